// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
)

// A crash anywhere inside a reset never loses the operator's cordon the
// reset carries. The reset used to rename every state file away before it
// wrote the new state: a crash in between left a state dir without ledger
// files, which the next read took for a fresh host (after a reboot: the
// cordoned GPU was claimable at once) or the next reset and recovery for
// nothing to keep. Each subtest crashes the reset at the n-th write stage
// it reaches, for every n until one completes; whatever the crash left
// either reads as before the reset, or as the reset's state, or needs
// recovery, and the operator's next `recover --reset` finds the cordon.
func TestCrashInsideResetKeepsTheOperatorsCordon(t *testing.T) {
	for _, tc := range []struct {
		name string
		boot string // the boot the reset runs in; the ledger is of testBoot
	}{{"this boot", testBoot}, {"after a reboot", "after-reboot"}} {
		t.Run(tc.name, func(t *testing.T) {
			for n := 1; ; n++ {
				if !crashResetAtStage(t, n, tc.boot) {
					require.Greater(t, n, 3, "the reset writes a snapshot, a journal and the marker")
					return
				}
			}
		})
	}
}

// crashResetAtStage runs a reset that crashes at the n-th write stage it
// reaches and checks what is left; it reports whether the reset crashed
// (false: it had fewer stages and completed).
func crashResetAtStage(t *testing.T, n int, boot string) bool {
	t.Helper()
	c := newClock()
	dir := filepath.Join(t.TempDir(), "state")
	var opts Options
	if boot == testBoot {
		opts = testOptions(c)
	} else {
		opts = rebootOptions(t, c, testBoot)
	}
	l, err := Open(dir, opts)
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, _, err := tx.Cordon(gpu(1), CordonOperator, "RMA 4711", "uid 0 via gpu-guard-ctl")
		require.NoError(t, err)
		_, err = tx.Claim("", owner("h2"), devs(gpu(2)), "env")
		require.NoError(t, err)
	})
	if boot != testBoot {
		opts = rebootOptions(t, c, boot)
		opts.RuntimeDir = l.opts.RuntimeDir // the same host's runtime dir, rebooted: a new boot id
	}
	r, err := Open(dir, opts)
	require.NoError(t, err)

	crashed := false
	func() {
		reached := 0
		failpoint = func(string) {
			if reached++; reached == n {
				panic("crash")
			}
		}
		defer func() {
			failpoint = nil
			crashed = recover() != nil
		}()
		_, err := r.Reset(context.Background(), "test")
		require.NoError(t, err)
	}()
	if !crashed {
		return false
	}

	again, err := Open(dir, opts)
	require.NoError(t, err)
	st, err := again.Snapshot(context.Background())
	if errors.Is(err, ErrNeedsRecovery) {
		// What the operator does next: `gpu-guard-ctl recover --reset`.
		rep, rerr := again.Reset(context.Background(), "again")
		require.NoError(t, rerr, "crash at stage %d", n)
		require.Equal(t, map[string]string{gpu(1).UUID: CordonOperator}, cordonSources(rep.KeptCordons), "crash at stage %d", n)
		st, err = again.Snapshot(context.Background())
	}
	require.NoError(t, err, "crash at stage %d", n)
	require.Equal(t, map[string]string{gpu(1).UUID: CordonOperator}, cordonSources(st.Cordons), "crash at stage %d", n)
	err = again.Update(context.Background(), func(tx *Tx) error {
		_, err := tx.Claim("", owner("n"), devs(gpu(1)), "env")
		return err
	})
	require.Error(t, err, "crash at stage %d: the cordoned GPU must not be claimable", n)
	return true
}

// A handle that cached a journal ending in a torn record reads it again
// from the end of its last whole record, even when the file looks
// unchanged. Another writer cuts that tail and appends its commit; where
// the commit has the torn tail's length and both writes fall in one
// timestamp tick (coarse timestamps), size, mtime and ctime all match the
// cached identity. The test makes them match by giving the cache the
// file's new identity. Trusting it, the long-lived handle did not see the
// commit; the boot marker's generation then told it commits were lost, and
// a healthy ledger refused every GPU until an operator recovered it.
func TestCachedTornTailIsReadAgain(t *testing.T) {
	c := newClock()
	dir := t.TempDir()
	a, err := Open(dir, testOptions(c))
	require.NoError(t, err)
	update(t, a, func(tx *Tx) {
		_, err := tx.Claim("", owner("h0"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	// A writer killed in the middle of its record.
	f, err := os.OpenFile(filepath.Join(dir, journalName), os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(t, err)
	_, err = f.WriteString(`{"torn":`)
	require.NoError(t, err)
	require.NoError(t, f.Close())
	snapshot(t, a) // a caches the journal with its torn tail

	b, err := Open(dir, testOptions(c))
	require.NoError(t, err)
	update(t, b, func(tx *Tx) {
		_, err := tx.Claim("", owner("h1"), devs(gpu(1)), "env")
		require.NoError(t, err)
	})
	fi, err := os.Lstat(filepath.Join(dir, journalName))
	require.NoError(t, err)
	a.cacheMu.Lock()
	require.NotNil(t, a.cache)
	require.Less(t, a.cache.jEnd, a.cache.jID.size, "the cache holds the torn tail")
	a.cache.jID = idOf(fi) // the coincidence of coarse timestamps and equal lengths
	a.cacheMu.Unlock()

	err = a.Update(context.Background(), func(tx *Tx) error {
		_, err := tx.Claim("", owner("h2"), devs(gpu(1)), "env")
		return err
	})
	require.ErrorIs(t, err, ErrBusy, "GPU 1 is held by h1 (not: the ledger needs recovery)")
	st := snapshot(t, b)
	require.Len(t, st.Claims, 2)
	require.Equal(t, "h1", holders(st)[gpu(1).UUID])
}

// A lock-free read that catches another process's reset half done (its new
// snapshot in place, the journal not yet swapped) does not report the
// ledger as needing recovery: it confirms under the lock, after the reset,
// and reads the reset's state.
func TestReadDuringAResetConfirmsUnderTheLock(t *testing.T) {
	c := newClock()
	dir := t.TempDir()
	w, err := Open(dir, testOptions(c))
	require.NoError(t, err)
	update(t, w, func(tx *Tx) {
		_, _, err := tx.Cordon(gpu(1), CordonOperator, "RMA 4711", "uid 0 via gpu-guard-ctl")
		require.NoError(t, err)
	})
	waiting := make(chan struct{})
	var once sync.Once
	ropts := testOptions(c)
	ropts.BeforeLockWait = func() { once.Do(func() { close(waiting) }) }
	// The reader waits for the reset as long as the test lets it: no
	// deadline of the real clock decides the outcome.
	defer func(d time.Duration) { confirmWait = d }(confirmWait)
	confirmWait = time.Hour
	r, err := Open(dir, ropts)
	require.NoError(t, err)

	paused, resume := make(chan struct{}), make(chan struct{})
	paused1 := false
	failpoint = func(s string) {
		if s == stageJournalRotated && !paused1 {
			paused1 = true
			close(paused)
			<-resume
		}
	}
	defer func() { failpoint = nil }()
	resetDone := make(chan error, 1)
	go func() {
		_, err := w.Reset(context.Background(), "test")
		resetDone <- err
	}()
	testwait.Receive(t, paused, "the reset's pause") // its snapshot is written, its journal not yet

	type result struct {
		st  State
		err error
	}
	read := make(chan result, 1)
	go func() {
		st, err := r.Snapshot(context.Background())
		read <- result{st, err}
	}()
	select {
	case <-waiting: // the reader found the half-replaced files and waits for the lock
	case got := <-read:
		close(resume)
		require.NoError(t, testwait.Receive(t, resetDone, "the reset's end"))
		t.Fatalf("the read did not wait for the reset: %+v", got.err)
	}
	close(resume)
	require.NoError(t, testwait.Receive(t, resetDone, "the reset's end"))
	got := testwait.Receive(t, read, "the read")
	require.NoError(t, got.err)
	require.Equal(t, map[string]string{gpu(1).UUID: CordonOperator}, cordonSources(got.st.Cordons))
}
