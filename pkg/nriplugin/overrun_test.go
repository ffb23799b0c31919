// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"context"
	"testing"
	"time"

	"github.com/containerd/nri/pkg/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// Under the failure policy the plugin asks for (KeepConnected), a create
// that answers past the runtime's deadline fails without the plugin being
// dropped, and the runtime's undo (StopContainer, RemoveContainer) reaches
// the plugin while the create's handler still runs. Those handlers found the
// id untracked and ended nothing; the claim the create committed next was of
// a container that never existed (no process: the liveness check keeps it),
// and nothing ever released it. The create now sees that it was undone,
// releases what it claimed and refuses.
func TestCreateUndoneWhileItRunsLeavesNoClaim(t *testing.T) {
	rt := newRuntime(t, func(c *config.Config) { c.Ledger.LockTimeout = config.Duration{Duration: time.Minute} })
	pl := rt.startPlugin()
	entered := make(chan string, 16)
	pl.p.entered = func(h string) { entered <- h }
	pod := rt.addPod("a")
	ctr := container(pod, "main", "x-1", "NVIDIA_VISIBLE_DEVICES=0")

	err := createUndoneWhileItWaits(t, rt, pl, entered, pod, ctr)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "stopped or removed it while nri-gpu-guard decided its create")
	assert.Empty(t, rt.holders(), "the claim of a container that never existed is released")
	_, tracked := pl.p.trackedGuard(ctr.Id)
	assert.False(t, tracked)
}

// An exempt container's create undone while it ran (its exemption's audit
// record waited for the ledger) leaves nothing of it behind: not in the
// observer's exempt set, not waiting for a validation that will not come.
func TestExemptCreateUndoneWhileItRunsLeavesNothing(t *testing.T) {
	rt := newRuntime(t, func(c *config.Config) {
		c.Ledger.LockTimeout = config.Duration{Duration: time.Minute}
		c.Policy.ExemptNamespaces = []string{"monitoring"}
	})
	pl := rt.startPlugin()
	rec := &exemptRecorder{ids: map[string]bool{}}
	pl.p.exempt = rec
	pl.p.validates.Store(true)
	entered := make(chan string, 16)
	pl.p.entered = func(h string) { entered <- h }
	pod := rt.addPod("dcgm")
	pod.Namespace = "monitoring"
	ctr := container(pod, "exporter", "exporter-1", "NVIDIA_VISIBLE_DEVICES=all")

	_ = createUndoneWhileItWaits(t, rt, pl, entered, pod, ctr) // admitted or refused: what is left behind counts

	assert.Empty(t, rec.set(), "not in the observer's exempt set")
	pl.p.mu.Lock()
	_, waiting := pl.p.exemptAtCreate[ctr.Id]
	pl.p.mu.Unlock()
	assert.False(t, waiting, "no exemption waits for a validation")
}

// createUndoneWhileItWaits runs ctr's create while the ledger's lock is held
// (a stalled disk, a throttled daemon), undoes it as the runtime does once
// it gave up on it (StopContainer, RemoveContainer) while the handler waits,
// then lets the lock go, and returns the create's answer. entered receives
// the handlers' names as they start.
func createUndoneWhileItWaits(t *testing.T, rt *runtime, pl *plugin, entered chan string, pod *api.PodSandbox, ctr *api.Container) error {
	t.Helper()
	lk := rt.lockLedger()
	created := make(chan error, 1)
	go func() {
		_, _, err := pl.p.CreateContainer(context.Background(), pod, ctr)
		created <- err
	}()
	require.Equal(t, "CreateContainer", testwait.Receive(t, entered, "the create's handler"))
	_, err := pl.p.StopContainer(context.Background(), pod, ctr)
	require.NoError(t, err)
	require.NoError(t, pl.p.RemoveContainer(context.Background(), pod, ctr))
	require.NoError(t, lk.Unlock())
	return testwait.Receive(t, created, "the create's answer")
}
