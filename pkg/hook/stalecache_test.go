// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// A hook-only host whose operator once ran `gpu-guard-ctl devices --refresh`
// over two GPUs gets a third while it is down. After the reboot the cache
// still lists two: a container asking for "all" must claim the third too (it
// gets it from NVIDIA's runtime), not reach it unclaimed.
func TestAllClaimsGPUAddedSinceTheCache(t *testing.T) {
	cfg := staticConfig(t)
	cfg.Devices.Source = config.SourceAuto
	cfg.Devices.ProcRoot = t.TempDir()
	buses := []string{"0000:1b:00.0", "0000:3b:00.0", "0000:5b:00.0"}
	for i, bus := range buses {
		info := fmt.Sprintf("Model: \t\t NVIDIA H100 80GB HBM3\nGPU UUID: \t %s\nBus Location: \t %s\nDevice Minor: \t %d\nGPU Excluded:\t No\n",
			gpuUUIDs[i], bus, i)
		dir := filepath.Join(cfg.Devices.ProcRoot, "proc/driver/nvidia/gpus", bus)
		require.NoError(t, os.MkdirAll(dir, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "information"), []byte(info), 0o644))
	}
	var cached []devices.GPU
	for i, bus := range buses[:2] {
		cached = append(cached, devices.GPU{Index: i, UUID: gpuUUIDs[i], Minor: i, BusID: bus})
	}
	inv, err := devices.NewInventory("nvml", cached)
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(cfg.Ledger.Dir, 0o700))
	require.NoError(t, devices.SaveCache(filepath.Join(cfg.Ledger.Dir, devices.CacheFile), inv, "an-earlier-boot"))

	opened := 0
	e := testEnv(&opened)
	ctx := context.Background()
	require.NoError(t, e.run(ctx, PhaseCreateRuntime, cfg, strings.NewReader(stateFor(t, "all", os.Getpid(), "NVIDIA_VISIBLE_DEVICES=all")), io.Discard))

	l, err := ledger.OpenReadOnly(cfg.Ledger.Dir, ledger.Options{})
	require.NoError(t, err)
	st, err := l.Snapshot(ctx)
	require.NoError(t, err)
	var claimed []string
	for _, c := range st.Claims {
		require.Equal(t, "all", c.Owner.ContainerID)
		claimed = append(claimed, c.Device.UUID)
	}
	require.ElementsMatch(t, gpuUUIDs[:3], claimed, "every GPU the driver lists, the one added since the cache included")
}
