// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestLegacyHookAnswersNoGPUContainersFirst: `nri-gpu-guard hook PHASE`,
// kept for hooks.d files written for it, takes nri-gpu-guard-hook's path: a
// container that can reach no GPU is answered before the configuration is
// read, so a configuration that does not load refuses none of them (it used
// to refuse every container), and one that names a GPU is refused with the
// hook's error naming the container and check-config.
func TestLegacyHookAnswersNoGPUContainersFirst(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.toml")
	require.NoError(t, os.WriteFile(bad, []byte("[policy]\non_conflict = \"maybe\"\n"), 0o600))
	for _, phase := range []string{"create-runtime", "poststop"} {
		t.Run(phase, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := run([]string{"hook", phase, "--config", bad}, strings.NewReader(hookState(t, "PATH=/bin")), &stdout, &stderr)
			require.Equal(t, 0, code, stderr.String())
			assert.Empty(t, stderr.String())
			assert.Empty(t, stdout.String())

			stderr.Reset()
			code = run([]string{"hook", phase, "--config", bad}, strings.NewReader(hookState(t, "NVIDIA_VISIBLE_DEVICES=0")), &stdout, &stderr)
			require.Equal(t, 1, code, phase)
			assert.Contains(t, stderr.String(), "policy.on_conflict")
			assert.Contains(t, stderr.String(), "`gpu-guard-ctl check-config` says what is wrong")
			if phase == "create-runtime" {
				assert.Contains(t, stderr.String(), "nri-gpu-guard: hook create-runtime: container c1 refused: configuration: ")
			} else {
				assert.Contains(t, stderr.String(), "nri-gpu-guard: hook poststop: container c1: its GPUs are not released: configuration: ")
			}
		})
	}
}

// TestLegacyHookNoGPUNeverReadsLedger: as with nri-gpu-guard-hook, both
// phases of a container that names no GPU succeed without the ledger (the
// state dir is a FIFO, which any ledger access would fail on).
func TestLegacyHookNoGPUNeverReadsLedger(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "config.toml")
	require.NoError(t, os.WriteFile(good, []byte("[devices]\nsource = \"static\"\nproc_root = \""+filepath.Join(dir, "no-driver")+"\"\n"+
		"[[devices.static]]\nindex = 0\nuuid = \"GPU-6c1a2f2e-0000-4000-8000-000000000000\"\nminor = 0\n"), 0o600))
	fifo := filepath.Join(dir, "state")
	require.NoError(t, syscall.Mkfifo(fifo, 0o600))
	for _, phase := range []string{"create-runtime", "poststop"} {
		var stdout, stderr bytes.Buffer
		code := run([]string{"hook", phase, "--config", good, "--state-dir", fifo}, strings.NewReader(hookState(t, "PATH=/bin")), &stdout, &stderr)
		require.Equal(t, 0, code, "%s: %s", phase, stderr.String())
		require.Empty(t, stderr.String())

		// The same with a GPU named reaches the ledger and fails on it.
		stderr.Reset()
		code = run([]string{"hook", phase, "--config", good, "--state-dir", fifo}, strings.NewReader(hookState(t, "NVIDIA_VISIBLE_DEVICES=0")), &stdout, &stderr)
		require.Equal(t, 1, code, phase)
		require.Contains(t, stderr.String(), fifo)
	}
}
