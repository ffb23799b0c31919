// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// The host of the boot-check tests: the cache an NVML discovery wrote for
// two GPUs, GPU 1 in MIG mode, and the /proc trees the driver may show after
// a reboot.
const (
	bootModel   = "NVIDIA H100 80GB HBM3"
	bootEarlier = "0b1d9e44-earlier-boot"
)

// procEntry is one /proc/driver/nvidia/gpus entry of a fake tree.
type procEntry struct {
	bus      string
	uuid     string
	minor    int
	excluded bool
}

func bootCacheGPUs() []GPU {
	return []GPU{
		{Index: 0, UUID: gpuUUID(0), Minor: 0, BusID: "0000:1b:00.0", Model: bootModel},
		{Index: 1, UUID: gpuUUID(1), Minor: 1, BusID: "0000:3b:00.0", Model: bootModel},
	}
}

// bootCacheGPUsMIG is bootCacheGPUs with GPU 1 in MIG mode.
func bootCacheGPUsMIG() []GPU {
	gpus := bootCacheGPUs()
	gpus[1].MIG = []MIG{{Index: 0, UUID: migUUID(1, 0), GI: 1, CI: 0}}
	return gpus
}

// sameGPUs is the /proc tree of the cached GPUs.
var sameGPUs = []procEntry{{"0000:1b:00.0", gpuUUID(0), 0, false}, {"0000:3b:00.0", gpuUUID(1), 1, false}}

// writeBootCache writes the cache as the daemon of boot wrote it; boot
// "old format" writes it as a build that recorded no boot did.
func writeBootCache(t *testing.T, path, boot string, gpus []GPU) *Inventory {
	t.Helper()
	inv := mustInventory(t, "nvml", gpus)
	if boot != "old format" {
		require.NoError(t, SaveCache(path, inv, boot))
		return inv
	}
	data, err := json.Marshal(map[string]any{"version": 1, "inventory": inv})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(path, data, 0o600))
	return inv
}

// TestLoadInventoryChecksCacheOfAnotherBoot: a cache written in this boot is
// used as it is; one of an earlier (or an unrecorded) boot is used only when
// the driver lists the GPUs it lists, else it is skipped as stale
// (ErrStaleCache) and the next step of the order runs: the hook discovers
// through /proc, gpu-guard-ctl as the daemon would, and the daemon whose
// discovery failed starts undiscovered rather than decide with it. Without
// a driver tree nothing tells the cache is stale, and it is used.
func TestLoadInventoryChecksCacheOfAnotherBoot(t *testing.T) {
	added := append(append([]procEntry(nil), sameGPUs...), procEntry{"0000:5b:00.0", gpuUUID(2), 2, false})
	for _, tc := range []struct {
		name      string
		boot      string // the cache's boot
		cacheGPUs []GPU  // nil = bootCacheGPUs()
		proc      []procEntry
		noProc    bool     // a procfs without the driver's tree
		stale     []string // what the skip reason names; nil = cache used
	}{
		// GPUs do not change while a host runs: within its boot the cache
		// is not checked (the hook reads nothing more), whatever /proc says.
		{name: "same boot, GPU added: used as it is", boot: testBoot, proc: added},
		{name: "earlier boot, same GPUs: used", boot: bootEarlier, proc: sameGPUs},
		// MIG instances get new UUIDs when re-created after a reboot.
		{name: "same boot, MIG instances: used", boot: testBoot, cacheGPUs: bootCacheGPUsMIG(), proc: sameGPUs},
		{name: "earlier boot, same GPUs with MIG instances", boot: bootEarlier, cacheGPUs: bootCacheGPUsMIG(), proc: sameGPUs,
			stale: []string{"the cache lists 1 MIG instance(s), which are re-created with new UUIDs after a reboot"}},
		{name: "earlier boot, an excluded GPU added: used", boot: bootEarlier,
			proc: append(append([]procEntry(nil), sameGPUs...), procEntry{"0000:5b:00.0", gpuUUID(2), 2, true})},
		{name: "earlier boot, no driver tree: used", boot: bootEarlier, noProc: true},
		{name: "unrecorded boot (older cache), same GPUs: used", boot: "old format", proc: sameGPUs},
		{name: "unknown boot (empty id), same GPUs: used", boot: "", proc: sameGPUs},

		{name: "earlier boot, GPU added", boot: bootEarlier, proc: added,
			stale: []string{"GPU 2 (" + gpuUUID(2) + ") at 0000:5b:00.0 is not in the cache", "an earlier boot"}},
		{name: "earlier boot, GPU removed", boot: bootEarlier, proc: sameGPUs[1:],
			stale: []string{"the cache's GPU 0 (" + gpuUUID(0) + ") at 0000:1b:00.0 is not listed by the driver"}},
		{name: "earlier boot, GPU replaced in the same slot", boot: bootEarlier,
			proc: []procEntry{sameGPUs[0], {"0000:3b:00.0", gpuUUID(4), 1, false}},
			stale: []string{"GPU 1 (" + gpuUUID(4) + ") at 0000:3b:00.0 is not in the cache",
				"the cache's GPU 1 (" + gpuUUID(1) + ") at 0000:3b:00.0 is not listed"}},
		{name: "earlier boot, device minors swapped", boot: bootEarlier,
			proc:  []procEntry{{"0000:1b:00.0", gpuUUID(0), 1, false}, {"0000:3b:00.0", gpuUUID(1), 0, false}},
			stale: []string{"GPU 0 (" + gpuUUID(0) + ") at 0000:1b:00.0 is /dev/nvidia1, /dev/nvidia0 in the cache"}},
		{name: "earlier boot, GPUs moved to other slots", boot: bootEarlier,
			proc:  []procEntry{{"0000:1b:00.0", gpuUUID(1), 1, false}, {"0000:3b:00.0", gpuUUID(0), 0, false}},
			stale: []string{"GPU 0 (" + gpuUUID(1) + ") is at 0000:1b:00.0, at 0000:3b:00.0 in the cache"}},
		{name: "unrecorded boot (older cache), GPU added", boot: "old format", proc: added,
			stale: []string{"GPU 2 (" + gpuUUID(2) + ")", "a boot it does not record"}},

		// A cache without bus ids (a static list's) is compared by UUID
		// and minor.
		{name: "earlier boot, no bus ids in the cache, same GPUs: used", boot: bootEarlier,
			cacheGPUs: []GPU{{Index: 0, UUID: gpuUUID(0), Minor: 0}, {Index: 1, UUID: gpuUUID(1), Minor: 1}}, proc: sameGPUs},
		{name: "earlier boot, no bus ids in the cache, UUIDs in upper case, same GPUs: used", boot: bootEarlier,
			cacheGPUs: []GPU{{Index: 0, UUID: upperUUID(gpuUUID(0)), Minor: 0}, {Index: 1, UUID: upperUUID(gpuUUID(1)), Minor: 1}}, proc: sameGPUs},
		{name: "earlier boot, no bus ids in the cache, GPU added", boot: bootEarlier,
			cacheGPUs: []GPU{{Index: 0, UUID: gpuUUID(0), Minor: 0}, {Index: 1, UUID: gpuUUID(1), Minor: 1}}, proc: added,
			stale: []string{"GPU 2 (" + gpuUUID(2) + ") at 0000:5b:00.0 is not in the cache"}},
	} {
		for _, role := range []Role{RoleHook, RoleReader, RoleDaemon} {
			t.Run(tc.name+"/"+role.String(), func(t *testing.T) {
				procRoot := t.TempDir()
				for _, e := range tc.proc {
					fakeProcGPU(t, procRoot, e.bus, bootModel, e.uuid, e.minor, e.excluded)
				}
				if !tc.noProc && len(tc.proc) == 0 {
					t.Fatal("a row names its /proc tree or noProc")
				}
				require.NoError(t, os.MkdirAll(filepath.Join(procRoot, "proc"), 0o755))
				state := t.TempDir()
				path := filepath.Join(state, CacheFile)
				gpus := tc.cacheGPUs
				if gpus == nil {
					gpus = bootCacheGPUs()
				}
				want := writeBootCache(t, path, tc.boot, gpus)
				before := snapshotCache(t, path)
				// NVML works for the reader, and fails for the daemon: its
				// discovery then falls back to the cache.
				cfg := config.DevicesConfig{Source: config.SourceAuto, ProcRoot: procRoot}
				nvml := fakeNVML{works: role == RoleReader}
				if role == RoleDaemon {
					cfg.Source = config.SourceNVML
				}

				got, err := LoadInventory(cfg, LoadOptions{Role: role, StateDir: state, NVML: nvml, BootID: testBoot})
				require.NoError(t, err)
				if role != RoleDaemon || tc.stale == nil {
					assert.Equal(t, before, snapshotCache(t, path), "the cache is left as it was")
				}

				if tc.stale == nil {
					assert.Equal(t, OriginCache, got.Origin)
					assert.Equal(t, want.GPUs, got.Inventory.GPUs, "the cache as written")
					for _, s := range got.Skipped {
						assert.NotErrorIs(t, s, ErrStaleCache)
					}
					return
				}
				var stale error
				for _, s := range got.Skipped {
					if errors.Is(s, ErrStaleCache) {
						stale = s
					}
				}
				require.Error(t, stale, "ErrStaleCache in Skipped: %v", got.Skipped)
				for _, s := range append(tc.stale, path, "gpu-guard-ctl devices --refresh", "nri-gpu-guard daemon") {
					assert.Contains(t, stale.Error(), s)
				}
				switch role {
				case RoleHook:
					assert.Equal(t, OriginDiscovery, got.Origin)
					assert.Equal(t, string(config.SourceProc), got.Inventory.Source)
					var uuids []string
					for _, g := range got.Inventory.GPUs {
						uuids = append(uuids, g.UUID)
					}
					var listed []string
					for _, e := range tc.proc {
						listed = append(listed, e.uuid)
					}
					assert.ElementsMatch(t, listed, uuids, "the GPUs the driver lists")
				case RoleReader:
					assert.Equal(t, OriginDiscovery, got.Origin)
					assert.Equal(t, loadUUIDNVML, got.Inventory.GPUs[0].UUID, "discovered as the daemon would")
				case RoleDaemon:
					assert.Equal(t, OriginNone, got.Origin)
					assert.True(t, got.Inventory.Undiscovered, "refuses every GPU request rather than decide with a stale cache")
					assert.Empty(t, got.Inventory.GPUs)
					assert.Equal(t, before, snapshotCache(t, path), "no cache is written over nothing")
				}
			})
		}
	}
}

// TestSaveCacheRecordsBoot: the cache says which boot wrote it; an older
// cache without the field still loads, its boot unknown.
func TestSaveCacheRecordsBoot(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		boot, want string
	}{
		{testBoot, testBoot},
		{"", ""},
		{"old format", ""},
	} {
		path := filepath.Join(dir, CacheFile)
		inv := writeBootCache(t, path, tc.boot, bootCacheGPUs())
		c, err := loadCache(path)
		require.NoError(t, err, tc.boot)
		assert.Equal(t, tc.want, c.bootID, tc.boot)
		assert.Equal(t, inv.GPUs, c.inv.GPUs, tc.boot)
		data, err := os.ReadFile(path)
		require.NoError(t, err)
		assert.Equal(t, tc.want != "", json.Valid(data) && containsKey(t, data, "boot_id"), tc.boot)
	}
}

func containsKey(t *testing.T, data []byte, key string) bool {
	t.Helper()
	var m map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(data, &m))
	_, ok := m[key]
	return ok
}

// A GPU the driver lists but whose information cannot be read yet (its
// UUID "GPU-????????-…" until it is initialised, right after a reboot) does
// not make a cache of another boot trusted: nothing shows it matches. It
// is stale; the hook's /proc discovery then fails on the same GPU, and the
// daemon starts undiscovered. (The cache used to be taken as it was, with
// the new GPU reachable unclaimed by "all".)
func TestStaleCacheWhenADriverGPUCannotBeRead(t *testing.T) {
	procRoot := t.TempDir()
	for _, e := range sameGPUs {
		fakeProcGPU(t, procRoot, e.bus, bootModel, e.uuid, e.minor, false)
	}
	fakeProcGPU(t, procRoot, "0000:5b:00.0", bootModel, "GPU-????????-????-????-????-????????????", 2, false)
	state := t.TempDir()
	path := filepath.Join(state, CacheFile)
	writeBootCache(t, path, bootEarlier, bootCacheGPUs())

	_, err := LoadInventory(config.DevicesConfig{Source: config.SourceAuto, ProcRoot: procRoot},
		LoadOptions{Role: RoleHook, StateDir: state, BootID: testBoot})
	require.ErrorIs(t, err, ErrStaleCache, "the hook refuses GPU containers")
	assert.ErrorContains(t, err, "cannot all be read")

	got, err := LoadInventory(config.DevicesConfig{Source: config.SourceNVML, ProcRoot: procRoot},
		LoadOptions{Role: RoleDaemon, StateDir: state, NVML: fakeNVML{}, BootID: testBoot})
	require.NoError(t, err)
	assert.Equal(t, OriginNone, got.Origin)
	assert.True(t, got.Inventory.Undiscovered)
}

// No procfs at all at devices.proc_root (set for another mount namespace)
// is not "no driver": nothing shows an earlier boot's cache matches, and it
// is stale (it used to be used as it was).
func TestStaleCacheWithoutProcfs(t *testing.T) {
	state := t.TempDir()
	path := filepath.Join(state, CacheFile)
	writeBootCache(t, path, bootEarlier, bootCacheGPUs())
	_, err := LoadInventory(config.DevicesConfig{Source: config.SourceAuto, ProcRoot: filepath.Join(t.TempDir(), "elsewhere")},
		LoadOptions{Role: RoleHook, StateDir: state, BootID: testBoot})
	require.ErrorIs(t, err, ErrStaleCache)
	assert.ErrorContains(t, err, "no procfs")
}
