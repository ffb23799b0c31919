// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package ctl

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// writeObserveFile writes the daemon's observer report into the fixture.
func (f *fixture) writeObserveFile(t *testing.T, of observe.File) {
	t.Helper()
	require.NoError(t, observe.WriteFile(f.dir, of))
}

// TestStatusShowsObserverFindings: the daemon's last report adds each
// finding as a problem (exit 3) with its age and the container's names; an
// unhealthy device too.
func TestStatusShowsObserverFindings(t *testing.T) {
	f := newFixture(t)
	f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
		claim(t, tx, ownTrainer, "env", f.dev(t, uuidGPU1))
	})
	r := f.run(t, "status")
	require.Equal(t, ExitOK, r.code, "no report, no problem: %s", r.stdout)

	seen := now.Add(-4 * time.Second)
	gpu1 := observe.Device{Index: "1", UUID: uuidGPU1}
	gpu2 := observe.Device{Index: "2", UUID: uuidGPU2}
	f.writeObserveFile(t, observe.File{Time: seen, WrittenAt: seen, IntervalSeconds: 10,
		Findings: []observe.FileFinding{
			{Finding: observe.Finding{Kind: observe.KindIntruder, Device: gpu1, PID: 4242, ContainerID: idRogue, Holder: idTrainer,
				Message: "pid 4242 (container e5e5e5e5e5e5) runs on GPU 1 (" + uuidGPU1 + "), held by team-a/trainer-0/main"},
				Namespace: "team-x", Pod: "rogue", Container: "cuda"},
			{Finding: observe.Finding{Kind: observe.KindOutOfBounds, Device: gpu2, PID: 77, ContainerID: idTrainer,
				Message: "pid 77 of team-a/trainer-0/main runs on GPU 2"}},
		},
		Unhealthy: []observe.Finding{{Kind: observe.KindUnhealthy, Device: observe.Device{Index: "3", UUID: uuidGPU3}, Xid: 79,
			Time: now.Add(-2 * time.Minute), Message: "GPU 3 (" + uuidGPU3 + ") reported critical Xid 79"}},
	})
	r = f.run(t, "status")
	require.Equal(t, ExitAttention, r.code, r.stdout+r.stderr)
	assert.Contains(t, r.stdout, "ATTENTION (3)")
	assert.Contains(t, r.stdout, "pid 4242 (container e5e5e5e5e5e5) runs on GPU 1 ("+uuidGPU1+"), held by team-a/trainer-0/main [team-x/rogue/cuda] (seen 4s ago)")
	assert.Contains(t, r.stdout, "reported critical Xid 79 (seen 2m ago)")

	r = f.run(t, "status", "-o", "json")
	require.Equal(t, ExitAttention, r.code)
	var v struct {
		Problems []problem    `json:"problems"`
		Observer observerJSON `json:"observer"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	kinds := map[string]problem{}
	for _, p := range v.Problems {
		kinds[p.Kind] = p
	}
	require.Contains(t, kinds, "intruder")
	assert.Equal(t, 4242, kinds["intruder"].Pid)
	assert.Equal(t, idRogue, kinds["intruder"].ContainerID)
	assert.Equal(t, "1", kinds["intruder"].Index)
	require.NotNil(t, kinds["intruder"].SeenAt)
	assert.True(t, kinds["intruder"].SeenAt.Equal(seen))
	assert.Equal(t, uuidGPU2, kinds["out-of-bounds"].Device)
	assert.Equal(t, "3", kinds["unhealthy"].Index)
	assert.False(t, v.Observer.Stale)
	assert.InDelta(t, 4, v.Observer.AgeSeconds, 0.001)
	assert.Equal(t, 2, v.Observer.Findings)
}

// TestStatusDistrustsAStaleReport: a report older than three intervals is not
// shown as current: one observer-stale problem says so instead.
func TestStatusDistrustsAStaleReport(t *testing.T) {
	f := newFixture(t)
	old := now.Add(-5 * time.Minute)
	f.writeObserveFile(t, observe.File{Time: old, WrittenAt: old, IntervalSeconds: 10,
		Findings: []observe.FileFinding{{Finding: observe.Finding{Kind: observe.KindIntruder,
			Device: observe.Device{Index: "1", UUID: uuidGPU1}, PID: 1, Message: "pid 1 runs on GPU 1"}}}})
	r := f.run(t, "status")
	require.Equal(t, ExitAttention, r.code)
	assert.Contains(t, r.stdout, "ATTENTION (1)")
	assert.Contains(t, r.stdout, "the GPU observer's last report is 5m old (interval 10s): its findings are not shown; is nri-gpu-guard running?")
	assert.NotContains(t, r.stdout, "pid 1 runs")
}

// TestStatusReportsAnUnreadableReport: an observe.json that is there but
// cannot be read is a problem (exit 3, kind observer-unreadable), not the
// silence of a host without a daemon: the daemon writes it whole, so it was
// damaged or replaced, and the intruders and unhealthy GPUs it may list go
// unseen. Before, status printed a warning on stderr and exited 0, as if
// no daemon ran.
func TestStatusReportsAnUnreadableReport(t *testing.T) {
	for _, tc := range []struct {
		name  string
		write func(t *testing.T, path string)
		why   string
	}{
		{name: "does not parse", why: "does not parse", write: func(t *testing.T, path string) {
			require.NoError(t, os.WriteFile(path, []byte(`{"time":"2026-03-01T11:59:`), 0o600))
		}},
		{name: "symlink", why: "is a symlink", write: func(t *testing.T, path string) {
			target := filepath.Join(t.TempDir(), "observe.json")
			require.NoError(t, os.WriteFile(target, []byte(`{}`), 0o600))
			require.NoError(t, os.Symlink(target, path))
		}},
		{name: "too large", why: "is larger than", write: func(t *testing.T, path string) {
			require.NoError(t, os.WriteFile(path, []byte(strings.Repeat(" ", 2<<20)), 0o600))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			tc.write(t, filepath.Join(f.dir, observe.FileName))
			r := f.run(t, "status")
			require.Equal(t, ExitAttention, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			assert.Contains(t, r.stdout, "ATTENTION (1)")
			assert.Contains(t, r.stdout, "the GPU observer's report cannot be read (")
			assert.Contains(t, r.stdout, tc.why)
			assert.Contains(t, r.stdout, "): its findings are not shown")
			assert.Empty(t, r.stderr, "said once, in the output")

			r = f.run(t, "status", "-o", "json")
			require.Equal(t, ExitAttention, r.code, r.stderr)
			var v struct {
				Problems []problem       `json:"problems"`
				Observer json.RawMessage `json:"observer"`
			}
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
			require.Len(t, v.Problems, 1)
			assert.Equal(t, "observer-unreadable", v.Problems[0].Kind)
			assert.Contains(t, v.Problems[0].Message, tc.why)
			assert.Nil(t, v.Observer, "no report to summarise")
		})
	}
}

// psHost is go-nvml's DGX A100 mock as the ctl's NVML, with the fixture's
// inventory replaced by the mock's GPUs and a fake /proc tree.
type psHost struct {
	srv   *server.Server
	procs map[string][]nvml.ProcessInfo
	proc  string // the proc directory
}

func newPSHost(t *testing.T, f *fixture) *psHost {
	h := &psHost{srv: dgxa100.New(), procs: map[string][]nvml.ProcessInfo{}, proc: filepath.Join(t.TempDir(), "proc")}
	require.NoError(t, os.MkdirAll(h.proc, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(h.proc, "uptime"), []byte("1000.00 1.00\n"), 0o644))
	var gpus []devices.GPU
	for i, d := range h.srv.Devices {
		sd := d.(*server.Device)
		uuid := sd.UUID
		gpus = append(gpus, devices.GPU{Index: i, UUID: uuid, Minor: i})
		sd.GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return h.procs[uuid], nvml.SUCCESS }
		sd.GetGraphicsRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.ERROR_NOT_SUPPORTED }
	}
	inv, err := devices.NewInventory("nvml", gpus)
	require.NoError(t, err)
	f.inv = inv
	require.NoError(t, devices.SaveCache(filepath.Join(f.dir, devices.CacheFile), inv, bootID))
	return h
}

func (h *psHost) run(t *testing.T, gpu, pid int, cgroup string) {
	dir := filepath.Join(h.proc, fmt.Sprint(pid))
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "stat"),
		fmt.Appendf(nil, "%d (python) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 500 0 0\n", pid), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "cgroup"), []byte(cgroup), 0o644))
	uuid := h.srv.Devices[gpu].(*server.Device).UUID
	h.procs[uuid] = append(h.procs[uuid], nvml.ProcessInfo{Pid: uint32(pid), UsedGpuMemory: 3 << 30})
}

func (f *fixture) runPS(t *testing.T, h *psHost, args ...string) result {
	t.Helper()
	var stdout, stderr syncBuffer
	env := f.env(&stdout, &stderr)
	if h != nil {
		env.NVML, env.ProcRoot = h.srv, h.proc
	} else {
		env.NVML = failingNVML()
	}
	code := Run(context.Background(), append([]string{"--config", f.config, "ps"}, args...), env)
	return result{code: code, stdout: stdout.String(), stderr: stderr.String()}
}

// TestPS: ps lists every process NVML reports with its container and its
// verdict against the ledger, and exits 3 for an intruder.
func TestPS(t *testing.T) {
	f := newFixture(t)
	h := newPSHost(t, f)
	f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
		claim(t, tx, ownTrainer, "env", f.dev(t, h.srv.Devices[0].(*server.Device).UUID))
	})
	cg := func(id string) string {
		return "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-" + id + ".scope\n"
	}
	h.run(t, 0, 100, cg(idTrainer))
	h.run(t, 0, 200, cg(idRogue))
	h.run(t, 5, 300, "0::/user.slice/user-0.slice/session-1.scope\n")

	r := f.runPS(t, h)
	require.Equal(t, ExitAttention, r.code, r.stdout+r.stderr)
	lines := strings.Split(r.stdout, "\n")
	assert.Regexp(t, `^INDEX +UUID +PID +TYPE +MEMORY +CONTAINER +HOLDER +VERDICT$`, lines[0])
	assert.Regexp(t, `(?m)^0 +GPU-\S+ +100 +C +3072MiB +team-a/trainer-0/main +team-a/trainer-0/main +ok$`, r.stdout)
	assert.Regexp(t, `(?m)^0 +GPU-\S+ +200 +C +3072MiB +e5e5e5e5e5e5 +team-a/trainer-0/main +intruder$`, r.stdout)
	assert.Regexp(t, `(?m)^5 +GPU-\S+ +300 +C +3072MiB +host process +- +intruder$`, r.stdout)
	assert.Contains(t, r.stdout, "ATTENTION (2)")

	r = f.runPS(t, h, "-o", "json")
	require.Equal(t, ExitAttention, r.code)
	var v psView
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	require.Len(t, v.Devices, 8)
	require.NotNil(t, v.Devices[0].Holder)
	assert.Equal(t, idTrainer, v.Devices[0].Holder.ContainerID)
	require.Len(t, v.Devices[0].Processes, 2)
	assert.Equal(t, verdictIntruder, v.Devices[0].Processes[1].Verdict)
	assert.Equal(t, idRogue, v.Devices[0].Processes[1].ContainerID)
	assert.Len(t, v.Problems, 2)

	// Everyone where the ledger says: exit 0.
	delete(h.procs, h.srv.Devices[5].(*server.Device).UUID)
	h.procs[h.srv.Devices[0].(*server.Device).UUID] = h.procs[h.srv.Devices[0].(*server.Device).UUID][:1]
	r = f.runPS(t, h)
	require.Equal(t, ExitOK, r.code, r.stdout)
	assert.NotContains(t, r.stdout, "ATTENTION")
}

// TestPSWithoutNVML: a clear error, exit 1.
func TestPSWithoutNVML(t *testing.T) {
	f := newFixture(t)
	r := f.runPS(t, nil)
	require.Equal(t, ExitError, r.code)
	assert.Contains(t, r.stderr, "ps needs NVML to see the processes on the GPUs, and it is not available on this host (is the NVIDIA driver loaded? does nvidia-smi work?)")
	assert.Contains(t, r.stderr, "ERROR_LIBRARY_NOT_FOUND")
}
