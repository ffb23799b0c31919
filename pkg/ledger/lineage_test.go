// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

// stored is the state in the files (snapshot and journal), verified, read
// by a fresh handle (Snapshot would hide a state of an earlier boot).
func stored(t *testing.T, l *Ledger) State {
	t.Helper()
	fresh, err := OpenReadOnly(l.Dir(), l.opts)
	require.NoError(t, err)
	ld, err := fresh.loadFiles(nil)
	require.NoError(t, err)
	return ld.st
}

func TestLineageKeptByEveryMutation(t *testing.T) {
	c := newClock()
	l := openTest(t, c)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("c1"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	first := stored(t, l)
	require.Len(t, first.Lineage, len(testLineage), "the first commit stores a new lineage")
	require.Equal(t, first.Lineage, snapshot(t, l).Lineage)

	for _, m := range []struct {
		name string
		fn   func(tx *Tx)
	}{
		{"claim", func(tx *Tx) { _, err := tx.Claim("", owner("c2"), devs(gpu(1)), "env"); require.NoError(t, err) }},
		{"enqueue", func(tx *Tx) { tx.Enqueue("w", owner("w"), devs(gpu(0))) }},
		{"started", func(tx *Tx) { require.True(t, tx.SetStarted("c1", 42, 7, "/k8s/c1")) }},
		{"stopped", func(tx *Tx) { require.True(t, tx.MarkStopped("c2")) }},
		{"release", func(tx *Tx) { require.NotEmpty(t, tx.Release("c1", "removed")) }},
		{"reconcile", func(tx *Tx) { tx.Reconcile(FrontEndNRI, []Holding{{Owner: owner("c3"), Devices: devs(gpu(2))}}) }},
		{"drop waiter", func(tx *Tx) { require.True(t, tx.DropWaiter("w", "gone")) }},
	} {
		gen := stored(t, l).Generation
		c.Advance(1)
		update(t, l, m.fn)
		st := stored(t, l)
		require.Greater(t, st.Generation, gen, "%s: committed", m.name)
		require.Equal(t, first.Lineage, st.Lineage, "%s: a mutation keeps the lineage", m.name)
	}
}

func TestLineageRenewedWhenStateStartsAfresh(t *testing.T) {
	for _, tc := range []struct {
		name string
		// afresh makes the state start empty and returns the ledger that
		// then writes.
		afresh func(t *testing.T, l *Ledger) *Ledger
	}{
		{"reset deliberately", func(t *testing.T, l *Ledger) *Ledger {
			_, err := l.Reset(context.Background(), "test")
			require.NoError(t, err)
			return l
		}},
		{"earlier boot discarded", func(t *testing.T, l *Ledger) *Ledger {
			opts := testOptions(nil)
			opts.BootID = "after-reboot"
			l2, err := Open(l.Dir(), opts)
			require.NoError(t, err)
			return l2
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := seeded(t)
			old := stored(t, l)
			require.NotEmpty(t, old.Lineage)
			w := tc.afresh(t, l)
			update(t, w, func(tx *Tx) {
				require.Empty(t, tx.State().Claims, "the state starts empty")
				_, err := tx.Claim("", owner("c9"), devs(gpu(3)), "env")
				require.NoError(t, err)
			})
			st := stored(t, w)
			require.NotEmpty(t, st.Lineage)
			require.NotEqual(t, old.Lineage, st.Lineage, "a state started afresh has a new lineage")
			update(t, w, func(tx *Tx) { tx.Release("c9", "removed") })
			require.Equal(t, st.Lineage, stored(t, w).Lineage, "and keeps it")
		})
	}
}

// legacyFile is the format 1 file an older build wrote for st: one
// envelope, and no lineage field.
func legacyFile(t *testing.T, st State) []byte {
	t.Helper()
	st.Lineage = ""
	body, err := appendStateJSON(nil, &st)
	require.NoError(t, err)
	body = bytes.Replace(body, []byte(`,"lineage":""`), nil, 1)
	out := fmt.Appendf(nil, `{"format":1,"generation":%d,"boot_id":%q,"checksum":%q,"state":`, st.Generation, st.BootID, checksumOf(body))
	out = append(out, body...)
	return append(out, "}\n"...)
}

// The upgrade from format 1: a ledger.json of an older build (no journal,
// no boot marker) is read as it is and converted at the next commit.
func TestStateWithoutLineageGetsOneAtItsFirstCommit(t *testing.T) {
	seed := seeded(t)
	old := stored(t, seed)
	legacy := legacyFile(t, old)
	require.NotContains(t, string(legacy), "lineage")
	opts := testOptions(newClock())
	opts.RuntimeDir = t.TempDir() // as on the first boot with this build
	l, err := Open(t.TempDir(), opts)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(l.StatePath(), legacy, 0o600))

	// It is valid: read as it is, claims and all.
	got := snapshot(t, l)
	require.Empty(t, got.Lineage)
	require.Equal(t, holders(old), holders(got))

	// A no-op update still writes nothing.
	update(t, l, func(*Tx) {})
	require.Equal(t, legacy, mustRead(t, l.StatePath()))

	// A reconcile stores the lineage it reports, even with nothing to change.
	var res ReconcileResult
	update(t, l, func(tx *Tx) {
		res = tx.Reconcile(FrontEndNRI, []Holding{{Owner: owner("c1"), Devices: devs(gpu(0))}})
	})
	require.Empty(t, res.Released)
	require.Empty(t, res.Adopted)
	st := stored(t, l)
	require.NotEmpty(t, st.Lineage)
	require.Equal(t, st.Lineage, res.Lineage)
	require.Equal(t, holders(old), holders(st))
	require.Equal(t, old.Generation+1, st.Generation)
	format, _ := peekFormat(mustRead(t, l.StatePath()))
	require.Equal(t, FormatVersion, format, "converted to the current format")
	require.FileExists(t, l.JournalPath())
}

func TestReconcileStoresTheLineageOfAnEmptyLedger(t *testing.T) {
	l := openTest(t, newClock())
	var res ReconcileResult
	update(t, l, func(tx *Tx) { res = tx.Reconcile(FrontEndNRI, nil) })
	st := stored(t, l)
	require.NotEmpty(t, res.Lineage)
	require.Equal(t, res.Lineage, st.Lineage, "the lineage reported is the one on disk")

	update(t, l, func(tx *Tx) { res = tx.Reconcile(FrontEndNRI, nil) })
	require.Equal(t, st.Lineage, res.Lineage)
	require.Equal(t, st.Generation, stored(t, l).Generation, "a stored lineage is not written again")
}

func TestRequireLineage(t *testing.T) {
	for _, tc := range []struct {
		name string
		// change alters the ledger behind l's back; ok: l may still decide.
		change func(t *testing.T, l *Ledger)
		ok     bool
		why    string // in the error
	}{
		{name: "same lineage, other writers' changes", ok: true, change: func(t *testing.T, l *Ledger) {
			other, err := Open(l.Dir(), testOptions(nil))
			require.NoError(t, err)
			update(t, other, func(tx *Tx) { _, err := tx.Claim("", owner("hook"), devs(gpu(2)), "env"); require.NoError(t, err) })
		}},
		{name: "another process reset and started afresh", why: "started afresh",
			change: func(t *testing.T, l *Ledger) {
				other, err := Open(l.Dir(), testOptions(nil))
				require.NoError(t, err)
				_, err = other.Reset(context.Background(), "test")
				require.NoError(t, err)
				update(t, other, func(tx *Tx) { _, err := tx.Claim("", owner("hook"), devs(gpu(2)), "env"); require.NoError(t, err) })
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := seeded(t)
			var res ReconcileResult
			update(t, l, func(tx *Tx) { res = tx.Reconcile(FrontEndNRI, []Holding{{Owner: owner("c1"), Devices: devs(gpu(0))}}) })
			synced := res.Lineage
			require.NotEmpty(t, synced)
			tc.change(t, l)
			before := stored(t, l)

			l.RequireLineage(synced)
			ran := false
			err := l.Update(context.Background(), func(tx *Tx) error {
				ran = true
				_, err := tx.Claim("", owner("new"), devs(gpu(1)), "env")
				return err
			})
			if tc.ok {
				require.NoError(t, err)
				require.True(t, ran)
				return
			}
			var le *LineageError
			require.ErrorAs(t, err, &le)
			require.ErrorIs(t, err, ErrLineageChanged)
			require.False(t, ran, "nothing is decided on a state of another lineage")
			require.Equal(t, before, stored(t, l), "nothing is written")
			require.Equal(t, synced, le.Expected)
			require.Equal(t, l.StatePath(), le.Path)
			require.NotEmpty(t, le.Found)
			require.NotEqual(t, synced, le.Found)
			require.Contains(t, err.Error(), tc.why)
			require.Contains(t, err.Error(), "rebuilt from the runtime's containers")

			// Without the requirement (the runtime's Synchronize) it proceeds.
			l.RequireLineage("")
			update(t, l, func(tx *Tx) { tx.Reconcile(FrontEndNRI, nil) })
		})
	}
}

func TestRequireLineageEmptyMeansNone(t *testing.T) {
	l := seeded(t)
	ran := false
	l.RequireLineage("x")
	l.RequireLineage("")
	require.NoError(t, l.Update(context.Background(), func(*Tx) error { ran = true; return nil }))
	require.True(t, ran)
}
