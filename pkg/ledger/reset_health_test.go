// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// resetRecords is the audit log's reset records.
func resetRecords(t *testing.T, l *Ledger) []AuditRecord {
	t.Helper()
	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	var out []AuditRecord
	for _, r := range recs {
		if r.Op == OpReset {
			out = append(out, r)
		}
	}
	return out
}

// TestResetRefuseHealthyRefusesALedgerRecoveredMeanwhile: a reset asked
// for because the ledger needed recovery (the caller looked, found it
// damaged and read the runtimes) finds it recovered by someone else when
// it gets the lock, and a hook has admitted h4 since: it refuses, and the
// recovered claims, h4's among them, stay. Before, the reset went ahead and
// forgot them all but the ones the runtimes listed at the look: h4's GPU was
// claimable by a second container.
func TestResetRefuseHealthyRefusesALedgerRecoveredMeanwhile(t *testing.T) {
	l, opts := lostClaimLedger(t)
	running := []Holding{{Owner: hookHolder("h1"), Devices: devs(gpu(0))}} // read at the look

	// Meanwhile: another process recovers the ledger, and a hook admits h4.
	other, err := Open(l.Dir(), opts)
	require.NoError(t, err)
	_, err = other.Recover(context.Background(), RecoverOptions{Reason: "a concurrent recover"})
	require.NoError(t, err)
	update(t, other, func(tx *Tx) {
		_, err := tx.Claim("", hookHolder("h4"), devs(gpu(3)), "env")
		require.NoError(t, err)
	})
	before := snapshot(t, other)

	_, err = l.ResetWith(context.Background(), ResetOptions{Reason: "test", Running: running, RefuseHealthy: true,
		Keep: func(Claim) (bool, string) { return true, "kept" }})
	require.ErrorIs(t, err, ErrHealthy)
	assert.Contains(t, err.Error(), "is healthy (generation")
	assert.Contains(t, err.Error(), "3 claim(s)")
	after := snapshot(t, other)
	require.Equal(t, before, after, "a refused reset changes nothing")
	require.Equal(t, map[string]string{gpu(0).UUID: "h1", gpu(1).UUID: "h2", gpu(3).UUID: "h4"}, holders(after))
	require.Empty(t, resetRecords(t, l))
}

// TestResetRefuseHealthyResetsALedgerThatNeedsRecovery: RefuseHealthy
// lets a reset of a ledger that still needs recovery go ahead, and Keep is
// not asked about any claim of it: nothing trusts an unhealthy ledger's
// claims (the runtimes' list stands for its holders).
func TestResetRefuseHealthyResetsALedgerThatNeedsRecovery(t *testing.T) {
	l, _ := lostClaimLedger(t)
	rep, err := l.ResetWith(context.Background(), ResetOptions{Reason: "test", RefuseHealthy: true,
		Running: []Holding{{Owner: hookHolder("h3"), Devices: devs(gpu(2))}},
		Keep: func(c Claim) (bool, string) {
			t.Errorf("Keep asked about %s of a ledger that needs recovery", c.Owner.ContainerID)
			return true, ""
		}})
	require.NoError(t, err)
	assert.Empty(t, rep.KeptClaims)
	require.Equal(t, map[string]string{gpu(2).UUID: "h3"}, holders(snapshot(t, l)))
	require.Len(t, resetRecords(t, l), 1)
}

// TestResetKeepCarriesTheHoldersOfAHealthyLedger: a forced reset of a
// healthy ledger read the runtimes (h1 on GPU 0, z on GPU 3), and then a
// hook admitted h3 on GPU 2. Keep, asked under the lock, carries h1's and
// h3's claims (their holders run) and drops h2's (exited); z, which held
// nothing, adopts GPU 3; y, on h3's GPU 2, is a conflict, not a second
// holder. Waiters are forgotten. Each kept claim is audited. Before, h3's
// claim was forgotten: its GPU went to the next container that asked.
func TestResetKeepCarriesTheHoldersOfAHealthyLedger(t *testing.T) {
	opts := testOptions(newClock())
	opts.RuntimeDir = t.TempDir()
	l, err := Open(filepath.Join(t.TempDir(), "state"), opts)
	require.NoError(t, err)
	for i, id := range []string{"h1", "h2"} {
		update(t, l, func(tx *Tx) {
			_, err := tx.Claim("", hookHolder(id), devs(gpu(i)), "env")
			require.NoError(t, err)
		})
	}
	update(t, l, func(tx *Tx) { tx.Enqueue("w", hookHolder("w"), devs(gpu(0))) })
	running := []Holding{ // read at the look, before h3 was admitted
		{Owner: hookHolder("h1"), Devices: devs(gpu(0))},
		{Owner: hookHolder("z"), Devices: devs(gpu(3))},
		{Owner: hookHolder("y"), Devices: devs(gpu(2))},
	}
	other, err := Open(l.Dir(), opts)
	require.NoError(t, err)
	update(t, other, func(tx *Tx) {
		_, err := tx.Claim("", hookHolder("h3"), devs(gpu(2)), "env")
		require.NoError(t, err)
	})

	var asked []string
	rep, err := l.ResetWith(context.Background(), ResetOptions{Reason: "test", Running: running,
		Keep: func(c Claim) (bool, string) {
			asked = append(asked, c.Owner.ContainerID)
			return c.Owner.ContainerID != "h2", "its holder runs"
		}})
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{"h1", "h2", "h3"}, asked, "every claim of the state under the lock is asked about")
	var kept []string
	for _, c := range rep.KeptClaims {
		kept = append(kept, c.Owner.ContainerID)
	}
	assert.ElementsMatch(t, []string{"h1", "h3"}, kept)
	require.Len(t, rep.Adopted, 1)
	assert.Equal(t, "z", rep.Adopted[0].Owner.ContainerID)
	require.Len(t, rep.Conflicts, 1)
	assert.Equal(t, "y", rep.Conflicts[0].Owner.ContainerID)
	assert.True(t, rep.NewLineage)

	st := snapshot(t, other)
	require.Equal(t, map[string]string{gpu(0).UUID: "h1", gpu(2).UUID: "h3", gpu(3).UUID: "z"}, holders(st))
	assert.Empty(t, st.Waiters, "a reset forgets the waiters")
	assert.Equal(t, rep.Lineage, st.Lineage)
	update(t, other, func(tx *Tx) {
		_, err := tx.Claim("", hookHolder("second"), devs(gpu(2)), "env")
		var busy *BusyError
		require.ErrorAs(t, err, &busy, "h3's GPU stays held")
	})

	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	var keptRecs []string
	for _, r := range recs {
		if r.Op == OpAdopt && strings.HasPrefix(r.Reason, "kept across the reset") {
			keptRecs = append(keptRecs, r.ContainerID+": "+r.Reason)
		}
	}
	assert.ElementsMatch(t, []string{"h1: kept across the reset: its holder runs", "h3: kept across the reset: its holder runs"}, keptRecs)
	resets := resetRecords(t, l)
	require.Len(t, resets, 1)
	assert.Contains(t, resets[0].Reason, "2 claim(s) of running holders kept")
}

// TestResetKeepIgnoresAnEarlierBootsState: a healthy state of an earlier
// boot reads as empty (its holders died with that boot): Keep is not asked
// about its claims, and none is carried.
func TestResetKeepIgnoresAnEarlierBootsState(t *testing.T) {
	opts := testOptions(newClock())
	opts.RuntimeDir = t.TempDir()
	dir := filepath.Join(t.TempDir(), "state")
	l, err := Open(dir, opts)
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", hookHolder("h1"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	opts.BootID = "another-boot"
	opts.RuntimeDir = t.TempDir()
	l, err = Open(dir, opts)
	require.NoError(t, err)
	rep, err := l.ResetWith(context.Background(), ResetOptions{Reason: "test", Keep: func(c Claim) (bool, string) {
		t.Errorf("Keep asked about %s of an earlier boot", c.Owner.ContainerID)
		return true, ""
	}})
	require.NoError(t, err)
	assert.Empty(t, rep.KeptClaims)
	assert.Empty(t, snapshot(t, l).Claims)
}
