// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// A write cut exactly after one record's newline (a writer killed at a page
// boundary, a full disk) leaves only whole lines: nothing unfinished says
// that the write carried more. The records' places ("seq") and the
// audit-late note's count say it instead.

// A writer killed inside its catch-up write right after the first late
// record's newline, before its own commit: the log ends with the audit-late
// note of generation g and the first of its three records. The next writers
// append the other two, once, and no audit-lost is needed.
func TestACatchUpCutAtARecordBoundaryIsFinished(t *testing.T) {
	l, g, want := ledgerWithUnauditedCommit(t)
	cutAuditWrites(t, func(b []byte) int {
		i := bytes.IndexByte(b, '\n')                     // end of the audit-late note
		return i + 1 + bytes.IndexByte(b[i+1:], '\n') + 1 // and of the first record
	})
	a := l.openAuditCaughtUp(g) // killed here: no commit, no own write
	require.NoError(t, a.close())
	auditWrite = (*os.File).Write

	requireFinishedByTheNextWriters(t, l, g, want)
}

// requireFinishedByTheNextWriters commits two releases after a catch-up
// of generation g was cut, and requires that the log then holds each of
// want exactly once, with no audit-lost note: the cut was noticed and
// finished, not reported as a loss.
func requireFinishedByTheNextWriters(t *testing.T, l *Ledger, g uint64, want []AuditRecord) {
	t.Helper()
	update(t, l, func(tx *Tx) { tx.Release("h1", "stop") })
	update(t, l, func(tx *Tx) { tx.Release("h2", "stop") })
	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	t.Logf("generation %d in the log: %v", g, opsOf(ofGeneration(recs, g)))
	requireNoLostNote(t, recs)
	requireEachOnce(t, recs, want)
}

// lostGenRe finds the generations an audit-lost record's reason names.
var lostGenRe = regexp.MustCompile(`generations? (\d+)(?: to (\d+))?`)

// auditProblems checks the log of l against wants, the records of each
// generation (a commit's, from its journal record): each is in the log
// exactly once, or an audit-lost record names its generation; and the
// log's records are in generation order.
func auditProblems(t *testing.T, l *Ledger, wants map[uint64][]AuditRecord) []string {
	t.Helper()
	var recs []AuditRecord
	for _, p := range []string{l.AuditPath() + ".1", l.AuditPath()} {
		if _, err := os.Stat(p); err == nil {
			r, _ := ReadAudit(p) // the unfinished lines are reported; the records are what counts
			recs = append(recs, r...)
		}
	}
	var probs []string
	lost := map[uint64]bool{}
	var prev uint64
	for i, r := range recs {
		if r.Generation < prev {
			probs = append(probs, fmt.Sprintf("record %d (%s) of generation %d after one of %d", i, r.Op, r.Generation, prev))
		}
		prev = r.Generation
		if r.Op != OpAuditLost {
			continue
		}
		lost[r.Generation] = true
		if m := lostGenRe.FindStringSubmatch(r.Reason); m != nil {
			lo, _ := strconv.ParseUint(m[1], 10, 64)
			hi := lo
			if m[2] != "" {
				hi, _ = strconv.ParseUint(m[2], 10, 64)
			}
			for g := lo; g <= hi; g++ {
				lost[g] = true
			}
		}
	}
	for g, want := range wants {
		count := map[string]int{}
		for _, r := range recs {
			if r.Generation == g {
				count[renderAudit(t, r)]++
			}
		}
		for i, w := range want {
			switch c := count[renderAudit(t, w)]; {
			case c > 1:
				probs = append(probs, fmt.Sprintf("generation %d record %d (%s %s) is in the log %d times", g, i, w.Op, w.ContainerID, c))
			case c == 0 && !lost[g]:
				probs = append(probs, fmt.Sprintf("generation %d record %d (%s %s) is missing, and no audit-lost names it", g, i, w.Op, w.ContainerID))
			}
		}
	}
	return probs
}

// journaledRecs is what generation g's journal record holds of its audit
// records.
func journaledRecs(l *Ledger, g uint64) []AuditRecord {
	late := l.lateAudit(g, g, true, l.now(), os.Getpid(), nil)
	if len(late) > 0 && late[0].Op == OpAuditLate {
		return late[1:]
	}
	return nil
}

// killAuditWriteAt makes the first audit write stop after k bytes and
// every later one write nothing: the writer was killed there.
func killAuditWriteAt(t *testing.T, k int) {
	t.Helper()
	calls := 0
	cutAuditWrites(t, func(b []byte) int {
		calls++
		if calls == 1 {
			return min(k, len(b))
		}
		return 0
	})
}

// firstAuditWriteLen is the length of the first audit write that run makes.
func firstAuditWriteLen(t *testing.T, run func()) int {
	t.Helper()
	n := -1
	cutAuditWrites(t, func(b []byte) int {
		if n < 0 {
			n = len(b)
		}
		return -1
	})
	run()
	auditWrite = (*os.File).Write
	require.Positive(t, n)
	return n
}

// A write of a commit's three records cut at every byte (k: the bytes
// written), its writer killed there: a later writer's catch-up of an
// unaudited commit (before its own commit), or the commit's own write.
// After it, normal writers: every record of each commit is in the log
// exactly once, or an audit-lost record names its generation; at a record
// boundary (k just past a newline) as anywhere else.
func TestAnAuditWriteCutAtEveryByteLosesNothingSilently(t *testing.T) {
	claim3 := func(tx *Tx) {
		for i := 1; i <= 3; i++ {
			_, err := tx.Claim("", owner(fmt.Sprintf("h%d", i)), devs(gpu(i)), "env")
			require.NoError(t, err)
		}
	}
	ownSetup := func(t *testing.T) *Ledger { return ledgerWithClaim(t, "h0", nil) }
	sweeps := []struct {
		name string
		n    func(t *testing.T) int
		run  func(t *testing.T, k int) (*Ledger, map[uint64][]AuditRecord)
	}{
		{"catch-up", func(t *testing.T) int {
			l, g, _ := ledgerWithUnauditedCommit(t)
			return firstAuditWriteLen(t, func() { require.NoError(t, l.openAuditCaughtUp(g).close()) })
		}, func(t *testing.T, k int) (*Ledger, map[uint64][]AuditRecord) {
			l, g, want := ledgerWithUnauditedCommit(t)
			killAuditWriteAt(t, k)
			require.NoError(t, l.openAuditCaughtUp(g).close()) // killed before its commit
			auditWrite = (*os.File).Write
			return l, map[uint64][]AuditRecord{g: want}
		}},
		{"own", func(t *testing.T) int {
			l := ownSetup(t)
			return firstAuditWriteLen(t, func() { update(t, l, claim3) })
		}, func(t *testing.T, k int) (*Ledger, map[uint64][]AuditRecord) {
			l := ownSetup(t)
			killAuditWriteAt(t, k)
			update(t, l, claim3)
			auditWrite = (*os.File).Write
			g := snapshot(t, l).Generation
			want := journaledRecs(l, g)
			require.Len(t, want, 3)
			return l, map[uint64][]AuditRecord{g: want}
		}},
	}
	for _, s := range sweeps {
		t.Run(s.name, func(t *testing.T) {
			n := s.n(t)
			var failed []int
			for k := 0; k <= n; k++ {
				l, wants := s.run(t, k)
				for _, c := range []string{"h1", "h2", "h3"} {
					update(t, l, func(tx *Tx) { tx.Release(c, "stop") })
					g := snapshot(t, l).Generation
					wants[g] = journaledRecs(l, g)
				}
				if p := auditProblems(t, l, wants); len(p) > 0 {
					failed = append(failed, k)
					if len(failed) <= 3 {
						t.Errorf("%s write cut after %d of %d bytes: %v\n%s", s.name, k, n, p, mustRead(t, l.AuditPath()))
					}
				}
			}
			require.Empty(t, failed, "cuts (bytes written of %d) that lose records silently or append them twice", n)
		})
	}
}

// stripJournalSeq rewrites l's journal as a build before Seq wrote it: its
// records' audit records carry no place.
func stripJournalSeq(t *testing.T, l *Ledger) {
	t.Helper()
	p := filepath.Join(l.Dir(), journalName)
	data := mustRead(t, p)
	seq := regexp.MustCompile(`,"seq":"\d+/\d+"`)
	var out []byte
	for _, line := range bytes.SplitAfter(data, []byte{'\n'}) {
		if len(line) < 10 || !seq.Match(line) {
			out = append(out, line...)
			continue
		}
		js := seq.ReplaceAll(bytes.TrimSuffix(line[9:], []byte{'\n'}), nil)
		out = fmt.Appendf(out, "%08x %s\n", crc32.Checksum(js, castagnoli()), js)
	}
	require.NoError(t, os.WriteFile(p, out, 0o600))
}

// The late records of a commit written by an older build carry no Seq: a
// catch-up of them cut right after a record's newline is told by the count
// its audit-late note gives, and the next writers append the rest, once.
func TestACatchUpOfRecordsWithoutSeqCutAtARecordBoundaryIsFinished(t *testing.T) {
	for cut := 1; cut <= 2; cut++ { // records of the three written whole
		t.Run(strconv.Itoa(cut), func(t *testing.T) {
			l, g, _ := ledgerWithUnauditedCommit(t)
			stripJournalSeq(t, l)
			want := journaledRecs(l, g)
			require.Len(t, want, 3)
			require.Empty(t, want[0].Seq)
			cutAuditWrites(t, func(b []byte) int {
				k := bytes.IndexByte(b, '\n') + 1 // the audit-late note
				for range cut {
					k += bytes.IndexByte(b[k:], '\n') + 1
				}
				return k
			})
			require.NoError(t, l.openAuditCaughtUp(g).close()) // killed before its commit
			auditWrite = (*os.File).Write
			requireFinishedByTheNextWriters(t, l, g, want)
		})
	}
}

// The counts the audit-late notes give, as lateAudit and lateRest write
// them, and the places moreFollow reads.
func TestLateCountAndMoreFollow(t *testing.T) {
	for why, want := range map[string]int{
		"the 3 record(s) of generation 7 that follow are appended late, from its journal record: …":       3,
		"the last 2 of the 3 record(s) of generation 7 follow, appended late, from its journal record: …": 2,
		"the 12 record(s) of generation 7 that follow are appended late":                                  12,
		"something else": 0,
	} {
		n, ok := lateCount(why)
		require.Equal(t, want, n, why)
		require.Equal(t, want > 0, ok, why)
	}
	for seq, want := range map[string]bool{"": false, "1/2": true, "2/2": false, "9/10": true, "10/10": false} {
		line := bytes.TrimSuffix([]byte(renderAudit(t, AuditRecord{Op: OpClaim, Reason: `,"seq":"1/2"`, Seq: seq, Generation: 4, Pid: 1})), []byte{'\n'})
		require.Equal(t, want, moreFollow(line), "%s", line)
		g, ok := auditedGeneration(line)
		require.True(t, ok)
		require.Equal(t, uint64(4), g)
	}
}
