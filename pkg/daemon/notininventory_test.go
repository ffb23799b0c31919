// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package daemon

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/metrics"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// migGPU is the GPU of gpuHost that migHost puts in MIG mode.
const migGPU = 1

const (
	knownMIG = "MIG-00000001-0000-4000-8000-000000000000" // at MIG index 0, in the inventory
	newMIG   = "MIG-00000001-0000-4000-8000-000000000002" // at MIG index 2, created since discovery
)

// migHost is gpuHost with GPU 1 in MIG mode: NVML reports an instance the
// inventory has (knownMIG) and one created after discovery (newMIG), each
// listing the processes runOn puts on it.
func migHost(t *testing.T) *gpuHost {
	h := newGPUHost(t)
	sd := h.srv.Devices[migGPU].(*server.Device)
	instance := func(uuid string) *mock.Device {
		return &mock.Device{
			GetUUIDFunc:           func() (string, nvml.Return) { return uuid, nvml.SUCCESS },
			IsMigDeviceHandleFunc: func() (bool, nvml.Return) { return true, nvml.SUCCESS },
			GetComputeRunningProcessesFunc: func() ([]nvml.ProcessInfo, nvml.Return) {
				h.mu.Lock()
				defer h.mu.Unlock()
				return append([]nvml.ProcessInfo(nil), h.procs[uuid]...), nvml.SUCCESS
			},
			GetGraphicsRunningProcessesFunc: func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.ERROR_NOT_SUPPORTED },
		}
	}
	handles := map[int]nvml.Device{0: instance(knownMIG), 2: instance(newMIG)}
	sd.GetMaxMigDeviceCountFunc = func() (int, nvml.Return) { return 7, nvml.SUCCESS }
	sd.GetMigDeviceHandleByIndexFunc = func(n int) (nvml.Device, nvml.Return) {
		if m, ok := handles[n]; ok {
			return m, nvml.SUCCESS
		}
		return nil, nvml.ERROR_NOT_FOUND
	}
	fail := func() ([]nvml.ProcessInfo, nvml.Return) {
		t.Errorf("processes listed on MIG-mode GPU %d instead of its instances", migGPU)
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	sd.GetComputeRunningProcessesFunc = fail
	return h
}

// runOn starts pid of container id ("" for a host process) on device uuid.
func (h *gpuHost) runOn(uuid string, pid int, id string) {
	dir := filepath.Join(h.proc, "proc", fmt.Sprint(pid))
	require.NoError(h.t, os.MkdirAll(dir, 0o755))
	stat := fmt.Sprintf("%d (python) S 1 %d %d 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 500 0 0\n", pid, pid, pid)
	require.NoError(h.t, os.WriteFile(filepath.Join(dir, "stat"), []byte(stat), 0o644))
	cg := "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-" + id + ".scope\n"
	if id == "" {
		cg = "0::/user.slice/user-0.slice/session-1.scope\n"
	}
	require.NoError(h.t, os.WriteFile(filepath.Join(dir, "cgroup"), []byte(cg), 0o644))
	h.mu.Lock()
	defer h.mu.Unlock()
	h.procs[uuid] = append(h.procs[uuid], nvml.ProcessInfo{Pid: uint32(pid), UsedGpuMemory: 1 << 30})
}

// An intruder on a MIG instance the daemon's inventory lacks (created
// since discovery) clears when its process leaves, as on any device: the
// instance's processes are listed at every pass. It used to stand for as
// long as the instance existed: the observer said "not in the inventory"
// in the device's listing error, so the daemon counted the instance as
// one NVML could not list at every pass and kept its findings as the last
// listing saw them (never finding-cleared, still in observe.json and the
// gauge). observe.json carries the instance in not_in_inventory, with its
// notice, and not among the devices that could not be listed.
func TestFindingOnAnInstanceNotInTheInventoryClears(t *testing.T) {
	h := migHost(t)
	g := guardFor(t, h, func(c *config.Config) {
		c.Devices.Static[migGPU].MIG = []config.StaticMIG{{Index: 0, UUID: knownMIG, GI: 1, CI: 0}}
	})
	_, err := g.Reconcile(context.Background(), ledger.FrontEndNRI, nil)
	require.NoError(t, err)
	logs := &syncBuffer{}
	m := metrics.New()
	w := watchOver(g, logs)
	w.Metrics = m
	w.States = func(*guard.Guard) DeviceStates { return newFakeStates() }
	src, err := observe.OpenNVML(h.srv)
	require.NoError(t, err)
	t.Cleanup(func() { _ = src.Close() })
	ctx := context.Background()
	o, err := observe.New(observe.Options{Source: src, GPUs: g.Inventory().GPUs, ProcRoot: h.proc,
		Ledger: observe.EpochLedgerFunc(func() ([]observe.Holding, uint64, error) { return w.holdingsAt(ctx) })})
	require.NoError(t, err)
	h.runOn(newMIG, 900, "") // a host process on the new instance: an intruder

	accountAndHandle(t, w, o, g)
	file, err := observe.ReadFile(g.Ledger().Dir())
	require.NoError(t, err)
	require.Len(t, file.Findings, 1, "%+v", file.Findings)
	assert.Equal(t, observe.KindIntruder, file.Findings[0].Kind)
	assert.Equal(t, 900, file.Findings[0].PID)
	assert.Equal(t, newMIG, file.Findings[0].Device.UUID)
	assert.Empty(t, file.Unlisted, "its processes were listed")
	assert.Empty(t, file.Errors, "its processes were listed")
	if assert.Len(t, file.NotInInventory, 1, "%+v", file.NotInInventory) {
		assert.Equal(t, newMIG, file.NotInInventory[0].Device.UUID)
		assert.Equal(t, "1:2", file.NotInInventory[0].Device.Index)
		assert.Equal(t, h.uuid(migGPU), file.NotInInventory[0].Device.ParentUUID)
		assert.Contains(t, file.NotInInventory[0].Notice, "is not in it")
		assert.Contains(t, file.NotInInventory[0].Notice, "restart nri-gpu-guard")
	}
	assert.Equal(t, map[string]float64{"1:2": 1}, gaugeByIndex(t, m, "nri_gpu_guard_intruders"))

	h.stop(900)
	accountAndHandle(t, w, o, g)
	file, err = observe.ReadFile(g.Ledger().Dir())
	require.NoError(t, err)
	assert.Empty(t, file.Findings, "the process left: its finding clears")
	assert.Empty(t, gaugeByIndex(t, m, "nri_gpu_guard_intruders"))
	assert.Contains(t, logs.String(), "GPU finding cleared")
	recs, err := ledger.ReadAudit(g.Ledger().AuditPath())
	require.NoError(t, err)
	var ops []string
	for _, r := range recs {
		if r.Op == OpIntruder || r.Op == OpFindingCleared {
			ops = append(ops, r.Op)
		}
	}
	assert.Equal(t, []string{OpIntruder, OpFindingCleared}, ops)
	if assert.Len(t, file.NotInInventory, 1, "still reported while NVML reports it") {
		assert.Equal(t, newMIG, file.NotInInventory[0].Device.UUID)
	}
}

// A device the inventory lacks whose processes NVML could not list is both:
// in not_in_inventory, and among the devices that could not be listed,
// whose findings stand (nothing is concluded about it).
func TestInstanceNotInTheInventoryThatCannotBeListedKeepsFindings(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	w := watchOver(g, nil)
	mig := observe.Device{UUID: newMIG, Index: "1:2", ParentUUID: h.uuid(migGPU)}
	f := observe.Finding{Kind: observe.KindIntruder, Device: mig, PID: 900, Message: "pid 900 runs on MIG 1:2"}
	const notice = "the MIG layout of GPU 1 changed since the inventory was discovered: instance " + newMIG + " is not in it"
	pass := func(r observe.Report) { w.onReport(context.Background(), g.Config(), r) }
	pass(observe.Report{Devices: []observe.DeviceReport{{Device: mig, NotInInventory: notice}}, Findings: []observe.Finding{f}})
	pass(observe.Report{Devices: []observe.DeviceReport{{Device: mig, NotInInventory: notice, Error: "list compute processes: ERROR_UNKNOWN"}}})
	file, err := observe.ReadFile(g.Ledger().Dir())
	require.NoError(t, err)
	require.Len(t, file.Findings, 1, "not seeing the process is no sign that it left")
	assert.Equal(t, 900, file.Findings[0].PID)
	assert.Equal(t, []observe.UnlistedDevice{{Device: mig, Error: "list compute processes: ERROR_UNKNOWN"}}, file.Unlisted)
	assert.Equal(t, []observe.NotInInventoryDevice{{Device: mig, Notice: notice}}, file.NotInInventory)
}
