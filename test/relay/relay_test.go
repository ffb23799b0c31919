// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package relay_test holds the conformance tests of the C hook relay
// (cmd/nri-gpu-guard-hook-relay/relay.c) against protocol version 2
// (the "GGH2" request, acknowledgement, go-ahead and result).
//
// They build relay.c with cc exactly as `make build` does and run the real
// binary against a fake server written here (a unix listener in a temp dir),
// with a fake Go hook written in C as the fallback target: it records its pid,
// its argv (argv[0] included, which a #! script cannot see), its stdin, the
// fds it inherited and what fd 0 is, then exits with a chosen code. They
// prove that:
//   - on a result, the server got exactly the forwarded arguments (never the
//     relay's own options), exactly NRI_GPU_GUARD_CONFIG of the environment
//     (when set), exactly the stdin bytes (at most 1 MiB + 1), from the relay's
//     own pid; after the 'A' the relay sent the go-ahead 'G' and nothing
//     else; it writes the result's stderr bytes as they are and exits with
//     its code, and no hook runs;
//   - in every fallback case of the protocol (connect failing, the request not
//     sent, no, a late, a malformed (a version 1 server's included) or an 'F'
//     acknowledgement, a connection ending before the whole result) the fake
//     hook runs in the relay's
//     process (same pid: exec, never fork) with argv ["nri-gpu-guard-hook",
//     forwarded args...], with fd 0 a memfd holding exactly the bytes the
//     relay read, with no fd besides what it gets when started directly, and
//     its exit code and stderr are the relay's; where the server saw the
//     relay give up (no acknowledgement, or a bad one), the relay sent it no
//     go-ahead: the server never runs a request its relay runs itself;
//   - a fallback decided before stdin is read (no phase argument, arguments
//     or environment over the protocol's bounds, a bad option value) does not
//     connect at all and leaves fd 0 untouched;
//   - an exec failure is one line naming the hook path and exit 1.
//
// Nothing sleeps to synchronise and nothing asserts a duration: a case that
// expects the relay to give up after its ack timeout runs it with
// --relay-ack-timeout-ms=100 and asserts only that it fell back. Whether the
// relay connected is known without waiting: after it has exited, the test
// connects a sentinel of its own; unix connections queue in order, so the fake
// server accepts the relay's first if there was one.
package relay_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

const (
	maxStdin  = 1<<20 + 1
	maxStderr = 65536
	// runGuard only stops a hung relay so that the test fails instead of
	// waiting for go test's timeout; no assertion depends on it.
	runGuard = time.Minute
)

// Built once by TestMain.
var (
	buildDir    string
	relayBin    string // relay.c as `make build` builds it
	defaultsBin string // the same with the default hook and socket in buildDir
	defaultSock string // defaultsBin's default socket
	fakeHook    string
	skipReason  string
)

// fakeHookC is the fallback target: the stand-in for nri-gpu-guard-hook. It
// lists its fds before it opens anything, writes its records into
// $FAKE_HOOK_DIR ("pid" last: the proof that it ran to the end), writes one
// line to stderr and exits with $FAKE_HOOK_EXIT.
const fakeHookC = `
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char in[4 << 20];

static void put(const char *dir, const char *name, const char *p, size_t n)
{
	char path[4096];
	int fd;

	snprintf(path, sizeof path, "%s/%s", dir, name);
	fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		_exit(90);
	while (n > 0) {
		ssize_t w = write(fd, p, n);
		if (w < 0)
			_exit(91);
		p += w;
		n -= (size_t)w;
	}
	close(fd);
}

int main(int argc, char **argv)
{
	const char *dir = getenv("FAKE_HOOK_DIR"), *code = getenv("FAKE_HOOK_EXIT");
	char buf[8192];
	size_t n = 0;
	ssize_t l;
	DIR *d;
	struct dirent *e;
	int i;

	if (dir == NULL)
		return 92;
	d = opendir("/proc/self/fd");
	if (d == NULL)
		return 93;
	while ((e = readdir(d)) != NULL) {
		if (e->d_name[0] == '.' || atoi(e->d_name) == dirfd(d))
			continue;
		n += (size_t)snprintf(buf + n, sizeof buf - n, "%s\n", e->d_name);
	}
	closedir(d);
	put(dir, "fds", buf, n);
	l = readlink("/proc/self/fd/0", buf, sizeof buf);
	put(dir, "fd0", buf, l < 0 ? 0 : (size_t)l);
	for (n = 0, i = 0; i < argc; i++) {
		size_t k = strlen(argv[i]) + 1;
		if (n + k > sizeof in)
			return 94;
		memcpy(in + n, argv[i], k);
		n += k;
	}
	put(dir, "argv", in, n);
	for (n = 0;;) {
		ssize_t r = read(0, in + n, sizeof in - n);
		if (r == 0)
			break;
		if (r < 0)
			return 95;
		n += (size_t)r;
	}
	put(dir, "stdin", in, n);
	n = (size_t)snprintf(buf, sizeof buf, "%d", (int)getpid());
	put(dir, "pid", buf, n);
	fputs("fake hook: done\n", stderr);
	return code ? atoi(code) : 0;
}
`

func TestMain(m *testing.M) {
	os.Exit(testMain(m))
}

func testMain(m *testing.M) int {
	cc, err := exec.LookPath("cc")
	if err != nil {
		skipReason = "no C compiler (cc) on PATH: the relay cannot be built"
		return m.Run()
	}
	// The relay with the compiler `make build` uses: RELAY_CC, else
	// musl-gcc where installed, else cc (the fake hook always with cc).
	relayCC := cc
	if v := os.Getenv("RELAY_CC"); v != "" {
		relayCC = v
	} else if p, err := exec.LookPath("musl-gcc"); err == nil {
		relayCC = p
	}
	// Short: defaultSock must fit a sockaddr_un.
	buildDir, err = os.MkdirTemp("", "ggr-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer func() { _ = os.RemoveAll(buildDir) }()
	src, err := filepath.Abs("../../cmd/nri-gpu-guard-hook-relay/relay.c")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	relayBin = filepath.Join(buildDir, "nri-gpu-guard-hook-relay")
	defaultsBin = filepath.Join(buildDir, "relay-defaults")
	defaultSock = filepath.Join(buildDir, "d.sock")
	fakeHook = filepath.Join(buildDir, "fake-hook")
	hookSrc := filepath.Join(buildDir, "fake-hook.c")
	if err := os.WriteFile(hookSrc, []byte(fakeHookC), 0o600); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	flags := []string{"-O2", "-static", "-Wall", "-Wextra", "-Werror"}
	builds := []struct {
		cc   string
		args []string
	}{
		{relayCC, append(slices.Clone(flags), "-o", relayBin, src)},
		{relayCC, append(slices.Clone(flags), "-DRELAY_DEFAULT_HOOK=\""+fakeHook+"\"",
			"-DRELAY_DEFAULT_SOCKET=\""+defaultSock+"\"", "-o", defaultsBin, src)},
		{cc, []string{"-O2", "-Wall", "-o", fakeHook, hookSrc}},
	}
	for _, b := range builds {
		if out, err := exec.Command(b.cc, b.args...).CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "%s %s: %v\n%s", b.cc, strings.Join(b.args, " "), err, out)
			return 1
		}
	}
	return m.Run()
}

func needRelay(t *testing.T) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}

// request is protocol version 2's request as the fake server reads it.
type request struct {
	args  []string
	env   []string
	stdin []byte
}

func readU32(r io.Reader) (uint32, error) {
	var b [4]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint32(b[:]), nil
}

func readBytes(r io.Reader, limit uint32, what string) ([]byte, error) {
	n, err := readU32(r)
	if err != nil {
		return nil, err
	}
	if n > limit {
		return nil, fmt.Errorf("%s: %d bytes, over %d", what, n, limit)
	}
	b := make([]byte, n)
	_, err = io.ReadFull(r, b)
	return b, err
}

// readRequest reads exactly one request and checks it against the bounds.
func readRequest(r io.Reader) (*request, error) {
	br := bufio.NewReader(r)
	magic := make([]byte, 4)
	if _, err := io.ReadFull(br, magic); err != nil {
		return nil, err
	}
	if string(magic) != "GGH2" {
		return nil, fmt.Errorf("magic %q", magic)
	}
	req := &request{}
	argc, err := readU32(br)
	if err != nil {
		return nil, err
	}
	if argc < 1 || argc > 32 {
		return nil, fmt.Errorf("argc %d", argc)
	}
	for range argc {
		a, err := readBytes(br, 4096, "arg")
		if err != nil {
			return nil, err
		}
		req.args = append(req.args, string(a))
	}
	envc, err := readU32(br)
	if err != nil {
		return nil, err
	}
	if envc > 8 {
		return nil, fmt.Errorf("envc %d", envc)
	}
	for range envc {
		e, err := readBytes(br, 8192, "env")
		if err != nil {
			return nil, err
		}
		req.env = append(req.env, string(e))
	}
	if req.stdin, err = readBytes(br, maxStdin, "stdin"); err != nil {
		return nil, err
	}
	if br.Buffered() != 0 {
		return nil, fmt.Errorf("%d bytes after the request", br.Buffered())
	}
	return req, nil
}

func ack(b byte) []byte { return []byte{'G', 'G', 'H', '2', b} }

func u32(v uint32) []byte { return binary.LittleEndian.AppendUint32(nil, v) }

func result(code uint32, stderr []byte) []byte {
	out := append(ack('A'), 'R')
	out = append(out, u32(code)...)
	out = append(out, u32(uint32(len(stderr)))...)
	return append(out, stderr...)
}

// behaviour is what the fake server does with the relay's connection once it
// has read the request (req is nil when readReq is false); relayDone is
// closed when the relay process has exited. It returns what it read of the
// relay after the request, where it reads at all (nil where it does not).
type behaviour func(c *net.UnixConn, req *request, relayDone <-chan struct{}) (after []byte)

type serverCase struct {
	readReq bool
	act     behaviour
}

// reply writes b and closes.
func reply(b []byte) serverCase {
	return serverCase{readReq: true, act: func(c *net.UnixConn, _ *request, _ <-chan struct{}) []byte {
		_, _ = c.Write(b)
		return nil
	}}
}

// replyAndHold writes b, then keeps the connection open until the relay
// closes it (its exec does) and returns what the relay sent meanwhile.
func replyAndHold(b []byte, readReq bool) serverCase {
	return serverCase{readReq: readReq, act: func(c *net.UnixConn, _ *request, _ <-chan struct{}) []byte {
		_, _ = c.Write(b)
		after, _ := io.ReadAll(c)
		return after
	}}
}

// answer is a server of this protocol: it writes the acknowledgement (the
// first 5 bytes of res), reads the relay's go-ahead, writes the rest of res
// (one byte a write when trickle is set: the relay sees the result in
// pieces, as far as the scheduler lets it), then reads until the relay
// closes. It returns every byte the relay sent after its request.
func answer(res []byte, trickle bool) serverCase {
	return serverCase{readReq: true, act: func(c *net.UnixConn, _ *request, _ <-chan struct{}) []byte {
		write := func(b []byte) bool {
			if !trickle {
				_, err := c.Write(b)
				return err == nil
			}
			for i := range b {
				if _, err := c.Write(b[i : i+1]); err != nil {
					return false
				}
			}
			return true
		}
		if !write(res[:5]) {
			return nil
		}
		goAhead := make([]byte, 1)
		if _, err := io.ReadFull(c, goAhead); err != nil {
			return nil
		}
		write(res[5:])
		rest, _ := io.ReadAll(c)
		return append(goAhead, rest...)
	}}
}

// served is what the fake server saw of the first connection it accepted.
type served struct {
	relay   bool // from another process than this test's (its sentinel)
	peerPid int32
	req     *request
	after   []byte // what the behaviour read after the request
	err     error
}

type fakeServer struct {
	path string
	ln   *net.UnixListener
	got  chan served
	done chan struct{}
}

func peerPid(c *net.UnixConn) (int32, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, err
	}
	if credErr != nil {
		return 0, credErr
	}
	return cred.Pid, nil
}

// startServer listens on path and serves the first connection with sc.
func startServer(t *testing.T, path string, sc serverCase) *fakeServer {
	t.Helper()
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	s := &fakeServer{path: path, ln: ln, got: make(chan served, 1), done: make(chan struct{})}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		s.got <- s.serveOne(sc)
	}()
	return s
}

func (s *fakeServer) serveOne(sc serverCase) served {
	c, err := s.ln.AcceptUnix()
	if err != nil {
		return served{err: err}
	}
	defer func() { _ = c.Close() }()
	pid, err := peerPid(c)
	if err != nil {
		return served{err: err}
	}
	if int(pid) == os.Getpid() {
		return served{}
	}
	sv := served{relay: true, peerPid: pid}
	if sc.readReq {
		if sv.req, sv.err = readRequest(c); sv.err != nil {
			return sv
		}
	}
	sv.after = sc.act(c, sv.req, s.done)
	return sv
}

// finish is called once the relay has exited: it releases a holding
// behaviour, then tells what the server saw, and that the relay made no
// second connection.
func (s *fakeServer) finish(t *testing.T) served {
	t.Helper()
	close(s.done)
	sentinel, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: s.path, Net: "unix"})
	require.NoError(t, err)
	defer func() { _ = sentinel.Close() }()
	sv := <-s.got
	if sv.relay {
		// The sentinel is next in the queue; nothing else may be.
		for {
			c, err := s.ln.AcceptUnix()
			require.NoError(t, err)
			pid, err := peerPid(c)
			_ = c.Close()
			require.NoError(t, err)
			if int(pid) == os.Getpid() {
				break
			}
			t.Errorf("the relay connected more than once (pid %d)", pid)
		}
	}
	return sv
}

// outcome is one run of a relay binary.
type outcome struct {
	pid    int
	code   int
	stderr []byte
	hook   *hookRecord // nil when the fake hook did not run
}

type hookRecord struct {
	pid   int
	argv  []string
	stdin []byte
	fds   []string
	fd0   string
}

type runOpts struct {
	bin      string // relayBin when empty
	args     []string
	config   *string // NRI_GPU_GUARD_CONFIG, unset when nil
	stdin    []byte
	hookExit int
}

func baseEnv(hookDir string, hookExit int) []string {
	return []string{
		"PATH=/usr/bin:/bin",
		"FAKE_HOOK_DIR=" + hookDir,
		"FAKE_HOOK_EXIT=" + strconv.Itoa(hookExit),
		"OTHER_SETTING=not-forwarded",
		"NRI_GPU_GUARD_CONFIGX=not-forwarded-either",
	}
}

func runRelay(t *testing.T, o runOpts) outcome {
	t.Helper()
	hookDir := t.TempDir()
	bin := o.bin
	if bin == "" {
		bin = relayBin
	}
	ctx, cancel := context.WithTimeout(context.Background(), runGuard)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, o.args...)
	cmd.Args[0] = "nri-gpu-guard-hook-relay"
	cmd.Env = baseEnv(hookDir, o.hookExit)
	if o.config != nil {
		cmd.Env = append(cmd.Env, "NRI_GPU_GUARD_CONFIG="+*o.config)
	}
	// A pipe, as runtimes give hooks.
	cmd.Stdin = bytes.NewReader(o.stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	err := cmd.Wait()
	// A relay that read 1 MiB + 1 of more leaves the rest unwritten:
	// exec.Cmd drops that EPIPE, and an exit code above 0 hides it.
	var exitErr *exec.ExitError
	if !errors.As(err, &exitErr) {
		require.NoError(t, err)
	}
	require.NoError(t, ctx.Err(), "the relay hung")
	out := outcome{pid: cmd.Process.Pid, code: cmd.ProcessState.ExitCode(), stderr: stderr.Bytes()}
	out.hook = readHookRecord(t, hookDir)
	return out
}

func readHookRecord(t *testing.T, dir string) *hookRecord {
	t.Helper()
	pid, err := os.ReadFile(filepath.Join(dir, "pid"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	require.NoError(t, err)
	rec := &hookRecord{}
	rec.pid, err = strconv.Atoi(string(pid))
	require.NoError(t, err)
	read := func(name string) []byte {
		b, err := os.ReadFile(filepath.Join(dir, name))
		require.NoError(t, err)
		return b
	}
	rec.argv = strings.Split(strings.TrimSuffix(string(read("argv")), "\x00"), "\x00")
	rec.stdin = read("stdin")
	rec.fds = strings.Fields(string(read("fds")))
	slices.Sort(rec.fds)
	rec.fd0 = string(read("fd0"))
	return rec
}

// directFds is what the fake hook inherits when started directly with a
// pipe as stdin, as the relay is: the fds the relay may hand on, no more.
func directFds(t *testing.T) []string {
	t.Helper()
	dir := t.TempDir()
	cmd := exec.Command(fakeHook, "direct")
	cmd.Env = baseEnv(dir, 0)
	cmd.Stdin = strings.NewReader("x")
	require.NoError(t, cmd.Run())
	rec := readHookRecord(t, dir)
	require.NotNil(t, rec)
	// 0, 1 and 2, plus whatever this test process inherited without
	// close-on-exec (exec.Cmd passes such fds on).
	require.Subset(t, rec.fds, []string{"0", "1", "2"})
	return rec.fds
}

func pattern(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		// Not a multiple of any buffer size; NULs and newlines included.
		b[i] = byte(i*7 + i/251)
	}
	return b
}

// stdinSizes are the stdin lengths every fallback is tried with.
var stdinSizes = []int{0, 37, 200 << 10, maxStdin + 4}

func capped(b []byte) []byte { return b[:min(len(b), maxStdin)] }

func ptr(s string) *string { return &s }

// shortDir is a temp dir whose socket paths fit a sockaddr_un (t.TempDir's
// can be too long with subtest names).
func shortDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("", "ggr-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(d) })
	return d
}

// assertFallback checks that the fake hook replaced the relay: same pid,
// argv, stdin (replayed through a memfd when the relay read it, the original
// pipe otherwise), no extra fd, and its exit code and stderr are the relay's.
func assertFallback(t *testing.T, out outcome, fwd []string, stdin []byte, replayed bool, fds []string, hookExit int) {
	t.Helper()
	require.NotNil(t, out.hook, "the fake hook did not run; relay stderr %q", out.stderr)
	assert.Equal(t, out.pid, out.hook.pid, "the hook must replace the relay (exec), not run in a child")
	assert.Equal(t, append([]string{"nri-gpu-guard-hook"}, fwd...), out.hook.argv)
	assert.True(t, bytes.Equal(stdin, out.hook.stdin), "the hook's stdin: %d bytes, want these %d", len(out.hook.stdin), len(stdin))
	if replayed {
		assert.True(t, strings.HasPrefix(out.hook.fd0, "/memfd:"), "fd 0 is %q, want the memfd", out.hook.fd0)
	} else {
		assert.True(t, strings.HasPrefix(out.hook.fd0, "pipe:"), "fd 0 is %q, want the original pipe", out.hook.fd0)
	}
	assert.Equal(t, fds, out.hook.fds, "fds the hook inherited")
	assert.Equal(t, hookExit, out.code, "exit code")
	assert.Equal(t, "fake hook: done\n", string(out.stderr), "stderr")
}

var exitCodes = []int{0, 1, 75, 77, 255}

// TestRelayResult: the server's result is the relay's, and the server got
// exactly what the protocol says.
func TestRelayResult(t *testing.T) {
	needRelay(t)
	big := pattern(maxStdin + 4)
	longArgs := []string{"create-runtime"}
	for i := 1; i < 32; i++ {
		longArgs = append(longArgs, strings.Repeat(string(rune('a'+i%26)), 4096-i%2))
	}
	cases := []struct {
		name    string
		args    []string // after the socket and hook options
		fwd     []string
		config  *string
		stdin   []byte
		code    uint32
		stderr  []byte
		trickle bool
	}{
		{name: "create-runtime", args: []string{"create-runtime"}, fwd: []string{"create-runtime"},
			stdin: []byte(`{"id":"c1"}`), code: 0},
		{name: "refusal on stderr, config set", args: []string{"create-runtime", "--wait"}, fwd: []string{"create-runtime", "--wait"},
			config: ptr("/etc/nri-gpu-guard/config.toml"), stdin: pattern(4000), code: 1, stderr: []byte("nri-gpu-guard: refused: GPU 0 is held\n")},
		{name: "config set but empty", args: []string{"poststop"}, fwd: []string{"poststop"},
			config: ptr(""), stdin: nil, code: 75, stderr: []byte("a\x00b\nno newline")},
		{name: "relay options before, the same spelled after are forwarded",
			args:  []string{"--relay-ack-timeout-ms=60000", "poststop", "--relay-socket=/x", "--relay-hook=/y", ""},
			fwd:   []string{"poststop", "--relay-socket=/x", "--relay-hook=/y", ""},
			stdin: pattern(200 << 10), code: 77, stderr: pattern(maxStderr)},
		{name: "stdin over 1 MiB is cut at 1 MiB + 1", args: []string{"create-runtime"}, fwd: []string{"create-runtime"},
			config: ptr(strings.Repeat("c", 8192-len("NRI_GPU_GUARD_CONFIG="))), stdin: big, code: 255, stderr: []byte("x")},
		{name: "32 arguments up to 4096 bytes", args: longArgs, fwd: longArgs, stdin: []byte("{}"), code: 0, stderr: []byte("ok\n"), trickle: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sock := filepath.Join(shortDir(t), "s")
			srv := startServer(t, sock, answer(result(tc.code, tc.stderr), tc.trickle))
			args := append([]string{"--relay-socket=" + sock, "--relay-hook=" + fakeHook, "--relay-ack-timeout-ms=60000"}, tc.args...)
			out := runRelay(t, runOpts{args: args, config: tc.config, stdin: tc.stdin, hookExit: 3})
			sv := srv.finish(t)

			require.NoError(t, sv.err)
			require.True(t, sv.relay, "the relay did not connect")
			assert.Equal(t, int32(out.pid), sv.peerPid, "the peer is the relay process itself")
			assert.Equal(t, tc.fwd, sv.req.args)
			if tc.config == nil {
				assert.Empty(t, sv.req.env)
			} else {
				assert.Equal(t, []string{"NRI_GPU_GUARD_CONFIG=" + *tc.config}, sv.req.env)
			}
			assert.True(t, bytes.Equal(capped(tc.stdin), sv.req.stdin), "stdin: server got %d bytes, want %d", len(sv.req.stdin), len(capped(tc.stdin)))
			assert.Equal(t, "G", string(sv.after), "what the relay sent after its request: the go-ahead alone")
			assert.Nil(t, out.hook, "the hook ran although the server answered")
			assert.Equal(t, int(tc.code), out.code, "exit code")
			assert.True(t, bytes.Equal(tc.stderr, out.stderr), "stderr: got %d bytes %.80q, want %d bytes", len(out.stderr), out.stderr, len(tc.stderr))
		})
	}
}

// TestRelayFallsBack: each way the server can fail to answer ends in the
// hook, exec'd with the same arguments and stdin.
func TestRelayFallsBack(t *testing.T) {
	needRelay(t)
	fds := directFds(t)
	cases := []struct {
		name string
		// sc: the server; none when nil. socketFile, without sc: a
		// socket file with no listener.
		sc         *serverCase
		socketFile bool
		longPath   bool
		timeout    string // --relay-ack-timeout-ms
	}{
		{name: "no socket file"},
		{name: "socket file without a listener", socketFile: true},
		{name: "socket path too long", longPath: true},
		{name: "server closes without reading", sc: &serverCase{act: func(*net.UnixConn, *request, <-chan struct{}) []byte { return nil }}},
		{name: "server never reads", sc: &serverCase{act: func(_ *net.UnixConn, _ *request, done <-chan struct{}) []byte { <-done; return nil }}, timeout: "100"},
		{name: "EOF before the ack", sc: ptrTo(reply(nil))},
		{name: "ack timeout", sc: ptrTo(replyAndHold(nil, true)), timeout: "100"},
		{name: "ack cut short, then silence", sc: ptrTo(replyAndHold([]byte("GGH1"), true)), timeout: "100"},
		{name: "ack cut short, then EOF", sc: ptrTo(reply([]byte("GGH")))},
		{name: "F with a reason", sc: ptrTo(reply(append(append(ack('F'), u32(6)...), "busy.."...)))},
		{name: "F, reason never sent", sc: ptrTo(replyAndHold(ack('F'), true))},
		{name: "F, then what looks like a result", sc: ptrTo(reply(append(ack('F'), result(0, nil)[5:]...)))},
		{name: "wrong magic", sc: ptrTo(reply(append([]byte("GGHXA"), result(0, nil)[5:]...)))},
		{name: "a version 1 server's accept, held", sc: ptrTo(replyAndHold([]byte("GGH1A"), true))},
		{name: "unknown ack", sc: ptrTo(reply(append(ack('X'), result(0, nil)[5:]...)))},
		{name: "EOF after A", sc: ptrTo(reply(ack('A')))},
		{name: "result header cut short", sc: ptrTo(reply(result(0, nil)[:9]))},
		{name: "result stderr cut short", sc: ptrTo(reply(result(0, []byte("0123456789"))[:17]))},
		{name: "result tag not R", sc: ptrTo(reply(append(ack('A'), append([]byte{'X'}, result(0, nil)[6:]...)...)))},
		{name: "exit code over 255", sc: ptrTo(reply(result(256, nil)))},
		{name: "stderr over 64 KiB", sc: ptrTo(reply(result(0, make([]byte, maxStderr+1))))},
	}
	n := 0
	for _, tc := range cases {
		for _, size := range stdinSizes {
			hookExit := exitCodes[n%len(exitCodes)]
			n++
			t.Run(fmt.Sprintf("%s/stdin=%d", tc.name, size), func(t *testing.T) {
				dir := shortDir(t)
				sock := filepath.Join(dir, "s")
				if tc.longPath {
					sock = filepath.Join(dir, strings.Repeat("l", 120))
				}
				var srv *fakeServer
				switch {
				case tc.sc != nil:
					srv = startServer(t, sock, *tc.sc)
				case tc.socketFile:
					ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
					require.NoError(t, err)
					ln.SetUnlinkOnClose(false)
					require.NoError(t, ln.Close())
				}
				args := []string{"--relay-socket=" + sock, "--relay-hook=" + fakeHook}
				if tc.timeout != "" {
					args = append(args, "--relay-ack-timeout-ms="+tc.timeout)
				}
				fwd := []string{"create-runtime", "--wait"}
				if size%2 == 1 {
					fwd = []string{"poststop"}
				}
				stdin := pattern(size)
				out := runRelay(t, runOpts{args: append(args, fwd...), config: ptr("/c.toml"), stdin: stdin, hookExit: hookExit})
				if srv != nil {
					sv := srv.finish(t)
					assert.True(t, sv.relay, "the relay did not connect")
					if tc.sc.readReq {
						require.NoError(t, sv.err)
						assert.True(t, bytes.Equal(capped(stdin), sv.req.stdin), "the server's stdin")
					}
					// A server that held the connection saw all the relay
					// sent: never a go-ahead, since the relay ran the hook.
					assert.Empty(t, sv.after, "the relay sent %q after its request and fell back", sv.after)
				}
				assertFallback(t, out, fwd, capped(stdin), true, fds, hookExit)
			})
		}
	}
}

func ptrTo[T any](v T) *T { return &v }

// TestRelayFallsBackAtOnce: what the relay cannot or must not send goes to
// the hook without a connection, with fd 0 untouched (all of it, even over
// 1 MiB: the hook reads what it would have read had hooks.d named it).
func TestRelayFallsBackAtOnce(t *testing.T) {
	needRelay(t)
	fds := directFds(t)
	over := make([]string, 33)
	for i := range over {
		over[i] = "a"
	}
	over[0] = "create-runtime"
	cases := []struct {
		name   string
		opts   []string // relay options after the socket and hook
		fwd    []string
		config *string
	}{
		{name: "no arguments"},
		{name: "version", fwd: []string{"version"}},
		{name: "flag first", fwd: []string{"--wait", "create-runtime"}},
		{name: "phase in other case", fwd: []string{"Create-Runtime"}},
		{name: "unknown relay option is forwarded", fwd: []string{"--relay-other=1", "create-runtime"}},
		{name: "relay option without a value is forwarded", fwd: []string{"--relay-socket", "create-runtime"}},
		{name: "bad ack timeout", opts: []string{"--relay-ack-timeout-ms=1x"}, fwd: []string{"create-runtime"}},
		{name: "zero ack timeout", opts: []string{"--relay-ack-timeout-ms=0"}, fwd: []string{"create-runtime"}},
		{name: "33 arguments", fwd: over},
		{name: "argument over 4096 bytes", fwd: []string{"create-runtime", strings.Repeat("x", 4097)}},
		{name: "config entry over 8192 bytes", fwd: []string{"poststop"},
			config: ptr(strings.Repeat("c", 8193-len("NRI_GPU_GUARD_CONFIG=")))},
	}
	n := 0
	for _, tc := range cases {
		for _, size := range stdinSizes {
			hookExit := exitCodes[n%len(exitCodes)]
			n++
			t.Run(fmt.Sprintf("%s/stdin=%d", tc.name, size), func(t *testing.T) {
				sock := filepath.Join(shortDir(t), "s")
				srv := startServer(t, sock, reply(result(0, nil)))
				args := append([]string{"--relay-socket=" + sock, "--relay-hook=" + fakeHook}, tc.opts...)
				stdin := pattern(size)
				out := runRelay(t, runOpts{args: append(args, tc.fwd...), config: tc.config, stdin: stdin, hookExit: hookExit})
				sv := srv.finish(t)
				require.NoError(t, sv.err)
				assert.False(t, sv.relay, "the relay connected")
				assertFallback(t, out, tc.fwd, stdin, false, fds, hookExit)
			})
		}
	}
}

// TestRelayExecFailure: a hook that cannot be run is one line naming it and
// exit 1, whether stdin was read or not.
func TestRelayExecFailure(t *testing.T) {
	needRelay(t)
	missing := filepath.Join(t.TempDir(), "no-such-hook")
	for _, fwd := range [][]string{{"create-runtime"}, {"version"}} {
		t.Run(fwd[0], func(t *testing.T) {
			sock := filepath.Join(shortDir(t), "absent")
			args := append([]string{"--relay-socket=" + sock, "--relay-hook=" + missing}, fwd...)
			out := runRelay(t, runOpts{args: args, stdin: []byte("{}")})
			assert.Nil(t, out.hook)
			assert.Equal(t, 1, out.code)
			assert.Equal(t, "nri-gpu-guard-hook-relay: cannot run the hook "+missing+": No such file or directory\n", string(out.stderr))
		})
	}
}

// TestRelayDefaults: without options the relay uses its compiled-in socket
// and hook (built with -DRELAY_DEFAULT_SOCKET and -DRELAY_DEFAULT_HOOK).
func TestRelayDefaults(t *testing.T) {
	needRelay(t)
	fds := directFds(t)
	stdin := []byte(`{"id":"d"}`)

	out := runRelay(t, runOpts{bin: defaultsBin, args: []string{"poststop"}, stdin: stdin, hookExit: 7})
	assertFallback(t, out, []string{"poststop"}, stdin, true, fds, 7)

	srv := startServer(t, defaultSock, answer(result(9, []byte("served\n")), false))
	out = runRelay(t, runOpts{bin: defaultsBin, args: []string{"poststop"}, stdin: stdin})
	sv := srv.finish(t)
	require.NoError(t, sv.err)
	assert.True(t, sv.relay)
	assert.Nil(t, out.hook)
	assert.Equal(t, 9, out.code)
	assert.Equal(t, "served\n", string(out.stderr))
}
