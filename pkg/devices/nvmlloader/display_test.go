// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package nvmlloader

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// A DGX Station's display adapter ("DGX Display") is no GPU to NVIDIA's
// enumeration, which leaves it out of the NVML inventory; the driver's /proc
// tree lists it. The /proc loader leaves it out too, at the same indices, so
// that the cache the daemon wrote from NVML in an earlier boot is not stale
// to a hook that checks it against /proc after the reboot.
func TestDisplayAdapterLeavesTheCacheFresh(t *testing.T) {
	srv := dgxa100.New()
	display := srv.Devices[2].(*server.Device)
	display.GetNameFunc = func() (string, nvml.Return) { return "DGX Display", nvml.SUCCESS }
	gpus, err := New(srv).Load()
	require.NoError(t, err)
	inv, err := devices.NewInventory("nvml", gpus)
	require.NoError(t, err)

	root := t.TempDir()
	for i, d := range srv.Devices {
		sd := d.(*server.Device)
		model := "NVIDIA A100-SXM4-40GB"
		if i == 2 {
			model = "DGX Display"
		}
		bus := fmt.Sprintf("0000:%02x:00.0", 0x10*(i+1))
		p := filepath.Join(root, "proc/driver/nvidia/gpus", bus, "information")
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, fmt.Appendf(nil, "Model: \t\t %s\nGPU UUID: \t %s\nBus Location: \t %s\nDevice Minor: \t %d\nGPU Excluded:\t No\n",
			model, sd.UUID, bus, sd.Minor), 0o644))
	}
	proc, err := devices.NewProcLoader(root).Load()
	require.NoError(t, err)
	require.Len(t, proc, len(gpus))
	for i := range proc {
		assert.Equal(t, gpus[i].Index, proc[i].Index, "the same index for %s from both sources", proc[i].UUID)
		assert.Equal(t, gpus[i].UUID, proc[i].UUID)
	}

	state := t.TempDir()
	require.NoError(t, devices.SaveCache(filepath.Join(state, devices.CacheFile), inv, "boot-1"))
	l, err := devices.LoadInventory(config.DevicesConfig{Source: config.SourceAuto, ProcRoot: root},
		devices.LoadOptions{Role: devices.RoleHook, StateDir: state, BootID: "boot-2"})
	require.NoError(t, err)
	assert.Equal(t, devices.OriginCache, l.Origin, "skipped: %v", l.Skipped)
}
