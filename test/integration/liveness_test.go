// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build integration

package integration

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// containerPid is the host pid of a running container's process.
func containerPid(t *testing.T, c *Containerd, id string) int {
	t.Helper()
	out, err := c.Crictl("inspect", "--output", "go-template", "--template", "{{.info.pid}}", id)
	require.NoError(t, err)
	pid, err := strconv.Atoi(strings.TrimSpace(out))
	require.NoError(t, err, "crictl inspect pid of %s: %q", shortID(id), out)
	require.Positive(t, pid)
	return pid
}

// parentPid is field 4 of /proc/PID/stat.
func parentPid(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	require.NoError(t, err)
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	ppid, err := strconv.Atoi(f[1])
	require.NoError(t, err)
	return ppid
}

// cgroupEmpty reads the kernel's own answer for a container's cgroup: on
// cgroup v2 "populated" of cgroup.events, on v1 the pids hierarchy's
// cgroup.procs. The cgroup must exist.
func cgroupEmpty(t *testing.T, cgroup string) (bool, string) {
	t.Helper()
	if cgroupMode() == "v2" {
		ev, err := os.ReadFile(filepath.Join("/sys/fs/cgroup", cgroup, "cgroup.events"))
		require.NoError(t, err, "the cgroup stays while the shim is frozen")
		return strings.Contains(string(ev), "populated 0\n"), string(ev)
	}
	procs, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/pids", cgroup, "cgroup.procs"))
	require.NoError(t, err, "the cgroup stays while the shim is frozen")
	return strings.TrimSpace(string(procs)) == "", "cgroup.procs: " + string(procs)
}

// statusDevice is GPU index i as `gpu-guard-ctl status -o json` shows it.
type statusDevice struct {
	Index  string `json:"index"`
	Holder *struct {
		ContainerID string `json:"container_id"`
	} `json:"holder"`
	Stale string `json:"stale"`
}

// The second result is status's exit code: 0, or 3 (attention: a stale
// claim), which still prints the status; any other failure is one.
func deviceStatus(t *testing.T, g *Guard, i int) (statusDevice, int) {
	t.Helper()
	out, err := g.TryCtl("status", "-o", "json")
	code := exitCode(err)
	if code != 0 && code != statusAttention {
		t.Fatalf("gpu-guard-ctl status: %v", err)
	}
	var st struct {
		Devices []statusDevice `json:"devices"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &st), "status output: %s", out)
	for _, d := range st.Devices {
		if d.Index == strconv.Itoa(i) {
			return d, code
		}
	}
	t.Fatalf("GPU %d not in the status: %s", i, out)
	return statusDevice{}, code
}

// TestExitedHolderIsSeenThroughItsCgroup: the holder's process dies while
// its runtime cannot report it (its shim is frozen, so neither NRI
// StopContainer nor runc's cgroup removal happens). The guard's liveness
// check, reading the real cgroup hierarchy (v1, or v2 under cgroup2.sh),
// sees the holder's cgroup empty: `gpu-guard-ctl status` marks the claim
// stale with that reason, and the next request for the GPU is admitted
// instead of refused.
func TestExitedHolderIsSeenThroughItsCgroup(t *testing.T) {
	env := NewGuardEnv(t, GuardOptions{})
	c, g := env.C, env.G
	a := c.RunPod(t, PodSpec{Name: "liveness-a"})
	aID := a.Run(t, ContainerSpec{Name: worker, Env: GPUEnv("0")})
	pid := containerPid(t, c, aID)
	shim := parentPid(t, pid)

	d, code := deviceStatus(t, g, 0)
	require.NotNil(t, d.Holder)
	assert.Equal(t, aID, d.Holder.ContainerID)
	assert.Empty(t, d.Stale, "a running holder is not stale")
	assert.Equal(t, 0, code, "status of a running holder needs no attention")

	require.NoError(t, syscall.Kill(shim, syscall.SIGSTOP), "freeze the shim (pid %d)", shim)
	t.Cleanup(func() { _ = syscall.Kill(shim, syscall.SIGCONT) })
	require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
	waitFor(t, waitTimeout, "the holder's process to exit", func() (bool, string) {
		return !processExists(pid), fmt.Sprintf("pid %d", pid)
	})

	// The killed process's leader shows as a zombie as soon as its own
	// thread exited; its other threads leave the cgroup a moment later, and
	// with the shim frozen nobody reaps it. Wait on the kernel's view.
	cgroup := "/k8s.io/" + aID
	waitFor(t, waitTimeout, "the holder's cgroup to be empty", func() (bool, string) {
		return cgroupEmpty(t, cgroup)
	})
	d, code = deviceStatus(t, g, 0)
	require.NotNil(t, d.Holder, "no stop reached the guard")
	assert.Equal(t, aID, d.Holder.ContainerID)
	assert.Equal(t, "cgroup "+cgroup+" has no processes", d.Stale)
	assert.Equal(t, statusAttention, code, "a stale claim needs attention")

	b := c.RunPod(t, PodSpec{Name: "liveness-b"})
	bID := b.Run(t, ContainerSpec{Name: worker, Env: GPUEnv("0")})
	assert.Equal(t, bID, g.Holder(t, 0), "the exited holder's GPU went to the next request")

	// Let the runtime catch up before the test's pods are removed.
	require.NoError(t, syscall.Kill(shim, syscall.SIGCONT))
	waitFor(t, waitTimeout, "containerd to see the holder exited", func() (bool, string) {
		st := c.ContainerState(t, aID)
		return st == "CONTAINER_EXITED", st
	})
	t.Logf("cgroup %s: the exited holder was released through its cgroup %s", cgroupMode(), cgroup)
}
