// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// A write to audit.log cut short leaves an unfinished line without its
// newline. These tests leave one as a writer killed inside its write(2)
// does (written into audit.log by hand, before the next writer opens it),
// or make a write stop partway as a full disk does (auditWrite).

// cutAuditWrites makes the audit writes for which cut returns n >= 0 write
// only their first n bytes and fail with ENOSPC, as a full disk does; the
// others are written whole.
func cutAuditWrites(t *testing.T, cut func(payload []byte) int) {
	t.Helper()
	auditWrite = func(f *os.File, b []byte) (int, error) {
		n := cut(b)
		if n < 0 {
			return f.Write(b)
		}
		w, err := f.Write(b[:n])
		if err != nil {
			return w, err
		}
		return w, syscall.ENOSPC
	}
	t.Cleanup(func() { auditWrite = (*os.File).Write })
}

// inSecondLine is a cut inside the second line of payload.
func inSecondLine(payload []byte) int {
	return bytes.IndexByte(payload, '\n') + 1 + 10
}

// appendRaw appends s to the file at p as it is.
func appendRaw(t *testing.T, p, s string) {
	t.Helper()
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(t, err)
	_, err = f.WriteString(s)
	require.NoError(t, err)
	require.NoError(t, f.Close())
}

// renderAudit renders recs as appendAuditLine does, one line each.
func renderAudit(t *testing.T, recs ...AuditRecord) string {
	t.Helper()
	b, err := appendAuditLines(nil, recs)
	require.NoError(t, err)
	return string(b)
}

// requireEachOnce: every record of want (one commit's) is in recs exactly
// once (compared as rendered), and recs holds no other record of that
// generation with one of their ops.
func requireEachOnce(t *testing.T, recs []AuditRecord, want []AuditRecord) {
	t.Helper()
	count := map[string]int{}
	for _, r := range recs {
		if r.Generation == want[0].Generation && slices.Contains(opsOf(want), r.Op) {
			count[renderAudit(t, r)]++
		}
	}
	for i, w := range want {
		require.Equal(t, 1, count[renderAudit(t, w)], "record %d of the commit (%s %s)", i, w.Op, w.ContainerID)
		delete(count, renderAudit(t, w))
	}
	require.Empty(t, count, "records of the generation the commit does not have")
}

// A log that ends inside a line keeps that line as it was: a writer that
// appends nothing leaves the file untouched (the fragment is not cut away
// unnoticed), the next commit ends the line with a newline in its own
// write and notes it, its own records each on a line of their own, and
// ReadAudit names the fragment by line and byte offset. The commit after
// that appends its records and nothing more: no newline of its own.
func TestATornAuditLineIsEndedNotCut(t *testing.T) {
	ctx := context.Background()
	l := ledgerWithClaim(t, "h1", nil)
	good := readAuditOK(t, l.Dir())
	before := mustRead(t, l.AuditPath())
	fragment := `{"time":"2026-03-01T12:00:00Z","op":"claim","devices":["GPU-000`
	appendRaw(t, l.AuditPath(), fragment)

	// Recover finds the healthy ledger and the log caught up: it appends
	// nothing, and leaves the fragment where it is.
	rep, err := l.Recover(ctx, RecoverOptions{Reason: "test"})
	require.NoError(t, err)
	require.Empty(t, rep.Problem)
	require.Equal(t, string(before)+fragment, string(mustRead(t, l.AuditPath())), "a writer that appends nothing changes nothing")

	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h2"), devs(gpu(1)), "env")
		require.NoError(t, err)
	})
	g := snapshot(t, l).Generation
	after := mustRead(t, l.AuditPath())
	require.Equal(t, string(before)+fragment+"\n", string(after[:len(before)+len(fragment)+1]), "the fragment is left as it was, ended")
	recs, err := ReadAudit(l.AuditPath())
	require.ErrorContains(t, err, fmt.Sprintf("line %d: an unfinished record of %d bytes at byte offset %d (its write was cut short",
		len(good)+1, len(fragment), len(before)))
	require.Equal(t, good, recs[:len(good)])
	require.Equal(t, []string{OpAuditTorn, OpClaim}, opsOf(recs[len(good):]))
	require.Contains(t, recs[len(good)].Reason, fmt.Sprintf("an unfinished record of %d bytes precedes this one", len(fragment)))
	require.Equal(t, "h2", recs[len(good)+1].ContainerID)
	require.Equal(t, g, recs[len(good)+1].Generation)
	require.Equal(t, string(after[len(before)+len(fragment)+1:]), renderAudit(t, recs[len(good):]...), "each record on a line of its own")

	// No fragment: the commit's lines and nothing else.
	update(t, l, func(tx *Tx) { tx.Release("h2", "stop") })
	again := mustRead(t, l.AuditPath())
	recs2, err := ReadAudit(l.AuditPath())
	require.Error(t, err, "the fragment stays a bad line")
	require.Len(t, recs2, len(recs)+1)
	require.Equal(t, OpRelease, recs2[len(recs)].Op)
	require.Equal(t, string(after)+renderAudit(t, recs2[len(recs)]), string(again), "no newline added where none is missing")
}

// ledgerWithClaim opens a ledger in a new directory (options as
// testOptions gives them, then edit, if any) whose one commit claimed GPU 0
// for holder: an audit log of one record.
func ledgerWithClaim(t *testing.T, holder string, edit func(*Options)) *Ledger {
	t.Helper()
	opts := testOptions(newClock())
	opts.RuntimeDir = t.TempDir()
	if edit != nil {
		edit(&opts)
	}
	l, err := Open(filepath.Join(t.TempDir(), "state"), opts)
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner(holder), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	return l
}

// claimThree commits claims of GPUs 1 to 3 for h1 to h3 in one commit: one
// write of three audit records.
func claimThree(t *testing.T, l *Ledger) {
	t.Helper()
	update(t, l, func(tx *Tx) {
		for i := 1; i <= 3; i++ {
			_, err := tx.Claim("", owner(fmt.Sprintf("h%d", i)), devs(gpu(i)), "env")
			require.NoError(t, err)
		}
	})
}

// ledgerWithUnauditedCommit returns a ledger whose last commit (generation
// g) claimed three GPUs, one audit record each, and could not append them:
// they are only in its journal record (recs), and audit.log is as the
// commit before left it.
func ledgerWithUnauditedCommit(t *testing.T) (l *Ledger, g uint64, recs []AuditRecord) {
	t.Helper()
	l = ledgerWithClaim(t, "h0", nil)
	aside := l.AuditPath() + ".moved"
	require.NoError(t, os.Rename(l.AuditPath(), aside))
	require.NoError(t, os.Mkdir(l.AuditPath(), 0o700))
	claimThree(t, l)
	putAuditLogBack(t, l, aside)
	g = snapshot(t, l).Generation
	late := l.lateAudit(g, g, true, l.now(), os.Getpid(), nil)
	require.Equal(t, []string{OpAuditLate, OpClaim, OpClaim, OpClaim}, opsOf(late))
	return l, g, late[1:]
}

// A writer killed inside the write(2) that appends a commit's records (its
// own, or a later writer's catch-up) may have written some of them whole
// before the unfinished line. The generation of the log's last record is
// then not all there: the next writer appends, after the unfinished line,
// each of the commit's records the log lacks, from its journal record, and
// none it has. The unfinished line is not one it has, even one that lacks
// only its closing brace; one that lacks only its newline is whole. Each
// record is on a line of its own, none is missing and none is twice in the
// log, and the writer after adds nothing of that generation. The next
// writer is a commit, or an exemption's AppendAudit, whose own record is of
// that generation.
func TestAKilledWritersRecordsAfterATornLineAreAppendedOnce(t *testing.T) {
	nexts := []struct {
		name string
		run  func(t *testing.T, l *Ledger)
		own  []string // the next writer's own records stamped with that generation
	}{
		{"update", func(t *testing.T, l *Ledger) {
			update(t, l, func(tx *Tx) {
				_, err := tx.Claim("", owner("h9"), devs(gpu(9)), "env")
				require.NoError(t, err)
			})
		}, nil},
		{"append-audit", func(t *testing.T, l *Ledger) {
			require.NoError(t, l.AppendAudit(context.Background(), AuditRecord{Op: "exempt", ContainerID: "dcgm"}))
		}, []string{"exempt"}},
	}
	for _, tc := range []struct {
		name string
		// left is what the killed write left, of the commit's lines and
		// of the audit-late record a catch-up writes before them.
		left func(lines []string, late string) string
		ops  []string // of the generation, once the next writer appended
		bad  int      // unfinished lines ReadAudit reports
	}{
		{
			name: "cut inside the second record",
			left: func(lines []string, _ string) string { return lines[0] + lines[1][:30] },
			ops:  []string{OpClaim, OpAuditTorn, OpAuditLate, OpClaim, OpClaim},
			bad:  1,
		},
		{
			name: "cut right before the second record's closing brace",
			left: func(lines []string, _ string) string { return lines[0] + strings.TrimSuffix(lines[1], "}\n") },
			ops:  []string{OpClaim, OpAuditTorn, OpAuditLate, OpClaim, OpClaim},
			bad:  1,
		},
		{
			name: "cut right before the second record's newline",
			left: func(lines []string, _ string) string { return lines[0] + strings.TrimSuffix(lines[1], "\n") },
			ops:  []string{OpClaim, OpClaim, OpAuditLate, OpClaim},
		},
		{
			name: "a catch-up cut inside the first record",
			left: func(lines []string, late string) string { return late + lines[0][:30] },
			ops:  []string{OpAuditLate, OpAuditTorn, OpAuditLate, OpClaim, OpClaim, OpClaim},
			bad:  1,
		},
		{
			name: "a catch-up cut inside the second record",
			left: func(lines []string, late string) string { return late + lines[0] + lines[1][:30] },
			ops:  []string{OpAuditLate, OpClaim, OpAuditTorn, OpAuditLate, OpClaim, OpClaim},
			bad:  1,
		},
	} {
		for _, next := range nexts {
			t.Run(tc.name+"/"+next.name, func(t *testing.T) {
				testTornCommitCaughtUp(t, tc.left, slices.Concat(tc.ops, next.own), tc.bad, next.run)
			})
		}
	}
}

// testTornCommitCaughtUp leaves what leave returns after the log of a
// ledger whose last commit appended no record, runs next, and checks that
// the commit's records are in the log once each, after the notes of ops.
func testTornCommitCaughtUp(t *testing.T, leave func(lines []string, late string) string, ops []string, bad int,
	next func(t *testing.T, l *Ledger)) {
	t.Helper()
	l, g, want := ledgerWithUnauditedCommit(t)
	var lines []string
	for _, r := range want {
		lines = append(lines, renderAudit(t, r))
	}
	late := renderAudit(t, AuditRecord{Time: l.now(), Op: OpAuditLate, Generation: g, Pid: 1, Reason: "a catch-up"})
	before := mustRead(t, l.AuditPath())
	left := leave(lines, late)
	appendRaw(t, l.AuditPath(), left)

	next(t, l)
	after := mustRead(t, l.AuditPath())
	require.Equal(t, string(before)+left+"\n", string(after[:len(before)+len(left)+1]), "what the killed write left is left as it was, ended")
	recs, err := ReadAudit(l.AuditPath())
	if bad == 0 {
		require.NoError(t, err)
	} else {
		require.ErrorContains(t, err, fmt.Sprintf("an unfinished record of %d bytes at byte offset %d",
			len(left)-strings.LastIndex(left, "\n")-1, len(before)+strings.LastIndex(left, "\n")+1))
		require.Equal(t, bad, strings.Count(err.Error(), "unfinished record"))
	}
	requireInGenerationOrder(t, recs)
	require.Equal(t, ops, opsOf(ofGeneration(recs, g)))
	requireEachOnce(t, recs, want)

	// Appended once: the writer after finds the log caught up.
	update(t, l, func(tx *Tx) { tx.Release("h1", "stop") })
	again, _ := ReadAudit(l.AuditPath())
	requireInGenerationOrder(t, again)
	require.Equal(t, ofGeneration(recs, g), ofGeneration(again, g))
	require.Equal(t, []string{OpRelease}, opsOf(again[len(recs):]))
}

// A write that fails partway (a full disk: the kernel wrote what fitted)
// leaves an unfinished line that the next write on the same open log —
// the writer's own records after its catch-up failed so — must not be
// glued to: the audit-lost record that names what the catch-up could not
// append, and the writer's own, start a line of their own. A writer whose
// own append is cut short so leaves the rest of its records to the next
// writer, who appends them, each once.
func TestAnAuditWriteCutShortIsNotGluedTo(t *testing.T) {
	t.Run("the catch-up, then the writer's own records", func(t *testing.T) {
		l, g, aside := ledgerWithUnauditedRelease(t)
		putAuditLogBack(t, l, aside)
		before := mustRead(t, l.AuditPath())
		var cutAt int
		calls := 0
		cutAuditWrites(t, func(b []byte) int {
			calls++
			if calls > 1 {
				return -1
			}
			cutAt = inSecondLine(b) // the audit-late record whole, the release not
			return cutAt
		})
		update(t, l, func(tx *Tx) {
			_, err := tx.Claim("", owner("h1"), devs(gpu(1)), "env")
			require.NoError(t, err)
		})
		require.Equal(t, 2, calls)

		after := mustRead(t, l.AuditPath())
		recs, err := ReadAudit(l.AuditPath())
		require.ErrorContains(t, err, fmt.Sprintf("an unfinished record of %d bytes at byte offset %d",
			cutAt-bytes.IndexByte(after[len(before):], '\n')-1, len(before)+bytes.IndexByte(after[len(before):], '\n')+1))
		requireInGenerationOrder(t, recs)
		of := ofGeneration(recs, g)
		require.Equal(t, []string{OpAuditLate, OpAuditTorn, OpAuditLost}, opsOf(of))
		require.Contains(t, of[2].Reason, fmt.Sprintf("no record of generation %d, and appending them from their journal records failed partway", g))
		require.Equal(t, []string{OpClaim}, opsOf(ofGeneration(recs, g+1)), "the writer's own record reads back")
		require.Equal(t, string(after[len(before):len(before)+cutAt])+"\n"+renderAudit(t, of[1], of[2], ofGeneration(recs, g+1)[0]),
			string(after[len(before):]), "one newline ends the unfinished line, in the write after it")
	})

	t.Run("the writer's own records", func(t *testing.T) {
		l := ledgerWithClaim(t, "h0", nil)
		before := mustRead(t, l.AuditPath())
		cutAuditWrites(t, inSecondLine)
		claimThree(t, l)
		auditWrite = (*os.File).Write
		g := snapshot(t, l).Generation
		want := l.lateAudit(g, g, true, l.now(), os.Getpid(), nil)[1:]
		require.Equal(t, string(before)+renderAudit(t, want[0]), string(mustRead(t, l.AuditPath())[:len(before)+len(renderAudit(t, want[0]))]))

		update(t, l, func(tx *Tx) { tx.Release("h1", "stop") })
		recs, err := ReadAudit(l.AuditPath())
		require.ErrorContains(t, err, "an unfinished record of 10 bytes")
		requireInGenerationOrder(t, recs)
		require.Equal(t, []string{OpClaim, OpAuditTorn, OpAuditLate, OpClaim, OpClaim}, opsOf(ofGeneration(recs, g)))
		requireEachOnce(t, recs, want)
		require.Equal(t, []string{OpRelease}, opsOf(ofGeneration(recs, g+1)))
	})
}

// ReadAudit names a line that a write cut short left by its line and byte
// offset, and says it is unfinished: at the end of the log, without its
// newline, and ended since by the next append. A whole record that lacks
// only its newline reads back.
func TestReadAuditReportsAnUnfinishedLine(t *testing.T) {
	p := filepath.Join(t.TempDir(), "audit.log")
	rec := func(op string) string {
		return `{"time":"2026-01-02T03:04:05Z","op":"` + op + `","generation":1,"pid":1}`
	}
	ended := `{"time":"2026-01-02T03:04:05Z","op":"cla`
	last := `{"time":"20`
	log := rec("claim") + "\n" + ended + "\n" + rec("release") + "\n" + last
	require.NoError(t, os.WriteFile(p, []byte(log), 0o600))
	recs, err := ReadAudit(p)
	require.Equal(t, []string{"claim", "release"}, opsOf(recs))
	require.ErrorContains(t, err, fmt.Sprintf("audit log %s line 2: an unfinished record of %d bytes at byte offset %d (its write was cut short",
		p, len(ended), len(rec("claim"))+1))
	require.ErrorContains(t, err, fmt.Sprintf("audit log %s line 4: the log ends inside an unfinished record of %d bytes at byte offset %d, without its newline",
		p, len(last), len(log)-len(last)))

	require.NoError(t, os.WriteFile(p, []byte(rec("claim")+"\n"+rec("release")), 0o600))
	recs, err = ReadAudit(p)
	require.NoError(t, err)
	require.Equal(t, []string{"claim", "release"}, opsOf(recs))
}
