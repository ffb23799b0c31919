// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// unknownUUID is how the driver shows the UUID of a GPU it has not
// initialised yet.
const unknownUUID = "GPU-????????-????-????-????-????????????"

// treeStatic is the [[devices.static]] list of fakeProcTree's GPUs: index in
// PCI bus id order, the driver's minors, the excluded GPU left out.
func treeStatic() []config.StaticGPU {
	return []config.StaticGPU{
		{Index: 0, UUID: gpuUUID(0), Minor: 2},
		{Index: 1, UUID: gpuUUID(1), Minor: 1},
		{Index: 2, UUID: gpuUUID(2), Minor: 0},
		{Index: 3, UUID: gpuUUID(3), Minor: 4},
	}
}

// editStatic returns treeStatic changed by edit.
func editStatic(edit func(s []config.StaticGPU) []config.StaticGPU) []config.StaticGPU {
	return edit(treeStatic())
}

// unknownTree is fakeProcTree with the UUIDs of GPUs 1 (0000:3b:00.0) and 3
// (0001:01:00.0) not known yet, as right after a boot without persistence
// mode.
func unknownTree(t testing.TB) string {
	t.Helper()
	root := fakeProcTree(t)
	fakeProcGPU(t, root, "0000:3b:00.0", "NVIDIA H100 80GB HBM3", unknownUUID, 1, false)
	fakeProcGPU(t, root, "0001:01:00.0", "NVIDIA H100 80GB HBM3", unknownUUID, 4, false)
	return root
}

// procfsWithoutDriver is a proc_root whose procfs has no NVIDIA driver tree.
func procfsWithoutDriver(t testing.TB) string {
	t.Helper()
	root := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(root, "proc"), 0o755))
	return root
}

// TestStaticListMatchesDriver: devices.source = "static" is checked against
// the GPUs the driver lists, where it lists any, by UUID, minor and index
// (a static list has no bus ids); a list the driver contradicts fails the
// load for every role, naming each differing GPU and what to do, rather
// than let "all" or an index reach a GPU it does not claim.
func TestStaticListMatchesDriver(t *testing.T) {
	tests := []struct {
		name   string
		root   func(testing.TB) string
		static []config.StaticGPU
		// want: substrings of the error; none: the list is the inventory.
		want []string
		// note: a substring of an inventory note.
		note string
		// unchecked: how far the list could not be checked.
		unchecked Unchecked
	}{
		{name: "the driver's GPUs: used", root: fakeProcTree, static: treeStatic()},
		// UUIDs are compared ignoring case, as the configuration's
		// validation, the inventory and the resolver read them.
		{name: "the driver's GPUs, UUIDs in upper case: used", root: fakeProcTree,
			static: editStatic(func(s []config.StaticGPU) []config.StaticGPU {
				for i := range s {
					s[i].UUID = upperUUID(s[i].UUID)
				}
				return s
			})},
		{name: "a GPU the list misses (added, or left out)", root: fakeProcTree,
			static: editStatic(func(s []config.StaticGPU) []config.StaticGPU { return s[:3] }),
			want:   []string{"GPU 3 (" + gpuUUID(3) + ") at 0001:01:00.0, /dev/nvidia4, is not in [[devices.static]]"}},
		{name: "a typo'd minor", root: fakeProcTree,
			static: editStatic(func(s []config.StaticGPU) []config.StaticGPU { s[1].Minor = 5; return s }),
			want:   []string{"GPU 1 (" + gpuUUID(1) + ") at 0000:3b:00.0 is /dev/nvidia1, /dev/nvidia5 in [[devices.static]]"}},
		{name: "indices not in PCI bus id order", root: fakeProcTree,
			static: editStatic(func(s []config.StaticGPU) []config.StaticGPU { s[0].Index, s[1].Index = 1, 0; return s }),
			want: []string{"GPU 0 (" + gpuUUID(0) + ") at 0000:07:00.0 is index 1 in [[devices.static]]",
				"GPU 1 (" + gpuUUID(1) + ") at 0000:3b:00.0 is index 0 in [[devices.static]]"}},
		{name: "a list copied from another host", root: fakeProcTree,
			static: editStatic(func(s []config.StaticGPU) []config.StaticGPU {
				for i := range s {
					s[i].UUID = gpuUUID(20 + i)
				}
				return s
			}),
			want: []string{"GPU 0 (" + gpuUUID(0) + ") at 0000:07:00.0, /dev/nvidia2, is not in [[devices.static]]",
				"GPU 3 (" + gpuUUID(3) + ") at 0001:01:00.0, /dev/nvidia4, is not in [[devices.static]]",
				"the [[devices.static]] GPU 0 (" + gpuUUID(20) + ") is not listed by the driver"}},
		{name: "the GPU the driver excludes listed too", root: fakeProcTree,
			static: editStatic(func(s []config.StaticGPU) []config.StaticGPU {
				return append(s, config.StaticGPU{Index: 4, UUID: gpuUUID(7), Minor: 3})
			}),
			want: []string{"the [[devices.static]] GPU 4 (" + gpuUUID(7) + ") is excluded by the driver at 0000:50:00.0 (NVreg_ExcludedGpus)",
				"leave it out of [[devices.static]]"}},
		// A list copied from nvidia-smi on a DGX Station names its display
		// adapter, which the driver shows and NVML's enumeration skips.
		{name: "the DGX Station's display adapter listed too", root: func(t testing.TB) string {
			root := fakeProcTree(t)
			fakeProcGPU(t, root, "0001:c1:00.0", "DGX Display", gpuUUID(9), 5, false)
			return root
		}, static: editStatic(func(s []config.StaticGPU) []config.StaticGPU {
			return append(s, config.StaticGPU{Index: 4, UUID: gpuUUID(9), Minor: 5})
		}), want: []string{"the [[devices.static]] GPU 4 (" + gpuUUID(9) + ") is a display adapter (DGX Display) at 0001:c1:00.0",
			"leave it out of [[devices.static]]"}},
		{name: "the DGX Station's display adapter left out: used", root: func(t testing.TB) string {
			root := fakeProcTree(t)
			fakeProcGPU(t, root, "0001:c1:00.0", "DGX Display", gpuUUID(9), 5, false)
			return root
		}, static: treeStatic()},
		{name: "no driver tree: the list as it is, unchecked", root: procfsWithoutDriver,
			static: editStatic(func(s []config.StaticGPU) []config.StaticGPU { return s[:1] }), unchecked: UncheckedNoDriver},
		{name: "no procfs at all (fake GPUs): the list as it is, unchecked", root: func(t testing.TB) string { return t.TempDir() },
			static: editStatic(func(s []config.StaticGPU) []config.StaticGPU { return s[:1] }), unchecked: UncheckedNoDriver},
		{name: "UUIDs not known yet, the same minors and indices: used, with a note, UUIDs unchecked", root: unknownTree, static: treeStatic(),
			note: "GPU 1 at 0000:3b:00.0 (/dev/nvidia1) matches [[devices.static]] by minor and index", unchecked: UncheckedUUIDs},
		{name: "UUID not known yet, a GPU the list misses", root: unknownTree,
			static: editStatic(func(s []config.StaticGPU) []config.StaticGPU { return s[:3] }),
			want:   []string{"GPU 3 (UUID not known yet) at 0001:01:00.0, /dev/nvidia4, is not in [[devices.static]]"}},
		{name: "UUID not known yet, another minor", root: unknownTree,
			static: editStatic(func(s []config.StaticGPU) []config.StaticGPU { s[1].Minor = 5; return s }),
			want: []string{"GPU 1 (UUID not known yet) at 0000:3b:00.0, /dev/nvidia1, is not in [[devices.static]]",
				"the [[devices.static]] GPU 1 (" + gpuUUID(1) + ") is not listed by the driver"}},
		{name: "UUID not known yet, indices swapped", root: unknownTree,
			static: editStatic(func(s []config.StaticGPU) []config.StaticGPU { s[1].Index, s[3].Index = 3, 1; return s }),
			want:   []string{"GPU 1 (UUID not known yet) at 0000:3b:00.0 is index 3 in [[devices.static]]"}},
		{name: "a driver tree that cannot be read", root: func(t testing.TB) string {
			root := fakeProcTree(t)
			writeFile(t, filepath.Join(root, procGPUsDir, "0000:3b:00.0", "information"), "GPU UUID: \t GPU-1234\nDevice Minor: \t 1\n")
			return root
		}, static: treeStatic(), want: []string{"cannot be read to compare", "not of the form"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := config.DevicesConfig{Source: config.SourceStatic, ProcRoot: tc.root(t), Static: tc.static}
			for _, role := range []Role{RoleDaemon, RoleRefresh, RoleHook, RoleReader} {
				dir := t.TempDir()
				got, err := LoadInventory(cfg, LoadOptions{Role: role, StateDir: dir, BootID: testBoot})
				if len(tc.want) > 0 {
					require.ErrorIs(t, err, ErrStaticMismatch, role)
					for _, w := range tc.want {
						assert.Contains(t, err.Error(), w, role)
					}
					assert.Contains(t, err.Error(), `set devices.source = "auto"`, "says what to do")
					assert.Contains(t, err.Error(), "fix", "says what to do")
					assert.Nil(t, got.Inventory)
					_, serr := os.Lstat(filepath.Join(dir, CacheFile))
					assert.ErrorIs(t, serr, os.ErrNotExist, "%s: no cache is written for a list the driver contradicts", role)
					continue
				}
				require.NoError(t, err, role)
				assert.Equal(t, OriginConfig, got.Origin)
				assert.Equal(t, "static", got.Inventory.Source)
				assert.Len(t, got.Inventory.GPUs, len(tc.static))
				if tc.note != "" {
					assert.Contains(t, strings.Join(got.Inventory.Notes, "\n"), tc.note)
				}
				assert.Equal(t, tc.unchecked, got.Inventory.Unchecked, role)
				if role == RoleDaemon || role == RoleRefresh {
					// The cache holds the mark, for its readers to check
					// it again.
					c, err := loadCache(filepath.Join(dir, CacheFile))
					require.NoError(t, err)
					assert.Equal(t, tc.unchecked, c.inv.Unchecked, role)
				}
			}
		})
	}
}

// TestAutoStaticFallbackMatchesDriver: under source "auto" the static list
// is the last resort, reached when NVML is not there (the hook, an image
// without the library) and /proc cannot be read because a GPU's UUID is not
// known yet. It used to be taken as complete; it is now compared with what
// the driver shows of those GPUs (bus id, minor, index), and a list the
// driver contradicts is skipped, so that the load fails closed: the hook
// refuses the GPU container, the daemon starts over an undiscovered
// inventory and discovers again.
func TestAutoStaticFallbackMatchesDriver(t *testing.T) {
	missing := editStatic(func(s []config.StaticGPU) []config.StaticGPU { return s[:3] })
	tests := []struct {
		name   string
		static []config.StaticGPU
		role   Role
		// wantStatic: the static list is the inventory; else the load
		// fails (want, the hook) or is undiscovered (the daemon).
		wantStatic bool
		want       []string
	}{
		{name: "hook: the list the driver shows", static: treeStatic(), role: RoleHook, wantStatic: true},
		{name: "hook: a GPU the list misses", static: missing, role: RoleHook,
			want: []string{"GPU UUID \"" + unknownUUID + "\" is not known yet",
				"GPU 3 (UUID not known yet) at 0001:01:00.0, /dev/nvidia4, is not in [[devices.static]]"}},
		{name: "reader without NVML: a GPU the list misses", static: missing, role: RoleReader,
			want: []string{"GPU 3 (UUID not known yet) at 0001:01:00.0, /dev/nvidia4, is not in [[devices.static]]"}},
		{name: "daemon without NVML: a GPU the list misses", static: missing, role: RoleDaemon},
		{name: "daemon without NVML: the list the driver shows", static: treeStatic(), role: RoleDaemon, wantStatic: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := config.DevicesConfig{Source: config.SourceAuto, ProcRoot: unknownTree(t), Static: tc.static}
			dir := t.TempDir()
			got, err := LoadInventory(cfg, LoadOptions{Role: tc.role, StateDir: dir, NVML: fakeNVML{}, BootID: testBoot})
			if tc.wantStatic {
				require.NoError(t, err)
				assert.Equal(t, "static", got.Inventory.Source)
				assert.Len(t, got.Inventory.GPUs, len(tc.static))
				assert.Contains(t, strings.Join(got.Inventory.Notes, "\n"), "its UUID is not known to the driver yet")
				return
			}
			if tc.role == RoleDaemon {
				require.NoError(t, err)
				assert.Equal(t, OriginNone, got.Origin, "the daemon refuses GPU requests and discovers again")
				assert.True(t, got.Inventory.Undiscovered)
				assert.Contains(t, errorsText(got.Skipped), "is not in [[devices.static]]")
				_, serr := os.Lstat(filepath.Join(dir, CacheFile))
				assert.ErrorIs(t, serr, os.ErrNotExist, "no cache is written for the hooks to trust")
				return
			}
			require.Error(t, err)
			assert.ErrorIs(t, err, ErrStaticMismatch, "the error of a discovery where no source works wraps each source's")
			assert.Nil(t, got.Inventory)
			for _, w := range tc.want {
				assert.Contains(t, err.Error(), w)
			}
			assert.Contains(t, err.Error(), "enable persistence mode (nvidia-smi -pm 1)", "says what to do")
		})
	}
}

// upperUUID is uuid with its hex digits in upper case, as a list typed by
// hand may spell it.
func upperUUID(uuid string) string {
	return "GPU-" + strings.ToUpper(strings.TrimPrefix(uuid, "GPU-"))
}

func errorsText(errs []error) string {
	var b strings.Builder
	for _, err := range errs {
		b.WriteString(err.Error())
		b.WriteByte('\n')
	}
	return b.String()
}

// TestListDiffsUnknownUUIDByBus: a GPU whose UUID is not known yet is
// matched to the listed GPU at its bus id where the list has bus ids (a
// cache), whatever the minors say, and its minor then compared.
func TestListDiffsUnknownUUIDByBus(t *testing.T) {
	list := []GPU{
		{Index: 0, UUID: gpuUUID(0), Minor: 0, BusID: "0000:07:00.0"},
		{Index: 1, UUID: gpuUUID(1), Minor: 1, BusID: "0000:3B:00.0"},
	}
	driver := []procGPU{
		{GPU: GPU{Index: 0, UUID: gpuUUID(0), Minor: 0, BusID: "0000:07:00.0"}},
		{GPU: GPU{Index: 1, Minor: 1, BusID: "0000:3b:00.0"}, uuidUnknown: true},
	}
	assert.Empty(t, listDiffs(driver, nil, list, listCache, true))
	driver[1].Minor = 0
	assert.Equal(t, []string{"GPU 1 (UUID not known yet) at 0000:3b:00.0 is /dev/nvidia0, /dev/nvidia1 in the cache"},
		listDiffs(driver, nil, list, listCache, true))
	driver[1].BusID = "0000:5b:00.0"
	assert.Equal(t, []string{"GPU 1 (UUID not known yet) at 0000:5b:00.0, /dev/nvidia0, is not in the cache",
		"the cache's GPU 1 (" + gpuUUID(1) + ") at 0000:3B:00.0 is not listed by the driver (removed, replaced or excluded)"},
		listDiffs(driver, nil, list, listCache, true))
}

// TestUncheckedStaticCacheIsCheckedInItsBoot: under source "auto" without
// NVML, a daemon that took the static list while a GPU's UUID was not known
// yet (matched by minor and index) writes it to the cache marked unchecked.
// Its readers check that cache against the driver on every read, in the
// boot it was written in too: while the UUID is unknown nothing shows it
// matches, and the hook matches the list itself; once the driver shows a
// UUID the list does not have (the card was replaced), the cache is stale
// and the hook discovers the real GPU. It used to use the cache, stamped
// with this boot, as it was for the whole boot, so that the real UUID,
// under unknown_device = "ignore", was admitted unclaimed.
func TestUncheckedStaticCacheIsCheckedInItsBoot(t *testing.T) {
	root := unknownTree(t)
	cfg := config.DevicesConfig{Source: config.SourceAuto, ProcRoot: root, Static: treeStatic()}
	dir := t.TempDir()
	opts := LoadOptions{StateDir: dir, NVML: fakeNVML{}, BootID: testBoot}

	opts.Role = RoleDaemon
	got, err := LoadInventory(cfg, opts)
	require.NoError(t, err)
	require.Equal(t, "static", got.Inventory.Source)
	require.Equal(t, UncheckedUUIDs, got.Inventory.Unchecked)

	opts.Role = RoleHook
	got, err = LoadInventory(cfg, opts)
	require.NoError(t, err)
	assert.Equal(t, OriginDiscovery, got.Origin, "nothing shows the cache matches while a UUID is not known")
	require.ErrorIs(t, errors.Join(got.Skipped...), ErrStaleCache)
	assert.Equal(t, UncheckedUUIDs, got.Inventory.Unchecked)

	// GPU 1 was replaced: the driver now shows its real UUID.
	fakeProcGPU(t, root, "0000:3b:00.0", "NVIDIA H100 80GB HBM3", gpuUUID(11), 1, false)
	fakeProcGPU(t, root, "0001:01:00.0", "NVIDIA H100 80GB HBM3", gpuUUID(3), 4, false)
	got, err = LoadInventory(cfg, opts)
	require.NoError(t, err)
	assert.Equal(t, OriginDiscovery, got.Origin)
	require.ErrorIs(t, errors.Join(got.Skipped...), ErrStaleCache)
	assert.Contains(t, errorsText(got.Skipped), "GPU 1 ("+gpuUUID(11)+") at 0000:3b:00.0 is not in the cache")
	assert.Equal(t, "proc", got.Inventory.Source)
	_, ok := got.Inventory.Lookup(gpuUUID(11))
	assert.True(t, ok, "the real GPU is in the inventory the hook decides with")

	// The right UUIDs, shown at last: the cache matches and is used.
	fakeProcGPU(t, root, "0000:3b:00.0", "NVIDIA H100 80GB HBM3", gpuUUID(1), 1, false)
	got, err = LoadInventory(cfg, opts)
	require.NoError(t, err)
	assert.Equal(t, OriginCache, got.Origin)
	assert.Empty(t, got.Skipped)

	// Indices are compared for a static list's cache: they were written
	// by hand.
	swapped := treeStatic()
	swapped[1].Index, swapped[3].Index = 3, 1
	inv, err := NewInventory("static", staticGPUs(swapped))
	require.NoError(t, err)
	marked := *inv
	marked.Unchecked = UncheckedUUIDs
	inv, err = newInventory(marked)
	require.NoError(t, err)
	require.NoError(t, SaveCache(filepath.Join(dir, CacheFile), inv, testBoot))
	got, err = LoadInventory(cfg, opts)
	require.NoError(t, err)
	assert.Equal(t, OriginDiscovery, got.Origin)
	assert.Contains(t, errorsText(got.Skipped), "is index 3 in the cache")

	// A static list's cache without the mark (written by a binary from
	// before static lists were checked) is checked in its boot too: GPU 1
	// was replaced, and the list it holds names the old card.
	fakeProcGPU(t, root, "0000:3b:00.0", "NVIDIA H100 80GB HBM3", gpuUUID(11), 1, false)
	inv, err = NewInventory("static", staticGPUs(treeStatic()))
	require.NoError(t, err)
	require.Empty(t, inv.Unchecked)
	require.NoError(t, SaveCache(filepath.Join(dir, CacheFile), inv, testBoot))
	got, err = LoadInventory(cfg, opts)
	require.NoError(t, err)
	assert.Equal(t, OriginDiscovery, got.Origin, "an unmarked static cache is not trusted unchecked")
	assert.Contains(t, errorsText(got.Skipped), "GPU 1 ("+gpuUUID(11)+") at 0000:3b:00.0 is not in the cache")
	_, ok = got.Inventory.Lookup(gpuUUID(11))
	assert.True(t, ok, "the real GPU is in the inventory the hook decides with")
}

// staticGPUs is the inventory's reading of a static list.
func staticGPUs(s []config.StaticGPU) []GPU {
	gpus, err := NewStaticLoader(s).Load()
	if err != nil {
		panic(err)
	}
	return gpus
}

// TestUncheckedUUIDsRefuseUnknownIDs: over a static list whose UUIDs the
// driver does not show yet, an id the list lacks may be the real UUID of a
// GPU the list names wrongly: it is refused under unknown_device = "ignore"
// too, as over an incomplete inventory. A list checked in full, or one with
// no driver to check against (no GPU is reachable), ignores it as before.
func TestUncheckedUUIDsRefuseUnknownIDs(t *testing.T) {
	pol := defaultPolicy()
	pol.UnknownDevice = config.UnknownIgnore
	req := Request{Env: env("NVIDIA_VISIBLE_DEVICES=" + gpuUUID(11))}
	for _, tc := range []struct {
		unchecked Unchecked
		refused   bool
	}{{"", false}, {UncheckedNoDriver, false}, {UncheckedUUIDs, true}} {
		t.Run(string(tc.unchecked), func(t *testing.T) {
			inv, err := newInventory(Inventory{Source: "static", GPUs: staticGPUs(treeStatic()), Unchecked: tc.unchecked})
			require.NoError(t, err)
			res, err := NewResolver(inv, pol).Resolve(req)
			if !tc.refused {
				require.NoError(t, err)
				assert.Empty(t, res.Devices)
				return
			}
			require.ErrorIs(t, err, ErrUnknownDevice)
			assert.Contains(t, err.Error(), "whose UUIDs are not checked yet")
		})
	}
}
