// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// testBoot is the boot id the tests load and save the cache in; a cache of
// another boot is checked against the driver's /proc tree.
const testBoot = "5c3a1e0f-boot-test"

// Test UUIDs: the first hex digit is chosen so that UUID order differs from
// index order (GPU 3 sorts first, GPU 2 last), which proves that Resolve
// sorts by UUID and never by index.
var gpuPrefix = [...]string{"c", "a", "d", "9", "e", "f", "1", "2", "3", "4", "5", "6", "7", "8", "b", "0"}

func gpuUUID(i int) string {
	return fmt.Sprintf("GPU-%s%07x-0000-4000-8000-%012x", gpuPrefix[i%len(gpuPrefix)], i, i)
}

func migUUID(gpu, mig int) string {
	return fmt.Sprintf("MIG-%x%07x-1111-4000-8000-%012x", mig+1, gpu, gpu*16+mig)
}

// testGPUs is a 4-GPU host where index and minor differ (GPU 1 is
// /dev/nvidia3, GPU 3 is /dev/nvidia1) and GPU 1 is MIG-enabled with two
// GPU instances: 1:0 (gi 1, ci 0), 1:1 (gi 2, ci 0) and 1:2 (gi 2, ci 1).
func testGPUs() []GPU {
	minors := []int{0, 3, 2, 1}
	gpus := make([]GPU, 4)
	for i := range gpus {
		gpus[i] = GPU{
			Index: i, UUID: gpuUUID(i), Minor: minors[i],
			Model: "NVIDIA H100 80GB HBM3", MemoryMiB: 81559,
			BusID: fmt.Sprintf("0000:%02x:00.0", 0x1b+i*0x20),
		}
	}
	gpus[1].MIG = []MIG{
		{Index: 0, UUID: migUUID(1, 0), GI: 1, CI: 0},
		{Index: 1, UUID: migUUID(1, 1), GI: 2, CI: 0},
		{Index: 2, UUID: migUUID(1, 2), GI: 2, CI: 1},
	}
	return gpus
}

// testCaps is GPU 1's /dev/nvidia-caps mapping (its minor is 3).
func testCaps() []MIGCap {
	return []MIGCap{
		{Minor: 1, Kind: CapConfig},
		{Minor: 2, Kind: CapMonitor},
		{Minor: 30, Kind: CapGIAccess, GPUMinor: 3, GI: 1},
		{Minor: 31, Kind: CapCIAccess, GPUMinor: 3, GI: 1, CI: 0},
		{Minor: 39, Kind: CapGIAccess, GPUMinor: 3, GI: 2},
		{Minor: 40, Kind: CapCIAccess, GPUMinor: 3, GI: 2, CI: 0},
		{Minor: 41, Kind: CapCIAccess, GPUMinor: 3, GI: 2, CI: 1},
	}
}

const testCapsMajor = 508

func testInventory(t testing.TB) *Inventory {
	t.Helper()
	inv, err := newInventory(Inventory{Source: "nvml", GPUs: testGPUs(), CapsMajor: testCapsMajor, MIGCaps: testCaps()})
	require.NoError(t, err)
	return inv
}

func defaultPolicy() config.PolicyConfig { return config.Default().Policy }

// uuidOf maps a human index ("1", "1:0") of the test inventory to its UUID.
func uuidOf(t testing.TB, inv *Inventory, index string) string {
	t.Helper()
	d, ok := inv.ByIndex(index)
	require.True(t, ok, "test inventory has no device %q", index)
	return d.UUID
}

// writeFile creates path (and its directories) with content.
func writeFile(t testing.TB, path, content string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, []byte(content), 0o644))
}

// fakeProcGPU writes one /proc/driver/nvidia/gpus/<bus>/information file in
// the driver's format.
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
