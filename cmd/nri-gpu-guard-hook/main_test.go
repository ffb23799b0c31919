// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/version"
)

func TestRunExitCodes(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "bad.toml")
	require.NoError(t, os.WriteFile(bad, []byte("[policy]\non_conflict = \"maybe\"\n"), 0o600))
	good := filepath.Join(t.TempDir(), "good.toml")
	require.NoError(t, os.WriteFile(good, nil, 0o600))
	wantVersion := version.String(program) + "\n"
	for _, tc := range []struct {
		name    string
		args    []string
		stdin   string
		want    int
		wantErr string // substring of stderr; "" = stderr must be empty
		wantOut string // stdout, exactly
	}{
		{name: "version", args: []string{"version"}, wantOut: wantVersion},
		{name: "--version", args: []string{"--version"}, wantOut: wantVersion},
		{name: "--help", args: []string{"--help"}, wantOut: "usage: " + program + " create-runtime|poststop [--config PATH] [--state-dir DIR] [--wait]\n" +
			"       " + program + " add-hooks [--config PATH] [--state-dir DIR] [--wait] [--no-poststop] [--path HOOK] [--relay RELAY | --no-relay] CONFIG.JSON\n" +
			"       " + program + " serve [--socket PATH]\n" +
			"       " + program + " version\n" +
			"  -config string\n    \tconfiguration file (default $NRI_GPU_GUARD_CONFIG or /etc/nri-gpu-guard/config.toml)\n" +
			"  -state-dir string\n    \tledger directory (default [ledger] dir)\n" +
			"  -wait\n    \tcreate-runtime: wait in the queue for a busy GPU (plain runc only; ignored under conmon and containerd-shim)\n"},
		{name: "no phase", args: nil, want: 2, wantErr: "usage: " + program + " create-runtime|poststop"},
		{name: "unknown phase", args: []string{"prestart"}, want: 2, wantErr: `unknown phase "prestart"`},
		{name: "the daemon's word is not a phase", args: []string{"hook", "poststop"}, want: 2, wantErr: `unknown phase "hook"`},
		{name: "unknown flag", args: []string{"poststop", "--bogus"}, want: 2, wantErr: "usage"},
		{name: "stray argument", args: []string{"poststop", "x"}, want: 2, wantErr: `unexpected argument "x"`},
		{name: "unknown flag is named", args: []string{"create-runtime", "--bogus"}, want: 2, wantErr: program + ": flag provided but not defined: -bogus\nusage: "},
		{name: "help after the phase: the usage alone", args: []string{"poststop", "-h"}, want: 2, wantErr: "usage: " + program + " create-runtime|poststop"},
		{name: "serve takes no argument", args: []string{"serve", "x"}, want: 2, wantErr: `serve: unexpected argument "x"`},
		{name: "serve: unknown flag", args: []string{"serve", "--bogus"}, want: 2, wantErr: "usage: " + program + " serve [--socket PATH]"},
		{name: "invalid config fails closed", args: []string{"create-runtime", "--config", bad}, want: 1,
			wantErr: "hook create-runtime: container refused: configuration: "},
		{name: "invalid config in poststop: how to release", args: []string{"poststop", "--config", bad}, want: 1,
			wantErr: "hook poststop: a stopped container (its id is unknown): its GPUs are not released: configuration: "},
		{name: "relative state dir", args: []string{"poststop", "--config", good, "--state-dir", "rel"}, want: 1, wantErr: "ledger.dir"},
		{name: "unreadable input in poststop: how to release", args: []string{"poststop", "--config", good}, stdin: "{", want: 1,
			wantErr: "the GPUs of a stopped container (its id is unknown) are not released: run `gpu-guard-ctl gc`"},
		{name: "empty stdin fails closed", args: []string{"create-runtime", "--config", good}, want: 1,
			wantErr: program + ": hook create-runtime: container refused: cannot read the runtime's input: stdin is empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			got := run(tc.args, strings.NewReader(tc.stdin), &stdout, &stderr)
			assert.Equal(t, tc.want, got, stderr.String())
			assert.Equal(t, tc.wantOut, stdout.String())
			if tc.wantErr == "" {
				assert.Empty(t, stderr.String())
			} else {
				assert.Contains(t, stderr.String(), tc.wantErr)
			}
		})
	}
}

// Both phases of a container that names no GPU succeed without the ledger:
// the state dir here is a FIFO, which any ledger access would fail on.
func TestNoGPUNeverReadsLedger(t *testing.T) {
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "config.toml")
	require.NoError(t, os.WriteFile(cfgPath, []byte("[devices]\nsource = \"static\"\nproc_root = \""+filepath.Join(dir, "no-driver")+"\"\n[[devices.static]]\nindex = 0\n"+
		"uuid = \"GPU-6c1a2f2e-0000-4000-8000-000000000000\"\nminor = 0\n"), 0o600))
	fifo := filepath.Join(dir, "state")
	require.NoError(t, syscall.Mkfifo(fifo, 0o600))
	state := func(env ...string) string { return bundleState(t, specs.StateStopped, env...) }
	for _, phase := range []string{"create-runtime", "poststop"} {
		var stdout, stderr bytes.Buffer
		code := run([]string{phase, "--config", cfgPath, "--state-dir", fifo}, strings.NewReader(state("PATH=/bin")), &stdout, &stderr)
		require.Equal(t, 0, code, "%s: %s", phase, stderr.String())
		require.Empty(t, stderr.String())

		// The same with a GPU named reaches the ledger and fails on it.
		stderr.Reset()
		code = run([]string{phase, "--config", cfgPath, "--state-dir", fifo}, strings.NewReader(state("NVIDIA_VISIBLE_DEVICES=0")), &stdout, &stderr)
		require.Equal(t, 1, code, phase)
		require.Contains(t, stderr.String(), fifo)
	}
}

// Plain runc: the bundle's config.json is edited between create and delete
// to name no GPU. The hook binary's poststop still releases the claim: it
// takes its no-GPU short cut only when create-runtime left no marker for the
// container, and here it did.
func TestPoststopAfterTheBundleWasEdited(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the container markers are in " + hook.DefaultMarkerDir + " (root only)")
	}
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "config.toml")
	require.NoError(t, os.WriteFile(cfgPath, []byte("[ledger]\ndir = \""+filepath.Join(dir, "state")+"\"\n[devices]\nsource = \"static\"\nproc_root = \""+filepath.Join(dir, "no-driver")+"\"\n"+
		"[[devices.static]]\nindex = 0\nuuid = \"GPU-6c1a2f2e-0000-4000-8000-000000000000\"\nminor = 0\n"), 0o600))
	require.NoError(t, os.Mkdir(filepath.Join(dir, "state"), 0o700))
	state := bundleState(t, specs.StateCreating, "NVIDIA_VISIBLE_DEVICES=0")
	var st specs.State
	require.NoError(t, json.Unmarshal([]byte(state), &st))
	var stdout, stderr bytes.Buffer
	require.Equal(t, 0, run([]string{"create-runtime", "--config", cfgPath}, strings.NewReader(state), &stdout, &stderr), stderr.String())
	claims := func() int {
		l, err := ledger.OpenReadOnly(filepath.Join(dir, "state"), ledger.Options{})
		require.NoError(t, err)
		s, err := l.Snapshot(t.Context())
		require.NoError(t, err)
		return len(s.Claims)
	}
	require.Equal(t, 1, claims())

	data, err := json.Marshal(specs.Spec{Version: specs.Version, Process: &specs.Process{Env: []string{"PATH=/bin"}, Capabilities: podmanCaps()}})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(st.Bundle, "config.json"), data, 0o600))
	require.Equal(t, 0, run([]string{"poststop", "--config", cfgPath}, strings.NewReader(state), &stdout, &stderr), stderr.String())
	require.Zero(t, claims(), "released although config.json names no GPU any more")

	// The marker went with the release: the next no-GPU poststop of the
	// same container id and bundle is the short cut again (the FIFO as state
	// dir fails any ledger access).
	fifo := filepath.Join(dir, "fifo")
	require.NoError(t, syscall.Mkfifo(fifo, 0o600))
	require.Equal(t, 0, run([]string{"poststop", "--config", cfgPath, "--state-dir", fifo}, strings.NewReader(state), &stdout, &stderr), stderr.String())
}

// bundleState writes a bundle whose config.json sets env and returns the OCI
// state of container c1 in it, as a runtime hands it to a hook.
func bundleState(t *testing.T, status specs.ContainerState, env ...string) string {
	t.Helper()
	bundle := t.TempDir()
	data, err := json.Marshal(specs.Spec{Version: specs.Version, Process: &specs.Process{Env: env, Capabilities: podmanCaps()}})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
	st, err := json.Marshal(specs.State{Version: specs.Version, ID: "c1", Status: status, Bundle: bundle})
	require.NoError(t, err)
	return string(st)
}

// A container that can reach no GPU is answered before the configuration is
// read, so neither phase fails it for a configuration that does not load
// (nothing it could do reaches a GPU); one that names a GPU is still refused
// for that configuration, with the configuration's error.
func TestNoGPUNeedsNoConfig(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.toml")
	require.NoError(t, os.WriteFile(bad, []byte("[policy]\non_conflict = \"maybe\"\n"), 0o600))
	state := func(env ...string) string { return bundleState(t, specs.StateCreating, env...) }
	for _, phase := range []string{"create-runtime", "poststop"} {
		var stdout, stderr bytes.Buffer
		code := run([]string{phase, "--config", bad}, strings.NewReader(state("PATH=/bin")), &stdout, &stderr)
		require.Equal(t, 0, code, "%s: %s", phase, stderr.String())
		require.Empty(t, stderr.String())

		stderr.Reset()
		code = run([]string{phase, "--config", bad}, strings.NewReader(state("NVIDIA_VISIBLE_DEVICES=0")), &stdout, &stderr)
		require.Equal(t, 1, code, phase)
		require.Contains(t, stderr.String(), "on_conflict")
		if phase == "create-runtime" {
			require.Contains(t, stderr.String(), "hook "+phase+": container c1 refused: configuration: ")
			require.Contains(t, stderr.String(), ". Fix the configuration (`gpu-guard-ctl check-config` says what is wrong), then create the container again")
			continue
		}
		// The container stopped already: poststop refuses nothing, it
		// could not release, and says how to.
		require.NotContains(t, stderr.String(), "refused")
		for _, s := range []string{"hook poststop: container c1: its GPUs are not released: configuration: ", "gpu-guard-ctl check-config",
			"then run `sudo gpu-guard-ctl release --container c1 --reason \"poststop failed\"` (or `gpu-guard-ctl gc`"} {
			require.Contains(t, stderr.String(), s)
		}
	}
}

// forbiddenDeps are packages the hook binary must not link: it starts once per
// container and phase, and every one of these costs init time and size (or,
// for go-nvml, cgo and a driver library) on a path that never uses it.
var forbiddenDeps = []string{
	"github.com/containerd/nri",
	"github.com/containerd/ttrpc",
	"google.golang.org/protobuf",
	"google.golang.org/grpc",
	"github.com/prometheus",
	"github.com/spf13/cobra",
	"github.com/NVIDIA/go-nvml",
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices/nvmlloader",
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/nriplugin",
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/metrics",
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/daemon",
	"net/http",
	"expvar",
	"runtime/cgo",
}

// TestHookDeps lists what the binary links, as the release build does
// (CGO_ENABLED=0), and fails on any forbidden package.
func TestHookDeps(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("needs the go command: ", err)
	}
	cmd := exec.Command(goBin, "list", "-tags", "nri_no_wasm", "-deps", ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.Output()
	require.NoError(t, err)
	deps := strings.Fields(string(out))
	require.Contains(t, deps, "github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook", "the listing is of the hook binary")
	for _, d := range deps {
		for _, f := range forbiddenDeps {
			if d == f || strings.HasPrefix(d, f+"/") {
				t.Errorf("%s links %s (forbidden: %s); trace it with `go list -deps -f '{{.ImportPath}}: {{.Imports}}' ./cmd/%s`",
					program, d, f, program)
			}
		}
	}
}

// podmanCaps is podman's default capability set (no CAP_MKNOD): a spec
// without a capabilities object counts as holding every capability, which
// a container the runtime gives no device cgroup (these tests' states name
// no process in one) turns into a claim of every GPU.
func podmanCaps() *specs.LinuxCapabilities {
	caps := []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_NET_BIND_SERVICE",
		"CAP_SETFCAP", "CAP_SETGID", "CAP_SETPCAP", "CAP_SETUID", "CAP_SYS_CHROOT"}
	return &specs.LinuxCapabilities{Bounding: caps, Effective: caps, Permitted: caps}
}
