// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// buildRelease builds gpu-guard-ctl as `make build` does (no cgo) and its
// companion nri-gpu-guard (cgo, NVML) into one directory, as the package
// installs them.
func buildRelease(t *testing.T) (dir string) {
	t.Helper()
	if testing.Short() {
		t.Skip("builds the binaries: skipped in -short mode")
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("needs the go command: ", err)
	}
	dir = t.TempDir()
	for _, b := range []struct{ pkg, cgo string }{{".", "0"}, {"../nri-gpu-guard", "1"}} {
		cmd := exec.Command(goBin, "build", "-tags", "nri_no_wasm", "-o", dir+"/", b.pkg)
		cmd.Env = append(os.Environ(), "CGO_ENABLED="+b.cgo)
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "go build %s: %s", b.pkg, out)
	}
	return dir
}

type run struct {
	code           int
	stdout, stderr string
}

func runBin(t *testing.T, env []string, bin string, args ...string) run {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = env
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	if ee, ok := errors.AsType[*exec.ExitError](err); ok {
		code = ee.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return run{code: code, stdout: stdout.String(), stderr: stderr.String()}
}

// TestReleaseCtlHandsNVMLToTheDaemonBinary: the release gpu-guard-ctl is
// static; a command that needs NVML (ps, discovery through NVML) is run by
// `nri-gpu-guard ctl` from the same directory, with the same arguments, so
// its output is the daemon binary's to the byte; without that binary it fails
// saying which binary it needs. Commands that need no NVML run without it.
func TestReleaseCtlHandsNVMLToTheDaemonBinary(t *testing.T) {
	dir := buildRelease(t)
	ctl, daemon := filepath.Join(dir, "gpu-guard-ctl"), filepath.Join(dir, "nri-gpu-guard")

	f, err := elf.Open(ctl)
	require.NoError(t, err)
	for _, p := range f.Progs {
		assert.NotEqual(t, elf.PT_INTERP, p.Type, "gpu-guard-ctl is dynamically linked")
	}
	require.NoError(t, f.Close())

	base := t.TempDir()
	state := filepath.Join(base, "state")
	require.NoError(t, os.Mkdir(state, 0o700))
	config := func(source string) string {
		path := filepath.Join(base, source+".toml")
		cfg := fmt.Sprintf("version = 1\n[ledger]\ndir = %q\n[devices]\nsource = %q\nproc_root = %q\n"+
			"[[devices.static]]\nindex = 0\nuuid = \"GPU-6c1a2f2e-0000-4000-8000-000000000000\"\nminor = 0\n",
			state, source, filepath.Join(base, "proc"))
		require.NoError(t, os.WriteFile(path, []byte(cfg), 0o600))
		return path
	}
	// No nri-gpu-guard on PATH: the one next to gpu-guard-ctl is found.
	env := []string{"PATH=" + t.TempDir()}

	for _, args := range [][]string{
		{"--config", config("nvml"), "ps"},
		{"--config", config("nvml"), "devices"},
		{"--config", config("auto"), "status", "-o", "json"},
		{"--config", config("auto"), "ps", "-o", "json"},
	} {
		want := runBin(t, env, daemon, append([]string{"ctl"}, args...)...)
		got := runBin(t, env, ctl, args...)
		assert.Equal(t, want, got, "gpu-guard-ctl %q", args)
		assert.NotContains(t, got.stderr, "built without cgo", "gpu-guard-ctl %q ran without NVML", args)
	}

	// Alone, it runs what needs no NVML, and refuses the rest by name.
	alone := filepath.Join(t.TempDir(), "gpu-guard-ctl")
	data, err := os.ReadFile(ctl)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(alone, data, 0o755))
	r := runBin(t, env, alone, "--config", config("static"), "status")
	assert.Equal(t, 0, r.code, r.stderr)
	assert.Contains(t, r.stdout, "1 device: 1 free")
	r = runBin(t, env, alone, "--config", config("static"), "version")
	assert.Equal(t, 0, r.code, r.stderr)
	for _, args := range [][]string{
		{"--config", config("nvml"), "ps"},
		{"--config", config("auto"), "status"},
	} {
		r = runBin(t, env, alone, args...)
		assert.Equal(t, 1, r.code, "gpu-guard-ctl %q", args)
		assert.Empty(t, r.stdout)
		assert.Contains(t, r.stderr, "needs NVML: this gpu-guard-ctl is built without NVML and runs such commands as `nri-gpu-guard ctl`, "+
			"but there is no nri-gpu-guard next to "+alone+" nor on PATH: install the nri-gpu-guard package", "gpu-guard-ctl %q", args)
	}
}
