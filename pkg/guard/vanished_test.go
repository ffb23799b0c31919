// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// A Synchronize whose pod list lacks pod p while its container list has
// p's container c1 running (containerd leaves a pod in StateUnknown out of
// ListPodSandboxes, not its running containers out of ListContainers): the
// reconcile keeps c1's claim on GPU 0, and forgetting p's vanished waiters
// drops c2's queue entry without ending that claim. A pod really gone (r:
// neither it nor its container listed) loses its claim to the reconcile and
// its waiters here.
func TestForgetVanishedPodsDropsWaitersOnly(t *testing.T) {
	e, _ := newStateEnv(t, nil)
	c1 := ctr("ml", "p", "main", "c10000000000001")
	c2 := ctr("ml", "p", "side", "c20000000000001")
	holder := ctr("ml", "q", "main", "q0000000000001")
	gone := ctr("ml", "r", "main", "r0000000000001")
	goneWaiter := ctr("ml", "r", "side", "r0000000000002")
	require.Equal(t, guard.Admit, e.admit(c1, visible("0")).Result)
	require.NoError(t, e.g.Started(ctx, c1.ContainerID, 4242, "/k8s.io/"+c1.ContainerID))
	require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
	require.NoError(t, e.g.Started(ctx, holder.ContainerID, 4343, "/k8s.io/"+holder.ContainerID))
	require.Equal(t, guard.Admit, e.admit(gone, visible("2")).Result)
	require.Equal(t, guard.Queue, e.admit(c2, visible("1")).Result)
	require.Equal(t, guard.Queue, e.admit(goneWaiter, visible("1")).Result)

	// As the NRI front end lists them: c1 without its (unlisted) pod.
	listedC1 := ledger.Owner{ContainerID: c1.ContainerID, Container: c1.Container, PodSandboxID: c1.PodSandboxID,
		FrontEnd: ledger.FrontEndNRI, Pid: 4242, Cgroup: "/k8s.io/" + c1.ContainerID}
	listedHolder := holder
	listedHolder.Pid, listedHolder.Cgroup = 4343, "/k8s.io/"+holder.ContainerID
	_, err := e.g.Reconcile(ctx, ledger.FrontEndNRI, []guard.Request{
		{Owner: listedC1, Spec: visible("0")},
		{Owner: listedHolder, Spec: visible("1")},
	})
	require.NoError(t, err)
	require.Equal(t, map[string]string{uuid(0): c1.ContainerID, uuid(1): holder.ContainerID}, e.holders())

	n, err := e.g.ForgetVanishedPods(ctx, ledger.FrontEndNRI, []string{holder.PodUID})
	require.NoError(t, err)
	assert.Equal(t, 2, n, "pods p and r")
	assert.Equal(t, map[string]string{uuid(0): c1.ContainerID, uuid(1): holder.ContainerID}, e.holders(),
		"GPU 0 is still c1's: it runs")
	assert.Empty(t, e.waiters())

	n, err = e.g.ForgetVanishedPods(ctx, ledger.FrontEndNRI, []string{holder.PodUID})
	require.NoError(t, err)
	assert.Zero(t, n, "nothing left to drop")
}

// ForgetPodsNotLive asks which pods are live under the ledger lock, once
// per waiter's pod: a pod whose create queued a waiter after the caller's
// pod list was taken (a launched plugin admits creations during the drop)
// counts as live if the caller says so at that moment, and keeps its place.
func TestForgetPodsNotLiveAsksUnderTheLock(t *testing.T) {
	e, _ := newStateEnv(t, nil)
	holder := ctr("ml", "q", "main", "q0000000000001")
	late := ctr("ml", "late", "main", "l0000000000001")
	gone := ctr("ml", "r", "main", "r0000000000001")
	require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
	require.Equal(t, guard.Queue, e.admit(gone, visible("1")).Result)
	require.Equal(t, guard.Queue, e.admit(late, visible("1")).Result)

	asked := map[string]bool{}
	n, err := e.g.ForgetPodsNotLive(ctx, ledger.FrontEndNRI, func(uid string) bool {
		asked[uid] = true
		return uid == late.PodUID || uid == holder.PodUID
	})
	require.NoError(t, err)
	assert.Equal(t, 1, n, "pod r only")
	assert.True(t, asked[late.PodUID] && asked[gone.PodUID], "asked for each waiter's pod: %v", asked)
	assert.Len(t, e.waiters(), 1, "late keeps its place")
}
