// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"container/heap"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// The queue deadlock that partial reservations allowed, through the real
// Admit on a real ledger: X holds MIG 3:1, Y holds GPU 1; A asks for "3,1",
// then B for "3:0,1". B used to get the free 3:0 reserved, and A GPU 1 once
// Y stopped: each then waited for the other's reservation forever, and a
// newcomer for either idle GPU was refused "reserved". Now only A, the head
// of the queue, holds part of its request: GPU 3 from the moment X stops,
// so neither B nor a newcomer overtakes it.
func TestQueueMIGDeadlockThroughAdmit(t *testing.T) {
	e := newEnv(t, nil)
	x := ctr("ml", "x", "main", "xxxx000000000001")
	y := ctr("ml", "y", "main", "yyyy000000000001")
	require.Equal(t, guard.Admit, e.admit(x, visible("3:1")).Result)
	require.Equal(t, guard.Admit, e.admit(y, visible("1")).Result)

	attempt := map[string]int{}
	try := func(pod, spec string) guard.Decision {
		attempt[pod]++
		o := ctr("ml", pod, "main", fmt.Sprintf("%s-try-%d", pod, attempt[pod]))
		d := e.admit(o, visible(spec))
		if d.Result != guard.Admit {
			// containerd stops and removes the refused container.
			require.NoError(t, e.g.Stopped(ctx, o))
			require.NoError(t, e.g.Removed(ctx, o))
		}
		return d
	}
	require.Equal(t, guard.Queue, try("a", "3,1").Result)
	e.clock.advance(time.Second)
	d := try("b", "3:0,1")
	require.Equal(t, guard.Queue, d.Result)
	assert.Empty(t, e.state().Reservations, "B is not the head: 3:0 is not held for it")

	e.clock.advance(time.Minute)
	require.NoError(t, e.g.Stopped(ctx, x))
	assert.Equal(t, []string{"3:ml/uid-a/main"}, reservationIndices(e.state()), "GPU 3 is kept for A, the head, while GPU 1 is held")
	// So a newcomer for the idle 3:0 waits for A.
	d = try("n", "3:0")
	require.Equal(t, guard.Queue, d.Result, d.Message)
	assert.Equal(t, "reserved", d.Reason)
	assert.Contains(t, d.Message, "is reserved for ml/a/main (id a-try-1) through GPU 3 ("+uuid(3)+") (earlier in the queue, first in line: kept for it until the other devices it asks for are free)")
	e.clock.advance(time.Minute)
	require.NoError(t, e.g.Stopped(ctx, y))
	st := e.state()
	require.Len(t, st.Reservations, 2)
	for _, r := range st.Reservations {
		assert.Equal(t, "ml/uid-a/main", r.For, "both of A's GPUs are reserved for A")
	}

	// B, later in the queue, is refused: A is indeed earlier.
	d = try("b", "3:0,1")
	require.Equal(t, guard.Queue, d.Result)
	assert.Contains(t, d.Message, "is reserved for ml/a/main (id a-try-1) (earlier in the queue)")
	d = try("a", "3,1")
	require.Equal(t, guard.Admit, d.Result, d.Message)

	// A runs; once it stops, B (earlier than N and the newcomer C) gets both.
	c := try("c", "3:0")
	require.Equal(t, guard.Queue, c.Result)
	require.NoError(t, e.g.Stopped(ctx, ctr("ml", "a", "main", "a-try-2")))
	for _, pod := range []string{"c", "n"} {
		d = try(pod, "3:0")
		require.Equal(t, guard.Queue, d.Result)
		assert.Equal(t, "reserved", d.Reason)
	}
	require.Equal(t, guard.Admit, try("b", "3:0,1").Result)
}

// A requester first in its queue, refused for a reservation held by a later
// waiter (whose devices were all free first), is not told that waiter is
// "earlier in the queue". (A is not the head: H, earlier, waits for GPU 0.)
func TestReservedForALaterWaiterIsNotCalledEarlier(t *testing.T) {
	e := newEnv(t, nil)
	z := ctr("ml", "z", "main", "zzzz000000000001")
	require.Equal(t, guard.Admit, e.admit(z, visible("0")).Result)
	y := ctr("ml", "y", "main", "yyyy000000000001")
	require.Equal(t, guard.Admit, e.admit(y, visible("1")).Result)
	x := ctr("ml", "x", "main", "xxxx000000000001")
	require.Equal(t, guard.Admit, e.admit(x, visible("2")).Result)
	// H waits for GPU 0; A, next, for GPUs 1 and 2; B, later, for GPU 2 alone.
	h := ctr("ml", "h", "main", "h-try-1")
	require.Equal(t, guard.Queue, e.admit(h, visible("0")).Result)
	a := ctr("ml", "a", "main", "a-try-1")
	require.Equal(t, guard.Queue, e.admit(a, visible("1,2")).Result)
	b := ctr("ml", "b", "main", "b-try-1")
	require.Equal(t, guard.Queue, e.admit(b, visible("2")).Result)
	// GPU 2 freed: A cannot start (GPU 1 held), B can: reserved for B.
	require.NoError(t, e.g.Stopped(ctx, x))
	a.ContainerID = "a-try-2"
	d := e.admit(a, visible("1,2"))
	require.Equal(t, guard.Queue, d.Result)
	assert.Contains(t, d.Message, "queued at position 1 of 2")
	assert.Contains(t, d.Message, "is reserved for ml/b/main (id b-try-1) (later in the queue, but all it asks for was free first)")
	assert.NotContains(t, d.Message, "earlier in the queue")
}

// TestQueueLivenessThroughAdmit plays random schedules of requests for full
// GPUs and the MIG instances of GPU 3 through Admit, Stopped and Removed on
// a real ledger (the bulk of the schedules runs in pkg/ledger, in memory).
// Requesters retry like the kubelet (10 s doubling to 5 min). It checks that
// no two containers ever hold conflicting devices, that a requester is never
// refused while nobody held any of its devices for more than the maximum
// back-off (or had it reserved for another waiter), that only the head of
// the queue holds part of its request, and that everyone is admitted in
// the end.
func TestQueueLivenessThroughAdmit(t *testing.T) {
	n := 40
	if testing.Short() {
		n = 10
	}
	pool := []string{"0", "1", "2", "3", "3:0", "3:1"}
	var admissions, refusals int
	for seed := range uint64(n) {
		rng := rand.New(rand.NewPCG(seed, 42))
		e := newEnv(t, nil)
		resolve := func(spec string) []devices.Device {
			res, err := e.g.Resolve(visible(spec))
			require.NoError(t, err)
			var out []devices.Device
			for _, r := range res.Devices {
				out = append(out, r.Device)
			}
			return out
		}
		type req struct {
			pod, spec    string
			want         []devices.Device
			arrive, hold time.Duration
			attempts     int
			backoff      time.Duration
			admittedAt   time.Duration
			waitingSince time.Duration
			id           string
		}
		var reqs []*req
		for i := range 2 + rng.IntN(5) {
			spec := pool[rng.IntN(len(pool))]
			if rng.IntN(5) < 2 {
				other := pool[rng.IntN(len(pool))]
				if !devices.Conflicts(resolve(spec)[0], resolve(other)[0]) {
					spec += "," + other
				}
			}
			reqs = append(reqs, &req{pod: fmt.Sprintf("r%d", i), spec: spec, want: resolve(spec),
				arrive: time.Duration(rng.IntN(15*60)) * time.Second, hold: time.Duration(30+rng.IntN(30*60)) * time.Second,
				admittedAt: -1, waitingSince: -1})
		}
		var evs liveEvents
		seq := 0
		push := func(at time.Duration, stop bool, i int) {
			seq++
			heap.Push(&evs, liveEvent{at: at, seq: seq, stop: stop, i: i})
		}
		for i, r := range reqs {
			push(r.arrive, false, i)
		}
		start := e.clock.Now()
		lastBusy := map[string]time.Duration{}
		// lastReserved: when a device last had a conflicting reservation,
		// by the waiter it was for (a reservation for another waiter keeps
		// it busy: the head's may stand while it waits for the rest).
		lastReserved := map[string]map[string]time.Duration{}
		markHeld := func(at time.Duration, st ledger.State) {
			// What the head of the queue waits for is kept for it like a
			// reservation (a free MIG instance of a GPU it asks for whole).
			var head ledger.Waiter
			var headWants []devices.Device
			require.NoError(t, e.l.View(ctx, func(tx *ledger.Tx) error {
				head, headWants, _ = tx.HeadWaitsFor()
				return nil
			}))
			for _, r := range reqs {
				for _, d := range r.want {
					for _, h := range headWants {
						if devices.Conflicts(h, d) {
							if lastReserved[d.UUID] == nil {
								lastReserved[d.UUID] = map[string]time.Duration{}
							}
							lastReserved[d.UUID][head.Key] = at
						}
					}
					for _, c := range st.Claims {
						if devices.Conflicts(c.Device, d) {
							lastBusy[d.UUID] = at
						}
					}
					for _, res := range st.Reservations {
						if devices.Conflicts(res.Device, d) {
							if lastReserved[d.UUID] == nil {
								lastReserved[d.UUID] = map[string]time.Duration{}
							}
							lastReserved[d.UUID][res.For] = at
						}
					}
				}
			}
		}
		const bound = 5*time.Minute + time.Second
		for evs.Len() > 0 {
			ev := heap.Pop(&evs).(liveEvent)
			require.Less(t, ev.at, 24*time.Hour, "seed %d: still running after a day", seed)
			e.clock.advance(start.Add(ev.at).Sub(e.clock.Now()))
			markHeld(ev.at, e.state())
			r := reqs[ev.i]
			if ev.stop {
				require.NoError(t, e.g.Stopped(ctx, ctr("ml", r.pod, "main", r.id)))
				require.NoError(t, e.g.Removed(ctx, ctr("ml", r.pod, "main", r.id)))
				continue
			}
			r.attempts++
			r.id = fmt.Sprintf("%s-try-%d", r.pod, r.attempts)
			o := ctr("ml", r.pod, "main", r.id)
			d := e.admit(o, visible(r.spec))
			st := e.state()
			markHeld(ev.at, st)
			checkAdmitState(t, seed, st)
			if d.Result == guard.Admit {
				admissions++
				r.admittedAt = ev.at
				push(ev.at+r.hold, true, ev.i)
				continue
			}
			require.Equal(t, guard.Queue, d.Result, d.Message)
			refusals++
			require.NoError(t, e.g.Stopped(ctx, o))
			require.NoError(t, e.g.Removed(ctx, o))
			if r.waitingSince < 0 {
				r.waitingSince = ev.at
			}
			if ev.at-r.waitingSince >= bound {
				calm := true
				for _, dev := range r.want {
					if at, seen := lastBusy[dev.UUID]; seen && ev.at-at < bound {
						calm = false
					}
					for key, at := range lastReserved[dev.UUID] {
						if key != "ml/uid-"+r.pod+"/main" && ev.at-at < bound {
							calm = false
						}
					}
				}
				require.False(t, calm, "seed %d: %s (%s) refused at %s although nobody held its devices for %s: %s",
					seed, r.pod, r.spec, ev.at, bound, d.Message)
			}
			r.backoff = min(max(2*r.backoff, 10*time.Second), 5*time.Minute)
			push(ev.at+r.backoff, false, ev.i)
		}
		for _, r := range reqs {
			require.GreaterOrEqual(t, r.admittedAt, time.Duration(0), "seed %d: %s (%s) never admitted", seed, r.pod, r.spec)
		}
	}
	t.Logf("%d schedules through Admit: %d admissions, %d refusals", n, admissions, refusals)
}

// checkAdmitState: no conflicting holders; only the head of the queue (the
// earliest waiter not fully reserved) holds part of its request.
func checkAdmitState(t *testing.T, seed uint64, st ledger.State) {
	t.Helper()
	for i, a := range st.Claims {
		for _, b := range st.Claims[i+1:] {
			require.False(t, a.Owner.ContainerID != b.Owner.ContainerID && devices.Conflicts(a.Device, b.Device),
				"seed %d: %s holds %s and %s holds %s", seed, a.Owner.ContainerID, a.Device.Index, b.Owner.ContainerID, b.Device.Index)
		}
	}
	headSeen := false
	for _, w := range st.Waiters {
		n := 0
		for _, r := range st.Reservations {
			if r.For == w.Key {
				n++
			}
		}
		if n == len(w.Devices) {
			continue
		}
		if !headSeen {
			headSeen = true // the head: may hold part
			continue
		}
		require.Zero(t, n, "seed %d: %s, not the head, has %d of its %d devices reserved: %v",
			seed, w.Key, n, len(w.Devices), reservationList(st))
	}
}

func reservationIndices(st ledger.State) []string {
	var out []string
	for _, r := range st.Reservations {
		out = append(out, r.Device.Index+":"+r.For)
	}
	return out
}

func reservationList(st ledger.State) string {
	var out []string
	for _, r := range st.Reservations {
		out = append(out, r.Device.Index+":"+r.For)
	}
	slices.Sort(out)
	return strings.Join(out, " ")
}

type liveEvent struct {
	at   time.Duration
	seq  int
	stop bool
	i    int
}

type liveEvents []liveEvent

func (h liveEvents) Len() int { return len(h) }
func (h liveEvents) Less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	return h[i].seq < h[j].seq
}
func (h liveEvents) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *liveEvents) Push(x any)   { *h = append(*h, x.(liveEvent)) }
func (h *liveEvents) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
