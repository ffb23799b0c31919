// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// Under release_on = "remove" the claim of a stopped container passes to
// any container of its pod, not only to a restart of the same name: the
// device plugin gives an app container the devices of the pod's init
// containers, and the kubelet keeps a finished init container until the
// pod goes, so the pod's own app container used to queue behind it for
// good. A running container of the pod is never taken over, and another
// pod still waits for the removal.
func TestStoppedClaimPassesToAnyContainerOfThePod(t *testing.T) {
	mutate := func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove }
	initC := ctr("ml", "train", "init-check", "init000000000001")
	app := ctr("ml", "train", "app", "app0000000000001")
	sidecar := ctr("ml", "train", "sidecar", "side000000000001")
	other := ctr("ml", "other", "app", "other00000000001")

	t.Run("a finished init container's GPU goes to the app container", func(t *testing.T) {
		e := newEnv(t, mutate)
		require.Equal(t, guard.Admit, e.admit(initC, visible("1")).Result)
		require.NoError(t, e.g.Started(ctx, initC.ContainerID, 1001, "/k8s.io/"+initC.ContainerID))
		require.NoError(t, e.g.Stopped(ctx, initC))

		d := e.admit(other, visible("1"))
		require.Equal(t, guard.Queue, d.Result, "another pod waits for the removal: %s", d.Message)
		require.NoError(t, e.g.Withdraw(ctx, guard.RequesterKey(other), "test"))

		d = e.admit(app, visible("1"))
		require.Equal(t, guard.Admit, d.Result, d.Message)
		assert.Equal(t, "takeover", d.Reason)
		assert.Equal(t, map[string]string{uuid(1): app.ContainerID}, e.holders())
		assert.Len(t, e.audit(ledger.OpTakeover), 1)

		// The pod's removal of the init container ends nothing of the app's.
		require.NoError(t, e.g.Removed(ctx, initC))
		assert.Equal(t, map[string]string{uuid(1): app.ContainerID}, e.holders())
	})

	t.Run("an init container found exited without a stop event", func(t *testing.T) {
		e := newEnv(t, mutate)
		require.Equal(t, guard.Admit, e.admit(initC, visible("1")).Result)
		require.NoError(t, e.g.Started(ctx, initC.ContainerID, 1001, "/k8s.io/"+initC.ContainerID))
		e.live.exited[initC.ContainerID] = true
		d := e.admit(app, visible("1"))
		require.Equal(t, guard.Admit, d.Result, d.Message)
		assert.Equal(t, "takeover", d.Reason)
	})

	t.Run("a running container of the pod is never taken over", func(t *testing.T) {
		e := newEnv(t, mutate)
		require.Equal(t, guard.Admit, e.admit(sidecar, visible("1")).Result)
		require.NoError(t, e.g.Started(ctx, sidecar.ContainerID, 1002, "/k8s.io/"+sidecar.ContainerID))
		d := e.admit(app, visible("1"))
		require.Equal(t, guard.Queue, d.Result, d.Message)
		assert.Equal(t, map[string]string{uuid(1): sidecar.ContainerID}, e.holders())
	})

	t.Run("across the sandboxes of the pod", func(t *testing.T) {
		// The kubelet replaced the pod's sandbox: its containers run again
		// in the new one while the stopped ones of the old sandbox are kept
		// until the pod's garbage collection.
		e := newEnv(t, mutate)
		require.Equal(t, guard.Admit, e.admit(app, visible("1")).Result)
		require.NoError(t, e.g.Stopped(ctx, app))
		rerun := initC
		rerun.ContainerID, rerun.PodSandboxID = "init000000000002", "sb-train-2"
		d := e.admit(rerun, visible("1"))
		require.Equal(t, guard.Admit, d.Result, d.Message)
		assert.Equal(t, "takeover", d.Reason)
		// The old sandbox goes: nothing of the new one's ends.
		require.NoError(t, e.g.PodGone(ctx, ledger.FrontEndNRI, app.PodUID, app.PodSandboxID))
		assert.Equal(t, map[string]string{uuid(1): rerun.ContainerID}, e.holders())
	})
}
