// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// The signal tests of `gpu-guard-ctl run` start this test binary twice: as
// "ctl", which runs runChild as gpu-guard-ctl run does, and, below it, as
// "container", the command, which counts the signals it gets. Both in a
// session of their own: with the pseudo-terminal the test drives as their
// controlling terminal (an interactive gpu-guard-ctl run), or with none (one
// run by systemd or cron).
const signalRoleEnv = "GPU_GUARD_CTL_TEST_SIGNAL_ROLE"

// signalConfigEnv names the configuration file of the "wait" role.
const signalConfigEnv = "GPU_GUARD_CTL_TEST_SIGNAL_CONFIG"

func playSignalRole(role string) int {
	switch role {
	case "ctl":
		// What root.go sets up for every command: a context the signals
		// cancel; runChild must not turn them into a kill.
		_, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		exe, err := os.Executable()
		if err != nil {
			fmt.Println(err)
			return 1
		}
		if err := os.Setenv(signalRoleEnv, "container"); err != nil {
			fmt.Println(err)
			return 1
		}
		// As started from a terminal, where no signal is ignored: a
		// test run under nohup hands its ignored SIGHUP down, which
		// runChild leaves ignored on purpose
		// (TestRunChildKeepsIgnoredSignalsIgnored).
		fromTerminal := func(os.Signal) bool { return false }
		code, err := runChild(context.Background(), []string{exe}, "ticket-x", Env{Stdout: os.Stdout, Stderr: os.Stderr, Ignored: fromTerminal})
		if err != nil {
			fmt.Println(err)
			return 1
		}
		return code
	case "ctl-nohup":
		// gpu-guard-ctl run started by nohup: SIGHUP ignored from the
		// start. The command reports what it ignores.
		signal.Ignore(syscall.SIGHUP)
		fmt.Println("ready")
		code, err := runChild(context.Background(), []string{"grep", "SigIgn", "/proc/self/status"}, "ticket-x", Env{Stdout: os.Stdout, Stderr: os.Stderr})
		if err != nil {
			fmt.Println(err)
			return 1
		}
		return code
	case "wait":
		// gpu-guard-ctl run, waiting for a busy GPU, with the signal
		// handling of the real process (cmd/gpu-guard-ctl) started from a
		// terminal, where none is ignored: a test run under nohup hands
		// its ignored SIGHUP down, which NotifyInterrupts leaves ignored
		// on purpose (TestIgnoredSignalsStayIgnored).
		fromTerminal := func(ctx context.Context) (context.Context, context.CancelFunc) {
			return signal.NotifyContext(ctx, caughtInterrupts(func(os.Signal) bool { return false })...)
		}
		env := Env{Stdout: os.Stdout, Stderr: os.Stdout, Getuid: func() int { return 0 }, Interrupts: fromTerminal}
		fmt.Println("ready")
		return Run(context.Background(), []string{"--config", os.Getenv(signalConfigEnv), "run", "--gpus", "1", "--", "true"}, env)
	case "container":
		// Each signal is reported once handled, so that a signal the test
		// sends next arrives after it; SIGTERM ends it with the counts.
		sigs := make(chan os.Signal, 8)
		signal.Notify(sigs, syscall.SIGINT, syscall.SIGQUIT, syscall.SIGHUP, syscall.SIGTERM)
		counts := map[string]int{}
		fmt.Printf("ready %d\n", os.Getpid())
		for s := range sigs {
			name := s.(syscall.Signal).String()
			counts[name]++
			if s == syscall.SIGTERM {
				fmt.Printf("done interrupt=%d quit=%d hangup=%d terminated=%d\n",
					counts["interrupt"], counts["quit"], counts["hangup"], counts["terminated"])
				return 7
			}
			fmt.Printf("got %s %d\n", name, counts[name])
		}
	}
	return 2
}

// signalRig is a "ctl" process (and its "container") started by the test.
type signalRig struct {
	t   *testing.T
	cmd *exec.Cmd
	out *outWatch
	tty *os.File // the pseudo-terminal's master side, or nil
	// exited is closed once ctl has exited, with its error in err.
	exited chan struct{}
	err    error
	// drained is closed once out holds all the output: with a terminal,
	// when the copy from its master side has ended (output written before
	// ctl exited may still be in the terminal when exited closes); without,
	// at once (cmd.Wait copies the pipes out before it returns).
	drained chan struct{}
}

// startSignalRig starts "ctl" in a session of its own, with a
// pseudo-terminal as its controlling terminal (and stdio) when withTTY.
func startSignalRig(t *testing.T, withTTY bool) *signalRig {
	t.Helper()
	return startSignalRole(t, withTTY, "ctl")
}

// startSignalRole is startSignalRig for any role, with extra environment.
func startSignalRole(t *testing.T, withTTY bool, role string, env ...string) *signalRig {
	t.Helper()
	exe, err := os.Executable()
	require.NoError(t, err)
	r := &signalRig{t: t, out: &outWatch{}, exited: make(chan struct{}), drained: make(chan struct{})}
	r.cmd = exec.Command(exe)
	r.cmd.Env = append(append(os.Environ(), signalRoleEnv+"="+role), env...)
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if withTTY {
		master, slave := openPTY(t)
		r.tty = master
		r.cmd.Stdin, r.cmd.Stdout, r.cmd.Stderr = slave, slave, slave
		r.cmd.SysProcAttr.Setctty, r.cmd.SysProcAttr.Ctty = true, 0
		require.NoError(t, r.cmd.Start())
		_ = slave.Close()
		go func() { // ends with EIO once both have exited
			defer close(r.drained)
			_, _ = io.Copy(r.out, master)
		}()
	} else {
		r.cmd.Stdout, r.cmd.Stderr = r.out, r.out
		require.NoError(t, r.cmd.Start())
		close(r.drained)
	}
	go func() {
		r.err = r.cmd.Wait()
		close(r.exited)
	}()
	t.Cleanup(func() {
		_ = syscall.Kill(-r.cmd.Process.Pid, syscall.SIGKILL)
		if r.tty != nil {
			_ = r.tty.Close()
		}
	})
	r.waitOutput("ready")
	return r
}

// waitOutput waits until the output holds s.
func (r *signalRig) waitOutput(s string) {
	r.t.Helper()
	select {
	case <-r.out.when(s):
	case <-r.exited:
		select {
		case <-r.drained:
		case <-time.After(time.Minute):
			r.t.Fatalf("the output of ctl did not end within a minute of its exit:\n%s", r.out.String())
		}
		select {
		case <-r.out.when(s):
		default:
			r.t.Fatalf("ctl exited (%v) before %q was in the output:\n%s", r.err, s, r.out.String())
		}
	case <-time.After(time.Minute):
		r.t.Fatalf("no %q in the output within a minute:\n%s", s, r.out.String())
	}
}

// outWatch collects output and tells when it holds a string.
type outWatch struct {
	mu      sync.Mutex
	buf     strings.Builder
	waiting map[string]chan struct{}
}

func (w *outWatch) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	for s, ch := range w.waiting {
		if strings.Contains(w.buf.String(), s) {
			close(ch)
			delete(w.waiting, s)
		}
	}
	return len(p), nil
}

// when returns a channel closed once the output holds s.
func (w *outWatch) when(s string) <-chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	ch := make(chan struct{})
	if strings.Contains(w.buf.String(), s) {
		close(ch)
		return ch
	}
	if w.waiting == nil {
		w.waiting = map[string]chan struct{}{}
	}
	if old, ok := w.waiting[s]; ok {
		return old
	}
	w.waiting[s] = ch
	return ch
}

func (w *outWatch) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

// finish ends the container with a SIGTERM to ctl (forwarded in every
// case) and returns the container's counts line and ctl's exit code.
func (r *signalRig) finish() (string, int) {
	r.t.Helper()
	require.NoError(r.t, syscall.Kill(r.cmd.Process.Pid, syscall.SIGTERM))
	r.waitOutput("done ")
	select {
	case <-r.exited:
	case <-time.After(time.Minute):
		r.t.Fatalf("ctl did not exit:\n%s", r.out.String())
	}
	code := 0
	var ee *exec.ExitError
	if errors.As(r.err, &ee) {
		code = ee.ExitCode()
	} else {
		require.NoError(r.t, r.err)
	}
	out := r.out.String()
	i := strings.Index(out, "done ")
	line, _, _ := strings.Cut(out[i:], "\n")
	return strings.TrimSpace(line), code
}

// openPTY opens a pseudo-terminal pair (master, slave).
func openPTY(t *testing.T) (*os.File, *os.File) {
	t.Helper()
	master, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("no pseudo-terminal here: %v", err)
	}
	if err := unix.IoctlSetPointerInt(int(master.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		_ = master.Close()
		t.Skipf("unlock the pseudo-terminal: %v", err)
	}
	n, err := unix.IoctlGetUint32(int(master.Fd()), unix.TIOCGPTN)
	if err != nil {
		_ = master.Close()
		t.Skipf("name the pseudo-terminal: %v", err)
	}
	slave, err := os.OpenFile(filepath.Join("/dev/pts", strconv.Itoa(int(n))), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		_ = master.Close()
		t.Skipf("open the pseudo-terminal's slave: %v", err)
	}
	return master, slave
}

// An interactive `gpu-guard-ctl run -- podman run …`: Ctrl-C and Ctrl-\ on
// the terminal reach the command once, from the terminal, as they reach
// every process of the foreground group; gpu-guard-ctl does not send a
// second copy (podman run --sig-proxy would pass both into the container).
// SIGTERM, which only a sender aiming at gpu-guard-ctl sends, is forwarded.
func TestRunChildTerminalSignalsReachTheCommandOnce(t *testing.T) {
	for _, tc := range []struct {
		name string
		key  byte
		got  string
		want string
	}{
		{"ctrl-c", 0x03, "got interrupt 1", "done interrupt=1 quit=0 hangup=0 terminated=1"},
		{"ctrl-backslash", 0x1c, "got quit 1", "done interrupt=0 quit=1 hangup=0 terminated=1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := startSignalRig(t, true)
			_, err := r.tty.Write([]byte{tc.key}) // the signal to the foreground group
			require.NoError(t, err)
			r.waitOutput(tc.got)
			counts, code := r.finish()
			// A copy forwarded by gpu-guard-ctl would have reached the
			// command before the SIGTERM it forwards after it.
			assert.Equal(t, tc.want, counts, r.out.String())
			assert.Equal(t, 7, code, "the command's exit code, not a kill")
		})
	}
}

// Without a terminal (systemd, cron, CI, `kill -INT PID`), a signal sent to
// gpu-guard-ctl reaches the command only through it: each is forwarded
// once, and the command handles it (not turned into a kill by the
// command's own interrupt handling).
func TestRunChildForwardsSignals(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGQUIT, syscall.SIGHUP} {
		t.Run(sig.String(), func(t *testing.T) {
			r := startSignalRig(t, false)
			require.NoError(t, syscall.Kill(r.cmd.Process.Pid, sig))
			r.waitOutput(fmt.Sprintf("got %s 1", sig))
			counts, code := r.finish()
			want := map[syscall.Signal]string{
				syscall.SIGINT:  "done interrupt=1 quit=0 hangup=0 terminated=1",
				syscall.SIGQUIT: "done interrupt=0 quit=1 hangup=0 terminated=1",
				syscall.SIGHUP:  "done interrupt=0 quit=0 hangup=1 terminated=1",
			}[sig]
			assert.Equal(t, want, counts, r.out.String())
			assert.Equal(t, 7, code)
		})
	}
}

func TestForwardSignal(t *testing.T) {
	for _, s := range []syscall.Signal{syscall.SIGINT, syscall.SIGQUIT, syscall.SIGHUP} {
		assert.False(t, forwardSignal(s, true), "%s in a terminal's foreground: the terminal sent the command its own", s)
		assert.True(t, forwardSignal(s, false), "%s elsewhere: sent to gpu-guard-ctl alone", s)
	}
	assert.True(t, forwardSignal(syscall.SIGTERM, true))
	assert.True(t, forwardSignal(syscall.SIGTERM, false))
}

// A signal that would end gpu-guard-ctl run while it waits leaves the queue,
// as Ctrl-C does. SIGHUP (the ssh session or terminal hung up) and SIGQUIT
// (Ctrl-\\) used to kill it with its entry still queued: the next freed GPU
// was reserved for a waiter that would never come.
func TestRunWaitLeavesTheQueueOnEverySignal(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGINT, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			f := newFixture(t)
			// The ledger as the hook opens it (the host's boot id): GPU 1
			// held by a container that never started, so run waits.
			l, err := ledger.Open(f.dir, ledger.Options{})
			require.NoError(t, err)
			require.NoError(t, l.Update(t.Context(), func(tx *ledger.Tx) error {
				_, err := tx.Claim(key(ownTrainer), ownTrainer, []devices.Device{f.dev(t, uuidGPU1)}, "env")
				return err
			}))
			r := startSignalRole(t, false, "wait", signalConfigEnv+"="+f.config)
			r.waitOutput(" waiting ") // queued: the first progress line
			st, err := l.Snapshot(t.Context())
			require.NoError(t, err)
			require.Len(t, st.Waiters, 1, r.out.String())

			require.NoError(t, syscall.Kill(r.cmd.Process.Pid, sig))
			select {
			case <-r.exited:
			case <-time.After(time.Minute):
				t.Fatalf("run did not exit:\n%s", r.out.String())
			}
			var ee *exec.ExitError
			require.ErrorAs(t, r.err, &ee, r.out.String())
			assert.Equal(t, ExitError, ee.ExitCode(), "left the wait and failed (not killed by %s):\n%s", sig, r.out.String())
			st, err = l.Snapshot(t.Context())
			require.NoError(t, err)
			assert.Empty(t, st.Waiters, "the queue entry is withdrawn")
			assert.Empty(t, st.Reservations)
			assert.Len(t, st.Claims, 1, "the holder keeps its GPU")
		})
	}
}

// `nohup gpu-guard-ctl run -- CMD`: a signal the ctl started with ignored
// stays ignored in the command. Caught by the ctl, exec would reset it to
// its default action there (and the ctl would forward it), so that a
// hang-up ended the command nohup was asked to keep.
func TestRunChildKeepsIgnoredSignalsIgnored(t *testing.T) {
	r := startSignalRole(t, false, "ctl-nohup")
	select {
	case <-r.exited:
	case <-time.After(time.Minute):
		t.Fatalf("ctl did not exit:\n%s", r.out.String())
	}
	require.NoError(t, r.err, r.out.String())
	out := r.out.String()
	i := strings.Index(out, "SigIgn:")
	require.GreaterOrEqual(t, i, 0, out)
	line, _, _ := strings.Cut(out[i+len("SigIgn:"):], "\n")
	mask, err := strconv.ParseUint(strings.TrimSpace(line), 16, 64)
	require.NoError(t, err, out)
	assert.NotZero(t, mask&(1<<(uint(syscall.SIGHUP)-1)), "SIGHUP is still ignored in the command: %s", out)
}

// A signal caught while the ticket was being admitted, or between the wait
// and the command's own signal handling, cancels the context runChild gets:
// the command is not started (its ticket is then released by the caller),
// rather than started as if nothing had been asked.
func TestRunChildNotStartedOnceInterrupted(t *testing.T) {
	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(errors.New("interrupt signal received"))
	mark := filepath.Join(t.TempDir(), "ran")
	code, err := runChild(ctx, []string{"touch", mark}, "ticket-x", Env{Stdout: io.Discard, Stderr: io.Discard})
	require.ErrorContains(t, err, "interrupted as the GPUs were claimed, touch not run: interrupt signal received")
	assert.Zero(t, code)
	assert.NoFileExists(t, mark)
}
