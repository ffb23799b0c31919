// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// claimOrQueue is what the guard does with on_conflict = queue.
func claimOrQueue(tx *Tx, key string, o Owner, ds []devices.Device) (admitted bool, pos, total int) {
	if _, err := tx.Claim(key, o, ds, "env"); err == nil {
		return true, 0, 0
	}
	pos, total = tx.Enqueue(key, o, ds)
	return false, pos, total
}

func TestQueueFIFOWithReservationForTheHead(t *testing.T) {
	c := newClock()
	l := openTest(t, c)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("holder"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	// Three requesters arrive in order; each is queued behind the previous.
	for i, k := range []string{"a", "b", "c"} {
		update(t, l, func(tx *Tx) {
			ok, pos, total := claimOrQueue(tx, k, owner("ctr-"+k), devs(gpu(0)))
			require.False(t, ok)
			require.Equal(t, i+1, pos)
			require.Equal(t, i+1, total)
		})
		c.Advance(time.Second)
	}
	// A retry keeps the place.
	update(t, l, func(tx *Tx) {
		_, pos, total := claimOrQueue(tx, "b", owner("ctr-b2"), devs(gpu(0)))
		require.Equal(t, 2, pos)
		require.Equal(t, 3, total)
	})
	update(t, l, func(tx *Tx) { tx.Release("holder", "stop") })
	st := snapshot(t, l)
	require.Equal(t, map[string]string{gpu(0).UUID: "a"}, reservedFor(st), "the released device is reserved for the head")

	// Others are refused because of the reservation, in any order.
	for _, k := range []string{"c", "b"} {
		update(t, l, func(tx *Tx) {
			ok, _, _ := claimOrQueue(tx, k, owner("ctr-"+k), devs(gpu(0)))
			require.False(t, ok, "%s must not jump the queue", k)
		})
	}
	// A newcomer neither.
	update(t, l, func(tx *Tx) {
		ok, pos, total := claimOrQueue(tx, "d", owner("ctr-d"), devs(gpu(0)))
		require.False(t, ok)
		require.Equal(t, 4, pos)
		require.Equal(t, 4, total)
	})
	// The head is admitted; its reservation and waiter are gone.
	for i, k := range []string{"a", "b", "c", "d"} {
		update(t, l, func(tx *Tx) {
			ok, _, _ := claimOrQueue(tx, k, owner("ctr-"+k), devs(gpu(0)))
			require.True(t, ok, "%s is the head", k)
		})
		st := snapshot(t, l)
		require.Equal(t, map[string]string{gpu(0).UUID: "ctr-" + k}, holders(st))
		require.Empty(t, st.Reservations)
		require.Len(t, st.Waiters, 3-i)
		update(t, l, func(tx *Tx) { tx.Release("ctr-"+k, "stop") })
	}
	require.Empty(t, snapshot(t, l).Reservations)
}

func TestReservationExpiresWithItsWaiter(t *testing.T) {
	c := newClock()
	l, err := Open(t.TempDir(), Options{BootID: testBoot, Now: c.Now, ReservationTTL: 6 * time.Minute, QueueTTL: time.Hour})
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("holder"), devs(gpu(0)), "env")
		require.NoError(t, err)
		tx.Enqueue("a", owner("a"), devs(gpu(0)))
		tx.Enqueue("b", owner("b"), devs(gpu(0)))
		tx.Release("holder", "stop")
	})
	require.Equal(t, map[string]string{gpu(0).UUID: "a"}, reservedFor(snapshot(t, l)))

	c.Advance(6 * time.Minute) // exactly at the deadline: still valid
	update(t, l, func(tx *Tx) {})
	require.Equal(t, map[string]string{gpu(0).UUID: "a"}, reservedFor(snapshot(t, l)))

	c.Advance(time.Second) // past it: a did not come back in time
	update(t, l, func(tx *Tx) {})
	st := snapshot(t, l)
	require.Equal(t, map[string]string{gpu(0).UUID: "b"}, reservedFor(st))
	require.Equal(t, []string{"b"}, waiterKeys(st))

	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	var expired *AuditRecord
	for i := range recs {
		if recs[i].Op == OpReservationExpired {
			expired = &recs[i]
		}
	}
	require.NotNil(t, expired)
	require.Equal(t, "a", expired.Key)
	require.Equal(t, []string{gpu(0).UUID}, expired.Devices)

	// a's late retry queues it again at the tail.
	update(t, l, func(tx *Tx) {
		ok, pos, total := claimOrQueue(tx, "a", owner("a"), devs(gpu(0)))
		require.False(t, ok)
		require.Equal(t, 2, pos)
		require.Equal(t, 2, total)
	})
}

// The head of the queue keeps every device it asks for as it frees: a
// request for two GPUs is not overtaken by later requests for one of them,
// while a later request for a device it does not ask for is served at once.
func TestHeadKeepsItsFreeDevicesAndKeepsItsPlace(t *testing.T) {
	c := newClock()
	l, err := Open(t.TempDir(), Options{BootID: testBoot, Now: c.Now, ReservationTTL: 6 * time.Minute, QueueTTL: 15 * time.Minute})
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("holder"), devs(gpu(0)), "env")
		require.NoError(t, err)
		_, err = tx.Claim("", owner("other"), devs(gpu(2)), "env")
		require.NoError(t, err)
		ok, _, _ := claimOrQueue(tx, "a", owner("a"), devs(gpu(0), gpu(1)))
		require.False(t, ok)
	})
	require.Equal(t, map[string]string{gpu(1).UUID: "a"}, reservedFor(snapshot(t, l)),
		"a heads the queue: the free GPU 1 is kept for it while GPU 0 is held")
	update(t, l, func(tx *Tx) {
		ok, _, _ := claimOrQueue(tx, "b", owner("b"), devs(gpu(1)))
		require.False(t, ok, "b must not take a device the head waits with")
		ok, _, _ = claimOrQueue(tx, "e", owner("e"), devs(gpu(3)))
		require.True(t, ok, "a device the head does not ask for is served at once")
	})
	// a keeps retrying every 5 minutes for 40 minutes: it keeps its place
	// (although that is older than queue_ttl) and its reservation.
	for i := 0; i < 8; i++ {
		c.Advance(5 * time.Minute)
		update(t, l, func(tx *Tx) {
			ok, _, _ := claimOrQueue(tx, "a", owner("a"), devs(gpu(0), gpu(1)))
			require.False(t, ok)
			ok, _, _ = claimOrQueue(tx, "b", owner("b"), devs(gpu(1)))
			require.False(t, ok)
		})
		st := snapshot(t, l)
		require.Equal(t, []string{"a", "b"}, waiterKeys(st))
		require.Equal(t, map[string]string{gpu(1).UUID: "a"}, reservedFor(st))
	}
	// GPU 0 freed: both are a's in the commit that frees it; a request for
	// GPU 0 alone cannot take it.
	update(t, l, func(tx *Tx) { tx.Release("holder", "stop") })
	require.Equal(t, map[string]string{gpu(0).UUID: "a", gpu(1).UUID: "a"}, reservedFor(snapshot(t, l)))
	update(t, l, func(tx *Tx) {
		ok, _, _ := claimOrQueue(tx, "d", owner("d"), devs(gpu(0)))
		require.False(t, ok, "d must not jump the queue")
		ok, _, _ = claimOrQueue(tx, "a", owner("a"), devs(gpu(0), gpu(1)))
		require.True(t, ok)
	})
	st := snapshot(t, l)
	require.Equal(t, map[string]string{gpu(0).UUID: "a", gpu(1).UUID: "a", gpu(2).UUID: "other", gpu(3).UUID: "e"}, holders(st))
	require.Equal(t, []string{"b", "d"}, waiterKeys(st))
	require.Empty(t, st.Reservations, "b and d wait for a's GPUs")
}

// Only the head may hold part of its request: the next waiter, although
// one of its devices is free, gets nothing until it is the head, and a
// waiter that asks for a cordoned device is never the head.
func TestOnlyTheHeadHoldsPartOfItsRequest(t *testing.T) {
	c := newClock()
	l := openTest(t, c)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h0"), devs(gpu(0)), "env")
		require.NoError(t, err)
		_, err = tx.Claim("", owner("h2"), devs(gpu(2)), "env")
		require.NoError(t, err)
		_, _, err = tx.Cordon(gpu(5), CordonOperator, "maintenance", "test")
		require.NoError(t, err)
		tx.Enqueue("cordoned", owner("cordoned"), devs(gpu(5), gpu(4)))
		tx.Enqueue("a", owner("a"), devs(gpu(0), gpu(1)))
		tx.Enqueue("b", owner("b"), devs(gpu(2), gpu(3)))
	})
	require.Equal(t, map[string]string{gpu(1).UUID: "a"}, reservedFor(snapshot(t, l)),
		"a is the head (the earlier waiter asks for a cordoned GPU); b is not")
	update(t, l, func(tx *Tx) { tx.Release("h0", "stop") })
	require.Equal(t, map[string]string{gpu(0).UUID: "a", gpu(1).UUID: "a", gpu(3).UUID: "b"}, reservedFor(snapshot(t, l)),
		"a can start: b is the head now")
}

func TestQueueTTLDropsWaitersThatStopRetrying(t *testing.T) {
	c := newClock()
	l, err := Open(t.TempDir(), Options{BootID: testBoot, Now: c.Now, QueueTTL: 15 * time.Minute})
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("holder"), devs(gpu(0)), "env")
		require.NoError(t, err)
		tx.Enqueue("gone", owner("gone"), devs(gpu(0)))
		tx.Enqueue("alive", owner("alive"), devs(gpu(0)))
	})
	c.Advance(10 * time.Minute)
	update(t, l, func(tx *Tx) { tx.Enqueue("alive", owner("alive"), devs(gpu(0))) })
	c.Advance(5 * time.Minute) // gone: last seen exactly queue_ttl ago
	update(t, l, func(tx *Tx) {})
	require.Equal(t, []string{"gone", "alive"}, waiterKeys(snapshot(t, l)))
	c.Advance(time.Second)
	update(t, l, func(tx *Tx) {
		pos, total, ok := tx.Position("alive")
		require.True(t, ok)
		require.Equal(t, 1, pos, "expiry moved alive up")
		require.Equal(t, 1, total)
	})
	require.Equal(t, []string{"alive"}, waiterKeys(snapshot(t, l)))
	require.Contains(t, auditOps(t, l), OpExpired)

	// Expiry also happens on a View (explain) but is not written.
	c.Advance(16 * time.Minute)
	require.NoError(t, l.View(context.Background(), func(tx *Tx) error {
		require.Empty(t, tx.State().Waiters)
		return nil
	}))
	require.Len(t, snapshot(t, l).Waiters, 1)
}

func TestDropWaiters(t *testing.T) {
	l := openTest(t, newClock())
	a, b, other := owner("a"), owner("b"), owner("other")
	a.PodUID, a.PodSandboxID = "pod-1", "sb-1"
	b.PodUID, b.PodSandboxID = "pod-1", "sb-1"
	other.PodUID, other.PodSandboxID, other.FrontEnd = "pod-1", "sb-1", FrontEndHook // annotations
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("holder"), devs(gpu(0)), "env")
		require.NoError(t, err)
		tx.Enqueue("ns/pod-1/a", a, devs(gpu(0)))
		tx.Enqueue("ns/pod-1/b", b, devs(gpu(1), gpu(2))) // gets GPUs 1 and 2 reserved
		tx.Enqueue("other", other, devs(gpu(1)))
	})
	require.Equal(t, map[string]string{gpu(1).UUID: "ns/pod-1/b", gpu(2).UUID: "ns/pod-1/b"}, reservedFor(snapshot(t, l)))
	update(t, l, func(tx *Tx) {
		got := tx.DropPodWaiters(FrontEndNRI, "", "sb-1", "pod sandbox stopped")
		require.Len(t, got, 2)
		require.Empty(t, tx.DropPodWaiters(FrontEndNRI, "", "", "no pod named"))
	})
	st := snapshot(t, l)
	require.Equal(t, []string{"other"}, waiterKeys(st), "another front end's waiter naming the pod stays")
	require.Equal(t, map[string]string{gpu(1).UUID: "other"}, reservedFor(st), "the dropped waiter's reservation passes on")

	update(t, l, func(tx *Tx) {
		require.True(t, tx.DropWaiter("other", "container removed while waiting"))
		require.False(t, tx.DropWaiter("other", "again"))
	})
	st = snapshot(t, l)
	require.Empty(t, st.Waiters)
	require.Empty(t, st.Reservations)
}

func TestReleaseDoesNotDropTheRefusedRequestersWaiter(t *testing.T) {
	// containerd stops and removes a refused container by id; the requester
	// (keyed by pod and name) must stay queued.
	l := openTest(t, newClock())
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("holder"), devs(gpu(0)), "env")
		require.NoError(t, err)
		tx.Enqueue("ns/uid/ctr", owner("attempt-1"), devs(gpu(0)))
	})
	update(t, l, func(tx *Tx) { require.Empty(t, tx.Release("attempt-1", "stop")) })
	require.Equal(t, []string{"ns/uid/ctr"}, waiterKeys(snapshot(t, l)))
}

func TestPositionCountsConflictingWaitersOnly(t *testing.T) {
	l := openTest(t, newClock())
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h0"), devs(gpu(0)), "env")
		require.NoError(t, err)
		_, err = tx.Claim("", owner("h1"), devs(gpu(1)), "env")
		require.NoError(t, err)
		tx.Enqueue("w-gpu0", owner("a"), devs(gpu(0)))
		tx.Enqueue("w-gpu1", owner("b"), devs(gpu(1)))
		tx.Enqueue("w-mig00", owner("c"), devs(mig(0, 0)))
		tx.Enqueue("w-mig01", owner("d"), devs(mig(0, 1)))
		tx.Enqueue("w-both", owner("e"), devs(gpu(0), gpu(1)))
	})
	update(t, l, func(tx *Tx) {
		for _, tc := range []struct {
			key        string
			pos, total int
		}{
			{"w-gpu0", 1, 4},  // itself, both MIGs of GPU 0, w-both
			{"w-gpu1", 1, 2},  // itself, w-both
			{"w-mig00", 2, 3}, // w-gpu0 before it; w-both after; not the sibling MIG
			{"w-mig01", 2, 3},
			{"w-both", 5, 5},
		} {
			pos, total, ok := tx.Position(tc.key)
			require.True(t, ok, tc.key)
			require.Equal(t, [2]int{tc.pos, tc.total}, [2]int{pos, total}, tc.key)
		}
		_, _, ok := tx.Position("nobody")
		require.False(t, ok)
	})
}

func TestReservationsRespectMIG(t *testing.T) {
	for _, tc := range []struct {
		name     string
		held     []devices.Device // by holder0, holder1, ...; holder0 is released
		waiters  []devices.Device // in arrival order, keys w0, w1, ...
		reserved map[string]string
	}{
		{
			name: "sibling MIG heads both get their instance; the full GPU waits", held: devs(gpu(0)),
			waiters:  devs(mig(0, 0), mig(0, 1), gpu(0)),
			reserved: map[string]string{mig(0, 0).UUID: "w0", mig(0, 1).UUID: "w1"},
		},
		{
			name: "full GPU head blocks later MIG waiters", held: devs(gpu(0)),
			waiters:  devs(gpu(0), mig(0, 0)),
			reserved: map[string]string{gpu(0).UUID: "w0"},
		},
		{
			name: "a wholly freed GPU goes to the earlier full-GPU waiter", held: devs(mig(0, 0)),
			waiters:  devs(gpu(0), mig(0, 0)),
			reserved: map[string]string{gpu(0).UUID: "w0"},
		},
		{
			// The head cannot have GPU 0 reserved while 0:1 is held, but its
			// freed 0:0 is kept for it (keptForHead): before, w1 got 0:0,
			// and requests for GPU 0's instances could keep it from ever
			// being whole again.
			name: "a freed instance of a still partly held GPU is kept for the head asking for the GPU", held: devs(mig(0, 0), mig(0, 1)),
			waiters:  devs(gpu(0), mig(0, 0)),
			reserved: map[string]string{},
		},
		{
			name: "a freed instance goes to its own waiter when the head waits elsewhere", held: devs(mig(0, 0), mig(0, 1), gpu(1)),
			waiters:  devs(gpu(1), mig(0, 0)),
			reserved: map[string]string{mig(0, 0).UUID: "w1"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := openTest(t, newClock())
			update(t, l, func(tx *Tx) {
				for i, d := range tc.held {
					_, err := tx.Claim("", owner(fmt.Sprintf("holder%d", i)), devs(d), "env")
					require.NoError(t, err)
				}
				for i, d := range tc.waiters {
					tx.Enqueue(fmt.Sprintf("w%d", i), owner(fmt.Sprintf("c%d", i)), devs(d))
				}
				require.Empty(t, tx.State().Reservations, "nothing is free while the holders run")
				tx.Release("holder0", "stop")
			})
			st := snapshot(t, l)
			require.Equal(t, tc.reserved, reservedFor(st))
			// Only reserved waiters can claim.
			for i, d := range tc.waiters {
				key := fmt.Sprintf("w%d", i)
				isReserved := tc.reserved[d.UUID] == key
				err := l.View(context.Background(), func(tx *Tx) error {
					_, err := tx.Claim(key, owner(fmt.Sprintf("c%d", i)), devs(d), "env")
					return err
				})
				if isReserved {
					require.NoError(t, err, key)
				} else {
					require.True(t, isBusy(err), "%s: %v", key, err)
				}
			}
		})
	}
}

// A head asking for a whole GPU one of whose MIG instances is in use cannot
// have the GPU reserved, but nobody else is admitted on (or reserved) its
// free instances meanwhile, except a waiter that had one reserved before;
// once the GPU is whole again it is the head's.
func TestHeadAskingForAWholeGPUKeepsItsFreeInstances(t *testing.T) {
	l := openTest(t, newClock())
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("x"), devs(mig(0, 0)), "env")
		require.NoError(t, err)
		// r waits for 0:1, which is free: reserved for it at once.
		tx.Enqueue("r", owner("r"), devs(mig(0, 1)))
		require.Equal(t, map[string]string{mig(0, 1).UUID: "r"}, reservedFor(*tx.State()))
		// The head asks for GPU 0 whole.
		ok, _, _ := claimOrQueue(tx, "head", owner("h"), devs(gpu(0)))
		require.False(t, ok)
	})

	claimBy := func(key, id string, d devices.Device) error {
		return l.View(context.Background(), func(tx *Tx) error {
			_, err := tx.Claim(key, owner(id), devs(d), "env")
			return err
		})
	}
	err := claimBy("newcomer", "n", mig(0, 2))
	var be *BusyError
	require.ErrorAs(t, err, &be)
	require.Len(t, be.Busy, 1)
	b := be.Busy[0]
	require.Equal(t, mig(0, 2).UUID, b.Wanted.UUID)
	require.Nil(t, b.Holder)
	require.Nil(t, b.Reservation)
	require.NotNil(t, b.KeptFor, "0:2 is free but kept for the head")
	require.Equal(t, "head", b.KeptFor.Key)
	require.Equal(t, gpu(0).UUID, b.Through.UUID)
	require.Contains(t, err.Error(), `is kept for queued request "head", first in line for GPU 0`)

	// r had 0:1 reserved before the head asked: it is still admitted on it.
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("r", owner("r"), devs(mig(0, 1)), "env")
		require.NoError(t, err)
		tx.Release("r", "stop")
	})
	// Once freed, 0:1 is kept for the head too.
	require.ErrorAs(t, claimBy("newcomer", "n", mig(0, 1)), &be)
	require.Equal(t, "head", be.Busy[0].KeptFor.Key)
	// A waiter for a free instance is not reserved it either.
	update(t, l, func(tx *Tx) { tx.Enqueue("later", owner("l"), devs(mig(0, 1))) })
	require.Empty(t, reservedFor(snapshot(t, l)))
	// x's own container asking again for what it holds is not refused.
	require.NoError(t, claimBy("", "x", mig(0, 0)))

	// x stops: GPU 0 is whole and reserved for the head, which starts.
	update(t, l, func(tx *Tx) { tx.Release("x", "stop") })
	require.Equal(t, map[string]string{gpu(0).UUID: "head"}, reservedFor(snapshot(t, l)))
	require.NoError(t, claimBy("head", "h", gpu(0)))
}

// TestQueueInvariantsUnderRandomOperations drives random operations and checks
// after each commit, independently of the implementation, that no two
// containers hold conflicting devices and that every unheld device somebody
// waits for is reserved for that waiter or for an earlier one.
func TestQueueInvariantsUnderRandomOperations(t *testing.T) {
	c := newClock()
	l, err := Open(t.TempDir(), Options{BootID: testBoot, Now: c.Now, ReservationTTL: 6 * time.Minute, QueueTTL: 15 * time.Minute})
	require.NoError(t, err)
	pool := devs(gpu(0), gpu(1), mig(0, 0), mig(0, 1), gpu(2), mig(2, 0))
	rng := rand.New(rand.NewPCG(1, 2))
	steps := 600
	if testing.Short() {
		steps = 150
	}
	// Each requester asks for the same devices on every retry (one that
	// changes its devices keeps its place, but not a reservation already
	// handed to a later waiter: reservations are never taken back).
	const requesters = 12
	wants := make([][]devices.Device, requesters)
	for k := range wants {
		wants[k] = devs(pool[rng.IntN(len(pool))])
		if rng.IntN(3) == 0 {
			wants[k] = append(wants[k], pool[rng.IntN(len(pool))])
		}
	}
	for step := 0; step < steps; step++ {
		c.Advance(time.Duration(rng.IntN(90)) * time.Second)
		k := rng.IntN(requesters)
		key, id, want := fmt.Sprintf("k%d", k), fmt.Sprintf("c%d", k), wants[k]
		update(t, l, func(tx *Tx) {
			switch rng.IntN(5) {
			case 0, 1:
				claimOrQueue(tx, key, owner(id), want)
			case 2:
				tx.Release(id, "stop")
			case 3:
				tx.DropWaiter(key, "gone")
			case 4:
				tx.Enqueue(key, owner(id), want)
			}
		})
		checkQueueInvariants(t, snapshot(t, l))
	}
	ops := auditOps(t, l)
	for _, op := range []string{OpClaim, OpRelease, OpReserve, OpEnqueue, OpRefresh, OpDequeue, OpExpired, OpReservationExpired} {
		require.Contains(t, ops, op, "the random walk should exercise %s", op)
	}
	// Every commit is audited.
	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	seen := map[uint64]bool{}
	for _, r := range recs {
		seen[r.Generation] = true
	}
	final := snapshot(t, l).Generation
	for g := uint64(1); g <= final; g++ {
		require.True(t, seen[g], "generation %d has no audit record", g)
	}
}

// checkQueueInvariants checks what the queue promises: reservations are on
// free devices and for waiters; only the head of the queue (expectedHead)
// holds a reservation on part of its request, and it has every free device
// it asks for reserved; every other waiter with a reservation has every
// device it asks for reserved or held by its own container, and a waiter
// all of whose devices are free has them reserved (so no newcomer can take
// them).
func checkQueueInvariants(t *testing.T, st State) {
	t.Helper()
	require.NoError(t, validateState(&st))
	for _, r := range st.Reservations {
		require.True(t, slices.ContainsFunc(st.Waiters, func(w Waiter) bool { return w.Key == r.For }),
			"reservation for %q without a waiter", r.For)
	}
	require.NoError(t, checkReservations(&st))
}

// expectedHead is the head of the queue in st, found without the code under
// test: the earliest waiter that asks for something not reserved for it
// and not held by its own container, and for no cordoned device.
func expectedHead(st *State) string {
	for _, w := range st.Waiters {
		if len(w.Devices) == 0 {
			continue
		}
		covered, cordoned := true, false
		for _, d := range w.Devices {
			mine := slices.ContainsFunc(st.Reservations, func(r Reservation) bool { return r.For == w.Key && r.Device.UUID == d.UUID }) ||
				slices.ContainsFunc(st.Claims, func(c Claim) bool {
					return c.Device.UUID == d.UUID && c.Owner.ContainerID == w.Owner.ContainerID && w.Owner.ContainerID != ""
				})
			covered = covered && mine
			ownClaim := slices.ContainsFunc(st.Claims, func(c Claim) bool {
				return c.Device.UUID == d.UUID && c.Owner.ContainerID == w.Owner.ContainerID && w.Owner.ContainerID != ""
			})
			if !ownClaim && slices.ContainsFunc(st.Cordons, func(k Cordon) bool { return devices.Conflicts(k.Device, d) }) {
				cordoned = true
			}
		}
		if !covered && !cordoned {
			return w.Key
		}
	}
	return ""
}

// headWaitsFor is what the head of the queue (expectedHead) asks for and
// has neither reserved nor held by its own container: a device conflicting
// with one of them is kept for it.
func headWaitsFor(st *State, head string) []devices.Device {
	i := slices.IndexFunc(st.Waiters, func(w Waiter) bool { return w.Key == head })
	if head == "" || i < 0 {
		return nil
	}
	w := st.Waiters[i]
	var out []devices.Device
	for _, d := range w.Devices {
		mine := slices.ContainsFunc(st.Reservations, func(r Reservation) bool { return r.For == head && r.Device.UUID == d.UUID }) ||
			slices.ContainsFunc(st.Claims, func(c Claim) bool {
				return c.Device.UUID == d.UUID && c.Owner.ContainerID == w.Owner.ContainerID && w.Owner.ContainerID != ""
			})
		if !mine {
			out = append(out, d)
		}
	}
	return out
}

// checkReservations checks the reservation rules of checkQueueInvariants
// (the queue liveness simulation checks them after every event too).
func checkReservations(st *State) error {
	head := expectedHead(st)
	kept := headWaitsFor(st, head)
	for _, w := range st.Waiters {
		has, covered, free, needs := false, true, true, false
		var freeNotMine []string
		for _, d := range w.Devices {
			mine, freeD := false, true
			for _, r := range st.Reservations {
				if r.For == w.Key {
					has = true
					mine = mine || r.Device.UUID == d.UUID
				} else if devices.Conflicts(r.Device, d) {
					freeD = false
				}
			}
			for _, c := range st.Claims {
				if devices.Conflicts(c.Device, d) {
					if c.Owner.ContainerID == w.Owner.ContainerID && c.Device.UUID == d.UUID {
						mine = true
					} else {
						freeD = false
					}
				}
			}
			if w.Key != head && slices.ContainsFunc(kept, func(k devices.Device) bool { return devices.Conflicts(k, d) }) {
				freeD = false // kept for the head
			}
			if freeD && !mine {
				freeNotMine = append(freeNotMine, d.Index)
			}
			free = free && freeD
			covered = covered && mine
			needs = needs || !mine
		}
		switch {
		case w.Key == head:
			if len(freeNotMine) > 0 {
				return fmt.Errorf("generation %d: %q heads the queue but free %v is not reserved for it", st.Generation, w.Key, freeNotMine)
			}
		case has && !covered:
			return fmt.Errorf("generation %d: %q has a partial reservation but %q heads the queue", st.Generation, w.Key, head)
		case !has && free && needs:
			return fmt.Errorf("generation %d: every device %q asks for is free, and not reserved", st.Generation, w.Key)
		}
	}
	return nil
}
