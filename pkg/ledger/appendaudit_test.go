// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
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
// its newline. The next append cuts that fragment off and says so, instead
// of gluing its own first record to it: every line reads back.
func TestAuditAppendCutsATornTail(t *testing.T) {
	ctx := context.Background()
	opts := testOptions(newClock())
	opts.RuntimeDir = t.TempDir()
	l, err := Open(filepath.Join(t.TempDir(), "state"), opts)
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h1"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	good, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)

	for _, tc := range []struct {
		name string
		tail string
		cut  int
	}{
		{"half a record", `{"time":"2026-01-02T03:04:05Z","op":"cla`, 40},
		{"one byte", `{`, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := os.OpenFile(l.AuditPath(), os.O_WRONLY|os.O_APPEND, 0)
			require.NoError(t, err)
			_, err = f.WriteString(tc.tail)
			require.NoError(t, err)
			require.NoError(t, f.Close())
			_, err = ReadAudit(l.AuditPath())
			require.Error(t, err, "the fragment is a bad line until repaired")

			require.NoError(t, l.AppendAudit(ctx, AuditRecord{Op: "exempt", ContainerID: "x"}))
			recs, err := ReadAudit(l.AuditPath())
			require.NoError(t, err)
			require.Equal(t, good, recs[:len(good)], "nothing before the fragment is touched")
			tail := recs[len(good):]
			require.Len(t, tail, 2)
			assert.Equal(t, OpAuditTorn, tail[0].Op)
			assert.Contains(t, tail[0].Reason, fmt.Sprintf("%d bytes", tc.cut))
			assert.Equal(t, "exempt", tail[1].Op)
			good = recs
		})
	}
}

// A tail without a newline longer than any record is not a torn append:
// the append leaves it alone (nothing of unknown origin is cut away) and
// the log keeps reporting it as a bad line.
func TestAuditAppendLeavesALongFragment(t *testing.T) {
	ctx := context.Background()
	opts := testOptions(newClock())
	opts.RuntimeDir = t.TempDir()
	l, err := Open(filepath.Join(t.TempDir(), "state"), opts)
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h1"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	before, err := os.ReadFile(l.AuditPath())
	require.NoError(t, err)
	fragment := bytes.Repeat([]byte("x"), maxAuditLine)
	require.NoError(t, os.WriteFile(l.AuditPath(), append(bytes.Clone(before), fragment...), 0o600))

	require.NoError(t, l.AppendAudit(ctx, AuditRecord{Op: "exempt", ContainerID: "x"}))
	after, err := os.ReadFile(l.AuditPath())
	require.NoError(t, err)
	require.True(t, bytes.HasPrefix(after, append(bytes.Clone(before), fragment...)), "the long fragment was cut")
	assert.NotContains(t, string(after[len(before):]), OpAuditTorn)
	_, err = ReadAudit(l.AuditPath())
	require.Error(t, err, "the fragment stays a bad line")
}
