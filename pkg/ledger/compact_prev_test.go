// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// A compaction whose new snapshot cannot be put in place (here: its temp
// file vanishes before the rename, as an I/O error or a full disk would
// fail it) leaves ledger.json.prev as it was: the older snapshot that
// ledger.journal.prev continues, not a second name for ledger.json. Damage
// in place to ledger.json then costs nothing: the previous snapshot and the
// journals replay to the last commit.
func TestFailedCompactionKeepsThePreviousSnapshot(t *testing.T) {
	dir := t.TempDir()
	opts := testOptions(nil)
	opts.RuntimeDir = t.TempDir()
	l, err := Open(dir, opts)
	require.NoError(t, err)
	l.compactAlways = true
	for i := 0; i < 4; i++ {
		update(t, l, func(tx *Tx) {
			_, err := tx.Claim("", owner(fmt.Sprintf("c%d", i)), devs(gpu(i)), "env")
			require.NoError(t, err)
		})
	}
	prevBefore := mustRead(t, filepath.Join(dir, prevName))

	failpoint = func(s string) {
		if s == stageSnapWritten {
			m, err := filepath.Glob(filepath.Join(dir, tempPrefix+"*"))
			require.NoError(t, err)
			for _, p := range m {
				require.NoError(t, os.Remove(p))
			}
		}
	}
	defer func() { failpoint = nil }()
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("c4"), devs(gpu(4)), "env")
		require.NoError(t, err)
	})
	failpoint = nil
	require.Empty(t, tempFiles(t, dir), "the failed compaction removed its temp files")

	a, err := os.Stat(filepath.Join(dir, stateName))
	require.NoError(t, err)
	b, err := os.Stat(filepath.Join(dir, prevName))
	require.NoError(t, err)
	require.False(t, os.SameFile(a, b), "%s is a link to %s", prevName, stateName)
	require.Equal(t, prevBefore, mustRead(t, filepath.Join(dir, prevName)), "the failed compaction changed %s", prevName)

	f, err := os.OpenFile(filepath.Join(dir, stateName), os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = f.WriteAt([]byte("XXXX"), 200)
	require.NoError(t, err)
	require.NoError(t, f.Close())
	l2, err := Open(dir, opts)
	require.NoError(t, err)
	rep, err := l2.Recover(context.Background(), RecoverOptions{})
	require.NoError(t, err)
	require.True(t, rep.Complete, "lost: %s", rep.Lost)
	require.Len(t, rep.Claims, 5)
}
