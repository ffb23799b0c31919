// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/net/multiplex"
	"github.com/containerd/ttrpc"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// sigtermWatchdog fails a test whose process did not end after SIGTERM. It
// only keeps a broken build from hanging the suite: the time a process takes
// to end is logged (and written down in docs/benchmarks.md), not asserted.
// As long as the suite's other waits: a race-built binary on a loaded
// machine may take seconds, and none of these processes ends by itself.
const sigtermWatchdog = 60 * time.Second

// daemonProc is the test binary running the daemon (run with args) as a
// child, its stderr lines delivered on lines.
type daemonProc struct {
	cmd   *exec.Cmd
	lines chan string
	done  chan struct{}
	err   error
}

func startDaemon(t *testing.T, args ...string) *daemonProc {
	t.Helper()
	self, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.Command(self, args...)
	cmd.Env = append(os.Environ(), runMainEnv+"=1")
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	p := &daemonProc{cmd: cmd, lines: make(chan string, 1024), done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			select {
			case p.lines <- sc.Text():
			default: // nobody reads: drop
			}
		}
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.done
	})
	return p
}

// waitLine waits for a stderr line containing want.
func (p *daemonProc) waitLine(t *testing.T, want string) {
	t.Helper()
	deadline := time.After(condWait)
	for {
		select {
		case l := <-p.lines:
			if strings.Contains(l, want) {
				return
			}
		case <-p.done:
			t.Fatalf("the daemon exited (%v) before logging %q", p.err, want)
		case <-deadline:
			t.Fatalf("no line with %q within %s", want, condWait)
		}
	}
}

// term sends SIGTERM and returns the exit code and how long the process took
// to end; a process still running after sigtermWatchdog fails the test.
func (p *daemonProc) term(t *testing.T) (int, time.Duration) {
	t.Helper()
	start := time.Now()
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-p.done:
	case <-time.After(sigtermWatchdog):
		t.Fatalf("the daemon still runs %s after SIGTERM", sigtermWatchdog)
	}
	return p.cmd.ProcessState.ExitCode(), time.Since(start)
}

// condWait bounds every wait for a condition (a log line, a connection).
const condWait = 60 * time.Second

// daemonConfig writes a configuration with a static GPU and a ledger in a
// fresh short directory (unix socket paths are short).
func daemonConfig(t *testing.T) (dir, cfgPath string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "gg-sig-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	conf := fmt.Sprintf("version = 1\n[ledger]\ndir = %q\n[devices]\nsource = \"static\"\nproc_root = %q\n"+
		"[[devices.static]]\nindex = 0\nuuid = %q\nminor = 0\n", filepath.Join(dir, "state"), filepath.Join(dir, "no-driver"), gpuUUID(0))
	cfgPath = filepath.Join(dir, "config.toml")
	require.NoError(t, os.WriteFile(cfgPath, []byte(conf), 0o600))
	return dir, cfgPath
}

// mutedRuntime is an NRI socket whose runtime accepts the plugin's
// registration (when register is set; else it never answers at all) and then
// never configures it. It reports on reached when the daemon got that far.
func mutedRuntime(t *testing.T, socket string, register bool) <-chan struct{} {
	t.Helper()
	l, err := net.Listen("unix", socket)
	require.NoError(t, err)
	reached := make(chan struct{}, 1)
	signal := func() {
		select {
		case reached <- struct{}{}:
		default:
		}
	}
	var conns []net.Conn
	var servers []*ttrpc.Server
	accepted := make(chan struct{})
	go func() {
		defer close(accepted)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
			if !register {
				signal()
				continue
			}
			mux := multiplex.Multiplex(c)
			rl, err := mux.Listen(multiplex.RuntimeServiceConn)
			if err != nil {
				continue
			}
			srv, err := ttrpc.NewServer()
			if err != nil {
				continue
			}
			api.RegisterRuntimeService(srv, silentRuntime{registered: signal})
			servers = append(servers, srv)
			go func() { _ = srv.Serve(context.Background(), rl) }()
		}
	}()
	t.Cleanup(func() {
		_ = l.Close()
		<-accepted
		for _, s := range servers {
			_ = s.Close()
		}
		for _, c := range conns {
			_ = c.Close()
		}
	})
	return reached
}

// silentRuntime accepts a registration and never calls the plugin back.
type silentRuntime struct{ registered func() }

func (r silentRuntime) RegisterPlugin(context.Context, *api.RegisterPluginRequest) (*api.Empty, error) {
	r.registered()
	return &api.Empty{}, nil
}

func (silentRuntime) UpdateContainers(context.Context, *api.UpdateContainersRequest) (*api.UpdateContainersResponse, error) {
	return &api.UpdateContainersResponse{}, nil
}

// The external daemon ends on SIGTERM, with exit status 0, wherever it is in
// reaching the runtime: retrying a socket that is not there, registering
// with a runtime that never answers, or waiting for the Configure a runtime
// never sends (the NRI stub's Start waits for it without looking at the
// context: the daemon must not wait for Start once it is told to stop).
func TestDaemonEndsOnSIGTERM(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, socket string) func(p *daemonProc)
	}{
		{"no socket, retrying", func(t *testing.T, _ string) func(p *daemonProc) {
			return func(p *daemonProc) { p.waitLine(t, "cannot register with the runtime; retrying") }
		}},
		{"socket never answers", func(t *testing.T, socket string) func(p *daemonProc) {
			reached := mutedRuntime(t, socket, false)
			return func(*daemonProc) { waitChan(t, reached, "the daemon connected") }
		}},
		{"registered, never configured", func(t *testing.T, socket string) func(p *daemonProc) {
			reached := mutedRuntime(t, socket, true)
			return func(*daemonProc) { waitChan(t, reached, "the daemon registered") }
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir, cfg := daemonConfig(t)
			socket := filepath.Join(dir, "nri.sock")
			ready := tc.setup(t, socket)
			p := startDaemon(t, "--config", cfg, "--socket", socket)
			ready(p)
			code, took := p.term(t)
			t.Logf("SIGTERM exit latency: daemon (%s): %s", tc.name, took)
			assert.Equal(t, 0, code, "a daemon told to stop exits 0")
		})
	}
}

func waitChan(t *testing.T, c <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(condWait):
		t.Fatalf("%s: not within %s", what, condWait)
	}
}
