// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// RemoveMarkersUnder removes exactly the markers of state dirs at or below
// the root it is given: not a sibling whose name merely starts the same,
// not a file that is no marker, not a marker that does not verify.
func TestRemoveMarkersUnder(t *testing.T) {
	base := t.TempDir()
	runtimeDir := filepath.Join(t.TempDir(), "run")
	opts := testOptions(nil)
	opts.RuntimeDir = runtimeDir

	commit := func(dir string) *Ledger {
		t.Helper()
		require.NoError(t, os.MkdirAll(filepath.Dir(dir), 0o700))
		l, err := Open(dir, opts)
		require.NoError(t, err)
		require.NoError(t, l.Update(context.Background(), func(tx *Tx) error {
			_, err := tx.Claim("", owner("c-"+filepath.Base(dir)), devs(gpu(0)), "env")
			return err
		}))
		_, err = os.Stat(l.markerPath())
		require.NoError(t, err, "a commit writes the boot marker")
		return l
	}
	root := filepath.Join(base, "suite")
	inside := commit(filepath.Join(root, "a", "state"))
	atRoot := commit(root)
	sibling := commit(filepath.Join(base, "suite2", "state")) // shares the prefix "suite"
	other := commit(filepath.Join(base, "elsewhere", "state"))

	stray := filepath.Join(runtimeDir, "ledger-notes.txt")
	require.NoError(t, os.WriteFile(stray, []byte("not a marker"), 0o600))
	damaged := filepath.Join(runtimeDir, "ledger-000000000000000000000000.marker")
	require.NoError(t, os.WriteFile(damaged, []byte("0000 {\"dir\":"+`"`+root+`/x"}`), 0o600))

	n, err := RemoveMarkersUnder(runtimeDir, root+"/")
	require.NoError(t, err)
	require.Equal(t, 2, n)
	for _, l := range []*Ledger{inside, atRoot} {
		_, err := os.Stat(l.markerPath())
		require.ErrorIs(t, err, os.ErrNotExist, "marker of %s", l.dir)
	}
	for _, p := range []string{sibling.markerPath(), other.markerPath(), stray, damaged} {
		_, err := os.Stat(p)
		require.NoError(t, err, "%s must stay", p)
	}

	// Without its marker a dir is a fresh one again: deleting it and
	// opening it anew is not refused (what the marker is there to refuse
	// for a dir still in use, which is why only finished suites call this).
	require.NoError(t, os.RemoveAll(inside.dir))
	again, err := Open(inside.dir, opts)
	require.NoError(t, err)
	_, err = again.Snapshot(context.Background())
	require.NoError(t, err)

	_, err = RemoveMarkersUnder(runtimeDir, "relative/root")
	require.ErrorContains(t, err, "not an absolute path")
	n, err = RemoveMarkersUnder(filepath.Join(base, "no-such-run"), root)
	require.NoError(t, err)
	require.Zero(t, n)
}
