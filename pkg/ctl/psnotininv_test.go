// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package ctl

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// withMIG puts GPU gpu of h in MIG mode: NVML reports an instance at MIG
// index 0, which the inventory (rewritten into the fixture's cache) has,
// and one at index 2, created since, which it lacks. Their UUIDs are
// returned; their processes come from h.procs like the GPUs'.
func (h *psHost) withMIG(t *testing.T, f *fixture, gpu int) (known, created string) {
	t.Helper()
	sd := h.srv.Devices[gpu].(*server.Device)
	known = fmt.Sprintf("MIG-%08x-0000-4000-8000-000000000000", gpu)
	created = fmt.Sprintf("MIG-%08x-0000-4000-8000-000000000002", gpu)
	instance := func(uuid string) nvml.Device {
		return &mock.Device{
			GetUUIDFunc:                     func() (string, nvml.Return) { return uuid, nvml.SUCCESS },
			IsMigDeviceHandleFunc:           func() (bool, nvml.Return) { return true, nvml.SUCCESS },
			GetComputeRunningProcessesFunc:  func() ([]nvml.ProcessInfo, nvml.Return) { return h.procs[uuid], nvml.SUCCESS },
			GetGraphicsRunningProcessesFunc: func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.ERROR_NOT_SUPPORTED },
		}
	}
	handles := map[int]nvml.Device{0: instance(known), 2: instance(created)}
	sd.GetMaxMigDeviceCountFunc = func() (int, nvml.Return) { return 7, nvml.SUCCESS }
	sd.GetMigDeviceHandleByIndexFunc = func(n int) (nvml.Device, nvml.Return) {
		if m, ok := handles[n]; ok {
			return m, nvml.SUCCESS
		}
		return nil, nvml.ERROR_NOT_FOUND
	}
	gpus := append([]devices.GPU(nil), f.inv.GPUs...)
	gpus[gpu].MIG = []devices.MIG{{Index: 0, UUID: known, GI: 1, CI: 0, ParentUUID: sd.UUID, ParentIndex: gpu}}
	inv, err := devices.NewInventory("nvml", gpus)
	require.NoError(t, err)
	f.inv = inv
	require.NoError(t, devices.SaveCache(filepath.Join(f.dir, devices.CacheFile), inv, bootID))
	return known, created
}

// runOn puts pid, with cgroup as its /proc/PID/cgroup, on device uuid.
func (h *psHost) runOn(t *testing.T, uuid string, pid int, cgroup string) {
	dir := filepath.Join(h.proc, fmt.Sprint(pid))
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "stat"),
		fmt.Appendf(nil, "%d (python) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 500 0 0\n", pid), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "cgroup"), []byte(cgroup), 0o644))
	h.procs[uuid] = append(h.procs[uuid], nvml.ProcessInfo{Pid: uint32(pid), UsedGpuMemory: 3 << 30})
}

// TestPSListsTheProcessesOfAnInstanceNotInTheInventory: ps lists and
// judges the processes of a MIG instance the inventory lacks (created
// since discovery) like any device's, marking its rows as on a device
// outside the inventory, and says under the table that the inventory lacks
// it and what to do (not-in-inventory, exit 3). Before, the instance was a
// row "error: the MIG layout … changed" with none of its processes, and a
// problem saying NVML could not list them, which it had. The intruder
// problem is the GPU's (observe.Finding.Instance), its verdict on the
// process's row under the instance.
func TestPSListsTheProcessesOfAnInstanceNotInTheInventory(t *testing.T) {
	f := newFixture(t)
	h := newPSHost(t, f)
	gpu1 := h.srv.Devices[1].(*server.Device).UUID
	known, created := h.withMIG(t, f, 1)
	f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
		claim(t, tx, ownTrainer, "env", f.dev(t, gpu1)) // covers the new instance too
	})
	h.runOn(t, known, 100, "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-"+idTrainer+".scope\n")
	h.runOn(t, created, 200, "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-"+idTrainer+".scope\n")
	h.runOn(t, created, 300, "0::/user.slice/user-0.slice/session-1.scope\n")

	r := f.runPS(t, h)
	require.Equal(t, ExitAttention, r.code, r.stdout+r.stderr)
	assert.Regexp(t, `(?m)^1:0 +MIG-\S+ +100 +C +3072MiB +team-a/trainer-0/main +team-a/trainer-0/main +ok$`, r.stdout)
	assert.Regexp(t, `(?m)^1:2 \(not in inventory\) +MIG-\S+ +200 +C +3072MiB +team-a/trainer-0/main +team-a/trainer-0/main +ok$`, r.stdout)
	assert.Regexp(t, `(?m)^1:2 \(not in inventory\) +MIG-\S+ +300 +C +3072MiB +host process +team-a/trainer-0/main +intruder$`, r.stdout)
	assert.NotContains(t, r.stdout, "error:", "its processes were listed")
	assert.NotContains(t, r.stdout, "could not list")
	assert.Contains(t, r.stdout, "ATTENTION (2)", "the intruder, and the instance the inventory lacks")
	assert.Contains(t, r.stdout, "  - MIG 1:2 ("+created+"): not in the inventory: the MIG layout of GPU 1 ("+gpu1+
		") changed since the inventory was discovered: instance "+created+" is not in it;")
	assert.Contains(t, r.stdout, "restart nri-gpu-guard")

	r = f.runPS(t, h, "-o", "wide")
	require.Equal(t, ExitAttention, r.code, r.stdout+r.stderr)
	assert.Regexp(t, `(?m)^1:2 \(not in inventory\) +`+created+` +300 +C +3072MiB +host process +- +team-a/trainer-0/main +`+idTrainer+` +intruder$`, r.stdout)

	r = f.runPS(t, h, "-o", "json")
	require.Equal(t, ExitAttention, r.code)
	var v psView
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	var dev *psDevice
	for i := range v.Devices {
		if v.Devices[i].UUID == created {
			dev = &v.Devices[i]
		} else {
			assert.Empty(t, v.Devices[i].NotInInventory, "%s is in the inventory", v.Devices[i].Index)
		}
	}
	require.NotNil(t, dev, r.stdout)
	assert.Equal(t, "1:2", dev.Index)
	assert.Equal(t, gpu1, dev.Parent)
	assert.Empty(t, dev.Error)
	assert.Contains(t, dev.NotInInventory, "is not in it")
	require.Len(t, dev.Processes, 2)
	assert.Equal(t, verdictOK, dev.Processes[0].Verdict)
	assert.Equal(t, 300, dev.Processes[1].PID)
	assert.Equal(t, verdictIntruder, dev.Processes[1].Verdict)
	kinds := []string{}
	for _, p := range v.Problems {
		kinds = append(kinds, p.Kind)
		if p.Kind == problemIntruder {
			// The finding is the instance's GPU's, the instance named.
			assert.Equal(t, gpu1, p.Device)
			assert.Equal(t, "1", p.Index)
			assert.Equal(t, 300, p.Pid)
			assert.Contains(t, p.Message, "MIG 1:2 ("+created+") of GPU 1 ("+gpu1+"), an instance the inventory lacks")
			assert.Contains(t, p.Message, "the finding is its GPU's, GPU 1 ("+gpu1+")")
		}
		if p.Kind == problemNotInInventory {
			assert.Equal(t, created, p.Device)
			assert.Equal(t, "1:2", p.Index)
			assert.True(t, strings.HasPrefix(p.Message, "MIG 1:2 ("+created+"): not in the inventory: "), p.Message)
		}
	}
	assert.ElementsMatch(t, []string{problemIntruder, problemNotInInventory}, kinds)
}
