// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// conflictOnGPU0 is the state of a host where x holds MIG 0:0 and the
// runtime lists container c running on GPU 0 whole: c is a conflict record
// on GPU 0, and uses every instance of it.
func conflictOnGPU0(t *testing.T) *Ledger {
	t.Helper()
	l := openTest(t, newClock())
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("x"), devs(mig(0, 0)), "env")
		require.NoError(t, err)
	})
	// Reconcile in an Update of its own: what follows starts from a
	// state its handle committed (settled), as a daemon's next one does.
	update(t, l, func(tx *Tx) {
		res := tx.Reconcile(FrontEndNRI, []Holding{
			{Owner: owner("x"), Devices: devs(mig(0, 0))},
			{Owner: owner("c"), Devices: devs(gpu(0))},
		})
		require.Len(t, res.Conflicts, 1)
	})
	return l
}

// A container found running on a whole GPU makes every device of it busy
// for others, as a claim would: a request for a free MIG instance of it is
// refused, naming that container as the holder through the GPU.
func TestConflictRecordIsBusy(t *testing.T) {
	type holder struct{ id, device string }
	for _, tc := range []struct {
		name string
		who  string
		want []devices.Device
		busy []holder // each busy entry's holder, in order
	}{
		{name: "a free instance of the GPU", who: "y", want: devs(mig(0, 1)),
			busy: []holder{{"c", gpu(0).UUID}}},
		{name: "the held instance", who: "y", want: devs(mig(0, 0)),
			busy: []holder{{"x", mig(0, 0).UUID}, {"c", gpu(0).UUID}}},
		{name: "the GPU whole", who: "y", want: devs(gpu(0)),
			busy: []holder{{"x", mig(0, 0).UUID}, {"c", gpu(0).UUID}}},
		{name: "another GPU", who: "y", want: devs(gpu(1))},
		// The record is there because of x's claim: x asking again for
		// what it holds changes nothing.
		{name: "the holder asking again for what it holds", who: "x", want: devs(mig(0, 0))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := conflictOnGPU0(t)
			var busy []BusyDevice
			var err error
			update(t, l, func(tx *Tx) {
				busy = tx.Busy("", owner(tc.who), tc.want)
				_, err = tx.Claim("", owner(tc.who), tc.want, "env")
			})
			var got []holder
			for _, b := range busy {
				require.NotNil(t, b.Holder, "busy entry %+v", b)
				got = append(got, holder{b.Holder.Owner.ContainerID, b.Holder.Device.UUID})
				assert.Equal(t, b.Holder.Owner.ContainerID == "c", b.Conflict, "a conflict record is told from a claim")
				if b.Holder.Owner.ContainerID == "c" {
					assert.Equal(t, ConflictSource, b.Holder.Source, "the record's holder text")
				}
			}
			assert.Equal(t, tc.busy, got)
			if len(tc.busy) == 0 {
				require.NoError(t, err)
				return
			}
			require.True(t, isBusy(err), "%v", err)
			assert.Contains(t, err.Error(), DescribeOwner(owner("c")), "the refusal names the container found running")
			assert.NotContains(t, holders(snapshot(t, l)), mig(0, 1).UUID, "nothing was claimed")
		})
	}
}

// Refused while c runs on GPU 0, the request leaves GPU 0 to c: once x's
// claim ends, c's record becomes c's claim (before, the request got MIG 0:1
// and c's record could never become a claim).
func TestConflictRecordBecomesTheClaimOnceTheHolderGoes(t *testing.T) {
	l := conflictOnGPU0(t)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("y"), devs(mig(0, 1)), "env")
		require.True(t, isBusy(err), "%v", err)
	})
	update(t, l, func(tx *Tx) { tx.Release("x", "stopped") })
	st := snapshot(t, l)
	assert.Equal(t, map[string]string{gpu(0).UUID: "c"}, holders(st))
	assert.Empty(t, st.Conflicts)
}

// Nothing is reserved on a device a conflict record covers, and a
// reservation made before the record is dropped: its waiter could not use
// it. Once the record ends (its container stopped), the waiter gets the
// device, in an Update that starts from a settled state, whose reservation
// pass looks only at the waiters of devices that changed.
func TestConflictRecordAndReservations(t *testing.T) {
	for _, head := range []bool{true, false} {
		name := "not reserved while the record stands: the head of the queue"
		if !head {
			name = "not reserved while the record stands: a waiter behind the head"
		}
		t.Run(name, func(t *testing.T) {
			l := conflictOnGPU0(t)
			if !head {
				// h, ahead of w, waits for GPU 1 (z holds it): w is
				// reserved by the pass over the other waiters (step 6),
				// not as the head (step 5).
				update(t, l, func(tx *Tx) {
					_, err := tx.Claim("", owner("z"), devs(gpu(1)), "env")
					require.NoError(t, err)
					tx.Enqueue("h", owner("h"), devs(gpu(1)))
				})
			}
			update(t, l, func(tx *Tx) { tx.Enqueue("w", owner("w"), devs(mig(0, 1))) })
			assert.Empty(t, reservedFor(snapshot(t, l)), "MIG 0:1 is in use by c")
			update(t, l, func(tx *Tx) { tx.Release("c", "stopped") })
			st := snapshot(t, l)
			assert.Empty(t, st.Conflicts)
			assert.Equal(t, map[string]string{mig(0, 1).UUID: "w"}, reservedFor(st), "free once c stopped")
		})
	}
	t.Run("a reservation made before the record is dropped", func(t *testing.T) {
		l := openTest(t, newClock())
		update(t, l, func(tx *Tx) {
			_, err := tx.Claim("", owner("x"), devs(mig(0, 0)), "env")
			require.NoError(t, err)
			tx.Enqueue("w", owner("w"), devs(mig(0, 1)))
		})
		require.Equal(t, map[string]string{mig(0, 1).UUID: "w"}, reservedFor(snapshot(t, l)))
		update(t, l, func(tx *Tx) {
			tx.Reconcile(FrontEndNRI, []Holding{
				{Owner: owner("x"), Devices: devs(mig(0, 0))},
				{Owner: owner("c"), Devices: devs(gpu(0))},
			})
		})
		st := snapshot(t, l)
		require.Len(t, st.Conflicts, 1)
		assert.Empty(t, reservedFor(st))
		assert.Equal(t, []string{"w"}, waiterKeys(st), "the waiter keeps its place")
		recs, err := ReadAudit(l.AuditPath())
		require.NoError(t, err)
		var unreserved []AuditRecord
		for _, r := range recs {
			if r.Op == OpUnreserve {
				unreserved = append(unreserved, r)
			}
		}
		require.Len(t, unreserved, 1)
		assert.Equal(t, "w", unreserved[0].Key)
		assert.Contains(t, unreserved[0].Reason, "in use by running "+DescribeOwner(owner("c")))
	})
}
