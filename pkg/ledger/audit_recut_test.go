// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The write that catches up what a cut write left out can be cut short in
// turn, and so can one that rotates audit.log. Whatever it leaves, no
// record of a commit goes missing without an audit-lost record naming its
// generation, and none is in the log twice.

// noteLine renders a note of the log itself (audit-torn, audit-late) of
// generation g, as a writer before the next one left it.
func noteLine(t *testing.T, op string, g uint64) string {
	t.Helper()
	return renderAudit(t, AuditRecord{Time: newClock().Now(), Op: op, Generation: g, Pid: 1, Reason: "a writer before"})
}

// requireNoLostNote: no audit-lost record in recs.
func requireNoLostNote(t *testing.T, recs []AuditRecord) {
	t.Helper()
	for _, r := range recs {
		require.NotEqual(t, OpAuditLost, r.Op, "generation %d: %s", r.Generation, r.Reason)
	}
}

// A catch-up's write (a newline, an audit-torn note, an audit-late note,
// then the commit's records the log lacks) cut short leaves the log's own
// notes between the commit's records the log has and the unfinished line.
// They are not records of the commit: the next writer still appends each of
// the commit's records the log lacks, once. So it does when the cut falls
// right after a note's newline: a note is always followed by records in
// the same write, so a log that ends with one ends where a write was cut.
func TestACutCatchUpIsCaughtUpAgain(t *testing.T) {
	for _, tc := range []struct {
		name string
		// left is what the cut writes left, after the log of a ledger
		// whose last commit (generation g, records lines) appended none.
		left func(t *testing.T, lines []string, g uint64) string
		ops  []string // of generation g once the next writer appended
	}{
		{
			name: "cut inside the audit-late note",
			left: func(t *testing.T, lines []string, g uint64) string {
				return lines[0] + lines[1][:30] + "\n" + noteLine(t, OpAuditTorn, g) + noteLine(t, OpAuditLate, g)[:20]
			},
			ops: []string{OpClaim, OpAuditTorn, OpAuditTorn, OpAuditLate, OpClaim, OpClaim},
		},
		{
			name: "cut inside the first record after the audit-late note",
			left: func(t *testing.T, lines []string, g uint64) string {
				return lines[0] + lines[1][:30] + "\n" + noteLine(t, OpAuditTorn, g) + noteLine(t, OpAuditLate, g) + lines[1][:10]
			},
			ops: []string{OpClaim, OpAuditTorn, OpAuditLate, OpAuditTorn, OpAuditLate, OpClaim, OpClaim},
		},
		{
			name: "cut inside the last record",
			left: func(t *testing.T, lines []string, g uint64) string {
				return lines[0] + lines[1][:30] + "\n" + noteLine(t, OpAuditTorn, g) + noteLine(t, OpAuditLate, g) + lines[1] + lines[2][:10]
			},
			ops: []string{OpClaim, OpAuditTorn, OpAuditLate, OpClaim, OpAuditTorn, OpAuditLate, OpClaim},
		},
		{
			name: "cut right after the audit-late note",
			left: func(t *testing.T, lines []string, g uint64) string {
				return lines[0] + lines[1][:30] + "\n" + noteLine(t, OpAuditTorn, g) + noteLine(t, OpAuditLate, g)
			},
			ops: []string{OpClaim, OpAuditTorn, OpAuditLate, OpAuditLate, OpClaim, OpClaim},
		},
		{
			name: "cut right after the audit-torn note",
			left: func(t *testing.T, lines []string, g uint64) string {
				return lines[0] + lines[1][:30] + "\n" + noteLine(t, OpAuditTorn, g)
			},
			ops: []string{OpClaim, OpAuditTorn, OpAuditLate, OpClaim, OpClaim},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, g, want := ledgerWithUnauditedCommit(t)
			var lines []string
			for _, r := range want {
				lines = append(lines, renderAudit(t, r))
			}
			before := mustRead(t, l.AuditPath())
			left := tc.left(t, lines, g)
			appendRaw(t, l.AuditPath(), left)

			update(t, l, func(tx *Tx) { tx.Release("h0", "stop") })
			after := mustRead(t, l.AuditPath())
			require.Equal(t, string(before)+left, string(after[:len(before)+len(left)]), "what the cut writes left is left as it was")
			recs, _ := ReadAudit(l.AuditPath())
			requireInGenerationOrder(t, recs)
			requireNoLostNote(t, recs)
			require.Equal(t, tc.ops, opsOf(ofGeneration(recs, g)))
			requireEachOnce(t, recs, want)
			require.Equal(t, []string{OpRelease}, opsOf(ofGeneration(recs, g+1)))

			// Appended once: the writer after finds the log caught up.
			update(t, l, func(tx *Tx) { tx.Release("h1", "stop") })
			again, _ := ReadAudit(l.AuditPath())
			require.Equal(t, recs, again[:len(recs)])
			require.Equal(t, []string{OpRelease}, opsOf(again[len(recs):]))
		})
	}
}

// A catch-up write cut short inside its audit-late note (a full disk),
// then the same writer's own write failing whole, leaves the audit-lost
// note it would have written only in memory. The next writer finds the
// log as the cut write left it, and appends what it lacks.
func TestACatchUpCutShortThenAFullDiskIsCaughtUpByTheNextWriter(t *testing.T) {
	l, g, want := ledgerWithUnauditedCommit(t)
	lines := renderAudit(t, want...)
	left := lines[:strings.IndexByte(lines, '\n')+1] + strings.SplitAfter(lines, "\n")[1][:30]
	appendRaw(t, l.AuditPath(), left)

	calls := 0
	cutAuditWrites(t, func(b []byte) int {
		calls++
		if calls > 1 {
			return 0 // the disk is full
		}
		// "\n", the audit-torn note, then 10 bytes of the audit-late one.
		require.Equal(t, []string{OpAuditTorn, OpAuditLate, OpClaim, OpClaim}, opsOf(mustParse(t, b)))
		return 1 + strings.IndexByte(string(b[1:]), '\n') + 1 + 10
	})
	update(t, l, func(tx *Tx) { tx.Release("h0", "stop") })
	require.Equal(t, 2, calls)
	auditWrite = (*os.File).Write

	update(t, l, func(tx *Tx) { tx.Release("h1", "stop") })
	recs, _ := ReadAudit(l.AuditPath())
	requireInGenerationOrder(t, recs)
	requireNoLostNote(t, recs)
	require.Equal(t, []string{OpClaim, OpAuditTorn, OpAuditTorn, OpAuditLate, OpClaim, OpClaim}, opsOf(ofGeneration(recs, g)))
	requireEachOnce(t, recs, want)
	require.Equal(t, []string{OpAuditLate, OpRelease}, opsOf(ofGeneration(recs, g+1)), "the commit whose own write failed")
	require.Equal(t, []string{OpRelease}, opsOf(ofGeneration(recs, g+2)))
}

// A writer whose catch-up append failed whole (a full disk) writes, with
// its own records, the audit-torn note of the unfinished line it follows and
// the audit-lost note of what it could not catch up. A write cut right after
// the audit-torn note's newline leaves that note as the log's last record:
// it is stamped with the generation of the record before it, so the next
// writer catches up everything after that, the generations the audit-lost
// note would have named included.
func TestAWriteCutRightAfterItsAuditTornNoteLosesNothing(t *testing.T) {
	l, g, want := ledgerWithUnauditedCommit(t)
	appendRaw(t, l.AuditPath(), renderAudit(t, want[0])[:30])
	calls := 0
	cutAuditWrites(t, func(b []byte) int {
		calls++
		if calls == 1 {
			return 0 // the catch-up: the disk is full
		}
		require.Equal(t, []string{OpAuditTorn, OpAuditLost, OpRelease}, opsOf(mustParse(t, b)))
		return 1 + strings.IndexByte(string(b[1:]), '\n') + 1 // "\n", then the audit-torn note whole
	})
	update(t, l, func(tx *Tx) { tx.Release("h0", "stop") })
	require.Equal(t, 2, calls)
	auditWrite = (*os.File).Write

	update(t, l, func(tx *Tx) { tx.Release("h1", "stop") })
	recs, _ := ReadAudit(l.AuditPath())
	requireInGenerationOrder(t, recs)
	requireNoLostNote(t, recs)
	requireEachOnce(t, recs, want)
	require.Equal(t, []string{OpAuditLate, OpRelease}, opsOf(ofGeneration(recs, g+1)))
	require.Equal(t, []string{OpRelease}, opsOf(ofGeneration(recs, g+2)))
}

// mustParse reads the records of an audit write's payload (its lines that
// decode).
func mustParse(t *testing.T, payload []byte) []AuditRecord {
	t.Helper()
	p := filepath.Join(t.TempDir(), "payload")
	require.NoError(t, os.WriteFile(p, payload, 0o600))
	recs, _ := ReadAudit(p)
	return recs
}

// A write that rotated audit.log and was then cut short leaves the first
// of the commit's records, and the unfinished line, as all of audit.log:
// the commit's records that the log has may go back into audit.log.1. The
// next writer reads on there, and appends each record the log lacks, once.
func TestAWriteCutShortAfterARotationIsCaughtUp(t *testing.T) {
	l := ledgerWithClaim(t, "h0", func(o *Options) { o.AuditMaxBytes = 600 })
	first := mustRead(t, l.AuditPath())
	cutAuditWrites(t, inSecondLine)
	claimThree(t, l)
	auditWrite = (*os.File).Write
	g := snapshot(t, l).Generation
	want := l.lateAudit(g, g, true, l.now(), os.Getpid(), nil)[1:]
	require.Equal(t, string(first), string(mustRead(t, l.AuditPath()+".1")), "the cut write rotated the log")
	require.Equal(t, renderAudit(t, want[0])+renderAudit(t, want[1])[:10], string(mustRead(t, l.AuditPath())))

	l.opts.AuditMaxBytes = 1 << 20 // no more rotations: every record stays readable
	update(t, l, func(tx *Tx) { tx.Release("h0", "stop") })
	recs, err := ReadAudit(l.AuditPath())
	require.ErrorContains(t, err, "an unfinished record of 10 bytes")
	requireInGenerationOrder(t, recs)
	requireNoLostNote(t, recs)
	require.Equal(t, []string{OpClaim, OpAuditTorn, OpAuditLate, OpClaim, OpClaim}, opsOf(ofGeneration(recs, g)))
	requireEachOnce(t, recs, want)
	require.Equal(t, []string{OpRelease}, opsOf(ofGeneration(recs, g+1)))
}

// A log that ends inside a line and must be rotated gets its newline first,
// in the old file: audit.log.1 then ends with a line of its own, and the
// next writer, finding audit.log empty (the write after the rotation
// failed: a full disk), reads its last record there, and what a cut write
// carried. The writers meanwhile fail whole (nothing written): when the
// newline cannot be written either, nothing is rotated, and the log stays
// as it was. The commits in between are appended once the disk has room:
// none is passed over.
func TestALogRotatedInsideALineIsCaughtUp(t *testing.T) {
	for _, tc := range []struct {
		name    string
		cut     func(payload []byte) int
		rotated bool // the first writer rotated the log
	}{
		{"every write fails", func([]byte) int { return 0 }, false},
		{"only the newline that ends the old file is written", func(b []byte) int {
			if string(b) == "\n" {
				return -1
			}
			return 0
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, g, want := ledgerWithUnauditedCommit(t)
			fragment := renderAudit(t, want[0])[:30]
			appendRaw(t, l.AuditPath(), fragment)
			before := mustRead(t, l.AuditPath())
			l.opts.AuditMaxBytes = int64(len(before)) + 100
			cutAuditWrites(t, tc.cut)
			update(t, l, func(tx *Tx) { tx.Release("h0", "stop") })
			auditWrite = (*os.File).Write
			if tc.rotated {
				require.Equal(t, string(before)+"\n", string(mustRead(t, l.AuditPath()+".1")))
				require.Empty(t, mustRead(t, l.AuditPath()))
			} else {
				require.Equal(t, string(before), string(mustRead(t, l.AuditPath())), "nothing rotated")
				require.NoFileExists(t, l.AuditPath()+".1")
			}

			l.opts.AuditMaxBytes = 1 << 20
			update(t, l, func(tx *Tx) { tx.Release("h1", "stop") })
			recs, _ := ReadAudit(l.AuditPath())
			requireInGenerationOrder(t, recs)
			requireNoLostNote(t, recs)
			requireEachOnce(t, recs, want)
			require.Equal(t, []string{OpAuditLate, OpRelease}, opsOf(ofGeneration(recs, g+1)))
			require.Equal(t, []string{OpRelease}, opsOf(ofGeneration(recs, g+2)))
		})
	}
}

// A rotation leaves the unfinished line it moves into audit.log.1 ended by
// a newline, and the audit-torn note, now at the start of the new
// audit.log, says where it is.
func TestARotationEndsTheUnfinishedLineItMoves(t *testing.T) {
	dir := t.TempDir()
	rec := renderAudit(t, AuditRecord{Time: newClock().Now(), Op: OpClaim, ContainerID: "c", Generation: 4, Pid: 1})
	fragment := `{"time":"2026-03-01T12:00:00Z","op":"cl`
	require.NoError(t, os.WriteFile(filepath.Join(dir, auditName), []byte(rec+fragment), 0o600))
	a, err := openAuditLog(dir, int64(len(rec)+len(fragment)+10))
	require.NoError(t, err)
	require.NoError(t, a.write([]AuditRecord{{Time: newClock().Now(), Op: OpRelease, ContainerID: "c", Generation: 5, Pid: 1}}, nil, true))
	require.NoError(t, a.close())

	require.Equal(t, rec+fragment+"\n", string(mustRead(t, filepath.Join(dir, auditRotated))))
	recs, err := ReadAudit(filepath.Join(dir, auditName))
	require.ErrorContains(t, err, fmt.Sprintf("%s line 2: an unfinished record of %d bytes", auditRotated, len(fragment)))
	require.Equal(t, []string{OpClaim, OpAuditTorn, OpRelease}, opsOf(recs))
	require.Contains(t, recs[1].Reason, fmt.Sprintf("an unfinished record of %d bytes ends %s", len(fragment), auditRotated))
	require.NotContains(t, recs[1].Reason, "precedes this one")
}

// When what the log has of the generation a cut write was appending is not
// what a cut write of that commit's records leaves, it is not known which
// of them the log lacks: none is appended (none twice), and an audit-lost
// record says that generation may lack records.
func TestAnUnmatchedRunIsReportedMaybeLost(t *testing.T) {
	l, g, want := ledgerWithUnauditedCommit(t)
	lines := strings.SplitAfter(renderAudit(t, want...), "\n")
	appendRaw(t, l.AuditPath(), lines[1]+lines[2][:30]) // the second record, without the first

	update(t, l, func(tx *Tx) { tx.Release("h0", "stop") })
	recs, _ := ReadAudit(l.AuditPath())
	requireInGenerationOrder(t, recs)
	of := ofGeneration(recs, g)
	require.Equal(t, []string{OpClaim, OpAuditTorn, OpAuditLost}, opsOf(of), "nothing appended twice")
	require.Equal(t, want[1], of[0])
	require.Contains(t, of[2].Reason, fmt.Sprintf("generation %d may lack records", g))
	require.Equal(t, []string{OpRelease}, opsOf(ofGeneration(recs, g+1)))

	update(t, l, func(tx *Tx) { tx.Release("h1", "stop") })
	again, _ := ReadAudit(l.AuditPath())
	require.Equal(t, recs, again[:len(recs)], "said once")
}
