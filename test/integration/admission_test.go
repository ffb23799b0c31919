// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build integration

package integration

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// worker is the name of every workload container.
const worker = "worker"

// shortID is how the guard abbreviates container ids in messages.
func shortID(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

// gpuName is how the guard names a GPU in messages: "GPU 1 (GPU-…)".
func gpuName(g FakeGPU) string { return fmt.Sprintf("GPU %d (%s)", g.Index, g.UUID) }

// assertNoPodClaims checks that no claim belongs to a container of pod p.
func assertNoPodClaims(t *testing.T, g *Guard, p *Pod) {
	t.Helper()
	for _, c := range g.Claims(t) {
		assert.NotEqual(t, p.Spec.UID, c.PodUID, "pod %s holds %s (container %s)", p.Spec.Name, c.Device, c.ContainerID)
	}
}

// TestConflictingRequestIsRefusedAndQueued: pod A holds GPU 1 (named by UUID);
// pod B asks for GPU 1 by index and is refused with a message naming the GPU,
// its full UUID and A's namespace/pod/container, and queued; pod C asks for
// GPU 2 and is admitted at once.
func TestConflictingRequestIsRefusedAndQueued(t *testing.T) {
	env := NewGuardEnv(t, GuardOptions{})
	c, g := env.C, env.G
	gpu1, gpu2 := c.GPUs[1], c.GPUs[2]

	a := c.RunPod(t, PodSpec{Name: "conflict-a"})
	aID := a.Run(t, ContainerSpec{Name: worker, Env: GPUEnv(gpu1.UUID)})
	assert.Equal(t, map[string][]string{aID: {gpu1.UUID}}, g.ClaimsByContainer(t))

	b := c.RunPod(t, PodSpec{Name: "conflict-b"})
	msg := b.Refused(t, ContainerSpec{Name: worker, Env: GPUEnv("1")})
	t.Logf("refusal seen by crictl: %s", msg)
	assert.Contains(t, msg, gpuName(gpu1)+" is held by "+a.Owner(worker))
	assert.Contains(t, msg, shortID(aID))
	assert.Contains(t, msg, "position 1 of 1")
	for _, ctr := range c.Containers(t) {
		assert.NotEqual(t, b.ID, ctr.PodSandboxID, "the refused container was not left behind: %s", describe(ctr))
	}

	q := g.Queue(t)
	require.Len(t, q, 1, "B is queued: %s", describe(q))
	assert.Equal(t, "default/"+b.Spec.UID+"/"+worker, q[0].Requester)
	assert.Equal(t, []string{gpu1.UUID}, q[0].Devices)
	assert.Equal(t, 1, q[0].Position)

	cp := c.RunPod(t, PodSpec{Name: "conflict-c"})
	cID := cp.Run(t, ContainerSpec{Name: worker, Env: GPUEnv("2")})
	assert.Equal(t, map[string][]string{aID: {gpu1.UUID}, cID: {gpu2.UUID}}, g.ClaimsByContainer(t))

	// B's retry (what the kubelet does) is refused again at the same place:
	// a requester is queued once, however often it retries.
	msg = b.Refused(t, ContainerSpec{Name: worker, Env: GPUEnv("1")})
	assert.Contains(t, msg, "position 1 of 1")
	assert.Len(t, g.Queue(t), 1)
	assertNoPodClaims(t, g, b)
}

// TestStoppedHolderHandsGPUToHeadOfQueue: when the holder stops, the GPU is
// reserved for the head of the queue: a newcomer D is refused as "reserved
// for" B, and B's retried create is admitted.
func TestStoppedHolderHandsGPUToHeadOfQueue(t *testing.T) {
	env := NewGuardEnv(t, GuardOptions{})
	c, g := env.C, env.G
	gpu1 := c.GPUs[1]
	want := ContainerSpec{Name: worker, Env: GPUEnv("1")}

	a := c.RunPod(t, PodSpec{Name: "handover-a"})
	aID := a.Run(t, want)
	b := c.RunPod(t, PodSpec{Name: "handover-b"})
	assert.Contains(t, b.Refused(t, want), "position 1 of 1")

	c.StopContainer(t, aID)
	// The stop reaches the guard as NRI StopContainer (or its liveness check
	// finds A's processes gone): wait for the ledger to show it.
	g.WaitHolder(t, 1, "")
	q := g.Queue(t)
	require.Len(t, q, 1)
	assert.Equal(t, []string{gpu1.UUID}, q[0].Reserved, "the freed GPU is reserved for the head of the queue")

	d := c.RunPod(t, PodSpec{Name: "handover-d"})
	msg := d.Refused(t, want)
	t.Logf("newcomer's refusal: %s", msg)
	assert.Contains(t, msg, gpuName(gpu1)+" is reserved for "+b.Owner(worker))
	assert.Contains(t, msg, "position 2 of 2", "D queues behind B")

	bID := b.Run(t, want)
	assert.Equal(t, map[string][]string{bID: {gpu1.UUID}}, g.ClaimsByContainer(t))

	msg = d.Refused(t, want)
	assert.Contains(t, msg, gpuName(gpu1)+" is held by "+b.Owner(worker))
	assert.Contains(t, msg, "position 1 of 1")
}

// TestWaiterRemovedWhileQueuedNeverHoldsTheGPU: a waiter whose pod is
// removed leaves the queue and never claims; the next waiter gets the GPU.
// Both while the GPU is still held and once it is reserved for the removed
// waiter.
func TestWaiterRemovedWhileQueuedNeverHoldsTheGPU(t *testing.T) {
	env := NewGuardEnv(t, GuardOptions{})
	c, g := env.C, env.G

	for _, tc := range []struct {
		name string
		gpu  int
		// holderStopsFirst: the holder stops (the GPU is reserved for B)
		// before B's pod is removed.
		holderStopsFirst bool
	}{
		{name: "removed while the GPU is held", gpu: 1},
		{name: "removed while the GPU is reserved for it", gpu: 2, holderStopsFirst: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpu := c.GPUs[tc.gpu]
			want := ContainerSpec{Name: worker, Env: GPUEnv(fmt.Sprint(tc.gpu))}
			prefix := fmt.Sprintf("withdraw%d-", tc.gpu)

			a := c.RunPod(t, PodSpec{Name: prefix + "a"})
			aID := a.Run(t, want)
			b := c.RunPod(t, PodSpec{Name: prefix + "b"})
			assert.Contains(t, b.Refused(t, want), "position 1 of 1")
			cp := c.RunPod(t, PodSpec{Name: prefix + "c"})
			assert.Contains(t, cp.Refused(t, want), "position 2 of 2")

			if tc.holderStopsFirst {
				c.StopContainer(t, aID)
				g.WaitHolder(t, tc.gpu, "")
				assert.Contains(t, cp.Refused(t, want), "reserved for "+b.Owner(worker))
			}

			b.Remove(t)
			// RemovePodSandbox drops B's request at once.
			waitFor(t, waitTimeout, "B to leave the queue", func() (bool, string) {
				q := g.Queue(t)
				for _, w := range q {
					if w.Pod == b.Spec.Name {
						return false, describe(q)
					}
				}
				return true, ""
			})
			assertNoPodClaims(t, g, b)

			if !tc.holderStopsFirst {
				// Still held by A: C is now first in line.
				assert.Contains(t, cp.Refused(t, want), "position 1 of 1")
				c.StopContainer(t, aID)
				g.WaitHolder(t, tc.gpu, "")
			}
			cID := cp.Run(t, want)
			assert.Equal(t, cID, g.Holder(t, tc.gpu), "the next waiter got %s", gpuName(gpu))
			assertNoPodClaims(t, g, b)
		})
	}
}

// TestEveryPathToTheGPUConflicts: a GPU reached through an env var, a CDI
// annotation or a CRI device node is the same GPU: whichever way the holder
// named it, every other way is refused with the holder named.
func TestEveryPathToTheGPUConflicts(t *testing.T) {
	env := NewGuardEnv(t, GuardOptions{})
	c, g := env.C, env.G

	viaEnv := func(i int) ContainerSpec {
		return ContainerSpec{Name: worker, Env: GPUEnv(c.GPUs[i].UUID)}
	}
	viaIndexEnv := func(i int) ContainerSpec {
		return ContainerSpec{Name: worker, Env: GPUEnv(fmt.Sprint(i))}
	}
	viaCDI := func(i int) ContainerSpec {
		return ContainerSpec{Name: worker, Annotations: map[string]string{"cdi.k8s.io/gpu": fmt.Sprintf("nvidia.com/gpu=%d", i)}}
	}
	viaDevice := func(i int) ContainerSpec {
		return ContainerSpec{Name: worker, Devices: []DeviceMapping{{
			ContainerPath: fmt.Sprintf("/dev/nvidia%d", c.GPUs[i].Minor), HostPath: c.DevicePath(i), Permissions: "rw",
		}}}
	}

	for _, tc := range []struct {
		name       string
		gpu        int
		holder     func(int) ContainerSpec
		requesters map[string]func(int) ContainerSpec
	}{
		{
			name: "env holder", gpu: 1, holder: viaEnv,
			requesters: map[string]func(int) ContainerSpec{"cdi": viaCDI, "device": viaDevice},
		},
		{
			name: "cdi holder", gpu: 2, holder: viaCDI,
			requesters: map[string]func(int) ContainerSpec{"env": viaIndexEnv, "device": viaDevice},
		},
		{
			name: "device holder", gpu: 3, holder: viaDevice,
			requesters: map[string]func(int) ContainerSpec{"env": viaEnv, "cdi": viaCDI},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpu := c.GPUs[tc.gpu]
			holderPod := c.RunPod(t, PodSpec{Name: fmt.Sprintf("paths%d-holder", tc.gpu)})
			hID := holderPod.Run(t, tc.holder(tc.gpu))
			assert.Equal(t, hID, g.Holder(t, tc.gpu))
			for via, spec := range tc.requesters {
				p := c.RunPod(t, PodSpec{Name: fmt.Sprintf("paths%d-%s", tc.gpu, via)})
				msg := p.Refused(t, spec(tc.gpu))
				assert.Contains(t, msg, gpuName(gpu)+" is held by "+holderPod.Owner(worker), "request via %s", via)
				assertNoPodClaims(t, g, p)
			}
			assert.Equal(t, hID, g.Holder(t, tc.gpu), "the holder keeps its GPU")
		})
	}
}
