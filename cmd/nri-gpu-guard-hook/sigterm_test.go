// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
)

// sigtermWatchdog fails a test whose process did not end after SIGTERM. It
// only keeps a broken build from hanging the suite: how long a process takes
// to end is logged (and written down in docs/benchmarks.md), not asserted.
// As long as the suite's other waits: a race-built binary on a loaded
// machine may take seconds, and none of these processes ends by itself.
const sigtermWatchdog = 60 * time.Second

// term sends SIGTERM to p and returns how long it took to end.
func (p *proc) term(t *testing.T) time.Duration {
	t.Helper()
	start := time.Now()
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-p.done:
	case <-time.After(sigtermWatchdog):
		t.Fatalf("still running %s after SIGTERM; stderr:\n%s", sigtermWatchdog, p.stderr.String())
	}
	return time.Since(start)
}

// lockFree reports whether the ledger lock can be taken now (and lets it
// go at once).
func (h *host) lockFree(t *testing.T) bool {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(h.stateDir, "ledger.lock"), os.O_RDWR, 0)
	require.NoError(t, err)
	defer func() { _ = f.Close() }()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return false
	}
	_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	return true
}

// holdLock takes the ledger lock in this process (another process, to the
// commands under test) until the test ends.
func (h *host) holdLock(t *testing.T) {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(h.stateDir, "ledger.lock"), os.O_RDWR, 0)
	require.NoError(t, err)
	require.NoError(t, syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB))
	t.Cleanup(func() { _ = f.Close() })
}

// holdLockUntilReleased takes the ledger lock as soon as it is free (the
// commands under test poll the ledger and take the lock for moments) and
// returns the func that lets it go.
func (h *host) holdLockUntilReleased(t *testing.T) func() {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(h.stateDir, "ledger.lock"), os.O_RDWR, 0)
	require.NoError(t, err)
	h.waitFor("the ledger lock taken by the test", func() bool {
		return syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil
	})
	release := func() { _ = f.Close() }
	t.Cleanup(release)
	return release
}

// opens reports, from the call on, each time some process opens path
// (inotify). A command polling a held lock opens the lock file for
// microseconds per attempt (gofrs/flock closes it again when the attempt
// fails), so sampling /proc/PID/fd can miss every attempt: a sampler and a
// poller on the same period never meet. Closes are watched too: inotify
// merges identical events that follow each other unread, and an open, a
// close and an open are never identical neighbours.
func opens(t *testing.T, path string) <-chan struct{} {
	t.Helper()
	fd, err := syscall.InotifyInit1(syscall.IN_CLOEXEC | syscall.IN_NONBLOCK)
	require.NoError(t, err)
	// Non-blocking, so the runtime's poller serves the reads and Close
	// ends the reader below.
	f := os.NewFile(uintptr(fd), "inotify")
	t.Cleanup(func() { _ = f.Close() })
	_, err = syscall.InotifyAddWatch(fd, path, syscall.IN_OPEN|syscall.IN_CLOSE_WRITE|syscall.IN_CLOSE_NOWRITE)
	require.NoError(t, err)
	ch := make(chan struct{}, 1024)
	go func() {
		buf := make([]byte, 64<<10)
		for {
			n, err := f.Read(buf)
			if err != nil {
				return
			}
			for off := 0; off+syscall.SizeofInotifyEvent <= n; {
				ev := (*syscall.InotifyEvent)(unsafe.Pointer(&buf[off]))
				if ev.Mask&syscall.IN_OPEN != 0 {
					select {
					case ch <- struct{}{}:
					default:
					}
				}
				off += syscall.SizeofInotifyEvent + int(ev.Len)
			}
		}
	}()
	return ch
}

// slowLockCfg is the host's configuration with a ledger.lock_timeout of an
// hour: a command waiting for the lock waits until it is told to stop.
func (h *host) slowLockCfg(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(h.cfgPath)
	require.NoError(t, err)
	require.Contains(t, string(b), `lock_timeout = "5s"`)
	p := filepath.Join(h.base, "config-slow-lock.toml")
	require.NoError(t, os.WriteFile(p, []byte(strings.Replace(string(b), `lock_timeout = "5s"`, `lock_timeout = "1h"`, 1)), 0o600))
	return p
}

// Every long-running command of the hook-only host ends on SIGTERM, with a
// non-zero status and a message saying so, and leaves nothing behind: a
// create-runtime hook waiting in the queue (--wait) and `gpu-guard-ctl run`
// waiting for its ticket leave the queue; a hook and a ctl mutation waiting
// for the ledger lock another process holds give up without touching the
// ledger. The exit latency is logged.
func TestSIGTERMEndsEveryCommand(t *testing.T) {
	t.Run("hook create-runtime --wait, queued", func(t *testing.T) {
		h := newBusyHost(t)
		p := startProc(t, h.state("w4", h.ctrProcess(), gpuEnv(0)), hookBin, hook.PhaseCreateRuntime, "--config", h.cfgPath, "--wait")
		h.waitFor("w4 queued", func() bool {
			st, err := h.snapshot()
			return err == nil && len(st.Waiters) == 4
		})
		took := p.term(t)
		t.Logf("SIGTERM exit latency: hook create-runtime --wait (queued): %s", took)
		assert.Equal(t, hook.ExitRefused, p.cmd.ProcessState.ExitCode(), p.stderr.String())
		assert.Contains(t, p.stderr.String(), "hook cancelled while waiting for the GPU (terminated")
		assert.Contains(t, p.stderr.String(), "it is not queued any more and holds no GPU")
		st, err := h.snapshot()
		require.NoError(t, err)
		assert.Equal(t, []string{"w1", "w2", "w3"}, waiterKeys(st), "w4 left the queue")
		assert.True(t, h.lockFree(t), "the ledger lock is free")
	})

	t.Run("gpu-guard-ctl run, queued", func(t *testing.T) {
		h := newBusyHost(t)
		p := startProc(t, nil, ctlBin, "--config", h.cfgPath, "run", "--gpus", "0", "--", "true")
		h.waitFor("the run queued", func() bool {
			st, err := h.snapshot()
			return err == nil && len(st.Waiters) == 4
		})
		took := p.term(t)
		t.Logf("SIGTERM exit latency: gpu-guard-ctl run (queued): %s", took)
		assert.NotEqual(t, 0, p.cmd.ProcessState.ExitCode(), p.stderr.String())
		st, err := h.snapshot()
		require.NoError(t, err)
		assert.Equal(t, []string{"w1", "w2", "w3"}, waiterKeys(st), "the run left the queue")
		assert.Equal(t, map[string]string{"0": "h1", "1": "h2"}, h.holders(st), "and claimed nothing")
		assert.True(t, h.lockFree(t), "the ledger lock is free")
	})

	// Told to stop while another process holds the ledger lock, a queued
	// waiter cannot leave the queue at once. It still ends within its short
	// stop budget (not ten lock timeouts), says so, and the entry it left
	// is dropped by the next request for its GPU, its process being gone.
	t.Run("gpu-guard-ctl run, queued, ledger lock held when told to stop", func(t *testing.T) {
		h := newBusyHost(t)
		p := startProc(t, nil, ctlBin, "--config", h.cfgPath, "run", "--gpus", "0", "--", "true")
		h.waitFor("the run queued", func() bool {
			st, err := h.snapshot()
			return err == nil && len(st.Waiters) == 4
		})
		release := h.holdLockUntilReleased(t)
		took := p.term(t)
		t.Logf("SIGTERM exit latency: gpu-guard-ctl run (queued, ledger lock held elsewhere): %s", took)
		assert.NotEqual(t, 0, p.cmd.ProcessState.ExitCode(), p.stderr.String())
		assert.Contains(t, p.stderr.String(), "could not leave the queue within 500ms")
		assert.Contains(t, p.stderr.String(), "the next request for these GPUs drops the entry once this process has exited")
		release()
		st, err := h.snapshot()
		require.NoError(t, err)
		require.Len(t, st.Waiters, 4, "the run's entry is still there")
		r := h.hook(hook.PhaseCreateRuntime, "late", h.ctrProcess(), gpuEnv(0))
		require.Equal(t, hook.ExitBusy, r.code, r.String())
		st, err = h.snapshot()
		require.NoError(t, err)
		assert.Equal(t, []string{"w1", "w2", "w3"}, waiterKeys(st), "the dead run's entry was dropped")
		assert.Equal(t, map[string]string{"0": "h1", "1": "h2"}, h.holders(st))
	})

	for _, tc := range []struct {
		name string
		// args gets the subtest's t: a failure inside it must end the
		// subtest, not the parent from the subtest's goroutine.
		args func(t *testing.T, h *host) ([]byte, string, []string)
	}{
		{"hook create-runtime, ledger lock held", func(t *testing.T, h *host) ([]byte, string, []string) {
			return h.state("c2", h.ctrProcess(), gpuEnv(2)), hookBin, []string{hook.PhaseCreateRuntime, "--config", h.slowLockCfg(t)}
		}},
		{"gpu-guard-ctl release of holder h1, ledger lock held", func(t *testing.T, h *host) ([]byte, string, []string) {
			return nil, ctlBin, []string{"--config", h.slowLockCfg(t), "release", "--container", "h1", "--reason", "test", "--force"}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newBusyHost(t)
			before, err := h.snapshot()
			require.NoError(t, err)
			h.holdLock(t)
			stdin, bin, args := tc.args(t, h.host)
			// Watched from before the command starts: the test's own hold
			// opened the lock already, so every open reported is the
			// command's. Its second attempt means it is waiting: a hook sets
			// up its signal handling before it first waits for a held lock.
			lockOpened := opens(t, filepath.Join(h.stateDir, "ledger.lock"))
			p := startProc(t, stdin, bin, args...)
			deadline := time.After(condTimeout)
			for attempt := 1; attempt <= 2; attempt++ {
				select {
				case <-lockOpened:
				case <-p.done:
					t.Fatalf("ended before SIGTERM after %d attempts at the ledger lock: %s", attempt-1, p.stderr.String())
				case <-deadline:
					t.Fatalf("timed out after %s waiting for the command's attempt %d at the ledger lock", condTimeout, attempt)
				}
			}
			took := p.term(t)
			t.Logf("SIGTERM exit latency: %s: %s", tc.name, took)
			assert.Equal(t, 1, p.cmd.ProcessState.ExitCode(), p.stderr.String())
			// It was waiting for the lock, and says who holds it and why it
			// stopped waiting.
			assert.Contains(t, p.stderr.String(), "ledger.lock not acquired within")
			assert.Contains(t, p.stderr.String(), fmt.Sprintf("held by pid %d", os.Getpid()))
			assert.Contains(t, p.stderr.String(), "terminated signal received")
			after, err := h.snapshot()
			require.NoError(t, err)
			assert.Equal(t, before.Generation, after.Generation, "nothing committed")
			assert.Equal(t, map[string]string{"0": "h1", "1": "h2"}, h.holders(after))
		})
	}
}
