// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gofrs/flock"
	"github.com/stretchr/testify/require"
)

// seeded returns a ledger whose state holds one claim on GPU 0 by c1.
func seeded(t *testing.T) *Ledger {
	t.Helper()
	l := openTest(t, newClock())
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("c1"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	return l
}

func quarantined(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, corruptPrefix+"*"))
	require.NoError(t, err)
	return m
}

func mustRead(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	require.NoError(t, err)
	return b
}

func TestNewerFormatIsLeftAlone(t *testing.T) {
	l := seeded(t)
	future := append(formatPrefix(FormatVersion+1), mustRead(t, l.StatePath())[len(formatPrefix(FormatVersion)):]...)
	require.NoError(t, os.WriteFile(l.StatePath(), future, 0o600))

	err := l.Update(context.Background(), func(tx *Tx) error { t.Fatal("fn must not run"); return nil })
	var fe *FormatError
	require.ErrorAs(t, err, &fe)
	require.ErrorIs(t, err, ErrUnsupportedFormat)
	require.Equal(t, l.StatePath(), fe.Path)
	require.Contains(t, err.Error(), "written by a newer nri-gpu-guard")
	_, err = l.Snapshot(context.Background())
	require.ErrorIs(t, err, ErrUnsupportedFormat)
	require.Equal(t, future, mustRead(t, l.StatePath()), "untouched")
	require.Empty(t, quarantined(t, l.Dir()))
}

// A reset that refuses a healthy ledger, or keeps what runs, cannot tell
// either from a state it cannot read for another reason than damage (a
// newer format, an I/O error): it used to take any read error for damage,
// and moved the newer state aside with every claim of it.
func TestResetThatMustReadRefusesANewerFormat(t *testing.T) {
	for name, opts := range map[string]ResetOptions{
		"refuse healthy": {Reason: "test", RefuseHealthy: true},
		"keep":           {Reason: "test", Keep: func(Claim) (bool, string) { return true, "runs" }},
	} {
		t.Run(name, func(t *testing.T) {
			l := seeded(t)
			future := append(formatPrefix(FormatVersion+1), mustRead(t, l.StatePath())[len(formatPrefix(FormatVersion)):]...)
			require.NoError(t, os.WriteFile(l.StatePath(), future, 0o600))
			_, err := l.ResetWith(context.Background(), opts)
			require.ErrorIs(t, err, ErrUnsupportedFormat)
			require.Equal(t, future, mustRead(t, l.StatePath()), "untouched")
		})
	}
}

func TestStateFromAnotherBootIsDiscarded(t *testing.T) {
	l := seeded(t)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("c2"), devs(gpu(1)), "env")
		require.NoError(t, err)
		tx.Enqueue("w", owner("w"), devs(gpu(0)))
	})
	old := snapshot(t, l)
	oldBytes := mustRead(t, l.StatePath())

	opts := testOptions(nil)
	opts.BootID = "after-reboot"
	l2, err := Open(l.Dir(), opts)
	require.NoError(t, err)
	// Reading shows it empty, without writing.
	st := snapshot(t, l2)
	require.Empty(t, st.Claims)
	require.Empty(t, st.Waiters)
	require.Equal(t, "after-reboot", st.BootID)
	require.Equal(t, oldBytes, mustRead(t, l.StatePath()))

	// The first Update discards it (audited) and runs on an empty state.
	update(t, l2, func(tx *Tx) {
		require.Empty(t, tx.State().Claims)
		_, err := tx.Claim("", owner("c9"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	st = snapshot(t, l2)
	require.Equal(t, map[string]string{gpu(0).UUID: "c9"}, holders(st))
	require.Equal(t, old.Generation+1, st.Generation, "generations keep counting up")
	require.GreaterOrEqual(t, st.NextSeq, old.NextSeq)
	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	var discard *AuditRecord
	for i := range recs {
		if recs[i].Op == OpDiscard {
			discard = &recs[i]
		}
	}
	require.NotNil(t, discard)
	require.ElementsMatch(t, []string{gpu(0).UUID, gpu(1).UUID}, discard.Devices)
	require.Contains(t, discard.Reason, testBoot)
	require.Empty(t, quarantined(t, l.Dir()), "another boot's state is not corrupt")
}

func TestStrayTempFilesAreNeverReadAndAreRemoved(t *testing.T) {
	l := seeded(t)
	// A temp file with a valid, newer state: what a writer killed after its
	// fsync but before its rename leaves.
	st := snapshot(t, l)
	st.Generation = 99
	st.Claims = nil
	b, err := encodeState(&st)
	require.NoError(t, err)
	stray := filepath.Join(l.Dir(), tempPrefix+"123")
	require.NoError(t, os.WriteFile(stray, b, 0o600))

	l2, err := Open(l.Dir(), testOptions(nil))
	require.NoError(t, err)
	require.Equal(t, uint64(1), snapshot(t, l2).Generation)
	update(t, l2, func(tx *Tx) {
		require.Equal(t, uint64(1), tx.State().Generation)
		require.Len(t, tx.State().Claims, 1)
	})
	require.NoFileExists(t, stray)
}

func TestDirectorySecurity(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to chown")
	}
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, dir string) string // returns the dir to open
		ok    bool
		want  string
	}{
		{name: "missing dir is created 0700", ok: true, setup: func(t *testing.T, dir string) string {
			return filepath.Join(dir, "a", "b")
		}},
		{name: "dir 0700", ok: true, setup: func(t *testing.T, dir string) string { return dir }},
		{name: "dir 0755 (not writable by others)", ok: true, setup: func(t *testing.T, dir string) string {
			require.NoError(t, os.Chmod(dir, 0o755))
			return dir
		}},
		{name: "dir is a symlink", want: "symlink", setup: func(t *testing.T, dir string) string {
			real := filepath.Join(dir, "real")
			require.NoError(t, os.Mkdir(real, 0o700))
			link := filepath.Join(dir, "link")
			require.NoError(t, os.Symlink(real, link))
			return link
		}},
		{name: "dir world-writable", want: "0777", setup: func(t *testing.T, dir string) string {
			require.NoError(t, os.Chmod(dir, 0o777))
			return dir
		}},
		{name: "dir group-writable", want: "0770", setup: func(t *testing.T, dir string) string {
			require.NoError(t, os.Chmod(dir, 0o770))
			return dir
		}},
		{name: "dir owned by another user", want: "owned by uid 65534", setup: func(t *testing.T, dir string) string {
			require.NoError(t, os.Chown(dir, 65534, 65534))
			return dir
		}},
		{name: "dir is a file", want: "not a directory", setup: func(t *testing.T, dir string) string {
			p := filepath.Join(dir, "file")
			require.NoError(t, os.WriteFile(p, nil, 0o600))
			return p
		}},
		{name: "state file is a symlink", want: "symlink", setup: func(t *testing.T, dir string) string {
			require.NoError(t, os.WriteFile(filepath.Join(dir, "elsewhere"), nil, 0o600))
			require.NoError(t, os.Symlink(filepath.Join(dir, "elsewhere"), filepath.Join(dir, stateName)))
			return dir
		}},
		{name: "lock file world-writable", want: "writable by group or others", setup: func(t *testing.T, dir string) string {
			p := filepath.Join(dir, lockName)
			require.NoError(t, os.WriteFile(p, nil, 0o600))
			require.NoError(t, os.Chmod(p, 0o666))
			return dir
		}},
		{name: "audit log owned by another user", want: "owned by uid 65534", setup: func(t *testing.T, dir string) string {
			p := filepath.Join(dir, auditName)
			require.NoError(t, os.WriteFile(p, nil, 0o600))
			require.NoError(t, os.Chown(p, 65534, 65534))
			return dir
		}},
		{name: "state file is a directory", want: "not a regular file", setup: func(t *testing.T, dir string) string {
			require.NoError(t, os.Mkdir(filepath.Join(dir, stateName), 0o700))
			return dir
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := filepath.Join(t.TempDir(), "state")
			require.NoError(t, os.Mkdir(base, 0o700))
			dir := tc.setup(t, base)
			l, err := Open(dir, testOptions(nil))
			if !tc.ok {
				require.ErrorIs(t, err, ErrUnsafeDir)
				require.Contains(t, err.Error(), tc.want)
				return
			}
			require.NoError(t, err)
			fi, err := os.Stat(dir)
			require.NoError(t, err)
			require.Zero(t, fi.Mode().Perm()&0o022)
			update(t, l, func(tx *Tx) {
				_, err := tx.Claim("", owner("c1"), devs(gpu(0)), "env")
				require.NoError(t, err)
			})
			for _, name := range []string{stateName, lockName, auditName} {
				fi, err := os.Stat(filepath.Join(dir, name))
				require.NoError(t, err)
				require.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), name)
			}
		})
	}
}

func TestOpenReadOnlyCreatesNothing(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "absent")
	l, err := OpenReadOnly(dir, testOptions(nil))
	require.NoError(t, err)
	st := snapshot(t, l)
	require.Empty(t, st.Claims)
	require.Equal(t, uint64(0), st.Generation)
	require.NoDirExists(t, dir)
	err = l.Update(context.Background(), func(tx *Tx) error { return nil })
	require.ErrorIs(t, err, ErrReadOnly)
	require.NoDirExists(t, dir)

	// Existing state reads fine; the lock file is not created.
	w := seeded(t)
	require.NoError(t, os.Remove(w.LockPath()))
	ro, err := OpenReadOnly(w.Dir(), testOptions(nil))
	require.NoError(t, err)
	require.Len(t, snapshot(t, ro).Claims, 1)
	require.NoFileExists(t, w.LockPath())
}

func TestLockTimeoutNamesTheHolder(t *testing.T) {
	l := seeded(t)
	other := flock.New(l.LockPath())
	ok, err := other.TryLock()
	require.NoError(t, err)
	require.True(t, ok)
	defer func() { _ = other.Unlock() }()

	opts := testOptions(nil)
	opts.LockTimeout = time.Millisecond
	l2, err := Open(l.Dir(), opts)
	require.NoError(t, err)
	err = l2.Update(context.Background(), func(tx *Tx) error { t.Fatal("must not run"); return nil })
	var le *LockError
	require.ErrorAs(t, err, &le)
	require.ErrorIs(t, err, ErrLockTimeout)
	require.Equal(t, l.LockPath(), le.Path)
	require.Equal(t, os.Getpid(), le.HolderPid, "found in /proc/locks")
	require.Contains(t, err.Error(), l.LockPath())

	// The context bounds the wait too, and its error is kept.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err = l.Update(ctx, func(tx *Tx) error { t.Fatal("must not run"); return nil })
	require.ErrorAs(t, err, &le)
	require.ErrorIs(t, err, context.Canceled)

	ctx, cancel = context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	l3, err := Open(l.Dir(), testOptions(nil)) // LockTimeout 30s: the ctx wins
	require.NoError(t, err)
	err = l3.Update(ctx, func(tx *Tx) error { return nil })
	require.ErrorIs(t, err, ErrLockTimeout)
	require.ErrorIs(t, err, context.DeadlineExceeded)

	// Snapshot needs no lock.
	require.Len(t, snapshot(t, l3).Claims, 1)
	require.NoError(t, other.Unlock())

	// A caller that gave up changes nothing, even with the lock free.
	ctx, cancel = context.WithCancel(context.Background())
	cancel()
	err = l3.Update(ctx, func(tx *Tx) error { t.Fatal("must not run"); return nil })
	require.ErrorIs(t, err, ErrLockTimeout)
	require.ErrorIs(t, err, context.Canceled)
	update(t, l3, func(tx *Tx) {})
}

// BeforeLockWait runs once per acquisition, only when the lock is held by
// another and before the first wait for it: here it lets the other holder
// go, so the acquisition's next attempt succeeds.
func TestBeforeLockWaitOnlyWhenTheLockIsHeld(t *testing.T) {
	l := seeded(t)
	calls := 0
	var other *flock.Flock
	opts := testOptions(nil)
	opts.BeforeLockWait = func() {
		calls++
		if other != nil {
			require.NoError(t, other.Unlock())
		}
	}
	l2, err := Open(l.Dir(), opts)
	require.NoError(t, err)

	update(t, l2, func(tx *Tx) {})
	require.Zero(t, calls, "a free lock is taken without waiting")

	other = flock.New(l.LockPath())
	ok, err := other.TryLock()
	require.NoError(t, err)
	require.True(t, ok)
	ran := false
	update(t, l2, func(tx *Tx) { ran = true })
	require.True(t, ran)
	require.Equal(t, 1, calls, "called before waiting for the held lock, once")

	update(t, l2, func(tx *Tx) {})
	require.Equal(t, 1, calls, "free again: not called")
}

func TestUpdatesOfOneProcessAreSerialised(t *testing.T) {
	l := openTest(t, newClock())
	const n = 16
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		go func() {
			errs <- l.Update(context.Background(), func(tx *Tx) error {
				_, err := tx.Claim("", owner("c"+string(rune('a'+i))), devs(gpu(0)), "env")
				if err != nil && !isBusy(err) {
					return err
				}
				return nil
			})
		}()
	}
	for i := 0; i < n; i++ {
		require.NoError(t, <-errs)
	}
	st := snapshot(t, l)
	require.Len(t, st.Claims, 1, "exactly one goroutine won GPU 0")
	require.Equal(t, uint64(1), st.Generation)
}

func TestAuditRotationAndReadAudit(t *testing.T) {
	opts := testOptions(newClock())
	opts.AuditMaxBytes = 2000
	l, err := Open(t.TempDir(), opts)
	require.NoError(t, err)
	for i := 0; i < 30; i++ {
		update(t, l, func(tx *Tx) {
			_, err := tx.Claim("", owner("c1"), devs(gpu(0)), "env")
			require.NoError(t, err)
		})
		update(t, l, func(tx *Tx) { tx.Release("c1", "stop") })
	}
	cur, err := os.Stat(l.AuditPath())
	require.NoError(t, err)
	rot, err := os.Stat(l.AuditPath() + ".1")
	require.NoError(t, err)
	require.LessOrEqual(t, cur.Size(), int64(2000))
	require.LessOrEqual(t, rot.Size(), int64(2000))
	require.Equal(t, os.FileMode(0o600), rot.Mode().Perm())

	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	require.NotEmpty(t, recs)
	for i := 1; i < len(recs); i++ {
		require.Equal(t, recs[i-1].Generation+1, recs[i].Generation, "rotated file first, in order, nothing lost between them")
	}
	require.Equal(t, snapshot(t, l).Generation, recs[len(recs)-1].Generation)

	// A bad line is reported with its place, and the rest still read.
	f, err := os.OpenFile(l.AuditPath(), os.O_APPEND|os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = f.WriteString("{torn\n{\"time\":\"2026-01-01T00:00:00Z\"}\n")
	require.NoError(t, err)
	require.NoError(t, f.Close())
	n := len(recs)
	recs, err = ReadAudit(l.AuditPath())
	require.Len(t, recs, n)
	var le *AuditLineError
	require.ErrorAs(t, err, &le)
	require.Equal(t, l.AuditPath(), le.Path)
	require.Contains(t, err.Error(), "record has no op")
	require.Equal(t, 2, strings.Count(err.Error(), "audit log "), "both bad lines are reported")

	recs, err = ReadAudit(filepath.Join(t.TempDir(), "none.log"))
	require.NoError(t, err)
	require.Empty(t, recs)
}

func TestHolderFromProcLocksIgnoresOtherFiles(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "x.lock")
	require.NoError(t, os.WriteFile(p, nil, 0o600))
	require.Equal(t, 0, lockHolder(p), "nobody holds it")
	f := flock.New(p)
	ok, err := f.TryLock()
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, os.Getpid(), lockHolder(p))
	require.NoError(t, f.Unlock())
	require.Equal(t, 0, lockHolder(filepath.Join(dir, "missing")))
}

func TestDevNumbers(t *testing.T) {
	for _, tc := range []struct{ major, minor uint64 }{{8, 1}, {253, 0}, {0x1234, 0x56789}, {0, 0}} {
		dev := tc.minor&0xff | (tc.major&0xfff)<<8 | (tc.minor&^0xff)<<12 | (tc.major&^0xfff)<<32
		major, minor := devNumbers(dev)
		require.Equal(t, tc.major, major)
		require.Equal(t, tc.minor, minor)
	}
}
