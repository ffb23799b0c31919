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

// The kubelet's device manager splits an init container's devices between
// the app containers of its pod: an init container that held GPUs 1 and 2
// gives GPU 1 to app a and GPU 2 to app b. A takeover moves only the
// claims on the devices the new container asks for; it used to move every
// claim of the stopped predecessor, so a took GPU 2 too, b queued behind
// its running sibling for a GPU a never reaches, and status named a as
// GPU 2's holder.
func TestTakeoverMovesOnlyTheDevicesAskedFor(t *testing.T) {
	mutate := func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove }
	initC := ctr("ml", "train", "init", "init000000000001")
	a := ctr("ml", "train", "a", "appa000000000001")
	b := ctr("ml", "train", "b", "appb000000000001")
	other := ctr("ml", "other", "main", "other00000000001")

	// stoppedInit: the init container held spec, ran and stopped.
	stoppedInit := func(t *testing.T, spec string) *env {
		t.Helper()
		e := newEnv(t, mutate)
		require.Equal(t, guard.Admit, e.admit(initC, visible(spec)).Result)
		require.NoError(t, e.g.Started(ctx, initC.ContainerID, 1001, "/k8s.io/"+initC.ContainerID))
		require.NoError(t, e.g.Stopped(ctx, initC))
		return e
	}

	t.Run("an init container's GPUs split between two app containers", func(t *testing.T) {
		e := stoppedInit(t, "1,2")
		d := e.admit(a, visible("1"))
		require.Equal(t, guard.Admit, d.Result, d.Message)
		assert.Equal(t, "takeover", d.Reason)
		require.NoError(t, e.g.Started(ctx, a.ContainerID, 1002, "/k8s.io/"+a.ContainerID))
		assert.Equal(t, map[string]string{uuid(1): a.ContainerID, uuid(2): initC.ContainerID}, e.holders())
		recs := e.audit(ledger.OpTakeover)
		require.Len(t, recs, 1)
		assert.Equal(t, []string{uuid(1)}, recs[0].Devices, "the audit names what moved, and only that")
		assert.Equal(t, a.ContainerID, recs[0].ContainerID)

		// Another pod still waits for the init container's removal.
		d = e.admit(other, visible("2"))
		require.Equal(t, guard.Queue, d.Result, d.Message)
		assert.Contains(t, d.Message, "is held by ml/train/init (id init00000000)")
		require.NoError(t, e.g.Withdraw(ctx, guard.RequesterKey(other), "test"))

		d = e.admit(b, visible("2"))
		require.Equal(t, guard.Admit, d.Result, d.Message)
		assert.Equal(t, "takeover", d.Reason)
		assert.Equal(t, map[string]string{uuid(1): a.ContainerID, uuid(2): b.ContainerID}, e.holders())

		// The init container's removal ends nothing of its successors'.
		require.NoError(t, e.g.Removed(ctx, initC))
		assert.Equal(t, map[string]string{uuid(1): a.ContainerID, uuid(2): b.ContainerID}, e.holders())
	})

	t.Run("what no app container asks for stays with the init container until its removal", func(t *testing.T) {
		e := stoppedInit(t, "1,2")
		require.Equal(t, guard.Admit, e.admit(a, visible("1")).Result)
		require.NoError(t, e.g.Started(ctx, a.ContainerID, 1002, "/k8s.io/"+a.ContainerID))
		require.NoError(t, e.g.Removed(ctx, initC))
		assert.Equal(t, map[string]string{uuid(1): a.ContainerID}, e.holders())
		d := e.admit(other, visible("2"))
		require.Equal(t, guard.Admit, d.Result, d.Message)
	})

	t.Run("the pod's removal is the safety net for what stays", func(t *testing.T) {
		e := stoppedInit(t, "1,2")
		require.Equal(t, guard.Admit, e.admit(a, visible("1")).Result)
		require.NoError(t, e.g.PodGone(ctx, ledger.FrontEndNRI, initC.PodUID, initC.PodSandboxID))
		assert.Empty(t, e.holders())
	})

	t.Run("an undone create hands back what moved, nothing else", func(t *testing.T) {
		e := stoppedInit(t, "1,2")
		before := e.state().Claims
		require.Len(t, before, 2)
		require.Equal(t, "takeover", e.admit(a, visible("1")).Reason)
		// b takes GPU 2 over and starts; then a's create is undone.
		require.Equal(t, "takeover", e.admit(b, visible("2")).Reason)
		require.NoError(t, e.g.Started(ctx, b.ContainerID, 1003, "/k8s.io/"+b.ContainerID))
		require.NoError(t, e.g.Stopped(ctx, a))
		require.NoError(t, e.g.Removed(ctx, a))
		assert.Equal(t, map[string]string{uuid(1): initC.ContainerID, uuid(2): b.ContainerID}, e.holders())
		for _, c := range e.state().Claims {
			if c.Device.UUID == uuid(1) {
				assert.Equal(t, before[0], c, "GPU 1 back to the init container as it was")
			}
		}
		var back []ledger.AuditRecord
		for _, r := range e.audit(ledger.OpTakeover) {
			if r.ContainerID == initC.ContainerID {
				back = append(back, r)
			}
		}
		require.Len(t, back, 1)
		assert.Equal(t, []string{uuid(1)}, back[0].Devices)
		assert.Contains(t, back[0].Reason, "handed back from container "+a.ContainerID)
	})

	t.Run("a restart asking for the same GPUs takes everything over", func(t *testing.T) {
		e := stoppedInit(t, "1,2")
		restart := initC
		restart.ContainerID = "init000000000002"
		require.Equal(t, "takeover", e.admit(restart, visible("1,2")).Reason)
		assert.Equal(t, map[string]string{uuid(1): restart.ContainerID, uuid(2): restart.ContainerID}, e.holders())
	})

	t.Run("a restart asking for fewer GPUs takes over only those", func(t *testing.T) {
		e := stoppedInit(t, "1,2")
		restart := initC
		restart.ContainerID = "init000000000002"
		require.Equal(t, "takeover", e.admit(restart, visible("2")).Reason)
		assert.Equal(t, map[string]string{uuid(1): initC.ContainerID, uuid(2): restart.ContainerID}, e.holders())
		// The rest ends with the predecessor's removal.
		require.NoError(t, e.g.Removed(ctx, initC))
		assert.Equal(t, map[string]string{uuid(2): restart.ContainerID}, e.holders())
	})
}

// MIG: the takeover moves the predecessor's claims that would conflict with
// the request, a whole GPU against its instances and the reverse.
func TestTakeoverMovesWhatConflictsOnMIG(t *testing.T) {
	mutate := func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove }
	initC := ctr("ml", "train", "init", "init000000000001")
	a := ctr("ml", "train", "a", "appa000000000001")
	b := ctr("ml", "train", "b", "appb000000000001")
	for _, tc := range []struct {
		name           string
		init, a, b     string // the specs
		afterA, afterB map[string]string
	}{
		{
			name: "instances split between the apps", init: "3:0,3:1", a: "3:0", b: "3:1",
			afterA: map[string]string{migUUID(0): a.ContainerID, migUUID(1): initC.ContainerID},
			afterB: map[string]string{migUUID(0): a.ContainerID, migUUID(1): b.ContainerID},
		},
		{
			name: "the GPU whole moves with its instances", init: "3:0,3:1,2", a: "3", b: "2",
			afterA: map[string]string{migUUID(0): a.ContainerID, migUUID(1): a.ContainerID, uuid(2): initC.ContainerID, uuid(3): a.ContainerID},
			afterB: map[string]string{migUUID(0): a.ContainerID, migUUID(1): a.ContainerID, uuid(2): b.ContainerID, uuid(3): a.ContainerID},
		},
		{
			// The whole GPU's claim is what conflicts with an instance:
			// it moves (a second container on a GPU held whole is what
			// the guard prevents), and GPU 1 stays for b.
			name: "an instance asked for takes the whole GPU's claim", init: "3,1", a: "3:0", b: "1",
			afterA: map[string]string{uuid(1): initC.ContainerID, uuid(3): a.ContainerID, migUUID(0): a.ContainerID},
			afterB: map[string]string{uuid(1): b.ContainerID, uuid(3): a.ContainerID, migUUID(0): a.ContainerID},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, mutate)
			require.Equal(t, guard.Admit, e.admit(initC, visible(tc.init)).Result)
			require.NoError(t, e.g.Started(ctx, initC.ContainerID, 1001, "/k8s.io/"+initC.ContainerID))
			require.NoError(t, e.g.Stopped(ctx, initC))
			d := e.admit(a, visible(tc.a))
			require.Equal(t, guard.Admit, d.Result, d.Message)
			require.NoError(t, e.g.Started(ctx, a.ContainerID, 1002, "/k8s.io/"+a.ContainerID))
			assert.Equal(t, tc.afterA, e.holders())
			d = e.admit(b, visible(tc.b))
			require.Equal(t, guard.Admit, d.Result, d.Message)
			assert.Equal(t, tc.afterB, e.holders())
		})
	}
}

// A container that took over an instance of the GPU it asks for whole, and
// claimed the GPU, then had its create undone: the instance goes back to
// the predecessor, and the GPU's claim ends with it (two containers never
// hold one GPU, not even between the hand-back and the release).
func TestUndoneTakeoverOfAnInstanceHandsItBack(t *testing.T) {
	e := newEnv(t, func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove })
	initC := ctr("ml", "train", "init", "init000000000001")
	app := ctr("ml", "train", "app", "app0000000000001")
	require.Equal(t, guard.Admit, e.admit(initC, visible("3:0")).Result)
	require.NoError(t, e.g.Started(ctx, initC.ContainerID, 1001, "/k8s.io/"+initC.ContainerID))
	require.NoError(t, e.g.Stopped(ctx, initC))
	before := e.state().Claims
	d := e.admit(app, visible("3"))
	require.Equal(t, "takeover", d.Reason, d.Message)
	require.Equal(t, map[string]string{migUUID(0): app.ContainerID, uuid(3): app.ContainerID}, e.holders())
	require.NoError(t, e.g.Stopped(ctx, app))
	require.NoError(t, e.g.Removed(ctx, app))
	assert.Equal(t, before, e.state().Claims)
}
