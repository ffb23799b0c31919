// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package daemon

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/metrics"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// restartObserver starts w's observer afresh over its guard's inventory
// and ledger with cfg's [observe] section, as Run does at a reconnect with
// another section, an inventory swap or NVML reopened, and stops it.
// Without NVML the new observer runs no pass of its own: the test's passes
// (onReport) decide with what it carried over.
func restartObserver(t *testing.T, w *Watch, cfg config.Config) {
	t.Helper()
	g := w.guard()
	stop := w.start(context.Background(), nil, watchKey{gpus: g.Inventory().GPUs, observe: cfg.Observe, dir: g.Ledger().Dir()}, cfg)
	stop()
}

// auditCount counts the records of op in g's audit log.
func auditCount(t *testing.T, g *guard.Guard, op string) int {
	t.Helper()
	recs, err := ledger.ReadAudit(g.Ledger().AuditPath())
	require.NoError(t, err)
	n := 0
	for _, r := range recs {
		if r.Op == op {
			n++
		}
	}
	return n
}

// intruderRestartSetup is a watch over a reconciled ledger (on_intruder =
// "cordon", unless edit says otherwise) with an intruder finding on GPU 2;
// pass runs one accounting pass with cfg, as the observer's OnReport.
func intruderRestartSetup(t *testing.T, edit func(*config.Config)) (g *guard.Guard, w *Watch, logs *syncBuffer, m *metrics.Metrics,
	f observe.Finding, pass func(cfg config.Config, fs ...observe.Finding)) {
	t.Helper()
	h := newGPUHost(t)
	g = guardFor(t, h, func(c *config.Config) {
		c.Observe.OnIntruder = config.IntruderCordon
		if edit != nil {
			edit(c)
		}
	})
	// A lineage before the first cordon (see
	// TestIntruderCordonKeptWhileReportedUntilOperatorUncordons).
	_, err := g.Reconcile(context.Background(), ledger.FrontEndNRI, nil)
	require.NoError(t, err)
	logs = &syncBuffer{}
	w = watchOver(g, logs)
	m = metrics.New()
	w.Metrics = m
	ctx := context.Background()
	f = observe.Finding{Kind: observe.KindIntruder, Device: observe.Device{UUID: h.uuid(2), Index: "2"},
		PID: 200, ContainerID: idB, Message: "pid 200 runs on GPU 2 without a claim"}
	pass = func(cfg config.Config, fs ...observe.Finding) {
		w.onReport(ctx, cfg, observe.Report{Time: time.Now(), Findings: fs})
		w.settleUnhealthy(ctx, forgetting(func(string) bool { return true }))
	}
	// The first observer's: it finds the intruder, cordons its device
	// (on_intruder = "cordon") and sees the cordon in force.
	restartObserver(t, w, g.Config())
	pass(g.Config(), f)
	require.Equal(t, g.Config().Observe.OnIntruder == config.IntruderCordon, cordonedIn(t, g, f.Device.UUID))
	pass(g.Config(), f)
	return g, w, logs, m, f, pass
}

// An intruder still running when the observer restarts (another [observe]
// section, an inventory swap, NVML reopened) is not a new finding for the
// new observer: it is not logged or audited again, and its device is not
// cordoned again once the operator lifted the cordon, whether before the
// restart or after it. A cordon the ledger lost with its state (a reset, a
// recovery afresh) is written again, as without the restart. The restart
// used to forget the findings and their cordons' lineages: the same process
// was reported, audited and its device cordoned again, the operator's
// uncordon undone.
func TestIntruderFindingKeptAcrossAnObserverRestart(t *testing.T) {
	for _, tc := range lineageCases() {
		for _, before := range []bool{true, false} {
			name := "restart, then " + tc.name
			if !before {
				name = tc.name + ", then restart"
			}
			t.Run(name, func(t *testing.T) {
				g, w, logs, m, f, pass := intruderRestartSetup(t, func(c *config.Config) {
					c.Observe.Xids = []int{79} // the new observer's section differs
				})
				uuid := f.Device.UUID
				cordoned := func() bool { t.Helper(); return cordonedIn(t, g, uuid) }
				next := g.Config()
				next.Observe.Xids = []int{48, 79}
				if before {
					restartObserver(t, w, next)
				}
				tc.between(t, g, uuid)
				if !before {
					restartObserver(t, w, next)
				}
				assert.Equal(t, map[string]float64{"2": 1}, gaugeByIndex(t, m, "nri_gpu_guard_intruders"),
					"the carried finding is still counted")
				require.False(t, cordoned())
				pass(next, f)
				if tc.fenceOnce {
					assert.False(t, cordoned(), "the fence refuses writes until the plugin rebuilt")
					g.Ledger().RequireLineage("") // rebuilt
					pass(next, f)
				}
				if tc.recordon {
					assert.True(t, cordoned(), "the intruder still runs: its lost cordon is written again")
					assertCordonedAgain(t, g, logs, uuid, "intruder cordon lost", "pid 200")
				} else {
					assert.False(t, cordoned(), "the operator's uncordon is honoured across the restart")
					assert.Contains(t, logs.String(), "intruder cordon lifted by the operator")
					pass(next, f)
					assert.False(t, cordoned())
				}
				assert.Equal(t, 1, auditCount(t, g, OpIntruder), "one finding, audited once")
				assert.Equal(t, 1, strings.Count(logs.String(), "GPU process not admitted by the guard"), "one finding, logged once")
				assert.Zero(t, auditCount(t, g, OpFindingCleared))
				file, err := observe.ReadFile(g.Ledger().Dir())
				require.NoError(t, err)
				if assert.Len(t, file.Findings, 1) {
					assert.Equal(t, 200, file.Findings[0].PID)
				}

				// The intruder leaves: its finding clears, once.
				pass(next)
				assert.Equal(t, 1, auditCount(t, g, OpFindingCleared))
				w.mu.Lock()
				assert.Empty(t, w.cordonLineage)
				w.mu.Unlock()
				assert.Empty(t, gaugeByIndex(t, m, "nri_gpu_guard_intruders"))
			})
		}
	}
}

// A finding carried over whose process has left by the new observer's first
// pass is cleared by it (finding-cleared, the gauge and observe.json
// follow); a new intruder on the device then is a new finding, and cordons
// it. An observer that runs no accounting pass (interval 0) carries no
// finding: nothing would ever clear it.
func TestIntruderFindingCarriedThenCleared(t *testing.T) {
	g, w, logs, m, f, pass := intruderRestartSetup(t, nil)
	operatorUncordon(t, g, f.Device.UUID)
	restartObserver(t, w, g.Config())
	pass(g.Config())
	assert.Equal(t, 1, auditCount(t, g, OpFindingCleared))
	assert.Contains(t, logs.String(), "GPU finding cleared")
	assert.Empty(t, gaugeByIndex(t, m, "nri_gpu_guard_intruders"))
	file, err := observe.ReadFile(g.Ledger().Dir())
	require.NoError(t, err)
	assert.Empty(t, file.Findings)

	f.PID = 201
	pass(g.Config(), f)
	assert.True(t, cordonedIn(t, g, f.Device.UUID), "a new intruder cordons the device")
	assert.Equal(t, 2, auditCount(t, g, OpIntruder))

	off := g.Config()
	off.Observe.Interval = config.Duration{}
	restartObserver(t, w, off)
	w.mu.Lock()
	assert.Empty(t, w.reported, "no pass would clear it")
	assert.Empty(t, w.cordonLineage)
	w.mu.Unlock()
	assert.Empty(t, gaugeByIndex(t, m, "nri_gpu_guard_intruders"))
}

// An intruder cordon the ledger refused is still retried after the
// observer restarts, while the process runs, and written once.
func TestIntruderCordonRetryCarriedAcrossAnObserverRestart(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, func(c *config.Config) { c.Observe.OnIntruder = config.IntruderCordon })
	states := newFakeStates()
	states.failing = 1
	w := watchOver(g, nil)
	w.States = func(*guard.Guard) DeviceStates { return states }
	ctx := context.Background()
	f := observe.Finding{Kind: observe.KindIntruder, Device: observe.Device{UUID: h.uuid(2), Index: "2"},
		PID: 200, ContainerID: idB, Message: "pid 200 runs on GPU 2 without a claim"}
	restartObserver(t, w, g.Config())
	w.onReport(ctx, g.Config(), observe.Report{Time: time.Now(), Findings: []observe.Finding{f}})
	require.Empty(t, states.cordons, "the first write failed")
	restartObserver(t, w, g.Config())
	w.onReport(ctx, g.Config(), observe.Report{Time: time.Now(), Findings: []observe.Finding{f}})
	c := testwait.Receive(t, states.cordons, "the retried cordon")
	assert.Equal(t, [2]string{h.uuid(2), ledger.CordonIntruder}, [2]string{c[0], c[1]})
	w.onReport(ctx, g.Config(), observe.Report{Time: time.Now(), Findings: []observe.Finding{f}})
	assert.Empty(t, states.cordons, "written once")
	states.mu.Lock()
	assert.Equal(t, 2, states.attempts)
	states.mu.Unlock()
	assert.Equal(t, 1, auditCount(t, g, OpIntruder))
}

// Switching on_intruder from "report" to "cordon" cordons the devices of
// the intruders still running (the old policy never did) without reporting
// them again; switching back and forth keeps a cordon in force as it is.
func TestIntruderPolicySwitchedToCordon(t *testing.T) {
	g, w, _, _, f, pass := intruderRestartSetup(t, func(c *config.Config) { c.Observe.OnIntruder = config.IntruderReport })
	uuid := f.Device.UUID
	require.False(t, cordonedIn(t, g, uuid), "reported, not cordoned")
	cordon := g.Config()
	cordon.Observe.OnIntruder = config.IntruderCordon
	restartObserver(t, w, cordon)
	pass(cordon, f)
	assert.True(t, cordonedIn(t, g, uuid), "the new policy cordons the running intruder's device")
	assert.Equal(t, 1, auditCount(t, g, OpIntruder), "not a new finding")

	// Back to "report" and to "cordon" again: the cordon in force is known,
	// not written again; the operator's uncordon meanwhile is honoured.
	cordons := auditCount(t, g, ledger.OpCordon)
	restartObserver(t, w, g.Config())
	pass(g.Config(), f)
	restartObserver(t, w, cordon)
	pass(cordon, f)
	assert.Equal(t, cordons, auditCount(t, g, ledger.OpCordon), "not cordoned again")
	restartObserver(t, w, g.Config())
	operatorUncordon(t, g, uuid)
	pass(g.Config(), f)
	restartObserver(t, w, cordon)
	pass(cordon, f)
	assert.False(t, cordonedIn(t, g, uuid), "the operator's uncordon is honoured")
	assert.Equal(t, 1, auditCount(t, g, OpIntruder))
}

// A cordon's lineage goes with the last finding on its device under
// "report" too: cordon → report (the operator uncordons, the process
// leaves, another arrives) → cordon cordons the new process's device. The
// lineage used to stay while "report" ran, so the new process read as one
// whose cordon the operator had lifted and was never cordoned.
func TestIntruderLineageForgottenUnderReport(t *testing.T) {
	g, w, _, _, f, pass := intruderRestartSetup(t, nil)
	uuid := f.Device.UUID
	require.True(t, cordonedIn(t, g, uuid))
	report := g.Config()
	report.Observe.OnIntruder = config.IntruderReport
	restartObserver(t, w, report)
	operatorUncordon(t, g, uuid)
	pass(report, f)
	pass(report) // the process leaves
	next := f
	next.PID, next.ContainerID = 201, idA
	pass(report, next) // another arrives, reported only
	require.False(t, cordonedIn(t, g, uuid))

	restartObserver(t, w, g.Config())
	pass(g.Config(), next)
	pass(g.Config(), next)
	assert.True(t, cordonedIn(t, g, uuid), "the new intruder's device is cordoned")
}

// The same through Run: a reconnect with another [observe] section restarts
// the observer, whose passes find the intruder the operator accepted (an
// uncordon) still running, and neither report nor cordon it again.
func TestIntruderUncordonSticksAcrossAReconnect(t *testing.T) {
	h := newGPUHost(t)
	b := &Builder{}
	cfg := config.Default()
	cfg.Ledger.Dir = t.TempDir()
	cfg.Devices.Source = config.SourceStatic
	cfg.Devices.ProcRoot = t.TempDir()
	for i := range h.srv.Devices {
		cfg.Devices.Static = append(cfg.Devices.Static, config.StaticGPU{Index: i, UUID: h.uuid(i), Minor: i})
	}
	cfg.Observe.OnIntruder = config.IntruderCordon
	g, err := b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	_, err = g.Reconcile(context.Background(), ledger.FrontEndNRI, nil)
	require.NoError(t, err)
	uuid := h.uuid(2)
	h.run(2, 200, idB) // no claim
	logs := &syncBuffer{}
	w, reports, stop := runWatch(t, h, g, nil, func(w *Watch) {
		w.States = nil // the guard's own, over the real ledger
		w.Logger = slog.New(slog.NewJSONHandler(logs, nil))
	})
	defer stop()
	until := func(what string, done func() bool) {
		t.Helper()
		for pass := 0; !done(); pass++ {
			require.Less(t, pass, 1000, what)
			testwait.Receive(t, reports, what)
		}
	}
	until("the intruder's device cordoned", func() bool { return cordonedIn(t, g, uuid) })
	operatorUncordon(t, g, uuid)
	until("the uncordon taken for the operator's", func() bool {
		return strings.Contains(logs.String(), "intruder cordon lifted by the operator")
	})

	// A reconnect whose configuration has another [observe] section: the
	// same ledger and inventory, a new observer.
	cfg.Observe.Xids = []int{48, 79}
	g2, err := b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	require.Same(t, g.Ledger(), g2.Ledger())
	w.Use(g2)
	until("the new observer running", func() bool { return strings.Count(logs.String(), "GPU observer running") == 2 })
	// The old observer stopped before the new one started: what is queued
	// now may be its passes; the next two are the new observer's.
	for drained := false; !drained; {
		select {
		case <-reports:
		default:
			drained = true
		}
	}
	for range 2 {
		testwait.Receive(t, reports, "a pass of the new observer")
	}
	assert.False(t, cordonedIn(t, g, uuid), "the operator's uncordon sticks")
	assert.Equal(t, 1, auditCount(t, g, OpIntruder))
	assert.Equal(t, 1, strings.Count(logs.String(), "GPU process not admitted by the guard"))
}
