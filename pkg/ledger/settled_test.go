// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// TestSettledSkipAgreesWithFullPass drives two ledgers through the same
// random claims, releases, queue entries, withdrawals and clock jumps: one
// through a single handle, whose Updates start from the state it committed
// itself and so may skip the queue mechanics' second half (Tx.maintain),
// the queue_ttl scan (Tx.expireWaiters) and, in the reservation pass, the
// waiters nothing changed for (Tx.reserveCandidates), the other through a
// fresh handle per step, which reads the files and always runs them in
// full, every waiter looked at in every pass. After every step both must hold the same claims,
// waiters, reservations, conflicts and cordons (cordons and draining claims
// change what the queue pass may reserve).
func TestSettledSkipAgreesWithFullPass(t *testing.T) {
	for _, seed := range []uint64{13, 14, 15, 16} {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { settledAgreesWithFullPass(t, seed) })
	}
}

func settledAgreesWithFullPass(t *testing.T, seed uint64) {
	c := newClock()
	opts := testOptions(c)
	opts.QueueTTL, opts.ReservationTTL = 10*time.Minute, 3*time.Minute
	opts.DrainGrace = 4 * time.Minute
	kept, err := Open(t.TempDir(), opts)
	require.NoError(t, err)
	freshDir := t.TempDir()

	pool := []devices.Device{gpu(0), gpu(1), gpu(2), gpu(3), mig(4, 0), mig(4, 1), gpu(4)}
	rng := rand.New(rand.NewPCG(seed, 7))
	pick := func() []devices.Device {
		n := 1 + rng.IntN(2)
		out := make([]devices.Device, 0, n)
		for range n {
			out = append(out, pool[rng.IntN(len(pool))])
		}
		return out
	}
	step := func(op, who int, want []devices.Device) func(tx *Tx) {
		id := fmt.Sprintf("c%d", who)
		key := "ns/pod-" + id + "/ctr"
		o := owner(id)
		return func(tx *Tx) {
			switch op {
			case 0, 1, 2: // a request: refused if cordoned, claim if free, else queue
				if len(tx.CordonsOn(id, want)) > 0 {
					return
				}
				if len(tx.Busy(key, o, want)) == 0 {
					_, err := tx.Claim(key, o, want, "env")
					require.NoError(t, err)
				} else {
					tx.Enqueue(key, o, want)
				}
			case 3, 4:
				tx.Release(id, "stopped")
			case 5:
				tx.DropWaiter(key, "gone")
			case 6: // cordons and draining claims change what is free
				_, _, err := tx.Cordon(want[0], CordonOperator, "maintenance", "test")
				require.NoError(t, err)
			case 7:
				tx.Uncordon(want[0].UUID, "test")
			case 8:
				tx.MarkDraining(id, "stopped")
			case 9: // queued whatever is free (a retry asking for other devices)
				tx.Enqueue(key, o, want)
			}
		}
	}
	skipped, scans, scanSkips := 0, 0, 0
	for i := range 600 {
		if rng.IntN(4) == 0 {
			c.Advance(time.Duration(rng.IntN(5*60)) * time.Second)
		}
		fn := step(rng.IntN(10), rng.IntN(10), pick())
		// Whether the kept handle's Update may skip the queue_ttl scan
		// (its cached lower bound of LastSeen is not yet past the cutoff).
		if cur := kept.cached(); cur != nil && cur.minKnown && len(cur.st.Waiters) > 0 {
			if cur.minLastSeen.Before(c.Now().Add(-opts.QueueTTL)) {
				scans++
			} else {
				scanSkips++
			}
		}
		update(t, kept, fn)
		if cur := kept.cached(); cur != nil && cur.minKnown {
			for _, w := range cur.st.Waiters {
				require.False(t, w.LastSeen.Before(cur.minLastSeen), "step %d: waiter %s last seen %s, before the bound %s", i, w.Key, w.LastSeen, cur.minLastSeen)
			}
		}
		fresh, err := Open(freshDir, opts)
		require.NoError(t, err)
		fresh.fullPasses = true // the reference: every waiter looked at in every pass
		update(t, fresh, fn)

		a, b := queueOf(snapshot(t, kept)), queueOf(snapshot(t, fresh))
		require.Equal(t, b, a, "step %d", i)
		if cur := kept.cached(); cur != nil && cur.settled {
			skipped++
		}
	}
	// The comparison means something only if the kept handle started from a
	// settled state most of the time.
	require.Greater(t, skipped, 300, "the kept handle's commits were not marked settled")
	// And only if it both skipped the expiry scan and had to scan.
	require.Greater(t, scanSkips, 100, "the kept handle never skipped the queue_ttl scan")
	require.Greater(t, scans, 10, "the kept handle never had a waiter that could expire")

	// A commit of another process makes the kept handle's cache unsettled.
	other, err := Open(kept.Dir(), opts)
	require.NoError(t, err)
	update(t, other, step(0, 11, devs(gpu(5))))
	_, err = kept.Snapshot(context.Background())
	require.NoError(t, err)
	require.False(t, kept.cached().settled, "a state read from the files is never settled")
}

// queueOf is the part of st the queue mechanics decide, with empty lists as
// nil (a state in memory and one decoded from the files differ there only).
func queueOf(st State) State {
	q := State{Claims: st.Claims, Waiters: st.Waiters, Reservations: st.Reservations, Conflicts: st.Conflicts, Cordons: st.Cordons}
	if len(q.Claims) == 0 {
		q.Claims = nil
	}
	if len(q.Waiters) == 0 {
		q.Waiters = nil
	}
	if len(q.Reservations) == 0 {
		q.Reservations = nil
	}
	if len(q.Conflicts) == 0 {
		q.Conflicts = nil
	}
	if len(q.Cordons) == 0 {
		q.Cordons = nil
	}
	return q
}
