// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// movedStateDir commits a claim in root/state, then moves the dir to
// root/moved, as an operator or a tool would (`mv state moved`).
func movedStateDir(t *testing.T) (l *Ledger, dir, moved string) {
	t.Helper()
	root := safeDir(t)
	return movedDir(t, root, "state", "moved")
}

// movedDir commits a claim in the state dir root/state (state may name a
// dir below a parent: "lib/state"), then moves the first element of state
// to root/moved.
func movedDir(t *testing.T, root, state, moved string) (l *Ledger, dir, movedTo string) {
	t.Helper()
	dir = filepath.Join(root, state)
	opts := testOptions(nil)
	opts.RuntimeDir = t.TempDir()
	l, err := Open(dir, opts)
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("a"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	top := strings.SplitN(state, "/", 2)[0]
	movedTo = filepath.Join(root, moved)
	require.NoError(t, os.Rename(filepath.Join(root, top), movedTo))
	return l, dir, movedTo
}

// A dry run changes nothing: not even the vanished state dir is made
// again (a later `mv moved state` would then nest the saved dir inside
// the new one instead of putting it back). It reports what a real run
// would find.
func TestRecoverDryRunLeavesAVanishedStateDirAbsent(t *testing.T) {
	l, dir, _ := movedStateDir(t)
	_, err := l.Recover(context.Background(), RecoverOptions{DryRun: true})
	require.NoDirExists(t, dir, "a dry run created the state dir")
	require.ErrorIs(t, err, ErrNeedsRecovery)
	require.ErrorContains(t, err, "the state dir does not exist")

	// AllowEmpty: the dry run reports the empty start a real run would
	// write, and still creates nothing.
	rep, err := l.Recover(context.Background(), RecoverOptions{DryRun: true, AllowEmpty: true})
	require.NoError(t, err)
	require.True(t, rep.Empty)
	require.NoDirExists(t, dir, "a dry run created the state dir")
}

// A real Recover that finds nothing to recover from removes the empty dir
// it made to take the lock, so that putting the moved dir back at its name
// (as the error says) works, and the next Recover restores every commit.
func TestRecoverThatFindsNothingRemovesTheDirItMade(t *testing.T) {
	l, dir, moved := movedStateDir(t)
	_, err := l.Recover(context.Background(), RecoverOptions{})
	require.ErrorIs(t, err, ErrNeedsRecovery)
	require.ErrorContains(t, err, "put them back")
	require.NoDirExists(t, dir, "Recover left the empty dir it made")

	require.NoError(t, os.Rename(moved, dir))
	require.FileExists(t, filepath.Join(dir, lockName), "the moved dir is back at its name, not nested")
	rep, err := l.Recover(context.Background(), RecoverOptions{})
	require.NoError(t, err)
	require.True(t, rep.Complete)
	require.Equal(t, map[string]string{gpu(0).UUID: "a"}, holders(snapshot(t, l)))
}

// A missing parent made for the state dir is removed with it.
func TestRecoverThatFindsNothingRemovesTheParentsItMade(t *testing.T) {
	root := safeDir(t)
	l, _, _ := movedDir(t, root, "lib/state", "saved")
	_, err := l.Recover(context.Background(), RecoverOptions{})
	require.ErrorIs(t, err, ErrNeedsRecovery)
	require.NoDirExists(t, filepath.Join(root, "lib"), "Recover left the parent it made")
}
