// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// fakeUnboundGPU puts an NVIDIA 3D controller no driver has taken on the
// PCI bus under root: what a host shows before its driver is loaded.
func fakeUnboundGPU(t *testing.T, root, addr string) {
	t.Helper()
	dir := filepath.Join(root, "sys", "bus", "pci", "devices", addr)
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "vendor"), []byte("0x10de\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "class"), []byte("0x030200\n"), 0o644))
}

// A daemon that starts before the NVIDIA driver (a GPU Operator's driver
// container) discovers no GPU while the bus shows some: it keeps deciding
// with that empty inventory, but leaves a cache that lists GPUs as it was.
// Without NVIDIA GPUs on the bus, an empty discovery is a host without GPUs
// and is written; a refresh always writes what it found.
func TestLoadInventoryKeepsCacheWhileDriverIsDown(t *testing.T) {
	withBus := t.TempDir()
	fakeUnboundGPU(t, withBus, "0000:3b:00.0")
	cfg := config.DevicesConfig{Source: config.SourceAuto, ProcRoot: withBus}

	for _, tc := range []struct {
		name     string
		role     Role
		procRoot string
		kept     bool
	}{
		{"daemon, GPUs on the bus", RoleDaemon, withBus, true},
		{"daemon, no GPU on the bus", RoleDaemon, t.TempDir(), false},
		{"refresh, GPUs on the bus", RoleRefresh, withBus, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			state := t.TempDir()
			path := filepath.Join(state, CacheFile)
			require.NoError(t, SaveCache(path, testInventory(t), testBoot))
			c := cfg
			c.ProcRoot = tc.procRoot

			got, err := LoadInventory(c, LoadOptions{Role: tc.role, StateDir: state, NVML: zeroGPUs{}, BootID: testBoot})
			require.NoError(t, err)
			assert.Equal(t, OriginDiscovery, got.Origin)
			assert.Empty(t, got.Inventory.GPUs, "the daemon does not decide with the cache")
			assert.Equal(t, tc.kept, got.CacheKept)
			cached, err := LoadCache(path)
			require.NoError(t, err)
			if tc.kept {
				assert.Equal(t, testInventory(t).GPUs, cached.GPUs, "the cache that lists GPUs is kept")
			} else {
				assert.Empty(t, cached.GPUs)
			}
		})
	}

	// Nothing to keep: an absent cache is written (empty, with the count).
	state := t.TempDir()
	got, err := LoadInventory(cfg, LoadOptions{Role: RoleDaemon, StateDir: state, NVML: zeroGPUs{}, BootID: testBoot})
	require.NoError(t, err)
	assert.False(t, got.CacheKept)
	cached, err := LoadCache(filepath.Join(state, CacheFile))
	require.NoError(t, err)
	assert.Equal(t, 1, cached.UnlistedGPUs)
}
