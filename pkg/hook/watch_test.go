// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"bytes"
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// livenessFunc is a guard.Liveness from a function.
type livenessFunc func(p liveness.Process) (bool, string)

func (f livenessFunc) Exited(p liveness.Process) (bool, string) { return f(p) }

// exitedByPid reports the named holders of TestWatcherDue as exited; they
// are told apart by pid ("holder" is 4242, "z" is 7).
func exitedByPid(exited map[string]bool) guard.Liveness {
	names := map[int]string{4242: "holder", 7: "z"}
	return livenessFunc(func(p liveness.Process) (bool, string) {
		return exited[names[p.Pid]], ""
	})
}

func TestWatcherDue(t *testing.T) {
	gpu2 := devices.Device{UUID: "GPU-22222222-0000-4000-8000-000000000002", Index: "2", Kind: devices.KindGPU}
	mig1 := devices.Device{UUID: "MIG-11111111-0000-4000-8000-0000000000a0", Index: "1:0", Kind: devices.KindMIG, Parent: gpu1.UUID}
	started := ledger.Owner{ContainerID: "holder", Pid: 4242, PidStart: 9, FrontEnd: ledger.FrontEndHook}
	me := ledger.Waiter{Key: "me", Seq: 5, Devices: []devices.Device{gpu1}, LastSeen: t0, FirstSeen: t0}
	other := ledger.Waiter{Key: "other", Seq: 3, Devices: []devices.Device{gpu1}, LastSeen: t0, FirstSeen: t0}
	base := ledger.State{
		Claims:     []ledger.Claim{{Device: gpu1, Owner: started, Since: t0}},
		Waiters:    []ledger.Waiter{other, me},
		Generation: 10,
	}
	with := func(f func(st *ledger.State)) ledger.State {
		st := base
		st.Claims = append([]ledger.Claim(nil), base.Claims...)
		st.Waiters = append([]ledger.Waiter(nil), base.Waiters...)
		f(&st)
		return st
	}

	for _, tc := range []struct {
		name    string
		now     time.Duration // since the last Admit
		before  ledger.State  // read just before the last Admit
		current ledger.State
		readErr error
		exited  map[string]bool
		wantDue bool
		wantWhy string
	}{
		{name: "nothing changed", before: base, current: base},
		{
			name:   "only refreshes and the generation moved",
			before: base,
			current: with(func(st *ledger.State) {
				st.Generation = 14
				st.Waiters[0].LastSeen = t0.Add(time.Second)
				st.Waiters[1].LastSeen = t0.Add(time.Second)
			}),
		},
		{
			name: "another waiter's reservation deadline moved",
			before: with(func(st *ledger.State) {
				st.Reservations = []ledger.Reservation{{Device: gpu2, For: "x", Until: t0.Add(time.Minute)}}
			}),
			current: with(func(st *ledger.State) {
				st.Reservations = []ledger.Reservation{{Device: gpu2, For: "x", Until: t0.Add(2 * time.Minute)}}
			}),
		},
		{name: "holder released", before: base, current: with(func(st *ledger.State) { st.Claims = nil }), wantDue: true, wantWhy: "ledger changed"},
		{
			name: "a device reserved for me", before: base,
			current: with(func(st *ledger.State) {
				st.Claims = nil
				st.Reservations = []ledger.Reservation{{Device: gpu1, For: "me", Until: t0.Add(time.Minute)}}
			}),
			wantDue: true, wantWhy: "ledger changed",
		},
		{name: "a waiter ahead left", before: base, current: with(func(st *ledger.State) { st.Waiters = st.Waiters[1:] }), wantDue: true, wantWhy: "ledger changed"},
		{name: "I was dropped (and nothing else changed)", before: with(func(st *ledger.State) { st.Waiters = st.Waiters[:1] }),
			current: with(func(st *ledger.State) { st.Waiters = st.Waiters[:1] }), wantDue: true, wantWhy: "not queued"},
		{name: "refresh interval passed", now: 30 * time.Second, before: base, current: base, wantDue: true, wantWhy: "refresh"},
		{name: "ledger unreadable", before: base, readErr: errors.New("permission denied"), wantDue: true, wantWhy: "ledger unreadable"},
		{name: "holder exited", before: base, current: base, exited: map[string]bool{"holder": true}, wantDue: true, wantWhy: "holder exited"},
		{
			name: "a holder of another GPU exited: not my business",
			before: with(func(st *ledger.State) {
				st.Claims = append(st.Claims, ledger.Claim{Device: gpu2, Owner: ledger.Owner{ContainerID: "z", Pid: 7}})
			}),
			current: with(func(st *ledger.State) {
				st.Claims = append(st.Claims, ledger.Claim{Device: gpu2, Owner: ledger.Owner{ContainerID: "z", Pid: 7}})
			}),
			exited: map[string]bool{"z": true},
		},
		{
			name:    "a holder of a MIG instance of my GPU exited",
			before:  with(func(st *ledger.State) { st.Claims[0].Device = mig1 }),
			current: with(func(st *ledger.State) { st.Claims[0].Device = mig1 }),
			exited:  map[string]bool{"holder": true},
			wantDue: true, wantWhy: "holder exited",
		},
		{
			name:    "a never-started holder is not checked",
			before:  with(func(st *ledger.State) { st.Claims[0].Owner.Pid = 0 }),
			current: with(func(st *ledger.State) { st.Claims[0].Owner.Pid = 0 }),
			exited:  map[string]bool{"holder": true},
		},
		{
			name:    "a waiter past queue_ttl",
			now:     time.Second,
			before:  with(func(st *ledger.State) { st.Waiters[0].LastSeen = t0.Add(-15 * time.Minute) }),
			current: with(func(st *ledger.State) { st.Waiters[0].LastSeen = t0.Add(-15 * time.Minute) }),
			wantDue: true, wantWhy: "waiter expired",
		},
		{
			name: "a reservation past its deadline",
			before: with(func(st *ledger.State) {
				st.Reservations = []ledger.Reservation{{Device: gpu1, For: "other", Until: t0}}
			}),
			current: with(func(st *ledger.State) {
				st.Reservations = []ledger.Reservation{{Device: gpu1, For: "other", Until: t0}}
			}),
			wantDue: true, wantWhy: "reservation expired",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clock := &fakeClock{t: t0}
			reads := 0
			w := &watcher{
				snapshot: func(context.Context) (ledger.State, error) {
					reads++
					if reads == 1 {
						return tc.before, nil
					}
					return tc.current, tc.readErr
				},
				releasable:   guard.NewReleaseRule(config.Default(), exitedByPid(tc.exited)).Check,
				now:          clock.now,
				queueTTL:     15 * time.Minute,
				refreshEvery: 30 * time.Second,
			}
			w.before(context.Background(), "me")
			clock.advance(tc.now)
			due, why := w.due(context.Background(), "me")
			require.Equal(t, tc.wantDue, due, why)
			require.Contains(t, why, tc.wantWhy)
		})
	}
}

// TestWaiterWithWatcherAdmitsOnlyOnChange: a hook waiting behind a holder
// for many polls Admits once at the start, at each refresh, and when the
// holder leaves; not at every poll.
func TestWaiterWithWatcherAdmitsOnlyOnChange(t *testing.T) {
	clock := &fakeClock{t: t0}
	held := ledger.State{
		Claims:  []ledger.Claim{{Device: gpu1, Owner: holder.Owner}},
		Waiters: []ledger.Waiter{{Key: "c0ffee0123456789", Seq: 1, Devices: []devices.Device{gpu1}, LastSeen: t0}},
	}
	reserved := ledger.State{
		Reservations: []ledger.Reservation{{Device: gpu1, For: "c0ffee0123456789", Until: t0.Add(time.Hour)}},
		Waiters:      held.Waiters,
	}
	polls := 0
	f := &fakeGuard{clock: clock, script: []answer{queued(1, 1)}}
	var stderr bytes.Buffer
	w := newTestWaiter(f, &stderr)
	w.watch = &watcher{
		snapshot: func(context.Context) (ledger.State, error) {
			if polls >= 100 {
				return reserved, nil
			}
			return held, nil
		},
		now:          clock.now,
		queueTTL:     15 * time.Minute,
		refreshEvery: 30 * time.Second,
	}
	// Time passes at the polls here (one second each), not in Admit.
	w.gone = func() (bool, string) {
		polls++
		clock.advance(time.Second)
		if polls == 100 {
			f.script = []answer{admitted()}
		}
		return false, ""
	}
	w.waitTimeout = time.Hour
	require.NoError(t, w.run(context.Background()))
	// t=0, refreshes at 30s, 60s, 90s, then the reservation at poll 100.
	require.Equal(t, 5, f.admits)
}

func TestRefreshInterval(t *testing.T) {
	for _, tc := range []struct {
		queueTTL, reservationTTL, poll, want time.Duration
	}{
		{15 * time.Minute, 6 * time.Minute, 250 * time.Millisecond, 30 * time.Second},
		{time.Minute, 6 * time.Minute, 250 * time.Millisecond, 15 * time.Second},
		{time.Second, 6 * time.Minute, 2 * time.Second, 2 * time.Second},
		// The head of the queue renews its reservations well within
		// reservation_ttl, or it would lose its place while it waits.
		{15 * time.Minute, 20 * time.Second, 250 * time.Millisecond, 5 * time.Second},
	} {
		cfg := config.Default()
		cfg.Policy.QueueTTL = config.Duration{Duration: tc.queueTTL}
		cfg.Policy.ReservationTTL = config.Duration{Duration: tc.reservationTTL}
		cfg.Hook.PollInterval = config.Duration{Duration: tc.poll}
		require.Equal(t, tc.want, refreshInterval(cfg), "queue_ttl %s poll %s", tc.queueTTL, tc.poll)
	}
}

// TestWatcherFingerprintsWhatTheAdmitCommitted: with the ledger's committed
// state, a waiting hook reads nothing around its Admit, sees no change while
// nothing changes, and sees the holder leave (a commit of another process's
// ledger handle) at the next poll.
func TestWatcherFingerprintsWhatTheAdmitCommitted(t *testing.T) {
	ctx := context.Background()
	cfg := staticConfig(t)
	inv, err := devices.Discover(cfg.Devices, nil)
	require.NoError(t, err)
	holderSide, _, err := openGuard(cfg, inv)
	require.NoError(t, err)
	waiterSide, _, err := openGuard(cfg, inv)
	require.NoError(t, err)
	pid := os.Getpid()
	start, err := liveness.PidStart(liveness.DefaultProcRoot, pid)
	require.NoError(t, err)
	spec := devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=0"}}
	holder := ledger.Owner{ContainerID: "holder", FrontEnd: ledger.FrontEndHook, Pid: pid, PidStart: start}
	d, err := holderSide.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndHook, Owner: holder, Key: "holder", Spec: spec})
	require.NoError(t, err)
	require.Equal(t, guard.Admit, d.Result)

	reads := 0
	w := &watcher{
		snapshot: func(ctx context.Context) (ledger.State, error) {
			reads++
			return waiterSide.Ledger().Snapshot(ctx)
		},
		committed:    waiterSide.Ledger().Committed,
		releasable:   guard.NewReleaseRule(cfg, liveness.New("", liveness.DefaultProcRoot)).Check,
		now:          time.Now,
		queueTTL:     cfg.Policy.QueueTTL.Duration,
		refreshEvery: time.Hour,
	}
	me := ledger.Owner{ContainerID: "waiter", FrontEnd: ledger.FrontEndHook, Pid: pid, PidStart: start}
	w.before(ctx, "waiter")
	d, err = waiterSide.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndHook, Owner: me, Key: "waiter", Spec: spec})
	require.NoError(t, err)
	require.Equal(t, guard.Queue, d.Result)
	w.after("waiter")
	require.Zero(t, reads, "the Admit's own read is the only one")
	require.NotEmpty(t, w.last)

	due, why := w.due(ctx, "waiter")
	require.False(t, due, why)
	_, err = holderSide.RemovedExited(ctx, holder, func(ledger.Owner) bool { return false })
	require.NoError(t, err)
	due, why = w.due(ctx, "waiter")
	require.True(t, due)
	require.Equal(t, "ledger changed", why)
}

// A --wait restart queued behind its own earlier incarnation (another
// process was left in the cgroup the runtime names after the id) sees at
// its next poll that only its own process is left, and Admits: its rule
// (releasableFor) judges the holder as the guard's Admit does, without the
// requester's process. The rule of no requester counts that process and
// left the waiter polling until its next refresh.
func TestWatcherSeesItsOwnEarlierIncarnationGone(t *testing.T) {
	const cgroup = "/machine.slice/libpod-me.scope"
	earlier := ledger.Owner{ContainerID: "me", Pid: 100, PidStart: 1, Cgroup: cgroup, FrontEnd: ledger.FrontEndHook}
	restart := ledger.Owner{ContainerID: "me", Pid: 200, PidStart: 2, Cgroup: cgroup, FrontEnd: ledger.FrontEndHook}
	st := ledger.State{
		Claims:  []ledger.Claim{{Device: gpu1, Owner: earlier, Since: t0}},
		Waiters: []ledger.Waiter{{Key: "me", Seq: 1, Devices: []devices.Device{gpu1}, Owner: restart, LastSeen: t0, FirstSeen: t0}},
	}
	// The cgroup holds the restart's process alone.
	live := livenessFunc(func(p liveness.Process) (bool, string) {
		return p.Successor == restart.Pid, "cgroup holds pid 200"
	})
	rule := guard.NewReleaseRule(config.Default(), live)
	for _, tc := range []struct {
		name    string
		rule    func(ledger.Owner) guard.Verdict
		wantDue bool
	}{
		{"bound to its requester", releasableFor(rule, restart), true},
		{"without a requester", rule.Check, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clock := &fakeClock{t: t0}
			w := &watcher{
				snapshot:     func(context.Context) (ledger.State, error) { return st, nil },
				releasable:   tc.rule,
				now:          clock.now,
				queueTTL:     15 * time.Minute,
				refreshEvery: 30 * time.Second,
			}
			w.before(context.Background(), "me")
			clock.advance(time.Second)
			due, why := w.due(context.Background(), "me")
			require.Equal(t, tc.wantDue, due, why)
			if tc.wantDue {
				require.Equal(t, "holder exited", why)
			}
		})
	}
}
