// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

// Helpers of the process tests: the real nri-gpu-guard-hook and gpu-guard-ctl
// binaries, built once, run as a runtime and an operator run them, on a
// hook-only host (a static inventory of fake GPUs, a ledger in a temp dir).
// Synchronisation is on conditions only (ledger state, process exits), each
// waited for with a deadline.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/syncbuf"
	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testtmp"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// condTimeout bounds every wait for a condition; a passing run takes
// milliseconds per wait.
const condTimeout = 60 * time.Second

var (
	buildOnce sync.Once
	binDir    string
	hookBin   string
	ctlBin    string
	buildErr  error
	buildSkip string
)

// buildBinaries builds nri-gpu-guard-hook and gpu-guard-ctl once per test
// binary (removed by TestMain).
func buildBinaries(t *testing.T) {
	t.Helper()
	buildOnce.Do(func() {
		if testing.Short() {
			buildSkip = "process tests build the binaries: skipped in -short mode"
			return
		}
		goBin, err := exec.LookPath("go")
		if err != nil {
			buildSkip = "process tests build the binaries and need the go command: " + err.Error()
			return
		}
		if binDir, buildErr = os.MkdirTemp("", "gg-bin-"); buildErr != nil {
			return
		}
		hookBin, ctlBin = filepath.Join(binDir, "nri-gpu-guard-hook"), filepath.Join(binDir, "gpu-guard-ctl")
		for _, b := range []struct{ out, pkg string }{{hookBin, "."}, {ctlBin, "../gpu-guard-ctl"}} {
			cmd := exec.Command(goBin, "build", "-tags", "nri_no_wasm", "-o", b.out, b.pkg)
			if out, err := cmd.CombinedOutput(); err != nil {
				buildErr = fmt.Errorf("go build %s: %w\n%s", b.pkg, err, out)
				return
			}
		}
	})
	if buildSkip != "" {
		t.Skip(buildSkip)
	}
	require.NoError(t, buildErr)
}

func TestMain(m *testing.M) {
	os.Exit(testtmp.Main(m, func() {
		if binDir != "" {
			_ = os.RemoveAll(binDir)
		}
		// The container markers of the hooks these tests ran (TMPDIR is
		// still the tests' root here).
		if _, err := hook.RemoveMarkersUnder(hook.DefaultMarkerDir, os.TempDir()); err != nil {
			fmt.Fprintln(os.Stderr, err)
		}
	}))
}

// gpuUUIDs is the static inventory of every host: GPU i has minor i.
var gpuUUIDs = []string{
	"GPU-6c1a2f2e-0000-4000-8000-000000000000",
	"GPU-6c1a2f2e-0000-4000-8000-000000000001",
	"GPU-6c1a2f2e-0000-4000-8000-000000000002",
}

// host is one hook-only host: a configuration, a ledger dir below a safe
// parent chain (the test's temp dir: root- or euid-owned, 0700, below the
// sticky /tmp) and bundles.
type host struct {
	t        *testing.T
	base     string
	stateDir string
	cfgPath  string
	// waitCfgPath is the same host with hook.poll_interval at its maximum
	// (a minute): a waiting hook queues with its first Admit, then stays
	// idle for the length of a test, so that nothing it does races the
	// test's steps.
	waitCfgPath string
}

func newHost(t *testing.T) *host {
	t.Helper()
	buildBinaries(t)
	base := t.TempDir()
	h := &host{t: t, base: base, stateDir: filepath.Join(base, "state"),
		cfgPath: filepath.Join(base, "config.toml"), waitCfgPath: filepath.Join(base, "config-idle.toml")}
	require.NoError(t, ledger.CheckDirChain(h.stateDir), "the test's state dir must have a safe parent chain")
	for path, poll := range map[string]string{h.cfgPath: "20ms", h.waitCfgPath: "1m"} {
		var b strings.Builder
		fmt.Fprintf(&b, "version = 1\n[ledger]\ndir = %q\nlock_timeout = \"5s\"\n[devices]\nsource = \"static\"\nproc_root = %q\n", h.stateDir, filepath.Join(h.stateDir, "no-driver"))
		for i, u := range gpuUUIDs {
			fmt.Fprintf(&b, "[[devices.static]]\nindex = %d\nuuid = %q\nminor = %d\nmodel = \"Fake GPU\"\n", i, u, i)
		}
		// runtime_roots = []: recover must not adopt the containers of the
		// machine the tests run on (adopt_test.go names its own roots).
		fmt.Fprintf(&b, "[hook]\npoll_interval = %q\nwait_timeout = \"10m\"\nruntime_roots = []\n", poll)
		require.NoError(t, os.WriteFile(path, []byte(b.String()), 0o600))
	}
	return h
}

// ctrProcess starts a process standing for a container's init (what the OCI
// state's pid names); it is killed at the end of the test.
func (h *host) ctrProcess() int {
	h.t.Helper()
	return h.ctrCmd().Process.Pid
}

// ctrCmd is ctrProcess, for a test that ends the container itself.
func (h *host) ctrCmd() *exec.Cmd {
	h.t.Helper()
	cmd := exec.Command("sleep", "3600")
	require.NoError(h.t, cmd.Start())
	h.t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd
}

// end kills a container process and reaps it, as its runtime does before
// running the poststop hook.
func end(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	require.NoError(t, cmd.Process.Kill())
	_ = cmd.Wait()
}

// state writes the bundle of container id (config.json with env) and returns
// the OCI state a runtime gives the hook on stdin.
func (h *host) state(id string, pid int, env ...string) []byte {
	h.t.Helper()
	bundle := filepath.Join(h.base, "bundles", id)
	require.NoError(h.t, os.MkdirAll(bundle, 0o700))
	spec, err := json.Marshal(specs.Spec{Version: specs.Version, Process: &specs.Process{Env: append([]string{"PATH=/bin"}, env...), Capabilities: podmanCaps()}})
	require.NoError(h.t, err)
	require.NoError(h.t, os.WriteFile(filepath.Join(bundle, "config.json"), spec, 0o600))
	st, err := json.Marshal(specs.State{Version: specs.Version, ID: id, Status: specs.StateCreated, Pid: pid, Bundle: bundle})
	require.NoError(h.t, err)
	return st
}

func gpuEnv(i int) string { return fmt.Sprintf("NVIDIA_VISIBLE_DEVICES=%d", i) }

// result is how a process ended.
type result struct {
	code           int
	stdout, stderr string
}

func (r result) String() string {
	return fmt.Sprintf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
}

// runProc runs a binary to its end (bounded by condTimeout).
func runProc(t *testing.T, stdin []byte, bin string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), condTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stdin = bytes.NewReader(stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		require.NoError(t, err, "run %s %v", bin, args)
	}
	require.NoError(t, ctx.Err(), "%s %v did not end within %s", bin, args, condTimeout)
	return result{code: cmd.ProcessState.ExitCode(), stdout: stdout.String(), stderr: stderr.String()}
}

// hook runs `nri-gpu-guard-hook PHASE --config …` for container id.
func (h *host) hook(phase, id string, pid int, env ...string) result {
	h.t.Helper()
	return runProc(h.t, h.state(id, pid, env...), hookBin, phase, "--config", h.cfgPath)
}

// ctl runs gpu-guard-ctl with the host's configuration.
func (h *host) ctl(args ...string) result {
	h.t.Helper()
	return runProc(h.t, nil, ctlBin, append([]string{"--config", h.cfgPath}, args...)...)
}

// proc is a long-running child (a waiting hook, `gpu-guard-ctl run`).
type proc struct {
	cmd    *exec.Cmd
	stderr *syncBuffer
	done   chan struct{}
}

// syncBuffer is the tests' shared output buffer (internal/syncbuf).
type syncBuffer = syncbuf.Buffer

func startProc(t *testing.T, stdin []byte, bin string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Stdin = bytes.NewReader(stdin)
	p := &proc{cmd: cmd, stderr: &syncBuffer{}, done: make(chan struct{})}
	cmd.Stderr = p.stderr
	require.NoError(t, cmd.Start())
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.done
	})
	return p
}

// snapshot reads the host's ledger as a fresh reader does.
func (h *host) snapshot() (ledger.State, error) {
	l, err := ledger.OpenReadOnly(h.stateDir, ledger.Options{})
	if err != nil {
		return ledger.State{}, err
	}
	return l.Snapshot(context.Background())
}

// holders maps GPU index to the container id holding it.
func (h *host) holders(st ledger.State) map[string]string {
	out := map[string]string{}
	for _, c := range st.Claims {
		out[c.Device.Index] = c.Owner.ContainerID
	}
	return out
}

func waiterKeys(st ledger.State) []string {
	var out []string
	for _, w := range st.Waiters {
		out = append(out, w.Key)
	}
	return out
}

// waitFor polls cond until it holds, failing after condTimeout with desc.
func (h *host) waitFor(desc string, cond func() bool) {
	h.t.Helper()
	deadline := time.Now().Add(condTimeout)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			h.t.Fatalf("timed out after %s waiting for %s", condTimeout, desc)
		}
		<-tick.C
	}
}
