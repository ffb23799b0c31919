// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

// Every commit writes at least one audit record stamped with its
// generation, a reconcile that only stores the new lineage of a fresh
// ledger included (the daemon fences on the lineage it reconciled, so it
// is written even when nothing else changed).
func TestAReconcileThatOnlyStoresTheLineageIsAudited(t *testing.T) {
	l := openTest(t, newClock())
	var lineage string
	update(t, l, func(tx *Tx) { lineage = tx.Reconcile(FrontEndNRI, nil).Lineage })
	st := stored(t, l)
	require.Equal(t, uint64(1), st.Generation, "the reconcile committed")
	require.Equal(t, lineage, st.Lineage)
	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	require.Len(t, recs, 1)
	require.Equal(t, OpLineage, recs[0].Op)
	require.Equal(t, st.Generation, recs[0].Generation)
	require.Equal(t, "lineage "+lineage+" stored (fresh start: a new ledger)", recs[0].Reason)

	// Stored: the next reconcile that changes nothing commits nothing.
	update(t, l, func(tx *Tx) { tx.Reconcile(FrontEndNRI, nil) })
	require.Equal(t, uint64(1), stored(t, l).Generation)
	recs, err = ReadAudit(l.AuditPath())
	require.NoError(t, err)
	require.Len(t, recs, 1)
}

// The record says why the lineage is new: an earlier boot's state
// discarded (next to the discard record), or a state file without one.
func TestTheLineageRecordSaysWhyItIsNew(t *testing.T) {
	t.Run("earlier boot", func(t *testing.T) {
		l := seeded(t)
		opts := testOptions(nil)
		opts.BootID = "after-reboot"
		l2, err := Open(l.Dir(), opts)
		require.NoError(t, err)
		update(t, l2, func(tx *Tx) { tx.Reconcile(FrontEndNRI, nil) })
		st := stored(t, l2)
		recs, err := ReadAudit(l2.AuditPath())
		require.NoError(t, err)
		var ops []string
		for _, r := range recs {
			if r.Generation == st.Generation {
				ops = append(ops, r.Op)
			}
		}
		require.Equal(t, []string{OpDiscard, OpLineage}, ops)
		require.Equal(t, "lineage "+st.Lineage+" stored (fresh start: the state of an earlier boot was discarded)", recs[len(recs)-1].Reason)
	})
	t.Run("no lineage in the file", func(t *testing.T) {
		// The upgrade from format 1: a ledger.json of an older build, no
		// journal, no boot marker.
		old := stored(t, seeded(t))
		opts := testOptions(newClock())
		opts.RuntimeDir = t.TempDir()
		l, err := Open(t.TempDir(), opts)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(l.StatePath(), legacyFile(t, old), 0o600))
		update(t, l, func(tx *Tx) { tx.Reconcile(FrontEndNRI, []Holding{{Owner: owner("c1"), Devices: devs(gpu(0))}}) })
		st := stored(t, l)
		recs, err := ReadAudit(l.AuditPath())
		require.NoError(t, err)
		require.Len(t, recs, 1)
		require.Equal(t, OpLineage, recs[0].Op)
		require.Equal(t, st.Generation, recs[0].Generation)
		require.Equal(t, "lineage "+st.Lineage+" stored (the state file had none: written by an older nri-gpu-guard, "+
			"or restored from an old copy)", recs[0].Reason)
	})
}
