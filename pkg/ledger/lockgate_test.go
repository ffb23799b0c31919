// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func init() {
	helpers["gate-holder"] = gateHolder
}

// gateHolder closes the gate of the ledger in DIR (as a writer waiting for
// the lock does), says "ready" and holds it until its stdin ends.
func gateHolder() int {
	f, err := os.OpenFile(filepath.Join(os.Getenv("DIR"), gateName), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return helperFail("open the gate: %v", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return helperFail("close the gate: %v", err)
	}
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	return 0
}

// withGateGrace sets gateGrace for one test (no test of this package runs
// in parallel).
func withGateGrace(t *testing.T, d time.Duration) {
	old := gateGrace
	gateGrace = d
	t.Cleanup(func() { gateGrace = old })
}

// A writer that commits back to back (the daemon in a burst) does not take
// the lock again ahead of a writer that found it held: that one closed the
// gate, and the busy writer's next commit waits there until the other has
// the lock. Without the gate the busy writer took the lock again
// microseconds after it let go, while the other slept between two polls,
// and a ctl command or hook reached lock_timeout behind a holder that was
// busy, not stuck.
func TestABackToBackWriterLetsTheWaiterIn(t *testing.T) {
	withGateGrace(t, time.Hour) // the waiter is never taken for frozen: the order is the gate's alone
	ctx := context.Background()
	busy := openTest(t, nil)
	waiting := make(chan struct{})
	opts := testOptions(nil)
	opts.BeforeLockWait = func() { close(waiting) }
	other, err := Open(busy.Dir(), opts)
	require.NoError(t, err)

	var mu sync.Mutex
	var order []string
	note := func(s string) {
		mu.Lock()
		defer mu.Unlock()
		order = append(order, s)
	}
	done := make(chan error, 1)
	update(t, busy, func(tx *Tx) {
		go func() {
			done <- other.Update(ctx, func(tx *Tx) error {
				note("other")
				_, _, err := tx.Cordon(gpu(7), CordonOperator, "maintenance", "root")
				return err
			})
		}()
		<-waiting // the other found the lock held, and closed the gate
		note("busy 1")
		tx.Enqueue("k1", owner("k1"), devs(gpu(0)))
	})
	update(t, busy, func(tx *Tx) {
		note("busy 2")
		tx.Enqueue("k2", owner("k2"), devs(gpu(1)))
	})
	require.NoError(t, <-done)
	require.Equal(t, []string{"busy 1", "other", "busy 2"}, order)
}

// A writer at a gate closed by a stopped process (^Z of a gpu-guard-ctl
// command that waited for the lock) goes on to the lock at once: the
// stopped process would hold the gate until continued.
func TestAStoppedGateHolderHoldsNoWriterUp(t *testing.T) {
	withGateGrace(t, time.Hour) // only the stopped check lets the writer through
	l := seeded(t)
	waits := 0
	opts := testOptions(nil)
	opts.BeforeLockWait = func() { waits++ }
	w, err := Open(l.Dir(), opts)
	require.NoError(t, err)

	cmd := helperCmd(t, "gate-holder", map[string]string{"DIR": l.Dir()})
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	pid := cmd.Process.Pid
	t.Cleanup(func() {
		_ = syscall.Kill(pid, syscall.SIGCONT)
		_ = stdin.Close()
		_ = cmd.Wait()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "ready\n", line)
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	var ws syscall.WaitStatus
	_, err = syscall.Wait4(pid, &ws, syscall.WUNTRACED, nil)
	require.NoError(t, err)
	require.True(t, ws.Stopped())

	// A bound for a broken gate, not a timing: the caller gives up, and
	// a writer whose caller gave up takes nothing.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, w.Update(ctx, func(tx *Tx) error {
		tx.Enqueue("k", owner("k"), devs(gpu(1)))
		return nil
	}))
	require.Zero(t, waits, "the lock was free and the gate's holder stopped: nothing to wait for")
}

// A live process that closed the gate but leaves the free lock alone (a
// waiter starved of CPU) holds the others up only for gateGrace.
func TestAGateLeftClosedOverAFreeLockIsPassed(t *testing.T) {
	withGateGrace(t, time.Millisecond)
	l := seeded(t)
	waits := 0
	opts := testOptions(nil)
	opts.BeforeLockWait = func() { waits++ }
	w, err := Open(l.Dir(), opts)
	require.NoError(t, err)
	f, err := os.OpenFile(w.gatePath(), os.O_RDWR|os.O_CREATE, 0o600)
	require.NoError(t, err)
	defer func() { _ = f.Close() }()
	require.NoError(t, syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB))

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, w.Update(ctx, func(tx *Tx) error {
		tx.Enqueue("k", owner("k"), devs(gpu(1)))
		return nil
	}))
	require.Equal(t, 1, waits, "it waited at the closed gate, once")
}

// A writer whose caller gives up while it waits at the gate takes nothing.
func TestACallerThatGivesUpAtTheGateTakesNothing(t *testing.T) {
	withGateGrace(t, time.Hour)
	l := seeded(t)
	ctx, cancel := context.WithCancel(context.Background())
	opts := testOptions(nil)
	opts.BeforeLockWait = cancel // at the closed gate
	w, err := Open(l.Dir(), opts)
	require.NoError(t, err)
	f, err := os.OpenFile(w.gatePath(), os.O_RDWR|os.O_CREATE, 0o600)
	require.NoError(t, err)
	defer func() { _ = f.Close() }()
	require.NoError(t, syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB))

	err = w.Update(ctx, func(tx *Tx) error { t.Fatal("must not run"); return nil })
	require.ErrorIs(t, err, ErrLockTimeout)
	require.ErrorIs(t, err, context.Canceled)
}

// A lock timeout tells a holder that keeps the lock without committing
// (stuck: stop it) from a ledger that committed while the call waited
// (busy: retry), from the generation in the boot marker.
func TestLockTimeoutTellsBusyFromStuck(t *testing.T) {
	l := seeded(t)
	waiting := make(chan struct{}, 1)
	opts := testOptions(nil)
	opts.LockTimeout = 200 * time.Millisecond
	opts.BeforeLockWait = func() { waiting <- struct{}{} }
	w, err := Open(l.Dir(), opts)
	require.NoError(t, err)
	wait := func(during func(tx *Tx)) *LockError {
		var le *LockError
		update(t, l, func(tx *Tx) {
			done := make(chan error, 1)
			go func() { done <- w.Update(context.Background(), func(*Tx) error { return nil }) }()
			<-waiting
			during(tx)
			require.ErrorAs(t, <-done, &le)
		})
		return le
	}

	le := wait(func(*Tx) {})
	require.True(t, le.CommitsKnown)
	require.Zero(t, le.Commits)
	require.Contains(t, le.Error(), fmt.Sprintf("held by pid %d (see /proc/%d/cmdline); no commit was made while this "+
		"call waited: a holder that keeps the lock without writing is stuck and must be stopped", os.Getpid(), os.Getpid()))
	require.NotContains(t, le.Error(), "busy")

	// Three commits of other processes meanwhile, as the boot marker
	// (which every commit updates) shows them.
	le = wait(func(tx *Tx) {
		st := *tx.State()
		st.Generation += 3
		require.NoError(t, l.writeMarker(&st))
	})
	require.True(t, le.CommitsKnown)
	require.Equal(t, uint64(3), le.Commits)
	require.Contains(t, le.Error(), "the ledger is busy, not stuck: 3 commit(s) were made while this call waited, "+
		"and its turn did not come in time: retry it, and if this keeps happening raise [ledger] lock_timeout")
	require.NotContains(t, le.Error(), "must be stopped")
	require.True(t, errors.Is(le, ErrLockTimeout))
}
