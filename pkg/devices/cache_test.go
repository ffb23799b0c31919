// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestCacheRoundTrip(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, CacheFile)
	inv := testInventory(t)
	inv.Notes = []string{"nvml: skipped: test"}
	inv, err := newInventory(*inv)
	require.NoError(t, err)

	require.NoError(t, SaveCache(path, inv, testBoot))
	st, err := os.Stat(path)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), st.Mode().Perm())

	back, err := LoadCache(path)
	require.NoError(t, err)
	assert.Equal(t, inv.Source, back.Source)
	assert.Equal(t, inv.GPUs, back.GPUs)
	assert.Equal(t, inv.Notes, back.Notes)
	assert.Equal(t, inv.MIGCaps, back.MIGCaps)
	assert.Equal(t, inv.Devices(), back.Devices())
	d, ok := back.ByMinor(3)
	require.True(t, ok, "indexes are rebuilt on load")
	assert.Equal(t, gpuUUID(1), d.UUID)

	// Overwrite with another inventory; no temporary file is left behind.
	other := mustInventory(t, "proc", []GPU{{Index: 0, UUID: gpuUUID(5), Minor: 0}})
	require.NoError(t, SaveCache(path, other, testBoot))
	back, err = LoadCache(path)
	require.NoError(t, err)
	assert.Equal(t, "proc", back.Source)
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 1)
	assert.Equal(t, CacheFile, entries[0].Name())
}

func TestCacheFailures(t *testing.T) {
	dir := t.TempDir()
	_, err := LoadCache(filepath.Join(dir, "missing.json"))
	require.ErrorIs(t, err, fs.ErrNotExist)

	for name, content := range map[string]string{
		"corrupt":       `{"version":1,"inventory":{"source":"nvml","gpus":[`,
		"other version": `{"version":2,"inventory":{"source":"nvml","gpus":[]}}`,
		"no inventory":  `{"version":1}`,
		"invalid":       `{"version":1,"inventory":{"source":"nvml","gpus":[{"index":0,"uuid":"GPU-1","minor":0}]}}`,
	} {
		path := filepath.Join(dir, name+".json")
		writeFile(t, path, content)
		_, err := LoadCache(path)
		require.ErrorIs(t, err, ErrBadCache, name)
		assert.Contains(t, err.Error(), path, name)
	}
	target := filepath.Join(dir, "real.json")
	require.NoError(t, SaveCache(target, testInventory(t), testBoot))
	link := filepath.Join(dir, "link.json")
	require.NoError(t, os.Symlink(target, link))
	_, err = LoadCache(link)
	require.ErrorIs(t, err, ErrUntrustedCache, "a symlink is refused")

	require.Error(t, SaveCache(filepath.Join(dir, "x.json"), &Inventory{Source: "nvml"}, testBoot), "an unbuilt inventory is not saved")
	require.Error(t, SaveCache(filepath.Join(dir, "nodir", "x.json"), testInventory(t), testBoot))
}

// An undiscovered inventory (the daemon's when no source works and no cache
// exists) is never written: the hooks would read it as a host without GPUs.
func TestSaveCacheRefusesUndiscovered(t *testing.T) {
	inv, err := newInventory(Inventory{Source: "none", Undiscovered: true})
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), CacheFile)
	require.Error(t, SaveCache(path, inv, testBoot))
	assert.NoFileExists(t, path)
	_, err = newInventory(Inventory{Source: "nvml", Undiscovered: true, GPUs: []GPU{{Index: 0, UUID: "GPU-00000000-0000-4000-8000-000000000000"}}})
	require.ErrorIs(t, err, ErrInvalidInventory)
}
