// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build podman

package integration

import (
	"bufio"
	"io"
	"net"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestPodmanRelay runs every scenario of TestPodman with the hooks.d
// definitions naming the hook relay (nri-gpu-guard-hook-relay) in front of
// the same hook arguments, and `nri-gpu-guard-hook serve` running for the
// rig's life: each scenario must give the verdicts it gives with the hook
// binary, and the server must have answered every relay of it (none fell
// back). Then the relay's own scenarios: the server answers alone (no hook
// binary to fall back to), and with the server stopped the fallback gives
// the same verdicts.
func TestPodmanRelay(t *testing.T) {
	for _, rt := range podmanRuntimes {
		t.Run(rt, func(t *testing.T) {
			newPodmanRig(t, rt, true).runScenarios(t, append(slices.Clone(podmanScenarios), podmanRelayScenarios...))
		})
	}
}

// podmanRelayScenarios are TestPodmanRelay's own scenarios, after the shared
// ones.
var podmanRelayScenarios = []podmanScenario{
	{"ServerAnswersWithoutHookBinary", podmanRelayServerAnswers},
	{"ServerStoppedQueueFIFOAndOtherGPU", func(t *testing.T, r *podmanRig) {
		r.stopServerFor(t)
		podmanQueueFIFO(t, r)
	}},
	{"ServerStoppedWithoutHookBinaryFailsClosed", podmanRelayFailsClosed},
}

// hookServer is `nri-gpu-guard-hook serve`, run by a relay-mode rig.
type hookServer struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error // cmd.Wait's, once done is closed
}

// serverLog is what the rig's hook servers wrote (their stdout and stderr),
// each after the one before (a scenario may stop and start the server).
type serverLog struct {
	lockedBuffer
	seen int // how much unread returned
}

// unread is what the servers logged since the last call.
func (l *serverLog) unread() string {
	all := l.String()
	out := all[l.seen:]
	l.seen = len(all)
	return out
}

// hookPath is the program the rig's hooks.d definitions name.
func (r *podmanRig) hookPath() string {
	if r.relaySock != "" {
		return podmanRelay
	}
	return podmanHook
}

// startServer starts the hook server on r.relaySock, in the mount namespace
// the runtime runs the hooks in (crun's own in this rig: the server answers
// only a relay that shares it), and returns once it said it listens (its
// first line, which the log does not keep).
func (r *podmanRig) startServer(t *testing.T) {
	t.Helper()
	require.Nil(t, r.server, "a hook server runs already")
	args := []string{podmanHook, "serve", "--socket", r.relaySock}
	if r.nsFile != "" {
		// nsenter execs the server: its pid is the server's, for SIGTERM.
		args = append([]string{"nsenter", "--mount=" + r.nsFile}, args...)
	}
	s := &hookServer{done: make(chan struct{})}
	s.cmd = exec.Command(args[0], args[1:]...)
	s.cmd.Stdout = &r.serverLog
	pipe, err := s.cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, s.cmd.Start())
	lines := bufio.NewReader(pipe)
	first, readErr := lines.ReadString('\n')
	go func() {
		// Read to EOF (the server's exit) before Wait, as StderrPipe asks.
		_, _ = io.Copy(&r.serverLog, lines)
		s.err = s.cmd.Wait()
		close(s.done)
	}()
	r.server = s
	if readErr != nil {
		<-s.done
		r.server = nil
		t.Fatalf("the hook server exited (%v) before it listened: %s%s", s.err, first, r.serverLog.String())
	}
	require.Equal(t, "nri-gpu-guard-hook serve: listening on "+r.relaySock+"\n", first)
}

// stopServer stops the hook server with SIGTERM, checks that it exits 0
// and logged nothing more, and shows the servers' whole log if t failed.
func (r *podmanRig) stopServer(t *testing.T) {
	t.Helper()
	s := r.server
	if s == nil {
		return
	}
	r.server = nil
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(podmanWait):
		_ = s.cmd.Process.Kill()
		<-s.done
		t.Errorf("the hook server did not stop within %s of SIGTERM", podmanWait)
	}
	if s.err != nil {
		t.Errorf("the hook server exited at SIGTERM with %v", s.err)
	}
	if lines := r.serverLog.unread(); lines != "" {
		t.Errorf("the hook server did not answer every relay (a line per relay that fell back or broke):\n%s", lines)
	}
	if t.Failed() {
		t.Logf("the hook servers' whole log:\n%s", r.serverLog.String())
	}
}

// stopServerFor stops the hook server for the rest of scenario t: it starts
// again at t's end, after the scenario's reset.
func (r *podmanRig) stopServerFor(t *testing.T) {
	t.Helper()
	r.stopServer(t)
	t.Cleanup(func() { r.startServer(t) })
}

// requireServerAnswered checks, after a scenario, that the hook server
// still runs and accepts connections and that it logged nothing during the
// scenario: it logs one line per relay it does not answer in full (an 'F',
// a request it could not read, a relay gone before its result) and none
// per answered one. With the server running and its socket there, a relay
// falls back only after such a line: so every hook of the scenario was
// run by the server.
func (r *podmanRig) requireServerAnswered(t *testing.T) {
	t.Helper()
	s := r.server
	if s == nil {
		return // stopped by the scenario: stopServer checked its log
	}
	select {
	case <-s.done:
		t.Errorf("the hook server exited during the scenario (%v): the relays fell back; its log:\n%s", s.err, r.serverLog.String())
		return
	default:
	}
	if c, err := net.Dial("unix", r.relaySock); err != nil {
		t.Errorf("the hook server runs but its socket takes no connection (the relays fall back): %v", err)
	} else {
		require.NoError(t, c.Close())
	}
	if lines := r.serverLog.unread(); lines != "" {
		t.Errorf("the hook server did not answer every relay (a line per relay that fell back or broke):\n%s", lines)
	}
}

// setRelayHook makes the rig's relays fall back to path for the rest of
// scenario t.
func (r *podmanRig) setRelayHook(t *testing.T, path string) {
	t.Helper()
	old := r.relayHook
	r.relayHook = path
	r.writeHooks(t)
	t.Cleanup(func() {
		r.relayHook = old
		r.writeHooks(t)
	})
}

// podmanRelayServerAnswers: with the relays' fallback naming a hook binary
// that does not exist, only the server can answer: a GPU container and one
// that names no GPU are admitted, a second one for the held GPU is refused
// with the hook's own words (the server's stderr, relayed), and the
// holder's poststop releases its GPU. A relay that fell back would refuse
// each of them with "cannot run the hook" (podmanRelayFailsClosed).
func podmanRelayServerAnswers(t *testing.T, r *podmanRig) {
	r.setRelayHook(t, filepath.Join(r.base, "no-such-hook"))

	out, err := r.runGPU("g", "1")
	require.NoError(t, err, "admitted: by the server, there is no hook to fall back to: %s", out)
	g := r.id("g")
	require.Equal(t, map[int]string{1: g}, r.holders())
	out, err = r.runGPU("n", "")
	require.NoError(t, err, "names no GPU: admitted by the server: %s", out)
	require.Equal(t, map[int]string{1: g}, r.holders())

	out, err = r.runGPU("x", "1")
	require.Error(t, err, "GPU 1 is held: %s", out)
	require.NotContains(t, out, "cannot run the hook")
	r.refusal(out, "GPU 1 ("+r.gpu[1]+") is held by container "+g[:12])

	r.mustPodman("stop", "-t", "5", "g")
	r.waitFor("g's poststop, run by the server, to release GPU 1", func() bool { return len(r.holders()) == 0 })
	require.Equal(t, []string{"removed"}, releaseReasons(r.audit(), g), "released by its poststop")
}

// podmanRelayFailsClosed: with the server stopped and the relays' fallback
// naming a hook binary that does not exist, the relay cannot run a hook:
// every container is refused at create, one that names no GPU too (fail
// closed). What podmanRelayServerAnswers would see had its relays fallen
// back.
func podmanRelayFailsClosed(t *testing.T, r *podmanRig) {
	r.stopServerFor(t)
	missing := filepath.Join(r.base, "no-such-hook")
	r.setRelayHook(t, missing)
	for _, gpu := range []string{"1", ""} {
		name := "nohook" + gpu
		out, err := r.runGPU(name, gpu)
		require.Error(t, err, "NVIDIA_VISIBLE_DEVICES=%q: no server, no hook: refused: %s", gpu, out)
		if r.runtime == "runc" {
			require.Contains(t, out, "nri-gpu-guard-hook-relay: cannot run the hook "+missing)
		} else {
			require.Contains(t, out, "exit code: 1", out)
		}
		require.Equal(t, "created", r.inspect(name, "{{.State.Status}}"))
		require.Empty(t, r.holders())
	}
}
