// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/nri/pkg/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/daemon"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// 1. Two containers naming the same GPU (by index, then by UUID): the second
// is refused with the full message; a container on another GPU is admitted.
func TestConflictRefusedWithFullMessage(t *testing.T) {
	rt := newRuntime(t, nil)
	rt.startPlugin()
	podA, podB, podC := rt.addPod("train-a"), rt.addPod("train-b"), rt.addPod("train-c")

	holder := container(podA, "main", "aaaaaaaaaaaa0123456789", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, holder))

	err := rt.create(podB, container(podB, "main", "bbbbbbbbbbbb0123456789", "NVIDIA_VISIBLE_DEVICES="+gpuUUID(1)))
	require.Error(t, err)
	msg := err.Error()
	for _, want := range []string{
		"nri-gpu-guard: GPU 1 (" + gpuUUID(1) + ") is held by ml/train-a/main (id aaaaaaaaaaaa)",
		"since 2026-05-09T08:00:00Z",
		"queued at position 1 of 1",
		"retrying is automatic under Kubernetes",
		"Free GPUs now: 0, 2, 3",
	} {
		assert.Contains(t, msg, want)
	}

	require.NoError(t, rt.create(podC, container(podC, "main", "cccccccccccc0123456789", "NVIDIA_VISIBLE_DEVICES=2")))
	assert.Equal(t, map[string]string{"1": holder.Id, "2": "cccccccccccc0123456789"}, rt.holders())
	assert.Equal(t, []string{"ml/uid-train-b/main"}, rt.waiters())
}

// 2. The holder stops: the queued requester's next create is admitted; a
// third requester trying in between is refused as "reserved for …".
func TestQueuedRequesterAdmittedAfterHolderStops(t *testing.T) {
	rt := newRuntime(t, nil)
	rt.startPlugin()
	podA, podB, podC := rt.addPod("a"), rt.addPod("b"), rt.addPod("c")
	holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=0")
	require.NoError(t, rt.create(podA, holder))
	rt.start(podA, holder, 1001)

	require.ErrorContains(t, rt.create(podB, container(podB, "main", "b-try-1", "NVIDIA_VISIBLE_DEVICES=0")), "position 1 of 1")

	rt.stop(podA, holder)
	assert.Empty(t, rt.holders())

	err := rt.create(podC, container(podC, "main", "c-try-1", "NVIDIA_VISIBLE_DEVICES=0"))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "GPU 0 ("+gpuUUID(0)+") is reserved for ml/b/main (id b-try-1) (earlier in the queue) until")
	assert.Contains(t, err.Error(), "position 2 of 2")

	require.NoError(t, rt.create(podB, container(podB, "main", "b-try-2", "NVIDIA_VISIBLE_DEVICES=0")))
	assert.Equal(t, map[string]string{"0": "b-try-2"}, rt.holders())
	assert.Equal(t, []string{"ml/uid-c/main"}, rt.waiters())
}

// 3. A waiter whose pod is stopped/removed leaves the queue and never claims;
// the next waiter gets the GPU.
func TestWaiterOfGonePodNeverClaims(t *testing.T) {
	for _, how := range []string{"stop", "remove"} {
		t.Run(how, func(t *testing.T) {
			rt := newRuntime(t, nil)
			rt.startPlugin()
			podA, podB, podC := rt.addPod("a"), rt.addPod("b"), rt.addPod("c")
			holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=3")
			require.NoError(t, rt.create(podA, holder))
			require.Error(t, rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=3")))
			require.Error(t, rt.create(podC, container(podC, "main", "c-1", "NVIDIA_VISIBLE_DEVICES=3")))
			require.Equal(t, []string{"ml/uid-b/main", "ml/uid-c/main"}, rt.waiters())

			if how == "stop" {
				rt.stopPod(podB)
			} else {
				rt.stopPod(podB)
				rt.removePod(podB)
			}
			assert.Equal(t, []string{"ml/uid-c/main"}, rt.waiters())

			rt.stop(podA, holder)
			st := rt.state()
			require.Len(t, st.Reservations, 1)
			assert.Equal(t, "ml/uid-c/main", st.Reservations[0].For, "the freed GPU goes to the next waiter")

			require.NoError(t, rt.create(podC, container(podC, "main", "c-2", "NVIDIA_VISIBLE_DEVICES=3")))
			assert.Equal(t, map[string]string{"3": "c-2"}, rt.holders())
		})
	}
}

// 4. A refused create's follow-up StopContainer and RemoveContainer (sent by
// containerd's undo) touch nothing of the holder.
func TestRefusedCreateUndoTouchesNothing(t *testing.T) {
	rt := newRuntime(t, nil)
	rt.startPlugin()
	podA, podB := rt.addPod("a"), rt.addPod("b")
	holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, holder))
	rt.start(podA, holder, 1001)
	before := rt.state()

	// The refused id even reuses the holder's pod sandbox and name: only the
	// container id counts for a release.
	refused := container(podA, "main", "refused-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.Error(t, rt.create(podA, refused)) // create + undo Stop + Remove
	refusedB := container(podB, "main", "refused-2", "NVIDIA_VISIBLE_DEVICES=1")
	require.Error(t, rt.create(podB, refusedB))

	after := rt.state()
	require.Len(t, after.Claims, 1)
	assert.Equal(t, before.Claims, after.Claims, "the holder's claim is untouched (pid and cgroup included)")
	assert.Equal(t, []string{"ml/uid-a/main", "ml/uid-b/main"}, rt.waiters(), "the refused requesters stay queued")
}

// 5. Plugin restart: claims of containers that exited meanwhile (their
// cgroup is empty, and the runtime no longer lists them) are released at
// Synchronize, running holders are kept, and a GPU shared by two running
// containers shows as a conflict.
func TestPluginRestartReconciles(t *testing.T) {
	rt := newRuntime(t, nil)
	first := rt.startPlugin()
	podA, podB, podC, podD := rt.addPod("a"), rt.addPod("b"), rt.addPod("c"), rt.addPod("d")
	running := container(podA, "main", "running-1", "NVIDIA_VISIBLE_DEVICES=0")
	vanished := container(podB, "main", "vanished-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, running))
	rt.start(podA, running, 1001)
	require.NoError(t, rt.create(podB, vanished))
	rt.start(podB, vanished, 1002)
	require.Equal(t, map[string]string{"0": "running-1", "1": "vanished-1"}, rt.holders())

	first.stub.Stop()

	// While the plugin is away: one holder exits and is removed, and two
	// containers start on GPU 2 unchecked.
	rt.exit(vanished)
	for _, c := range []*api.Container{
		container(podC, "main", "twin-c", "NVIDIA_VISIBLE_DEVICES=2"),
		container(podD, "main", "twin-d", "NVIDIA_VISIBLE_DEVICES="+gpuUUID(2)),
	} {
		c.State, c.Pid = api.ContainerState_CONTAINER_RUNNING, 2000
		rt.mu.Lock()
		rt.listed[c.Id] = c
		rt.order = append(rt.order, c.Id)
		rt.mu.Unlock()
	}

	rt.startPlugin()
	st := rt.state()
	assert.Equal(t, map[string]string{"0": "running-1", "2": "twin-c"}, rt.holders())
	for _, c := range st.Claims {
		if c.Owner.ContainerID == "running-1" {
			assert.Equal(t, 1001, c.Owner.Pid, "the running holder keeps its recorded process")
		}
	}
	require.Len(t, st.Conflicts, 1)
	assert.Equal(t, "twin-d", st.Conflicts[0].Owner.ContainerID)
	assert.Equal(t, gpuUUID(2), st.Conflicts[0].Device.UUID)

	// The restarted plugin enforces as before.
	require.ErrorContains(t, rt.create(podB, container(podB, "main", "b-2", "NVIDIA_VISIBLE_DEVICES=0")),
		"is held by ml/a/main (id running-1)")
	require.NoError(t, rt.create(podB, container(podB, "main", "b-3", "NVIDIA_VISIBLE_DEVICES=1")))
}

// A holder the runtime does not list at Synchronize but whose processes
// still run keeps its GPU. containerd leaves out of the list a running
// container it could not load after a restart (CRI state UNKNOWN: its shim
// did not answer in time, its task is paused); the container goes on using
// its GPU, and the next container asking for it must be refused, not given
// it as well. The claim ends as any holder's does: once its processes are
// gone (the next request's liveness check), or at its stop event. A
// container created but never started that the runtime lost meanwhile is
// gone, and its claim is released at the Synchronize.
func TestPluginRestartKeepsUnlistedRunningHolder(t *testing.T) {
	for _, tc := range []struct {
		name string
		ends func(rt *runtime, pod *api.PodSandbox, holder *api.Container)
	}{
		{"its processes exit", func(rt *runtime, _ *api.PodSandbox, holder *api.Container) { rt.exit(holder) }},
		{"its stop event", func(rt *runtime, pod *api.PodSandbox, holder *api.Container) { rt.stop(pod, holder) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rt := newRuntime(t, nil)
			first := rt.startPlugin()
			podA, podB, podL := rt.addPod("a"), rt.addPod("b"), rt.addPod("l")
			holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")
			require.NoError(t, rt.create(podA, holder))
			rt.start(podA, holder, 4242) // cgroup /k8s.io/holder-1 lists pid 4242
			lost := container(podL, "main", "lost-1", "NVIDIA_VISIBLE_DEVICES=2")
			require.NoError(t, rt.create(podL, lost)) // never started
			require.Equal(t, map[string]string{"1": "holder-1", "2": "lost-1"}, rt.holders())

			// containerd restarts: it cannot load the holder's task (UNKNOWN,
			// not listed; its processes run on), and it lost lost-1.
			first.stub.Stop()
			rt.unlist(holder)
			rt.unlist(lost)
			rt.startPlugin()

			require.Equal(t, map[string]string{"1": "holder-1"}, rt.holders(), "the running holder keeps GPU 1")
			unlisted := rt.audited(ledger.OpUnlisted)
			require.Len(t, unlisted, 1)
			assert.Equal(t, "holder-1", unlisted[0].ContainerID)
			assert.Contains(t, unlisted[0].Reason, "cgroup /k8s.io/holder-1 has processes")

			err := rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=1"))
			require.ErrorContains(t, err, "is held by ml/a/main (id holder-1)")
			require.NoError(t, rt.create(podB, container(podB, "side", "b-2", "NVIDIA_VISIBLE_DEVICES=2")),
				"the lost container's GPU is free")

			tc.ends(rt, podA, holder)
			require.NoError(t, rt.create(podB, container(podB, "main", "b-3", "NVIDIA_VISIBLE_DEVICES=1")))
			assert.Equal(t, map[string]string{"1": "b-3", "2": "b-2"}, rt.holders())
		})
	}
}

// Two running containers share a GPU when the plugin synchronizes: one
// holds the claim, the other is recorded in conflict. When the holder stops
// the other is handed the claim, and its own stop and removal release it
// (it is tracked like a holder from the Synchronize on).
func TestConflictContainerReleasedByItsOwnStop(t *testing.T) {
	rt := newRuntime(t, nil)
	podC, podD, podE := rt.addPod("c"), rt.addPod("d"), rt.addPod("e")
	twinC := container(podC, "main", "twin-c", "NVIDIA_VISIBLE_DEVICES=2")
	twinD := container(podD, "main", "twin-d", "NVIDIA_VISIBLE_DEVICES="+gpuUUID(2))
	for i, c := range []*api.Container{twinC, twinD} {
		c.State, c.Pid = api.ContainerState_CONTAINER_RUNNING, uint32(2000+i)
		rt.mu.Lock()
		rt.listed[c.Id] = c
		rt.order = append(rt.order, c.Id)
		rt.mu.Unlock()
	}
	rt.startPlugin()
	require.Equal(t, map[string]string{"2": "twin-c"}, rt.holders())
	require.Len(t, rt.state().Conflicts, 1)

	rt.stop(podC, twinC)
	rt.remove(podC, twinC)
	require.Equal(t, map[string]string{"2": "twin-d"}, rt.holders(), "the container in conflict is handed the claim")

	rt.stop(podD, twinD)
	assert.Empty(t, rt.holders(), "its own stop releases it")
	assert.Empty(t, rt.state().Conflicts)
	rt.remove(podD, twinD)
	require.NoError(t, rt.create(podE, container(podE, "main", "e-1", "NVIDIA_VISIBLE_DEVICES=2")))
}

// 6. The holder exited but StopContainer was not delivered: its empty
// cgroup gets it released, and the request is admitted.
func TestExitedHolderReleasedByCgroupCheck(t *testing.T) {
	rt := newRuntime(t, nil)
	rt.startPlugin()
	podA, podB := rt.addPod("a"), rt.addPod("b")
	holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, holder))
	rt.start(podA, holder, 4242)
	st := rt.state()
	require.Len(t, st.Claims, 1)
	assert.Equal(t, "/k8s.io/holder-1", st.Claims[0].Owner.Cgroup)

	// Still running: refused.
	require.Error(t, rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=1")))

	rt.exit(holder)
	require.NoError(t, rt.create(podB, container(podB, "main", "b-2", "NVIDIA_VISIBLE_DEVICES=1")))
	assert.Equal(t, map[string]string{"1": "b-2"}, rt.holders())

	// The late StopContainer of the old holder releases nothing of the new one.
	rt.stop(podA, holder)
	assert.Equal(t, map[string]string{"1": "b-2"}, rt.holders())
}

// A created-but-never-started holder has no process and keeps its GPU even
// though its (not yet existing) cgroup is empty.
func TestNeverStartedHolderKept(t *testing.T) {
	rt := newRuntime(t, nil)
	rt.startPlugin()
	podA, podB := rt.addPod("a"), rt.addPod("b")
	require.NoError(t, rt.create(podA, container(podA, "main", "created-1", "NVIDIA_VISIBLE_DEVICES=1")))
	require.Error(t, rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=1")))
	assert.Equal(t, map[string]string{"1": "created-1"}, rt.holders())
}

// 7. "all", privileged (as far as NRI exposes it: an allow-all device
// cgroup rule) and device-node requests each take part in conflicts.
func TestAllPrivilegedAndDeviceNodeConflicts(t *testing.T) {
	allowAll := &api.LinuxResources{Devices: []*api.LinuxDeviceCgroup{{Allow: true, Access: "rwm"}}}
	denyAllThenNvidia1 := &api.LinuxResources{Devices: []*api.LinuxDeviceCgroup{
		{Allow: false, Access: "rwm"},
		{Allow: true, Type: "c", Major: &api.OptionalInt64{Value: 195}, Minor: &api.OptionalInt64{Value: 1}, Access: "rw"},
	}}
	for _, tc := range []struct {
		name   string
		mutate func(*config.Config)
		// holderEnv is what the first container asks for.
		holderEnv string
		build     func(c *api.Container)
		wantErr   string // "" = admitted
		wantHeld  map[string]string
	}{
		{
			name: "all vs held GPU", holderEnv: "NVIDIA_VISIBLE_DEVICES=2",
			build:   func(c *api.Container) { c.Env = append(c.Env, "NVIDIA_VISIBLE_DEVICES=all") },
			wantErr: "GPU 2 (" + gpuUUID(2) + ") is held by ml/a/main (id holder-1)",
		},
		{
			name: "CDI annotation all vs held GPU", holderEnv: "NVIDIA_VISIBLE_DEVICES=0",
			build: func(c *api.Container) {
				c.Annotations = map[string]string{"cdi.k8s.io/nvidia-device-plugin_c": "nvidia.com/gpu=all"}
			},
			wantErr: "GPU 0 (" + gpuUUID(0) + ") is held",
		},
		{
			name: "held by all, a single GPU waits", holderEnv: "NVIDIA_VISIBLE_DEVICES=all",
			build:   func(c *api.Container) { c.Env = append(c.Env, "NVIDIA_VISIBLE_DEVICES=3") },
			wantErr: "GPU 3 (" + gpuUUID(3) + ") is held",
		},
		{
			name:      "privileged=all: allow-all device cgroup claims every GPU",
			mutate:    func(c *config.Config) { c.Policy.Privileged = config.PrivilegedAll },
			holderEnv: "NVIDIA_VISIBLE_DEVICES=1",
			build:     func(c *api.Container) { c.Linux.Resources = allowAll },
			wantErr:   "GPU 1 (" + gpuUUID(1) + ") is held",
		},
		{
			name:      "privileged=reject",
			mutate:    func(c *config.Config) { c.Policy.Privileged = config.PrivilegedReject },
			holderEnv: "NVIDIA_VISIBLE_DEVICES=1",
			build:     func(c *api.Container) { c.Linux.Resources = allowAll },
			wantErr:   "privileged",
		},
		{
			// Not privileged (privileged = "reject" does not refuse it), but
			// a device cgroup that lets it open /dev/nvidia1 is a request for
			// GPU 1 even without the node listed (mknod, a bind-mounted /dev):
			// it waits for the holder instead of sharing the GPU.
			name:      "unprivileged device rules are not privileged, but a GPU rule is a request",
			mutate:    func(c *config.Config) { c.Policy.Privileged = config.PrivilegedReject },
			holderEnv: "NVIDIA_VISIBLE_DEVICES=1",
			build:     func(c *api.Container) { c.Linux.Resources = denyAllThenNvidia1 },
			wantErr:   "GPU 1 (" + gpuUUID(1) + ") is held by ml/a/main (id holder-1)",
			wantHeld:  map[string]string{"1": "holder-1"},
		},
		{
			name: "device node /dev/nvidia1 (195:1) vs index 1", holderEnv: "NVIDIA_VISIBLE_DEVICES=1",
			build: func(c *api.Container) {
				c.Linux.Devices = []*api.LinuxDevice{
					{Path: "/dev/nvidiactl", Type: "c", Major: 195, Minor: 255},
					{Path: "/dev/nvidia-uvm", Type: "c", Major: 510, Minor: 0},
					{Path: "/dev/nvidia1", Type: "c", Major: 195, Minor: 1},
				}
			},
			wantErr: "GPU 1 (" + gpuUUID(1) + ") is held by ml/a/main (id holder-1)",
		},
		{
			name: "device node of a free GPU is admitted", holderEnv: "NVIDIA_VISIBLE_DEVICES=1",
			build: func(c *api.Container) {
				c.Linux.Devices = []*api.LinuxDevice{{Path: "/dev/nvidia0", Type: "c", Major: 195, Minor: 0}}
			},
			wantHeld: map[string]string{"0": "req-1", "1": "holder-1"},
		},
		{
			name: "CDI device list (containerd >= 2.3) vs index", holderEnv: "NVIDIA_VISIBLE_DEVICES=2",
			build:   func(c *api.Container) { c.CDIDevices = []*api.CDIDevice{{Name: "nvidia.com/gpu=2"}} },
			wantErr: "GPU 2 (" + gpuUUID(2) + ") is held",
		},
		{
			name: "volume-mount strategy vs UUID", holderEnv: "NVIDIA_VISIBLE_DEVICES=" + gpuUUID(3),
			build: func(c *api.Container) {
				c.Mounts = []*api.Mount{{Destination: "/var/run/nvidia-container-devices/3", Source: "/dev/null"}}
			},
			wantErr: "GPU 3 (" + gpuUUID(3) + ") is held",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rt := newRuntime(t, tc.mutate)
			rt.startPlugin()
			podA, podB := rt.addPod("a"), rt.addPod("b")
			require.NoError(t, rt.create(podA, container(podA, "main", "holder-1", tc.holderEnv)))
			req := container(podB, "main", "req-1")
			tc.build(req)
			err := rt.create(podB, req)
			if tc.wantErr == "" {
				require.NoError(t, err)
			} else {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tc.wantErr)
			}
			if tc.wantHeld != nil {
				assert.Equal(t, tc.wantHeld, rt.holders())
			}
		})
	}
}

// 8. With the ledger lock held by another process, the handler still answers
// within its deadline and refuses the create with "ledger busy" — the plugin
// is neither dropped nor fails open.
func TestLedgerBusyRefusedWithinDeadline(t *testing.T) {
	// lock_timeout longer than the request timeout: the request deadline
	// must bound the wait. The probe checks that bound and then ends the
	// wait at once, as the deadline would (no race against the runtime's
	// request timer).
	const lockTimeout = 10 * time.Minute
	rt := newRuntime(t, func(c *config.Config) { c.Ledger.LockTimeout = config.Duration{Duration: lockTimeout} })
	rt.deadlines = &deadlineProbe{}
	rt.startPlugin()
	podA, podB := rt.addPod("a"), rt.addPod("b")
	require.NoError(t, rt.create(podA, container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")))

	lk := rt.lockLedger()

	rt.deadlines.expiring.Store(true)
	err := rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=2"))
	rt.deadlines.expiring.Store(false)
	assertBoundedByRequest(t, rt.deadlines.expired(), lockTimeout)
	require.Error(t, err, "a create the guard could not decide must be refused, not let through")
	assert.Contains(t, err.Error(), "nri-gpu-guard: GPU ledger busy")
	assert.Contains(t, err.Error(), "ml/b/main")
	assert.NotContains(t, err.Error(), "failed to handle", "the plugin answered; the runtime did not time it out")

	// Containers without a GPU are not held up by the ledger.
	require.NoError(t, rt.create(podB, container(podB, "sidecar", "b-side")))

	require.NoError(t, lk.Unlock())
	// Still registered and enforcing: a conflicting create is refused by the
	// guard (a dropped plugin would let it through).
	require.ErrorContains(t, rt.create(podB, container(podB, "main", "b-2", "NVIDIA_VISIBLE_DEVICES=1")), "is held by ml/a/main")
	require.NoError(t, rt.create(podB, container(podB, "main", "b-3", "NVIDIA_VISIBLE_DEVICES=2")))
}

// Under release_on = "remove", a container restarted in the same pod takes
// over its stopped predecessor's claim; another pod waits until removal.
func TestReleaseOnRemoveRestartTakesOver(t *testing.T) {
	rt := newRuntime(t, func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove })
	rt.startPlugin()
	podA, podB := rt.addPod("a"), rt.addPod("b")
	first := container(podA, "main", "first-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, first))
	rt.start(podA, first, 1001)
	rt.stop(podA, first)
	assert.Equal(t, map[string]string{"1": "first-1"}, rt.holders())

	require.ErrorContains(t, rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=1")),
		"kept until the container is removed")
	rt.stopPod(podB) // the other pod gives up

	restart := container(podA, "main", "restart-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, restart))
	assert.Equal(t, map[string]string{"1": "restart-1"}, rt.holders())
	rt.remove(podA, first)
	assert.Equal(t, map[string]string{"1": "restart-1"}, rt.holders())
}

// Under release_on = "remove", a pod whose init container and app container
// get the same GPU (the device plugin hands an app container the devices of
// its init containers): the init container completes and is kept by the
// kubelet until the pod goes, and the app container takes its claim over
// instead of queueing behind it for good. The stopped init container's
// removal with the pod then ends nothing of the app's.
func TestReleaseOnRemoveAppTakesOverItsInitContainer(t *testing.T) {
	rt := newRuntime(t, func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove })
	rt.startPlugin()
	pod := rt.addPod("train")
	initC := container(pod, "init-check", "init-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(pod, initC))
	rt.start(pod, initC, 1001)
	rt.exit(initC)
	rt.stop(pod, initC)

	app := container(pod, "app", "app-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(pod, app), "the pod's own app container gets the GPU its finished init container held")
	assert.Equal(t, map[string]string{"1": "app-1"}, rt.holders())
	rt.start(pod, app, 1002)
	rt.remove(pod, initC)
	assert.Equal(t, map[string]string{"1": "app-1"}, rt.holders())
}

func TestConfigureFromRuntimeString(t *testing.T) {
	rt := newRuntime(t, nil)
	var built []config.Config
	p, err := New(Options{Config: rt.cfg, Setup: func(_ context.Context, cfg config.Config) (*guard.Guard, error) {
		built = append(built, cfg)
		return (&daemon.Builder{}).Setup(context.Background(), cfg)
	}})
	require.NoError(t, err)

	mask, err := p.Configure(context.Background(), "", "containerd", "v2.2.1")
	require.NoError(t, err)
	assert.Equal(t, EventsFor("containerd", "v2.2.1"), mask)
	require.Len(t, built, 1)
	assert.Equal(t, config.ConflictQueue, built[0].Policy.OnConflict)

	// Reconnect with the same (empty) configuration: nothing is rebuilt.
	_, err = p.Configure(context.Background(), "", "containerd", "v2.2.1")
	require.NoError(t, err)
	assert.Len(t, built, 1)

	doc := "[ledger]\ndir = \"" + rt.ledgerDir + "\"\n[policy]\non_conflict = \"reject\"\n" +
		"[devices]\nsource = \"static\"\nproc_root = \"" + t.TempDir() + "\"\n" + // fake GPUs: no driver tree
		"[[devices.static]]\nindex = 0\nuuid = \"" + gpuUUID(0) + "\"\nminor = 0\n"
	_, err = p.Configure(context.Background(), doc, "containerd", "v2.2.1")
	require.NoError(t, err)
	require.Len(t, built, 2)
	assert.Equal(t, config.ConflictReject, p.Guard().Config().Policy.OnConflict)

	_, err = p.Configure(context.Background(), "[policy]\nno_such_key = 1\n", "containerd", "v2.2.1")
	require.ErrorContains(t, err, "no_such_key")
	assert.Equal(t, config.ConflictReject, p.Guard().Config().Policy.OnConflict, "a bad document changes nothing")
}

// containerd carries the pid in StartContainer: the plugin does not ask it
// for PostStartContainer as well; any other runtime gets the full set.
// containerd 2.2 and later also validate the plugins' combined adjustments;
// older ones refuse a plugin subscribing to that, and so does a version
// that cannot be read.
func TestEventsForRuntime(t *testing.T) {
	containerd := EventsFor("containerd", "v2.1.4")
	assert.False(t, containerd.IsSet(api.Event_POST_START_CONTAINER))
	assert.True(t, containerd.IsSet(api.Event_START_CONTAINER))
	want := Events
	want.Clear(api.Event_POST_START_CONTAINER)
	assert.Equal(t, want, containerd, "only PostStartContainer is left out")
	assert.Equal(t, Events, EventsFor("cri-o", "1.34.0"))
	assert.True(t, Events.IsSet(api.Event_POST_START_CONTAINER))
	for version, validates := range map[string]bool{
		"v2.2.1": true, "2.2.0": true, "v2.4.2": true, "2.3.0-rc.1": true, "v3.0.0": true, "2.10.1+unknown": true,
		"v2.1.4": false, "1.7.35": false, "v2.0.0": false, "": false, "devel": false, "v2": false, "x.y.z": false,
	} {
		got := EventsFor("containerd", version)
		assert.Equal(t, validates, got.IsSet(api.Event_VALIDATE_CONTAINER_ADJUSTMENT), version)
		got.Clear(api.Event_VALIDATE_CONTAINER_ADJUSTMENT)
		assert.Equal(t, want, got, version)
	}
}

func TestEventMaskAvoidsNewEvents(t *testing.T) {
	for _, e := range []api.Event{api.Event_UPDATE_POD_SANDBOX, api.Event_POST_UPDATE_POD_SANDBOX, api.Event_VALIDATE_CONTAINER_ADJUSTMENT} {
		assert.False(t, Events.IsSet(e), "event %v breaks containerd 2.0/2.1", e)
	}
	for _, e := range []api.Event{api.Event_CREATE_CONTAINER, api.Event_STOP_CONTAINER, api.Event_REMOVE_CONTAINER,
		api.Event_STOP_POD_SANDBOX, api.Event_REMOVE_POD_SANDBOX, api.Event_START_CONTAINER} {
		assert.True(t, Events.IsSet(e))
	}
}

func TestDecisionContext(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name        string
		deadline    time.Duration // 0 = none
		lockTimeout time.Duration
		want        time.Duration // after now
	}{
		{"request deadline bounds", 2 * time.Second, 10 * time.Second, 1700 * time.Millisecond},
		{"lock timeout bounds", 2 * time.Second, 500 * time.Millisecond, 500 * time.Millisecond},
		{"short deadline keeps a quarter margin", 400 * time.Millisecond, time.Second, 300 * time.Millisecond},
		{"no deadline", 0, time.Second, time.Second},
		{"no limit: the request deadline bounds", 2 * time.Second, 0, 1700 * time.Millisecond},
		{"deadline already passed: a token attempt", -time.Second, time.Second, time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			end, bounded := decisionDeadline(now, now.Add(tc.deadline), tc.deadline != 0, tc.lockTimeout)
			require.True(t, bounded)
			assert.Equal(t, tc.want, end.Sub(now))
		})
	}
	// Neither a deadline nor a limit: nothing to bound by, and no tiny
	// timeout made up.
	_, bounded := decisionDeadline(now, time.Time{}, false, 0)
	assert.False(t, bounded)
	ctx, cancel := decisionContext(context.Background(), 0)
	defer cancel()
	_, ok := ctx.Deadline()
	assert.False(t, ok)
	// With a deadline, the context carries exactly what decisionDeadline
	// computes, never later than the request's own deadline.
	parent, cancelParent := context.WithTimeout(context.Background(), time.Hour)
	defer cancelParent()
	ctx, cancel = decisionContext(parent, 0)
	defer cancel()
	dl, ok := ctx.Deadline()
	require.True(t, ok)
	pdl, _ := parent.Deadline()
	assert.Equal(t, pdl.Add(-requestMargin), dl)
}

func TestSpecOf(t *testing.T) {
	c := &api.Container{
		Env:         []string{"A=1", "NVIDIA_VISIBLE_DEVICES=0"},
		Annotations: map[string]string{"cdi.k8s.io/x": "nvidia.com/gpu=1"},
		Mounts:      []*api.Mount{{Destination: "/var/run/nvidia-container-devices/2"}, {Destination: "/data"}},
		CDIDevices:  []*api.CDIDevice{{Name: "nvidia.com/gpu=3"}},
		Linux: &api.LinuxContainer{
			Devices:   []*api.LinuxDevice{{Path: "/dev/nvidia1", Type: "c", Major: 195, Minor: 1}},
			Resources: &api.LinuxResources{Devices: []*api.LinuxDeviceCgroup{{Allow: true, Access: "rwm"}}},
		},
	}
	req := specOf(c)
	assert.Equal(t, c.Env, req.Env)
	assert.Equal(t, c.Annotations, req.Annotations)
	assert.Equal(t, []string{"/var/run/nvidia-container-devices/2", "/data"}, req.Mounts)
	assert.Equal(t, []string{"nvidia.com/gpu=3"}, req.CDIDevices)
	require.Len(t, req.Devices, 1)
	assert.Equal(t, int64(195), req.Devices[0].Major)
	assert.True(t, req.Privileged)

	assert.False(t, specOf(&api.Container{}).Privileged)
}

func TestAllDevicesAllowed(t *testing.T) {
	i64 := func(v int64) *api.OptionalInt64 { return &api.OptionalInt64{Value: v} }
	for _, tc := range []struct {
		name  string
		rules []*api.LinuxDeviceCgroup
		want  bool
	}{
		{"none", nil, false},
		{"allow all rwm", []*api.LinuxDeviceCgroup{{Allow: true, Access: "rwm"}}, true},
		{"allow all, type a, empty access", []*api.LinuxDeviceCgroup{{Allow: true, Type: "a"}}, true},
		// Of an "a" rule the kernel reads nothing else: every device, rwm.
		{"allow all read only", []*api.LinuxDeviceCgroup{{Allow: true, Access: "r"}}, true},
		{"type a with numbers", []*api.LinuxDeviceCgroup{{Allow: false, Access: "rwm"}, {Allow: true, Type: "a", Major: i64(1), Minor: i64(3), Access: "r"}}, true},
		{"deny all then specific", []*api.LinuxDeviceCgroup{{Allow: false, Access: "rwm"},
			{Allow: true, Type: "c", Major: i64(195), Minor: i64(0), Access: "rwm"}}, false},
		{"allow all then deny all", []*api.LinuxDeviceCgroup{{Allow: true, Access: "rwm"}, {Allow: false, Access: "rwm"}}, false},
		{"deny all then allow all", []*api.LinuxDeviceCgroup{{Allow: false, Access: "rwm"}, {Allow: true, Access: "rwm"}}, true},
		{"wildcard major -1", []*api.LinuxDeviceCgroup{{Allow: true, Type: "a", Major: i64(-1), Minor: i64(-1), Access: "rwm"}}, true},
		{"all char devices only", []*api.LinuxDeviceCgroup{{Allow: true, Type: "c", Access: "rwm"}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, devices.AllowsAllDevices(deviceRules(tc.rules)))
		})
	}
}

func TestOwnerOf(t *testing.T) {
	pod := &api.PodSandbox{Id: "sb", Name: "p", Uid: "u", Namespace: "ns"}
	c := &api.Container{Id: "c1", Name: "main", PodSandboxId: "sb", Pid: 42,
		State: api.ContainerState_CONTAINER_CREATED, Linux: &api.LinuxContainer{CgroupsPath: "/k8s.io/c1"}}
	o := ownerOf(pod, c)
	assert.Equal(t, "ns", o.Namespace)
	assert.Equal(t, "u", o.PodUID)
	assert.Zero(t, o.Pid, "a container that is not running has no process to record")
	assert.Empty(t, o.Cgroup)
	c.State = api.ContainerState_CONTAINER_RUNNING
	o = ownerOf(pod, c)
	assert.Equal(t, 42, o.Pid)
	assert.Equal(t, "/k8s.io/c1", o.Cgroup)
	assert.True(t, strings.HasPrefix(ownerOf(nil, c).ContainerID, "c1"))
}

// BenchmarkDecision measures decisions through the real NRI runtime side
// over a unix socket: one op is a whole CreateContainer plus the
// StopContainer and RemoveContainer that follow it.
func BenchmarkDecision(b *testing.B) {
	for _, bc := range []struct {
		name string
		env  string
		// holder occupies GPU 1 first, so every create is refused.
		holder bool
	}{
		{name: "admit", env: "NVIDIA_VISIBLE_DEVICES=1"},
		{name: "refuse-queued", env: "NVIDIA_VISIBLE_DEVICES=1", holder: true},
		{name: "no-gpu"},
	} {
		b.Run(bc.name, func(b *testing.B) {
			rt := newRuntime(b, nil)
			rt.startPlugin()
			pod := rt.addPod("bench")
			if bc.holder {
				hp := rt.addPod("holder")
				require.NoError(b, rt.create(hp, container(hp, "main", "holder-1", bc.env)))
			}
			ctx := context.Background()
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				c := container(pod, "main", "bench-"+strconv.Itoa(i), bc.env)
				_, err := rt.nri.CreateContainer(ctx, &api.CreateContainerRequest{Pod: pod, Container: c})
				if bc.holder != (err != nil) {
					b.Fatalf("create %d: unexpected result %v", i, err)
				}
				if _, err := rt.nri.StopContainer(ctx, &api.StopContainerRequest{Pod: pod, Container: c}); err != nil {
					b.Fatal(err)
				}
				if err := rt.nri.RemoveContainer(ctx, &api.RemoveContainerRequest{Pod: pod, Container: c}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// proxy forwards unix connections to the runtime's socket; cut drops every
// connection, as a containerd restart does.
type proxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	conns  []net.Conn
}

func newProxy(t *testing.T, path, target string) *proxy {
	ln, err := net.Listen("unix", path)
	require.NoError(t, err)
	px := &proxy{ln: ln, target: target}
	t.Cleanup(func() { _ = ln.Close(); px.cut() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("unix", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			px.mu.Lock()
			px.conns = append(px.conns, c, u)
			px.mu.Unlock()
			go func() { _, _ = io.Copy(u, c); _ = u.Close() }()
			go func() { _, _ = io.Copy(c, u); _ = c.Close() }()
		}
	}()
	return px
}

func (px *proxy) cut() {
	px.mu.Lock()
	defer px.mu.Unlock()
	for _, c := range px.conns {
		_ = c.Close()
	}
	px.conns = nil
}

// External mode: Run registers, reports ready, reconnects after the
// connection to the runtime dropped (with a full Synchronize), and returns
// nil on cancellation (SIGTERM).
func TestRunReconnects(t *testing.T) {
	rt := newRuntime(t, nil)
	px := newProxy(t, filepath.Join(rt.dir, "px.sock"), rt.socket)
	podA, podB := rt.addPod("a"), rt.addPod("b")
	readyC := make(chan bool, 16)
	p, err := New(Options{Config: rt.cfg, Setup: (&daemon.Builder{Now: rt.clock.Now}).Setup,
		Ready: func(ok bool) { readyC <- ok }})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- p.Run(ctx, Identity{Name: "gpu-guard", Index: "90", Socket: filepath.Join(rt.dir, "px.sock")})
	}()

	waitReady := func(want bool) {
		t.Helper()
		for got := range readyC {
			if got == want {
				return
			}
		}
	}
	waitReady(true)
	rt.registered()
	holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, holder))

	// The connection drops; the holder is gone by the time the plugin is
	// back.
	rt.unlist(holder)
	px.cut()
	waitReady(false)
	waitReady(true)
	rt.registered()
	assert.Empty(t, rt.holders(), "the claim of the vanished holder was released at the new Synchronize")
	require.NoError(t, rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=1")))
	require.ErrorContains(t, rt.create(podA, container(podA, "main", "a-2", "NVIDIA_VISIBLE_DEVICES=1")),
		"is held by ml/b/main (id b-1)", "the reconnected plugin enforces")

	cancel()
	require.NoError(t, <-done)
}

// A corrupt ledger is moved aside and the request that found it is refused;
// the external plugin then reconnects at once, and the Synchronize that
// follows rebuilds the ledger from the runtime's running containers, so the
// running holder keeps its GPU against newcomers.
func TestCorruptLedgerRebuiltFromRuntime(t *testing.T) {
	rt := newRuntime(t, nil)
	podA, podB := rt.addPod("a"), rt.addPod("b")
	waitReady := runPlugin(t, rt)

	holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, holder))
	rt.start(podA, holder, 4242)

	statePath := filepath.Join(rt.ledgerDir, "ledger.json")
	require.NoError(t, os.WriteFile(statePath, []byte("{not json"), 0o600))

	err := rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=2"))
	require.ErrorContains(t, err, "corrupt", "the request that found the corruption is refused")

	waitReady(false)
	waitReady(true)
	quarantined, globErr := filepath.Glob(statePath + ".corrupt-*")
	require.NoError(t, globErr)
	require.Len(t, quarantined, 1, "the bad file is kept for a human")
	assert.Equal(t, map[string]string{"1": holder.Id}, rt.holders(), "the running holder was adopted again")
	require.ErrorContains(t, rt.create(podB, container(podB, "main", "b-2", "NVIDIA_VISIBLE_DEVICES=1")),
		"is held by ml/a/main (id holder-1)")
	require.NoError(t, rt.create(podB, container(podB, "main", "b-3", "NVIDIA_VISIBLE_DEVICES=2")))
}

// NVIDIA's NRI plugin injects the CDI devices a pod annotation
// nvidia.cdi.k8s.io/container.<name> names, and containerd never shows
// devices injected by one NRI plugin to another: the annotation must count,
// for the named container only.
func TestPodCDIAnnotationClaimsForItsContainer(t *testing.T) {
	rt := newRuntime(t, nil)
	rt.startPlugin()
	podA, podB := rt.addPod("a"), rt.addPod("b")
	require.NoError(t, rt.create(podA, container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")))

	podB.Annotations = map[string]string{"nvidia.cdi.k8s.io/container.worker": "nvidia.com/gpu=1"}
	require.NoError(t, rt.create(podB, container(podB, "sidecar", "b-sidecar")),
		"the annotation names another container of the pod")
	err := rt.create(podB, container(podB, "worker", "b-worker"))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "GPU 1 ("+gpuUUID(1)+") is held by ml/a/main (id holder-1)")
	assert.Equal(t, map[string]string{"1": "holder-1"}, rt.holders())
}

func TestWithPodCDIRequestLeavesContainerMapAlone(t *testing.T) {
	own := map[string]string{"a": "b"}
	pod := &api.PodSandbox{Annotations: map[string]string{
		"nvidia.cdi.k8s.io/container.main":  "nvidia.com/gpu=0",
		"nvidia.cdi.k8s.io/container.other": "nvidia.com/gpu=1",
	}}
	got := withPodCDIRequest(own, pod, "main")
	assert.Equal(t, map[string]string{"a": "b", "nvidia.cdi.k8s.io/container.main": "nvidia.com/gpu=0"}, got)
	assert.Equal(t, map[string]string{"a": "b"}, own, "the container's own annotations are not modified")
	assert.Equal(t, own, withPodCDIRequest(own, pod, "nomatch"))
	assert.Equal(t, own, withPodCDIRequest(own, nil, "main"))
}

// The pod-wide forms NVIDIA's NRI plugin reads when the container has no
// key of its own (container.*, pod, the bare domain: which depends on the
// release) all count; the container's own key, when there, is the only one
// every release reads.
func TestWithPodCDIRequestPodWideForms(t *testing.T) {
	pod := &api.PodSandbox{Annotations: map[string]string{
		"nvidia.cdi.k8s.io/container.*": "nvidia.com/gpu=0",
		"nvidia.cdi.k8s.io/pod":         "nvidia.com/gpu=1",
		"nvidia.cdi.k8s.io":             "nvidia.com/gpu=2",
		"unrelated":                     "x",
	}}
	assert.Equal(t, map[string]string{
		"nvidia.cdi.k8s.io/container.*": "nvidia.com/gpu=0",
		"nvidia.cdi.k8s.io/pod":         "nvidia.com/gpu=1",
		"nvidia.cdi.k8s.io/":            "nvidia.com/gpu=2",
	}, withPodCDIRequest(nil, pod, "main"))

	pod.Annotations["nvidia.cdi.k8s.io/container.main"] = "nvidia.com/gpu=3"
	assert.Equal(t, map[string]string{"nvidia.cdi.k8s.io/container.main": "nvidia.com/gpu=3"}, withPodCDIRequest(nil, pod, "main"))
}

// Through the plugin: a pod annotated for all its containers at once is
// checked like one naming the container.
func TestPodWideCDIAnnotationClaims(t *testing.T) {
	for _, key := range []string{"nvidia.cdi.k8s.io/container.*", "nvidia.cdi.k8s.io/pod", "nvidia.cdi.k8s.io"} {
		t.Run(key, func(t *testing.T) {
			rt := newRuntime(t, nil)
			rt.startPlugin()
			podA, podB := rt.addPod("a"), rt.addPod("b")
			require.NoError(t, rt.create(podA, container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")))
			podB.Annotations = map[string]string{key: "nvidia.com/gpu=1"}
			err := rt.create(podB, container(podB, "worker", "b-worker"))
			require.Error(t, err)
			assert.Contains(t, err.Error(), "GPU 1 ("+gpuUUID(1)+") is held by ml/a/main (id holder-1)")
		})
	}
}

// NVIDIA's NRI plugin injects every CDI name of the pod annotation after
// the guard answered, so an NVIDIA name whose GPUs cannot be told (the DRA
// driver's) is refused, not taken for no GPU: on containerd < 2.2 nothing
// checks the injected devices later.
func TestPodCDIAnnotationRefusesUntellableNvidiaName(t *testing.T) {
	rt := newRuntime(t, nil)
	rt.startPlugin()
	pod := rt.addPod("a")
	pod.Annotations = map[string]string{"nvidia.cdi.k8s.io/container.main": "k8s.gpu.nvidia.com/device=gpu-0"}
	err := rt.create(pod, container(pod, "main", "a-main"))
	require.Error(t, err)
	assert.Contains(t, err.Error(), `invalid device id "k8s.gpu.nvidia.com/device=gpu-0"`)
	assert.Empty(t, rt.holders())

	pod.Annotations = map[string]string{"nvidia.cdi.k8s.io/container.main": "vendor.com/foo=bar"}
	require.NoError(t, rt.create(pod, container(pod, "main", "a-main-2")), "another vendor's device is no GPU")
}

// StartContainer answers without waiting for the ledger: the holder's start
// record is committed in the background (here while another process holds
// the ledger lock), and the next event that touches the ledger waits for it,
// so the audit trail keeps the order of the events.
func TestStartRecordCommittedInTheBackground(t *testing.T) {
	rt := newRuntime(t, nil)
	pl := rt.startPlugin()
	podA := rt.addPod("a")
	holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, holder))

	lk := rt.lockLedger()
	holder.State, holder.Pid = api.ContainerState_CONTAINER_RUNNING, 1001
	require.NoError(t, rt.nri.StartContainer(context.Background(), &api.StartContainerRequest{Pod: podA, Container: holder}))
	expired, cancel := context.WithCancel(context.Background())
	cancel()
	require.Error(t, pl.p.starts.wait(expired), "answered with the start record still to commit")
	require.Zero(t, rt.state().Claims[0].Owner.Pid, "not committed while the lock is held")
	require.NoError(t, lk.Unlock())

	rt.stop(podA, holder)
	assert.Empty(t, rt.holders())
	recs, err := ledger.ReadAudit(filepath.Join(rt.ledgerDir, "audit.log"))
	require.NoError(t, err)
	var ops []string
	for _, r := range recs {
		if r.ContainerID == holder.Id {
			ops = append(ops, r.Op)
		}
	}
	require.Equal(t, []string{ledger.OpClaim, ledger.OpStarted, ledger.OpRelease}, ops)
}
