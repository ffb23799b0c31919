// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// A cordon on a GPU covers its MIG instances, one on a MIG instance blocks
// its GPU (but not its sibling), and nobody's claim is taken away.
func TestCordonRefusesNewClaimsBothDirections(t *testing.T) {
	for _, tc := range []struct {
		name    string
		cordon  devices.Device
		want    devices.Device
		refused bool
	}{
		{"gpu itself", gpu(0), gpu(0), true},
		{"gpu covers its mig", gpu(1), mig(1, 0), true},
		{"mig blocks its gpu", mig(1, 0), gpu(1), true},
		{"mig itself", mig(1, 0), mig(1, 0), true},
		{"sibling mig is free", mig(1, 0), mig(1, 1), false},
		{"other gpu is free", gpu(0), gpu(2), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := openTest(t, newClock())
			update(t, l, func(tx *Tx) {
				_, isNew, err := tx.Cordon(tc.cordon, CordonOperator, "fan noise", "root")
				require.NoError(t, err)
				require.True(t, isNew)
			})
			err := l.Update(context.Background(), func(tx *Tx) error {
				_, err := tx.Claim("", owner("c1"), devs(tc.want), "env")
				return err
			})
			if !tc.refused {
				require.NoError(t, err)
				return
			}
			var ce *CordonError
			require.ErrorAs(t, err, &ce)
			require.ErrorIs(t, err, ErrCordoned)
			require.Equal(t, tc.want.UUID, ce.Cordoned[0].Wanted.UUID)
			require.Equal(t, tc.cordon.UUID, ce.Cordoned[0].Cordon.Device.UUID)
			require.Contains(t, err.Error(), "fan noise")
			require.Empty(t, snapshot(t, l).Claims, "nothing claimed")
		})
	}
}

func TestCordonKeepsTheHolderAndIsIdempotent(t *testing.T) {
	c := newClock()
	l := openTest(t, c)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h1"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	since := c.Now()
	update(t, l, func(tx *Tx) {
		_, _, err := tx.Cordon(gpu(0), CordonUnhealthy, "Xid 79", "observer")
		require.NoError(t, err)
	})
	c.Advance(time.Minute)
	update(t, l, func(tx *Tx) {
		// An operator's cordon replaces the observer's.
		k, isNew, err := tx.Cordon(gpu(0), CordonOperator, "first", "alice")
		require.NoError(t, err)
		require.False(t, isNew, "a repeat is not a new cordon")
		require.True(t, k.Since.Equal(since), "a repeat keeps Since")
		// The holder may ask again for what it holds: not a new claim.
		_, err = tx.Claim("", owner("h1"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	st := snapshot(t, l)
	require.Equal(t, map[string]string{gpu(0).UUID: "h1"}, holders(st), "the holder keeps its claim")
	require.Len(t, st.Cordons, 1)
	require.Equal(t, Cordon{Device: gpu(0), Source: CordonOperator, Reason: "first", By: "alice", Since: since}, st.Cordons[0])

	// An identical repeat changes nothing (no commit, no audit record).
	gen := st.Generation
	update(t, l, func(tx *Tx) {
		_, _, err := tx.Cordon(gpu(0), CordonOperator, "first", "alice")
		require.NoError(t, err)
	})
	require.Equal(t, gen, snapshot(t, l).Generation)

	var k Cordon
	var ok bool
	update(t, l, func(tx *Tx) { k, ok = tx.Uncordon(gpu(0).UUID, "bob") })
	require.True(t, ok)
	require.Equal(t, "first", k.Reason)
	update(t, l, func(tx *Tx) { _, ok = tx.Uncordon(gpu(0).UUID, "bob") })
	require.False(t, ok, "nothing to lift")
	require.Empty(t, snapshot(t, l).Cordons)
	ops := auditOps(t, l)
	require.Contains(t, ops, OpCordon)
	require.Contains(t, ops, OpUncordon)
}

func TestCordonInputIsChecked(t *testing.T) {
	l := openTest(t, newClock())
	err := l.Update(context.Background(), func(tx *Tx) error {
		_, _, err := tx.Cordon(gpu(0), "whim", "", "root")
		return err
	})
	require.ErrorIs(t, err, ErrInvalid)
	require.Contains(t, err.Error(), `"whim"`)
	err = l.Update(context.Background(), func(tx *Tx) error {
		_, _, err := tx.Cordon(devices.Device{Index: "3"}, CordonOperator, "", "root")
		return err
	})
	require.ErrorIs(t, err, ErrInvalid)
}

// No reservation is ever made on a cordoned device: the waiter keeps its
// place and gets the device once the cordon is lifted.
func TestCordonedDeviceIsNeverReserved(t *testing.T) {
	l := openTest(t, newClock())
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h1"), devs(gpu(0)), "env")
		require.NoError(t, err)
		tx.Enqueue("w1", owner("w1"), devs(gpu(0)))
		tx.Enqueue("w2", owner("w2"), devs(mig(1, 0)))
	})
	require.Equal(t, map[string]string{mig(1, 0).UUID: "w2"}, reservedFor(snapshot(t, l)))

	update(t, l, func(tx *Tx) {
		_, _, err := tx.Cordon(gpu(0), CordonOperator, "maintenance", "root")
		require.NoError(t, err)
		_, _, err = tx.Cordon(gpu(1), CordonIntruder, "pid 4242 of host", "observer")
		require.NoError(t, err)
	})
	require.Empty(t, reservedFor(snapshot(t, l)), "the cordon on GPU 1 took back the reservation of its MIG instance")

	update(t, l, func(tx *Tx) { tx.Release("h1", "stopped") })
	st := snapshot(t, l)
	require.Empty(t, st.Claims)
	require.Empty(t, reservedFor(st), "the freed GPU is cordoned: nobody gets it")
	require.Equal(t, []string{"w1", "w2"}, waiterKeys(st), "the waiters keep their places")

	update(t, l, func(tx *Tx) {
		_, ok := tx.Uncordon(gpu(0).UUID, "root")
		require.True(t, ok)
	})
	require.Equal(t, map[string]string{gpu(0).UUID: "w1"}, reservedFor(snapshot(t, l)), "the head gets it once lifted")
}

// Draining: a stopped holder's claim stays until FinishDraining or the
// grace; the container's other claims are left alone; reconcile keeps it.
func TestDrainingClaims(t *testing.T) {
	c := newClock()
	opts := testOptions(c)
	opts.DrainGrace = time.Minute
	l, err := Open(t.TempDir(), opts)
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h1"), devs(gpu(0), gpu(1)), "env")
		require.NoError(t, err)
		_, err = tx.Claim("", owner("h2"), devs(gpu(2)), "env")
		require.NoError(t, err)
		tx.Enqueue("w1", owner("w1"), devs(gpu(0)))
	})
	start := c.Now()
	update(t, l, func(tx *Tx) {
		got := tx.MarkDraining("h1", "stopped")
		require.Len(t, got, 2)
		require.Len(t, tx.MarkDraining("h2", "stopped"), 1)
	})
	c.Advance(30 * time.Second)
	update(t, l, func(tx *Tx) {
		again := tx.MarkDraining("h1", "removed")
		require.True(t, again[0].Owner.DrainingSince.Equal(start), "a repeat keeps DrainingSince")
		// The runtime no longer lists the stopped containers: reconcile
		// does not release a draining claim.
		res := tx.Reconcile(FrontEndNRI, nil)
		require.Empty(t, res.Released)
		require.Len(t, tx.Draining(), 3)
	})
	st := snapshot(t, l)
	require.Equal(t, map[string]string{gpu(0).UUID: "h1", gpu(1).UUID: "h1", gpu(2).UUID: "h2"}, holders(st))
	require.Empty(t, reservedFor(st), "a draining device is still held")

	update(t, l, func(tx *Tx) {
		require.Empty(t, tx.FinishDraining("nobody", "idle"))
		rel := tx.FinishDraining("h2", "idle")
		require.Len(t, rel, 1)
	})
	require.Equal(t, map[string]string{gpu(0).UUID: "h1", gpu(1).UUID: "h1"}, holders(snapshot(t, l)))

	// At the grace, the next update (of anything) releases the rest.
	c.Advance(30 * time.Second)
	update(t, l, func(tx *Tx) { tx.Enqueue("w2", owner("w2"), devs(gpu(3))) })
	st = snapshot(t, l)
	require.Empty(t, holders(st), "released once idle_grace passed")
	require.Equal(t, map[string]string{gpu(0).UUID: "w1", gpu(3).UUID: "w2"}, reservedFor(st), "the queue head gets the freed GPU")
	recs := auditRecords(t, l)
	var graceOver, drained bool
	for _, r := range recs {
		if r.Op == OpRelease && bytes.Contains([]byte(r.Reason), []byte("idle grace over")) {
			graceOver = true
			require.Equal(t, "h1", r.ContainerID)
		}
		if r.Op == OpRelease && r.Reason == "drained: idle" {
			drained = true
		}
	}
	require.True(t, graceOver, "the grace release is audited")
	require.True(t, drained, "FinishDraining is audited")
	require.Contains(t, auditOps(t, l), OpDraining)
}

// Cordons and draining claims survive a cold read (every commit a journal
// record), compaction, and recovery from the journal after the snapshot is
// lost.
func TestCordonsAndDrainingSurviveJournalCompactionAndRecover(t *testing.T) {
	for _, compacted := range []bool{false, true} {
		t.Run(map[bool]string{false: "journal", true: "compacted"}[compacted], func(t *testing.T) {
			opts := testOptions(newClock())
			opts.RuntimeDir = t.TempDir()
			opts.DrainGrace = time.Hour
			dir := filepath.Join(t.TempDir(), "state")
			l, err := Open(dir, opts)
			require.NoError(t, err)
			l.compactAlways = compacted
			update(t, l, func(tx *Tx) {
				_, err := tx.Claim("", owner("h1"), devs(gpu(0)), "env")
				require.NoError(t, err)
				_, err = tx.Claim("", owner("h2"), devs(gpu(2)), "env")
				require.NoError(t, err)
			})
			update(t, l, func(tx *Tx) {
				_, _, err := tx.Cordon(gpu(1), CordonOperator, "reseat", "root")
				require.NoError(t, err)
				_, _, err = tx.Cordon(mig(3, 0), CordonUnhealthy, "Xid 48", "observer")
				require.NoError(t, err)
			})
			update(t, l, func(tx *Tx) { tx.MarkDraining("h1", "stopped") })
			update(t, l, func(tx *Tx) { tx.Uncordon(mig(3, 0).UUID, "root") })
			update(t, l, func(tx *Tx) {
				_, _, err := tx.Cordon(gpu(2), CordonIntruder, "pid 7", "observer")
				require.NoError(t, err)
			})
			want := snapshot(t, l)
			require.Len(t, want.Cordons, 2)

			cold, err := Open(dir, opts)
			require.NoError(t, err)
			got := snapshot(t, cold)
			require.Equal(t, want.Cordons, got.Cordons)
			require.Equal(t, want.Claims, got.Claims)
			require.False(t, got.Claims[0].Owner.DrainingSince.IsZero())

			require.NoError(t, os.Remove(l.StatePath()))
			_, err = cold.Snapshot(context.Background())
			require.ErrorIs(t, err, ErrNeedsRecovery)
			_, err = cold.Recover(context.Background(), RecoverOptions{Reason: "test"})
			require.NoError(t, err)
			got = snapshot(t, cold)
			require.Equal(t, want.Cordons, got.Cordons, "cordons survive recovery")
			require.False(t, got.Claims[0].Owner.DrainingSince.IsZero(), "draining survives recovery")
		})
	}
}

// A format 2 state (before cordons) is read as it is and written as the
// current format at the next commit; a format 2 build refuses format 3 as
// newer (see TestNewerFormatIsLeftAlone), it never reads it and drops a
// cordon.
func TestFormat2IsReadAndConverted(t *testing.T) {
	l := seeded(t)
	data := mustRead(t, l.StatePath())
	require.True(t, bytes.HasPrefix(data, formatPrefix(FormatVersion)))
	old := append(formatPrefix(2), data[len(formatPrefix(FormatVersion)):]...)
	_, err := DecodeState(old)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(l.StatePath(), old, 0o600))

	fresh, err := Open(l.Dir(), l.opts)
	require.NoError(t, err)
	update(t, fresh, func(tx *Tx) {
		_, _, err := tx.Cordon(gpu(5), CordonOperator, "x", "root")
		require.NoError(t, err)
	})
	require.True(t, bytes.HasPrefix(mustRead(t, l.StatePath()), formatPrefix(FormatVersion)), "converted before the first cordon")
	require.Len(t, snapshot(t, fresh).Cordons, 1)
}

// A state with a cordon that breaks an invariant is refused, not read.
func TestInvalidCordonsAreCorrupt(t *testing.T) {
	base := sampleState()
	for _, tc := range []struct {
		name string
		ks   []Cordon
	}{
		{"no uuid", []Cordon{{Source: CordonOperator}}},
		{"bad source", []Cordon{{Device: gpu(0), Source: "whim"}}},
		{"unsorted", []Cordon{{Device: gpu(1), Source: CordonOperator}, {Device: gpu(0), Source: CordonOperator}}},
		{"duplicate", []Cordon{{Device: gpu(1), Source: CordonOperator}, {Device: gpu(1), Source: CordonOperator}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := base
			st.Cordons = tc.ks
			b, err := encodeState(&st)
			require.NoError(t, err)
			_, err = DecodeState(b)
			require.ErrorIs(t, err, ErrCorrupt)
		})
	}
}

func TestJournalRecordCarriesCordons(t *testing.T) {
	base := sampleState()
	base.Cordons = []Cordon{{Device: gpu(1), Source: CordonOperator, Reason: "a", By: "root", Since: time.Unix(5, 0).UTC()},
		{Device: gpu(2), Source: CordonIntruder, Reason: "b", By: "observer", Since: time.Unix(6, 0).UTC()}}
	next := base.Clone()
	next.Generation++
	next.Cordons = []Cordon{{Device: gpu(2), Source: CordonUnhealthy, Reason: "c", By: "observer", Since: time.Unix(6, 0).UTC()},
		{Device: mig(3, 1), Source: CordonOperator, Reason: "d", By: "root", Since: time.Unix(7, 0).UTC()}}
	next.Claims[0].Owner.DrainingSince = time.Unix(8, 0).UTC()
	rec := recordOf(&base, &next, nil)
	require.Equal(t, []string{gpu(1).UUID}, rec.CordonsGone)
	require.Len(t, rec.Cordons, 2)
	require.Len(t, rec.Claims, 1, "the draining claim changed")

	line, err := appendJournalLine(nil, rec)
	require.NoError(t, err)
	lines, _, _, err := journalLines(line, 0)
	require.NoError(t, err)
	back, err := decodeRecord(lines[0], 0)
	require.NoError(t, err)
	st := base.Clone()
	require.NoError(t, applyRecords(&st, []journalRecord{back}))
	require.Equal(t, next.Cordons, st.Cordons)
	require.True(t, st.Claims[0].Owner.DrainingSince.Equal(next.Claims[0].Owner.DrainingSince))
	require.Len(t, base.Cordons, 2, "the base is not written")
	require.Equal(t, gpu(1).UUID, base.Cordons[0].Device.UUID)
}

func TestCordonErrorNamesDeviceAndCordon(t *testing.T) {
	err := error(&CordonError{Cordoned: []CordonedDevice{{Wanted: mig(1, 0),
		Cordon: Cordon{Device: gpu(1), Source: CordonOperator, Reason: "reseat", By: "root", Since: time.Unix(0, 0)}}}})
	require.True(t, errors.Is(err, ErrCordoned))
	for _, s := range []string{mig(1, 0).UUID, gpu(1).UUID, "through", "operator", "root", "reseat", "1970-01-01T00:00:00Z"} {
		require.Contains(t, err.Error(), s)
	}
}

func auditRecords(t testing.TB, l *Ledger) []AuditRecord {
	t.Helper()
	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	return recs
}
