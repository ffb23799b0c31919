// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"errors"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A state that starts afresh next to an audit log of a higher generation
// (its files lost or damaged, and a reboot: no marker to continue from)
// continues above the log's last record. Numbered from 1 again, a writer
// stopped between its commit and its audit append lost that commit's
// records without a trace: the next writer catches the log up only through
// generations past its last record, which were all below it.
func TestFreshStartContinuesAboveTheAuditLog(t *testing.T) {
	const reboot = "99999999-2222-3333-4444-555555555555"
	// remove removes what there is of the state files (no .prev before
	// the first compaction).
	remove := func(t *testing.T, dir string, names ...string) {
		for _, n := range names {
			if err := os.Remove(filepath.Join(dir, n)); !errors.Is(err, fs.ErrNotExist) {
				require.NoError(t, err)
			}
		}
	}
	garbage := func(t *testing.T, dir string) {
		require.NoError(t, os.WriteFile(filepath.Join(dir, stateName), []byte("garbage"), 0o600))
		remove(t, dir, prevName, journalName, journalPrevName)
	}
	for _, tc := range []struct {
		name string
		// start makes the fresh start, stopped (a panic at stage) before it
		// appended its audit records.
		start func(t *testing.T, l *Ledger)
		stage string
		// want is what the log must hold of the stopped start: the
		// claim's records, appended late from its journal record, or an
		// audit-lost record naming a state written whole (no record).
		want func(r AuditRecord) bool
	}{{
		name: "state files lost",
		start: func(t *testing.T, l *Ledger) {
			remove(t, l.Dir(), stateName, prevName, journalName, journalPrevName)
			_ = tryClaim(l, "a", gpu(0))
		},
		stage: stageAfterFsync,
		want:  func(r AuditRecord) bool { return r.Op == OpClaim && r.ContainerID == "a" },
	}, {
		name: "recover that finds nothing",
		start: func(t *testing.T, l *Ledger) {
			garbage(t, l.Dir())
			_, _ = l.Recover(context.Background(), RecoverOptions{Reason: "test", AllowEmpty: true})
		},
		stage: stageJournalSwapped,
		want:  func(r AuditRecord) bool { return r.Op == OpAuditLost },
	}, {
		name: "reset",
		start: func(t *testing.T, l *Ledger) {
			garbage(t, l.Dir())
			_, _ = l.Reset(context.Background(), "test")
		},
		stage: stageJournalSwapped,
		want:  func(r AuditRecord) bool { return r.Op == OpAuditLost },
	}} {
		t.Run(tc.name, func(t *testing.T) {
			c := newClock()
			dir := t.TempDir()
			l, err := Open(dir, testOptions(c))
			require.NoError(t, err)
			for i := range 5 {
				update(t, l, func(tx *Tx) { tx.Enqueue("w"+strconv.Itoa(i), owner("w"), devs(gpu(i))) })
			}
			o := testOptions(c)
			o.BootID = reboot // no marker of this boot
			fresh, err := Open(dir, o)
			require.NoError(t, err)
			stopped := false
			t.Cleanup(func() { failpoint = nil })
			failpoint = func(s string) {
				if s == tc.stage && !stopped {
					stopped = true
					panic("killed before its audit append")
				}
			}
			func() {
				defer func() { _ = recover() }()
				tc.start(t, fresh)
			}()
			failpoint = nil
			require.True(t, stopped, "stopped at %s", tc.stage)

			next, err := Open(dir, o)
			require.NoError(t, err)
			require.NoError(t, tryClaim(next, "b", gpu(1)))
			recs := auditRecords(t, next)
			require.True(t, slices.ContainsFunc(recs, tc.want), "what the stopped writer left out is in the log, or named lost: %v", opsOf(recs))
			for i := 1; i < len(recs); i++ {
				require.GreaterOrEqual(t, recs[i].Generation, recs[i-1].Generation, "the log is in generation order: %+v after %+v", recs[i], recs[i-1])
			}
			require.Greater(t, snapshot(t, next).Generation, uint64(5), "counted on from the log's last generation")
		})
	}
}

// An audit log carries no checksum: a damaged one naming a generation no
// ledger reaches is not numbered on from (the state's generation would
// wrap, and a second process read the fresh claims as an older state's).
func TestFreshStartIgnoresAnAuditedGenerationPastAnyLedgers(t *testing.T) {
	for _, gen := range []uint64{math.MaxUint64, math.MaxUint64 - 1, maxAuditedGeneration + 1} {
		t.Run(strconv.FormatUint(gen, 10), func(t *testing.T) {
			c := newClock()
			dir := t.TempDir()
			line := `{"time":"2026-03-01T11:00:00Z","op":"claim","container_id":"old","generation":` + strconv.FormatUint(gen, 10) + `,"pid":1}` + "\n"
			require.NoError(t, os.WriteFile(filepath.Join(dir, auditName), []byte(line), 0o600))
			l, err := Open(dir, testOptions(c))
			require.NoError(t, err)
			require.NoError(t, tryClaim(l, "a", gpu(0)))
			require.NoError(t, tryClaim(l, "b", gpu(1)))
			other, err := Open(dir, testOptions(c)) // another process: a hook, gpu-guard-ctl
			require.NoError(t, err)
			assert.True(t, isBusy(tryClaim(other, "intruder", gpu(0))), "GPU 0 is held by a")
			assert.Less(t, snapshot(t, other).Generation, uint64(maxAuditedGeneration))
		})
	}
}

// A state at the last generation a uint64 holds is not numbered on: the
// commit is refused (fail closed) instead of wrapping to 0.
func TestACommitAtTheLastGenerationIsRefused(t *testing.T) {
	c := newClock()
	l := openTest(t, c)
	require.NoError(t, tryClaim(l, "a", gpu(0)))
	l.cache.st.Generation = math.MaxUint64 // as a state that reached it would load
	err := tryClaim(l, "b", gpu(1))
	require.ErrorIs(t, err, ErrCorrupt)
	assert.Contains(t, err.Error(), "recover --reset")
}
