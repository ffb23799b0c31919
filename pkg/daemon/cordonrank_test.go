// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package daemon

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
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
	w.settleUnhealthy(ctx, forgetting(func(string) bool { return true }))
	k = cordonOn(t, g, uuid)
	assert.Equal(t, ledger.CordonUnhealthy, k.Source, "the lost cordon is written again")
	assert.Contains(t, k.Reason, xid)
}

// logRecords are the JSON log records in logs whose message starts with
// prefix.
func logRecords(t *testing.T, logs *syncBuffer, prefix string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for line := range strings.Lines(logs.String()) {
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), line)
		if msg, _ := rec["msg"].(string); strings.HasPrefix(msg, prefix) {
			out = append(out, rec)
		}
	}
	return out
}

// The daemon's log says what the ledger did with the observer's cordon.
// A finding on a device whose cordon in force ranks higher (operator >
// unhealthy > intruder) leaves that cordon as it is (ledger.CordonKept):
// logging "device cordoned" for it told the operator that the observer
// had cordoned the device for the finding, while the ledger showed the
// operator's or the unhealthy cordon, and the finding only in the audit
// log (lifting that cordon lifts the finding's too). The log names the
// device, the finding and the cordon kept; a cordon written is still
// logged "device cordoned". Either way the device counts as cordoned for
// the finding (judgeCordons): nothing is retried.
func TestCordonKeptIsNotLoggedAsTheObserversCordon(t *testing.T) {
	const gpu = 3
	const (
		operatorReason = "firmware update tonight"
		xidReason      = "GPU 3 reported critical Xid 79"
	)
	for _, tc := range []struct {
		name string
		// inForce is the source of the cordon on GPU 3 before the finding
		// ("" none).
		inForce string
		// finding is the source of the observer's cordon for it.
		finding string
		// kept: the cordon in force stays, the finding's is not written.
		kept bool
	}{
		{name: "intruder on an operator's cordon", inForce: ledger.CordonOperator, finding: ledger.CordonIntruder, kept: true},
		{name: "intruder on an unhealthy device", inForce: ledger.CordonUnhealthy, finding: ledger.CordonIntruder, kept: true},
		{name: "Xid on an operator's cordon", inForce: ledger.CordonOperator, finding: ledger.CordonUnhealthy, kept: true},
		{name: "intruder on a device not cordoned", finding: ledger.CordonIntruder},
		{name: "Xid on an intruder's cordon", inForce: ledger.CordonIntruder, finding: ledger.CordonUnhealthy},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newGPUHost(t)
			g := guardFor(t, h, func(c *config.Config) { c.Observe.OnIntruder = config.IntruderCordon })
			ctx := context.Background()
			uuid := h.uuid(gpu)
			dev := observe.Device{UUID: uuid, Index: "3"}
			var before ledger.Cordon
			switch tc.inForce {
			case ledger.CordonOperator:
				_, _, err := g.Cordon(ctx, uuid, ledger.CordonOperator, operatorReason, "uid 0 via gpu-guard-ctl")
				require.NoError(t, err)
			case ledger.CordonUnhealthy:
				require.NoError(t, g.CordonDevice(ctx, uuid, ledger.CordonUnhealthy, xidReason))
			case ledger.CordonIntruder:
				require.NoError(t, g.CordonDevice(ctx, uuid, ledger.CordonIntruder, "intruder: pid 100 (host process) runs on it without a claim"))
			}
			if tc.inForce != "" {
				before = cordonOn(t, g, uuid)
				require.Equal(t, tc.inForce, before.Source)
			}

			logs := &syncBuffer{}
			w := watchOver(g, logs)
			if tc.finding == ledger.CordonUnhealthy {
				w.onUnhealthy(ctx, observe.Finding{Kind: observe.KindUnhealthy, Xid: 79, Message: xidReason, Device: dev})
			} else {
				w.onReport(ctx, g.Config(), observe.Report{Time: time.Now(), Findings: []observe.Finding{
					{Kind: observe.KindIntruder, Device: dev, PID: 200, ContainerID: idB, Message: "pid 200 runs on GPU 3 without a claim"}}})
			}

			cordoned := logRecords(t, logs, "device cordoned")
			kept := logRecords(t, logs, "device already cordoned by")
			if !tc.kept {
				require.Len(t, cordoned, 1, "the observer's cordon is logged as written")
				assert.Equal(t, tc.finding, cordoned[0]["source"])
				assert.Empty(t, kept)
				assert.Equal(t, tc.finding, cordonOn(t, g, uuid).Source)
				return
			}
			assert.Empty(t, cordoned, "the ledger kept the %s cordon: the observer cordoned nothing", tc.inForce)
			require.Len(t, kept, 1, "the finding that left the cordon in force is logged as such")
			rec := kept[0]
			assert.Equal(t, "device already cordoned by "+tc.inForce+": the observer's "+tc.finding+
				" cordon is not recorded over it; that cordon stays in force (no new claims), the finding is in the audit log, and lifting that cordon with `gpu-guard-ctl uncordon` lifts this finding's too",
				rec["msg"])
			assert.Equal(t, "WARN", rec["level"])
			assert.Equal(t, "3", rec["device_index"])
			assert.Equal(t, uuid, rec["device_uuid"])
			assert.Equal(t, tc.finding, rec["source"])
			detail := "pid 200"
			if tc.finding == ledger.CordonUnhealthy {
				detail = "Xid 79"
			}
			assert.Contains(t, rec["reason"], detail, "the finding")
			assert.Equal(t, before.Source, rec["cordon_source"])
			assert.Equal(t, before.By, rec["cordon_by"])
			assert.Equal(t, before.Reason, rec["cordon_reason"])
			assert.Equal(t, before, cordonOn(t, g, uuid), "the cordon in force stays as it was")

			// The device counts as cordoned for the finding: no retry.
			w.mu.Lock()
			assert.Empty(t, w.cordonFailed)
			assert.Empty(t, w.intruderRetry)
			_, recorded := w.cordonLineage[cordonKey{tc.finding, uuid}]
			w.mu.Unlock()
			assert.True(t, recorded, "the cordon kept stands for the finding's (judgeCordons)")
		})
	}
}
