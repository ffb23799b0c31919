// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package daemon

import (
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// Two GPUs NVML cannot identify (PCI 0000:c1:00.0 and 0000:c2:00.0) report
// the same critical Xid. They used to be told apart by the Xid alone: only
// c1's was audited and listed, c2 went unseen. Each is audited and listed.
func TestTwoUnidentifiedGPUsSameXid(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	states := newFakeStates()
	w, reports, stop := runWatch(t, h, g, states, nil)
	defer stop()
	a, b := unidentifiedGPU(), unidentifiedGPU()
	b.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) {
		var p nvml.PciInfo
		for i, c := range "0000:c2:00.0" {
			p.BusId[i] = int8(c)
		}
		return p, nvml.SUCCESS
	}
	ev := func(d nvml.Device, xid uint64) nvml.EventData {
		return nvml.EventData{Device: d, EventType: nvml.EventTypeXidCriticalError, EventData: xid,
			GpuInstanceId: 0xFFFFFFFF, ComputeInstanceId: 0xFFFFFFFF}
	}
	h.events <- ev(a, 79)
	h.events <- ev(b, 79)
	h.events <- ev(a, 79) // c1's again: one finding still
	h.events <- ev(a, 48) // marker: once listed, both 79s were handled
	hasMarker := func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		for _, d := range w.notInInventory {
			if strings.Contains(d.Notice, "Xid 48") {
				return true
			}
		}
		return false
	}
	for pass := 0; !hasMarker(); pass++ {
		require.Less(t, pass, 1000)
		testwait.Receive(t, reports, "a report")
	}
	listed := map[string]int{}
	w.mu.Lock()
	for _, d := range w.notInInventory {
		if strings.Contains(d.Notice, "Xid 79") {
			for _, bus := range []string{"0000:c1:00.0", "0000:c2:00.0"} {
				if strings.Contains(d.Notice, bus) {
					listed[bus]++
				}
			}
		}
	}
	w.mu.Unlock()
	assert.Equal(t, map[string]int{"0000:c1:00.0": 1, "0000:c2:00.0": 1}, listed, "status lists each GPU's Xid 79 once")
	recs, err := ledger.ReadAudit(g.Ledger().AuditPath())
	require.NoError(t, err)
	audited := map[string]int{}
	for _, r := range recs {
		if r.Op == OpUnhealthy && strings.Contains(r.Reason, "Xid 79") {
			for _, bus := range []string{"0000:c1:00.0", "0000:c2:00.0"} {
				if strings.Contains(r.Reason, bus) {
					audited[bus]++
				}
			}
		}
	}
	assert.Equal(t, map[string]int{"0000:c1:00.0": 1, "0000:c2:00.0": 1}, audited, "each GPU's Xid 79 audited once")
}
