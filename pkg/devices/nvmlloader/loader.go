// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package nvmlloader

import (
	"fmt"

	"github.com/NVIDIA/go-nvlib/pkg/nvlib/device"
	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// Interface is the NVML API the inventory enumerates through: go-nvml's
// nvml.Interface in cgo builds (the real library or a go-nvml mock). Builds
// without cgo have no NVML; there it is an empty interface and only nil is
// meaningful.
type Interface = nvml.Interface

type nvmlLoader struct {
	lib nvml.Interface
}

// New returns the loader that enumerates GPUs and MIG instances
// through NVML (go-nvlib's device visitors). lib nil means the host's
// libnvidia-ml.so.1 (nvml.New()). Load initialises NVML and shuts it down
// again: the inventory is loaded once and cached, never per container.
func New(lib Interface) devices.Loader {
	return &nvmlLoader{lib: lib}
}

func (l *nvmlLoader) Name() string { return string(config.SourceNVML) }

func (l *nvmlLoader) Load() (gpus []devices.GPU, err error) {
	lib := l.lib
	if lib == nil {
		lib = nvml.New()
	}
	switch ret := lib.Init(); ret {
	case nvml.SUCCESS:
	case nvml.ERROR_LIBRARY_NOT_FOUND, nvml.ERROR_DRIVER_NOT_LOADED:
		return nil, fmt.Errorf("%w: nvml: %w", devices.ErrSourceUnavailable, ret)
	default:
		return nil, fmt.Errorf("nvml: initialise: %w", ret)
	}
	// A failed shutdown only leaves NVML's reference count raised in this
	// process; the enumeration is complete, so it is not an error.
	defer func() { _ = lib.Shutdown() }()

	err = device.New(lib).VisitDevices(func(i int, d device.Device) error {
		g, err := nvmlGPU(i, d)
		if err != nil {
			return err
		}
		gpus = append(gpus, g)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("nvml: enumerate GPUs: %w", err)
	}
	return gpus, nil
}

// nvmlGPU describes the GPU NVML enumerates at index i. UUID, minor number
// and MIG layout are required (they are what the guard matches on); model,
// memory and bus id are descriptive and left empty when NVML cannot say.
func nvmlGPU(i int, d device.Device) (devices.GPU, error) {
	uuid, ret := d.GetUUID()
	if ret != nvml.SUCCESS {
		return devices.GPU{}, fmt.Errorf("GPU %d: get UUID: %w", i, ret)
	}
	g := devices.GPU{Index: i, UUID: uuid}
	minor, ret := d.GetMinorNumber()
	if ret != nvml.SUCCESS {
		return devices.GPU{}, fmt.Errorf("GPU %d (%s): get minor number: %w", i, uuid, ret)
	}
	g.Minor = minor
	if name, ret := d.GetName(); ret == nvml.SUCCESS {
		g.Model = name
	}
	if mem, ret := d.GetMemoryInfo(); ret == nvml.SUCCESS {
		g.MemoryMiB = mem.Total >> 20
	}
	if bus, err := d.GetPCIBusID(); err == nil {
		if norm, ok := devices.NormaliseBusID(bus); ok {
			g.BusID = norm
		}
	}
	enabled, err := d.IsMigEnabled()
	if err != nil {
		return devices.GPU{}, fmt.Errorf("GPU %d (%s): MIG mode: %w", i, uuid, err)
	}
	if !enabled {
		return g, nil
	}
	err = d.VisitMigDevices(func(j int, m device.MigDevice) error {
		mig, err := nvmlMIG(g, j, m)
		if err != nil {
			return err
		}
		g.MIG = append(g.MIG, mig)
		return nil
	})
	if err != nil {
		return devices.GPU{}, fmt.Errorf("GPU %d (%s): enumerate MIG instances: %w", i, uuid, err)
	}
	return g, nil
}

func nvmlMIG(parent devices.GPU, j int, m device.MigDevice) (devices.MIG, error) {
	uuid, ret := m.GetUUID()
	if ret != nvml.SUCCESS {
		return devices.MIG{}, fmt.Errorf("MIG %d:%d: get UUID: %w", parent.Index, j, ret)
	}
	gi, ret := m.GetGpuInstanceId()
	if ret != nvml.SUCCESS {
		return devices.MIG{}, fmt.Errorf("MIG %d:%d (%s): get GPU instance id: %w", parent.Index, j, uuid, ret)
	}
	ci, ret := m.GetComputeInstanceId()
	if ret != nvml.SUCCESS {
		return devices.MIG{}, fmt.Errorf("MIG %d:%d (%s): get compute instance id: %w", parent.Index, j, uuid, ret)
	}
	mig := devices.MIG{Index: j, UUID: uuid, GI: gi, CI: ci, ParentUUID: parent.UUID, ParentIndex: parent.Index}
	if name, ret := m.GetName(); ret == nvml.SUCCESS {
		mig.Model = name
	}
	if mem, ret := m.GetMemoryInfo(); ret == nvml.SUCCESS {
		mig.MemoryMiB = mem.Total >> 20
	}
	return mig, nil
}
