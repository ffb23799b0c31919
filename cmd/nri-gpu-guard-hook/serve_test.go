// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hookserve"
)

// relayCall is one relay request to the server at path: its
// acknowledgement and, after an 'A', its result.
func relayCall(t *testing.T, path string, q hookserve.Request) (hookserve.Ack, hookserve.Result) {
	t.Helper()
	c, err := net.Dial("unix", path)
	require.NoError(t, err)
	defer func() { _ = c.Close() }()
	b, err := hookserve.AppendRequest(nil, q)
	require.NoError(t, err)
	_, err = c.Write(b)
	require.NoError(t, err)
	ack, err := hookserve.ReadAck(c)
	require.NoError(t, err)
	if !ack.Accepted {
		return ack, hookserve.Result{}
	}
	_, err = c.Write([]byte{hookserve.GoAhead})
	require.NoError(t, err)
	res, err := hookserve.ReadResult(c)
	require.NoError(t, err)
	return ack, res
}

// startServer starts `nri-gpu-guard-hook serve --socket sock` and returns
// once it said it listens (its first line, which stderr does not keep).
func startServer(t *testing.T, sock string) *proc {
	t.Helper()
	cmd := exec.Command(hookBin, "serve", "--socket", sock)
	pipe, err := cmd.StderrPipe()
	require.NoError(t, err)
	p := &proc{cmd: cmd, stderr: &syncBuffer{}, done: make(chan struct{})}
	require.NoError(t, cmd.Start())
	// Reads to EOF (the server's exit) before Wait, as StderrPipe asks.
	lines := bufio.NewReader(pipe)
	first, err := lines.ReadString('\n')
	copied := make(chan struct{})
	go func() {
		_, _ = io.Copy(p.stderr, lines)
		close(copied)
	}()
	go func() {
		<-copied
		_ = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.done
	})
	require.NoError(t, err, "serve ended before it listened: %s", first)
	require.Equal(t, "nri-gpu-guard-hook serve: listening on "+sock+"\n", first)
	return p
}

// TestServeCommand: `nri-gpu-guard-hook serve --socket PATH` creates the
// socket's directory (0755) and a 0600 socket, says where it listens,
// answers a relay exactly as
// the hook binary answers the same input, logs a line per fallback and none
// per answer, and on SIGTERM stops, removing its socket, with exit 0.
func TestServeCommand(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the container markers are in /run (root only)")
	}
	h := newHost(t)
	dir, err := os.MkdirTemp("", "hs")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	sock := filepath.Join(dir, "run", "hook.sock")
	srv := startServer(t, sock)
	fi, err := os.Stat(filepath.Dir(sock))
	require.NoError(t, err)
	require.Equal(t, os.ModeDir|0o755, fi.Mode())
	fi, err = os.Lstat(sock)
	require.NoError(t, err)
	require.Equal(t, os.ModeSocket|0o600, fi.Mode())

	create := []string{"create-runtime", "--config", h.cfgPath}
	_, res := relayCall(t, sock, hookserve.Request{Args: create, Stdin: h.state("a", h.ctrProcess(), gpuEnv(0))})
	require.Equal(t, 0, res.Code, string(res.Stderr))
	b := h.state("b", h.ctrProcess(), gpuEnv(0))
	_, res = relayCall(t, sock, hookserve.Request{Args: create, Stdin: b})
	want := runProc(t, b, hookBin, create...)
	require.Equal(t, 75, want.code, want.String())
	require.Equal(t, want.code, res.Code)
	require.Equal(t, want.stderr, string(res.Stderr))
	require.Empty(t, srv.stderr.String(), "no log line for answered requests")

	ack, _ := relayCall(t, sock, hookserve.Request{Args: []string{"version"}})
	require.False(t, ack.Accepted)
	require.NoError(t, srv.cmd.Process.Signal(syscall.SIGTERM))
	<-srv.done
	require.Equal(t, 0, srv.cmd.ProcessState.ExitCode(), srv.stderr.String())
	require.Equal(t, 1, strings.Count(srv.stderr.String(), "\n"), "one line, for the fallback: %s", srv.stderr.String())
	require.Contains(t, srv.stderr.String(), `arguments ["version"]`)
	_, err = os.Lstat(sock)
	require.ErrorIs(t, err, os.ErrNotExist, "the socket goes with the server")
}
