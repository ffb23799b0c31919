// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package daemon

import (
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// unidentifiedGPU is an NVML device whose UUID and minor number cannot be
// read and whose PCI bus id, read, is none the inventory records (the
// daemon's static inventory of these tests records none): the observer
// cannot tell which GPU its events are of.
func unidentifiedGPU() *mock.Device {
	d := &mock.Device{}
	d.GetUUIDFunc = func() (string, nvml.Return) { return "", nvml.ERROR_GPU_IS_LOST }
	d.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) {
		var p nvml.PciInfo
		for i, c := range "0000:c1:00.0" {
			p.BusId[i] = int8(c)
		}
		return p, nvml.SUCCESS
	}
	d.GetMinorNumberFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_GPU_IS_LOST }
	return d
}

// A critical Xid from a GPU NVML cannot identify is audited, once per Xid
// code, as an unhealthy record naming no device (there is none to name or
// cordon), whose reason names the Xid, what NVML read of the device (its
// PCI bus id) and how to cordon the GPU by hand. No record was written: the
// health path (onUnhealthy) audits a device it cordons, and it never hears
// of this one; the policy skips every unhealthy finding of a report. The
// only traces were an error in the log and, with accounting on, an entry
// of observe.json that a restart of the daemon drops.
func TestUnidentifiedXidIsAudited(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	states := newFakeStates()
	w, reports, stop := runWatch(t, h, g, states, nil)
	defer stop()
	unknown := unidentifiedGPU()
	ev := func(xid uint64) nvml.EventData {
		return nvml.EventData{Device: unknown, EventType: nvml.EventTypeXidCriticalError, EventData: xid,
			GpuInstanceId: 0xFFFFFFFF, ComputeInstanceId: 0xFFFFFFFF}
	}
	h.events <- ev(79)
	h.events <- ev(79) // the same Xid again: audited once
	h.events <- ev(48)
	// The events are handled in order: once a report lists the Xid 48,
	// both 79 have been.
	for pass := 0; ; pass++ {
		require.Less(t, pass, 1000, "no report lists both Xids")
		testwait.Receive(t, reports, "a report")
		w.mu.Lock()
		n := len(w.notInInventory)
		w.mu.Unlock()
		if n == 2 {
			break
		}
	}
	recs, err := ledger.ReadAudit(g.Ledger().AuditPath())
	require.NoError(t, err)
	var unhealthy []ledger.AuditRecord
	for _, r := range recs {
		if r.Op == OpUnhealthy {
			unhealthy = append(unhealthy, r)
		}
	}
	require.Len(t, unhealthy, 2, "one unhealthy record per Xid code: %+v", unhealthy)
	for i, xid := range []string{"Xid 79", "Xid 48"} {
		r := unhealthy[i]
		assert.Empty(t, r.Devices, "no device to name")
		for _, want := range []string{"an unidentified GPU reported critical " + xid, "0000:c1:00.0", "no GPU was cordoned",
			"sudo gpu-guard-ctl cordon"} {
			assert.Contains(t, r.Reason, want)
		}
	}
	assert.Empty(t, states.cordons, "nothing cordoned: no GPU is known")
}
