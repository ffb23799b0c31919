// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"testing"

	"github.com/containerd/nri/pkg/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// addSandbox adds a sandbox of pod name with its own id: the kubelet gives a
// pod a new sandbox (same UID) when it recreates it.
func (rt *runtime) addSandbox(name, id string) *api.PodSandbox {
	pod := &api.PodSandbox{Id: id, Name: name, Uid: "uid-" + name, Namespace: "ml"}
	rt.mu.Lock()
	rt.pods[pod.Id] = pod
	rt.mu.Unlock()
	return pod
}

// The kubelet recreates pod a's sandbox: sb-a1 stops with its container,
// main runs again in sb-a2 on GPU 0 and side waits there for GPU 1. The
// later StopPodSandbox and RemovePodSandbox of sb-a1 (the kubelet's garbage
// collection of dead sandboxes) must not release main's GPU while it runs,
// nor drop side from the queue.
func TestOldSandboxRemovalKeepsTheNewSandboxClaims(t *testing.T) {
	rt := newRuntime(t, nil)
	rt.startPlugin()
	podQ := rt.addPod("q")
	holder := container(podQ, "main", "q-holder", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podQ, holder))
	rt.start(podQ, holder, 1001)

	s1 := rt.addSandbox("a", "sb-a1")
	first := container(s1, "main", "main-1", "NVIDIA_VISIBLE_DEVICES=0")
	require.NoError(t, rt.create(s1, first))
	rt.start(s1, first, 1002)
	rt.stop(s1, first)
	rt.stopPod(s1)
	require.Equal(t, map[string]string{"1": "q-holder"}, rt.holders())

	s2 := rt.addSandbox("a", "sb-a2")
	main := container(s2, "main", "main-2", "NVIDIA_VISIBLE_DEVICES=0")
	require.NoError(t, rt.create(s2, main))
	rt.start(s2, main, 1003)
	require.Error(t, rt.create(s2, container(s2, "side", "side-1", "NVIDIA_VISIBLE_DEVICES=1")))
	require.Equal(t, []string{"ml/uid-a/side"}, rt.waiters())

	rt.stopPod(s1)
	rt.removePod(s1)
	assert.Equal(t, map[string]string{"0": "main-2", "1": "q-holder"}, rt.holders(), "main keeps GPU 0 while it runs")
	assert.Equal(t, []string{"ml/uid-a/side"}, rt.waiters(), "side keeps its place")

	// The enforcement holds: GPU 0 is still main's.
	podB := rt.addPod("b")
	require.ErrorContains(t, rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=0")), "is held by ml/a/main (id main-2)")

	// The pod's real end releases it.
	rt.stopPod(s2)
	rt.removePod(s2)
	assert.Equal(t, map[string]string{"1": "q-holder"}, rt.holders())
	assert.Equal(t, []string{"ml/uid-b/main"}, rt.waiters())
}
