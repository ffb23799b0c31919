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

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// AppendAudit writes its records stamped with the current generation and
// the writer's pid, changes no state, and returns every failure: an
// unwritable audit log, a read-only ledger, a state that needs recovery.
func TestAppendAudit(t *testing.T) {
	ctx := context.Background()
	opts := testOptions(newClock())
	opts.RuntimeDir = t.TempDir()
	dir := filepath.Join(t.TempDir(), "state")
	l, err := Open(dir, opts)
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h1"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	before, err := l.Snapshot(ctx)
	require.NoError(t, err)

	require.NoError(t, l.AppendAudit(ctx, AuditRecord{Op: "exempt", ContainerID: "x"}))
	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	last := recs[len(recs)-1]
	assert.Equal(t, "exempt", last.Op)
	assert.Equal(t, before.Generation, last.Generation)
	assert.Equal(t, os.Getpid(), last.Pid)
	assert.False(t, last.Time.IsZero())
	after, err := l.Snapshot(ctx)
	require.NoError(t, err)
	assert.Equal(t, before.Generation, after.Generation, "no commit")

	require.ErrorContains(t, l.AppendAudit(ctx, AuditRecord{ContainerID: "x"}), "no op")

	// audit.log a directory: the append fails, and says where.
	aside := l.AuditPath() + ".moved"
	require.NoError(t, os.Rename(l.AuditPath(), aside))
	require.NoError(t, os.Mkdir(l.AuditPath(), 0o700))
	require.ErrorContains(t, l.AppendAudit(ctx, AuditRecord{Op: "exempt"}), l.AuditPath())
	require.NoError(t, os.Remove(l.AuditPath()))
	require.NoError(t, os.Rename(aside, l.AuditPath()))

	ro, err := OpenReadOnly(dir, opts)
	require.NoError(t, err)
	require.ErrorIs(t, ro.AppendAudit(ctx, AuditRecord{Op: "exempt"}), ErrReadOnly)

	require.NoError(t, os.WriteFile(l.StatePath(), []byte("garbage"), 0o600))
	require.ErrorIs(t, l.AppendAudit(ctx, AuditRecord{Op: "exempt"}), ErrNeedsRecovery)
	recs2, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	assert.Len(t, recs2, len(recs), "nothing written by the failed appends")
}

// A writer killed inside its write(2) leaves the start of a record without
// its newline. The next append leaves that fragment as it was (the log is
// only appended to) and starts with a newline, instead of gluing its own
// first record to it, and says so: every record reads back, and ReadAudit
// names the fragment's line and byte offset.
func TestAuditAppendEndsATornTail(t *testing.T) {
	ctx := context.Background()
	l := ledgerWithClaim(t, "h1", nil)
	good, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	bad := 0 // fragments left before

	for _, tc := range []struct {
		name string
		tail string
	}{
		{"half a record", `{"time":"2026-01-02T03:04:05Z","op":"cla`},
		{"one byte", `{`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before, err := os.ReadFile(l.AuditPath())
			require.NoError(t, err)
			f, err := os.OpenFile(l.AuditPath(), os.O_WRONLY|os.O_APPEND, 0)
			require.NoError(t, err)
			_, err = f.WriteString(tc.tail)
			require.NoError(t, err)
			require.NoError(t, f.Close())
			_, err = ReadAudit(l.AuditPath())
			require.ErrorContains(t, err, fmt.Sprintf("line %d: the log ends inside an unfinished record of %d bytes at byte offset %d, without its newline",
				len(good)+bad+1, len(tc.tail), len(before)))

			require.NoError(t, l.AppendAudit(ctx, AuditRecord{Op: "exempt", ContainerID: "x"}))
			after, err := os.ReadFile(l.AuditPath())
			require.NoError(t, err)
			require.Equal(t, string(before)+tc.tail+"\n", string(after[:len(before)+len(tc.tail)+1]), "the fragment is left as it was, on a line of its own")
			recs, err := ReadAudit(l.AuditPath())
			require.ErrorContains(t, err, fmt.Sprintf("line %d: an unfinished record of %d bytes at byte offset %d",
				len(good)+bad+1, len(tc.tail), len(before)))
			require.Equal(t, good, recs[:len(good)], "nothing before the fragment is touched")
			tail := recs[len(good):]
			require.Len(t, tail, 2)
			assert.Equal(t, OpAuditTorn, tail[0].Op)
			assert.Contains(t, tail[0].Reason, fmt.Sprintf("an unfinished record of %d bytes precedes this one", len(tc.tail)))
			assert.Equal(t, "exempt", tail[1].Op)
			good = recs
			bad++
		})
	}
}

// A tail without a newline longer than any record is not a torn append:
// the append leaves it alone (nothing of unknown origin is cut away), and
// the log keeps reporting it as a bad line, with its offset. But the
// records appended after it start a line of their own and read back: an
// append that returned nil is on disk and readable, and so is every later
// commit's record.
func TestAuditAppendLeavesALongFragment(t *testing.T) {
	ctx := context.Background()
	l := ledgerWithClaim(t, "h1", nil)
	good, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	before, err := os.ReadFile(l.AuditPath())
	require.NoError(t, err)
	for _, tc := range []struct {
		name string
		fill byte
	}{
		{"text", 'x'},
		{"zeros of a power cut", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fragment := bytes.Repeat([]byte{tc.fill}, maxAuditLine)
			require.NoError(t, os.WriteFile(l.AuditPath(), append(bytes.Clone(before), fragment...), 0o600))

			require.NoError(t, l.AppendAudit(ctx, AuditRecord{Op: "exempt", ContainerID: "x"}))
			after, err := os.ReadFile(l.AuditPath())
			require.NoError(t, err)
			require.True(t, bytes.HasPrefix(after, append(bytes.Clone(before), fragment...)), "the long fragment was not cut")
			assert.NotContains(t, string(after[len(before):]), OpAuditTorn)
			update(t, l, func(tx *Tx) { tx.Release("h1", "stop") })
			update(t, l, func(tx *Tx) {
				_, err := tx.Claim("", owner("h1"), devs(gpu(0)), "env")
				require.NoError(t, err)
			})

			recs, err := ReadAudit(l.AuditPath())
			var le *AuditLineError
			require.ErrorAs(t, err, &le, "the fragment stays a bad line")
			assert.Equal(t, l.AuditPath(), le.Path)
			assert.Equal(t, len(good)+1, le.Line)
			assert.Contains(t, err.Error(), fmt.Sprintf("a line of %d bytes at byte offset %d, longer than any record",
				maxAuditLine, len(before)))
			require.Len(t, recs, len(good)+3, "the records after the fragment read back")
			assert.Equal(t, good, recs[:len(good)])
			assert.Equal(t, "exempt", recs[len(good)].Op)
			assert.Equal(t, OpRelease, recs[len(good)+1].Op)
			assert.Equal(t, OpClaim, recs[len(good)+2].Op)
		})
	}
}

// ReadAudit goes on past a line too long to be a record wherever it is,
// and names it by its line and byte offset.
func TestReadAuditSkipsAnOverlongLine(t *testing.T) {
	p := filepath.Join(t.TempDir(), "audit.log")
	rec := func(op string) string {
		return `{"time":"2026-01-02T03:04:05Z","op":"` + op + `","generation":1,"pid":1}` + "\n"
	}
	long := strings.Repeat("y", 3*maxAuditLine)
	require.NoError(t, os.WriteFile(p, []byte(rec("claim")+long+"\n"+rec("release")+"{bad\n"+rec("enqueue")), 0o600))
	recs, err := ReadAudit(p)
	ops := []string{}
	for _, r := range recs {
		ops = append(ops, r.Op)
	}
	assert.Equal(t, []string{"claim", "release", "enqueue"}, ops)
	require.Error(t, err)
	assert.Contains(t, err.Error(), fmt.Sprintf("audit log %s line 2: a line of %d bytes at byte offset %d", p, len(long), len(rec("claim"))))
	assert.Contains(t, err.Error(), fmt.Sprintf("audit log %s line 4: ", p))
}

// openAuditLog finds the generation of the log's last record whatever was
// read to find it, and knows the log's size from then on (a rotation is
// decided by it): a last record longer than the first read, a torn fragment
// shorter or longer than it, one that leaves nothing of the first read, a
// log that is nothing but a fragment (then audit.log.1 says), and one too
// long to be ours. No fragment is cut: the write after ends it.
func TestOpenAuditLogReadsTheLastGeneration(t *testing.T) {
	line := func(gen uint64, reason string) string {
		b, err := appendAuditLine(nil, &AuditRecord{Op: OpClaim, ContainerID: "c", Reason: reason, Generation: gen, Pid: 1})
		require.NoError(t, err)
		return string(b)
	}
	long := strings.Repeat("r", 3*auditTailRead)
	records := line(7, "") + line(8, "")
	for _, tc := range []struct {
		name, log, fragment string
		rotated             string // audit.log.1
		last                uint64
		known, long         bool
	}{
		{name: "no fragment", log: records, last: 8, known: true},
		{name: "a last record longer than the first read", log: records + line(9, long), last: 9, known: true},
		{name: "a short fragment", log: records, fragment: `{"time":"2026`, last: 8, known: true},
		{name: "a fragment longer than the first read", log: records, fragment: `{"op":"` + long, last: 8, known: true},
		{name: "a fragment as long as the first read", log: records, fragment: strings.Repeat("f", auditTailRead), last: 8, known: true},
		{name: "a fragment after a long record", log: records + line(9, long), fragment: `{"op"`, last: 9, known: true},
		{name: "nothing but a fragment", fragment: `{"op"`, rotated: line(5, ""), last: 5, known: true},
		{name: "a fragment too long to be ours", log: records, fragment: strings.Repeat("x", maxAuditLine), long: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			p := filepath.Join(dir, auditName)
			require.NoError(t, os.WriteFile(p, []byte(tc.log+tc.fragment), 0o600))
			if tc.rotated != "" {
				require.NoError(t, os.WriteFile(filepath.Join(dir, auditRotated), []byte(tc.rotated), 0o600))
			}
			a, err := openAuditLog(dir, 1<<30)
			require.NoError(t, err)
			defer func() { require.NoError(t, a.close()) }()
			assert.Equal(t, tc.known, a.lastKnown)
			assert.Equal(t, tc.last, a.last)
			assert.Equal(t, tc.fragment != "", a.midLine)
			onDisk := func() int64 {
				fi, err := os.Stat(p)
				require.NoError(t, err)
				return fi.Size()
			}
			assert.Equal(t, int64(len(tc.log+tc.fragment)), onDisk(), "nothing cut")
			if tc.long {
				assert.Zero(t, a.torn, "not a record of ours: not noted")
			} else {
				assert.Equal(t, int64(len(tc.fragment)), a.torn)
			}
			assert.Equal(t, onDisk(), a.size)

			require.NoError(t, a.write([]AuditRecord{{Op: "exempt", Generation: 10, Pid: 1}}, nil, false))
			assert.Equal(t, onDisk(), a.size, "raised by the write")
			after := mustRead(t, p)
			ended := tc.log + tc.fragment
			if tc.fragment != "" {
				ended += "\n"
			}
			assert.Equal(t, ended, string(after[:len(ended)]), "the fragment is left as it was, and ended")
		})
	}
}
