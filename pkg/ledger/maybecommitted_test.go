// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/ledgerfault"
)

// failJournalSync makes the next sync of journal fail as fdatasync(2) fails
// on a file that cannot be synced (EINVAL): once the record is written, the
// journal's descriptor is replaced by one of a pipe. Nothing is closed under
// the writer, which still closes its own descriptor number.
func failJournalSync(t *testing.T, journal string) {
	t.Helper()
	r, w, err := os.Pipe()
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close(); _ = w.Close() })
	failpoint = func(stage string) {
		if stage != stageAfterWrite {
			return
		}
		failpoint = nil // once
		ents, err := os.ReadDir("/proc/self/fd")
		require.NoError(t, err)
		for _, e := range ents {
			if p, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && p == journal {
				fd, err := strconv.Atoi(e.Name())
				require.NoError(t, err)
				require.NoError(t, syscall.Dup3(int(w.Fd()), fd, syscall.O_CLOEXEC))
			}
		}
	}
	t.Cleanup(func() { failpoint = nil })
}

// An Update whose commit was written but could not be made durable does not
// report "nothing written": every later reader sees the commit, so its error
// wraps ErrMaybeCommitted, and its caller undoes it (here: the release a
// front end makes of the container it refused). An Update that failed before
// writing wraps no such thing.
func TestCommitWrittenButNotSyncedMayStand(t *testing.T) {
	for _, tc := range []struct {
		name string
		// arm sets the fault up for the commit of l.
		arm       func(t *testing.T, l *Ledger)
		reboot    bool // the commit is the first after a reboot (a new lineage's journal)
		committed bool
		says      string
	}{{
		name:      "journal record, fdatasync fails",
		arm:       func(t *testing.T, l *Ledger) { failJournalSync(t, l.JournalPath()) },
		committed: true,
		says:      "whose fdatasync failed: invalid argument",
	}, {
		name: "first commit after a reboot, the directory's fsync fails",
		arm: func(t *testing.T, l *Ledger) {
			// Only the sync after the new journal's rename: the stage
			// before it arms the fault.
			var armed atomic.Bool
			failpoint = func(stage string) {
				if stage == stageJournalRotated {
					armed.Store(true)
				}
			}
			lift := ledgerfault.FailSync(func(path string) error {
				if path == l.Dir() && armed.CompareAndSwap(true, false) {
					return syscall.EIO
				}
				return nil
			})
			t.Cleanup(func() { failpoint = nil; lift() })
		},
		reboot:    true,
		committed: true,
		says:      "the fsync of its directory failed",
	}, {
		name: "lock file replaced before the write",
		arm: func(t *testing.T, l *Ledger) {
			failpoint = func(stage string) {
				if stage == stageBeforeWrite {
					require.NoError(t, os.Remove(l.LockPath()))
				}
			}
			t.Cleanup(func() { failpoint = nil })
		},
		says: "nothing was written",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "state")
			runDir := t.TempDir()
			l, err := Open(dir, Options{BootID: testBoot, RuntimeDir: runDir})
			require.NoError(t, err)
			update(t, l, func(tx *Tx) {
				_, err := tx.Claim("", owner("holder"), devs(gpu(1)), "env")
				require.NoError(t, err)
			})
			boot := testBoot
			if tc.reboot {
				boot, runDir = nextBoot, t.TempDir()
				l, err = Open(dir, Options{BootID: boot, RuntimeDir: runDir})
				require.NoError(t, err)
			}

			tc.arm(t, l)
			err = l.Update(context.Background(), func(tx *Tx) error {
				_, err := tx.Claim("", owner("ghost"), devs(gpu(0)), "env")
				return err
			})
			failpoint = nil
			require.Error(t, err)
			require.Equal(t, tc.committed, errors.Is(err, ErrMaybeCommitted), "wraps ErrMaybeCommitted: %v", err)
			require.ErrorContains(t, err, tc.says)

			// What a fresh reader (another process) sees.
			fresh, err := Open(dir, Options{BootID: boot, RuntimeDir: runDir})
			require.NoError(t, err)
			st := snapshot(t, fresh)
			_, held := holders(st)[gpu(0).UUID]
			require.Equal(t, tc.committed, held, "the claim is in the ledger: %v", holders(st))
			// This handle reads the files again (its cache went with the
			// error): it sees the same.
			require.Equal(t, holders(st), holders(snapshot(t, l)))

			// The caller's undo: a release of exactly that container,
			// which the next writer commits after the record.
			update(t, l, func(tx *Tx) { tx.Release("ghost", "its create was refused") })
			st = snapshot(t, fresh)
			require.NotContains(t, holders(st), gpu(0).UUID)
			if !tc.reboot {
				require.Equal(t, "holder", holders(st)[gpu(1).UUID], "the other holder is untouched")
			}
		})
	}
}
