// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build integration

package integration

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var (
	fakeNVMLOnce sync.Once
	fakeNVMLDir  string
	fakeNVMLBin  string
	fakeNVMLErr  error
)

// removeFakeNVMLGuard removes the fakenvml build at the end of the run
// (the next run's sweep would otherwise find it, left behind).
func removeFakeNVMLGuard() {
	if fakeNVMLDir != "" {
		_ = os.RemoveAll(fakeNVMLDir)
	}
}

// fakeNVMLGuard builds nri-gpu-guard with the fakenvml tag once per run: the
// daemon under test, whose observer's NVML is go-nvml's mock fed by a JSON
// file (cmd/nri-gpu-guard/fakenvml.go). Everything else is the release code.
func fakeNVMLGuard(t *testing.T) string {
	t.Helper()
	fakeNVMLOnce.Do(func() {
		dir, err := newTempDir()
		if err != nil {
			fakeNVMLErr = err
			return
		}
		fakeNVMLDir = dir
		fakeNVMLBin = filepath.Join(dir, "nri-gpu-guard-fakenvml")
		cmd := exec.Command("go", "build", "-tags", "nri_no_wasm fakenvml", "-o", fakeNVMLBin, "./cmd/nri-gpu-guard")
		cmd.Dir = RepoRoot
		cmd.Env = append(os.Environ(), "CGO_ENABLED=1", "CGO_CFLAGS=-O2 -Wno-deprecated-declarations")
		if out, err := cmd.CombinedOutput(); err != nil {
			fakeNVMLErr = fmt.Errorf("build the fakenvml guard: %w\n%s", err, out)
		}
	})
	require.NoError(t, fakeNVMLErr)
	return fakeNVMLBin
}

// fakeNVML is the file the fake NVML reads: which pids run on which GPU.
type fakeNVML struct {
	path string
	gpus []string
	pids map[string][]int
}

func (f *fakeNVML) put(t *testing.T, gpu string, pid int) {
	t.Helper()
	f.pids[gpu] = append(f.pids[gpu], pid)
	f.write(t)
}

// write replaces the file (rename: the guard never reads half a file).
func (f *fakeNVML) write(t *testing.T) {
	t.Helper()
	type entry struct {
		UUID string `json:"uuid"`
		Pids []int  `json:"pids"`
	}
	var doc struct {
		GPUs []entry `json:"gpus"`
	}
	for _, u := range f.gpus {
		doc.GPUs = append(doc.GPUs, entry{UUID: u, Pids: append([]int{}, f.pids[u]...)})
	}
	data, err := json.Marshal(doc)
	require.NoError(t, err)
	tmp := f.path + ".tmp"
	require.NoError(t, os.WriteFile(tmp, data, 0o600))
	require.NoError(t, os.Rename(tmp, f.path))
}

// observeFile is what the test reads of the daemon's observe.json.
type observeFile struct {
	Time     time.Time `json:"time"`
	Findings []struct {
		Kind        string `json:"kind"`
		PID         int    `json:"pid"`
		ContainerID string `json:"container_id"`
		Holder      string `json:"holder"`
		Device      struct {
			Index string `json:"index"`
			UUID  string `json:"uuid"`
		} `json:"device"`
		Message string `json:"message"`
	} `json:"findings"`
}

// TestUncheckedContainerIsAnIntruder: containers created while the plugin
// was down never go unseen. A holds GPU 1 through the guard; with the guard
// stopped, B is created on GPU 1 (containerd admits it unchecked) and C,
// whose spec names no GPU, reaches GPU 2 another way (the fake NVML lists
// its process there). Once the guard is back, B is a conflict (Synchronize)
// and an intruder, and C, whom the runtime's state cannot reveal, an
// intruder: in the daemon's log, the audit log, the metrics and
// `gpu-guard-ctl status` (exit 3).
func TestUncheckedContainerIsAnIntruder(t *testing.T) {
	bin := fakeNVMLGuard(t)
	c := SharedContainerd(t)
	nv := &fakeNVML{path: filepath.Join(c.uniqueFile("fakenvml"), "nvml.json"), pids: map[string][]int{}}
	require.NoError(t, os.MkdirAll(filepath.Dir(nv.path), 0o700))
	for _, g := range c.GPUs {
		nv.gpus = append(nv.gpus, g.UUID)
	}
	nv.write(t) // no process anywhere yet
	env := NewGuardEnv(t, GuardOptions{Bin: bin, Env: []string{"NRI_GPU_GUARD_FAKE_NVML=" + nv.path},
		Extra: "[observe]\ninterval = \"1s\"\n"})
	g := env.G
	gpu1, gpu2 := c.GPUs[1], c.GPUs[2]

	a := c.RunPod(t, PodSpec{Name: "observe-a"})
	aID := a.Run(t, ContainerSpec{Name: worker, Env: GPUEnv("1")})
	nv.put(t, gpu1.UUID, containerPid(t, c, aID)) // the holder on its GPU: no finding

	g.Stop(t)
	b := c.RunPod(t, PodSpec{Name: "observe-b"})
	bID := b.Run(t, ContainerSpec{Name: worker, Env: GPUEnv("1")})
	cp := c.RunPod(t, PodSpec{Name: "observe-c"})
	cID := cp.Run(t, ContainerSpec{Name: worker})
	bPid, cPid := containerPid(t, c, bID), containerPid(t, c, cID)
	nv.put(t, gpu1.UUID, bPid)
	nv.put(t, gpu2.UUID, cPid)
	g.Start(t)

	// observe.json, written by the daemon after each pass.
	var f observeFile
	waitFor(t, 30*time.Second, "the observer's report with both intruders", func() (bool, string) {
		data, err := os.ReadFile(filepath.Join(g.StateDir, "observe.json"))
		if err != nil {
			return false, err.Error()
		}
		f = observeFile{}
		if err := json.Unmarshal(data, &f); err != nil {
			return false, err.Error()
		}
		return len(f.Findings) == 2, string(data)
	})
	byPid := map[int]int{}
	for i, fd := range f.Findings {
		byPid[fd.PID] = i
	}
	require.Contains(t, byPid, bPid)
	require.Contains(t, byPid, cPid)
	fb, fc := f.Findings[byPid[bPid]], f.Findings[byPid[cPid]]
	assert.Equal(t, "intruder", fb.Kind)
	assert.Equal(t, bID, fb.ContainerID, "mapped through the real /proc/PID/cgroup")
	assert.Equal(t, aID, fb.Holder)
	assert.Equal(t, gpu1.UUID, fb.Device.UUID)
	assert.Contains(t, fb.Message, "held by "+a.Owner(worker))
	assert.Equal(t, "intruder", fc.Kind)
	assert.Equal(t, cID, fc.ContainerID)
	assert.Empty(t, fc.Holder)
	assert.Contains(t, fc.Message, "which is free")

	// status: the conflict from Synchronize and both intruders; exit 3.
	out, err := g.TryCtl("status", "-o", "json")
	require.Equal(t, statusAttention, exitCode(err), "status exits 3: %v", err)
	var st struct {
		Problems []struct {
			Kind        string `json:"kind"`
			ContainerID string `json:"container_id"`
			Pid         int    `json:"pid"`
			Message     string `json:"message"`
		} `json:"problems"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &st), out)
	kinds := map[string][]string{}
	for _, p := range st.Problems {
		kinds[p.Kind] = append(kinds[p.Kind], p.ContainerID)
	}
	assert.ElementsMatch(t, []string{bID}, kinds["conflict"], out)
	assert.ElementsMatch(t, []string{bID, cID}, kinds["intruder"], out)

	// The daemon's log names pid, container and device, once per finding.
	log, err := os.ReadFile(g.LogPath)
	require.NoError(t, err)
	type seen struct {
		pid     int
		id, gpu string
	}
	for _, want := range []seen{{bPid, bID, gpu1.UUID}, {cPid, cID, gpu2.UUID}} {
		line := fmt.Sprintf(`"msg":"GPU process not admitted by the guard","component":"observe","kind":"intruder","pid":%d,`, want.pid)
		assert.Equal(t, 1, strings.Count(string(log), line), "logged once: %s", line)
		assert.Contains(t, string(log), `"container_id":"`+want.id+`"`)
		assert.Contains(t, string(log), `"device_uuid":"`+want.gpu+`"`)
	}

	// Audit records and the per-device gauge.
	audit, err := os.ReadFile(filepath.Join(g.StateDir, "audit.log"))
	require.NoError(t, err)
	assert.Equal(t, 2, strings.Count(string(audit), `"op":"intruder"`), string(audit))
	// A bounded client: a daemon that stops answering fails the test
	// instead of hanging it until go test's own timeout.
	cl := http.Client{Timeout: cmdTimeout}
	resp, err := cl.Get("http://" + g.MetricsAddr + "/metrics")
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
	for _, gpu := range []string{gpu1.UUID, gpu2.UUID} {
		assert.Regexp(t, `nri_gpu_guard_intruders\{device_index="\d+",device_uuid="`+gpu+`"\} 1`, string(body))
	}
}
