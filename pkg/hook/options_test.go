// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"

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
	id := NewTicketID()
	require.True(t, validTicket(id), id)
	require.Len(t, id, ticketLen)
	require.NotEqual(t, id, NewTicketID())
	for _, tc := range []struct {
		env  []string
		want string
	}{
		{[]string{"PATH=/bin", TicketEnv + "=" + id}, id},
		{[]string{TicketEnv + "=" + NewTicketID(), TicketEnv + "=" + id}, id}, // the last one wins, as in the runtime
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

// A --wait hook stops waiting 2 s before the timeout its own definition in
// config.json gives it (plain runc kills it there); other hooks and
// definitions without a timeout change nothing.
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
		}}, 58 * time.Second, true},
		{"no timeout", &specs.Hooks{CreateRuntime: []specs.Hook{guardWait}}, 0, false},
		{"not waiting", &specs.Hooks{CreateRuntime: []specs.Hook{{Path: guardWait.Path, Args: []string{"nri-gpu-guard-hook", "create-runtime"}, Timeout: sec(60)}}}, 0, false},
		{"too short to wait", &specs.Hooks{CreateRuntime: []specs.Hook{func() specs.Hook { h := guardWait; h.Timeout = sec(2); return h }()}}, 0, false},
		{"no hooks", nil, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bundle := t.TempDir()
			data, err := json.Marshal(specs.Spec{Version: specs.Version, Hooks: tc.hooks})
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
			got, ok := ownHookTimeout(bundle)
			require.Equal(t, tc.ok, ok)
			require.Equal(t, tc.want, got)
		})
	}
	_, ok := ownHookTimeout(filepath.Join(t.TempDir(), "missing"))
	require.False(t, ok)
}

// A container whose runtime named no cgroup has the cgroup its process is
// in recorded, when that cgroup is its own (its leaf names the container);
// a process left in a shared cgroup records none.
func TestCgroupRecordedFromTheProcess(t *testing.T) {
	for _, tc := range []struct {
		id, cgroup, want string
	}{
		{"train", "0::/train\n", "/train"},
		{"train", "0::/system.slice/runc-train.scope\n", "/system.slice/runc-train.scope"},
		{"train", "12:pids:/train\n11:memory:/train\n", "/train"},
		{"train", "0::/user.slice/user-0.slice/session-1.scope\n", ""},
		{"a", "0::/user.slice/data\n", ""},
	} {
		t.Run(tc.id+" "+tc.want, func(t *testing.T) {
			root := t.TempDir()
			fakeProc(t, root, 4242, 1, "app")
			require.NoError(t, os.WriteFile(filepath.Join(root, "4242", "cgroup"), []byte(tc.cgroup), 0o644))
			cfg := staticConfig(t)
			opened := 0
			e := testEnv(&opened)
			e.procRoot = root
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
