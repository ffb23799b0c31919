// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// containerd's Synchronize leaves out a pod in StateUnknown but lists its
// running containers. Pod p's main runs on GPU 0 and its side waits for GPU
// 1 (held by pod q); after a plugin restart whose sync lacks p, main keeps
// GPU 0 (another pod is refused it) while side's queue entry is dropped.
func TestSyncWithoutAPodOfARunningContainerKeepsItsClaim(t *testing.T) {
	rt := newRuntime(t, nil)
	first := rt.startPlugin()
	podP, podQ := rt.addPod("p"), rt.addPod("q")
	holder := container(podQ, "main", "q-holder", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podQ, holder))
	rt.start(podQ, holder, 1001)
	main := container(podP, "main", "p-main", "NVIDIA_VISIBLE_DEVICES=0")
	require.NoError(t, rt.create(podP, main))
	rt.start(podP, main, 1002)
	require.Error(t, rt.create(podP, container(podP, "side", "p-side", "NVIDIA_VISIBLE_DEVICES=1")))
	require.Equal(t, []string{"ml/uid-p/side"}, rt.waiters())

	first.stub.Stop()
	rt.mu.Lock()
	delete(rt.pods, podP.Id) // StateUnknown: not listed; p-main still is
	rt.mu.Unlock()
	rt.startPlugin()

	assert.Equal(t, map[string]string{"0": "p-main", "1": "q-holder"}, rt.holders(), "p-main keeps GPU 0 while it runs")
	assert.Empty(t, rt.waiters(), "the unlisted pod's waiter is dropped")
	podB := rt.addPod("b")
	require.ErrorContains(t, rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=0")), "(id p-main)")
}
