// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
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
