// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build integration

package integration

import (
	"fmt"
	"os"
	"sort"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// assertLedgerMatchesRuntime checks the reconcile rule: the ledger's claims
// are exactly the live (CREATED/RUNNING) containers that reach a GPU, each
// on the GPUs it names. want maps container id to the GPU UUIDs it reaches.
func assertLedgerMatchesRuntime(t *testing.T, c *Containerd, g *Guard, want map[string][]string) {
	t.Helper()
	live := c.LiveContainers(t)
	for id := range want {
		assert.Contains(t, live, id, "container %s should be live in crictl ps", shortID(id))
	}
	got := g.ClaimsByContainer(t)
	for id := range got {
		sort.Strings(got[id])
		assert.Contains(t, live, id, "claim of %s, which crictl ps does not list as live", shortID(id))
	}
	assert.Equal(t, want, got, "ledger claims")
}

// TestPluginRestartReconcilesWithRuntime: the plugin crashes (SIGKILL) while
// containers run; meanwhile one holder is removed and a GPU container is
// created unchecked. After the restart's Synchronize the ledger equals what
// crictl ps shows: the removed holder's claim is released (its GPU is
// admitted again), the unchecked container's GPU is adopted, and the
// surviving holder still blocks others.
func TestPluginRestartReconcilesWithRuntime(t *testing.T) {
	env := NewGuardEnv(t, GuardOptions{})
	c, g := env.C, env.G
	gpu0, gpu1, gpu2 := c.GPUs[0], c.GPUs[1], c.GPUs[2]

	a := c.RunPod(t, PodSpec{Name: "restart-a"})
	aID := a.Run(t, ContainerSpec{Name: worker, Env: GPUEnv("0")})
	b := c.RunPod(t, PodSpec{Name: "restart-b"})
	bID := b.Run(t, ContainerSpec{Name: worker, Env: GPUEnv("1")})
	assertLedgerMatchesRuntime(t, c, g, map[string][]string{aID: {gpu0.UUID}, bID: {gpu1.UUID}})

	g.Kill(t)
	// While the guard is down (and no validator requires it on this
	// containerd) the runtime goes on without it.
	c.RemoveContainer(t, bID)
	u := c.RunPod(t, PodSpec{Name: "restart-unchecked"})
	uID := u.Run(t, ContainerSpec{Name: worker, Env: GPUEnv("2")})

	g.Start(t) // ready = registered and synchronized
	assertLedgerMatchesRuntime(t, c, g, map[string][]string{aID: {gpu0.UUID}, uID: {gpu2.UUID}})

	// B's GPU is free again; A's and the adopted one are not.
	e := c.RunPod(t, PodSpec{Name: "restart-e"})
	eID := e.Run(t, ContainerSpec{Name: worker, Env: GPUEnv("1")})
	assert.Equal(t, eID, g.Holder(t, 1))
	f := c.RunPod(t, PodSpec{Name: "restart-f"})
	assert.Contains(t, f.Refused(t, ContainerSpec{Name: worker, Env: GPUEnv("0")}), gpuName(gpu0)+" is held by "+a.Owner(worker))
	assert.Contains(t, f.Refused(t, ContainerSpec{Name: "other", Env: GPUEnv("2")}), gpuName(gpu2)+" is held by "+u.Owner(worker))
}

// pidsWithExe lists the processes running the executable at path.
func pidsWithExe(path string) []int {
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if exe, err := os.Readlink("/proc/" + e.Name() + "/exe"); err == nil && exe == path && processExists(pid) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// TestPausedHolderKeepsGPUAcrossContainerdRestart: containerd cannot load a
// paused task after a restart and lists its container as CONTAINER_UNKNOWN,
// which NRI's Synchronize leaves out, although the container still holds its
// GPU. The guard keeps the claim (its cgroup still has processes) and
// refuses the next container asking for that GPU, instead of releasing the
// claim as stale.
func TestPausedHolderKeepsGPUAcrossContainerdRestart(t *testing.T) {
	c, g := startWithPreinstalledGuard(t)
	gpu0 := c.GPUs[0]
	a := c.RunPod(t, PodSpec{Name: "unknown-a"})
	aID := a.Run(t, ContainerSpec{Name: worker, Env: GPUEnv("0")})
	_, err := c.Ctr("task", "pause", aID)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = c.Ctr("task", "resume", aID) })

	c.Restart(t)
	require.Equal(t, "CONTAINER_UNKNOWN", c.ContainerState(t, aID), "the restarted containerd must hide the paused container from Synchronize")
	assert.Equal(t, map[string][]string{aID: {gpu0.UUID}}, g.ClaimsByContainer(t), "the paused holder keeps its claim")
	b := c.RunPod(t, PodSpec{Name: "unknown-b"})
	assert.Contains(t, b.Refused(t, ContainerSpec{Name: worker, Env: GPUEnv("0")}), gpuName(gpu0)+" is held by "+a.Owner(worker))
	assert.Contains(t, g.Ctl(t, "audit"), "unlisted", "keeping an unlisted holder is audited")
}

// TestPreinstalledPluginSurvivesContainerdRestart: the guard pre-installed
// under plugin_path (configured by the NRI conf.d file) is launched by
// containerd, exits with it, is relaunched by the next containerd, and the
// ledger (claims and queue) carries on across the restart.
func TestPreinstalledPluginSurvivesContainerdRestart(t *testing.T) {
	c, g := startWithPreinstalledGuard(t)
	pluginID := guardPluginIndex + "-" + guardPluginName
	syncedLine := fmt.Sprintf("pre-installed NRI plugin %q synchronization success", pluginID)
	// containerd starts and synchronizes pre-installed plugins before CRI
	// serves, so the outcome is in its log by now.
	requireSynced := func(from int64) {
		t.Helper()
		ok, related := c.logged(from, syncedLine, "pre-installed NRI plugin", logEscape(fmt.Sprintf("%q", pluginID)))
		require.True(t, ok, "containerd did not synchronize the pre-installed guard; its log says:\n%s", related)
	}
	requireSynced(0)
	require.Len(t, pidsWithExe(g.PluginExe()), 1, "containerd launched the plugin")
	gpu0 := c.GPUs[0]

	a := c.RunPod(t, PodSpec{Name: "preinstalled-a"})
	aID := a.Run(t, ContainerSpec{Name: worker, Env: GPUEnv("0")})
	b := c.RunPod(t, PodSpec{Name: "preinstalled-b"})
	want := ContainerSpec{Name: worker, Env: GPUEnv(gpu0.UUID)}
	assert.Contains(t, b.Refused(t, want), gpuName(gpu0)+" is held by "+a.Owner(worker))

	from := c.logOffset()
	oldPids := pidsWithExe(g.PluginExe())
	require.NoError(t, c.Stop())
	// A launched plugin cannot reconnect: it must exit with its containerd
	// rather than linger.
	waitFor(t, waitTimeout, "the launched plugin to exit with containerd", func() (bool, string) {
		left := pidsWithExe(g.PluginExe())
		return len(left) == 0, fmt.Sprint(left)
	})
	require.NoError(t, c.Start())
	requireSynced(from)
	newPids := pidsWithExe(g.PluginExe())
	require.Len(t, newPids, 1)
	assert.NotEqual(t, oldPids, newPids, "a new plugin process")

	assert.Equal(t, "CONTAINER_RUNNING", c.ContainerState(t, aID), "containers outlive containerd")
	assert.Equal(t, map[string][]string{aID: {gpu0.UUID}}, g.ClaimsByContainer(t), "claims survive")
	assert.Contains(t, b.Refused(t, want), "position 1 of 1", "the queue survives")

	c.StopContainer(t, aID)
	g.WaitHolder(t, 0, "")
	bID := b.Run(t, want)
	assert.Equal(t, map[string][]string{bID: {gpu0.UUID}}, g.ClaimsByContainer(t))
}

// TestPreinstalledPluginRebuildsAfterReset: an operator forgets a running
// holder's claim (gpu-guard-ctl release --force) and resets the ledger
// (recover --reset --force: the ledger is healthy) while that GPU container runs under a guard
// launched by containerd, which gets no new Synchronize until containerd
// restarts. The guard refuses the create that finds the new ledger,
// rebuilds it in place from the containers it tracks, and the running
// holder blocks its GPU again: nothing is admitted onto it meanwhile.
func TestPreinstalledPluginRebuildsAfterReset(t *testing.T) {
	c, g := startWithPreinstalledGuard(t)
	gpu0 := c.GPUs[0]
	a := c.RunPod(t, PodSpec{Name: "reset-a"})
	aID := a.Run(t, ContainerSpec{Name: worker, Env: GPUEnv("0")})
	plugin := pidsWithExe(g.PluginExe())
	require.Len(t, plugin, 1, "containerd launched the plugin")

	// A forced reset keeps the claims of holders still running.
	g.Ctl(t, "recover", "--reset", "--force", "--no-runtime", "--reason", "integration test")
	require.Contains(t, g.ClaimsByContainer(t), aID, "a forced reset keeps the claim of a holder still running")
	// The operator releases the running holder's claim by force (the
	// ledger then forgets it, as a reset used to), and resets again.
	g.Ctl(t, "release", "--container", aID, "--force", "--reason", "integration test")
	g.Ctl(t, "recover", "--reset", "--force", "--no-runtime", "--reason", "integration test")
	require.Empty(t, g.ClaimsByContainer(t), "the ledger forgot the running holder")

	b := c.RunPod(t, PodSpec{Name: "reset-b"})
	want := ContainerSpec{Name: worker, Env: GPUEnv(gpu0.UUID)}
	first := b.Refused(t, want)
	assert.NotContains(t, first, "is held by", "the create that finds the new ledger is refused before any decision: %s", first)
	g.WaitHolder(t, 0, aID)
	assert.Contains(t, b.Refused(t, want), gpuName(gpu0)+" is held by "+a.Owner(worker))
	assert.Equal(t, plugin, pidsWithExe(g.PluginExe()), "the same plugin process: containerd was not restarted")
}

// startWithPreinstalledGuard starts a containerd that launches the guard
// itself (pre-installed under plugin_path), as a package installs it.
func startWithPreinstalledGuard(t *testing.T) (*Containerd, *Guard) {
	t.Helper()
	var g *Guard
	c := StartContainerd(t, ContainerdOptions{BeforeStart: func(c *Containerd) error {
		var err error
		g, err = InstallGuard(c, GuardOptions{})
		return err
	}})
	return c, g
}
