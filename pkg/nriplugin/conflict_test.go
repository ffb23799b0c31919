// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"testing"
	"time"

	"github.com/containerd/nri/pkg/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// listedAtSync makes containerd list c at the plugin's Synchronize.
func (rt *runtime) listedAtSync(c *api.Container) {
	rt.mu.Lock()
	rt.listed[c.Id] = c
	rt.order = append(rt.order, c.Id)
	rt.mu.Unlock()
}

// advance moves the clock of the ledger and the guard.
func (rt *runtime) advance(d time.Duration) {
	rt.clock.mu.Lock()
	rt.clock.now = rt.clock.now.Add(d)
	rt.clock.mu.Unlock()
}

// twinsOnGPU2 lists, at the plugin's first Synchronize, a running holder of
// GPU 2 and a container created on it unchecked while the plugin was away
// (not started yet): the holder keeps the GPU, the other is recorded in
// conflict.
func twinsOnGPU2(t *testing.T, rt *runtime) (podC, podD *api.PodSandbox, holder, late *api.Container) {
	t.Helper()
	podC, podD = rt.addPod("c"), rt.addPod("d")
	holder = container(podC, "main", "twin-c", "NVIDIA_VISIBLE_DEVICES=2")
	holder.State, holder.Pid = api.ContainerState_CONTAINER_RUNNING, 2000
	late = container(podD, "main", "twin-d", "NVIDIA_VISIBLE_DEVICES=2")
	late.State = api.ContainerState_CONTAINER_CREATED
	rt.listedAtSync(holder)
	rt.listedAtSync(late)
	rt.startPlugin()
	require.Equal(t, map[string]string{"2": holder.Id}, rt.holders())
	require.Len(t, rt.state().Conflicts, 1)
	return podC, podD, holder, late
}

// Under release_requires_idle, the container recorded in conflict runs,
// stops and is removed, and then the holder goes too: GPU 2 runs nothing,
// and the next container gets it once the holder's claim and then the gone
// container's have drained. The record names the container's process, so
// it stays through the stop (its processes may still be on GPU 2), becomes
// its claim once the holder's has drained, and drains in its turn. It used
// to be handed the GPU for good: it named no process (the start was not
// recorded in it), so nothing ever found it exited.
func TestDrainEndsConflictOfGoneContainer(t *testing.T) {
	rt := newRuntime(t, func(c *config.Config) {
		c.Observe.ReleaseRequiresIdle = true
		c.Observe.IdleGrace = config.Duration{Duration: time.Minute}
	})
	podC, podD, holder, late := twinsOnGPU2(t, rt)

	rt.start(podD, late, 2001)
	rt.exit(late)
	rt.stop(podD, late)
	require.Len(t, rt.state().Conflicts, 1, "the record names its process, which may still be on GPU 2")
	rt.remove(podD, late)

	rt.stop(podC, holder)
	rt.remove(podC, holder)
	rt.advance(2 * time.Minute) // past idle_grace: the holder's claim drained away

	podE := rt.addPod("e")
	err := rt.create(podE, container(podE, "main", "e-1", "NVIDIA_VISIBLE_DEVICES=2"))
	require.ErrorContains(t, err, "draining since", "the record became the gone container's claim, which drains")
	rt.advance(2 * time.Minute)
	require.NoError(t, rt.create(podE, container(podE, "main", "e-1", "NVIDIA_VISIBLE_DEVICES=2")), "GPU 2 runs nothing")
	assert.Equal(t, map[string]string{"2": "e-1"}, rt.holders())
}

// The container recorded in conflict starts: its pid and cgroup go into
// the record. It then ends without a stop event reaching the plugin, and
// the holder stops: the record becomes its claim, and the next container
// on GPU 2 finds it exited and gets the GPU. Without the process in the
// record, the promoted claim counted as "never started" and was kept for
// good.
func TestPromotedConflictIsCheckedForLiveness(t *testing.T) {
	rt := newRuntime(t, nil)
	podC, podD, holder, late := twinsOnGPU2(t, rt)

	rt.start(podD, late, 2001)
	st := rt.state()
	require.Len(t, st.Conflicts, 1)
	assert.Equal(t, 2001, st.Conflicts[0].Owner.Pid, "the start is recorded in the conflict record")
	assert.Equal(t, late.Linux.CgroupsPath, st.Conflicts[0].Owner.Cgroup)
	rt.exit(late) // gone; its stop event never reaches the plugin

	rt.stop(podC, holder)
	require.Equal(t, map[string]string{"2": late.Id}, rt.holders(), "the record became the claim")

	podE := rt.addPod("e")
	require.NoError(t, rt.create(podE, container(podE, "main", "e-1", "NVIDIA_VISIBLE_DEVICES=2")),
		"the promoted claim's container is found exited")
	assert.Equal(t, map[string]string{"2": "e-1"}, rt.holders())
}
