// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// fakeProcTree writes a host whose PCI order differs from both the directory
// listing order and the minor numbers, with one GPU excluded by the driver.
func fakeProcTree(t testing.TB) string {
	t.Helper()
	root := t.TempDir()
	fakeProcGPU(t, root, "0000:86:00.0", "NVIDIA H100 80GB HBM3", gpuUUID(2), 0, false)
	fakeProcGPU(t, root, "0000:07:00.0", "NVIDIA H100 80GB HBM3", gpuUUID(0), 2, false)
	fakeProcGPU(t, root, "0000:3b:00.0", "NVIDIA H100 80GB HBM3", gpuUUID(1), 1, false)
	fakeProcGPU(t, root, "0000:50:00.0", "NVIDIA H100 80GB HBM3", gpuUUID(7), 3, true)
	fakeProcGPU(t, root, "0001:01:00.0", "NVIDIA H100 80GB HBM3", gpuUUID(3), 4, false)
	writeFile(t, filepath.Join(root, "proc/driver/nvidia/gpus/README"), "not a GPU directory")
	return root
}

func TestProcLoader(t *testing.T) {
	root := fakeProcTree(t)
	l := NewProcLoader(root)
	assert.Equal(t, "proc", l.Name())
	gpus, notes, err := l.(notingLoader).loadNoted()
	require.NoError(t, err)
	assert.Equal(t, []GPU{
		{Index: 0, UUID: gpuUUID(0), Minor: 2, Model: "NVIDIA H100 80GB HBM3", BusID: "0000:07:00.0"},
		{Index: 1, UUID: gpuUUID(1), Minor: 1, Model: "NVIDIA H100 80GB HBM3", BusID: "0000:3b:00.0"},
		{Index: 2, UUID: gpuUUID(2), Minor: 0, Model: "NVIDIA H100 80GB HBM3", BusID: "0000:86:00.0"},
		{Index: 3, UUID: gpuUUID(3), Minor: 4, Model: "NVIDIA H100 80GB HBM3", BusID: "0001:01:00.0"},
	}, gpus, "index = position in PCI bus order; the excluded GPU is skipped")
	require.Len(t, notes, 1)
	assert.Contains(t, notes[0], gpuUUID(7))
	assert.Contains(t, notes[0], "excluded")

	plain, err := l.Load()
	require.NoError(t, err)
	assert.Equal(t, gpus, plain)
	_, err = NewInventory("proc", gpus)
	require.NoError(t, err)
}

func TestProcLoaderFailures(t *testing.T) {
	t.Run("no root", func(t *testing.T) {
		_, err := NewProcLoader(filepath.Join(t.TempDir(), "nope")).Load()
		require.ErrorIs(t, err, ErrSourceUnavailable)
	})
	t.Run("no driver", func(t *testing.T) {
		_, err := NewProcLoader(t.TempDir()).Load()
		require.ErrorIs(t, err, ErrSourceUnavailable)
		assert.Contains(t, err.Error(), "proc/driver/nvidia/gpus")
	})
	for _, tc := range []struct {
		name, info, want string
	}{
		{"UUID not known yet", "GPU UUID: \t GPU-????????-????-????-????-????????????\nDevice Minor: \t 0\n", "persistence mode"},
		{"malformed UUID", "GPU UUID: \t GPU-1234\nDevice Minor: \t 0\n", "not of the form"},
		{"no minor", "GPU UUID: \t " + gpuUUID(0) + "\n", "Device Minor"},
		{"minor out of range", "GPU UUID: \t " + gpuUUID(0) + "\nDevice Minor: \t 254\n", "not a number in 0-253"},
		{"minor not a number", "GPU UUID: \t " + gpuUUID(0) + "\nDevice Minor: \t x\n", "not a number"},
		{"bad bus location", "GPU UUID: \t " + gpuUUID(0) + "\nDevice Minor: \t 0\nBus Location: \t nowhere\n", "not a PCI bus id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			writeFile(t, filepath.Join(root, "proc/driver/nvidia/gpus/0000:07:00.0/information"), tc.info)
			_, err := NewProcLoader(root).Load()
			require.Error(t, err)
			assert.NotErrorIs(t, err, ErrSourceUnavailable, "a broken tree is an error, not an absent source")
			assert.Contains(t, err.Error(), tc.want)
		})
	}
	t.Run("directory name is the bus id when the file lacks one", func(t *testing.T) {
		root := t.TempDir()
		writeFile(t, filepath.Join(root, "proc/driver/nvidia/gpus/0000:07:00.0/information"),
			"GPU UUID: \t "+gpuUUID(0)+"\nDevice Minor: \t 5\n")
		gpus, err := NewProcLoader(root).Load()
		require.NoError(t, err)
		assert.Equal(t, []GPU{{Index: 0, UUID: gpuUUID(0), Minor: 5, BusID: "0000:07:00.0"}}, gpus)
	})
	t.Run("oversized file", func(t *testing.T) {
		root := t.TempDir()
		big := make([]byte, maxProcFile+1)
		for i := range big {
			big[i] = 'x'
		}
		writeFile(t, filepath.Join(root, "proc/driver/nvidia/gpus/0000:07:00.0/information"), string(big))
		_, err := NewProcLoader(root).Load()
		require.ErrorContains(t, err, "larger than")
	})
}

const migMinors = `config 1
monitor 2
gpu0/gi1/access 12
gpu0/gi1/ci0/access 13
gpu3/gi1/access 30
gpu3/gi1/ci0/access 31
gpu3/gi1/ci1/access 32
gpu3/gi2/access 39
gpu3/gi2/ci0/access 40
gpu3/gi2/ci1/access 41
gpu3/gi3/access 48
gpu3/gi3/ci0/access 49
fabric/some-future-capability 60

`

func TestParseMIGMinors(t *testing.T) {
	caps, err := parseMIGMinors(migMinors, testGPUs())
	require.NoError(t, err)
	assert.Equal(t, testCaps(), caps, "only instances of the inventory are kept")

	for _, bad := range []string{"config\n", "config one\n", "a b c\n", "gpu0/gi1/access 99999999999999\n"} {
		_, err := parseMIGMinors(bad, testGPUs())
		assert.Error(t, err, bad)
	}
	for _, skipped := range []string{"gpu0/access 5\n", "gpux/gi1/access 5\n", "gpu3/gi1/ci0/x 5\n", "gpu3/gi1/ci0/ci1/access 5\n"} {
		caps, err := parseMIGMinors(skipped, testGPUs())
		require.NoError(t, err, skipped)
		assert.Empty(t, caps, skipped)
	}
}

func TestParseCapsMajor(t *testing.T) {
	assert.Equal(t, int64(508), parseCapsMajor("Character devices:\n  1 mem\n195 nvidia\n508 nvidia-caps\n511 nvidia-uvm\n\nBlock devices:\n  8 sd\n"))
	assert.Equal(t, int64(0), parseCapsMajor("Character devices:\n195 nvidia\n\nBlock devices:\n508 nvidia-caps\n"), "block section does not count")
	assert.Equal(t, int64(0), parseCapsMajor(""))
}

func TestStaticLoader(t *testing.T) {
	l := NewStaticLoader([]config.StaticGPU{
		{Index: 0, UUID: gpuUUID(0), Minor: 0, Model: "NVIDIA H100 80GB HBM3", MemoryMiB: 81559},
		{Index: 1, UUID: gpuUUID(1), Minor: 3, MIG: []config.StaticMIG{{Index: 0, UUID: migUUID(1, 0), GI: 1, CI: 0}}},
	})
	assert.Equal(t, "static", l.Name())
	gpus, err := l.Load()
	require.NoError(t, err)
	assert.Equal(t, []GPU{
		{Index: 0, UUID: gpuUUID(0), Minor: 0, Model: "NVIDIA H100 80GB HBM3", MemoryMiB: 81559},
		{Index: 1, UUID: gpuUUID(1), Minor: 3, MIG: []MIG{{Index: 0, UUID: migUUID(1, 0), GI: 1, CI: 0, ParentUUID: gpuUUID(1), ParentIndex: 1}}},
	}, gpus)

	_, err = NewStaticLoader(nil).Load()
	require.ErrorIs(t, err, ErrSourceUnavailable)
}

func TestDiscoverExplicitSources(t *testing.T) {
	root := fakeProcTree(t)
	inv, err := Discover(config.DevicesConfig{Source: config.SourceProc, ProcRoot: root}, nil)
	require.NoError(t, err)
	assert.Equal(t, "proc", inv.Source)
	assert.Len(t, inv.GPUs, 4)
	assert.Len(t, inv.Notes, 1, "the excluded GPU is noted")

	_, err = Discover(config.DevicesConfig{Source: config.SourceProc, ProcRoot: t.TempDir()}, nil)
	require.ErrorIs(t, err, ErrSourceUnavailable)
	assert.Contains(t, err.Error(), "from proc")

	static := []config.StaticGPU{{Index: 0, UUID: gpuUUID(0)}, {Index: 1, UUID: gpuUUID(1), Minor: 0}}
	_, err = Discover(config.DevicesConfig{Source: config.SourceStatic, ProcRoot: root, Static: static}, nil)
	require.ErrorIs(t, err, ErrInvalidInventory, "an explicit source that is inconsistent fails")

	_, err = Discover(config.DevicesConfig{Source: "magic"}, nil)
	require.ErrorContains(t, err, `"magic"`)
}

// zeroGPUs is a source that works and finds no GPU (NVML with every GPU
// gone, say).
type zeroGPUs struct{}

func (zeroGPUs) Name() string         { return "nvml" }
func (zeroGPUs) Load() ([]GPU, error) { return nil, nil }

// An inventory that every source found empty counts the NVIDIA GPUs the PCI
// bus shows all the same (unbound, or bound to nvidia; not vfio-pci's, not
// other vendors' or other classes), and says so.
func TestDiscoverCountsUnlistedGPUs(t *testing.T) {
	root := t.TempDir()
	pci := filepath.Join(root, "sys", "bus", "pci", "devices")
	device := func(addr, vendor, class, driver string) {
		dir := filepath.Join(pci, addr)
		require.NoError(t, os.MkdirAll(dir, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "vendor"), []byte(vendor+"\n"), 0o644))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "class"), []byte(class+"\n"), 0o644))
		if driver != "" {
			require.NoError(t, os.Symlink("../../../bus/pci/drivers/"+driver, filepath.Join(dir, "driver")))
		}
	}
	device("0000:3b:00.0", "0x10de", "0x030200", "")         // unbound: the driver is not loaded
	device("0000:86:00.0", "0x10de", "0x030000", "nvidia")   // bound, yet not listed
	device("0000:5e:00.0", "0x10de", "0x030200", "vfio-pci") // a VM's
	device("0000:3c:00.0", "0x10de", "0x040300", "")         // its audio function
	device("0000:00:02.0", "0x8086", "0x030000", "i915")

	inv, err := Discover(config.DevicesConfig{Source: config.SourceAuto, ProcRoot: root}, zeroGPUs{})
	require.NoError(t, err)
	onBus := inv
	assert.Empty(t, inv.GPUs)
	assert.Equal(t, 2, inv.UnlistedGPUs)
	assert.Contains(t, strings.Join(inv.Notes, "\n"), "2 NVIDIA GPU(s) on the PCI bus are not listed (0000:3b:00.0, 0000:86:00.0): is the NVIDIA driver loaded?")

	// A source named alone that lists none counts them too: NVML, or the
	// driver's /proc tree, may answer before the driver lists its GPUs.
	require.NoError(t, os.MkdirAll(filepath.Join(root, procGPUsDir), 0o755))
	for _, src := range []config.Source{config.SourceNVML, config.SourceProc} {
		named, err := Discover(config.DevicesConfig{Source: src, ProcRoot: root}, zeroGPUs{})
		require.NoError(t, err, src)
		assert.Empty(t, named.GPUs)
		assert.Equal(t, 2, named.UnlistedGPUs, "source %s", src)
	}
	// Without NVIDIA GPUs on the bus (or without sysfs) an empty inventory
	// is a host without GPUs.
	inv, err = Discover(config.DevicesConfig{Source: config.SourceAuto, ProcRoot: t.TempDir()}, zeroGPUs{})
	require.NoError(t, err)
	assert.Zero(t, inv.UnlistedGPUs)

	// The count survives the cache the hooks read.
	data, err := json.Marshal(onBus)
	require.NoError(t, err)
	var back Inventory
	require.NoError(t, json.Unmarshal(data, &back))
	assert.Equal(t, 2, back.UnlistedGPUs)
	_, err = newInventory(Inventory{Source: "nvml", GPUs: testGPUs(), UnlistedGPUs: 1})
	require.ErrorIs(t, err, ErrInvalidInventory, "unlisted GPUs only next to none listed")
}

func TestDiscoverAttachesMIGCaps(t *testing.T) {
	root := t.TempDir()
	writeFile(t, filepath.Join(root, "proc/driver/nvidia-caps/mig-minors"), migMinors)
	writeFile(t, filepath.Join(root, "proc/devices"), "Character devices:\n195 nvidia\n508 nvidia-caps\n\nBlock devices:\n")
	var static []config.StaticGPU
	for _, g := range testGPUs() {
		s := config.StaticGPU{Index: g.Index, UUID: g.UUID, Minor: g.Minor}
		for _, m := range g.MIG {
			s.MIG = append(s.MIG, config.StaticMIG{Index: m.Index, UUID: m.UUID, GI: m.GI, CI: m.CI})
		}
		static = append(static, s)
	}
	inv, err := Discover(config.DevicesConfig{Source: config.SourceStatic, ProcRoot: root, Static: static}, nil)
	require.NoError(t, err)
	assert.Equal(t, int64(508), inv.CapsMajor)
	assert.Equal(t, testCaps(), inv.MIGCaps)
	assert.Empty(t, inv.Notes)

	res, err := NewResolver(inv, defaultPolicy()).Resolve(Request{Devices: []LinuxDevice{
		dev("/dev/nvidia3", 195, 3), dev("/dev/nvidia-caps/nvidia-cap40", 508, 40)}})
	require.NoError(t, err)
	assert.Equal(t, []string{migUUID(1, 1)}, res.UUIDs())

	// Without the mapping: a note, and no caps; the major is kept, so a
	// node or rule of it is still recognised, under any name, and claims
	// its whole GPU.
	require.NoError(t, os.Remove(filepath.Join(root, "proc/driver/nvidia-caps/mig-minors")))
	inv, err = Discover(config.DevicesConfig{Source: config.SourceStatic, ProcRoot: root, Static: static}, nil)
	require.NoError(t, err)
	assert.Empty(t, inv.MIGCaps)
	assert.Equal(t, int64(508), inv.CapsMajor)
	require.Len(t, inv.Notes, 1)
	assert.Contains(t, inv.Notes[0], "MIG capability mapping unknown")
	r := NewResolver(inv, defaultPolicy())
	for _, capNode := range []LinuxDevice{dev("/dev/nvidia-caps/nvidia-cap40", 508, 40), dev("/dev/x", 508, 40)} {
		res, err = r.Resolve(Request{Env: env("NVIDIA_VISIBLE_DEVICES=1:0"), Devices: []LinuxDevice{dev("/dev/nvidia3", 195, 3), capNode}})
		require.NoError(t, err)
		assert.Equal(t, sorted(gpuUUID(1), migUUID(1, 0)), res.UUIDs(), "%s: the whole parent GPU", capNode.Path)
	}
	req := Request{Env: env("NVIDIA_VISIBLE_DEVICES=1:0"), Devices: []LinuxDevice{dev("/dev/nvidia3", 195, 3)}, HostDevMounted: true}
	req.ApplyDeviceRules([]DeviceRule{rule(false, "a", -1, -1, "rwm"), rule(true, "c", 195, 3, "rwm"), rule(true, "c", 508, -1, "rwm")})
	res, err = r.Resolve(req)
	require.NoError(t, err)
	assert.Equal(t, sorted(gpuUUID(1), migUUID(1, 0)), res.UUIDs(), "c 508:* opens every capability: the whole parent GPU")

	// Without /proc/devices either: both notes.
	require.NoError(t, os.Remove(filepath.Join(root, "proc/devices")))
	inv, err = Discover(config.DevicesConfig{Source: config.SourceStatic, ProcRoot: root, Static: static}, nil)
	require.NoError(t, err)
	assert.Zero(t, inv.CapsMajor)
	require.Len(t, inv.Notes, 2)
	assert.Contains(t, inv.Notes[0], "nvidia-caps major unknown")
	assert.Contains(t, inv.Notes[1], "MIG capability mapping unknown")
}

// TestResolveDoesNoFileIO loads an inventory from a fake /proc tree, removes
// the tree, and resolves again: the answers must be identical, because
// resolution reads only the in-memory inventory.
func TestResolveDoesNoFileIO(t *testing.T) {
	root := fakeProcTree(t)
	inv, err := Discover(config.DevicesConfig{Source: config.SourceProc, ProcRoot: root}, nil)
	require.NoError(t, err)
	r := NewResolver(inv, defaultPolicy())
	reqs := []Request{
		{Env: env("NVIDIA_VISIBLE_DEVICES=0," + gpuUUID(2)), Devices: []LinuxDevice{dev("/dev/nvidia4", 195, 4)}},
		{Env: env("NVIDIA_VISIBLE_DEVICES=all")},
		{Mounts: []string{mr + "1"}, Annotations: map[string]string{"cdi.k8s.io/x": "nvidia.com/gpu=gpu3"}},
		{Env: env("NVIDIA_VISIBLE_DEVICES=9")},
	}
	type outcome struct {
		res Resolution
		err string
	}
	resolveAll := func() []outcome {
		var out []outcome
		for _, req := range reqs {
			res, err := r.Resolve(req)
			o := outcome{res: res}
			if err != nil {
				o.err = err.Error()
			}
			out = append(out, o)
		}
		return out
	}
	before := resolveAll()
	require.Equal(t, sorted(gpuUUID(0), gpuUUID(2), gpuUUID(3)), before[0].res.UUIDs())
	require.NoError(t, os.RemoveAll(root))
	_, err = os.Stat(root)
	require.ErrorIs(t, err, os.ErrNotExist)
	assert.Equal(t, before, resolveAll())
}
