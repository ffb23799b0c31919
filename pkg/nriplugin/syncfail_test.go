// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// syncResult waits for the plugin's answer to the runtime's Synchronize.
func syncResult(t *testing.T, rt *runtime) error {
	t.Helper()
	select {
	case err := <-rt.syncs:
		return err
	case <-time.After(30 * time.Second):
		t.Fatal("no Synchronize within 30s")
		return nil
	}
}

// gaugeRecorder records what the plugin shows through Gauges.
type gaugeRecorder struct {
	mu         sync.Mutex
	rebuilding bool
	due        int
}

func (g *gaugeRecorder) SetRebuilding(on bool) { g.mu.Lock(); g.rebuilding = on; g.mu.Unlock() }

func (g *gaugeRecorder) SetReleasesDue(n int) { g.mu.Lock(); g.due = n; g.mu.Unlock() }

func (g *gaugeRecorder) isRebuilding() bool { g.mu.Lock(); defer g.mu.Unlock(); return g.rebuilding }

// A plugin launched by containerd whose Synchronize cannot reconcile the
// ledger (here: the ledger lock is held past the request's budget, as by a
// gpu-guard-ctl command running while containerd starts) must not answer
// with an error: containerd would stop it for good (pre-installed plugins
// are relaunched only when containerd restarts) and GPU containers would be
// created unchecked. It answers, refuses GPU containers (naming the lock's
// holder), lets the others through, and rebuilds the ledger from the
// containers containerd listed as soon as the lock is free: the running
// holder is adopted, the waiter of a pod gone meanwhile is dropped.
func TestLaunchedPluginSurvivesAFailedSync(t *testing.T) {
	rt := newRuntime(t, nil)
	podA, gone, podB := rt.addPod("a"), rt.addPod("gone"), rt.addPod("b")
	// Before containerd restarted: a holder of GPU 1 runs and a container
	// of another pod waits for it.
	first := rt.startPlugin()
	holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, holder))
	rt.start(podA, holder, 4242)
	require.Error(t, rt.create(gone, container(gone, "main", "gone-1", "NVIDIA_VISIBLE_DEVICES=1")))
	require.Len(t, rt.waiters(), 1)
	first.stub.Stop()
	rt.mu.Lock()
	delete(rt.pods, gone.Id) // removed while the plugin was away
	rt.mu.Unlock()

	lk := rt.lockLedger()
	rt.syncs = make(chan error, 16)
	gauges := &gaugeRecorder{}
	waitReady, _ := runPluginNoWait(t, rt, func(p *Plugin) { p.forceInPlace, p.gauges = true, gauges })
	require.NoError(t, syncResult(t, rt), "a launched plugin answers a failed reconcile without an error: containerd would kill it")
	rt.registered()
	assert.True(t, gauges.isRebuilding(), "the rebuild is shown")

	err := rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=2"))
	require.Error(t, err, "no GPU container is created unchecked while the ledger is not reconciled")
	assert.Contains(t, err.Error(), "being rebuilt")
	assert.Contains(t, err.Error(), "held by pid", "the refusal names the ledger error: here, who holds the lock")
	require.NoError(t, rt.create(podB, container(podB, "web", "web-1")), "a container without a GPU is let through")

	require.NoError(t, lk.Unlock())
	waitReady(true)
	assert.False(t, gauges.isRebuilding())
	assert.Equal(t, map[string]string{"1": holder.Id}, rt.holders(), "the running holder was adopted from containerd's list")
	assert.Empty(t, rt.waiters(), "the waiter of the pod gone meanwhile was dropped, as the Synchronize would have")
	err = rt.create(podB, container(podB, "main", "b-2", "NVIDIA_VISIBLE_DEVICES=1"))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "is held by ml/a/main")
	require.NoError(t, rt.create(podB, container(podB, "main", "b-3", "NVIDIA_VISIBLE_DEVICES=2")))
}

// The rebuild after a failed Synchronize ends with the plugin: Run returns
// once its context is done, while the ledger lock is still held.
func TestFailedSyncRetryStopsWithThePlugin(t *testing.T) {
	rt := newRuntime(t, nil)
	rt.startPlugin().stub.Stop() // the ledger exists
	lk := rt.lockLedger()
	t.Cleanup(func() { _ = lk.Unlock() })
	rt.syncs = make(chan error, 16)
	_, stop := runPluginNoWait(t, rt, func(p *Plugin) { p.forceInPlace = true })
	require.NoError(t, syncResult(t, rt))
	stop() // fails the test if Run does not return
}
