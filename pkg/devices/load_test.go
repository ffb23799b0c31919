// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// The GPUs each source of TestLoadInventoryOrder finds: one GPU per source,
// so the UUID of the result says which step of the order gave it.
var (
	loadUUIDNVML   = gpuUUID(10)
	loadUUIDProc   = gpuUUID(11)
	loadUUIDStatic = gpuUUID(12)
	loadUUIDCache  = gpuUUID(13)
)

// fakeNVML is an NVML source that finds one GPU, or is unavailable.
type fakeNVML struct{ works bool }

func (fakeNVML) Name() string { return string(config.SourceNVML) }

func (f fakeNVML) Load() ([]GPU, error) {
	if !f.works {
		return nil, fmt.Errorf("%w: nvml: test library not found", ErrSourceUnavailable)
	}
	return []GPU{{Index: 0, UUID: loadUUIDNVML, Minor: 0}}, nil
}

// cacheState is what lies at <state dir>/inventory.json.
type cacheState string

const (
	cacheAbsent   cacheState = "absent"
	cacheTrusted  cacheState = "trusted"
	cacheWritable cacheState = "group-writable"
	cacheSymlink  cacheState = "symlink"
	cacheForeign  cacheState = "foreign owner"
	cacheFIFO     cacheState = "fifo"
	cacheCorrupt  cacheState = "corrupt"
)

// column maps a cache state to its column in the expectations: the four
// untrusted kinds share one.
func (c cacheState) column() int {
	switch c {
	case cacheAbsent:
		return 0
	case cacheTrusted:
		return 1
	case cacheWritable, cacheSymlink, cacheForeign, cacheFIFO:
		return 2
	}
	return 3 // corrupt
}

// setUp writes the cache state into dir.
func (c cacheState) setUp(t *testing.T, dir string) {
	t.Helper()
	path := filepath.Join(dir, CacheFile)
	trusted := func(p string) {
		require.NoError(t, SaveCache(p, mustInventory(t, "nvml", []GPU{{Index: 0, UUID: loadUUIDCache, Minor: 0}}), testBoot))
	}
	switch c {
	case cacheAbsent:
	case cacheTrusted:
		trusted(path)
	case cacheWritable:
		trusted(path)
		require.NoError(t, os.Chmod(path, 0o620))
	case cacheSymlink:
		// A well-formed cache elsewhere: only the link makes it untrusted.
		target := filepath.Join(t.TempDir(), "elsewhere.json")
		trusted(target)
		require.NoError(t, os.Symlink(target, path))
	case cacheForeign:
		if os.Geteuid() != 0 {
			t.Skip("giving the cache to another user needs root")
		}
		trusted(path)
		require.NoError(t, os.Chown(path, 65534, 65534))
	case cacheFIFO:
		require.NoError(t, syscall.Mkfifo(path, 0o600))
	case cacheCorrupt:
		writeFile(t, path, `{"version":1,"inventory":{"source":"nvml","gpus":[`)
	}
}

// Expected outcomes: the UUID letter of the GPU loaded, or "err".
// N = NVML, P = /proc, S = static list, C = cache.
type outcome string

const (
	gotN   outcome = "N"
	gotP   outcome = "P"
	gotS   outcome = "S"
	gotC   outcome = "C"
	gotErr outcome = "err"
	// gotNone: the daemon's empty, undiscovered inventory (OriginNone),
	// the cache left as it was.
	gotNone outcome = "none"
)

// TestLoadInventoryOrder runs every role × devices.source × cache state ×
// discovery outcome through LoadInventory. In the "works" world NVML, the
// /proc tree and the static list each find their own GPU; in the "fails"
// world none does (and the static list is empty).
//
// Columns: cache absent, trusted, untrusted (group-writable, symlink, foreign
// owner, FIFO), corrupt.
func TestLoadInventoryOrder(t *testing.T) {
	rows := []struct {
		role   Role
		source config.Source
		works  [4]outcome
		fails  [4]outcome
	}{
		// static: the configured list, for every role, whatever the cache.
		{RoleDaemon, config.SourceStatic, [4]outcome{gotS, gotS, gotS, gotS}, [4]outcome{gotErr, gotErr, gotErr, gotErr}},
		{RoleRefresh, config.SourceStatic, [4]outcome{gotS, gotS, gotS, gotS}, [4]outcome{gotErr, gotErr, gotErr, gotErr}},
		{RoleHook, config.SourceStatic, [4]outcome{gotS, gotS, gotS, gotS}, [4]outcome{gotErr, gotErr, gotErr, gotErr}},
		{RoleReader, config.SourceStatic, [4]outcome{gotS, gotS, gotS, gotS}, [4]outcome{gotErr, gotErr, gotErr, gotErr}},

		// The daemon discovers; only a trusted cache replaces a failed
		// discovery; without one it starts over an undiscovered inventory
		// (refusing every GPU request) and writes no cache.
		{RoleDaemon, config.SourceAuto, [4]outcome{gotN, gotN, gotN, gotN}, [4]outcome{gotNone, gotC, gotNone, gotNone}},
		{RoleDaemon, config.SourceNVML, [4]outcome{gotN, gotN, gotN, gotN}, [4]outcome{gotNone, gotC, gotNone, gotNone}},
		{RoleDaemon, config.SourceProc, [4]outcome{gotP, gotP, gotP, gotP}, [4]outcome{gotNone, gotC, gotNone, gotNone}},

		// A refresh discovers and never falls back.
		{RoleRefresh, config.SourceAuto, [4]outcome{gotN, gotN, gotN, gotN}, [4]outcome{gotErr, gotErr, gotErr, gotErr}},
		{RoleRefresh, config.SourceNVML, [4]outcome{gotN, gotN, gotN, gotN}, [4]outcome{gotErr, gotErr, gotErr, gotErr}},
		{RoleRefresh, config.SourceProc, [4]outcome{gotP, gotP, gotP, gotP}, [4]outcome{gotErr, gotErr, gotErr, gotErr}},

		// The hook reads a trusted cache, else /proc, never NVML.
		{RoleHook, config.SourceAuto, [4]outcome{gotP, gotC, gotP, gotP}, [4]outcome{gotErr, gotC, gotErr, gotErr}},
		{RoleHook, config.SourceNVML, [4]outcome{gotP, gotC, gotP, gotP}, [4]outcome{gotErr, gotC, gotErr, gotErr}},
		{RoleHook, config.SourceProc, [4]outcome{gotP, gotC, gotP, gotP}, [4]outcome{gotErr, gotC, gotErr, gotErr}},

		// gpu-guard-ctl reads a trusted cache, else discovers as the daemon would.
		{RoleReader, config.SourceAuto, [4]outcome{gotN, gotC, gotN, gotN}, [4]outcome{gotErr, gotC, gotErr, gotErr}},
		{RoleReader, config.SourceNVML, [4]outcome{gotN, gotC, gotN, gotN}, [4]outcome{gotErr, gotC, gotErr, gotErr}},
		{RoleReader, config.SourceProc, [4]outcome{gotP, gotC, gotP, gotP}, [4]outcome{gotErr, gotC, gotErr, gotErr}},
	}
	caches := []cacheState{cacheAbsent, cacheTrusted, cacheWritable, cacheSymlink, cacheForeign, cacheFIFO, cacheCorrupt}
	procTree := t.TempDir()
	fakeProcGPU(t, procTree, "0000:07:00.0", "NVIDIA H100 80GB HBM3", loadUUIDProc, 0, false)

	for _, row := range rows {
		for _, world := range []string{"works", "fails"} {
			for _, cache := range caches {
				want := row.works[cache.column()]
				if world == "fails" {
					want = row.fails[cache.column()]
				}
				name := fmt.Sprintf("%s/%s/%s/cache %s", row.role, row.source, world, cache)
				t.Run(name, func(t *testing.T) {
					dir := t.TempDir()
					cache.setUp(t, dir)
					cfg := config.DevicesConfig{Source: row.source, ProcRoot: t.TempDir()}
					nvml := fakeNVML{}
					if world == "works" {
						cfg.ProcRoot = procTree
						cfg.Static = []config.StaticGPU{{Index: 0, UUID: loadUUIDStatic, Minor: 0}}
						nvml.works = true
					}
					if row.source == config.SourceStatic {
						// No driver tree: the static list, which the
						// driver's would contradict, is used as it is
						// (TestStaticListMatchesDriver checks it against
						// one).
						cfg.ProcRoot = t.TempDir()
					}
					path := filepath.Join(dir, CacheFile)
					before := snapshotCache(t, path)

					got, err := LoadInventory(cfg, LoadOptions{Role: row.role, StateDir: dir, NVML: nvml, BootID: testBoot})
					assert.Equal(t, path, got.CachePath)
					if want == gotErr {
						require.Error(t, err)
						assert.Nil(t, got.Inventory)
						assertNames(t, err, row.role, cache, path)
						assert.Equal(t, before, snapshotCache(t, path), "a failed load leaves the cache as it was")
						return
					}
					require.NoError(t, err)
					require.NotNil(t, got.Inventory)
					if want == gotNone {
						assert.Equal(t, OriginNone, got.Origin)
						assert.True(t, got.Inventory.Undiscovered)
						assert.Empty(t, got.Inventory.GPUs)
						assert.NotEmpty(t, got.Skipped)
						assert.Equal(t, before, snapshotCache(t, path), "no cache is written over nothing")
						return
					}
					require.Len(t, got.Inventory.GPUs, 1)
					assert.Equal(t, map[outcome]string{gotN: loadUUIDNVML, gotP: loadUUIDProc, gotS: loadUUIDStatic, gotC: loadUUIDCache}[want],
						got.Inventory.GPUs[0].UUID)
					switch {
					case want == gotC:
						assert.Equal(t, OriginCache, got.Origin)
						assert.False(t, got.CachedAt.IsZero())
					case row.source == config.SourceStatic:
						assert.Equal(t, OriginConfig, got.Origin)
					default:
						assert.Equal(t, OriginDiscovery, got.Origin)
					}
					assertCacheAfter(t, row.role, want, got, path, before)
					assertSkipped(t, row.role, row.source, cache, want, got.Skipped)
				})
			}
		}
	}
}

// cacheSnapshot is what is at the cache path: its type and content.
type cacheSnapshot struct {
	mode    fs.FileMode
	content string
}

func snapshotCache(t *testing.T, path string) cacheSnapshot {
	t.Helper()
	fi, err := os.Lstat(path)
	if err != nil {
		return cacheSnapshot{}
	}
	s := cacheSnapshot{mode: fi.Mode()}
	if fi.Mode().IsRegular() {
		data, err := os.ReadFile(path)
		require.NoError(t, err)
		s.content = string(data)
	}
	return s
}

// assertCacheAfter: the daemon and a refresh leave the inventory they
// loaded (not from the cache) in a trusted cache; readers change nothing.
func assertCacheAfter(t *testing.T, role Role, want outcome, got Loaded, path string, before cacheSnapshot) {
	t.Helper()
	if (role != RoleDaemon && role != RoleRefresh) || want == gotC {
		assert.Equal(t, before, snapshotCache(t, path), "the cache is left as it was")
		return
	}
	require.NoError(t, got.CacheWriteErr)
	back, err := LoadCache(path)
	require.NoError(t, err, "the cache written is trusted")
	assert.Equal(t, got.Inventory.GPUs, back.GPUs)
	assert.Equal(t, got.Inventory.Source, back.Source)
	assert.False(t, got.CachedAt.IsZero())
}

// assertSkipped: where a present cache was passed over, or the daemon fell
// back from discovery, Skipped says why.
func assertSkipped(t *testing.T, role Role, source config.Source, cache cacheState, want outcome, skipped []error) {
	t.Helper()
	reads := (role == RoleHook || role == RoleReader) && source != config.SourceStatic
	switch {
	case want == gotC && role == RoleDaemon:
		require.Len(t, skipped, 1)
		assert.Contains(t, skipped[0].Error(), "discovery")
	case reads && want != gotC:
		require.Len(t, skipped, 1)
		switch cache.column() {
		case 0:
			require.ErrorIs(t, skipped[0], fs.ErrNotExist)
		case 2:
			require.ErrorIs(t, skipped[0], ErrUntrustedCache)
		case 3:
			require.ErrorIs(t, skipped[0], ErrBadCache)
		}
	default:
		assert.Empty(t, skipped)
	}
}

// assertNames: a failed load names what was tried and what to do.
func assertNames(t *testing.T, err error, role Role, cache cacheState, path string) {
	t.Helper()
	msg := err.Error()
	assert.Contains(t, msg, "GPU", "names what is missing")
	if role == RoleHook || role == RoleReader || role == RoleDaemon {
		assert.Contains(t, msg, `devices.source = "static"`, "says what to do")
	}
	if cache != cacheAbsent && role != RoleRefresh && !strings.Contains(msg, "static: no [[devices.static]]") {
		assert.Contains(t, msg, path, "names the cache it refused")
	}
	if role == RoleHook && !strings.Contains(msg, "static: no [[devices.static]]") {
		assert.Contains(t, msg, "without NVML")
		assert.Contains(t, msg, "gpu-guard-ctl devices --refresh")
	}
}

// TestLoadInventoryRefreshWriteFails: a refresh that cannot write the cache
// fails; the daemon carries on with the inventory it discovered and reports
// the write error.
func TestLoadInventoryRefreshWriteFails(t *testing.T) {
	cfg := config.DevicesConfig{Source: config.SourceNVML}
	missing := filepath.Join(t.TempDir(), "no-such-dir")

	_, err := LoadInventory(cfg, LoadOptions{Role: RoleRefresh, StateDir: missing, NVML: fakeNVML{works: true}})
	require.Error(t, err)
	assert.Contains(t, err.Error(), filepath.Join(missing, CacheFile))

	got, err := LoadInventory(cfg, LoadOptions{Role: RoleDaemon, StateDir: missing, NVML: fakeNVML{works: true}})
	require.NoError(t, err)
	assert.Equal(t, loadUUIDNVML, got.Inventory.GPUs[0].UUID)
	require.Error(t, got.CacheWriteErr)
	assert.Contains(t, got.CacheWriteErr.Error(), filepath.Join(missing, CacheFile))
}

// TestLoadInventoryBadOptions: a load without a role or a state directory is
// refused rather than guessed.
func TestLoadInventoryBadOptions(t *testing.T) {
	cfg := config.DevicesConfig{Source: config.SourceStatic, Static: []config.StaticGPU{{Index: 0, UUID: loadUUIDStatic}}}
	_, err := LoadInventory(cfg, LoadOptions{StateDir: t.TempDir()})
	require.ErrorContains(t, err, "unknown role")
	_, err = LoadInventory(cfg, LoadOptions{Role: RoleHook})
	require.ErrorContains(t, err, "no state directory")
}
