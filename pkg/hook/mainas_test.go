// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

func TestParseArgs(t *testing.T) {
	for _, tc := range []struct {
		name    string
		args    []string
		want    Invocation
		wantErr string // "" = none
	}{
		{name: "phase alone", args: []string{"poststop"}, want: Invocation{Program: "p", Phase: PhasePoststop}},
		{name: "every option", args: []string{"create-runtime", "--config", "/c.toml", "--state-dir=/s", "-wait"},
			want: Invocation{Program: "p", Phase: PhaseCreateRuntime, Config: "/c.toml", StateDir: "/s", Options: Options{Wait: true}}},
		{name: "options end at --", args: []string{"create-runtime", "--"}, want: Invocation{Program: "p", Phase: PhaseCreateRuntime}},
		{name: "no phase", args: nil, wantErr: "no phase (want create-runtime or poststop)"},
		{name: "version is no phase", args: []string{"version"}, wantErr: `unknown phase "version"`},
		{name: "add-hooks is no phase", args: []string{"add-hooks", "x"}, wantErr: `unknown phase "add-hooks"`},
		{name: "help is no phase", args: []string{"--help"}, wantErr: `unknown phase "--help"`},
		{name: "an option before the phase", args: []string{"--wait", "create-runtime"}, wantErr: `unknown phase "--wait"`},
		{name: "unknown flag", args: []string{"poststop", "--bogus"}, wantErr: "flag provided but not defined: -bogus"},
		{name: "flag without its value", args: []string{"poststop", "--config"}, wantErr: "flag needs an argument: -config"},
		{name: "bad bool", args: []string{"create-runtime", "--wait=maybe"}, wantErr: `invalid boolean value "maybe" for -wait`},
		{name: "extra argument", args: []string{"poststop", "x"}, wantErr: `unexpected argument "x"`},
		{name: "extra argument after --", args: []string{"poststop", "--", "--wait"}, wantErr: `unexpected argument "--wait"`},
		{name: "help after the phase", args: []string{"poststop", "-h"}, wantErr: "flag: help requested"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseArgs("p", tc.args)
			if tc.wantErr == "" {
				require.NoError(t, err)
				require.Equal(t, tc.want, got)
				return
			}
			require.ErrorIs(t, err, ErrArgs)
			require.Contains(t, err.Error(), tc.wantErr)
			require.Equal(t, Invocation{}, got)
			if strings.Contains(tc.name, "help") && tc.args != nil && tc.args[0] == PhasePoststop {
				require.ErrorIs(t, err, flag.ErrHelp, "the binary prints the usage alone for it")
			}
		})
	}
}

func TestProcessGetenv(t *testing.T) {
	p := Process{Env: []string{"A=1", config.EnvPath + "=/first", "B", config.EnvPath + "=/last=x"}}
	require.Equal(t, "/last=x", p.getenv(config.EnvPath), "the last entry wins, as for exec.Cmd")
	require.Equal(t, "1", p.getenv("A"))
	require.Empty(t, p.getenv("B"), "an entry without '=' sets nothing")
	require.Empty(t, Process{}.getenv(config.EnvPath))
}

// TestProcessParent: the parent of a Process is read from /proc as
// getppid(2) would answer that process, and a process gone reads as 0 (a
// change: the hook's goneCheck takes its runtime for gone).
func TestProcessParent(t *testing.T) {
	child := exec.Command("sleep", "3600")
	require.NoError(t, child.Start())
	t.Cleanup(func() { _ = child.Process.Kill(); _ = child.Wait() })
	require.Equal(t, os.Getpid(), Process{Pid: child.Process.Pid}.parent()())
	require.Equal(t, os.Getppid(), Process{Pid: os.Getpid()}.parent()())

	gone := exec.Command("/bin/true")
	require.NoError(t, gone.Run())
	require.Zero(t, Process{Pid: gone.ProcessState.Pid()}.parent()())
}

// writeTOML writes cfg (as staticConfig makes it) where a hook process
// reads it.
func writeTOML(t *testing.T, cfg config.Config) string {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "version = 1\n[ledger]\ndir = %q\n[devices]\nsource = %q\nproc_root = %q\n", cfg.Ledger.Dir, cfg.Devices.Source, cfg.Devices.ProcRoot)
	for _, g := range cfg.Devices.Static {
		fmt.Fprintf(&b, "[[devices.static]]\nindex = %d\nuuid = %q\nminor = %d\n", g.Index, g.UUID, g.Minor)
	}
	fmt.Fprintf(&b, "[hook]\nruntime_roots = [%q]\n", cfg.Hook.RuntimeRoots[0])
	path := filepath.Join(t.TempDir(), "config.toml")
	require.NoError(t, os.WriteFile(path, []byte(b.String()), 0o600))
	return path
}

// TestMainAsAnswersAsMain: for this very process, MainAs answers exactly
// what Main answers (one path): the same exit code and the same stderr for
// an admission, a refusal and a configuration that does not load.
func TestMainAsAnswersAsMain(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the container markers are in " + DefaultMarkerDir + " (root only)")
	}
	cfg := staticConfig(t)
	cfgPath := writeTOML(t, cfg)
	bad := filepath.Join(t.TempDir(), "bad.toml")
	require.NoError(t, os.WriteFile(bad, []byte("[policy]\non_conflict = \"maybe\"\n"), 0o600))
	holder, _ := containerProcess(t)
	other, _ := containerProcess(t)
	ctx := context.Background()
	self := Process{Pid: os.Getpid()}
	answer := func(main bool, inv Invocation, stdin string) (int, string) {
		var stderr bytes.Buffer
		if main {
			return Main(ctx, inv, strings.NewReader(stdin), &stderr), stderr.String()
		}
		return MainAs(ctx, inv, self, strings.NewReader(stdin), &stderr), stderr.String()
	}
	inv := Invocation{Program: "nri-gpu-guard-hook", Phase: PhaseCreateRuntime, Config: cfgPath}
	code, stderr := answer(false, inv, dropsMarker(t, stateFor(t, "holder", holder, "NVIDIA_VISIBLE_DEVICES=1")))
	require.Equal(t, 0, code, stderr)

	for _, tc := range []struct {
		name     string
		inv      Invocation
		state    string
		wantCode int
	}{
		{name: "refused: the GPU is held", inv: inv, state: stateFor(t, "other", other, "NVIDIA_VISIBLE_DEVICES=1"), wantCode: 75},
		{name: "configuration does not load", inv: Invocation{Program: "x", Phase: PhaseCreateRuntime, Config: bad},
			state: stateFor(t, "other", other, "NVIDIA_VISIBLE_DEVICES=1"), wantCode: 1},
		{name: "no GPU", inv: inv, state: stateFor(t, "plain", other, "PATH=/bin")},
		{name: "unknown phase", inv: Invocation{Program: "x", Phase: "prestart"}, wantCode: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mainCode, mainErr := answer(true, tc.inv, tc.state)
			asCode, asErr := answer(false, tc.inv, tc.state)
			require.Equal(t, tc.wantCode, mainCode, mainErr)
			require.Equal(t, mainCode, asCode)
			require.Equal(t, mainErr, asErr)
		})
	}
}

// TestMainAsConfigFromProcess: MainAs loads the configuration
// $NRI_GPU_GUARD_CONFIG names in the hook process's environment, never the
// one this process's environment names; Main reads this process's.
func TestMainAsConfigFromProcess(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the container markers are in " + DefaultMarkerDir + " (root only)")
	}
	cfg := staticConfig(t)
	good := writeTOML(t, cfg)
	bad := filepath.Join(t.TempDir(), "bad.toml")
	require.NoError(t, os.WriteFile(bad, []byte("[policy]\non_conflict = \"maybe\"\n"), 0o600))
	t.Setenv(config.EnvPath, bad)
	pid, _ := containerProcess(t)
	state := dropsMarker(t, stateFor(t, "c1", pid, "NVIDIA_VISIBLE_DEVICES=2"))
	inv := Invocation{Program: "nri-gpu-guard-hook", Phase: PhaseCreateRuntime}

	var stderr bytes.Buffer
	require.Equal(t, 1, Main(context.Background(), inv, strings.NewReader(state), &stderr), "Main reads this process's environment")
	require.Contains(t, stderr.String(), "on_conflict")

	stderr.Reset()
	code := MainAs(context.Background(), inv, Process{Pid: os.Getpid(), Env: []string{config.EnvPath + "=" + good}}, strings.NewReader(state), &stderr)
	require.Equal(t, 0, code, stderr.String())
	l, err := ledger.OpenReadOnly(cfg.Ledger.Dir, ledger.Options{})
	require.NoError(t, err)
	st, err := l.Snapshot(context.Background())
	require.NoError(t, err)
	require.Len(t, st.Claims, 1, "claimed in the ledger of the configuration the hook process named")
	require.Equal(t, gpuUUIDs[2], st.Claims[0].Device.UUID)
}

// TestMainAsWithoutPid: a caller that names no process gets a refusal,
// never a run as this process.
func TestMainAsWithoutPid(t *testing.T) {
	var stderr bytes.Buffer
	code := MainAs(context.Background(), Invocation{Program: "p", Phase: PhaseCreateRuntime}, Process{}, strings.NewReader("{"), &stderr)
	require.Equal(t, 1, code)
	require.Contains(t, stderr.String(), "no hook process (pid 0)")
}

// dropsMarker removes, at the end of the test, the marker create-runtime
// leaves in DefaultMarkerDir for the container of state (no poststop runs
// for it here), and returns state.
func dropsMarker(t *testing.T, state string) string {
	t.Helper()
	var st specs.State
	require.NoError(t, json.Unmarshal([]byte(state), &st))
	t.Cleanup(func() { _ = os.Remove(filepath.Join(DefaultMarkerDir, markerName(st.ID, st.Bundle))) })
	return state
}
