// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

const (
	uuidStatic = "GPU-5a5a5a5a-0000-4000-8000-000000000000"
	uuidCached = "GPU-c0c0c0c0-0000-4000-8000-000000000000"
)

func staticConfig(t *testing.T) config.Config {
	t.Helper()
	cfg := config.Default()
	cfg.Ledger.Dir = t.TempDir()
	cfg.Devices.Source = config.SourceStatic
	cfg.Devices.ProcRoot = t.TempDir() // fake GPUs: no driver tree to check the list against
	cfg.Devices.Static = []config.StaticGPU{{Index: 0, UUID: uuidStatic, Minor: 0}}
	return cfg
}

// TestSetupWritesCacheOnce: Setup loads the inventory, writes the cache the
// hooks read, and a second Setup with the same configuration (a reconnect)
// neither reloads nor rewrites it; a changed [devices] section does.
func TestSetupWritesCacheOnce(t *testing.T) {
	cfg := staticConfig(t)
	cache := filepath.Join(cfg.Ledger.Dir, devices.CacheFile)
	b := &Builder{}

	g, err := b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	_, ok := g.Inventory().Lookup(uuidStatic)
	require.True(t, ok)
	inv, err := devices.LoadCache(cache)
	require.NoError(t, err)
	assert.Equal(t, uuidStatic, inv.GPUs[0].UUID)

	require.NoError(t, os.Remove(cache))
	_, err = b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	_, err = os.Lstat(cache)
	require.ErrorIs(t, err, os.ErrNotExist, "an unchanged configuration reuses the inventory")

	cfg.Devices.Static[0].Model = "renamed"
	g, err = b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	assert.Equal(t, "renamed", g.Inventory().GPUs[0].Model)
	_, err = devices.LoadCache(cache)
	require.NoError(t, err, "a changed [devices] section reloads and rewrites the cache")
}

// TestSetupFallsBackToTrustedCache: when discovery fails, the daemon starts
// from a trusted cache; without one (none, or an untrusted one) it starts
// over an undiscovered inventory that refuses every GPU request, and writes
// no cache.
func TestSetupFallsBackToTrustedCache(t *testing.T) {
	cfg := config.Default()
	cfg.Ledger.Dir = t.TempDir()
	cfg.Devices.Source = config.SourceProc
	cfg.Devices.ProcRoot = t.TempDir() // a procfs without /proc/driver/nvidia: discovery fails
	require.NoError(t, os.MkdirAll(filepath.Join(cfg.Devices.ProcRoot, "proc"), 0o755))
	cache := filepath.Join(cfg.Ledger.Dir, devices.CacheFile)

	g, err := (&Builder{}).Setup(context.Background(), cfg)
	require.NoError(t, err, "neither discovery nor a cache: the daemon starts all the same")
	assert.True(t, g.Inventory().Undiscovered)
	assert.NoFileExists(t, cache)

	inv, err := devices.NewInventory("nvml", []devices.GPU{{Index: 0, UUID: uuidCached, Minor: 0}})
	require.NoError(t, err)
	require.NoError(t, devices.SaveCache(cache, inv, ""))
	g, err = (&Builder{}).Setup(context.Background(), cfg)
	require.NoError(t, err)
	_, ok := g.Inventory().Lookup(uuidCached)
	assert.True(t, ok)

	require.NoError(t, os.Chmod(cache, 0o666))
	g, err = (&Builder{}).Setup(context.Background(), cfg)
	require.NoError(t, err)
	assert.True(t, g.Inventory().Undiscovered, "an untrusted cache is not decided with")
	_, ok = g.Inventory().Lookup(uuidCached)
	assert.False(t, ok)
}
