// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A damaged ledger: status fails (never prints GPUs as free), recover
// rebuilds it from the journal, releases the holder that exited, and status
// works again.
func TestRecoverDamagedLedger(t *testing.T) {
	f := newFixture(t)
	f.populate(t)
	before := f.state(t)
	require.NotEmpty(t, before.Claims)
	f.liveness[idStale] = "cgroup has no processes"
	require.NoError(t, os.WriteFile(filepath.Join(f.dir, "ledger.json"), []byte("\x00\x00garbage"), 0o600))

	r := f.run(t, "status")
	require.Equal(t, ExitError, r.code, "status of a damaged ledger exits 1")
	assert.Contains(t, r.stderr, "gpu-guard-ctl recover")
	assert.Contains(t, r.stderr, "NO container gets a GPU")
	assert.Contains(t, r.stderr, filepath.Join(f.dir, "ledger.json"))
	assert.Empty(t, r.stdout, "no device is shown as free")

	f.uid = 1000
	r = f.run(t, "recover")
	require.Equal(t, ExitError, r.code)
	assert.Contains(t, r.stderr, "needs root")

	f.uid = 0
	// A contradiction between flags is a usage error, found before the
	// ledger is touched.
	r = f.run(t, "recover", "--reset", "--dry-run")
	require.Equal(t, ExitUsage, r.code, r.stderr)
	assert.Contains(t, r.stderr, "--reset and --dry-run")

	r = f.run(t, "recover")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "recovered generation")
	assert.Contains(t, r.stdout, "released (holder exited)")
	assert.Contains(t, r.stdout, "moved aside (kept)")

	after := f.state(t)
	var want []string
	for _, c := range before.Claims {
		if c.Owner.ContainerID != idStale {
			want = append(want, c.Device.UUID+"="+c.Owner.ContainerID)
		}
	}
	var got []string
	for _, c := range after.Claims {
		got = append(got, c.Device.UUID+"="+c.Owner.ContainerID)
	}
	assert.Equal(t, want, got, "every claim is back but the exited holder's")
	assert.Equal(t, len(before.Waiters), len(after.Waiters))

	r = f.run(t, "recover")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "healthy")
}
