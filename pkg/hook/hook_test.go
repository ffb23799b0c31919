// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gofrs/flock"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// staticConfig is a 4-GPU static configuration over a ledger in a temp dir.
func staticConfig(t *testing.T) config.Config {
	t.Helper()
	cfg := config.Default()
	cfg.Ledger.Dir = filepath.Join(t.TempDir(), "ledger")
	cfg.Devices.Source = config.SourceStatic
	cfg.Devices.ProcRoot = t.TempDir() // fake GPUs: no driver tree to check the list against
	cfg.Devices.Static = nil
	for i, u := range gpuUUIDs {
		cfg.Devices.Static = append(cfg.Devices.Static, config.StaticGPU{Index: i, UUID: u, Minor: i})
	}
	cfg.Hook.PollInterval = config.Duration{Duration: time.Millisecond}
	cfg.Hook.WaitTimeout = config.Duration{Duration: time.Minute}
	// Runtime roots of the test's own, absent unless a test makes them:
	// the host's /run/runc and /run/crun are not read.
	cfg.Hook.RuntimeRoots = []string{filepath.Join(t.TempDir(), "run", "runc")}
	return cfg
}

// podmanCaps is podman's default capability set (containers.conf's
// default_capabilities): neither CAP_MKNOD nor CAP_SYS_ADMIN. The specs the
// tests write carry it, as every engine's do: a spec without a
// capabilities object counts as holding every capability (makesNodes), and
// so claims every GPU where no device cgroup can be told to apply.
func podmanCaps() *specs.LinuxCapabilities {
	caps := []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_NET_BIND_SERVICE",
		"CAP_SETFCAP", "CAP_SETGID", "CAP_SETPCAP", "CAP_SETUID", "CAP_SYS_CHROOT"}
	return &specs.LinuxCapabilities{Bounding: caps, Effective: slices.Clone(caps), Permitted: slices.Clone(caps)}
}

// stateFor writes a bundle whose config.json carries env (and podman's
// default capabilities) and returns the OCI state of a container in it.
func stateFor(t *testing.T, id string, pid int, env ...string) string {
	t.Helper()
	bundle := t.TempDir()
	data, err := json.Marshal(specs.Spec{Version: specs.Version, Process: &specs.Process{Env: env, Capabilities: podmanCaps()}})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
	st, err := json.Marshal(specs.State{Version: specs.Version, ID: id, Status: specs.StateCreating, Pid: pid, Bundle: bundle})
	require.NoError(t, err)
	return string(st)
}

// containerProcess is a stand-in for a container's process: a child that
// runs until end is called (as by the time a runtime runs poststop, the
// container's processes are gone).
func containerProcess(t *testing.T) (pid int, end func()) {
	t.Helper()
	cmd := exec.Command("sleep", "3600")
	require.NoError(t, cmd.Start())
	ended := false
	end = func() {
		if !ended {
			ended = true
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}
	t.Cleanup(end)
	return cmd.Process.Pid, end
}

// testEnv is defaultEnv with the guard opened over the real ledger, counting
// how often it was opened.
func testEnv(opened *int) env {
	e := defaultEnv()
	e.openGuard = func(cfg config.Config, inv *devices.Inventory) (guardAPI, func(), error) {
		*opened++
		return openGuard(cfg, inv)
	}
	return e
}

func TestRunPhases(t *testing.T) {
	for _, tc := range []struct {
		name       string
		phase      string
		stdin      func(t *testing.T) string
		openGuard  func(config.Config, *devices.Inventory) (guardAPI, func(), error)
		cfg        func(*config.Config)
		wantErrIs  error
		wantErr    []string
		wantOpened int
	}{
		{
			name:    "unknown phase",
			phase:   "prestart",
			stdin:   func(*testing.T) string { return "" },
			wantErr: []string{"usage: nri-gpu-guard hook", `"prestart"`},
		},
		{
			name:      "unreadable input fails closed",
			phase:     PhaseCreateRuntime,
			stdin:     func(*testing.T) string { return "{not json" },
			wantErrIs: errInput,
			wantErr:   []string{"hook create-runtime: container refused", "decode the OCI state"},
		},
		{
			name:      "missing bundle fails closed",
			phase:     PhaseCreateRuntime,
			stdin:     func(*testing.T) string { return `{"id":"c1","pid":1,"bundle":"/nonexistent/bundle"}` },
			wantErrIs: errInput,
			wantErr:   []string{"container c1 refused", "/nonexistent/bundle/config.json"},
		},
		{
			name:  "no GPU named: admitted without opening the ledger",
			phase: PhaseCreateRuntime,
			stdin: func(t *testing.T) string { return stateFor(t, "c1", os.Getpid(), "PATH=/bin") },
		},
		{
			name:       "GPU named: admitted and claimed",
			phase:      PhaseCreateRuntime,
			stdin:      func(t *testing.T) string { return stateFor(t, "c1", os.Getpid(), "NVIDIA_VISIBLE_DEVICES=2") },
			wantOpened: 1,
		},
		{
			name:  "unknown GPU: refused by the guard",
			phase: PhaseCreateRuntime,
			stdin: func(t *testing.T) string {
				return stateFor(t, "c1", os.Getpid(), "NVIDIA_VISIBLE_DEVICES=GPU-00000000-0000-4000-8000-0000000000ff")
			},
			wantErrIs:  guard.ErrRejected,
			wantErr:    []string{"container c1", "unknown GPU"},
			wantOpened: 1,
		},
		{
			name:  "a panic becomes an error",
			phase: PhaseCreateRuntime,
			stdin: func(t *testing.T) string { return stateFor(t, "c1", os.Getpid(), "NVIDIA_VISIBLE_DEVICES=1") },
			openGuard: func(config.Config, *devices.Inventory) (guardAPI, func(), error) {
				panic("boom")
			},
			wantErr: []string{"internal error, container refused", "boom"},
		},
		{
			name:  "ledger unusable: refused naming it",
			phase: PhaseCreateRuntime,
			stdin: func(t *testing.T) string { return stateFor(t, "c1", os.Getpid(), "NVIDIA_VISIBLE_DEVICES=1") },
			openGuard: func(config.Config, *devices.Inventory) (guardAPI, func(), error) {
				return nil, nil, errors.New("open the GPU ledger in /x: unsafe ledger directory")
			},
			wantErr: []string{"container c1 refused", "unsafe ledger directory"},
		},
		{
			name:    "invalid configuration (Run may be called without the main's checks)",
			phase:   PhaseCreateRuntime,
			stdin:   func(t *testing.T) string { return stateFor(t, "c1", os.Getpid(), "NVIDIA_VISIBLE_DEVICES=1") },
			cfg:     func(c *config.Config) { c.Hook.PollInterval = config.Duration{} },
			wantErr: []string{"configuration", "hook.poll_interval"},
		},
		{
			name:    "invalid configuration in poststop: not released, and how to",
			phase:   PhasePoststop,
			stdin:   func(t *testing.T) string { return stateFor(t, "c1", os.Getpid(), "NVIDIA_VISIBLE_DEVICES=1") },
			cfg:     func(c *config.Config) { c.Hook.PollInterval = config.Duration{} },
			wantErr: []string{"hook poststop: container c1: its GPUs are not released: configuration", "hook.poll_interval", "gpu-guard-ctl release --container c1"},
		},
		{
			name:  "a panic in poststop: not released, and how to",
			phase: PhasePoststop,
			stdin: func(t *testing.T) string { return stateFor(t, "c1", os.Getpid(), "NVIDIA_VISIBLE_DEVICES=1") },
			openGuard: func(config.Config, *devices.Inventory) (guardAPI, func(), error) {
				panic("boom")
			},
			wantErr: []string{"internal error", "boom", "the GPUs of container c1 may not be released", "gpu-guard-ctl release --container c1"},
		},
		{
			name:      "unreadable input in poststop: not released, and how to",
			phase:     PhasePoststop,
			stdin:     func(*testing.T) string { return "{not json" },
			wantErrIs: errInput,
			wantErr:   []string{"the GPUs of a stopped container (its id is unknown) are not released", "gpu-guard-ctl gc"},
		},
		{
			name:       "poststop of a container that holds nothing",
			phase:      PhasePoststop,
			stdin:      func(*testing.T) string { return `{"id":"never-seen","status":"stopped","bundle":"/gone"}` },
			wantOpened: 1,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := staticConfig(t)
			if tc.cfg != nil {
				tc.cfg(&cfg)
			}
			opened := 0
			e := testEnv(&opened)
			if tc.openGuard != nil {
				e.openGuard = tc.openGuard
			}
			err := e.run(context.Background(), tc.phase, cfg, strings.NewReader(tc.stdin(t)), io.Discard)
			if tc.wantErrIs == nil && len(tc.wantErr) == 0 {
				require.NoError(t, err)
			} else {
				require.Error(t, err)
			}
			if tc.wantErrIs != nil {
				require.ErrorIs(t, err, tc.wantErrIs)
			}
			for _, s := range tc.wantErr {
				require.Contains(t, err.Error(), s)
			}
			require.Equal(t, tc.wantOpened, opened, "ledger opened")
		})
	}
}

// A create-runtime hook that does not wait leaves one refuse record in the
// audit log for every refusal, busy or by policy: crun shows the user only
// the exit code, and docs/hook.md sends them to `gpu-guard-ctl audit`.
func TestEveryRefusalWithoutWaitIsAudited(t *testing.T) {
	for _, tc := range []struct {
		name       string
		cfg        func(*config.Config)
		env        string
		wantErrIs  error
		wantReason []string
	}{
		{"busy, queue policy", nil, "NVIDIA_VISIBLE_DEVICES=1", guard.ErrQueued,
			[]string{"busy, not waiting: ", "is held by container holder"}},
		{"busy, on_conflict=reject", func(c *config.Config) { c.Policy.OnConflict = config.ConflictReject }, "NVIDIA_VISIBLE_DEVICES=1",
			guard.ErrRejected, []string{"refused (busy): ", "is held by container holder"}},
		{"unknown GPU", nil, "NVIDIA_VISIBLE_DEVICES=GPU-00000000-0000-4000-8000-0000000000ff", guard.ErrRejected,
			[]string{"refused (unknown-device): ", "unknown GPU"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := staticConfig(t)
			if tc.cfg != nil {
				tc.cfg(&cfg)
			}
			opened := 0
			e := testEnv(&opened)
			ctx := context.Background()
			require.NoError(t, e.run(ctx, PhaseCreateRuntime, cfg, strings.NewReader(stateFor(t, "holder", os.Getpid(), "NVIDIA_VISIBLE_DEVICES=1")), io.Discard))
			err := e.run(ctx, PhaseCreateRuntime, cfg, strings.NewReader(stateFor(t, "late", os.Getpid(), tc.env)), io.Discard)
			require.ErrorIs(t, err, tc.wantErrIs)

			l, err := ledger.OpenReadOnly(cfg.Ledger.Dir, ledger.Options{})
			require.NoError(t, err)
			recs, err := ledger.ReadAudit(l.AuditPath())
			require.NoError(t, err)
			var refusals []ledger.AuditRecord
			for _, r := range recs {
				if r.ContainerID == "late" {
					refusals = append(refusals, r)
				}
			}
			require.Len(t, refusals, 1, "one record for the refused container: %+v", recs)
			require.Equal(t, guard.AuditRefuse, refusals[0].Op)
			require.Equal(t, string(ledger.FrontEndHook), refusals[0].FrontEnd)
			for _, s := range tc.wantReason {
				require.Contains(t, refusals[0].Reason, s)
			}
		})
	}
}

// Container ids are unique only per runtime root (or containerd namespace):
// two containers "train" may run at once. The second is not admitted onto
// the first one's GPU, and the poststop of either releases only its own
// claims: the one whose recorded process still runs is the other's.
func TestSameIDInTwoRuntimeRoots(t *testing.T) {
	cfg := staticConfig(t)
	opened := 0
	e := testEnv(&opened)
	ctx := context.Background()
	var stderr bytes.Buffer

	// The first "train" is this test process; the second a child that
	// runs until the test ends it.
	require.NoError(t, e.run(ctx, PhaseCreateRuntime, cfg, strings.NewReader(stateFor(t, "train", os.Getpid(), "NVIDIA_VISIBLE_DEVICES=0")), io.Discard))
	child := exec.Command("sleep", "3600")
	require.NoError(t, child.Start())
	t.Cleanup(func() { _ = child.Process.Kill(); _ = child.Wait() })

	err := e.run(ctx, PhaseCreateRuntime, cfg, strings.NewReader(stateFor(t, "train", child.Process.Pid, "NVIDIA_VISIBLE_DEVICES=0")), io.Discard)
	require.ErrorIs(t, err, guard.ErrQueued, "the other train holds GPU 0")
	require.NoError(t, e.run(ctx, PhaseCreateRuntime, cfg, strings.NewReader(stateFor(t, "train", child.Process.Pid, "NVIDIA_VISIBLE_DEVICES=1")), io.Discard))

	holders := func() map[string]int {
		l, err := ledger.OpenReadOnly(cfg.Ledger.Dir, ledger.Options{})
		require.NoError(t, err)
		st, err := l.Snapshot(ctx)
		require.NoError(t, err)
		out := map[string]int{}
		for _, c := range st.Claims {
			out[c.Device.UUID] = c.Owner.Pid
		}
		return out
	}
	require.Equal(t, map[string]int{gpuUUIDs[0]: os.Getpid(), gpuUUIDs[1]: child.Process.Pid}, holders())

	// The second train ends: its poststop releases GPU 1 and spares GPU 0,
	// whose holder still runs.
	require.NoError(t, child.Process.Kill())
	_ = child.Wait()
	poststop := `{"ociVersion":"1.2.0","id":"train","status":"stopped","bundle":"/gone"}`
	require.NoError(t, e.run(ctx, PhasePoststop, cfg, strings.NewReader(poststop), &stderr))
	require.Equal(t, map[string]int{gpuUUIDs[0]: os.Getpid()}, holders())
	require.Contains(t, stderr.String(), "GPU 0 ("+gpuUUIDs[0]+") not released: it is held by pid "+strconv.Itoa(os.Getpid())+", which still runs")

	// A poststop for a container whose process is gone releases as always.
	cfg2 := staticConfig(t)
	gone := exec.Command("true")
	require.NoError(t, gone.Start())
	require.NoError(t, e.run(ctx, PhaseCreateRuntime, cfg2, strings.NewReader(stateFor(t, "solo", gone.Process.Pid, "NVIDIA_VISIBLE_DEVICES=2")), io.Discard))
	require.NoError(t, gone.Wait())
	require.NoError(t, e.run(ctx, PhasePoststop, cfg2, strings.NewReader(`{"ociVersion":"1.2.0","id":"solo","status":"stopped","bundle":"/gone"}`), io.Discard))
	l, err := ledger.OpenReadOnly(cfg2.Ledger.Dir, ledger.Options{})
	require.NoError(t, err)
	st, err := l.Snapshot(ctx)
	require.NoError(t, err)
	require.Empty(t, st.Claims)
}

// racyGuard runs between() once, before poststop's first ledger write: what
// another process's hook can do between poststop's lock-free read and its
// locked write.
type racyGuard struct {
	guardAPI
	between func()
}

func (r *racyGuard) RemovedExited(ctx context.Context, o ledger.Owner, runs func(ledger.Owner) bool) ([]ledger.Claim, error) {
	if r.between != nil {
		r.between()
		r.between = nil
	}
	return r.guardAPI.RemovedExited(ctx, o, runs)
}

// A container "train" ended on GPU 0 and its poststop runs, while another
// container "train" (another runtime root, or the same root once runc
// removed the first one's state) runs. Poststop decides under the ledger
// lock which claims and queue entry of the id are the ended one's: the
// running one keeps its claim, also one admitted after poststop's lock-free
// read, and its place in the queue.
func TestPoststopSparesRunningContainerOfSameID(t *testing.T) {
	type ledgerView struct {
		held    map[string]int // device → holder pid
		waiters []string
	}
	for _, tc := range []struct {
		name string
		// setup runs after the ended train claimed GPU 0; it returns what
		// runs between poststop's read and its first write (nil: nothing).
		setup      func(t *testing.T, cfg config.Config, g guardAPI, newPid int) func()
		want       func(newPid int) ledgerView
		wantStderr string
	}{
		{
			name: "admitted after poststop's read",
			setup: func(t *testing.T, cfg config.Config, _ guardAPI, newPid int) func() {
				return func() {
					require.NoError(t, defaultEnv().run(context.Background(), PhaseCreateRuntime, cfg,
						strings.NewReader(stateFor(t, "train", newPid, "NVIDIA_VISIBLE_DEVICES=1")), io.Discard))
				}
			},
			want: func(newPid int) ledgerView {
				return ledgerView{held: map[string]int{gpuUUIDs[1]: newPid}}
			},
			wantStderr: "GPU 1 (" + gpuUUIDs[1] + ") not released: it is held by pid ",
		},
		{
			name: "waiting in the queue",
			setup: func(t *testing.T, _ config.Config, g guardAPI, newPid int) func() {
				start, err := liveness.PidStart(liveness.DefaultProcRoot, newPid)
				require.NoError(t, err)
				spec := devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=2"}}
				holder := ledger.Owner{ContainerID: "holder", FrontEnd: ledger.FrontEndHook}
				d, err := g.Admit(context.Background(), guard.Request{FrontEnd: ledger.FrontEndHook, Owner: holder, Key: "holder", Spec: spec})
				require.NoError(t, err)
				require.Equal(t, guard.Admit, d.Result)
				waiter := ledger.Owner{ContainerID: "train", FrontEnd: ledger.FrontEndHook, Pid: newPid, PidStart: start}
				d, err = g.Admit(context.Background(), guard.Request{FrontEnd: ledger.FrontEndHook, Owner: waiter, Key: "train", Spec: spec})
				require.NoError(t, err)
				require.Equal(t, guard.Queue, d.Result)
				return nil
			},
			want: func(int) ledgerView {
				return ledgerView{held: map[string]int{gpuUUIDs[2]: 0}, waiters: []string{"train"}}
			},
			wantStderr: "its queue entry is kept: the process it records still runs",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := staticConfig(t)
			ctx := context.Background()
			oldPid, endOld := containerProcess(t)
			require.NoError(t, defaultEnv().run(ctx, PhaseCreateRuntime, cfg,
				strings.NewReader(stateFor(t, "train", oldPid, "NVIDIA_VISIBLE_DEVICES=0")), io.Discard))
			endOld()
			newPid, _ := containerProcess(t)
			g, _, err := openGuard(cfg, mustStatic(t, cfg))
			require.NoError(t, err)
			between := tc.setup(t, cfg, g, newPid)

			e := defaultEnv()
			e.openGuard = func(cfg config.Config, inv *devices.Inventory) (guardAPI, func(), error) {
				g, c, err := openGuard(cfg, inv)
				return &racyGuard{guardAPI: g, between: between}, c, err
			}
			var stderr bytes.Buffer
			require.NoError(t, e.run(ctx, PhasePoststop, cfg,
				strings.NewReader(`{"ociVersion":"1.2.0","id":"train","status":"stopped","bundle":"/gone"}`), &stderr))

			st, err := g.Ledger().Snapshot(ctx)
			require.NoError(t, err)
			got := ledgerView{held: map[string]int{}}
			for _, c := range st.Claims {
				got.held[c.Device.UUID] = c.Owner.Pid
			}
			for _, w := range st.Waiters {
				got.waiters = append(got.waiters, w.Key)
			}
			require.Equal(t, tc.want(newPid), got, "the ended train's GPU 0 is released, the running train keeps what it has")
			require.Contains(t, stderr.String(), tc.wantStderr)
		})
	}
}

// TestRunClaimThenPoststop drives both phases in process over one ledger: the
// claim carries the hook's identity (pid, start time, cgroup) and poststop
// releases it, twice without error.
func TestRunClaimThenPoststop(t *testing.T) {
	cfg := staticConfig(t)
	opened := 0
	e := testEnv(&opened)
	ctx := context.Background()
	pid, end := containerProcess(t)
	require.NoError(t, e.run(ctx, PhaseCreateRuntime, cfg, strings.NewReader(stateFor(t, "c1", pid, "NVIDIA_VISIBLE_DEVICES=3")), io.Discard))

	l, err := ledger.OpenReadOnly(cfg.Ledger.Dir, ledger.Options{})
	require.NoError(t, err)
	st, err := l.Snapshot(ctx)
	require.NoError(t, err)
	require.Len(t, st.Claims, 1)
	c := st.Claims[0]
	require.Equal(t, gpuUUIDs[3], c.Device.UUID)
	require.Equal(t, "c1", c.Owner.ContainerID)
	require.Equal(t, ledger.FrontEndHook, c.Owner.FrontEnd)
	require.Equal(t, pid, c.Owner.Pid)
	require.NotZero(t, c.Owner.PidStart, "pid start recorded against pid reuse")

	end() // the container's processes are gone by poststop
	for range 2 {
		require.NoError(t, e.run(ctx, PhasePoststop, cfg, strings.NewReader(`{"id":"c1","status":"stopped","bundle":"/x"}`), io.Discard))
		st, err = l.Snapshot(ctx)
		require.NoError(t, err)
		require.Empty(t, st.Claims)
	}
}

func TestGoneCheck(t *testing.T) {
	// A reaped child: its pid no longer exists.
	child := exec.Command("/bin/true")
	require.NoError(t, child.Run())
	deadPid := child.ProcessState.Pid()
	self, err := liveness.PidStart("/proc", os.Getpid())
	require.NoError(t, err)

	for _, tc := range []struct {
		name     string
		self     *liveness.Process
		ppidNow  int
		wantGone bool
		wantWhy  string
	}{
		{name: "own process alive, runtime alive", self: &liveness.Process{Pid: os.Getpid(), PidStart: self}, ppidNow: 100},
		{name: "no pid in the state: only the runtime is watched", ppidNow: 100},
		{name: "runtime gone (reparented)", self: &liveness.Process{Pid: os.Getpid(), PidStart: self}, ppidNow: 1,
			wantGone: true, wantWhy: "the runtime that ran the hook (pid 100) is gone"},
		{name: "container process gone", self: &liveness.Process{Pid: deadPid, PidStart: 1}, ppidNow: 100,
			wantGone: true, wantWhy: fmt.Sprintf("its process: pid %d is gone", deadPid)},
		{name: "pid reused by another process", self: &liveness.Process{Pid: os.Getpid(), PidStart: self + 1}, ppidNow: 100,
			wantGone: true, wantWhy: "reused"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ppid := 100
			e := defaultEnv()
			e.getppid = func() int { return ppid }
			check := e.goneCheck(tc.self)
			ppid = tc.ppidNow
			gone, why := check()
			require.Equal(t, tc.wantGone, gone, why)
			require.Contains(t, why, tc.wantWhy)
		})
	}
}

func TestNothingRequested(t *testing.T) {
	cfg := staticConfig(t)
	inv, err := devices.Discover(cfg.Devices, nil)
	require.NoError(t, err)
	invErr := errors.New("no GPU inventory: cache /x/inventory.json: file does not exist")
	for _, tc := range []struct {
		name       string
		inv        *devices.Inventory
		invErr     error
		privileged config.Privileged // "" = the default, "declared"
		unknown    config.UnknownDevice
		req        devices.Request
		wantSkip   bool
		wantErr    string
	}{
		{name: "no GPU", inv: inv, req: devices.Request{Env: []string{"PATH=/bin"}}, wantSkip: true},
		{name: "a GPU", inv: inv, req: devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=0"}}},
		{name: "void", inv: inv, req: devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=void"}}, wantSkip: true},
		{name: "unknown id goes to the guard (it words the refusal)", inv: inv, req: devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=9"}}},
		{name: "no inventory, no GPU: skip", invErr: invErr, req: devices.Request{Env: []string{"PATH=/bin"}}, wantSkip: true},
		{name: "no inventory, a GPU: fail closed", invErr: invErr, req: devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=0"}}, wantErr: "names a GPU, but no GPU inventory"},
		{name: "no inventory, a GPU under unknown_device ignore: fail closed", invErr: invErr, unknown: config.UnknownIgnore,
			req: devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=0"}}, wantErr: "names a GPU, but no GPU inventory"},
		{name: "no inventory, a GPU UUID under unknown_device ignore: fail closed", invErr: invErr, unknown: config.UnknownIgnore,
			req: devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=GPU-6c1a2f2e-0000-4000-8000-000000000000"}}, wantErr: "no GPU inventory"},
		{name: "no inventory, no GPU under unknown_device ignore: skip", invErr: invErr, unknown: config.UnknownIgnore,
			req: devices.Request{Env: []string{"PATH=/bin"}}, wantSkip: true},
		{name: "no inventory, all: fail closed", invErr: invErr, req: devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=all"}}, wantErr: "no GPU inventory"},
		{name: "no inventory, privileged naming nothing (declared): skip", invErr: invErr, req: devices.Request{Privileged: true}, wantSkip: true},
		{name: "no inventory, privileged naming a GPU: fail closed", invErr: invErr,
			req: devices.Request{Privileged: true, Env: []string{"NVIDIA_VISIBLE_DEVICES=0"}}, wantErr: "no GPU inventory"},
		{name: "no inventory, privileged under policy all: fail closed", invErr: invErr, privileged: config.PrivilegedAll,
			req: devices.Request{Privileged: true}, wantErr: "no GPU inventory"},
		{name: "no inventory, privileged under policy reject: fail closed", invErr: invErr, privileged: config.PrivilegedReject,
			req: devices.Request{Privileged: true}, wantErr: "no GPU inventory"},
		{name: "privileged naming nothing (declared): skip", inv: inv, req: devices.Request{Privileged: true}, wantSkip: true},
		{name: "privileged under policy all goes to the guard", inv: inv, privileged: config.PrivilegedAll, req: devices.Request{Privileged: true}},
		{name: "no inventory, a /dev/nvidia node: fail closed", invErr: invErr,
			req: devices.Request{Devices: []devices.LinuxDevice{{Path: "/dev/nvidia0", Type: "c", Major: 195, Minor: 0}}}, wantErr: "no GPU inventory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := cfg
			if tc.privileged != "" {
				c.Policy.Privileged = tc.privileged
			}
			if tc.unknown != "" {
				c.Policy.UnknownDevice = tc.unknown
			}
			skip, err := guard.Prescreen(c, tc.inv, tc.invErr, tc.req)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				require.False(t, skip)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.wantSkip, skip)
		})
	}
}

func TestLoadInventory(t *testing.T) {
	cached := []devices.GPU{{Index: 0, UUID: "GPU-c0000000-0000-4000-8000-000000000000", Minor: 0}}
	writeCache := func(t *testing.T, cfg config.Config, mode os.FileMode) {
		t.Helper()
		require.NoError(t, os.MkdirAll(cfg.Ledger.Dir, 0o700))
		inv, err := devices.NewInventory("nvml", cached)
		require.NoError(t, err)
		path := filepath.Join(cfg.Ledger.Dir, devices.CacheFile)
		boot, err := ledger.HostBootID() // as the daemon of this boot writes it
		require.NoError(t, err)
		require.NoError(t, devices.SaveCache(path, inv, boot))
		require.NoError(t, os.Chmod(path, mode))
	}
	for _, tc := range []struct {
		name       string
		source     config.Source
		cache      os.FileMode // 0 = no cache
		wantSource string
		wantUUID   string
		wantErr    []string
	}{
		{name: "static is authoritative, cache or not", source: config.SourceStatic, cache: 0o600, wantSource: "static", wantUUID: gpuUUIDs[0]},
		{name: "auto uses the cache", source: config.SourceAuto, cache: 0o600, wantSource: "nvml", wantUUID: cached[0].UUID},
		{name: "nvml uses the cache (no NVML per container)", source: config.SourceNVML, cache: 0o600, wantSource: "nvml", wantUUID: cached[0].UUID},
		{name: "auto without cache nor /proc: the static list", source: config.SourceAuto, wantSource: "static", wantUUID: gpuUUIDs[0]},
		{name: "a group-writable cache is not trusted", source: config.SourceAuto, cache: 0o660, wantSource: "static", wantUUID: gpuUUIDs[0]},
		{name: "nvml without cache nor /proc: error saying what to do", source: config.SourceNVML,
			wantErr: []string{"no GPU inventory", devices.CacheFile, "gpu-guard-ctl devices --refresh"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := staticConfig(t)
			cfg.Devices.Source = tc.source
			cfg.Devices.ProcRoot = t.TempDir() // a procfs without /proc/driver/nvidia
			require.NoError(t, os.MkdirAll(filepath.Join(cfg.Devices.ProcRoot, "proc"), 0o755))
			if tc.cache != 0 {
				writeCache(t, cfg, tc.cache)
			}
			inv, err := loadInventory(cfg)
			if len(tc.wantErr) > 0 {
				require.Error(t, err)
				for _, s := range tc.wantErr {
					require.Contains(t, err.Error(), s)
				}
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.wantSource, inv.Source)
			_, ok := inv.Lookup(tc.wantUUID)
			require.True(t, ok, "inventory has %s", tc.wantUUID)
		})
	}
}

// TestPoststop: poststop releases the container's claims and drops the queue
// entry a killed create-runtime hook left; a container that appears nowhere
// in the ledger is done without taking the ledger lock, and one that only
// waits (or only holds) takes it only for the write it needs.
func TestPoststop(t *testing.T) {
	ctx := context.Background()
	cfg := staticConfig(t)
	cfg.Ledger.LockTimeout = config.Duration{Duration: 50 * time.Millisecond}
	opened := 0
	e := testEnv(&opened)
	e.lockBudget = 200 * time.Millisecond // a few tries of lock_timeout, for the lock held throughout below
	g, _, err := openGuard(cfg, mustStatic(t, cfg))
	require.NoError(t, err)

	// "holder" holds GPU 1; "killed" waits for it (its hook was SIGKILLed).
	admit := func(id string) guard.Decision {
		d, err := g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndHook, Key: id,
			Owner: ledger.Owner{ContainerID: id, FrontEnd: ledger.FrontEndHook},
			Spec:  devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=1"}}})
		require.NoError(t, err)
		return d
	}
	require.Equal(t, guard.Admit, admit("holder").Result)
	require.Equal(t, guard.Queue, admit("killed").Result)

	poststop := func(id string) error {
		return e.run(ctx, PhasePoststop, cfg, strings.NewReader(`{"id":"`+id+`","status":"stopped","bundle":"/x"}`), io.Discard)
	}
	snapshot := func() ledger.State {
		st, err := g.Ledger().Snapshot(ctx)
		require.NoError(t, err)
		return st
	}

	// With the ledger lock held elsewhere, a container absent from the
	// ledger is still done; one present cannot be (and says so).
	lock := flock.New(g.Ledger().LockPath())
	require.NoError(t, lock.Lock())
	require.NoError(t, poststop("never-seen"))
	err = poststop("killed")
	require.ErrorIs(t, err, ledger.ErrLockTimeout)
	require.Contains(t, err.Error(), "drop the queue entry of container killed")
	require.NotContains(t, err.Error(), "release the GPUs", "it holds nothing: no release is attempted")
	err = poststop("holder")
	require.ErrorIs(t, err, ledger.ErrLockTimeout)
	require.Contains(t, err.Error(), "release the GPUs of container holder")
	require.NotContains(t, err.Error(), "drop the queue entry", "it waits for nothing: no withdraw is attempted")
	require.NoError(t, lock.Unlock())

	require.NoError(t, poststop("killed"))
	require.Empty(t, snapshot().Waiters, "the killed hook's entry is gone")
	require.Len(t, snapshot().Claims, 1)

	require.NoError(t, poststop("holder"))
	require.Empty(t, snapshot().Claims)
	require.NoError(t, poststop("holder"), "idempotent")
}

// A poststop that finds the ledger lock busy tries again, as create-runtime
// does, within a budget of its own: it used to give up after one
// lock_timeout, and under release_on = "remove" little else ends the claim
// (the container is gone; gc keeps an exited holder's claim there unless
// [hook] runtime_roots shows that its runtime deleted it).
func TestPoststopRetriesABusyLock(t *testing.T) {
	ctx := context.Background()
	cfg := staticConfig(t)
	cfg.Ledger.LockTimeout = config.Duration{Duration: 50 * time.Millisecond}
	cfg.Policy.ReleaseOn = config.ReleaseOnRemove
	g, _, err := openGuard(cfg, mustStatic(t, cfg))
	require.NoError(t, err)
	d, err := g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndHook, Key: "holder",
		Owner: ledger.Owner{ContainerID: "holder", FrontEnd: ledger.FrontEndHook},
		Spec:  devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=1"}}})
	require.NoError(t, err)
	require.Equal(t, guard.Admit, d.Result)

	lock := flock.New(g.Ledger().LockPath())
	require.NoError(t, lock.Lock())
	// Held throughout: the error says what ends the claim under "remove".
	e := defaultEnv()
	e.lockBudget = 120 * time.Millisecond
	err = e.run(ctx, PhasePoststop, cfg, strings.NewReader(`{"id":"holder","status":"stopped","bundle":"/x"}`), io.Discard)
	require.ErrorIs(t, err, ledger.ErrLockTimeout)
	require.ErrorContains(t, err, "gpu-guard-ctl release --container holder")
	require.NotContains(t, err.Error(), "gc", "gc keeps an exited holder's claim under release_on = \"remove\"")

	e = defaultEnv()
	waits := 0
	e.openGuard = func(cfg config.Config, inv *devices.Inventory) (guardAPI, func(), error) {
		// Let go of the lock once a later try waits for it: one try
		// alone never gets it.
		return openGuardWith(cfg, inv, func() {
			if waits++; waits == 3 {
				require.NoError(t, lock.Unlock())
			}
		})
	}
	err = e.run(ctx, PhasePoststop, cfg, strings.NewReader(`{"id":"holder","status":"stopped","bundle":"/x"}`), io.Discard)
	require.NoError(t, err)
	st, err := g.Ledger().Snapshot(ctx)
	require.NoError(t, err)
	require.Empty(t, st.Claims, "released once the lock was free")
	require.GreaterOrEqual(t, waits, 3)
}

func mustStatic(t *testing.T, cfg config.Config) *devices.Inventory {
	t.Helper()
	inv, err := devices.Discover(cfg.Devices, nil)
	require.NoError(t, err)
	return inv
}
