// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package nvmlloader

import (
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// mockHost is go-nvml's DGX H100 mock with what a real host has and the mock
// lacks: minor numbers that differ from indices, PCI bus ids, and MIG device
// handles (the mock creates GPU/compute instances but implements neither
// GetMaxMigDeviceCount nor GetMigDeviceHandleByIndex nor any MIG handle).
type mockHost struct {
	srv  *server.Server
	migs []*mock.Device
}

const migGPU = 1 // the MIG-enabled GPU of mockHost

func newMockHost(t testing.TB) *mockHost {
	t.Helper()
	h := &mockHost{srv: dgxh100.New()}
	n := len(h.srv.Devices)
	for i, d := range h.srv.Devices {
		sd := d.(*server.Device)
		sd.Minor = n - 1 - i
		bus := fmt.Sprintf("00000000:%02X:00.0", 0x10*(i+1))
		sd.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) {
			p := nvml.PciInfo{PciDeviceId: sd.Config.PciDeviceId}
			for k := 0; k < len(bus); k++ {
				p.BusId[k] = int8(bus[k])
			}
			return p, nvml.SUCCESS
		}
	}
	h.enableMIG(t, h.srv.Devices[migGPU].(*server.Device))
	return h
}

// enableMIG creates, through the mock's own MIG support, a 1-slice GPU
// instance with one compute instance and a 2-slice GPU instance with two,
// and exposes them as MIG device handles at NVML MIG indices 1, 0 and 3
// (index 2 is a gap, which NVML reports as ERROR_NOT_FOUND).
func (h *mockHost) enableMIG(t testing.TB, parent *server.Device) {
	t.Helper()
	_, ret := parent.SetMigMode(nvml.DEVICE_MIG_ENABLE)
	require.Equal(t, nvml.SUCCESS, ret)
	var created []struct{ gi, ci int }
	for _, spec := range []struct{ profile, cis int }{{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 1}, {nvml.GPU_INSTANCE_PROFILE_2_SLICE, 2}} {
		giProfile, ret := parent.GetGpuInstanceProfileInfo(spec.profile)
		require.Equal(t, nvml.SUCCESS, ret)
		gi, ret := parent.CreateGpuInstance(&giProfile)
		require.Equal(t, nvml.SUCCESS, ret)
		giInfo, ret := gi.GetInfo()
		require.Equal(t, nvml.SUCCESS, ret)
		ciProfile, ret := gi.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		require.Equal(t, nvml.SUCCESS, ret)
		for c := 0; c < spec.cis; c++ {
			ci, ret := gi.CreateComputeInstance(&ciProfile)
			require.Equal(t, nvml.SUCCESS, ret)
			ciInfo, ret := ci.GetInfo()
			require.Equal(t, nvml.SUCCESS, ret)
			created = append(created, struct{ gi, ci int }{int(giInfo.Id), int(ciInfo.Id)})
		}
	}
	// created: (0,0), (1,0), (1,1). NVML MIG index → created instance.
	slots := map[int]int{0: 1, 1: 0, 3: 2}
	handles := map[int]*mock.Device{}
	for idx, c := range slots {
		m := newMIGHandle(parent, migUUID(migGPU, idx), created[c].gi, created[c].ci)
		handles[idx] = m
		h.migs = append(h.migs, m)
	}
	parent.GetMaxMigDeviceCountFunc = func() (int, nvml.Return) { return 7, nvml.SUCCESS }
	parent.GetMigDeviceHandleByIndexFunc = func(n int) (nvml.Device, nvml.Return) {
		if m, ok := handles[n]; ok {
			return m, nvml.SUCCESS
		}
		return nil, nvml.ERROR_NOT_FOUND
	}
}

func newMIGHandle(parent nvml.Device, uuid string, gi, ci int) *mock.Device {
	return &mock.Device{
		GetUUIDFunc:              func() (string, nvml.Return) { return uuid, nvml.SUCCESS },
		IsMigDeviceHandleFunc:    func() (bool, nvml.Return) { return true, nvml.SUCCESS },
		GetGpuInstanceIdFunc:     func() (int, nvml.Return) { return gi, nvml.SUCCESS },
		GetComputeInstanceIdFunc: func() (int, nvml.Return) { return ci, nvml.SUCCESS },
		GetNameFunc:              func() (string, nvml.Return) { return "NVIDIA H100 80GB HBM3 MIG 1g.10gb", nvml.SUCCESS },
		GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) {
			return nvml.Memory{Total: 9856 << 20}, nvml.SUCCESS
		},
		GetDeviceHandleFromMigDeviceHandleFunc: func() (nvml.Device, nvml.Return) { return parent, nvml.SUCCESS },
	}
}

// calls counts every NVML call recorded by the mocks: the server, each GPU
// and each MIG handle (moq records each call; *Calls() methods return them).
func (h *mockHost) calls() int {
	objs := []any{h.srv}
	for _, d := range h.srv.Devices {
		objs = append(objs, d)
	}
	for _, m := range h.migs {
		objs = append(objs, m)
	}
	n := 0
	for _, o := range objs {
		v := reflect.ValueOf(o)
		for i := 0; i < v.NumMethod(); i++ {
			m := v.Type().Method(i)
			if strings.HasSuffix(m.Name, "Calls") && m.Type.NumIn() == 1 && m.Type.NumOut() == 1 && m.Type.Out(0).Kind() == reflect.Slice {
				n += v.Method(i).Call(nil)[0].Len()
			}
		}
	}
	return n
}

func (h *mockHost) expected() []devices.GPU {
	var out []devices.GPU
	for i, d := range h.srv.Devices {
		sd := d.(*server.Device)
		g := devices.GPU{Index: i, UUID: sd.UUID, Minor: sd.Minor, Model: sd.Config.Name,
			MemoryMiB: sd.MemoryInfo.Total >> 20, BusID: fmt.Sprintf("0000:%02x:00.0", 0x10*(i+1))}
		if i == migGPU {
			for _, m := range []struct{ idx, gi, ci int }{{0, 1, 0}, {1, 0, 0}, {3, 1, 1}} {
				g.MIG = append(g.MIG, devices.MIG{Index: m.idx, UUID: migUUID(migGPU, m.idx), GI: m.gi, CI: m.ci,
					ParentUUID: sd.UUID, ParentIndex: i, Model: "NVIDIA H100 80GB HBM3 MIG 1g.10gb", MemoryMiB: 9856})
			}
		}
		out = append(out, g)
	}
	return out
}

func TestNVMLLoaderEnumeratesGPUsAndMIG(t *testing.T) {
	h := newMockHost(t)
	l := New(h.srv)
	assert.Equal(t, "nvml", l.Name())
	gpus, err := l.Load()
	require.NoError(t, err)
	assert.Equal(t, h.expected(), gpus)
	assert.Len(t, h.srv.InitCalls(), 1)
	assert.Len(t, h.srv.ShutdownCalls(), 1, "NVML is shut down after loading")

	inv, err := devices.NewInventory(l.Name(), gpus)
	require.NoError(t, err)
	d, ok := inv.ByMinor(7)
	require.True(t, ok)
	assert.Equal(t, "0", d.Index, "minor 7 is GPU 0 on this host")
	d, ok = inv.ByIndex("1:3")
	require.True(t, ok)
	assert.Equal(t, migUUID(migGPU, 3), d.UUID)
}

func TestNVMLLoaderKeepsNVMLIndicesWhenSkippingDisplays(t *testing.T) {
	srv := dgxa100.New() // no MIG enabled: the loader must not touch MIG functions the mock lacks
	display := srv.Devices[2].(*server.Device)
	display.GetNameFunc = func() (string, nvml.Return) { return "DGX Display", nvml.SUCCESS }
	gpus, err := New(srv).Load()
	require.NoError(t, err)
	var idx []int
	for _, g := range gpus {
		idx = append(idx, g.Index)
		assert.Equal(t, g.Index, g.Minor, "dgxa100 mock: minor = index")
		assert.Empty(t, g.MIG)
		assert.Empty(t, g.BusID, "the mock has no bus id")
	}
	assert.Equal(t, []int{0, 1, 3, 4, 5, 6, 7}, idx)
}

func TestNVMLLoaderUnavailable(t *testing.T) {
	for _, ret := range []nvml.Return{nvml.ERROR_LIBRARY_NOT_FOUND, nvml.ERROR_DRIVER_NOT_LOADED} {
		srv := dgxh100.New()
		srv.InitFunc = func() nvml.Return { return ret }
		_, err := New(srv).Load()
		require.ErrorIs(t, err, devices.ErrSourceUnavailable, ret.Error())
		require.ErrorIs(t, err, ret)
		assert.Empty(t, srv.ShutdownCalls(), "no NVML call after a failed Init")
	}
}

func TestNVMLLoaderErrors(t *testing.T) {
	t.Run("init fails otherwise", func(t *testing.T) {
		srv := dgxh100.New()
		srv.InitFunc = func() nvml.Return { return nvml.ERROR_NO_PERMISSION }
		_, err := New(srv).Load()
		require.ErrorIs(t, err, nvml.ERROR_NO_PERMISSION)
		assert.NotErrorIs(t, err, devices.ErrSourceUnavailable)
	})
	for _, tc := range []struct {
		name    string
		breakIt func(h *mockHost)
		want    string
	}{
		{"UUID", func(h *mockHost) {
			h.srv.Devices[2].(*server.Device).GetUUIDFunc = func() (string, nvml.Return) { return "", nvml.ERROR_GPU_IS_LOST }
		}, "GPU 2: get UUID"},
		{"minor", func(h *mockHost) {
			h.srv.Devices[3].(*server.Device).GetMinorNumberFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_UNKNOWN }
		}, "GPU 3 (GPU-"},
		{"MIG mode", func(h *mockHost) {
			h.srv.Devices[0].(*server.Device).GetMigModeFunc = func() (int, int, nvml.Return) { return 0, 0, nvml.ERROR_UNKNOWN }
		}, "MIG mode"},
		{"MIG instance", func(h *mockHost) {
			h.migs[0].GetGpuInstanceIdFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_UNKNOWN }
		}, "get GPU instance id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMockHost(t)
			tc.breakIt(h)
			_, err := New(h.srv).Load()
			require.ErrorContains(t, err, tc.want)
			assert.NotErrorIs(t, err, devices.ErrSourceUnavailable)
			assert.Len(t, h.srv.ShutdownCalls(), 1, "NVML is shut down on failure too")
		})
	}
	t.Run("descriptive fields are optional", func(t *testing.T) {
		h := newMockHost(t)
		sd := h.srv.Devices[0].(*server.Device)
		sd.GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) { return nvml.Memory{}, nvml.ERROR_NOT_SUPPORTED }
		sd.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) { return nvml.PciInfo{}, nvml.ERROR_NOT_SUPPORTED }
		gpus, err := New(h.srv).Load()
		require.NoError(t, err)
		assert.Zero(t, gpus[0].MemoryMiB)
		assert.Empty(t, gpus[0].BusID)
	})
}

func libraryNotFound() *server.Server {
	srv := dgxh100.New()
	srv.InitFunc = func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }
	return srv
}

func TestDiscoverAuto(t *testing.T) {
	static := []config.StaticGPU{{Index: 0, UUID: gpuUUID(0), Minor: 0}}
	t.Run("NVML first", func(t *testing.T) {
		h := newMockHost(t)
		inv, err := devices.Discover(config.DevicesConfig{Source: config.SourceAuto, ProcRoot: fakeProcTree(t), Static: static}, New(h.srv))
		require.NoError(t, err)
		assert.Equal(t, "nvml", inv.Source)
		assert.Equal(t, h.expected(), inv.GPUs)
		assert.Contains(t, strings.Join(inv.Notes, "\n"), "MIG capability mapping unknown", "the fake tree has no mig-minors")
	})
	t.Run("proc when NVML is absent", func(t *testing.T) {
		inv, err := devices.Discover(config.DevicesConfig{Source: config.SourceAuto, ProcRoot: fakeProcTree(t), Static: static}, New(libraryNotFound()))
		require.NoError(t, err)
		assert.Equal(t, "proc", inv.Source)
		assert.Len(t, inv.GPUs, 4)
		require.NotEmpty(t, inv.Notes)
		assert.Contains(t, inv.Notes[0], "nvml: skipped")
		assert.Contains(t, inv.Notes[0], "ERROR_LIBRARY_NOT_FOUND")
	})
	t.Run("proc when NVML fails", func(t *testing.T) {
		srv := dgxh100.New()
		srv.InitFunc = func() nvml.Return { return nvml.ERROR_NO_PERMISSION }
		inv, err := devices.Discover(config.DevicesConfig{Source: config.SourceAuto, ProcRoot: fakeProcTree(t)}, New(srv))
		require.NoError(t, err)
		assert.Equal(t, "proc", inv.Source)
		assert.Contains(t, inv.Notes[0], "ERROR_NO_PERMISSION")
	})
	t.Run("static last", func(t *testing.T) {
		inv, err := devices.Discover(config.DevicesConfig{Source: config.SourceAuto, ProcRoot: t.TempDir(), Static: static}, New(libraryNotFound()))
		require.NoError(t, err)
		assert.Equal(t, "static", inv.Source)
		require.Len(t, inv.Notes, 2)
		assert.Contains(t, inv.Notes[0], "nvml: skipped")
		assert.Contains(t, inv.Notes[1], "proc: skipped")
	})
	t.Run("nothing works", func(t *testing.T) {
		_, err := devices.Discover(config.DevicesConfig{Source: config.SourceAuto, ProcRoot: t.TempDir()}, New(libraryNotFound()))
		require.ErrorIs(t, err, devices.ErrSourceUnavailable)
		for _, s := range []string{"nvml: skipped", "proc: skipped", "static: skipped"} {
			assert.Contains(t, err.Error(), s)
		}
	})
	t.Run("a host without GPUs", func(t *testing.T) {
		srv := server.NewServerWithGPUs("550.54.15", "12.550.54.15", 12040)
		inv, err := devices.Discover(config.DevicesConfig{Source: config.SourceAuto, ProcRoot: t.TempDir()}, New(srv))
		require.NoError(t, err)
		assert.Equal(t, "nvml", inv.Source, "the first working source answers, empty")
		assert.Empty(t, inv.GPUs)
		assert.Contains(t, strings.Join(inv.Notes, "\n"), "nvml: skipped: found no GPU")
	})
	t.Run("explicit NVML absent", func(t *testing.T) {
		_, err := devices.Discover(config.DevicesConfig{Source: config.SourceNVML, ProcRoot: fakeProcTree(t)}, New(libraryNotFound()))
		require.ErrorIs(t, err, devices.ErrSourceUnavailable)
		assert.Contains(t, err.Error(), "from nvml")
	})
	t.Run("MIG caps from proc", func(t *testing.T) {
		h := newMockHost(t)
		root := t.TempDir()
		// GPU 1 of the mock has minor 6, GPU instances 0 and 1.
		writeFile(t, filepath.Join(root, "proc/driver/nvidia-caps/mig-minors"),
			"config 1\nmonitor 2\ngpu6/gi0/access 57\ngpu6/gi0/ci0/access 58\ngpu6/gi1/access 66\ngpu6/gi1/ci0/access 67\ngpu6/gi1/ci1/access 68\ngpu7/gi0/access 120\n")
		writeFile(t, filepath.Join(root, "proc/devices"), "Character devices:\n195 nvidia\n507 nvidia-caps\n")
		inv, err := devices.Discover(config.DevicesConfig{Source: config.SourceNVML, ProcRoot: root}, New(h.srv))
		require.NoError(t, err)
		assert.Equal(t, int64(507), inv.CapsMajor)
		assert.Len(t, inv.MIGCaps, 7)
		res, err := devices.NewResolver(inv, defaultPolicy()).Resolve(devices.Request{Devices: []devices.LinuxDevice{
			dev("/dev/nvidia6", 195, 6), dev("/dev/nvidia-caps/nvidia-cap66", 507, 66), dev("/dev/nvidia-caps/nvidia-cap68", 507, 68)}})
		require.NoError(t, err)
		assert.Equal(t, []string{migUUID(migGPU, 3)}, res.UUIDs(), "gi1/ci1 is MIG 1:3")
	})
}

// TestResolveDoesNoNVMLCalls loads the inventory through the NVML mock once
// and then resolves many requests: the mock must record no further call.
func TestResolveDoesNoNVMLCalls(t *testing.T) {
	h := newMockHost(t)
	inv, err := devices.Discover(config.DevicesConfig{Source: config.SourceNVML, ProcRoot: t.TempDir()}, New(h.srv))
	require.NoError(t, err)
	loaded := h.calls()
	require.Positive(t, loaded)

	r := devices.NewResolver(inv, defaultPolicy())
	reqs := []devices.Request{
		{Env: env("NVIDIA_VISIBLE_DEVICES=0,1:0," + inv.GPUs[3].UUID)},
		{Env: env("NVIDIA_VISIBLE_DEVICES=all")},
		{Annotations: map[string]string{"cdi.k8s.io/x": "nvidia.com/gpu=gpu2,nvidia.com/mig=mig1:3"}},
		{Devices: []devices.LinuxDevice{dev("/dev/nvidia6", 195, 6), dev("/dev/nvidia0", 195, 0)}},
		{Mounts: []string{mr + migUUID(migGPU, 1)}},
		{Env: env("NVIDIA_VISIBLE_DEVICES=" + "GPU-ffffffff")},
	}
	for i := 0; i < 1000; i++ {
		_, _ = r.Resolve(reqs[i%len(reqs)])
	}
	assert.Equal(t, loaded, h.calls(), "resolution made NVML calls")
}

// The helpers below mirror those of package devices' tests: the same fake
// hosts, so that the NVML loader is checked against the same expectations.

var gpuPrefix = [...]string{"c", "a", "d", "9", "e", "f", "1", "2", "3", "4", "5", "6", "7", "8", "b", "0"}

func gpuUUID(i int) string {
	return fmt.Sprintf("GPU-%s%07x-0000-4000-8000-%012x", gpuPrefix[i%len(gpuPrefix)], i, i)
}

func migUUID(gpu, mig int) string {
	return fmt.Sprintf("MIG-%x%07x-1111-4000-8000-%012x", mig+1, gpu, gpu*16+mig)
}

func defaultPolicy() config.PolicyConfig { return config.Default().Policy }

const mr = devices.MountRoot + "/"

func env(kv ...string) []string { return kv }

func dev(path string, major, minor int64) devices.LinuxDevice {
	return devices.LinuxDevice{Path: path, Type: "c", Major: major, Minor: minor}
}

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, []byte(content), 0o644))
}

// fakeProcTree is a /proc/driver/nvidia with four GPUs and one excluded.
func fakeProcTree(t testing.TB) string {
	t.Helper()
	root := t.TempDir()
	fakeProcGPU(t, root, "0000:86:00.0", "NVIDIA H100 80GB HBM3", gpuUUID(2), 0, false)
	fakeProcGPU(t, root, "0000:07:00.0", "NVIDIA H100 80GB HBM3", gpuUUID(0), 2, false)
	fakeProcGPU(t, root, "0000:3b:00.0", "NVIDIA H100 80GB HBM3", gpuUUID(1), 1, false)
	fakeProcGPU(t, root, "0000:50:00.0", "NVIDIA H100 80GB HBM3", gpuUUID(7), 3, true)
	fakeProcGPU(t, root, "0001:01:00.0", "NVIDIA H100 80GB HBM3", gpuUUID(3), 4, false)
	return root
}

func fakeProcGPU(t testing.TB, root, bus, model, uuid string, minor int, excluded bool) {
	t.Helper()
	ex := "No"
	if excluded {
		ex = "Yes"
	}
	writeFile(t, filepath.Join(root, "proc/driver/nvidia/gpus", bus, "information"), fmt.Sprintf(
		"Model: \t\t %s\nIRQ:   \t\t 35\nGPU UUID: \t %s\nVideo BIOS: \t 96.00.74.00.01\nBus Type: \t PCIe\n"+
			"DMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t %s\nDevice Minor: \t %d\nGPU Excluded:\t %s\n",
		model, uuid, bus, minor, ex))
}
