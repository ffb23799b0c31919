// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"context"
	"maps"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/nri/pkg/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/daemon"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// runPlugin runs an external plugin with Run (which reconnects for a resync)
// and returns a function waiting for its next readiness report of want.
func runPlugin(t *testing.T, rt *runtime) (waitReady func(want bool)) {
	t.Helper()
	return runPluginWith(t, rt, nil)
}

// runPluginWith is runPlugin with adjust applied to the plugin before it
// runs.
func runPluginWith(t *testing.T, rt *runtime, adjust func(p *Plugin)) (waitReady func(want bool)) {
	t.Helper()
	waitReady, _ = runPluginNoWait(t, rt, adjust)
	waitReady(true)
	return waitReady
}

// runPluginNoWait is runPluginWith without the wait for the first
// readiness report; stop ends Run and waits for it to return (it is also
// called at cleanup).
func runPluginNoWait(t *testing.T, rt *runtime, adjust func(p *Plugin)) (waitReady func(want bool), stop func()) {
	t.Helper()
	return runPluginOn(t, rt, &daemon.Builder{}, adjust)
}

// runPluginOn is runPluginNoWait with the guard built by b (its clock and
// liveness check are the runtime's).
func runPluginOn(t *testing.T, rt *runtime, b *daemon.Builder, adjust func(p *Plugin)) (waitReady func(want bool), stop func()) {
	t.Helper()
	readyC := make(chan bool, 16)
	b.Now, b.Liveness = rt.clock.Now, liveness.New(rt.cgroupRoot, filepath.Join(rt.dir, "proc"))
	p, err := New(Options{Config: rt.cfg, Setup: b.Setup, Ready: func(ok bool) { readyC <- ok }})
	require.NoError(t, err)
	if adjust != nil {
		adjust(p)
	}
	rt.running = append(rt.running, p)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx, Identity{Name: "gpu-guard", Index: "90", Socket: rt.socket}) }()
	var stopOnce sync.Once
	stop = func() {
		stopOnce.Do(func() {
			cancel()
			select {
			case err := <-done:
				assert.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Errorf("Run did not return within 30s of its context's end")
			}
		})
	}
	t.Cleanup(stop)
	waitReady = func(want bool) {
		t.Helper()
		deadline := time.After(30 * time.Second)
		for {
			select {
			case got := <-readyC:
				if got == want {
					if want {
						rt.registered()
					}
					return
				}
			case <-deadline:
				t.Fatalf("the plugin never became ready=%v", want)
			}
		}
	}
	return waitReady, stop
}

// startAfreshElsewhere is another process (an operator's `gpu-guard-ctl
// recover --reset`) that starts the ledger afresh, and an OCI hook whose
// next update writes a fresh state that knows only its own claim, on GPU 3.
func startAfreshElsewhere(t *testing.T, rt *runtime) {
	t.Helper()
	other, err := ledger.Open(rt.ledgerDir, ledger.Options{Now: rt.clock.Now})
	require.NoError(t, err)
	_, err = other.Reset(context.Background(), "test: started afresh elsewhere")
	require.NoError(t, err)
	hookCtr := ledger.Owner{ContainerID: "hook-1", FrontEnd: ledger.FrontEndHook}
	gpu3 := devices.Device{UUID: gpuUUID(3), Index: "3", Kind: devices.KindGPU}
	require.NoError(t, other.Update(context.Background(), func(tx *ledger.Tx) error {
		_, err := tx.Claim("", hookCtr, []devices.Device{gpu3}, "hook")
		return err
	}))
}

// afreshNotices are the two ways the plugin reaches the ledger after
// another process started it afresh: a create (refused, deciding nothing)
// or the release of a holder that stopped.
var afreshNotices = []struct {
	name   string
	notice func(t *testing.T, rt *runtime, podB, podC *api.PodSandbox, other *api.Container)
}{
	{"create", func(t *testing.T, rt *runtime, podB, _ *api.PodSandbox, _ *api.Container) {
		err := rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=2"))
		require.ErrorContains(t, err, "being rebuilt", "the create that finds the new lineage decides nothing")
	}},
	{"release", func(t *testing.T, rt *runtime, _, podC *api.PodSandbox, other *api.Container) {
		rt.stop(podC, other)
	}},
}

// runningHolders creates and starts holder-1 on GPU 1 in podA and other-1
// on GPU 0 in podC.
func runningHolders(t *testing.T, rt *runtime, podA, podC *api.PodSandbox) (holder, other *api.Container) {
	t.Helper()
	holder = container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, holder))
	rt.start(podA, holder, 4242)
	other = container(podC, "main", "other-1", "NVIDIA_VISIBLE_DEVICES=0")
	require.NoError(t, rt.create(podC, other))
	rt.start(podC, other, 4343)
	return holder, other
}

// checkRebuilt checks a ledger rebuilt after startAfreshElsewhere and the
// notice named notice: the running holders are adopted again (other only
// if its stop was not the notice), the hook's claim is kept, a newcomer on
// the holder's GPU is refused and one on GPU 2 admitted.
func checkRebuilt(t *testing.T, rt *runtime, notice string, podB *api.PodSandbox, holder, other *api.Container) {
	t.Helper()
	want := map[string]string{"1": holder.Id, "3": "hook-1"}
	if notice == "create" {
		want["0"] = other.Id
	}
	assert.Equal(t, want, rt.holders(), "the running holders were adopted again, the hook's claim kept")
	require.ErrorContains(t, rt.create(podB, container(podB, "main", "b-2", "NVIDIA_VISIBLE_DEVICES=1")),
		"is held by ml/a/main (id holder-1)")
	require.NoError(t, rt.create(podB, container(podB, "main", "b-3", "NVIDIA_VISIBLE_DEVICES=2")))
}

// Another process quarantines the corrupt ledger and writes a fresh state:
// the plugin's next handler that reaches the ledger (a create or a release)
// notices the new lineage before deciding anything, the plugin refuses
// creations, reconnects, and the runtime's Synchronize re-adopts the running
// holder, so that a newcomer on its GPU is refused again.
func TestLedgerStartedAfreshElsewhereRebuiltFromRuntime(t *testing.T) {
	for _, tc := range afreshNotices {
		t.Run(tc.name, func(t *testing.T) {
			rt := newRuntime(t, nil)
			podA, podB, podC := rt.addPod("a"), rt.addPod("b"), rt.addPod("c")
			waitReady := runPlugin(t, rt)

			holder, other := runningHolders(t, rt, podA, podC)

			startAfreshElsewhere(t, rt)
			require.Equal(t, map[string]string{"3": "hook-1"}, rt.holders(), "the fresh state forgot the running holders")

			tc.notice(t, rt, podB, podC, other)
			waitReady(false)
			waitReady(true)

			checkRebuilt(t, rt, tc.name, podB, holder, other)
		})
	}
}

// A plugin launched by containerd cannot reconnect for a new Synchronize
// (only a containerd restart relaunches it). When another process starts
// the ledger afresh, it refuses creations, rebuilds the ledger in place from
// the containers it tracks (the running holders; not the one that stopped
// before, nor the one whose stop brought the news) on the same connection,
// and enforces again.
func TestLaunchedPluginRebuildsTheLedgerInPlace(t *testing.T) {
	for _, tc := range afreshNotices {
		t.Run(tc.name, func(t *testing.T) {
			rt := newRuntime(t, nil)
			podA, podB, podC, podE := rt.addPod("a"), rt.addPod("b"), rt.addPod("c"), rt.addPod("e")
			var syncs atomic.Int32
			waitReady := runPluginWith(t, rt, func(p *Plugin) {
				p.forceInPlace = true
				p.entered = func(handler string) {
					if handler == "Synchronize" {
						syncs.Add(1)
					}
				}
			})

			holder, other := runningHolders(t, rt, podA, podC)
			gone := container(podE, "main", "gone-1", "NVIDIA_VISIBLE_DEVICES=2")
			require.NoError(t, rt.create(podE, gone))
			rt.start(podE, gone, 4444)
			rt.stop(podE, gone)

			startAfreshElsewhere(t, rt)
			require.Equal(t, map[string]string{"3": "hook-1"}, rt.holders(), "the fresh state forgot the running holders")

			tc.notice(t, rt, podB, podC, other)
			waitReady(false)
			waitReady(true)

			assert.Equal(t, int32(1), syncs.Load(), "rebuilt on the same connection, without a new Synchronize")
			for _, c := range rt.state().Claims {
				if c.Owner.ContainerID == holder.Id {
					assert.Equal(t, 4242, c.Owner.Pid, "the holder's process is known again")
				}
			}
			// b-3 asks for GPU 2, whose holder stopped before the reset:
			// it is not adopted back.
			checkRebuilt(t, rt, tc.name, podB, holder, other)
		})
	}
}

// exemptRecorder is an ExemptTracker that keeps the set it is told.
type exemptRecorder struct {
	mu  sync.Mutex
	ids map[string]bool
}

func (r *exemptRecorder) SetExempt(id, _ string, exempt bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if exempt {
		r.ids[id] = true
	} else {
		delete(r.ids, id)
	}
}

func (r *exemptRecorder) ResetExempt(cgroups map[string]string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ids = map[string]bool{}
	for id := range cgroups {
		r.ids[id] = true
	}
}

func (r *exemptRecorder) set() map[string]bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return maps.Clone(r.ids)
}

// The containers of exempt namespaces that run are told to the GPU
// observer (they use GPUs without claims): those listed at Synchronize,
// those created since, until removed.
func TestExemptContainersAreTracked(t *testing.T) {
	rt := newRuntime(t, func(c *config.Config) { c.Policy.ExemptNamespaces = []string{"monitoring"} })
	agent := rt.addPod("dcgm")
	agent.Namespace = "monitoring"
	listed := container(agent, "exporter", "exporter-1", "NVIDIA_VISIBLE_DEVICES=all")
	listed.State, listed.Pid = api.ContainerState_CONTAINER_RUNNING, 3000
	work := rt.addPod("work")
	other := container(work, "main", "work-1", "NVIDIA_VISIBLE_DEVICES=0")
	other.State, other.Pid = api.ContainerState_CONTAINER_RUNNING, 3001
	rt.mu.Lock()
	for _, c := range []*api.Container{listed, other} {
		rt.listed[c.Id] = c
		rt.order = append(rt.order, c.Id)
	}
	rt.mu.Unlock()

	rec := &exemptRecorder{ids: map[string]bool{"stale": true}}
	runPluginWith(t, rt, func(p *Plugin) { p.exempt = rec })
	assert.Equal(t, map[string]bool{"exporter-1": true}, rec.set(), "the Synchronize list replaces the set")

	second := container(agent, "exporter", "exporter-2", "NVIDIA_VISIBLE_DEVICES=all")
	require.NoError(t, rt.create(agent, second))
	require.NoError(t, rt.create(work, container(work, "side", "work-2", "NVIDIA_VISIBLE_DEVICES=1")))
	assert.Equal(t, map[string]bool{"exporter-1": true, "exporter-2": true}, rec.set())

	rt.stop(agent, listed)
	rt.remove(agent, listed)
	assert.Equal(t, map[string]bool{"exporter-2": true}, rec.set())
}
