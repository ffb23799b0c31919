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

// Under release_on = "remove" a container takes over the claim of a stopped
// container of its pod only when that admits it. A container refused for
// anything else leaves the predecessor's claim where it is (a refused NRI
// create's Stop and Remove are never seen, so a claim moved to it would stay
// with a container that never existed), and its refusal names both the
// predecessor and what else stands in the way.
//
// The pod's init container held MIG 3:0 and exited; the app container of
// the pod asks for GPU 3 (or 3:0) while something else is in the way too.
func TestRefusedContainerLeavesThePredecessorsClaim(t *testing.T) {
	initC := ctr("ml", "train", "init", "init000000000001")
	app := ctr("ml", "train", "app", "app0000000000001")
	other := ctr("ml", "other", "app", "other00000000001")
	for _, tc := range []struct {
		name  string
		setup func(e *env)
		spec  string
		words []string // besides the predecessor's claim
	}{
		{
			// Before the takeover, init's claim hides the keep: the keep
			// is looked for only where nothing holds the device.
			name: "the head of the queue waits for the GPU whole",
			setup: func(e *env) {
				d := e.admit(other, visible("3"))
				require.Equal(t, guard.Queue, d.Result, d.Message)
			},
			spec: "3",
			words: []string{"GPU 3 (" + uuid(3) + ") is kept for ml/other/app (id other0000000) (earlier in the queue, " +
				"first in line for GPU 3 (" + uuid(3) + "), which waits until the rest of it is free)"},
		},
		{
			name: "a container found running on the GPU whole",
			setup: func(e *env) {
				c := ctr("ml", "c", "main", "cccc000000000001")
				_, err := e.g.Reconcile(ctx, ledger.FrontEndNRI, []guard.Request{
					{FrontEnd: ledger.FrontEndNRI, Owner: initC, Spec: visible("3:0")},
					{FrontEnd: ledger.FrontEndNRI, Owner: c, Spec: visible("3")},
				})
				require.NoError(t, err)
				require.Len(t, e.state().Conflicts, 1)
			},
			spec:  "3:0",
			words: []string{"MIG 3:0 (" + migUUID(0) + ") is in use by ml/c/main (id cccc00000000) through GPU 3 (" + uuid(3) + ")"},
		},
		{
			name: "another device it asks for is reserved for another pod",
			setup: func(e *env) {
				x := ctr("ml", "x", "main", "xxxx000000000001")
				require.Equal(t, guard.Admit, e.admit(x, visible("2")).Result)
				require.Equal(t, guard.Queue, e.admit(other, visible("2")).Result)
				require.NoError(t, e.g.Removed(ctx, x))
			},
			spec:  "3:0,2",
			words: []string{"GPU 2 (" + uuid(2) + ") is reserved for ml/other/app (id other0000000)"},
		},
		{
			name: "another device it asks for is held by another pod",
			setup: func(e *env) {
				require.Equal(t, guard.Admit, e.admit(other, visible("2")).Result)
			},
			spec:  "3:0,2",
			words: []string{"GPU 2 (" + uuid(2) + ") is held by ml/other/app (id other0000000)"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove })
			require.Equal(t, guard.Admit, e.admit(initC, visible("3:0")).Result)
			require.NoError(t, e.g.Started(ctx, initC.ContainerID, 1001, "/k8s.io/"+initC.ContainerID))
			require.NoError(t, e.g.Stopped(ctx, initC))
			tc.setup(e)
			before := e.holders()
			require.Equal(t, initC.ContainerID, before[migUUID(0)])

			d := e.admit(app, visible(tc.spec))
			require.Equal(t, guard.Queue, d.Result, d.Message)
			assert.Equal(t, before, e.holders(), "the refused container took the predecessor's claim")
			assert.Empty(t, e.audit(ledger.OpTakeover))
			assert.Contains(t, d.Message, "is held by ml/train/init (id init00000000)", "the predecessor keeps its claim and is named")
			for _, w := range tc.words {
				assert.Contains(t, d.Message, w)
			}

			// The refused create is undone: its stop and removal end
			// nothing of the predecessor's.
			require.NoError(t, e.g.Stopped(ctx, app))
			require.NoError(t, e.g.Removed(ctx, app))
			assert.Equal(t, initC.ContainerID, e.holders()[migUUID(0)])
		})
	}

	t.Run("nothing else in the way: taken over", func(t *testing.T) {
		e := newEnv(t, func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove })
		require.Equal(t, guard.Admit, e.admit(initC, visible("3:0")).Result)
		require.NoError(t, e.g.Started(ctx, initC.ContainerID, 1001, "/k8s.io/"+initC.ContainerID))
		require.NoError(t, e.g.Stopped(ctx, initC))
		d := e.admit(app, visible("3"))
		require.Equal(t, guard.Admit, d.Result, d.Message)
		assert.Equal(t, "takeover", d.Reason)
		assert.Equal(t, map[string]string{migUUID(0): app.ContainerID, uuid(3): app.ContainerID}, e.holders())
	})
}

// The head of the queue waiting for GPU 3 whole keeps it once the refused
// container's predecessor is removed: nothing was left behind.
func TestRefusedTakeoverLeavesTheGPUToTheHead(t *testing.T) {
	e := newEnv(t, func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove })
	initC := ctr("ml", "train", "init", "init000000000001")
	app := ctr("ml", "train", "app", "app0000000000001")
	other := ctr("ml", "other", "app", "other00000000001")
	require.Equal(t, guard.Admit, e.admit(initC, visible("3:0")).Result)
	require.NoError(t, e.g.Started(ctx, initC.ContainerID, 1001, "/k8s.io/"+initC.ContainerID))
	require.NoError(t, e.g.Stopped(ctx, initC))
	require.Equal(t, guard.Queue, e.admit(other, visible("3")).Result)
	require.Equal(t, guard.Queue, e.admit(app, visible("3")).Result)

	require.NoError(t, e.g.Removed(ctx, initC))
	assert.Empty(t, e.holders())
	d := e.admit(other, visible("3"))
	require.Equal(t, guard.Admit, d.Result, d.Message)
	assert.Equal(t, map[string]string{uuid(3): other.ContainerID}, e.holders())
}
