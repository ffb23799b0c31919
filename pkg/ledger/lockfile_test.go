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

// ledger.lock removed or replaced (by someone who took it for a stale lock
// file) while a writer holds the flock on it: the next process locks the new
// file and writes; the first one must not write over it. Its commit is
// refused with ErrLockLost, nothing of it is written, the other's claim
// stands, and its next Update locks the new file and works.
func TestLockFileRemovedWhileHeldRefusesTheWrite(t *testing.T) {
	for _, tc := range []struct {
		name string
		do   func(t *testing.T, path string)
	}{
		{name: "removed", do: func(t *testing.T, path string) { require.NoError(t, os.Remove(path)) }},
		{name: "replaced", do: func(t *testing.T, path string) {
			require.NoError(t, os.WriteFile(path+".new", nil, 0o600))
			require.NoError(t, os.Rename(path+".new", path))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := testOptions(newClock())
			opts.RuntimeDir = t.TempDir()
			dir := filepath.Join(t.TempDir(), "state")
			a, err := Open(dir, opts)
			require.NoError(t, err)
			b, err := Open(dir, opts) // another descriptor: as another process
			require.NoError(t, err)
			update(t, a, func(tx *Tx) { tx.Enqueue("w", owner("w"), devs(gpu(3))) })

			err = a.Update(context.Background(), func(tx *Tx) error {
				_, err := tx.Claim("", owner("a"), devs(gpu(0)), "env")
				require.NoError(t, err)
				tc.do(t, a.LockPath())
				// The other takes the lock of the file now at the path at once
				// and claims the same GPU.
				return b.Update(context.Background(), func(tx *Tx) error {
					_, err := tx.Claim("", owner("b"), devs(gpu(0)), "env")
					return err
				})
			})
			require.ErrorIs(t, err, ErrLockLost)
			require.ErrorContains(t, err, "never remove it")
			require.ErrorContains(t, err, "nothing was written")

			fresh, err := Open(dir, opts)
			require.NoError(t, err)
			require.Equal(t, map[string]string{gpu(0).UUID: "b"}, holders(snapshot(t, fresh)), "one holder, the one that kept its lock")

			update(t, a, func(tx *Tx) {
				_, err := tx.Claim("", owner("a"), devs(gpu(1)), "env")
				require.NoError(t, err)
			})
			require.Equal(t, map[string]string{gpu(0).UUID: "b", gpu(1).UUID: "a"}, holders(snapshot(t, fresh)))
		})
	}
}
