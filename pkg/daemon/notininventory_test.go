// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package daemon

import (
	"context"
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
	assert.Equal(t, h.uuid(migGPU), file.Findings[0].Device.UUID, "the finding is the instance's GPU's")
	if assert.NotNil(t, file.Findings[0].Instance) {
		assert.Equal(t, newMIG, file.Findings[0].Instance.UUID)
	}
	assert.Empty(t, file.Unlisted, "its processes were listed")
	assert.Empty(t, file.Errors, "its processes were listed")
	if assert.Len(t, file.NotInInventory, 1, "%+v", file.NotInInventory) {
		assert.Equal(t, newMIG, file.NotInInventory[0].Device.UUID)
		assert.Equal(t, "1:2", file.NotInInventory[0].Device.Index)
		assert.Equal(t, h.uuid(migGPU), file.NotInInventory[0].Device.ParentUUID)
		assert.Contains(t, file.NotInInventory[0].Notice, "is not in it")
		assert.Contains(t, file.NotInInventory[0].Notice, "restart nri-gpu-guard")
	}
	assert.Equal(t, map[string]float64{"1": 1}, gaugeByIndex(t, m, "nri_gpu_guard_intruders"))

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
// whose findings stand (nothing is concluded about it): those of its
// processes, which are its GPU's (observe.Finding.Instance).
func TestInstanceNotInTheInventoryThatCannotBeListedKeepsFindings(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	w := watchOver(g, nil)
	mig := observe.Device{UUID: newMIG, Index: "1:2", ParentUUID: h.uuid(migGPU)}
	f := observe.Finding{Kind: observe.KindIntruder, Device: observe.Device{UUID: h.uuid(migGPU), Index: "1"}, Instance: &mig,
		PID: 900, Message: "pid 900 runs on MIG 1:2"}
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

// A process on a MIG instance the daemon's inventory lacks (created since
// discovery) that nothing on its GPU accounts for cordons the GPU under
// on_intruder = "cordon": the GPU's claims are the ones that would cover
// the instance, and a whole-GPU claim is what another container could
// still take while the process runs. The finding used to name the
// instance, which the guard's inventory does not know: its cordon failed
// at every pass ("cordoning the device failed"), and the GPU stayed open
// to new claims. The finding names the GPU (index and UUID) and the
// instance, and says to restart nri-gpu-guard; the daemon's cordon
// bookkeeping (lineage, carry file) speaks of the GPU, so the next pass
// sees the cordon in force (neither cordoned again nor taken for the
// operator's uncordon), and the finding clears when the process ends,
// the cordon left for the operator to lift as for any intruder's.
// An out-of-bounds process (a container holding another GPU) is the same.
func TestIntruderOnAnInstanceNotInTheInventoryCordonsItsGPU(t *testing.T) {
	for _, tc := range []struct {
		name string
		kind observe.Kind
		op   string
		id   string // the process's container ("": a host process)
	}{
		{name: "host process", kind: observe.KindIntruder, op: OpIntruder},
		{name: "holder of another GPU", kind: observe.KindOutOfBounds, op: OpOutOfBounds, id: idA},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := migHost(t)
			g := guardFor(t, h, func(c *config.Config) {
				c.Devices.Static[migGPU].MIG = []config.StaticMIG{{Index: 0, UUID: knownMIG, GI: 1, CI: 0}}
				c.Observe.OnIntruder = config.IntruderCordon
			})
			ctx := context.Background()
			_, err := g.Reconcile(ctx, ledger.FrontEndNRI, nil)
			require.NoError(t, err)
			if tc.id != "" {
				require.Equal(t, guard.Admit, admit(t, g, tc.id, "ml", "a", "main", "0").Result)
			}
			logs := &syncBuffer{}
			m := metrics.New()
			w := watchOver(g, logs) // the guard's own device states: its inventory decides what a cordon can name
			w.Metrics = m
			src, err := observe.OpenNVML(h.srv)
			require.NoError(t, err)
			t.Cleanup(func() { _ = src.Close() })
			o, err := observe.New(observe.Options{Source: src, GPUs: g.Inventory().GPUs, ProcRoot: h.proc,
				Ledger: observe.EpochLedgerFunc(func() ([]observe.Holding, uint64, error) { return w.holdingsAt(ctx) })})
			require.NoError(t, err)
			gpu := h.uuid(migGPU)
			// pass is one accounting pass, as the observer's OnReport.
			pass := func() {
				t.Helper()
				accountAndHandle(t, w, o, g)
				w.settleUnhealthy(ctx, o)
			}
			h.runOn(newMIG, 900, tc.id)

			pass()
			k := cordonOn(t, g, gpu)
			assert.Equal(t, ledger.CordonIntruder, k.Source, "the instance's GPU is cordoned")
			assert.Contains(t, k.Reason, newMIG, "the cordon says which instance the process runs on")
			assert.NotContains(t, logs.String(), "cordoning the device failed")
			file, err := observe.ReadFile(g.Ledger().Dir())
			require.NoError(t, err)
			require.Len(t, file.Findings, 1, "%+v", file.Findings)
			f := file.Findings[0]
			assert.Equal(t, tc.kind, f.Kind)
			assert.Equal(t, 900, f.PID)
			assert.Equal(t, gpu, f.Device.UUID, "the finding is on the GPU whose claims cover the instance")
			assert.Equal(t, "1", f.Device.Index)
			assert.Contains(t, f.Message, "MIG 1:2 ("+newMIG+") of GPU 1 ("+gpu+")")
			assert.Contains(t, f.Message, "restart nri-gpu-guard")
			if assert.Len(t, file.NotInInventory, 1) {
				assert.Equal(t, newMIG, file.NotInInventory[0].Device.UUID, "the instance is still reported as not in the inventory")
			}
			assert.Equal(t, map[string]float64{"1": 1}, gaugeByIndex(t, m, "nri_gpu_guard_intruders"))
			recs := logRecords(t, logs, "GPU process not admitted by the guard")
			if assert.Len(t, recs, 1) {
				assert.Equal(t, gpu, recs[0]["device_uuid"])
				assert.Equal(t, "1", recs[0]["device_index"])
				assert.Equal(t, newMIG, recs[0]["instance_uuid"], "the log names the instance")
				assert.Equal(t, "1:2", recs[0]["instance_index"])
			}
			c, err := observe.ReadCarry(g.Ledger().Dir())
			require.NoError(t, err)
			assert.Contains(t, c.CordonLineages, gpu, "the carry file watches the GPU's cordon")
			assert.Empty(t, c.CordonRetries)

			pass()
			assert.Equal(t, 1, auditCount(t, g, ledger.OpCordon), "the cordon in force is not written again")
			assert.Equal(t, 1, auditCount(t, g, tc.op), "the process is reported once")
			assert.NotContains(t, logs.String(), "intruder cordon lifted by the operator", "the cordon in force is not taken for lifted")
			assert.NotContains(t, logs.String(), "cordoning the device failed")
			w.mu.Lock()
			assert.Equal(t, map[cordonKey]string{{ledger.CordonIntruder, gpu}: lineageOf(t, g)}, w.cordonLineage)
			assert.Empty(t, w.intruderRetry)
			w.mu.Unlock()

			h.stop(900)
			pass()
			file, err = observe.ReadFile(g.Ledger().Dir())
			require.NoError(t, err)
			assert.Empty(t, file.Findings, "the process left: its finding clears")
			assert.Empty(t, gaugeByIndex(t, m, "nri_gpu_guard_intruders"))
			assert.Equal(t, 1, auditCount(t, g, OpFindingCleared))
			assert.True(t, cordonedIn(t, g, gpu), "the cordon stays until the operator lifts it")
			w.mu.Lock()
			assert.Empty(t, w.cordonLineage, "nothing is watched once the process left")
			w.mu.Unlock()
			assert.Equal(t, 1, auditCount(t, g, ledger.OpCordon))
		})
	}
}

// lineageOf is the lineage of g's ledger state now.
func lineageOf(t *testing.T, g *guard.Guard) string {
	t.Helper()
	st, err := g.Ledger().Snapshot(context.Background())
	require.NoError(t, err)
	return st.Lineage
}
