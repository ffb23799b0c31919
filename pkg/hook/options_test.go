// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// fakeProc writes procRoot/<pid>/stat (with parent ppid) and comm.
func fakeProc(t *testing.T, root string, pid, ppid int, comm string) {
	t.Helper()
	dir := filepath.Join(root, strconv.Itoa(pid))
	require.NoError(t, os.MkdirAll(dir, 0o755))
	stat := strconv.Itoa(pid) + " (" + comm + ") S " + strconv.Itoa(ppid) + " 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 12345 0 0\n"
	require.NoError(t, os.WriteFile(filepath.Join(dir, "stat"), []byte(stat), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "comm"), []byte(comm+"\n"), 0o644))
}

func TestEngineHoldsLock(t *testing.T) {
	root := t.TempDir()
	fakeProc(t, root, 100, 50, "conmon")
	fakeProc(t, root, 101, 100, "runc")
	fakeProc(t, root, 200, 1, "bash")
	fakeProc(t, root, 201, 200, "runc")
	fakeProc(t, root, 301, 1, "crun") // reparented: its engine is gone
	fakeProc(t, root, 400, 1, "containerd-shim")
	fakeProc(t, root, 401, 400, "runc")
	fakeProc(t, root, 500, 1, "conmonrs")
	fakeProc(t, root, 501, 500, "runc")

	locked, why := engineHoldsLock(root, 101)
	require.True(t, locked, "runc under conmon: podman or CRI-O")
	require.Contains(t, why, "conmon")
	require.Contains(t, why, "pid 100")

	locked, why = engineHoldsLock(root, 401)
	require.True(t, locked, "runc under containerd-shim: Docker or containerd")
	require.Contains(t, why, "containerd-shim")

	locked, why = engineHoldsLock(root, 501)
	require.True(t, locked, "runc under conmon-rs: CRI-O with runtime_type = pod")
	require.Contains(t, why, "conmon-rs")

	for _, ppid := range []int{201, 301, 999, 0} {
		locked, _ := engineHoldsLock(root, ppid)
		require.False(t, locked, "ppid %d", ppid)
	}
}

func TestTicketOf(t *testing.T) {
	id := guard.NewTicketID()
	require.True(t, guard.ValidTicket(id), id)
	require.Len(t, id, len(guard.TicketPrefix)+26)
	require.NotEqual(t, id, guard.NewTicketID())
	for _, tc := range []struct {
		env  []string
		want string
	}{
		{[]string{"PATH=/bin", TicketEnv + "=" + id}, id},
		{[]string{TicketEnv + "=" + guard.NewTicketID(), TicketEnv + "=" + id}, id}, // the last one wins, as in the runtime
		{[]string{TicketEnv + "=" + strings.ToUpper(id)}, ""},
		{[]string{TicketEnv + "=ticket-../../etc"}, ""},
		{[]string{TicketEnv + "=" + id + "x"}, ""},
		{[]string{TicketEnv + "="}, ""},
		{nil, ""},
	} {
		require.Equal(t, tc.want, ticketOf(tc.env), "%v", tc.env)
	}
}

func TestExitCode(t *testing.T) {
	require.Equal(t, 0, ExitCode(nil))
	require.Equal(t, ExitBusy, ExitCode(fmt.Errorf("x: %w; %w", guard.ErrQueued, ErrNotWaiting)))
	require.Equal(t, ExitBusy, ExitCode(fmt.Errorf("x: %w", ErrWaitTimeout)))
	require.Equal(t, ExitPolicy, ExitCode(fmt.Errorf("x: %w", guard.ErrRejected)))
	require.Equal(t, ExitRefused, ExitCode(errors.New("ledger corrupt")))
}

// A --wait hook finds the timeout its own definition in config.json gives
// it (plain runc kills it there), however short; other hooks and
// definitions without a timeout change nothing. The timeout comes from the
// spec ReadInput decoded (fast path or encoding/json alike).
func TestOwnHookTimeout(t *testing.T) {
	sec := func(n int) *int { return &n }
	guardWait := specs.Hook{Path: "/usr/bin/nri-gpu-guard-hook", Args: []string{"nri-gpu-guard-hook", "create-runtime", "--wait"}}
	for _, tc := range []struct {
		name  string
		hooks *specs.Hooks
		want  time.Duration
		ok    bool
	}{
		{"own timeout", &specs.Hooks{CreateRuntime: []specs.Hook{
			{Path: "/usr/bin/other", Args: []string{"other", "--wait"}, Timeout: sec(5)},
			func() specs.Hook { h := guardWait; h.Timeout = sec(60); return h }(),
		}}, 60 * time.Second, true},
		{"no timeout", &specs.Hooks{CreateRuntime: []specs.Hook{guardWait}}, 0, false},
		{"another hook of the guard, without --wait", &specs.Hooks{CreateRuntime: []specs.Hook{{Path: guardWait.Path, Args: []string{"nri-gpu-guard-hook", "create-runtime"}, Timeout: sec(60)}}}, 0, false},
		{"too short to wait: still a bound", &specs.Hooks{CreateRuntime: []specs.Hook{func() specs.Hook { h := guardWait; h.Timeout = sec(2); return h }()}}, 2 * time.Second, true},
		{"one second", &specs.Hooks{CreateRuntime: []specs.Hook{func() specs.Hook { h := guardWait; h.Timeout = sec(1); return h }()}}, time.Second, true},
		{"zero", &specs.Hooks{CreateRuntime: []specs.Hook{func() specs.Hook { h := guardWait; h.Timeout = sec(0); return h }()}}, 0, false},
		{"too long to bound anything", &specs.Hooks{CreateRuntime: []specs.Hook{func() specs.Hook { h := guardWait; h.Timeout = sec(1 << 40); return h }()}}, 0, false},
		{"another stage", &specs.Hooks{Poststop: []specs.Hook{func() specs.Hook { h := guardWait; h.Timeout = sec(60); return h }()}}, 0, false},
		{"no hooks", nil, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bundle := t.TempDir()
			data, err := json.Marshal(specs.Spec{Version: specs.Version, Hooks: tc.hooks})
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
			in := ReadInput(strings.NewReader(`{"id":"c1","pid":1,"bundle":"` + bundle + `"}`))
			require.NoError(t, in.specErr)
			got, ok := ownHookTimeout(in.spec, true)
			require.Equal(t, tc.ok, ok)
			require.Equal(t, tc.want, got)
		})
	}
	_, ok := ownHookTimeout(nil, true)
	require.False(t, ok)
}

// A hook without --wait finds its own timeout too: podman and CRI-O copy a
// hooks.d definition, timeout included, into config.json, and the runtime
// kills the hook there. The --wait hook's entry is not its own.
func TestOwnHookTimeoutWithoutWait(t *testing.T) {
	sec := func(n int) *int { return &n }
	guardNoWait := specs.Hook{Path: "/usr/bin/nri-gpu-guard-hook", Args: []string{"nri-gpu-guard-hook", "create-runtime"}, Timeout: sec(30)}
	guardWait := specs.Hook{Path: "/usr/bin/nri-gpu-guard-hook", Args: []string{"nri-gpu-guard-hook", "create-runtime", "--wait"}, Timeout: sec(60)}
	got, ok := ownHookTimeout(&specs.Spec{Hooks: &specs.Hooks{CreateRuntime: []specs.Hook{guardWait, guardNoWait}}}, false)
	require.True(t, ok)
	require.Equal(t, 30*time.Second, got)
	_, ok = ownHookTimeout(&specs.Spec{Hooks: &specs.Hooks{CreateRuntime: []specs.Hook{guardWait}}}, false)
	require.False(t, ok)
}

// A --wait hook takes its own timeout from the config.json ReadInput read,
// and never opens the file again: what is at that path afterwards (nothing,
// or a FIFO, whose open would block for good) changes nothing.
func TestWaitTimeoutFromTheSpecReadOnce(t *testing.T) {
	for _, tc := range []struct {
		name    string
		replace func(t *testing.T, path string)
	}{
		{"removed", func(*testing.T, string) {}},
		{"replaced by a FIFO", func(t *testing.T, path string) { require.NoError(t, syscall.Mkfifo(path, 0o600)) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := staticConfig(t)
			cfg.Hook.WaitTimeout = config.Duration{Duration: time.Hour}
			ctx := context.Background()
			holderPid, _ := containerProcess(t)
			require.NoError(t, defaultEnv().run(ctx, PhaseCreateRuntime, cfg,
				strings.NewReader(stateFor(t, "holder", holderPid, "NVIDIA_VISIBLE_DEVICES=0")), io.Discard))

			pid, _ := containerProcess(t)
			bundle := t.TempDir()
			path := filepath.Join(bundle, "config.json")
			timeout := 10
			data, err := json.Marshal(specs.Spec{Version: specs.Version, Process: &specs.Process{Env: []string{"NVIDIA_VISIBLE_DEVICES=0"}},
				Hooks: &specs.Hooks{CreateRuntime: []specs.Hook{{Path: "/usr/bin/nri-gpu-guard-hook",
					Args: []string{"nri-gpu-guard-hook", "create-runtime", "--wait"}, Timeout: &timeout}}}})
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(path, data, 0o600))
			in := ReadInput(strings.NewReader(fmt.Sprintf(`{"id":"waiter","pid":%d,"bundle":%q}`, pid, bundle)))
			require.NoError(t, in.specErr)
			require.NoError(t, os.Remove(path))
			tc.replace(t, path)

			clock := &fakeClock{t: t0}
			e := defaultEnv()
			e.opts = Options{Wait: true}
			e.lockingEngine = nil
			e.newTicker = newReadyTicker
			// Every reading of the clock is a second later: the wait reaches
			// its limit after a few polls, without real time passing.
			e.now = func() time.Time { clock.advance(time.Second); return clock.now() }
			err = e.runInput(ctx, PhaseCreateRuntime, cfg, in, io.Discard)
			require.ErrorIs(t, err, ErrWaitTimeout)
			require.Contains(t, err.Error(), "the timeout of this hook in the container's config.json (10s, less 2s to answer)")
		})
	}
}

// A --wait hook whose own timeout in config.json is no longer than the 2 s
// it keeps to answer does not wait at all (it would otherwise wait
// hook.wait_timeout and be killed by the runtime): it decides as a hook
// without --wait does, refusing a busy GPU at once with the queue position
// and leaving no queue entry, and says why it did not wait.
func TestOwnTimeoutTooShortToWaitDecidesAtOnce(t *testing.T) {
	for _, timeout := range []int{1, 2} {
		t.Run(strconv.Itoa(timeout)+"s", func(t *testing.T) {
			cfg := staticConfig(t)
			cfg.Hook.WaitTimeout = config.Duration{Duration: time.Hour}
			holderPid, _ := containerProcess(t)
			require.NoError(t, defaultEnv().run(t.Context(), PhaseCreateRuntime, cfg,
				strings.NewReader(stateFor(t, "holder", holderPid, "NVIDIA_VISIBLE_DEVICES=0")), io.Discard))

			pid, _ := containerProcess(t)
			bundle := t.TempDir()
			data, err := json.Marshal(specs.Spec{Version: specs.Version, Process: &specs.Process{Env: []string{"NVIDIA_VISIBLE_DEVICES=0"}},
				Hooks: &specs.Hooks{CreateRuntime: []specs.Hook{{Path: "/usr/bin/nri-gpu-guard-hook",
					Args: []string{"nri-gpu-guard-hook", "create-runtime", "--wait"}, Timeout: &timeout}}}})
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
			in := ReadInput(strings.NewReader(fmt.Sprintf(`{"id":"waiter","pid":%d,"bundle":%q}`, pid, bundle)))
			require.NoError(t, in.specErr)

			// A hook that starts waiting is cancelled at once, so that the
			// test ends either way.
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			waited := false
			e := defaultEnv()
			e.opts = Options{Wait: true, Started: t0}
			e.lockingEngine = nil
			e.now = func() time.Time { return t0 }
			e.newTicker = func(d time.Duration) ticker { waited = true; cancel(); return newReadyTicker(d) }
			var admits []ctxBound // the deadline of each AdmitIfFree
			e.openGuard = func(cfg config.Config, inv *devices.Inventory) (guardAPI, func(), error) {
				g, c, err := openGuard(cfg, inv)
				return &deadlineGuard{guardAPI: g, bounds: &admits}, c, err
			}
			var stderr strings.Builder
			err = e.runInput(ctx, PhaseCreateRuntime, cfg, in, &stderr)
			require.False(t, waited, "a hook that cannot wait must not start to")
			require.NotEmpty(t, admits)
			// The hook started at t0 on its clock and was not a moment
			// older when it decided, so the runtime kills it timeout later:
			// each AdmitIfFree ends hookExitReserve before that at the
			// latest. One-sided: real time passing only shrinks what is left.
			kill := time.Duration(timeout) * time.Second
			for i, b := range admits {
				require.True(t, b.set, "AdmitIfFree %d is bounded by the hook's timeout", i+1)
				require.LessOrEqual(t, b.left, kill-hookExitReserve, "AdmitIfFree %d ends before the kill", i+1)
			}
			require.ErrorIs(t, err, ErrNotWaiting)
			require.ErrorIs(t, err, guard.ErrQueued)
			require.Equal(t, ExitBusy, ExitCode(err))
			require.Contains(t, err.Error(), "no other request waits for it")
			require.Contains(t, stderr.String(), "deciding without waiting although --wait is set: the timeout of this hook in the container's config.json ("+
				strconv.Itoa(timeout)+"s) leaves no time to wait")

			l, err := ledger.OpenReadOnly(cfg.Ledger.Dir, ledger.Options{})
			require.NoError(t, err)
			st, err := l.Snapshot(t.Context())
			require.NoError(t, err)
			require.Empty(t, st.Waiters, "a hook that does not wait leaves no queue entry")
		})
	}
}

// deadlineGuard records the deadline of the context of every AdmitIfFree.
type deadlineGuard struct {
	guardAPI
	bounds *[]ctxBound
}

func (g *deadlineGuard) AdmitIfFree(ctx context.Context, r guard.Request) (guard.Decision, error) {
	*g.bounds = append(*g.bounds, boundOf(ctx))
	return g.guardAPI.AdmitIfFree(ctx, r)
}

// A cgroup leaf is a container's own by its name only when it is the id
// (optionally a .scope) or a runtime's <prefix>-<id>[.scope]; a shared
// cgroup whose name merely ends in "-<id>" is not.
func TestNamesContainer(t *testing.T) {
	for _, tc := range []struct {
		leaf, id string
		want     bool
	}{
		{"train", "train", true},
		{"train.scope", "train", true},
		{"runc-train.scope", "train", true},
		{"crun-train.scope", "train", true},
		{"libpod-0123abcd", "0123abcd", true},
		{"cri-containerd-0123abcd.scope", "0123abcd", true},
		{"crio-0123abcd.scope", "0123abcd", true},
		{"docker-0123abcd.scope", "0123abcd", true},
		{"session-3.scope", "3", false},
		{"run-u12.scope", "u12", false},
		{"user-runtime-dir@1000", "1000", false},
		{"user-1000.slice", "1000", false},
		{"app-train.scope", "train", false},
		{"runc-train.scope", "", false},
		{"libpod-conmon-0123abcd.scope", "0123abcd", false},
		{"trainer", "train", false},
	} {
		require.Equal(t, tc.want, namesContainer(tc.leaf, tc.id), "namesContainer(%q, %q)", tc.leaf, tc.id)
	}
}

// A container whose runtime named no cgroup has the cgroup its process is
// in recorded, when that cgroup is its own: its leaf names the container
// and the runtime that ran the hook (its parent, pid 4000) is not in it or
// below it. A process left in a shared cgroup records none.
func TestCgroupRecordedFromTheProcess(t *testing.T) {
	const userApp = "/user.slice/user-1000.slice/user@1000.service/app.slice"
	for _, tc := range []struct {
		name, id, cgroup string
		runtime          string // cgroup file of pid 4000; "" = unreadable
		want             string
	}{
		{"runc cgroupfs", "train", "0::/train\n", "0::/user.slice/user-0.slice/session-1.scope\n", "/train"},
		{"runc systemd", "train", "0::/system.slice/runc-train.scope\n", "0::/system.slice/sshd.service\n", "/system.slice/runc-train.scope"},
		{"cgroup v1", "train", "12:pids:/train\n11:memory:/train\n", "12:pids:/\n11:memory:/\n", "/train"},
		{"below the runtime's cgroup", "train", "0::" + userApp + "/podman.scope/train\n", "0::" + userApp + "/podman.scope\n",
			userApp + "/podman.scope/train"},
		{"shared, other name", "train", "0::/user.slice/user-0.slice/session-1.scope\n", "0::/user.slice/user-0.slice/session-1.scope\n", ""},
		{"shared, other name, elsewhere", "a", "0::/user.slice/data\n", "0::/system.slice/x.service\n", ""},
		{"session scope of a short id", "3", "0::/user.slice/user-0.slice/session-3.scope\n", "0::/system.slice/x.service\n", ""},
		{"transient unit of a short id", "u12", "0::/system.slice/run-u12.scope\n", "0::/system.slice/x.service\n", ""},
		{"the runtime's own cgroup", "train", "0::" + userApp + "/train\n", "0::" + userApp + "/train\n", ""},
		{"above the runtime's cgroup", "train", "0::" + userApp + "/train\n", "0::" + userApp + "/train/shell.scope\n", ""},
		{"the runtime's cgroup unreadable", "train", "0::/train\n", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			fakeProc(t, root, 4242, 4000, "app")
			require.NoError(t, os.WriteFile(filepath.Join(root, "4242", "cgroup"), []byte(tc.cgroup), 0o644))
			fakeProc(t, root, 4000, 1, "runc")
			if tc.runtime != "" {
				require.NoError(t, os.WriteFile(filepath.Join(root, "4000", "cgroup"), []byte(tc.runtime), 0o644))
			}
			cfg := staticConfig(t)
			opened := 0
			e := testEnv(&opened)
			e.procRoot = root
			e.getppid = func() int { return 4000 }
			require.NoError(t, e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(stateFor(t, tc.id, 4242, "NVIDIA_VISIBLE_DEVICES=1")), io.Discard))
			l, err := ledger.OpenReadOnly(cfg.Ledger.Dir, ledger.Options{})
			require.NoError(t, err)
			st, err := l.Snapshot(t.Context())
			require.NoError(t, err)
			require.Len(t, st.Claims, 1)
			require.Equal(t, tc.want, st.Claims[0].Owner.Cgroup)
		})
	}
}

// The runtime's hook timeout counts from the hook process's start, which a
// hook binary exec'd by the relay (after its wait for the server) reads
// from /proc: a hook with a timeout places its deadlines from there when it
// is earlier than its own clock's start; a hook without one never asks.
// The server's run (MainAs) has the relay's start as Options.Started and
// no process start of its own to ask.
func TestDeadlinesCountFromTheProcessStart(t *testing.T) {
	sec := func(n int) *int { return &n }
	timed := &specs.Spec{Hooks: &specs.Hooks{CreateRuntime: []specs.Hook{
		{Path: "/usr/bin/nri-gpu-guard-hook-relay", Args: []string{"nri-gpu-guard-hook-relay", "create-runtime"}, Timeout: sec(30)},
	}}}
	mainStart := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)
	execed := mainStart.Add(-2 * time.Second) // the relay waited 2 s for the server
	asked := 0
	e := env{opts: Options{Started: mainStart}, processStart: func(fallback time.Time) time.Time {
		asked++
		require.Equal(t, mainStart, fallback)
		return execed
	}}
	dl := e.deadlines(timed)
	require.Equal(t, execed, dl.started)
	require.Equal(t, execed.Add(30*time.Second), dl.killAt)
	require.Equal(t, execed.Add(30*time.Second-hookAnswerMargin), dl.decideBy)
	require.Equal(t, 1, asked)

	dl = e.deadlines(&specs.Spec{})
	require.Equal(t, mainStart, dl.started, "no timeout: the process start is not read")
	require.Equal(t, 1, asked)

	e.processStart = nil
	require.Equal(t, mainStart, e.deadlines(timed).started, "MainAs: Options.Started as given")

	// The hook binary's env reads this process's start: not after now.
	self := defaultEnv()
	require.NotNil(t, self.processStart)
	now := time.Now()
	require.False(t, self.processStart(now).After(now))
	require.Nil(t, envOf(os.Getppid).processStart, "the server's env for a relay")
}
