// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// A compaction replaces ledger.journal.prev in one rename, as it replaces
// ledger.json.prev: a writer killed anywhere in the journal's rotation
// leaves the ledger.journal.prev it found or the journal it was replacing,
// never none, and ledger.json.prev with ledger.journal.prev alone replay
// to the last generation either names. The next writer removes the temp
// names the kill left, and its own compaction leaves none, also when the
// kill left ledger.journal.prev a second name of the journal
// (journal-rotated).
func TestCrashRotatingTheJournalKeepsAPreviousJournal(t *testing.T) {
	for _, s := range []struct {
		stage string
		temps int // left behind: the new journal's, and the old one's second name
	}{{stageJournalSynced, 1}, {stageJournalLinked, 2}, {stageJournalRotated, 1}, {stageJournalSwapped, 0}} {
		stage := s.stage
		t.Run(stage, func(t *testing.T) {
			dir, seedGen := seedCrashLedger(t)
			compactEvery(t, dir, 2) // a .prev and a .journal.prev to replace
			prevJournal := mustRead(t, filepath.Join(dir, journalPrevName))
			journal := mustRead(t, filepath.Join(dir, journalName))

			cmd := helperCmd(t, "crash-writer", map[string]string{"DIR": dir, "STAGE": stage, "AT": "1", "COMPACT": "1"})
			out, err := cmd.CombinedOutput()
			require.True(t, killedBySIGKILL(err), "want SIGKILL, got %v: %s", err, out)

			kept, err := os.ReadFile(filepath.Join(dir, journalPrevName))
			require.NoError(t, err, "a writer killed at %s left no %s", stage, journalPrevName)
			require.True(t, bytes.Equal(kept, prevJournal) || bytes.HasPrefix(kept, journal),
				"%s is neither the one there before nor the journal being replaced", journalPrevName)
			checkPrevFilesReplay(t, dir, seedGen)
			require.Len(t, tempFiles(t, dir), s.temps)

			l, err := Open(dir, Options{BootID: testBoot})
			require.NoError(t, err)
			l.compactAlways = true
			update(t, l, func(tx *Tx) { require.NoError(t, crashStep(tx)) })
			require.Empty(t, tempFiles(t, dir), "the next writer leaves no temp file")
			j, err := os.Lstat(filepath.Join(dir, journalName))
			require.NoError(t, err)
			jp, err := os.Lstat(filepath.Join(dir, journalPrevName))
			require.NoError(t, err)
			require.False(t, os.SameFile(j, jp), "%s is still a second name of %s", journalPrevName, journalName)
			checkPrevFilesReplay(t, dir, seedGen)
			checkRecoverableWithoutSnapshot(t, dir, readBack(t, dir).Generation, seedGen, stage)
		})
	}
}

// compactEvery commits crashStep n times, compacting at each.
func compactEvery(t *testing.T, dir string, n int) {
	t.Helper()
	l, err := Open(dir, Options{BootID: testBoot})
	require.NoError(t, err)
	l.compactAlways = true
	for range n {
		update(t, l, func(tx *Tx) { require.NoError(t, crashStep(tx)) })
	}
}

// checkPrevFilesReplay: on a copy of dir without ledger.journal and with
// its ledger.json damaged (no boot marker to go by), Recover rebuilds the
// state from ledger.json.prev and ledger.journal.prev to the last
// generation either of them names: the two replay together, without a gap.
func checkPrevFilesReplay(t *testing.T, dir string, seedGen uint64) {
	t.Helper()
	cp := copyStateDir(t, dir)
	prev, err := DecodeState(mustRead(t, filepath.Join(cp, prevName)))
	require.NoError(t, err)
	want := prev.Generation
	_, recs, _, err := parseJournal(mustRead(t, filepath.Join(cp, journalPrevName)), 0, false)
	require.NoError(t, err)
	if len(recs) > 0 {
		want = max(want, recs[len(recs)-1].Gen)
	}
	require.NoError(t, os.Remove(filepath.Join(cp, journalName)))
	require.NoError(t, os.WriteFile(filepath.Join(cp, stateName), []byte("damaged"), 0o600))

	l, err := Open(cp, Options{BootID: testBoot, RuntimeDir: t.TempDir()})
	require.NoError(t, err)
	rep, err := l.Recover(context.Background(), RecoverOptions{Reason: "test"})
	require.NoError(t, err)
	require.Equal(t, want, rep.RecoveredGeneration, "recovered from %v", rep.From)
	require.Equal(t, filepath.Join(cp, prevName), rep.From[0])
	st := snapshot(t, l)
	st.Generation = rep.RecoveredGeneration // the recovered state is written one generation on
	checkCrashState(t, st, seedGen)
}
