// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// readAuditOK reads the audit log of dir; every line must parse.
func readAuditOK(t *testing.T, dir string) []AuditRecord {
	t.Helper()
	recs, err := ReadAudit(filepath.Join(dir, auditName))
	require.NoError(t, err)
	return recs
}

// ofGeneration is the records of generation g, in log order.
func ofGeneration(recs []AuditRecord, g uint64) []AuditRecord {
	var out []AuditRecord
	for _, r := range recs {
		if r.Generation == g {
			out = append(out, r)
		}
	}
	return out
}

func opsOf(recs []AuditRecord) []string {
	ops := make([]string, len(recs))
	for i, r := range recs {
		ops[i] = r.Op
	}
	return ops
}

// requireInGenerationOrder: a late record never lands after a later
// generation's.
func requireInGenerationOrder(t *testing.T, recs []AuditRecord) {
	t.Helper()
	var prev uint64
	for i, r := range recs {
		require.GreaterOrEqual(t, r.Generation, prev, "record %d (%s)", i, r.Op)
		prev = r.Generation
	}
}

// A writer SIGKILLed once its commit's record is in the journal, before it
// appended the commit's audit records (at every such stage: the record
// written, synced, and each step of the compaction that follows), leaves
// the commit in effect and no record of it in the audit log. Whatever
// takes the lock next — a commit, an exemption's AppendAudit, a recovery
// of the healthy ledger, a recovery of a damaged one, a reset — appends
// the commit's records, from its journal record, before its own: an
// audit-late record of this process, then the killed writer's own records
// with its pid. Once: the writer after that adds nothing of that
// generation.
func TestACommitKilledBeforeItsAuditIsAuditedByTheNextWriter(t *testing.T) {
	ctx := context.Background()
	nexts := []struct {
		name string
		run  func(t *testing.T, l *Ledger)
		own  []string // the next writer's own records stamped with that generation
	}{
		{"update", func(t *testing.T, l *Ledger) { update(t, l, func(tx *Tx) { require.NoError(t, crashStep(tx)) }) }, nil},
		{"append-audit", func(t *testing.T, l *Ledger) {
			require.NoError(t, l.AppendAudit(ctx, AuditRecord{Op: "exempt", ContainerID: "dcgm"}))
		}, []string{"exempt"}},
		{"recover-healthy", func(t *testing.T, l *Ledger) {
			rep, err := l.Recover(ctx, RecoverOptions{Reason: "test"})
			require.NoError(t, err)
			require.Empty(t, rep.Problem)
		}, nil},
		{"recover-damaged", func(t *testing.T, l *Ledger) {
			require.NoError(t, os.WriteFile(l.StatePath(), []byte("damaged"), 0o600))
			rep, err := l.Recover(ctx, RecoverOptions{Reason: "test"})
			require.NoError(t, err)
			require.NotEmpty(t, rep.Problem)
			require.True(t, rep.Complete, "%+v", rep)
		}, nil},
		{"reset", func(t *testing.T, l *Ledger) {
			_, err := l.Reset(ctx, "test")
			require.NoError(t, err)
		}, nil},
	}
	for _, s := range []struct{ stage, compact string }{
		{stageAfterWrite, "0"},
		{stageAfterFsync, "0"},
		{stageSnapSynced, "1"},
		{stageAfterRename, "1"},
		{stagePrevKept, "1"},
		{stageJournalRotated, "1"},
		{stageJournalSwapped, "1"},
	} {
		for _, next := range nexts {
			t.Run(s.stage+"/"+next.name, func(t *testing.T) {
				dir, _ := seedCrashLedger(t)
				before := readBack(t, dir).Generation
				cmd := helperCmd(t, "crash-writer", map[string]string{"DIR": dir, "STAGE": s.stage, "AT": "1", "COMPACT": s.compact})
				out, err := cmd.CombinedOutput()
				require.True(t, killedBySIGKILL(err), "%v %s", err, out)
				killed := cmd.Process.Pid
				g := before + 1
				require.Equal(t, g, readBack(t, dir).Generation, "the killed commit is in effect")
				require.Empty(t, ofGeneration(readAuditOK(t, dir), g), "the killed writer appended nothing")

				l, err := Open(dir, Options{BootID: testBoot})
				require.NoError(t, err)
				next.run(t, l)

				recs := readAuditOK(t, dir)
				requireInGenerationOrder(t, recs)
				late := ofGeneration(recs, g)
				require.Equal(t, append([]string{OpAuditLate, OpClaim}, next.own...), opsOf(late), "the late records first")
				require.Equal(t, os.Getpid(), late[0].Pid)
				require.Contains(t, late[0].Reason, fmt.Sprintf("(pid %d) stopped before it appended them", killed))
				claim := late[1]
				require.Equal(t, killed, claim.Pid, "the commit's own record, as its writer rendered it")
				require.Equal(t, fmt.Sprintf("c%d", g), claim.ContainerID)
				require.Equal(t, []string{gpu(int(g) % 4).UUID}, claim.Devices)

				// Appended once: the next writer finds the log caught up.
				l2, err := Open(dir, Options{BootID: testBoot})
				require.NoError(t, err)
				update(t, l2, func(tx *Tx) {
					_, err := tx.Claim("", owner("after"), devs(gpu(9)), "env")
					require.NoError(t, err)
				})
				again := readAuditOK(t, dir)
				require.Equal(t, late, ofGeneration(again, g))
				requireInGenerationOrder(t, again)
				for _, r := range again {
					require.NotEqual(t, OpAuditLost, r.Op, r.Reason)
				}
			})
		}
	}
}

// The first writer after a reboot, killed once its genesis journal is in
// place (at each stage from there to the snapshot of the empty base), has
// dropped the earlier boot's claims for good: the next writer of the boot
// appends the discard record (and the kept cordon's) from that journal.
// After a power cut the next writer is of a third boot: it appends the
// second boot's discard, then its own.
func TestTheRebootDiscardIsAuditedWhenTheFirstWriterIsKilled(t *testing.T) {
	for _, stage := range []string{stageJournalSwapped, stageSnapWritten, stagePrevLinked, stageAfterRename, stagePrevKept, stageAfterDirSyn} {
		t.Run(stage, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "state")
			old := bootWithClaimAndCordon(t, dir)
			oldGen := snapshot(t, old).Generation

			runDir := t.TempDir()
			cmd := helperCmd(t, "reboot-writer", map[string]string{"DIR": dir, "STAGE": stage, "BOOT": nextBoot, "RUNDIR": runDir})
			out, err := cmd.CombinedOutput()
			require.True(t, killedBySIGKILL(err), "%v %s", err, out)
			killed := cmd.Process.Pid
			require.NotContains(t, opsOf(readAuditOK(t, dir)), OpDiscard, "the killed writer appended nothing")

			checkDiscard := func(t *testing.T, rec AuditRecord, gen uint64) {
				t.Helper()
				require.Equal(t, OpDiscard, rec.Op)
				require.Equal(t, gen, rec.Generation)
				require.Equal(t, killed, rec.Pid)
				require.Equal(t, []string{gpu(0).UUID}, rec.Devices, "the earlier boot's claim it dropped")
			}

			// Had the kill been a power cut: the third boot's first writer.
			third := copyStateDir(t, dir)
			l3, err := Open(third, Options{BootID: thirdBoot, RuntimeDir: t.TempDir()})
			require.NoError(t, err)
			update(t, l3, func(tx *Tx) {
				_, err := tx.Claim("", owner("third"), devs(gpu(3)), "env")
				require.NoError(t, err)
			})
			recs := readAuditOK(t, third)
			requireInGenerationOrder(t, recs)
			var discards []AuditRecord
			for _, r := range recs {
				if r.Op == OpDiscard {
					discards = append(discards, r)
				}
			}
			require.Len(t, discards, 2, "the second boot's, appended late, and the third's: %v", opsOf(recs))
			checkDiscard(t, discards[0], oldGen+1)
			require.Equal(t, os.Getpid(), discards[1].Pid)
			require.Equal(t, oldGen+2, discards[1].Generation)

			// The next writer of the same boot.
			l, err := Open(dir, Options{BootID: nextBoot, RuntimeDir: runDir})
			require.NoError(t, err)
			update(t, l, func(tx *Tx) {
				_, err := tx.Claim("", owner("later"), devs(gpu(3)), "env")
				require.NoError(t, err)
			})
			recs = readAuditOK(t, dir)
			requireInGenerationOrder(t, recs)
			late := ofGeneration(recs, oldGen+1)
			require.Equal(t, []string{OpAuditLate, OpDiscard, OpCordon, OpClaim}, opsOf(late))
			checkDiscard(t, late[1], oldGen+1)
			require.True(t, strings.HasPrefix(late[2].Reason, "kept across the reboot"), late[2].Reason)
			require.Equal(t, "fresh", late[3].ContainerID)
		})
	}
}

// A commit whose audit append fails (here audit.log is a directory, as a
// full disk or a planted file makes it fail) stands, and its records are
// appended by the next writer once the log can be written.
func TestACommitWhoseAuditAppendFailedIsAuditedByTheNextWriter(t *testing.T) {
	l, g, aside := ledgerWithUnauditedRelease(t)
	putAuditLogBack(t, l, aside)
	require.Empty(t, ofGeneration(readAuditOK(t, l.Dir()), g))

	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h1"), devs(gpu(1)), "env")
		require.NoError(t, err)
	})
	recs := readAuditOK(t, l.Dir())
	requireInGenerationOrder(t, recs)
	late := ofGeneration(recs, g)
	require.Equal(t, []string{OpAuditLate, OpRelease}, opsOf(late))
	require.Equal(t, "h0", late[1].ContainerID)
	require.Equal(t, "stop", late[1].Reason)
	require.Equal(t, []string{OpClaim}, opsOf(ofGeneration(recs, g+1)))
}

// cutAuditAfter drops the records of the generations after g from the end
// of the audit log, as a power cut drops what was not yet written back.
func cutAuditAfter(t *testing.T, dir string, g uint64) {
	t.Helper()
	p := filepath.Join(dir, auditName)
	data := mustRead(t, p)
	recs := readAuditOK(t, dir)
	keep := 0
	for _, r := range recs {
		if r.Generation > g {
			break
		}
		keep++
	}
	lines := bytes.SplitAfter(data, []byte("\n"))
	require.NoError(t, os.WriteFile(p, bytes.Join(lines[:keep], nil), 0o600))
	require.Len(t, readAuditOK(t, dir), keep)
}

// Records the audit log lost whose journal records are gone too (here
// compacted away: the journals hold the commits since the compaction
// before the last) are reported, one audit-lost record naming the
// generations; those the journals still hold are appended.
func TestAuditRecordsNoJournalHoldsAreReportedLost(t *testing.T) {
	opts := testOptions(newClock())
	opts.RuntimeDir = t.TempDir()
	l, err := Open(filepath.Join(t.TempDir(), "state"), opts)
	require.NoError(t, err)
	l.compactAlways = true
	for i := 0; i < 7; i++ {
		update(t, l, func(tx *Tx) {
			_, err := tx.Claim("", owner(fmt.Sprintf("c%d", i)), devs(gpu(i)), "env")
			require.NoError(t, err)
		})
	}
	g := snapshot(t, l).Generation // 7: the journals hold only its record
	cutAuditAfter(t, l.Dir(), g-4)

	update(t, l, func(tx *Tx) { tx.Release("c0", "stop") })
	recs := readAuditOK(t, l.Dir())
	requireInGenerationOrder(t, recs)
	require.Equal(t, []string{OpAuditLost}, opsOf(ofGeneration(recs, g-1)))
	lost := ofGeneration(recs, g-1)[0]
	require.Contains(t, lost.Reason, fmt.Sprintf("generations %d to %d", g-3, g-1))
	require.Empty(t, ofGeneration(recs, g-3))
	require.Empty(t, ofGeneration(recs, g-2))
	require.Equal(t, []string{OpAuditLate, OpClaim}, opsOf(ofGeneration(recs, g)))
	require.Equal(t, []string{OpRelease}, opsOf(ofGeneration(recs, g+1)))
}

// An audit log with no record at all (removed by hand, or a state dir
// restored without it) gets the records the journals hold, and no
// audit-lost record for the generations before: that is no commit's loss.
func TestARemovedAuditLogIsNotReportedLost(t *testing.T) {
	opts := testOptions(newClock())
	opts.RuntimeDir = t.TempDir()
	l, err := Open(filepath.Join(t.TempDir(), "state"), opts)
	require.NoError(t, err)
	l.compactAlways = true
	for i := 0; i < 3; i++ {
		update(t, l, func(tx *Tx) {
			_, err := tx.Claim("", owner(fmt.Sprintf("c%d", i)), devs(gpu(i)), "env")
			require.NoError(t, err)
		})
	}
	g := snapshot(t, l).Generation
	require.NoError(t, os.Remove(l.AuditPath()))
	update(t, l, func(tx *Tx) { tx.Release("c0", "stop") })
	recs := readAuditOK(t, l.Dir())
	require.Equal(t, []string{OpAuditLate, OpClaim, OpRelease}, opsOf(recs))
	require.Equal(t, g, recs[0].Generation)
}

// rewriteJournalAsVersion2 makes the journal in dir what a build of
// journal 2 wrote: its header says 2 and its records carry no audit
// records.
func rewriteJournalAsVersion2(t *testing.T, dir string) {
	t.Helper()
	p := filepath.Join(dir, journalName)
	lines, _, torn, err := journalLines(mustRead(t, p), 0)
	require.NoError(t, err)
	require.Equal(t, int64(-1), torn)
	hdr, err := decodeHeader(lines[0])
	require.NoError(t, err)
	hdr.Journal = 2
	out, err := appendJournalLine(nil, hdr)
	require.NoError(t, err)
	for _, line := range lines[1:] {
		r, err := decodeRecord(line, 0)
		require.NoError(t, err)
		r.Audit = nil
		out, err = appendRecordLine(out, &r)
		require.NoError(t, err)
	}
	require.NoError(t, os.WriteFile(p, out, 0o600))
}

// A journal 2 (an older build's) is read, and the next commit replaces it
// with a journal 3 (kept as .prev) instead of appending to it records
// that a build of journal 2 would take for damage. Its records carry no
// audit records: a generation of it the audit log lacks is reported lost.
func TestAJournalOfVersion2IsReplacedAtTheNextCommit(t *testing.T) {
	opts := testOptions(newClock())
	opts.RuntimeDir = t.TempDir()
	l, err := Open(filepath.Join(t.TempDir(), "state"), opts)
	require.NoError(t, err)
	for i := 0; i < 3; i++ {
		update(t, l, func(tx *Tx) {
			_, err := tx.Claim("", owner(fmt.Sprintf("c%d", i)), devs(gpu(i)), "env")
			require.NoError(t, err)
		})
	}
	want := snapshot(t, l)
	rewriteJournalAsVersion2(t, l.Dir())
	cutAuditAfter(t, l.Dir(), want.Generation-1)

	fresh, err := Open(l.Dir(), opts)
	require.NoError(t, err)
	require.Equal(t, holders(want), holders(snapshot(t, fresh)), "a journal 2 reads as it did")
	update(t, fresh, func(tx *Tx) { tx.Release("c0", "stop") })

	lines, _, _, err := journalLines(mustRead(t, fresh.JournalPath()), 0)
	require.NoError(t, err)
	hdr, err := decodeHeader(lines[0])
	require.NoError(t, err)
	require.Equal(t, journalFormat, hdr.Journal)
	require.Equal(t, want.Generation, hdr.Base, "a new journal after the state the commit followed")
	require.Len(t, lines, 2)
	rec, err := decodeRecord(lines[1], 0)
	require.NoError(t, err)
	require.NotEmpty(t, rec.Audit, "records of this build carry their audit records")
	prevLines, _, _, err := journalLines(mustRead(t, filepath.Join(l.Dir(), journalPrevName)), 0)
	require.NoError(t, err)
	prevHdr, err := decodeHeader(prevLines[0])
	require.NoError(t, err)
	require.Equal(t, 2, prevHdr.Journal, "the journal 2 is kept for Recover")

	recs := readAuditOK(t, l.Dir())
	require.Equal(t, []string{OpAuditLost}, opsOf(ofGeneration(recs, want.Generation)))
	require.Contains(t, ofGeneration(recs, want.Generation)[0].Reason, fmt.Sprintf("generation %d,", want.Generation))
	require.Equal(t, []string{OpRelease}, opsOf(ofGeneration(recs, want.Generation+1)))
	again, err := Open(l.Dir(), opts)
	require.NoError(t, err)
	st := snapshot(t, again)
	require.Equal(t, map[string]string{gpu(1).UUID: "c1", gpu(2).UUID: "c2"}, holders(st))
}

// A writer whose catch-up append fails (here: audit.log is open read-only
// for it) still appends its own records, which put the log's last
// generation past the gap: no later writer would look there again. So an
// audit-lost record naming the gap, and why, precedes them. A writer whose
// own append fails too leaves the log as it was, and the next writer
// catches up.
func TestAFailedCatchUpIsReportedLost(t *testing.T) {
	for _, tc := range []struct {
		name     string
		ownFails bool
	}{
		{name: "the writer's own records are appended"},
		{name: "the writer's own append fails too", ownFails: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, g, aside := ledgerWithUnauditedRelease(t)
			putAuditLogBack(t, l, aside)

			a, err := openAuditLog(l.Dir(), l.opts.AuditMaxBytes)
			require.NoError(t, err)
			rw := a.f
			ro, err := os.Open(l.AuditPath())
			require.NoError(t, err)
			a.f = ro
			a.catchUp(l, g)
			if !tc.ownFails {
				a.f = rw
			}
			err = a.write([]AuditRecord{{Time: l.now(), Op: "exempt", ContainerID: "x", Generation: g, Pid: os.Getpid()}}, nil, true)
			if tc.ownFails {
				require.Error(t, err)
				a.f = rw
			} else {
				require.NoError(t, err)
			}
			require.NoError(t, ro.Close())
			require.NoError(t, a.close())

			recs := readAuditOK(t, l.Dir())
			requireInGenerationOrder(t, recs)
			if tc.ownFails {
				require.Empty(t, ofGeneration(recs, g), "nothing appended")
			} else {
				of := ofGeneration(recs, g)
				require.Equal(t, []string{OpAuditLost, "exempt"}, opsOf(of))
				require.Contains(t, of[0].Reason, fmt.Sprintf("no record of generation %d, and appending them from their journal records failed", g))
			}

			// The next writer: the gap is told once, as lost or caught up.
			update(t, l, func(tx *Tx) {
				_, err := tx.Claim("", owner("h1"), devs(gpu(1)), "env")
				require.NoError(t, err)
			})
			recs = readAuditOK(t, l.Dir())
			requireInGenerationOrder(t, recs)
			if tc.ownFails {
				require.Equal(t, []string{OpAuditLate, OpRelease}, opsOf(ofGeneration(recs, g)))
			} else {
				require.Equal(t, []string{OpAuditLost, "exempt"}, opsOf(ofGeneration(recs, g)))
			}
			require.Equal(t, []string{OpClaim}, opsOf(ofGeneration(recs, g+1)))
		})
	}
}

// A writer that could not open the audit log before its write (so caught
// nothing up), and can once its state is written, appends the records the
// log lacks before its own: appended straight away, its own would move the
// log's last generation past the gap, and nothing would name it after.
func TestAWriterThatOpensTheAuditLogLateCatchesUpFirst(t *testing.T) {
	l, missed, aside := ledgerWithUnauditedRelease(t)

	// The next writer cannot open the log before its write either; the
	// log is put back while it writes.
	failpoint = func(stage string) {
		if stage == stageBeforeWrite {
			putAuditLogBack(t, l, aside)
		}
	}
	t.Cleanup(func() { failpoint = nil })
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h1"), devs(gpu(1)), "env")
		require.NoError(t, err)
	})
	failpoint = nil

	recs := readAuditOK(t, l.Dir())
	requireInGenerationOrder(t, recs)
	late := ofGeneration(recs, missed)
	require.NotEmpty(t, late, "the release's records are appended before the next commit's")
	require.Contains(t, opsOf(late), OpAuditLate)
	require.Contains(t, opsOf(late), "release")
	require.NotEmpty(t, ofGeneration(recs, missed+1), "the writer's own records follow")
}

// ledgerWithUnauditedRelease returns a ledger whose last commit (generation
// g, h0's release) could not append its audit records: audit.log is a
// directory, the log itself set aside at aside (putAuditLogBack). Its
// records are only in its journal record.
func ledgerWithUnauditedRelease(t *testing.T) (l *Ledger, g uint64, aside string) {
	t.Helper()
	l = ledgerWithClaim(t, "h0", nil)
	aside = l.AuditPath() + ".moved"
	require.NoError(t, os.Rename(l.AuditPath(), aside))
	require.NoError(t, os.Mkdir(l.AuditPath(), 0o700))
	update(t, l, func(tx *Tx) { tx.Release("h0", "stop") })
	return l, snapshot(t, l).Generation, aside
}

// putAuditLogBack puts the log ledgerWithUnauditedRelease set aside back.
func putAuditLogBack(t *testing.T, l *Ledger, aside string) {
	t.Helper()
	require.NoError(t, os.Remove(l.AuditPath()))
	require.NoError(t, os.Rename(aside, l.AuditPath()))
}
