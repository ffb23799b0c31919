// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// release_on = "remove", GPU 3 in MIG instances. A pod's init container held
// MIG 3:0 and exited; another pod waits for GPU 3 whole (the head of the
// queue); the first pod's app container asks for GPU 3 whole. The app is
// refused (GPU 3 is kept for the head), and its refusal must not move the
// init container's claim to it: containerd's undo of the refused create
// sends Stop and Remove for an id the plugin does not track, which it
// ignores, so a claim moved there would stay with a container that never
// existed, and keep both pods out of GPU 3 until the next resync.
func TestRefusedCreateLeavesThePredecessorsClaim(t *testing.T) {
	rt := newRuntime(t, func(c *config.Config) {
		c.Policy.ReleaseOn = config.ReleaseOnRemove
		c.Devices.Static[3].MIG = []config.StaticMIG{
			{Index: 0, UUID: "MIG-6c1a2f2e-0000-4000-9000-000000000000", GI: 1, CI: 0},
			{Index: 1, UUID: "MIG-6c1a2f2e-0000-4000-9000-000000000001", GI: 2, CI: 0},
		}
	})
	rt.startPlugin()
	train, other := rt.addPod("train"), rt.addPod("other")
	initC := container(train, "init", "init-1", "NVIDIA_VISIBLE_DEVICES=3:0")
	require.NoError(t, rt.create(train, initC))
	rt.start(train, initC, 1001)
	rt.exit(initC)
	rt.stop(train, initC)
	require.Equal(t, map[string]string{"3:0": "init-1"}, rt.holders())

	err := rt.create(other, container(other, "main", "other-1", "NVIDIA_VISIBLE_DEVICES=3"))
	require.Error(t, err, "GPU 3 is partly held: the other pod waits, first in line")

	err = rt.create(train, container(train, "app", "app-1", "NVIDIA_VISIBLE_DEVICES=3"))
	require.Error(t, err)
	assert.ErrorContains(t, err, "is held by ml/train/init (id init-1)")
	assert.ErrorContains(t, err, "is kept for ml/other/main (id other-1)")
	assert.Equal(t, map[string]string{"3:0": "init-1"}, rt.holders(), "after the refused create's Stop and Remove")

	// The pod's garbage collection removes the init container: GPU 3 is
	// whole again, and goes to the head at its next retry.
	rt.remove(train, initC)
	assert.Empty(t, rt.holders())
	require.NoError(t, rt.create(other, container(other, "main", "other-2", "NVIDIA_VISIBLE_DEVICES=3")))
	assert.Equal(t, map[string]string{"3": "other-2"}, rt.holders())
}
