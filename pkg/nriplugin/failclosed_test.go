// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/nri/pkg/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/daemon"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// Tests of the ways the plugin could fail open: a handler that panics, that
// answers after the request deadline, or whose connection closes under it
// all get the plugin dropped by a released containerd (NRI <= v0.12.3),
// which then creates the container unchecked before 2.2 (2.2–2.4 refuse it:
// they ask the closed plugin to validate it, which fails), and every later
// one without the containerd drop-in. The runtime side in these tests is
// NRI v0.12.5, which honours the plugin's failure policy instead: it fails
// the request with "plugin ... failed to handle ..." and keeps the plugin.
// That error is what these tests must never see.

// panickingLiveness stands for a bug anywhere under a handler.
type panickingLiveness struct{}

func (panickingLiveness) Exited(liveness.Process) (bool, string) { panic("liveness check exploded") }

// A panic under CreateContainer is a refusal, not a dead plugin.
func TestHandlerPanicRefusesAndKeepsServing(t *testing.T) {
	rt := newRuntime(t, nil)
	rt.startPluginWith(panickingLiveness{})
	podA, podB := rt.addPod("a"), rt.addPod("b")
	holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, holder))
	rt.start(podA, holder, 4242)

	// The conflict makes the guard ask the liveness check about the holder.
	err := rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=1"))
	require.Error(t, err, "a create whose handler panicked must be refused")
	assert.Contains(t, err.Error(), "internal error in CreateContainer")

	// Still registered and enforcing.
	require.NoError(t, rt.create(podB, container(podB, "main", "b-2", "NVIDIA_VISIBLE_DEVICES=2")))
	assert.Equal(t, map[string]string{"1": "holder-1", "2": "b-2"}, rt.holders())
}

// Stop, Remove and pod events wait for the ledger lock no longer than the
// request deadline allows, whatever lock_timeout says: a late answer gets
// the plugin dropped and the next conflicting create through unchecked.
//
// The test does not race the runtime's request timer against the plugin's
// margin: the probe checks that each handler's ledger work ends before the
// request's deadline (not after lock_timeout), then ends that work at once,
// as the deadline would, while the lock is held.
func TestReleaseHandlersAnswerWithinDeadline(t *testing.T) {
	for _, tc := range []struct {
		name  string
		event func(rt *runtime, pod *api.PodSandbox, c *api.Container)
	}{
		{"StopContainer", func(rt *runtime, pod *api.PodSandbox, c *api.Container) { rt.stop(pod, c) }},
		{"RemoveContainer", func(rt *runtime, pod *api.PodSandbox, c *api.Container) { rt.remove(pod, c) }},
		{"StopPodSandbox", func(rt *runtime, pod *api.PodSandbox, _ *api.Container) { rt.stopPod(pod) }},
		{"StartContainer", func(rt *runtime, pod *api.PodSandbox, c *api.Container) { rt.start(pod, c, 4242) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const lockTimeout = 10 * time.Minute
			rt := newRuntime(t, func(c *config.Config) { c.Ledger.LockTimeout = config.Duration{Duration: lockTimeout} })
			rt.deadlines = &deadlineProbe{}
			rt.startPlugin()
			podA, podB := rt.addPod("a"), rt.addPod("b")
			holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")
			require.NoError(t, rt.create(podA, holder))

			lk := rt.lockLedger()
			// Fails to reach the ledger and answers: the harness requires
			// the runtime to report no error for the event.
			rt.deadlines.expiring.Store(true)
			tc.event(rt, podA, holder)
			rt.deadlines.expiring.Store(false)
			require.NoError(t, lk.Unlock())
			assertBoundedByRequest(t, rt.deadlines.expired(), lockTimeout)

			// The plugin is still there: a dropped plugin would let the
			// conflicting create through. A failed release is due, and the
			// next create that needs the ledger retries it first (see
			// TestFailedReleaseIsRetried); a start releases nothing.
			if tc.name == "StartContainer" {
				require.ErrorContains(t, rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=1")),
					"is held by ml/a/main")
				return
			}
			require.NoError(t, rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=1")))
			podC := rt.addPod("c")
			require.ErrorContains(t, rt.create(podC, container(podC, "main", "c-1", "NVIDIA_VISIBLE_DEVICES=1")),
				"is held by ml/b/main")
		})
	}
}

// assertBoundedByRequest checks that at least one handler ran while the probe
// expired its work, and that each one's ledger work was to end before the
// request's deadline, which came before lock_timeout would have ended it.
func assertBoundedByRequest(t *testing.T, calls []deadlineCall, lockTimeout time.Duration) {
	t.Helper()
	require.NotEmpty(t, calls, "no handler did ledger work")
	for _, c := range calls {
		require.False(t, c.request.IsZero(), "the runtime sends every request with a deadline")
		assert.Equal(t, lockTimeout, c.lockTimeoutUsed)
		assert.True(t, c.decision.Before(c.request), "ledger work ends %v before the request deadline", c.request.Sub(c.decision))
		assert.True(t, c.request.Before(c.at.Add(lockTimeout)), "the request deadline, not lock_timeout, bounds the wait")
	}
}

// The request that finds the ledger corrupt is refused, and so is every
// create after it until the runtime's Synchronize has rebuilt the ledger:
// the empty ledger that replaced the bad one knows no holder.
func TestCorruptLedgerRefusesCreatesUntilSynchronized(t *testing.T) {
	rt := newRuntime(t, nil)
	rt.startPlugin()
	podA, podB := rt.addPod("a"), rt.addPod("b")
	require.NoError(t, rt.create(podA, container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")))
	require.NoError(t, os.WriteFile(filepath.Join(rt.ledgerDir, "ledger.json"), []byte("{not json"), 0o600))

	require.ErrorContains(t, rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=2")), "corrupt")
	err := rt.create(podB, container(podB, "main", "b-2", "NVIDIA_VISIBLE_DEVICES=1"))
	require.Error(t, err, "decided against the empty ledger, this would take the holder's GPU")
	assert.Contains(t, err.Error(), "being rebuilt")
	l, err := ledger.OpenReadOnly(rt.ledgerDir, ledger.Options{Now: rt.clock.Now})
	require.NoError(t, err)
	_, err = l.Snapshot(context.Background())
	require.ErrorIs(t, err, ledger.ErrNeedsRecovery, "the ledger is not read as empty meanwhile")
}

// SIGTERM while a create is in flight: the handler answers before the
// connection closes. Closed under it, containerd would drop the plugin and
// (before 2.2) create the container unchecked.
func TestShutdownLetsRequestInFlightAnswer(t *testing.T) {
	rt := newRuntime(t, func(c *config.Config) { c.Ledger.LockTimeout = config.Duration{Duration: 10 * time.Second} })
	podA := rt.addPod("a")
	readyC := make(chan bool, 16)
	p, err := New(Options{Config: rt.cfg, Setup: (&daemon.Builder{Now: rt.clock.Now}).Setup,
		Ready: func(ok bool) { readyC <- ok }})
	require.NoError(t, err)
	creating := make(chan struct{}, 1)
	p.entered = func(h string) {
		if h == "CreateContainer" {
			creating <- struct{}{}
		}
	}
	// The create's ledger work ends when the test says so (as its deadline
	// would), after the shutdown began: no race against the runtime's timer.
	workCtx := make(chan context.CancelFunc, 1)
	p.decisionCtx = func(ctx context.Context, limit time.Duration) (context.Context, context.CancelFunc) {
		dctx, cancel := decisionContext(ctx, limit)
		workCtx <- cancel
		return dctx, cancel
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx, Identity{Name: "gpu-guard", Index: "90", Socket: rt.socket}) }()
	for ok := range readyC {
		if ok {
			break
		}
	}
	rt.registered()

	lk := rt.lockLedger()
	defer func() { _ = lk.Unlock() }()

	errC := make(chan error, 1)
	go func() {
		_, err := rt.nri.CreateContainer(context.Background(), &api.CreateContainerRequest{Pod: podA,
			Container: container(podA, "main", "a-1", "NVIDIA_VISIBLE_DEVICES=1")})
		errC <- err
	}()
	<-creating
	endWork := <-workCtx
	cancel() // SIGTERM
	endWork()
	err = <-errC
	require.Error(t, err, "the create in flight was let through unchecked")
	assert.Contains(t, err.Error(), "GPU ledger busy", "the plugin's own answer, not a broken connection")
	require.NoError(t, <-done)
}
