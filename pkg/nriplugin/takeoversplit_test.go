// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"testing"

	"github.com/containerd/nri/pkg/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// Under release_on = "remove", the kubelet's device manager splits a pod's
// init container's devices between its app containers: the init container
// held GPUs 1 and 2, app a gets GPU 1 and app b GPU 2. Each takes over the
// claim on what it asks for; a used to take both, and b was refused as
// "held by ml/train/a" for as long as a ran.
func TestAppContainersSplitTheirInitContainersGPUs(t *testing.T) {
	rt := newRuntime(t, func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove })
	rt.startPlugin()
	pod := rt.addPod("train")
	initC := container(pod, "init", "init-1", "NVIDIA_VISIBLE_DEVICES=1,2")
	require.NoError(t, rt.create(pod, initC))
	rt.start(pod, initC, 4001)
	rt.stop(pod, initC)

	a := container(pod, "a", "app-a", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(pod, a))
	rt.start(pod, a, 4002)
	assert.Equal(t, map[string]string{"1": "app-a", "2": "init-1"}, rt.holders())

	b := container(pod, "b", "app-b", "NVIDIA_VISIBLE_DEVICES=2")
	require.NoError(t, rt.create(pod, b))
	rt.start(pod, b, 4003)
	assert.Equal(t, map[string]string{"1": "app-a", "2": "app-b"}, rt.holders())

	// The pod's garbage collection of the init container ends nothing of
	// the app containers'; the pod's removal ends everything.
	rt.remove(pod, initC)
	assert.Equal(t, map[string]string{"1": "app-a", "2": "app-b"}, rt.holders())
	rt.stop(pod, a)
	rt.stop(pod, b)
	rt.stopPod(pod)
	rt.removePod(pod)
	assert.Empty(t, rt.holders())
}

// The takeover moved the init container's claim on GPU 2 to app a, which
// never asked for it: a later plugin that gave a GPU 2's node then passed
// validation (a "held" it), and a rebuild from the request CreateContainer
// saw would release GPU 2 as stale while a reaches it. Now a holds only
// what it asked for: the node is refused at validation, and containerd's
// undo of the create hands GPU 1 back to the init container.
func TestLaterPluginCannotGiveATakeoverTheRestOfItsPredecessor(t *testing.T) {
	rt := newRuntime(t, func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove })
	rt.startPlugin()
	gpu2 := &api.LinuxDevice{Path: "/dev/nvidia2", Type: "c", Major: 195, Minor: 2}
	rt.startInjector(func(c *api.Container) *api.ContainerAdjustment {
		if c.Name != "a" {
			return nil
		}
		return &api.ContainerAdjustment{Linux: &api.LinuxContainerAdjustment{Devices: []*api.LinuxDevice{gpu2}}}
	})
	pod := rt.addPod("train")
	initC := container(pod, "init", "init-1", "NVIDIA_VISIBLE_DEVICES=1,2")
	require.NoError(t, rt.create(pod, initC))
	rt.start(pod, initC, 4001)
	rt.stop(pod, initC)

	err := rt.create(pod, container(pod, "a", "app-a", "NVIDIA_VISIBLE_DEVICES=1"))
	require.Error(t, err, "GPU 2 was given by a later plugin, and a holds no claim on it")
	assert.ErrorContains(t, err, "GPU 2 ("+gpuUUID(2)+")")
	assert.Equal(t, map[string]string{"1": "init-1", "2": "init-1"}, rt.holders(),
		"the undone create handed GPU 1 back to the init container")
}
