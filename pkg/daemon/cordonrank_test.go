// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/metrics"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// The daemon found GPU 3 unhealthy (a double-bit ECC error), then an
// intruder on it. The intruder's cordon leaves the unhealthy one in force
// (ledger.CordonKept), so the daemon started afresh, which knows of no Xid
// (NVML reports one once), adopts GPU 3 as unhealthy from the ledger and
// writes its cordon again when the ledger loses it. Rewritten as an
// intruder's, the cordon was not adopted: the broken GPU took claims again
// once the intruder's cordon was lifted or lost.
func TestIntruderFindingLeavesTheUnhealthyCordonToTheNextDaemon(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	ctx := context.Background()
	uuid := h.uuid(3)
	dev := observe.Device{UUID: uuid, Index: "3"}
	const xid = "GPU 3 reported critical Xid 48"

	first := watchOver(g, nil)
	first.onUnhealthy(ctx, observe.Finding{Kind: observe.KindUnhealthy, Xid: 48, Message: xid, Device: dev})
	require.True(t, first.cordonRecorded(ctx, observe.Finding{Kind: observe.KindIntruder, PID: 200, Device: dev},
		ledger.CordonIntruder, "intruder: pid 200 (host process) runs on it without a claim"), "the intruder's cordon is in force")
	k := cordonOn(t, g, uuid)
	assert.Equal(t, ledger.CordonUnhealthy, k.Source)
	assert.Equal(t, xid, k.Reason)

	// The daemon restarts (its inventory without GPU 7, which plays no part).
	logs := &syncBuffer{}
	w := watchOver(g, logs)
	m := metrics.New()
	w.Metrics = m
	w.ProcRoot, w.Interval = h.proc, time.Hour // passes find nothing to change
	startWithout(t, w, g, h, 7)()
	assert.Equal(t, map[string]float64{"3": 1}, gaugeByIndex(t, m, "nri_gpu_guard_unhealthy"), "GPU 3 adopted as unhealthy")
	assert.Contains(t, logs.String(), "unhealthy device's cordon found in the ledger")

	resetLedger(t, g)
	require.False(t, cordonedIn(t, g, uuid))
	w.settleUnhealthy(ctx, func(string) bool { return true })
	k = cordonOn(t, g, uuid)
	assert.Equal(t, ledger.CordonUnhealthy, k.Source, "the lost cordon is written again")
	assert.Contains(t, k.Reason, xid)
}
