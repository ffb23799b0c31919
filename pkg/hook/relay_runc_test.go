// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

// The hook relay with the real runc: containers whose hooks are
// nri-gpu-guard-hook-relay (cmd/nri-gpu-guard-hook-relay), which forwards
// each hook run to the rig's `nri-gpu-guard-hook serve` and runs the Go hook
// itself whenever the server cannot answer. The verdicts must be the Go
// hook's, whichever of the two gave them. Needs root, runc and a C compiler
// that links static programs (the rig builds the relay); skipped elsewhere.

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// The argv[0] of the relay and of the Go hook, as the rig's hooks (and a
// relay's fallback) give them.
const (
	relayArgv0 = "nri-gpu-guard-hook-relay"
	hookArgv0  = "nri-gpu-guard-hook"
)

// hookChild is the hook process that runc (c's `runc run`) is running:
// its one child whose argv[0] names the relay or the Go hook.
type hookChild struct {
	pid   int
	argv0 string
	exe   string
}

// hookOf finds the hook process c's runc runs now; it fails the test unless
// there is exactly one.
func (r *rig) hookOf(c *ctr) hookChild {
	r.t.Helper()
	kids := childrenOf(r.t, c.cmd.Process.Pid)
	var hooks []hookChild
	for _, k := range kids {
		if k.argv0 == relayArgv0 || k.argv0 == hookArgv0 {
			hooks = append(hooks, k)
		}
	}
	require.Len(r.t, hooks, 1, "one hook process under runc run %s (pid %d): %+v", c.id, c.cmd.Process.Pid, kids)
	return hooks[0]
}

// childrenOf lists the processes whose parent is ppid, read from /proc.
// A process that exits while it is read is left out.
func childrenOf(t testing.TB, ppid int) []hookChild {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	require.NoError(t, err)
	var out []hookChild
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		parent, err := parentOf("/proc", pid)
		if err != nil || parent != ppid {
			continue
		}
		if k, ok := readChild(pid); ok {
			out = append(out, k)
		}
	}
	return out
}

// readChild reads pid's argv[0] and executable; false if it is gone.
func readChild(pid int) (hookChild, bool) {
	cmdline, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
	if err != nil || len(cmdline) == 0 {
		return hookChild{}, false
	}
	argv0, _, _ := strings.Cut(string(cmdline), "\x00")
	exe, err := os.Readlink(filepath.Join("/proc", strconv.Itoa(pid), "exe"))
	if err != nil {
		return hookChild{}, false
	}
	return hookChild{pid: pid, argv0: argv0, exe: exe}, true
}

// runcHookError matches the part of runc's error that the hook decided: its
// exit status and what it wrote on stderr, up to the end of runc's quoted
// message (runc's own prefix carries a time stamp).
var runcHookError = regexp.MustCompile(`error running (?:createRuntime )?hook #0: (?:[^"\\]|\\.)*`)

// holderSince is when a refusal says the holder claimed its GPU: the clock's,
// not the verdict's.
var holderSince = regexp.MustCompile(`since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(\d+s ago\)`)

// hookVerdict is what runc reports of a refusing create-runtime hook: the
// exit status and the hook's stderr, as runc quotes them, with the holder's
// claim time left out.
func hookVerdict(t testing.TB, out string) string {
	t.Helper()
	m := runcHookError.FindString(out)
	require.NotEmpty(t, m, "runc names no failing hook in:\n%s", out)
	return holderSince.ReplaceAllString(m, "since <time>")
}

// serverAnswers makes o's relay unable to fall back: its --relay-hook does
// not exist, so a relay that runs it fails (exit 1, "cannot run the hook"),
// and an admitted container was answered by the server.
func (r *rig) serverAnswers(o ctrOpts) ctrOpts {
	o.relayHook = filepath.Join(r.base, "no-such-hook")
	return o
}

// TestRuncRelayServerAnswers: with the server up, the relay's hooks are
// answered by it: containers are admitted, refused and released (poststop)
// although the relay has no Go hook to fall back on, a waiting container's
// hook process is the relay itself until it is admitted, a refusal reads
// in runc's error exactly as the Go hook's own (exit status and text), and
// the audit log has the claims and their releases. The server logs nothing
// (it logs each relay it tells to fall back, and each error).
func TestRuncRelayServerAnswers(t *testing.T) {
	r := newRig(t, rigOpts{relay: true})
	a := r.start("a", r.serverAnswers(ctrOpts{env: gpuEnv(0)}))
	r.waitFor("a to start", func() bool { return r.started("a") || !a.running() })
	require.True(t, r.started("a"), "a admitted: %s", a.out.String())
	require.Equal(t, map[string]string{gpuUUIDs[0]: "a"}, r.holders())

	b, err := r.run("b", r.serverAnswers(ctrOpts{env: gpuEnv(0), noWait: true, mode: "exit"}))
	require.Error(t, err, "GPU 0 is held by a")
	relayed := hookVerdict(t, b.out.String())
	require.NotContains(t, relayed, "cannot run the hook")
	require.Contains(t, relayed, "exit status "+strconv.Itoa(ExitBusy))
	require.Contains(t, relayed, "GPU 0 ("+gpuUUIDs[0]+") is held by container a")
	bd, err := r.run("b", ctrOpts{env: gpuEnv(0), noWait: true, mode: "exit", direct: true})
	require.Error(t, err)
	require.Equal(t, hookVerdict(t, bd.out.String()), relayed, "the relay shows runc the Go hook's refusal")
	require.False(t, r.started("b"))

	r.release("a")
	require.NoError(t, a.wait(t))
	require.Empty(t, r.holders(), "a's poststop released GPU 0 (nobody else could)")

	h := r.start("h", r.serverAnswers(ctrOpts{env: gpuEnv(0)}))
	r.waitFor("h to start", func() bool { return r.started("h") || !h.running() })
	require.True(t, r.started("h"), "h admitted: %s", h.out.String())
	w := r.start("w", r.serverAnswers(ctrOpts{env: gpuEnv(0)}))
	r.waitFor("w to queue", func() bool { return slices.Contains(r.waiterKeys(), "w") || !w.running() })
	require.True(t, w.running(), "w's runc returned: %s", w.out.String())
	hc := r.hookOf(w)
	require.Equal(t, relayArgv0, hc.argv0, "w's hook process waits for the server's answer")
	require.Equal(t, r.relayBin, hc.exe)
	r.release("h")
	require.NoError(t, h.wait(t))
	r.waitFor("w to start", func() bool { return r.started("w") || !w.running() })
	require.True(t, r.started("w"), "w admitted after h: %s", w.out.String())
	require.Equal(t, map[string]string{gpuUUIDs[0]: "w"}, r.holders())
	r.release("w")
	require.NoError(t, w.wait(t))
	require.Empty(t, r.holders(), "w's poststop released GPU 0")
	require.Empty(t, r.state().Waiters)

	// h's claim ended at its poststop or at w's poll, whichever came
	// first; a's and w's only at their poststops.
	type rec struct{ op, reason string }
	got := map[string][]rec{}
	for _, x := range r.audit() {
		switch x.Op {
		case ledger.OpClaim:
			require.Equal(t, []string{gpuUUIDs[0]}, x.Devices)
			require.Equal(t, string(ledger.FrontEndHook), x.FrontEnd)
			got[x.ContainerID] = append(got[x.ContainerID], rec{x.Op, ""})
		case ledger.OpRelease:
			if x.ContainerID == "h" {
				x.Reason = ""
			}
			got[x.ContainerID] = append(got[x.ContainerID], rec{x.Op, x.Reason})
		}
	}
	require.Equal(t, map[string][]rec{
		"a": {{ledger.OpClaim, ""}, {ledger.OpRelease, "removed"}},
		"h": {{ledger.OpClaim, ""}, {ledger.OpRelease, ""}},
		"w": {{ledger.OpClaim, ""}, {ledger.OpRelease, "removed"}},
	}, got, "claimed, then released")
	require.Empty(t, r.serverLog(), "the server logs nothing per answered request")
}

// verdicts runs one scenario of every kind of verdict on r and returns what
// each container got, as runc reports it: a holder admitted, a request for
// its GPU refused at once (busy), one for an unknown GPU refused (policy),
// a container naming no GPU admitted, a waiting one admitted once the
// holder exited, both released by their poststops; and the argv[0] of the
// waiting container's hook process, the audit trail's operations.
func verdicts(t *testing.T, r *rig) []string {
	t.Helper()
	var out []string
	admitted := func(c *ctr) string {
		if r.started(c.id) {
			return c.id + ": admitted"
		}
		return c.id + ": not started: " + c.out.String()
	}
	refused := func(c *ctr, err error) string {
		if err == nil {
			return c.id + ": admitted (want refused)"
		}
		return c.id + ": refused: " + hookVerdict(t, c.out.String())
	}

	h := r.start("h", ctrOpts{env: gpuEnv(0)})
	r.waitFor("h to start", func() bool { return r.started("h") || !h.running() })
	out = append(out, admitted(h))
	c, err := r.run("busy", ctrOpts{env: gpuEnv(0), noWait: true, mode: "exit"})
	out = append(out, refused(c, err))
	c, err = r.run("unknown", ctrOpts{env: gpuEnv(7), mode: "exit"})
	out = append(out, refused(c, err))
	c, err = r.run("nogpu", ctrOpts{mode: "exit"})
	if err != nil {
		out = append(out, "nogpu: "+err.Error())
	} else {
		out = append(out, admitted(c))
	}

	w := r.start("w", ctrOpts{env: gpuEnv(0)})
	r.waitFor("w to queue", func() bool { return slices.Contains(r.waiterKeys(), "w") || !w.running() })
	if !w.running() {
		return append(out, "w: not queued: "+w.out.String())
	}
	hc := r.hookOf(w)
	out = append(out, "w's hook process: "+hc.argv0+" "+hc.exe)
	r.release("h")
	require.NoError(t, h.wait(t))
	r.waitFor("w to start", func() bool { return r.started("w") || !w.running() })
	out = append(out, admitted(w))
	r.release("w")
	require.NoError(t, w.wait(t))
	out = append(out, fmt.Sprintf("holders after: %v", r.holders()))
	for _, x := range r.audit() {
		out = append(out, fmt.Sprintf("audit: %s %s %v", x.ContainerID, x.Op, x.Devices))
	}
	return out
}

// TestRuncRelayFallsBack: with no server to answer (never started: no
// socket; stopped: its socket removed; killed: a socket nobody listens on,
// refused), every relay runs the Go hook itself, in its own process (the
// waiting container's hook process is the Go hook, under the relay's pid),
// and every verdict, refusal text and audit record is what the Go hook
// named directly by the hooks gives.
func TestRuncRelayFallsBack(t *testing.T) {
	direct := verdicts(t, newRig(t, rigOpts{direct: true}))
	require.Contains(t, direct, "w's hook process: "+hookArgv0+" "+hookBin)

	for _, tc := range []struct {
		name string
		opts rigOpts
		stop func(t *testing.T, r *rig)
	}{
		{name: "never started", opts: rigOpts{relay: true, noServer: true}, stop: func(t *testing.T, r *rig) {
			require.NoFileExists(t, r.sock)
		}},
		{name: "stopped", opts: rigOpts{relay: true}, stop: func(t *testing.T, r *rig) {
			require.Empty(t, r.stopServer(syscall.SIGTERM))
			require.NoFileExists(t, r.sock)
		}},
		{name: "killed", opts: rigOpts{relay: true}, stop: func(t *testing.T, r *rig) {
			r.stopServer(syscall.SIGKILL)
			_, err := net.Dial("unix", r.sock)
			require.ErrorIs(t, err, syscall.ECONNREFUSED, "the socket stays, nobody listens")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, tc.opts)
			require.True(t, r.relay)
			tc.stop(t, r)
			require.Equal(t, direct, verdicts(t, r))
		})
	}
}

// TestRuncRelayKilledLeavesQueue: a relay waiting for the server's answer
// (a create-runtime --wait queued behind a holder) is killed with SIGKILL,
// as a runtime's hook timeout does: runc refuses the container, and the
// server, whose read on the connection returns, cancels the hook run, which
// leaves the queue at once, saying why. The rig's poll interval is a
// minute here, and w has no poststop, so neither a poll of the waiting
// hook (its container or runtime gone) nor w's poststop can be what ends
// the wait.
func TestRuncRelayKilledLeavesQueue(t *testing.T) {
	r := newRig(t, rigOpts{relay: true})
	idle := r.cfg
	idle.Hook.PollInterval = config.Duration{Duration: time.Minute}
	idlePath := r.writeConfig("idle.toml", idle)

	h := r.start("h", r.serverAnswers(ctrOpts{env: gpuEnv(1)}))
	r.waitFor("h to start", func() bool { return r.started("h") || !h.running() })
	require.True(t, r.started("h"), h.out.String())
	// No poststop for w: runc runs it when it destroys a container whose
	// createRuntime hook failed, and it would drop w's queue entry too
	// ("container removed").
	w := r.start("w", r.serverAnswers(ctrOpts{env: gpuEnv(1), cfgPath: idlePath, noPoststop: true}))
	r.waitFor("w to queue", func() bool { return slices.Contains(r.waiterKeys(), "w") || !w.running() })
	require.True(t, w.running(), "w's runc returned: %s", w.out.String())
	hc := r.hookOf(w)
	require.Equal(t, relayArgv0, hc.argv0, "w's relay waits for the server's answer")

	require.NoError(t, syscall.Kill(hc.pid, syscall.SIGKILL))
	err := w.wait(t)
	require.Error(t, err, "runc refuses a container whose hook was killed")
	require.Contains(t, err.Error(), "signal: killed")

	var reasons []string
	r.waitFor("w to leave the queue", func() bool {
		reasons = nil
		for _, rec := range r.audit() {
			if rec.Key == "w" && rec.Op == ledger.OpDequeue {
				reasons = append(reasons, rec.Reason)
			}
		}
		return len(reasons) > 0
	})
	require.Len(t, reasons, 1)
	require.Contains(t, reasons[0], "hook cancelled", "the server cancelled the run")
	require.Contains(t, reasons[0], "hung up", "because the relay's connection ended")
	require.Empty(t, r.state().Waiters)
	require.Equal(t, map[string]string{gpuUUIDs[1]: "h"}, r.holders(), "w never claimed")
	require.False(t, r.started("w"))

	r.release("h")
	require.NoError(t, h.wait(t))
	require.Empty(t, r.holders())
	require.Empty(t, r.state().Reservations, "nothing reserved for the gone waiter")
	require.NotContains(t, r.serverLog(), "falls back")
}

// TestRuncRelayServerKilledWhileWaiting: the server is killed with SIGKILL
// while a relay waits for its answer (a create-runtime --wait queued
// behind a holder). The relay's connection breaks before the result: it
// runs the Go hook in its own process (same pid, runc still its parent),
// which takes the queue entry over (one entry all along) and admits the
// container once the holder is gone (its poststop too falls back); one
// claim, released by the container's own poststop.
func TestRuncRelayServerKilledWhileWaiting(t *testing.T) {
	r := newRig(t, rigOpts{relay: true})
	h := r.start("h", ctrOpts{env: gpuEnv(2)})
	r.waitFor("h to start", func() bool { return r.started("h") || !h.running() })
	require.True(t, r.started("h"), h.out.String())
	w := r.start("w", ctrOpts{env: gpuEnv(2)})
	r.waitFor("w to queue", func() bool { return slices.Contains(r.waiterKeys(), "w") || !w.running() })
	require.True(t, w.running(), "w's runc returned: %s", w.out.String())
	relay := r.hookOf(w)
	require.Equal(t, relayArgv0, relay.argv0, "w's relay waits for the server's answer")

	r.stopServer(syscall.SIGKILL)
	r.waitFor("w's relay to run the Go hook, or to end", func() bool {
		k, ok := readChild(relay.pid)
		return !ok || k.argv0 != relayArgv0 || !w.running()
	})
	require.True(t, w.running(), "w's runc returned: %s", w.out.String())
	require.Equal(t, hookChild{pid: relay.pid, argv0: hookArgv0, exe: hookBin}, r.hookOf(w), "the relay's process became the Go hook")
	require.False(t, r.started("w"))
	require.Equal(t, []string{"w"}, r.waiterKeys(), "one queue entry")
	require.Equal(t, map[string]string{gpuUUIDs[2]: "h"}, r.holders())

	r.release("h")
	require.NoError(t, h.wait(t))
	r.waitFor("w to start", func() bool { return r.started("w") || !w.running() })
	require.True(t, r.started("w"), "w admitted by the Go hook: %s", w.out.String())
	st := r.state()
	require.Empty(t, st.Waiters)
	require.Len(t, st.Claims, 1)
	require.Equal(t, map[string]string{gpuUUIDs[2]: "w"}, holdersOf(st))
	r.release("w")
	require.NoError(t, w.wait(t))
	require.Empty(t, r.holders(), "w's poststop (fallen back) released it")

	claims := map[string]int{}
	for _, rec := range r.audit() {
		if rec.Op == ledger.OpClaim {
			claims[rec.ContainerID]++
		}
	}
	require.Equal(t, map[string]int{"h": 1, "w": 1}, claims, "one claim each")
}
