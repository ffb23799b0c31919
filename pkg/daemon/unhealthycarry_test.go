// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package daemon

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/metrics"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// accountingDaemon is a daemon's Watch over g whose observer runs
// accounting passes (an hour apart: the test drives the policy), over every
// GPU of h but GPU 7; stop ends it. It returns once the observer's first
// pass, which runs at its start, has been handled, so that nothing the
// daemon does runs beside what the test drives (that pass settles the
// unhealthy devices too: after a test had damaged the ledger, a late one
// cordoned GPU 3 again).
func accountingDaemon(t *testing.T, h *gpuHost, g *guard.Guard) (w *Watch, m *metrics.Metrics, stop func()) {
	t.Helper()
	w = watchOver(g, nil)
	m = metrics.New()
	w.Metrics = m
	w.ProcRoot, w.Interval = h.proc, time.Hour
	reports := make(chan struct{}, 1)
	w.afterReport = func() {
		select {
		case reports <- struct{}{}:
		default:
		}
	}
	stop = startWithout(t, w, g, h, 7)
	testwait.Receive(t, reports, "the observer's first pass")
	return w, m, stop
}

func unhealthyUUIDs(fs []observe.Finding) []string {
	var out []string
	for _, f := range fs {
		out = append(out, f.Device.UUID)
	}
	return out
}

// xidUnderOperatorCordon is a host whose GPU 3 (uuid) carries an
// operator's cordon, and its guard.
func xidUnderOperatorCordon(t *testing.T) (*gpuHost, *guard.Guard, string) {
	t.Helper()
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	uuid := h.uuid(3)
	_, _, err := g.Cordon(context.Background(), uuid, ledger.CordonOperator, "firmware update tonight", "operator")
	require.NoError(t, err)
	return h, g, uuid
}

// xid79 is GPU 3 (uuid) reporting a critical Xid.
func xid79(uuid string) observe.Finding {
	return observe.Finding{Kind: observe.KindUnhealthy, Xid: 79, Message: "GPU 3 reported critical Xid 79",
		Device: observe.Device{UUID: uuid, Index: "3"}}
}

// GPU 3 is under an operator's maintenance cordon when it reports a
// critical Xid: the unhealthy cordon is kept as the operator's (rank), so
// the ledger does not say that the GPU failed, and NVML reports the Xid
// once. The daemon after a restart (same boot) still knows it from the
// carry file: it lists it as unhealthy (observe.json, the gauge), and
// cordons it again, as unhealthy, once the ledger is rebuilt from nothing
// (the NRI daemon's recovery after damage), as the daemon before would.
func TestUnhealthyUnderOperatorCordonAcrossADaemonRestart(t *testing.T) {
	for _, restart := range []bool{false, true} {
		name := "same daemon"
		if restart {
			name = "daemon restarted"
		}
		t.Run(name, func(t *testing.T) {
			h, g, uuid := xidUnderOperatorCordon(t)
			ctx := context.Background()
			w, m, stop := accountingDaemon(t, h, g)
			w.onUnhealthy(ctx, xid79(uuid))
			assert.Equal(t, ledger.CordonOperator, cordonOn(t, g, uuid).Source)
			if restart {
				stop()
				w, m, stop = accountingDaemon(t, h, g)
			}
			defer stop()
			requireGPU3ListedUnhealthy(t, w, m, g, uuid)

			w.settleUnhealthy(ctx, forgetting(func(string) bool { return true }))
			assert.Equal(t, ledger.CordonOperator, cordonOn(t, g, uuid).Source, "the operator's cordon stays as it is")

			damageLedger(t, g)
			rep, err := g.Ledger().Recover(ctx, ledger.RecoverOptions{AllowEmpty: true, Reason: "NRI sync"})
			require.NoError(t, err)
			require.True(t, rep.Empty)
			require.False(t, cordonedIn(t, g, uuid))
			w.settleUnhealthy(ctx, forgetting(func(string) bool { return true }))
			assert.Equal(t, ledger.CordonUnhealthy, cordonOn(t, g, uuid).Source,
				"GPU 3 failed (Xid 79): cordoned again after the ledger was rebuilt")
		})
	}
}

// The unhealthy devices are carried within the boot only: after a reboot a
// GPU that still fails is found again (discovery, its next Xid).
func TestUnhealthyNotCarriedAcrossAReboot(t *testing.T) {
	h, g, uuid := xidUnderOperatorCordon(t)
	w, _, stop := accountingDaemon(t, h, g)
	w.onUnhealthy(context.Background(), xid79(uuid))
	stop()

	path := filepath.Join(g.Ledger().Dir(), observe.CarryFileName)
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	var c map[string]any
	require.NoError(t, json.Unmarshal(data, &c))
	require.Len(t, c["unhealthy"], 1)
	c["boot_id"] = "an-earlier-boot"
	data, err = json.Marshal(c)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(path, data, 0o600))

	w, m, stop := accountingDaemon(t, h, g)
	defer stop()
	w.mu.Lock()
	assert.Empty(t, w.unhealthy)
	w.mu.Unlock()
	assert.Empty(t, gaugeByIndex(t, m, "nri_gpu_guard_unhealthy"))
}

// The carry file names the device's cordon pending before it is written: a
// daemon that died between the two leaves it to the daemon after, which
// writes it at its first settling.
func TestUnhealthyCordonPendingCarriedAcrossADaemonRestart(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	ctx := context.Background()
	uuid := h.uuid(3)
	f := observe.Finding{Kind: observe.KindUnhealthy, Xid: 79, Message: "GPU 3 reported critical Xid 79",
		Device: observe.Device{UUID: uuid, Index: "3"}, Time: time.Now()}
	// What onUnhealthy's first write leaves when the daemon dies before its
	// cordon.
	w := watchOver(g, nil)
	w.mu.Lock()
	w.carryTaken, w.accounted = true, true
	w.unhealthy = append(w.unhealthy, f)
	w.mu.Unlock()
	w.writeUnhealthyCarry(map[string]string{uuid: f.Message})
	c, err := observe.ReadCarry(g.Ledger().Dir())
	require.NoError(t, err)
	require.Len(t, c.Unhealthy, 1)
	assert.Equal(t, f.Message, c.Unhealthy[0].CordonRetry)
	assert.Nil(t, c.Unhealthy[0].CordonLineage)
	require.False(t, cordonedIn(t, g, uuid))

	w, _, stop := accountingDaemon(t, h, g)
	defer stop()
	w.settleUnhealthy(ctx, forgetting(func(string) bool { return true }))
	assert.Equal(t, ledger.CordonUnhealthy, cordonOn(t, g, uuid).Source)
	assert.Equal(t, f.Message, cordonOn(t, g, uuid).Reason)
	c, err = observe.ReadCarry(g.Ledger().Dir())
	require.NoError(t, err)
	require.Len(t, c.Unhealthy, 1)
	assert.Empty(t, c.Unhealthy[0].CordonRetry, "written: no longer pending")
	assert.NotNil(t, c.Unhealthy[0].CordonLineage)
	assert.True(t, slices.ContainsFunc(c.Unhealthy, func(u observe.UnhealthyDevice) bool { return u.Xid == 79 }))
}

// healthOnlyDaemon is a daemon's Watch over g with [observe] interval =
// "0s": its observer runs no accounting pass and watches health only, over
// every GPU of h but GPU 7. cordoned gets each device whose cordon it asked
// for, once asked; timer ends its waits between two settlings of its
// unhealthy devices (none ends unless the test says so); stop ends it
// (waiting for the health callback in progress, as Run does).
func healthOnlyDaemon(t *testing.T, h *gpuHost, g *guard.Guard) (w *Watch, m *metrics.Metrics, cordoned chan string, timer *settleTimer,
	stop func()) {
	t.Helper()
	return healthOnlyDaemonWith(t, h, g, nil)
}

// healthOnlyDaemonWith is healthOnlyDaemon with wrap (when set) around its
// device states.
func healthOnlyDaemonWith(t *testing.T, h *gpuHost, g *guard.Guard, wrap func(DeviceStates) DeviceStates) (w *Watch, m *metrics.Metrics,
	cordoned chan string, timer *settleTimer, stop func()) {
	t.Helper()
	w = watchOver(g, nil)
	m = metrics.New()
	w.Metrics = m
	w.ProcRoot = h.proc
	timer = newSettleTimer()
	w.After, w.settled = timer.after, timer.settle
	cordoned = make(chan string, 8)
	w.States = func(g *guard.Guard) DeviceStates {
		s := statesOf(g)
		if wrap != nil {
			s = wrap(s)
		}
		return signalStates{s, cordoned}
	}
	cfg := g.Config()
	cfg.Observe.Interval = config.Duration{}
	return w, m, cordoned, timer, startWithoutUnder(t, w, g, h, 7, cfg)
}

// signalStates are device states that tell of each cordon asked for.
type signalStates struct {
	DeviceStates
	cordoned chan<- string
}

func (s signalStates) CordonDevice(ctx context.Context, uuid, source, reason string) (ledger.Cordon, bool, error) {
	k, kept, err := s.DeviceStates.CordonDevice(ctx, uuid, source, reason)
	s.cordoned <- uuid
	return k, kept, err
}

// xidEvent is NVML's critical Xid 79 event on GPU i of h.
func xidEvent(h *gpuHost, i int) nvml.EventData {
	return nvml.EventData{Device: h.srv.Devices[i], EventType: nvml.EventTypeXidCriticalError, EventData: 79,
		GpuInstanceId: 0xFFFFFFFF, ComputeInstanceId: 0xFFFFFFFF}
}

// With accounting off ([observe] interval = "0s") the observer still
// watches health: GPU 3, under an operator's maintenance cordon, reports a
// critical Xid, and the unhealthy cordon is kept as the operator's (rank).
// The daemon after a restart (same boot, accounting on or off) still knows
// that GPU 3 failed, from the carry file: it lists it as unhealthy
// (observe.json, the gauge), and cordons it again, as unhealthy, once the
// ledger is rebuilt from nothing (one that does not account, at a settling
// of its own: there is no pass; it used to leave the cordon unwatched). The carry file used to
// be written only by a daemon whose observer accounts: one at "0s" neither
// wrote its unhealthy devices there nor read the daemon before's, and NVML
// reports the Xid once, so GPU 3 was forgotten, and took claims again once
// the operator lifted the maintenance cordon.
func TestUnhealthyCarriedAcrossADaemonRestartWithAccountingOff(t *testing.T) {
	for _, accountsAfter := range []bool{false, true} {
		name := "accounting off after the restart"
		if accountsAfter {
			name = "accounting on after the restart"
		}
		t.Run(name, func(t *testing.T) {
			h, g, uuid := xidUnderOperatorCordon(t)
			ctx := context.Background()
			_, _, cordoned, _, stop := healthOnlyDaemon(t, h, g)
			h.events <- xidEvent(h, 3)
			assert.Equal(t, uuid, testwait.Receive(t, cordoned, "the health watcher's cordon of GPU 3"))
			stop()
			require.Equal(t, ledger.CordonOperator, cordonOn(t, g, uuid).Source, "the operator's cordon is kept")

			var (
				w      *Watch
				m      *metrics.Metrics
				timer  *settleTimer
				signal chan string
			)
			if accountsAfter {
				w, m, stop = accountingDaemon(t, h, g)
			} else {
				w, m, signal, timer, stop = healthOnlyDaemon(t, h, g)
			}
			defer stop()
			requireGPU3ListedUnhealthy(t, w, m, g, uuid)
			damageLedger(t, g)
			rep, err := g.Ledger().Recover(ctx, ledger.RecoverOptions{AllowEmpty: true, Reason: "NRI sync"})
			require.NoError(t, err)
			require.True(t, rep.Empty)
			if accountsAfter {
				w.settleUnhealthy(ctx, forgetting(func(string) bool { return true }))
			} else {
				// No pass runs: the watch settles its unhealthy devices
				// on its own schedule.
				timer.tick(t)
				assert.Equal(t, uuid, testwait.Receive(t, signal, "GPU 3's cordon written again"))
			}
			assert.Equal(t, ledger.CordonUnhealthy, cordonOn(t, g, uuid).Source,
				"GPU 3 failed (Xid 79): cordoned again after the ledger was rebuilt")
		})
	}
}

// A daemon whose observer does not account takes over the carry file for
// its unhealthy devices, and keeps the findings of the daemon before it as
// they were, for the first observer that accounts: of the daemon after it,
// or its own once [observe] interval is set again. That one does not take
// the intruder still running for a new finding (audited, and its device
// cordoned, again although the operator had lifted the cordon).
func TestFindingsKeptForAnAccountingObserverByADaemonWithAccountingOff(t *testing.T) {
	for _, later := range []string{"the daemon after", "the same daemon"} {
		t.Run(later, func(t *testing.T) {
			h := newGPUHost(t)
			g := guardFor(t, h, func(c *config.Config) { c.Observe.OnIntruder = config.IntruderCordon })
			ctx := context.Background()
			_, err := g.Reconcile(ctx, ledger.FrontEndNRI, nil)
			require.NoError(t, err)
			h.run(2, 200, idB) // no claim: an intruder
			// accounting runs one pass of an observer that accounts over
			// w, which then stops.
			accounting := func(w *Watch) {
				t.Helper()
				reports := make(chan struct{}, 1)
				w.afterReport = func() {
					select {
					case reports <- struct{}{}:
					default:
					}
				}
				w.ProcRoot, w.Interval = h.proc, time.Hour
				stop := startWithout(t, w, g, h, 7)
				testwait.Receive(t, reports, "the first pass")
				stop()
			}

			// A daemon that accounts finds the intruder and cordons GPU 2;
			// the operator accepts the process and lifts the cordon.
			accounting(watchOver(g, nil))
			require.Equal(t, 1, auditCount(t, g, OpIntruder))
			operatorUncordon(t, g, h.uuid(2))

			// The daemon after it runs with accounting off, and GPU 3
			// reports a critical Xid: the carry file names it, and still
			// the intruder.
			w, _, cordoned, _, stop := healthOnlyDaemon(t, h, g)
			h.events <- xidEvent(h, 3)
			assert.Equal(t, h.uuid(3), testwait.Receive(t, cordoned, "the health watcher's cordon of GPU 3"))
			stop()
			c, err := observe.ReadCarry(g.Ledger().Dir())
			require.NoError(t, err)
			require.Len(t, c.Unhealthy, 1)
			assert.Equal(t, h.uuid(3), c.Unhealthy[0].Device.UUID)
			require.Len(t, c.Findings, 1, "the intruder is still carried")
			assert.Equal(t, 200, c.Findings[0].PID)

			if later == "the daemon after" {
				w = watchOver(g, nil)
			}
			accounting(w)
			w.mu.Lock()
			assert.Len(t, w.reported, 1, "the intruder carried over")
			assert.Equal(t, []string{h.uuid(3)}, unhealthyUUIDs(w.unhealthy))
			w.mu.Unlock()
			assert.Equal(t, 1, auditCount(t, g, OpIntruder), "not a new finding")
			assert.False(t, cordonedIn(t, g, h.uuid(2)), "the operator's uncordon stands")
		})
	}
}

// requireGPU3ListedUnhealthy requires that the daemon of w (metrics m,
// guard g) lists GPU 3 (uuid) as unhealthy, alone: in its state, its gauge
// and observe.json, which gpu-guard-ctl status reads.
func requireGPU3ListedUnhealthy(t *testing.T, w *Watch, m *metrics.Metrics, g *guard.Guard, uuid string) {
	t.Helper()
	w.mu.Lock()
	assert.Equal(t, []string{uuid}, unhealthyUUIDs(w.unhealthy), "the daemon knows GPU 3 failed")
	w.mu.Unlock()
	assert.Equal(t, map[string]float64{"3": 1}, gaugeByIndex(t, m, "nri_gpu_guard_unhealthy"))
	file, err := observe.ReadFile(g.Ledger().Dir())
	require.NoError(t, err)
	assert.Equal(t, []string{uuid}, unhealthyUUIDs(file.Unhealthy), "gpu-guard-ctl status warns of GPU 3")
}
