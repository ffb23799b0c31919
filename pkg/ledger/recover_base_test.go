// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The state a recovery or reset writes is no journal record, so it has to
// be a base that the files other than ledger.json replay from. It was not:
// Recover kept its .prev pair from before (or none) and rotated the journal
// it replayed to ledger.journal.prev, so ledger.json.prev and the journals
// no longer replayed to the recovered generation. A second loss of
// ledger.json before the next compaction then lost the recovery and every
// commit made after it (a new lineage, loudly, but the commits were gone;
// after a reset, nothing verified at all). Now ledger.json.prev holds the
// recovered state too: the second recovery is complete, of the same
// lineage, with every commit.
func TestRecoveredStateSurvivesASecondLoss(t *testing.T) {
	snap := func(dir string) string { return filepath.Join(dir, stateName) }
	garbage := func(t *testing.T, dir string) {
		require.NoError(t, os.WriteFile(snap(dir), []byte("\x7fELF garbage, not a ledger"), 0o600))
	}
	deleted := func(t *testing.T, dir string) { require.NoError(t, os.Remove(snap(dir))) }
	recoverWith := func(o RecoverOptions) func(t *testing.T, l *Ledger) RecoverReport {
		return func(t *testing.T, l *Ledger) RecoverReport {
			rep, err := l.Recover(context.Background(), o)
			require.NoError(t, err)
			return rep
		}
	}
	for _, tc := range []struct {
		name      string
		compacted bool // the ledger compacted at every commit before the first fault
		fault     func(t *testing.T, dir string)
		first     func(t *testing.T, l *Ledger) RecoverReport
		// newLineage: the first recovery could not restore every commit
		// (or is a reset) and starts a lineage, which the second keeps.
		newLineage bool
		// compactSince: the commits after the first recovery compact, so
		// the .prev pair is the one compaction keeps.
		compactSince bool
	}{
		{name: "deleted, from the previous snapshot", compacted: true, fault: deleted, first: recoverWith(RecoverOptions{Reason: "test"})},
		{name: "damaged, from the journal's empty base", fault: garbage, first: recoverWith(RecoverOptions{Reason: "test"})},
		{name: "damaged, a holder released by the recovery", compacted: true, fault: garbage,
			first: recoverWith(RecoverOptions{Reason: "test", Alive: func(c Claim) (bool, error) { return c.Owner.ContainerID != "h1", nil }})},
		{name: "journal cut, a new lineage", newLineage: true, fault: func(t *testing.T, dir string) {
			j := filepath.Join(dir, journalName)
			b := mustRead(t, j)
			require.NoError(t, os.WriteFile(j, b[:bytes.LastIndexByte(b[:len(b)-1], '\n')+1], 0o600))
		}, first: recoverWith(RecoverOptions{Reason: "test"})},
		{name: "reset keeping the operator's cordon", newLineage: true, first: func(t *testing.T, l *Ledger) RecoverReport {
			rep, err := l.ResetWith(context.Background(), ResetOptions{Reason: "test",
				Running: []Holding{{Owner: owner("h2"), Devices: devs(gpu(1))}}})
			require.NoError(t, err)
			require.Len(t, rep.KeptCordons, 1)
			return rep
		}},
		{name: "deleted, compacted since", compacted: true, compactSince: true, fault: deleted, first: recoverWith(RecoverOptions{Reason: "test"})},
	} {
		for _, second := range []struct {
			name  string
			fault func(t *testing.T, dir string)
		}{{"deleted", deleted}, {"damaged", garbage}} {
			t.Run(tc.name+"/then "+second.name, func(t *testing.T) {
				dir, opts := failClosedLedger(t, tc.compacted)
				l, err := Open(dir, opts)
				require.NoError(t, err)
				update(t, l, func(tx *Tx) {
					_, _, err := tx.Cordon(gpu(3), CordonOperator, "RMA 4711", "uid 0 via gpu-guard-ctl")
					require.NoError(t, err)
				})
				if tc.fault != nil {
					tc.fault(t, dir)
				}
				first := tc.first(t, l)
				require.Equal(t, tc.newLineage, first.NewLineage, "lost: %s", first.Lost)
				recovered := snapshot(t, l)

				// Commits after the recovery, one of them undoing what it
				// recovered.
				l.compactAlways = tc.compactSince
				for i := range 3 {
					update(t, l, func(tx *Tx) {
						_, err := tx.Claim("", owner(fmt.Sprintf("after-%d", i)), devs(gpu(5+i)), "env")
						require.NoError(t, err)
					})
				}
				update(t, l, func(tx *Tx) { tx.Release("h2", "stop") })
				want := snapshot(t, l)
				require.Greater(t, want.Generation, recovered.Generation)

				second.fault(t, dir)
				again, err := Open(dir, opts)
				require.NoError(t, err)
				_, err = again.Snapshot(context.Background())
				require.ErrorIs(t, err, ErrNeedsRecovery)
				rep, err := again.Recover(context.Background(), RecoverOptions{Reason: "test"})
				require.NoError(t, err)
				require.True(t, rep.Complete, "every commit since the first recovery is back; lost: %s", rep.Lost)
				require.False(t, rep.NewLineage, "lost: %s", rep.Lost)
				require.Empty(t, rep.Lost)
				require.Equal(t, want.Generation, rep.RecoveredGeneration, "recovered from %v", rep.From)
				require.Equal(t, filepath.Join(dir, prevName), rep.From[0], "the base is the previous snapshot")
				got := snapshot(t, again)
				require.Equal(t, want.Lineage, got.Lineage)
				require.Equal(t, holders(want), holders(got))
				require.Equal(t, waiterKeys(want), waiterKeys(got))
				require.Equal(t, cordonSources(want.Cordons), cordonSources(got.Cordons))
			})
		}
	}
}

func init() {
	helpers["recover-writer"] = recoverWriter
}

// recoverWriter recovers the ledger in DIR (boot marker in RUNDIR),
// SIGKILLing itself at the AT-th write stage it reaches; it exits 0 if the
// recovery completes first.
func recoverWriter() int {
	at, reached := envInt("AT"), 0
	failpoint = func(string) {
		if reached++; reached == at {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // the signal is on its way
		}
	}
	l, err := Open(os.Getenv("DIR"), Options{BootID: testBoot, RuntimeDir: os.Getenv("RUNDIR"), LockTimeout: time.Minute})
	if err != nil {
		return helperFail("open: %v", err)
	}
	if _, err := l.Recover(context.Background(), RecoverOptions{Reason: "test"}); err != nil {
		return helperFail("recover: %v", err)
	}
	return 0
}

// A recovery killed (SIGKILL, nothing cleaned up) at any write stage leaves
// the ledger needing recovery or recovered, every commit back either way;
// and the state it recovers to stays recoverable: commits made after it
// survive a second loss of ledger.json, whatever stage the first recovery
// was killed at (the recovered state is kept as ledger.json.prev before
// ledger.json holds it, see writeBase). ledger.json.prev is never a second
// name of ledger.json.
func TestKilledRecoveryLosesNoLaterCommit(t *testing.T) {
	for n := 1; ; n++ {
		if !killRecoveryAt(t, n) {
			require.Greater(t, n, 8, "the recovery writes the base pair, a snapshot and a journal")
			t.Logf("recoveries killed at each of %d write stages", n-1)
			return
		}
	}
}

// killRecoveryAt runs the checks of TestKilledRecoveryLosesNoLaterCommit
// with the recovery killed at its n-th write stage; it reports whether it
// was killed (false: it completed first).
func killRecoveryAt(t *testing.T, n int) bool {
	t.Helper()
	dir, _ := seedCrashLedger(t)
	runDir := t.TempDir()
	opts := Options{BootID: testBoot, RuntimeDir: runDir}
	l, err := Open(dir, opts)
	require.NoError(t, err)
	l.compactAlways = true
	for range 3 { // a .prev pair to recover from
		update(t, l, func(tx *Tx) { require.NoError(t, crashStep(tx)) })
	}
	before := snapshot(t, l)
	require.NoError(t, os.Remove(filepath.Join(dir, stateName)))

	code, out := runHelper(t, "recover-writer", map[string]string{"DIR": dir, "RUNDIR": runDir, "AT": strconv.Itoa(n)})
	if code == 0 {
		return false
	}
	require.Equal(t, -1, code, "stage %d: want SIGKILL: %s", n, out) // a signalled process has no exit code

	r, err := Open(dir, opts)
	require.NoError(t, err)
	st, err := r.Snapshot(context.Background())
	if err != nil {
		require.ErrorIs(t, err, ErrNeedsRecovery, "stage %d", n)
		rep, err := r.Recover(context.Background(), RecoverOptions{Reason: "test"})
		require.NoError(t, err, "stage %d", n)
		require.True(t, rep.Complete, "stage %d: lost: %s", n, rep.Lost)
		st = snapshot(t, r)
	}
	require.Equal(t, before.Lineage, st.Lineage, "stage %d", n)
	require.Greater(t, st.Generation, before.Generation, "stage %d: the recovered state is written one generation on", n)
	require.Equal(t, holders(before), holders(st), "stage %d", n)
	require.Len(t, st.Waiters, len(before.Waiters), "stage %d", n)

	for i := range 3 {
		update(t, r, func(tx *Tx) {
			_, err := tx.Claim("", owner(fmt.Sprintf("after-%d", i)), devs(gpu(8+i)), "env")
			require.NoError(t, err)
		})
	}
	require.Empty(t, tempFiles(t, dir), "stage %d: the next writer removed the killed one's temp files", n)
	want := snapshot(t, r)
	a, err := os.Lstat(filepath.Join(dir, stateName))
	require.NoError(t, err)
	b, err := os.Lstat(filepath.Join(dir, prevName))
	require.NoError(t, err)
	require.False(t, os.SameFile(a, b), "stage %d: %s is a link to %s", n, prevName, stateName)

	require.NoError(t, os.WriteFile(filepath.Join(dir, stateName), []byte("damaged"), 0o600))
	again, err := Open(dir, opts)
	require.NoError(t, err)
	rep, err := again.Recover(context.Background(), RecoverOptions{Reason: "test"})
	require.NoError(t, err, "stage %d", n)
	require.True(t, rep.Complete, "stage %d: lost: %s", n, rep.Lost)
	require.Equal(t, want.Generation, rep.RecoveredGeneration, "stage %d: recovered from %v", n, rep.From)
	got := snapshot(t, again)
	require.Equal(t, want.Lineage, got.Lineage, "stage %d", n)
	require.Equal(t, holders(want), holders(got), "stage %d", n)
	return true
}
