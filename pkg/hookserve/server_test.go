// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hookserve

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/syncbuf"
	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

const program = "nri-gpu-guard-hook"

// condTimeout bounds every wait for a condition: a failure, never a pace.
const condTimeout = 30 * time.Second

var gpuUUIDs = []string{
	"GPU-6c1a2f2e-0000-4000-8000-000000000000",
	"GPU-6c1a2f2e-0000-4000-8000-000000000001",
}

// podmanCaps is podman's default capability set (no CAP_MKNOD, no
// CAP_SYS_ADMIN): a spec without capabilities counts as holding every
// one, and so as reaching every GPU.
func podmanCaps() *specs.LinuxCapabilities {
	caps := []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_NET_BIND_SERVICE",
		"CAP_SETFCAP", "CAP_SETGID", "CAP_SETPCAP", "CAP_SETUID", "CAP_SYS_CHROOT"}
	return &specs.LinuxCapabilities{Bounding: caps, Effective: caps, Permitted: caps}
}

// host is a static two-GPU host over a ledger in a temp dir, with a
// configuration file for it.
type host struct {
	t        *testing.T
	base     string
	stateDir string
	cfgPath  string
}

func newHost(t *testing.T) *host {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("the container markers are in " + hook.DefaultMarkerDir + " (root only)")
	}
	base := t.TempDir()
	h := &host{t: t, base: base, stateDir: filepath.Join(base, "state"), cfgPath: filepath.Join(base, "config.toml")}
	var b strings.Builder
	fmt.Fprintf(&b, "version = 1\n[ledger]\ndir = %q\n[devices]\nsource = \"static\"\nproc_root = %q\n", h.stateDir, filepath.Join(base, "no-driver"))
	for i, u := range gpuUUIDs {
		fmt.Fprintf(&b, "[[devices.static]]\nindex = %d\nuuid = %q\nminor = %d\n", i, u, i)
	}
	// runtime_roots = []: the runtimes of the machine the tests run on
	// are not read.
	b.WriteString("[hook]\npoll_interval = \"20ms\"\nwait_timeout = \"10m\"\nruntime_roots = []\n")
	require.NoError(t, os.WriteFile(h.cfgPath, []byte(b.String()), 0o600))
	return h
}

// container starts a process standing for container id's init and writes
// its bundle (config.json with env); it returns the OCI state a runtime
// gives the hook. At the end of the test the process is killed and the
// hook's poststop run for it, which releases what it holds and removes
// the marker create-runtime left.
func (h *host) container(id string, env ...string) []byte {
	h.t.Helper()
	cmd := exec.Command("sleep", "3600")
	require.NoError(h.t, cmd.Start())
	bundle := filepath.Join(h.base, "bundles", id)
	require.NoError(h.t, os.MkdirAll(bundle, 0o700))
	spec, err := json.Marshal(specs.Spec{Version: specs.Version, Process: &specs.Process{Env: append([]string{"PATH=/bin"}, env...), Capabilities: podmanCaps()}})
	require.NoError(h.t, err)
	require.NoError(h.t, os.WriteFile(filepath.Join(bundle, "config.json"), spec, 0o600))
	st, err := json.Marshal(specs.State{Version: specs.Version, ID: id, Status: specs.StateCreated, Pid: cmd.Process.Pid, Bundle: bundle})
	require.NoError(h.t, err)
	h.t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = hook.Main(context.Background(), hook.Invocation{Program: program, Phase: hook.PhasePoststop, Config: h.cfgPath},
			bytes.NewReader(st), io.Discard)
	})
	return st
}

// state reads the ledger as a fresh reader does.
func (h *host) state() ledger.State {
	h.t.Helper()
	l, err := ledger.OpenReadOnly(h.stateDir, ledger.Options{})
	require.NoError(h.t, err)
	st, err := l.Snapshot(context.Background())
	require.NoError(h.t, err)
	return st
}

// holders maps each claimed GPU's UUID to its container.
func (h *host) holders() map[string]string {
	m := map[string]string{}
	for _, c := range h.state().Claims {
		m[c.Device.UUID] = c.Owner.ContainerID
	}
	return m
}

func (h *host) waiterKeys() []string {
	var keys []string
	for _, w := range h.state().Waiters {
		keys = append(keys, w.Key)
	}
	return keys
}

// eventually polls cond until it holds (or fails the test after
// condTimeout): what it waits for is a state, not a pace.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(condTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, condTimeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// syncBuffer is the tests' shared output buffer (internal/syncbuf).
type syncBuffer = syncbuf.Buffer

// served is a running server on a socket of the test's.
type served struct {
	path string
	log  *syncBuffer
	stop func() error // cancels Serve's ctx and returns what it returned
}

// serve runs s (its Log set to a buffer) on a new socket until the test ends
// or stop is called.
func serve(t *testing.T, s *Server) *served {
	t.Helper()
	// A short path: sun_path holds 108 bytes, t.TempDir() may be longer.
	dir, err := os.MkdirTemp("", "hs")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	path := filepath.Join(dir, "hook.sock")
	l, err := Listen(path)
	require.NoError(t, err)
	log := &syncBuffer{}
	s.Log = log
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, l) }()
	var once sync.Once
	var serveErr error
	stop := func() error {
		once.Do(func() {
			cancel()
			serveErr = <-done
		})
		return serveErr
	}
	t.Cleanup(func() { _ = stop() })
	return &served{path: path, log: log, stop: stop}
}

// relay is a test relay's connection, its request sent.
type relay struct {
	t *testing.T
	c *net.UnixConn
}

func (v *served) send(t *testing.T, q Request) *relay {
	t.Helper()
	c := v.dial(t)
	_, err := c.Write(requestBytes(t, q))
	require.NoError(t, err)
	return &relay{t: t, c: c}
}

// dial connects to the server, closing the connection when t ends.
func (v *served) dial(t *testing.T) *net.UnixConn {
	t.Helper()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: v.path, Net: "unix"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	// A bound for a failing test, never a pace: every read of an answer
	// ends by then.
	require.NoError(t, c.SetDeadline(time.Now().Add(condTimeout)))
	return c
}

// requestBytes is q as a relay writes it.
func requestBytes(t *testing.T, q Request) []byte {
	t.Helper()
	b, err := AppendRequest(nil, q)
	require.NoError(t, err)
	return b
}

// ack reads the acknowledgement and, after an 'A', sends the go-ahead, as
// the relay does.
func (r *relay) ack() Ack {
	r.t.Helper()
	a := r.ackOnly()
	if a.Accepted {
		_, err := r.c.Write([]byte{GoAhead})
		require.NoError(r.t, err)
	}
	return a
}

// ackOnly reads the acknowledgement and sends nothing.
func (r *relay) ackOnly() Ack {
	r.t.Helper()
	a, err := ReadAck(r.c)
	require.NoError(r.t, err)
	return a
}

func (r *relay) result() Result {
	r.t.Helper()
	res, err := ReadResult(r.c)
	require.NoError(r.t, err)
	_, err = r.c.Read(make([]byte, 1))
	require.ErrorIs(r.t, err, io.EOF, "the server closes after the result")
	return res
}

// call sends q and returns the answer: the result after an 'A' (then Ack
// is {Accepted: true}), or the 'F' with its reason.
func (v *served) call(t *testing.T, q Request) (Ack, Result) {
	t.Helper()
	r := v.send(t, q)
	a := r.ack()
	if !a.Accepted {
		// Closed: an EOF, or a reset where the server closed without
		// reading the request (the bound of requests in flight).
		_, err := r.c.Read(make([]byte, 1))
		require.True(t, errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET), "the server closes after an 'F': %v", err)
		return a, Result{}
	}
	return a, r.result()
}

// direct runs the same request through hook.Main, as the hook binary would.
func direct(args []string, stdin []byte) Result {
	inv, err := hook.ParseArgs(program, args)
	if err != nil {
		panic(err)
	}
	var stderr bytes.Buffer
	code := hook.Main(context.Background(), inv, bytes.NewReader(stdin), &stderr)
	return Result{Code: code, Stderr: stderr.Bytes()}
}

func TestServeNoGPUAdmitted(t *testing.T) {
	h := newHost(t)
	v := serve(t, New(program, nil))
	ack, res := v.call(t, Request{Args: []string{"create-runtime", "--config", h.cfgPath}, Stdin: h.container("plain")})
	require.True(t, ack.Accepted, ack.Reason)
	require.Equal(t, Result{Code: 0, Stderr: []byte{}}, res)
	require.Empty(t, h.holders())
	require.Empty(t, v.log.String(), "no log line for an answered request")
}

// TestServeClaimConflictRelease: a GPU container is claimed through the
// server; a second one for the same GPU is refused with exactly the exit
// code and stderr the hook binary's path (hook.Main) gives it; poststop
// through the server releases the first.
func TestServeClaimConflictRelease(t *testing.T) {
	h := newHost(t)
	v := serve(t, New(program, nil))
	create := []string{"create-runtime", "--config", h.cfgPath}
	a := h.container("a", "NVIDIA_VISIBLE_DEVICES=0")
	ack, res := v.call(t, Request{Args: create, Stdin: a})
	require.True(t, ack.Accepted, ack.Reason)
	require.Equal(t, 0, res.Code, string(res.Stderr))
	require.Equal(t, map[string]string{gpuUUIDs[0]: "a"}, h.holders())

	b := h.container("b", "NVIDIA_VISIBLE_DEVICES=0")
	_, res = v.call(t, Request{Args: create, Stdin: b})
	want := direct(create, b)
	require.Equal(t, 75, want.Code, string(want.Stderr))
	require.Contains(t, string(want.Stderr), program+": hook create-runtime: ")
	require.Equal(t, want, res, "the server answers as the hook binary does")
	require.Equal(t, map[string]string{gpuUUIDs[0]: "a"}, h.holders())

	// a's processes end; its poststop releases GPU 0.
	var st specs.State
	require.NoError(t, json.Unmarshal(a, &st))
	p, err := os.FindProcess(st.Pid)
	require.NoError(t, err)
	require.NoError(t, p.Kill())
	eventually(t, "a's process to be gone", func() bool { return !isRunning(st.Pid) })
	ack, res = v.call(t, Request{Args: []string{"poststop", "--config", h.cfgPath}, Stdin: a})
	require.True(t, ack.Accepted)
	require.Equal(t, Result{Code: 0, Stderr: []byte{}}, res)
	require.Empty(t, h.holders())
	require.Empty(t, v.log.String())
}

// isRunning reports whether pid is a process that is not a zombie.
func isRunning(pid int) bool {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	end := bytes.LastIndexByte(data, ')')
	return end > 0 && len(data) > end+2 && data[end+2] != 'Z'
}

// TestServeCreateTwiceIsIdempotent: a relay that falls back after 'A' (its
// connection broke before the result) runs the hook again for the same
// container: the second create-runtime admits it again, without a second
// claim and without a refusal.
func TestServeCreateTwiceIsIdempotent(t *testing.T) {
	h := newHost(t)
	v := serve(t, New(program, nil))
	create := Request{Args: []string{"create-runtime", "--config", h.cfgPath}, Stdin: h.container("a", "NVIDIA_VISIBLE_DEVICES=1")}
	for i := range 2 {
		_, res := v.call(t, create)
		require.Equal(t, 0, res.Code, "run %d: %s", i+1, res.Stderr)
	}
	require.Len(t, h.state().Claims, 1)
	require.Equal(t, map[string]string{gpuUUIDs[1]: "a"}, h.holders())
	l, err := ledger.OpenReadOnly(h.stateDir, ledger.Options{})
	require.NoError(t, err)
	recs, err := ledger.ReadAudit(l.AuditPath())
	require.NoError(t, err)
	claims := 0
	for _, r := range recs {
		if r.ContainerID == "a" && r.Op == ledger.OpClaim {
			claims++
		}
	}
	require.Equal(t, 1, claims, "claimed once: %+v", recs)
}

// TestServeConfigFromRelay: the configuration is the one
// $NRI_GPU_GUARD_CONFIG names in what the relay forwarded; the server's own
// environment's is not read.
func TestServeConfigFromRelay(t *testing.T) {
	h := newHost(t)
	bad := filepath.Join(h.base, "bad.toml")
	require.NoError(t, os.WriteFile(bad, []byte("[policy]\non_conflict = \"maybe\"\n"), 0o600))
	t.Setenv(config.EnvPath, bad)
	v := serve(t, New(program, nil))
	_, res := v.call(t, Request{Args: []string{"create-runtime"}, Env: []string{config.EnvPath + "=" + h.cfgPath},
		Stdin: h.container("a", "NVIDIA_VISIBLE_DEVICES=0")})
	require.Equal(t, 0, res.Code, string(res.Stderr))
	require.Equal(t, map[string]string{gpuUUIDs[0]: "a"}, h.holders())

	// And the relay's word is taken for a bad one too.
	t.Setenv(config.EnvPath, h.cfgPath)
	_, res = v.call(t, Request{Args: []string{"create-runtime"}, Env: []string{config.EnvPath + "=" + bad},
		Stdin: h.container("b", "NVIDIA_VISIBLE_DEVICES=1")})
	require.Equal(t, 1, res.Code)
	require.Contains(t, string(res.Stderr), "on_conflict")
}

// TestServeFallsBackOnArgs: whatever hook.ParseArgs does not take is
// answered 'F', with nothing run: the hook binary answers it itself.
func TestServeFallsBackOnArgs(t *testing.T) {
	ran := 0
	s := New(program, nil)
	s.Run = func(context.Context, hook.Invocation, hook.Process, io.Reader, io.Writer) int { ran++; return 0 }
	v := serve(t, s)
	for _, args := range [][]string{
		{"version"}, {"--help"}, {"add-hooks", "/b/config.json"}, {"serve"}, {"prestart"},
		{"create-runtime", "--bogus"}, {"poststop", "x"}, {"poststop", "-h"}, {"create-runtime", "--config"},
	} {
		ack, _ := v.call(t, Request{Args: args})
		require.False(t, ack.Accepted, "%q", args)
		require.Contains(t, ack.Reason, fmt.Sprintf("arguments %q", args))
	}
	require.Zero(t, ran)
	require.Equal(t, 9, strings.Count(v.log.String(), "falls back"), "one log line per fallback: %s", v.log.String())
}

// TestServeFallsBackOnRelativePaths: a runtime runs its hooks in the bundle
// directory, the server runs elsewhere: a configuration or state dir named
// relative to the working directory is left to the hook itself.
func TestServeFallsBackOnRelativePaths(t *testing.T) {
	ran := 0
	s := New(program, nil)
	s.Run = func(context.Context, hook.Invocation, hook.Process, io.Reader, io.Writer) int { ran++; return 0 }
	v := serve(t, s)
	for _, tc := range []struct {
		q    Request
		want string
	}{
		{Request{Args: []string{"create-runtime", "--config", "config.toml"}}, `--config "config.toml" is relative`},
		{Request{Args: []string{"poststop", "-config=./c.toml"}}, `--config "./c.toml" is relative`},
		{Request{Args: []string{"create-runtime", "--state-dir", "state"}}, `--state-dir "state" is relative`},
		{Request{Args: []string{"poststop"}, Env: []string{"NRI_GPU_GUARD_CONFIG=etc/c.toml"}}, `$NRI_GPU_GUARD_CONFIG "etc/c.toml" is relative`},
	} {
		ack, _ := v.call(t, tc.q)
		require.False(t, ack.Accepted, "%q", tc.q.Args)
		require.Contains(t, ack.Reason, tc.want)
	}
	require.Zero(t, ran)
	// Absolute ones are served.
	ack, _ := v.call(t, Request{Args: []string{"poststop", "--config", "/etc/c.toml", "--state-dir", "/var/s"}, Env: []string{"NRI_GPU_GUARD_CONFIG=/x.toml"}})
	require.True(t, ack.Accepted, ack.Reason)
	require.Equal(t, 1, ran)
}

// TestServePassesTheRequest: the runner gets the parsed invocation, the
// peer as the hook process (with the forwarded environment) and the stdin
// bytes; its exit code and stderr are the result.
func TestServePassesTheRequest(t *testing.T) {
	type call struct {
		inv   hook.Invocation
		proc  hook.Process
		stdin string
	}
	calls := make(chan call, 1)
	s := New(program, nil)
	s.Run = func(_ context.Context, inv hook.Invocation, proc hook.Process, stdin io.Reader, stderr io.Writer) int {
		b, _ := io.ReadAll(stdin)
		calls <- call{inv: inv, proc: proc, stdin: string(b)}
		_, _ = io.WriteString(stderr, "one line\n")
		return 77
	}
	v := serve(t, s)
	_, res := v.call(t, Request{Args: []string{"create-runtime", "--wait", "--state-dir", "/s"}, Env: []string{"NRI_GPU_GUARD_CONFIG=/c"}, Stdin: []byte("{}")})
	require.Equal(t, Result{Code: 77, Stderr: []byte("one line\n")}, res)
	c := <-calls
	require.False(t, c.inv.Options.Started.IsZero(), "the start the runtime's hook timeout counts from")
	c.inv.Options.Started = time.Time{}
	require.Equal(t, hook.Invocation{Program: program, Phase: hook.PhaseCreateRuntime, StateDir: "/s", Options: hook.Options{Wait: true}}, c.inv)
	require.Equal(t, hook.Process{Pid: os.Getpid(), Env: []string{"NRI_GPU_GUARD_CONFIG=/c"}}, c.proc, "the peer is the hook process")
	require.Equal(t, "{}", c.stdin)
}

// blockingRunner runs until released (then returns 0) or until its
// context ends (then returns 9, with the cause on stderr); started
// receives one value per run begun.
type blockingRunner struct {
	started chan struct{}
	release chan struct{}
	ended   chan error // the cause, or nil when released
}

func newBlockingRunner() *blockingRunner {
	return &blockingRunner{started: make(chan struct{}, 8), release: make(chan struct{}), ended: make(chan error, 8)}
}

func (b *blockingRunner) run(ctx context.Context, _ hook.Invocation, _ hook.Process, _ io.Reader, stderr io.Writer) int {
	b.started <- struct{}{}
	select {
	case <-b.release:
		b.ended <- nil
		return 0
	case <-ctx.Done():
		b.ended <- context.Cause(ctx)
		_, _ = fmt.Fprintf(stderr, "cancelled: %v\n", context.Cause(ctx))
		return 9
	}
}

func TestServeTooManyInFlight(t *testing.T) {
	br := newBlockingRunner()
	s := New(program, nil)
	s.MaxInFlight = 1
	s.Run = br.run
	v := serve(t, s)
	first := v.send(t, Request{Args: []string{"poststop"}})
	require.True(t, first.ack().Accepted)
	<-br.started
	// Answered without its request being read: the server may have closed
	// before the request is written (EPIPE, which a relay reads as "fall
	// back" too); the 'F' is there to read either way.
	c := v.dial(t)
	if _, err := c.Write(requestBytes(t, Request{Args: []string{"poststop"}})); err != nil {
		require.ErrorIs(t, err, syscall.EPIPE)
	}
	ack, err := ReadAck(c)
	require.NoError(t, err)
	require.False(t, ack.Accepted)
	require.Contains(t, ack.Reason, "1 requests in flight, its bound")
	require.Contains(t, v.log.String(), "1 requests in flight")

	close(br.release)
	require.Equal(t, Result{Code: 0, Stderr: []byte{}}, first.result())
	// The slot is free again once the first handler returned, a moment
	// after its relay read the result.
	eventually(t, "the slot to be free again", func() bool {
		r := v.send(t, Request{Args: []string{"poststop"}})
		if !r.ack().Accepted {
			return false
		}
		require.Equal(t, 0, r.result().Code)
		return true
	})
}

// TestServeStop: stopping lets a run in flight finish within the grace
// (its result is sent), and Serve returns once it has; with no grace left
// the run's context is cancelled and its result still sent.
func TestServeStop(t *testing.T) {
	for _, tc := range []struct {
		name      string
		grace     time.Duration
		wantCode  int
		wantCause string
	}{
		{name: "finishes within the grace", grace: time.Hour, wantCode: 0},
		{name: "cancelled when the grace ends", grace: 0, wantCode: 9, wantCause: "grace for running hooks ended"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			br := newBlockingRunner()
			s := New(program, nil)
			s.Grace = tc.grace
			s.Run = br.run
			v := serve(t, s)
			r := v.send(t, Request{Args: []string{"poststop"}})
			require.True(t, r.ack().Accepted)
			<-br.started
			stopped := make(chan error, 1)
			go func() { stopped <- v.stop() }()
			if tc.wantCause == "" {
				select {
				case err := <-stopped:
					t.Fatalf("Serve returned (%v) while a run was in flight within its grace", err)
				case <-br.started:
					t.Fatal("a second run")
				default:
				}
				close(br.release)
			}
			if tc.wantCause == "" {
				res := r.result()
				require.Equal(t, tc.wantCode, res.Code)
				require.NoError(t, <-stopped)
				require.NoError(t, <-br.ended)
				return
			}
			// A run the stop cancelled gets no answer: its refusal would
			// say the server stopped, not what the hook decides; the
			// relay runs the hook itself.
			_, err := ReadResult(r.c)
			require.ErrorIs(t, err, io.ErrUnexpectedEOF, "no result for a run the stop cancelled")
			require.NoError(t, <-stopped)
			require.ErrorContains(t, <-br.ended, tc.wantCause)
			require.Contains(t, v.log.String(), "the server stopped while its hook ran (exit code 9); closed without an answer")
			_, err = os.Lstat(v.path)
			require.ErrorIs(t, err, os.ErrNotExist, "the socket file goes with the server")
		})
	}
}

// TestServeStopAnswersNewRelaysAtOnce: while a stop's grace runs, a relay
// that connects is answered 'F' at once, also where the listener is a copy
// of a socket that goes on listening when it is closed (systemd's, passed
// to the server: Activated): before, such a relay waited for an accept
// that never came, its whole acknowledgement timeout, before it ran the
// hook itself.
func TestServeStopAnswersNewRelaysAtOnce(t *testing.T) {
	dir, err := os.MkdirTemp("", "hs")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	path := filepath.Join(dir, "hook.sock")
	systemds, err := Listen(path) // the socket unit's copy, open throughout
	require.NoError(t, err)
	t.Cleanup(func() { _ = systemds.Close() })
	f, err := systemds.File()
	require.NoError(t, err)
	fl, err := net.FileListener(f)
	require.NoError(t, err)
	require.NoError(t, f.Close())
	l := fl.(*net.UnixListener)
	l.SetUnlinkOnClose(false)

	br := newBlockingRunner()
	s := New(program, &syncBuffer{})
	s.Grace = time.Hour
	s.Run = br.run
	stopping := make(chan struct{})
	s.stopped = func() { close(stopping) }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, l) }()
	v := &served{path: path}

	r := v.send(t, Request{Args: []string{"poststop"}})
	require.True(t, r.ack().Accepted)
	<-br.started
	cancel()
	<-stopping
	for range 3 {
		c := v.dial(t)
		if _, err := c.Write(requestBytes(t, Request{Args: []string{"poststop"}})); err != nil {
			require.ErrorIs(t, err, syscall.EPIPE) // answered before the request was read
		}
		ack, err := ReadAck(c)
		require.NoError(t, err, "answered, not left in the backlog")
		require.Equal(t, Ack{Reason: "the hook server is stopping"}, ack)
	}
	select {
	case err := <-done:
		t.Fatalf("Serve returned (%v) within the grace of a run in flight", err)
	default:
	}
	close(br.release)
	require.Equal(t, 0, r.result().Code, "the run in flight finished")
	require.NoError(t, <-done)
	require.NoError(t, <-br.ended)
	require.Empty(t, s.Log.(*syncBuffer).String(), "the relays a stop answers are not logged one by one")
}

// TestServeAnswersFallBackWhenStopping: a request read once the server is
// stopping is answered 'F'.
func TestServeAnswersFallBackWhenStopping(t *testing.T) {
	ran := false
	st := &serving{s: New(program, nil), check: peerCheck{procRoot: "/proc", euid: os.Geteuid()}, runCtx: context.Background(),
		run: func(context.Context, hook.Invocation, hook.Process, io.Reader, io.Writer) int { ran = true; return 0 }}
	log := &syncBuffer{}
	st.s.Log = log
	st.stopping.Store(true)
	client, server := socketPair(t)
	done := make(chan struct{})
	go func() { defer close(done); st.handle(server) }()
	b, err := AppendRequest(nil, Request{Args: []string{"poststop"}})
	require.NoError(t, err)
	_, err = client.Write(b)
	require.NoError(t, err)
	ack, err := ReadAck(client)
	require.NoError(t, err)
	require.Equal(t, Ack{Reason: "the hook server is stopping"}, ack)
	<-done
	require.False(t, ran)
	require.Contains(t, log.String(), "falls back: the hook server is stopping")
}

// socketPair is a connected pair of unix stream sockets.
func socketPair(t *testing.T) (client, server *net.UnixConn) {
	t.Helper()
	dir, err := os.MkdirTemp("", "hs")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(dir, "s"), Net: "unix"})
	require.NoError(t, err)
	defer func() { _ = l.Close() }()
	client, err = net.DialUnix("unix", nil, l.Addr().(*net.UnixAddr))
	require.NoError(t, err)
	server, err = l.AcceptUnix()
	require.NoError(t, err)
	t.Cleanup(func() { _ = client.Close(); _ = server.Close() })
	return client, server
}

// TestServeMalformedGetsNoAnswer: a request that does not follow the
// protocol is closed without a byte of answer (the relay falls back).
func TestServeMalformedGetsNoAnswer(t *testing.T) {
	s := New(program, nil)
	s.Run = func(context.Context, hook.Invocation, hook.Process, io.Reader, io.Writer) int { panic("must not run") }
	v := serve(t, s)
	for _, msg := range [][]byte{
		[]byte("GGH2\x01\x00\x00\x00"),
		cat([]byte(Magic), u32(MaxArgs+1)),
	} {
		c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: v.path, Net: "unix"})
		require.NoError(t, err)
		_, err = c.Write(msg)
		require.NoError(t, err)
		got, err := io.ReadAll(c)
		require.NoError(t, err)
		require.Empty(t, got)
		_ = c.Close()
	}
	// A connection closed before a byte (a probe whether a server
	// answers, as Listen makes) is no relay's: nothing is logged.
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: v.path, Net: "unix"})
	require.NoError(t, err)
	require.NoError(t, c.Close())
	require.NoError(t, v.stop(), "Serve returns once every connection is done")
	require.Equal(t, 2, strings.Count(v.log.String(), "closed without an answer"), v.log.String())
	require.Equal(t, 2, strings.Count(v.log.String(), "\n"), v.log.String())
}

// TestServePeerNotServed: a peer the namespace check refuses is answered
// 'F' with the check's reason, and nothing is run (here the check reads a
// proc root of the test's, whose namespaces are files of their own).
func TestServePeerNotServed(t *testing.T) {
	root := t.TempDir()
	for _, p := range []string{"self", fmt.Sprint(os.Getpid())} {
		require.NoError(t, os.MkdirAll(filepath.Join(root, p, "ns"), 0o700))
		for _, ns := range []string{"mnt", "pid", "user", "cgroup"} {
			require.NoError(t, os.WriteFile(filepath.Join(root, p, "ns", ns), nil, 0o600))
		}
	}
	s := New(program, nil)
	s.procRoot = root
	s.Run = func(context.Context, hook.Invocation, hook.Process, io.Reader, io.Writer) int { panic("must not run") }
	v := serve(t, s)
	ack, _ := v.call(t, Request{Args: []string{"poststop"}})
	require.False(t, ack.Accepted)
	require.Contains(t, ack.Reason, "is in another mnt namespace than the server")
	require.Contains(t, v.log.String(), "another mnt namespace")
}

// TestPeerCheck: the uid must be the server's effective uid, the pid
// visible, and every namespace of the list the server's; the time
// namespace only where the server has one; anything unreadable refuses.
func TestPeerCheck(t *testing.T) {
	self := int32(os.Getpid())
	uid := uint32(os.Geteuid())

	// A process in a mount namespace of its own.
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skip("needs unshare(1)")
	}
	other := exec.Command("unshare", "-m", "sleep", "3600")
	require.NoError(t, other.Start())
	t.Cleanup(func() { _ = other.Process.Kill(); _ = other.Wait() })
	otherPid := int32(other.Process.Pid)
	eventually(t, "unshare to enter its mount namespace", func() bool {
		return peerCheck{procRoot: "/proc", euid: int(uid)}.check(&unix.Ucred{Pid: otherPid, Uid: uid}) != nil
	})

	// A proc root without the time namespace for the server: not compared.
	noTime := t.TempDir()
	for _, p := range []string{"self", fmt.Sprint(self)} {
		require.NoError(t, os.MkdirAll(filepath.Join(noTime, p, "ns"), 0o700))
		for _, ns := range []string{"mnt", "pid", "user", "cgroup"} {
			target := filepath.Join("/proc/self/ns", ns)
			require.NoError(t, os.Symlink(target, filepath.Join(noTime, p, "ns", ns)))
		}
		require.NoError(t, os.Symlink("/", filepath.Join(noTime, p, "root")))
	}
	// And one whose peer lacks its cgroup namespace link.
	noCgroup := t.TempDir()
	require.NoError(t, os.CopyFS(noCgroup, os.DirFS(noTime)))
	require.NoError(t, os.Remove(filepath.Join(noCgroup, fmt.Sprint(self), "ns", "cgroup")))
	// And one whose peer runs chrooted (its root another directory).
	chrooted := t.TempDir()
	require.NoError(t, os.CopyFS(chrooted, os.DirFS(noTime)))
	require.NoError(t, os.Remove(filepath.Join(chrooted, fmt.Sprint(self), "root")))
	require.NoError(t, os.Symlink(t.TempDir(), filepath.Join(chrooted, fmt.Sprint(self), "root")))

	for _, tc := range []struct {
		name     string
		procRoot string
		euid     int
		cred     unix.Ucred
		wantErr  string // "" = served
	}{
		{name: "this process", procRoot: "/proc", euid: int(uid), cred: unix.Ucred{Pid: self, Uid: uid}},
		{name: "another uid", procRoot: "/proc", euid: int(uid) + 1000, cred: unix.Ucred{Pid: self, Uid: uid},
			wantErr: fmt.Sprintf("the peer runs as uid %d, the server as uid %d", uid, int(uid)+1000)},
		{name: "pid not visible", procRoot: "/proc", euid: int(uid), cred: unix.Ucred{Pid: 0, Uid: uid}, wantErr: "another pid namespace"},
		{name: "another mount namespace", procRoot: "/proc", euid: int(uid), cred: unix.Ucred{Pid: otherPid, Uid: uid},
			wantErr: fmt.Sprintf("the peer (pid %d) is in another mnt namespace", otherPid)},
		{name: "no time namespace on the server's kernel", procRoot: noTime, euid: int(uid), cred: unix.Ucred{Pid: self, Uid: uid}},
		{name: "peer namespace unreadable", procRoot: noCgroup, euid: int(uid), cred: unix.Ucred{Pid: self, Uid: uid},
			wantErr: "read the peer's cgroup namespace"},
		{name: "another root directory (chroot)", procRoot: chrooted, euid: int(uid), cred: unix.Ucred{Pid: self, Uid: uid},
			wantErr: "has another root directory than the server (chroot)"},
		{name: "peer gone", procRoot: "/proc", euid: int(uid), cred: unix.Ucred{Pid: goneProcess(t), Uid: uid},
			wantErr: "read the peer's mnt namespace"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cred := tc.cred
			err := peerCheck{procRoot: tc.procRoot, euid: tc.euid}.check(&cred)
			if tc.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.wantErr)
		})
	}
}

// goneProcess is the pid of a process that ran and was reaped.
func goneProcess(t *testing.T) int32 {
	t.Helper()
	c := exec.Command("/bin/true")
	require.NoError(t, c.Run())
	return int32(c.ProcessState.Pid())
}

// TestServePeerGoneCancelsWait: a --wait create-runtime queued behind a
// holder is cancelled when its relay hangs up (the runtime killed it): the
// run ends and its queue entry is gone.
func TestServePeerGoneCancelsWait(t *testing.T) {
	h := newHost(t)
	ended := make(chan int, 1)
	s := New(program, nil)
	s.Run = func(ctx context.Context, inv hook.Invocation, proc hook.Process, stdin io.Reader, stderr io.Writer) int {
		code := hook.MainAs(ctx, inv, proc, stdin, stderr)
		ended <- code
		return code
	}
	v := serve(t, s)
	_, res := v.call(t, Request{Args: []string{"create-runtime", "--config", h.cfgPath}, Stdin: h.container("holder", "NVIDIA_VISIBLE_DEVICES=0")})
	require.Equal(t, 0, res.Code, string(res.Stderr))
	<-ended

	w := v.send(t, Request{Args: []string{"create-runtime", "--wait", "--config", h.cfgPath}, Stdin: h.container("w", "NVIDIA_VISIBLE_DEVICES=0")})
	require.True(t, w.ack().Accepted)
	eventually(t, "w to queue", func() bool { return slices.Contains(h.waiterKeys(), "w") })
	select {
	case code := <-ended:
		t.Fatalf("the waiting run ended (%d) while its relay was connected", code)
	default:
	}
	require.NoError(t, w.c.Close())
	select {
	case code := <-ended:
		require.NotZero(t, code, "the cancelled wait refuses the container")
	case <-time.After(condTimeout):
		t.Fatalf("the waiting run did not end within %s of its relay hanging up", condTimeout)
	}
	require.Empty(t, h.waiterKeys(), "its queue entry is gone")
	require.Equal(t, map[string]string{gpuUUIDs[0]: "holder"}, h.holders())
	// The handler logs after the run returned: stopping waits for it.
	require.NoError(t, v.stop())
	require.Contains(t, v.log.String(), "hung up")
}

// TestTailBuffer: a hook's stderr over the bound reaches the relay as its
// last MaxStderr bytes.
func TestTailBuffer(t *testing.T) {
	var tb tailBuffer
	_, _ = tb.Write(bytes.Repeat([]byte("a"), MaxStderr-1))
	_, _ = tb.Write([]byte("bc"))
	require.Len(t, tb.Bytes(), MaxStderr)
	require.True(t, bytes.HasSuffix(tb.Bytes(), []byte("abc")))
	require.Equal(t, byte('a'), tb.Bytes()[0])
}

// openFiles lists the files (by path) this process has open: the test's
// own connections, pipes and process handles are not files and not counted.
func openFiles(t *testing.T) []string {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	var files []string
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		if err == nil && strings.HasPrefix(target, "/") {
			files = append(files, target)
		}
	}
	return files
}

// TestServeLeavesNoFileOpen: the server opens a ledger for every request
// that names a GPU; what the ledger keeps open between transactions (its
// boot marker) is closed with the request, not left for the garbage
// collector: a busy host would run the server out of descriptors first.
func TestServeLeavesNoFileOpen(t *testing.T) {
	h := newHost(t)
	v := serve(t, New(program, nil))
	create := []string{"create-runtime", "--config", h.cfgPath}
	stop := []string{"poststop", "--config", h.cfgPath}
	// One round first: what the process opens once and keeps is not
	// counted.
	round := func(i int) {
		c := h.container(fmt.Sprintf("c%d", i), "NVIDIA_VISIBLE_DEVICES=1")
		_, res := v.call(t, Request{Args: create, Stdin: c})
		require.Equal(t, 0, res.Code, string(res.Stderr))
		var st specs.State
		require.NoError(t, json.Unmarshal(c, &st))
		p, err := os.FindProcess(st.Pid)
		require.NoError(t, err)
		require.NoError(t, p.Kill())
		eventually(t, "the container's process to be gone", func() bool { return !isRunning(st.Pid) })
		_, res = v.call(t, Request{Args: stop, Stdin: c})
		require.Equal(t, 0, res.Code, string(res.Stderr))
	}
	round(0)
	before := openFiles(t)
	for i := 1; i <= 20; i++ {
		round(i)
	}
	require.Empty(t, h.holders())
	require.ElementsMatch(t, before, openFiles(t), "files left open by 20 claim/release requests")
}

// TestServeStopHandsTheWaitOver: a --wait still queued when the stop's
// grace ends gets no answer and keeps its queue entry, so the hook its
// relay runs itself waits on in the same place: here, ahead of a waiter
// that queued after it, it gets the GPU when the holder's claim ends.
func TestServeStopHandsTheWaitOver(t *testing.T) {
	h := newHost(t)
	s := New(program, nil)
	s.Grace = 0
	v := serve(t, s)
	create := []string{"create-runtime", "--wait", "--config", h.cfgPath}
	holder := h.container("holder", "NVIDIA_VISIBLE_DEVICES=0")
	_, res := v.call(t, Request{Args: []string{"create-runtime", "--config", h.cfgPath}, Stdin: holder})
	require.Equal(t, 0, res.Code, string(res.Stderr))

	first := h.container("first", "NVIDIA_VISIBLE_DEVICES=0")
	w := v.send(t, Request{Args: create, Stdin: first})
	require.True(t, w.ack().Accepted)
	eventually(t, "first to queue", func() bool { return slices.Contains(h.waiterKeys(), "first") })
	require.NoError(t, v.stop())
	_, err := ReadResult(w.c)
	require.ErrorIs(t, err, io.ErrUnexpectedEOF, "no answer: the relay runs the hook itself")
	require.Equal(t, []string{"first"}, h.waiterKeys(), "the queue entry is kept for the hook that takes the wait over")
	require.NotContains(t, v.log.String(), "hung up")

	// Another container queues behind it (no --wait: it only queues and
	// is refused; a later one would be admitted only after "first").
	second := h.container("second", "NVIDIA_VISIBLE_DEVICES=0")
	require.Equal(t, 75, direct([]string{"create-runtime", "--config", h.cfgPath}, second).Code)

	// The relay's own hook takes the wait over: the holder goes, and
	// "first" is admitted.
	took := make(chan Result, 1)
	go func() { took <- direct(create, first) }()
	var st specs.State
	require.NoError(t, json.Unmarshal(holder, &st))
	p, err := os.FindProcess(st.Pid)
	require.NoError(t, err)
	require.NoError(t, p.Kill())
	eventually(t, "the holder's process to be gone", func() bool { return !isRunning(st.Pid) })
	require.Equal(t, 0, direct([]string{"poststop", "--config", h.cfgPath}, holder).Code)
	res = testwait.Receive(t, took, "the taken-over wait's answer")
	require.Equal(t, 0, res.Code, string(res.Stderr))
	require.Equal(t, map[string]string{gpuUUIDs[0]: "first"}, h.holders())
}

// TestPeerCheckReadsItsOwnOnce: the server's own namespaces and root, read
// at its start, decide as a read at each check does.
func TestPeerCheckReadsItsOwnOnce(t *testing.T) {
	uid := uint32(os.Geteuid())
	c := newPeerCheck("/proc", int(uid))
	require.Len(t, c.own, len(peerFiles())-map[bool]int{true: 0, false: 1}[hasTimeNS(c.own)])
	require.NoError(t, c.check(&unix.Ucred{Pid: int32(os.Getpid()), Uid: uid}))
	other := exec.Command("unshare", "-m", "sleep", "3600")
	require.NoError(t, other.Start())
	t.Cleanup(func() { _ = other.Process.Kill(); _ = other.Wait() })
	eventually(t, "unshare to enter its mount namespace", func() bool {
		return c.check(&unix.Ucred{Pid: int32(other.Process.Pid), Uid: uid}) != nil
	})
	require.ErrorContains(t, c.check(&unix.Ucred{Pid: int32(other.Process.Pid), Uid: uid}), "in another mnt namespace")
}

// TestServeRunsOnlyAfterTheGoAhead: after its 'A' the server runs nothing
// until the relay's 'G'. A relay whose ack timeout ended before the 'A' came
// runs the hook itself and closes (its exec closes the socket): the server
// must not run the same request a second time. Under protocol version 1 it
// did, and the twin's cancellation could take a waiting hook's queue place.
func TestServeRunsOnlyAfterTheGoAhead(t *testing.T) {
	for _, tc := range []struct {
		name    string
		after   func(t *testing.T, c *net.UnixConn) // what the relay does after the 'A'
		timeout time.Duration                       // Server.ReadTimeout; 0: the default
		wantLog string
	}{
		{name: "closed after the A (the relay fell back)", after: func(t *testing.T, c *net.UnixConn) {
			require.NoError(t, c.CloseWrite())
		}, wantLog: "no go-ahead after the acknowledgement (EOF); nothing ran, the relay runs the hook itself"},
		{name: "another byte than G", after: func(t *testing.T, c *net.UnixConn) {
			_, err := c.Write([]byte{'A'})
			require.NoError(t, err)
		}, wantLog: `go-ahead: 'A' is not 'G'`},
		{name: "nothing within the read timeout", after: func(*testing.T, *net.UnixConn) {},
			timeout: 200 * time.Millisecond, wantLog: "i/o timeout"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var runs atomic.Int32
			s := New(program, nil)
			s.Run = func(context.Context, hook.Invocation, hook.Process, io.Reader, io.Writer) int { runs.Add(1); return 0 }
			if tc.timeout > 0 {
				s.ReadTimeout = tc.timeout
			}
			v := serve(t, s)
			r := v.send(t, Request{Args: []string{"poststop"}})
			require.True(t, r.ackOnly().Accepted)
			tc.after(t, r.c)
			// The server closes without a result; it logged before it
			// closed, and a run would have come before either.
			rest, err := io.ReadAll(r.c)
			require.NoError(t, err)
			require.Empty(t, rest, "no result without a go-ahead")
			require.Zero(t, runs.Load(), "the hook ran without the relay's go-ahead")
			require.Contains(t, v.log.String(), tc.wantLog)
		})
	}

	t.Run("the go-ahead sent with the request", func(t *testing.T) {
		// A relay of this protocol sends nothing after its request before
		// the 'A': bytes already there are not one.
		var runs atomic.Int32
		s := New(program, nil)
		s.Run = func(context.Context, hook.Invocation, hook.Process, io.Reader, io.Writer) int { runs.Add(1); return 0 }
		v := serve(t, s)
		c := v.dial(t)
		_, err := c.Write(append(requestBytes(t, Request{Args: []string{"poststop"}}), GoAhead))
		require.NoError(t, err)
		rest, err := io.ReadAll(c)
		require.NoError(t, err)
		require.Empty(t, rest, "closed without an answer")
		require.Zero(t, runs.Load())
		require.Contains(t, v.log.String(), "1 bytes after its request, before the acknowledgement; closed without an answer")
	})

	t.Run("G runs it", func(t *testing.T) {
		var runs atomic.Int32
		s := New(program, nil)
		s.Run = func(context.Context, hook.Invocation, hook.Process, io.Reader, io.Writer) int { runs.Add(1); return 5 }
		v := serve(t, s)
		ack, res := v.call(t, Request{Args: []string{"poststop"}})
		require.True(t, ack.Accepted)
		require.Equal(t, 5, res.Code)
		require.Equal(t, int32(1), runs.Load())
	})
}
