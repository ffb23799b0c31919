// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// daemon is one run of the daemon's Watch: a new Watch over g (all a
// restarted daemon holds), with h's NVML and /proc, logging to logs, the
// guard's own device states over the real ledger unless states is set, and
// adjust applied before it runs.
type daemon struct {
	t       *testing.T
	w       *Watch
	reports chan struct{}
	stop    func()
}

func runDaemon(t *testing.T, h *gpuHost, g *guard.Guard, states *fakeStates, logs *syncBuffer, adjust ...func(*Watch)) *daemon {
	t.Helper()
	// No test here sends an Xid: an event wait that gives up soon lets the
	// observer stop at once (it waits for the wait in flight).
	h.srv.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) {
		return &mock.EventSet{
			WaitFunc: func(uint32) (nvml.EventData, nvml.Return) {
				time.Sleep(10 * time.Millisecond)
				return nvml.EventData{}, nvml.ERROR_TIMEOUT
			},
			FreeFunc: func() nvml.Return { return nvml.SUCCESS },
		}, nvml.SUCCESS
	}
	w, reports, stop := runWatch(t, h, g, states, func(w *Watch) {
		if states == nil {
			w.States = nil
		}
		w.Logger = slog.New(slog.NewJSONHandler(logs, nil))
		for _, a := range adjust {
			a(w)
		}
	})
	return &daemon{t: t, w: w, reports: reports, stop: stop}
}

// until waits, pass by pass, for done.
func (d *daemon) until(what string, done func() bool) {
	d.t.Helper()
	for pass := 0; !done(); pass++ {
		require.Less(d.t, pass, 1000, what)
		testwait.Receive(d.t, d.reports, what)
	}
}

// passes waits for n passes that started after the call: a signal still
// queued may be of an earlier one, and the pass in flight may have read the
// ledger before the caller's change.
func (d *daemon) passes(n int) {
	d.t.Helper()
	for drained := false; !drained; {
		select {
		case <-d.reports:
		default:
			drained = true
		}
	}
	for range n + 1 {
		testwait.Receive(d.t, d.reports, "an accounting pass")
	}
}

// restartPID makes pid another process, started at ticks, as when a
// process exits and the kernel gives its pid to a new one (NVML lists the
// pid all along).
func restartPID(t *testing.T, h *gpuHost, pid int, ticks uint64) {
	t.Helper()
	stat := fmt.Sprintf("%d (python) S 1 %d %d 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 %d 0 0\n", pid, pid, pid, ticks)
	require.NoError(t, os.WriteFile(filepath.Join(h.proc, "proc", fmt.Sprint(pid), "stat"), []byte(stat), 0o644))
}

// cordonGuard is a guard over a reconciled ledger (a lineage before the
// first cordon) that cordons intruders' devices.
func cordonGuard(t *testing.T, h *gpuHost) *guard.Guard {
	t.Helper()
	g := guardFor(t, h, func(c *config.Config) { c.Observe.OnIntruder = config.IntruderCordon })
	_, err := g.Reconcile(context.Background(), ledger.FrontEndNRI, nil)
	require.NoError(t, err)
	return g
}

// A process the daemon reported is no new finding for the daemon after it
// (an upgrade, a crash, a restart for a new configuration), as it is none
// for a restarted observer: the intruder cordon the operator lifted stays
// lifted, whether lifted before the restart or while no daemon ran; a
// cordon the ledger lost with its state while no daemon ran is written
// again, as by the daemon that wrote it. The new daemon used to take the
// still-running process for a new finding: logged, audited and its device
// cordoned again, the operator's uncordon undone.
func TestIntruderUncordonSticksAcrossADaemonRestart(t *testing.T) {
	type tc struct {
		name string
		// before: the change made while the first daemon runs (it sees
		// it); between: while no daemon runs.
		before, between func(t *testing.T, g *guard.Guard, uuid string)
		recordon        bool
	}
	cases := []tc{{name: "operator uncordon, then restart", before: operatorUncordon}}
	for _, lc := range lineageCases() {
		if lc.fenceOnce {
			continue // the NRI plugin's fence: no restart of the daemon in it
		}
		cases = append(cases, tc{name: "restart across " + lc.name, between: lc.between, recordon: lc.recordon})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newGPUHost(t)
			g := cordonGuard(t, h)
			uuid := h.uuid(2)
			cordoned := func() bool { t.Helper(); return cordonedIn(t, g, uuid) }
			h.run(2, 200, idB) // no claim
			logs := &syncBuffer{}

			first := runDaemon(t, h, g, nil, logs)
			first.until("the intruder's device cordoned", cordoned)
			if tc.before != nil {
				tc.before(t, g, uuid)
				first.until("the uncordon taken for the operator's", func() bool {
					return strings.Contains(logs.String(), "intruder cordon lifted by the operator")
				})
			}
			first.stop()
			if tc.between != nil {
				tc.between(t, g, uuid)
			}
			require.False(t, cordoned())

			second := runDaemon(t, h, g, nil, logs)
			defer second.stop()
			if tc.recordon {
				second.until("the lost cordon written again", cordoned)
				second.passes(1) // the pass that wrote it has audited it
				assertCordonedAgain(t, g, logs, uuid, "intruder cordon lost", "pid 200")
			} else {
				second.passes(2)
				assert.False(t, cordoned(), "the operator's uncordon sticks across the daemon's restart")
			}
			assert.Contains(t, logs.String(), "findings of the daemon before carried over")
			assert.Equal(t, 1, auditCount(t, g, OpIntruder), "one process, audited once")
			assert.Equal(t, 1, strings.Count(logs.String(), "GPU process not admitted by the guard"), "one process, logged once")
			file, err := observe.ReadFile(g.Ledger().Dir())
			require.NoError(t, err)
			if assert.Len(t, file.Findings, 1, "status still shows it") {
				assert.Equal(t, 200, file.Findings[0].PID)
			}

			// It leaves: its finding clears, once.
			h.stop(200)
			second.until("the finding cleared", func() bool { return auditCount(t, g, OpFindingCleared) > 0 })
			second.passes(1)
			assert.Equal(t, 1, auditCount(t, g, OpFindingCleared))
		})
	}
}

// Under on_intruder = "report" the daemon after reports no process the
// daemon before reported; a process it had not seen is still a new
// finding. A new daemon that cordons after one that reported (the policy
// changed with the restart) cordons the device of the process still
// running, without reporting it again, as a restarted observer does.
func TestIntruderNotReportedAgainByANewDaemon(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil) // on_intruder = "report"
	_, err := g.Reconcile(context.Background(), ledger.FrontEndNRI, nil)
	require.NoError(t, err)
	h.run(2, 200, idB)
	logs := &syncBuffer{}
	first := runDaemon(t, h, g, nil, logs)
	first.until("the intruder reported", func() bool { return auditCount(t, g, OpIntruder) >= 1 })
	first.stop()

	h.run(3, 201, idC) // started while no daemon ran
	second := runDaemon(t, h, g, nil, logs)
	second.until("the new intruder reported", func() bool { return auditCount(t, g, OpIntruder) >= 2 })
	second.passes(2)
	second.stop()
	assert.Equal(t, 2, auditCount(t, g, OpIntruder), "pid 200 is not reported again, pid 201 is")
	assert.Equal(t, 2, strings.Count(logs.String(), "GPU process not admitted by the guard"))
	assert.Contains(t, logs.String(), `"pid":201`)
	assert.False(t, cordonedIn(t, g, h.uuid(2)))

	// The policy becomes "cordon" with the next restart.
	cfg := g.Config()
	cfg.Observe.OnIntruder = config.IntruderCordon
	g2, err := (&Builder{}).Setup(context.Background(), cfg)
	require.NoError(t, err)
	third := runDaemon(t, h, g2, nil, logs)
	defer third.stop()
	third.until("the running intruders' devices cordoned", func() bool {
		return cordonedIn(t, g2, h.uuid(2)) && cordonedIn(t, g2, h.uuid(3))
	})
	third.passes(1)
	assert.Equal(t, 2, auditCount(t, g2, OpIntruder), "cordoned, not reported again")
}

// An intruder cordon the daemon could not write (ledger lock busy, ledger
// being recovered) is written by the daemon after it while the process
// runs, once, and the process is not reported again. The ledger decides
// over the record: a cordon in force there (a write that reported an error
// but committed) is not written again.
func TestIntruderCordonPendingMadeByANewDaemon(t *testing.T) {
	for _, inForce := range []bool{false, true} {
		name := "pending"
		if inForce {
			name = "pending but in force in the ledger"
		}
		t.Run(name, func(t *testing.T) {
			h := newGPUHost(t)
			g := cordonGuard(t, h)
			uuid := h.uuid(2)
			h.run(2, 200, idB)
			logs := &syncBuffer{}
			refusing := newFakeStates()
			refusing.failing = 1 << 30
			first := runDaemon(t, h, g, refusing, logs)
			first.until("the cordon retried", func() bool {
				refusing.mu.Lock()
				defer refusing.mu.Unlock()
				return refusing.attempts >= 2
			})
			first.stop()

			states := newFakeStates()
			if inForce {
				states.cordoned[uuid], states.sources[uuid] = true, ledger.CordonIntruder
			}
			second := runDaemon(t, h, g, states, logs)
			if !inForce {
				c := testwait.Receive(t, states.cordons, "the pending cordon written by the new daemon")
				assert.Equal(t, [2]string{uuid, ledger.CordonIntruder}, [2]string{c[0], c[1]})
				assert.Contains(t, c[2], "pid 200")
			}
			second.passes(2)
			second.stop()
			states.mu.Lock()
			want := 1
			if inForce {
				want = 0
			}
			assert.Equal(t, want, states.attempts, "written once, or not at all when in force")
			states.mu.Unlock()
			assert.Equal(t, 1, auditCount(t, g, OpIntruder), "not a new finding")
			assert.Equal(t, 1, strings.Count(logs.String(), "GPU process not admitted by the guard"))
		})
	}
}

// The record is of processes, not of pids, and its age does not matter:
// the daemon after carries a finding only for the same process (the same
// boot, pid and start time). A process that ended while no daemon ran is
// cleared at the first pass; a pid the kernel gave to another process is a
// new finding, reported and its device cordoned, although the operator had
// lifted the cordon of the pid's earlier process.
func TestCarriedFindingsAreOfTheSameProcesses(t *testing.T) {
	h := newGPUHost(t)
	g := cordonGuard(t, h)
	h.run(2, 200, idB)
	h.run(3, 201, idB)
	h.run(4, 202, "") // a host process
	logs := &syncBuffer{}
	first := runDaemon(t, h, g, nil, logs)
	first.until("the three devices cordoned", func() bool {
		return cordonedIn(t, g, h.uuid(2)) && cordonedIn(t, g, h.uuid(3)) && cordonedIn(t, g, h.uuid(4))
	})
	first.stop()
	for _, i := range []int{2, 3, 4} {
		operatorUncordon(t, g, h.uuid(i))
	}
	h.stop(201)
	restartPID(t, h, 202, 900)
	// Written a week ago: it still names the processes it names.
	c, err := observe.ReadCarry(g.Ledger().Dir())
	require.NoError(t, err)
	c.WrittenAt = c.WrittenAt.Add(-7 * 24 * time.Hour)
	require.NoError(t, observe.WriteCarry(g.Ledger().Dir(), *c))

	second := runDaemon(t, h, g, nil, logs)
	defer second.stop()
	second.until("the new process on pid 202 cordons GPU 4", func() bool { return cordonedIn(t, g, h.uuid(4)) })
	second.until("the findings of the ended processes cleared", func() bool { return auditCount(t, g, OpFindingCleared) == 2 })
	second.passes(1)
	assert.False(t, cordonedIn(t, g, h.uuid(2)), "pid 200 is the process the operator accepted")
	assert.False(t, cordonedIn(t, g, h.uuid(3)))
	assert.Equal(t, 4, auditCount(t, g, OpIntruder), "three by the first daemon, the new process on pid 202 by the second")
	assert.Equal(t, 2, auditCount(t, g, OpFindingCleared), "pid 201, and pid 202's earlier process")
	assert.Equal(t, 4, strings.Count(logs.String(), "GPU process not admitted by the guard"))
}

// A record that cannot be trusted carries nothing, with a log line that
// says why, and never leaves a process unreported or a device uncordoned
// on its word: the process still running is a new finding (reported,
// audited, its device cordoned although the operator had lifted the
// cordon), as before there was a record, and the next pass writes a
// record that can be read.
func TestCarryFileNotTrustedCarriesNothing(t *testing.T) {
	for _, tc := range []struct {
		name  string
		spoil func(t *testing.T, path string)
		log   string
	}{
		{name: "missing", log: "no findings of an earlier daemon to carry over",
			spoil: func(t *testing.T, path string) { require.NoError(t, os.Remove(path)) }},
		{name: "corrupt", log: "the findings of the daemon before cannot be read",
			spoil: func(t *testing.T, path string) {
				require.NoError(t, os.WriteFile(path, []byte(`{"format": 1, "find`), 0o600))
			}},
		{name: "another format", log: "the findings of the daemon before cannot be read",
			spoil: func(t *testing.T, path string) {
				require.NoError(t, os.WriteFile(path, []byte(`{"format": 99, "findings": []}`), 0o600))
			}},
		{name: "a symlink", log: "the findings of the daemon before cannot be read",
			spoil: func(t *testing.T, path string) {
				other := filepath.Join(t.TempDir(), "carry.json")
				data, err := os.ReadFile(path)
				require.NoError(t, err)
				require.NoError(t, os.WriteFile(other, data, 0o600))
				require.NoError(t, os.Remove(path))
				require.NoError(t, os.Symlink(other, path))
			}},
		{name: "an earlier boot", log: "the findings of the daemon before were seen in an earlier boot",
			spoil: func(t *testing.T, path string) {
				c, err := observe.ReadCarry(filepath.Dir(path))
				require.NoError(t, err)
				c.BootID = "an-earlier-boot"
				require.NoError(t, observe.WriteCarry(filepath.Dir(path), *c))
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newGPUHost(t)
			g := cordonGuard(t, h)
			uuid := h.uuid(2)
			h.run(2, 200, idB)
			logs := &syncBuffer{}
			first := runDaemon(t, h, g, nil, logs)
			first.until("the intruder's device cordoned", func() bool { return cordonedIn(t, g, uuid) })
			first.stop()
			operatorUncordon(t, g, uuid)
			path := filepath.Join(g.Ledger().Dir(), observe.CarryFileName)
			tc.spoil(t, path)

			second := runDaemon(t, h, g, nil, logs)
			defer second.stop()
			second.until("the device cordoned again, for a new finding", func() bool { return cordonedIn(t, g, uuid) })
			second.passes(1)
			assert.Contains(t, logs.String(), tc.log)
			assert.NotContains(t, logs.String(), "findings of the daemon before carried over")
			assert.Equal(t, 2, auditCount(t, g, OpIntruder), "judged afresh")
			c, err := observe.ReadCarry(g.Ledger().Dir())
			require.NoError(t, err, "rewritten at the first pass")
			require.Len(t, c.Findings, 1)
			assert.Equal(t, 200, c.Findings[0].PID)
			assert.EqualValues(t, 500, c.Findings[0].StartTicks)
			assert.Equal(t, g.Ledger().BootID(), c.BootID)
		})
	}
}

// discoveringGuard is the guard Builder.Setup answers with while the GPU
// discovery still runs: g's configuration and ledger over an inventory that
// knows no GPU yet.
func discoveringGuard(t *testing.T, g *guard.Guard) *guard.Guard {
	t.Helper()
	pending, err := devices.NewUndiscovered("discovery in progress", "")
	require.NoError(t, err)
	pending.Provisional = true
	gd, err := guard.New(guard.Options{Config: g.Config(), Inventory: pending, Ledger: g.Ledger(), Discovering: true})
	require.NoError(t, err)
	return gd
}

// A daemon whose first guard knows no GPU yet (Setup answered while the
// discovery still ran, as on a host without persistence mode) starts no
// observer over it: one would watch nothing, and its start dropped what
// the daemon before carried, which only listed devices keep. Once the
// discovered inventory is handed on, the carried findings hold: the
// operator's uncordon sticks, and the process is audited and logged once.
func TestCarriedFindingsWaitForTheDiscovery(t *testing.T) {
	h := newGPUHost(t)
	g := cordonGuard(t, h)
	uuid := h.uuid(2)
	cordoned := func() bool { t.Helper(); return cordonedIn(t, g, uuid) }
	h.run(2, 200, idB)
	logs := &syncBuffer{}

	first := runDaemon(t, h, g, nil, logs)
	first.until("the intruder's device cordoned", cordoned)
	operatorUncordon(t, g, uuid)
	first.until("the uncordon taken for the operator's", func() bool {
		return strings.Contains(logs.String(), "intruder cordon lifted by the operator")
	})
	first.stop()
	require.False(t, cordoned())

	gd := discoveringGuard(t, g)
	taken := make(chan struct{}, 4)
	w, reports, stop := runWatch(t, h, gd, nil, func(w *Watch) {
		w.States = nil
		w.Logger = slog.New(slog.NewJSONHandler(logs, nil))
		w.guardTaken = func() { taken <- struct{}{} }
	})
	second := &daemon{t: t, w: w, reports: reports, stop: stop}
	defer second.stop()
	testwait.Receive(t, taken, "the first guard taken")
	assert.Contains(t, logs.String(), "waiting for the GPU discovery")
	assert.Equal(t, 1, strings.Count(logs.String(), "GPU observer running"), "no observer over no GPU")

	// The discovery lands: its inventory swapped in, the guard handed on.
	require.NoError(t, gd.SetInventory(g.Inventory()))
	second.w.Use(gd)
	testwait.Receive(t, taken, "the discovered guard taken")
	second.passes(2)
	assert.Contains(t, logs.String(), "findings of the daemon before carried over")
	assert.False(t, cordoned(), "the operator's uncordon sticks across the daemon's restart")
	assert.Equal(t, 1, auditCount(t, g, OpIntruder), "one process, audited once")
	assert.Equal(t, 1, strings.Count(logs.String(), "GPU process not admitted by the guard"), "one process, logged once")
}

// Within one daemon, a guard that knows no GPU yet (a reconnect whose
// Setup, for another [devices] section, answered before its discovery)
// leaves the running observer as it is: an unhealthy device whose cordon
// could not be written yet is not forgotten, and is cordoned at a later
// pass (NVML reports the Xid once; forgotten, the broken GPU would take new
// claims).
func TestPendingUnhealthyCordonWaitsForTheDiscovery(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	states := newFakeStates()
	states.failing = 1 << 30 // every cordon fails until the guard is handed on
	taken := make(chan struct{}, 4)
	w, _, stop := runWatch(t, h, g, states, func(w *Watch) { w.guardTaken = func() { taken <- struct{}{} } })
	defer stop()
	testwait.Receive(t, taken, "the first guard taken")
	w.onUnhealthy(context.Background(), observe.Finding{Kind: observe.KindUnhealthy, Xid: 79,
		Message: "GPU 5 reported critical Xid 79", Device: observe.Device{UUID: h.uuid(5), Index: "5"}})

	gd := discoveringGuard(t, g)
	w.Use(gd)
	testwait.Receive(t, taken, "the guard without GPUs taken")
	states.mu.Lock()
	states.failing = 0 // the ledger takes cordons again
	states.mu.Unlock()
	c := testwait.Receive(t, states.cordons, "the pending unhealthy cordon")
	assert.Equal(t, h.uuid(5), c[0])
	assert.Equal(t, "unhealthy", c[1])
}

// The cordon that keeps an intruder's device out of claims is the
// device's cordon, whatever its source: an operator who cordons the device
// (maintenance) replaces the observer's cordon in the ledger, and their
// uncordon is their decision about the finding, for the daemon after as for
// the daemon that saw it. The daemon after counted only a cordon from the
// intruder source as in force: it judged the device by the lineage the
// daemon before had last seen the cordon in, and after a reset while no
// daemon ran (which keeps an operator's cordon) took the operator's
// uncordon, made before its first pass, for a cordon lost with the state
// and cordoned the device again.
func TestOperatorCordonOverAnIntruderCordonAcrossADaemonRestart(t *testing.T) {
	h := newGPUHost(t)
	g := cordonGuard(t, h)
	uuid := h.uuid(2)
	h.run(2, 200, idB) // no claim
	logs := &syncBuffer{}

	first := runDaemon(t, h, g, nil, logs)
	first.until("the intruder's device cordoned", func() bool { return cordonedIn(t, g, uuid) })
	_, _, err := g.Cordon(context.Background(), uuid, ledger.CordonOperator, "RMA pending", "operator")
	require.NoError(t, err)
	first.passes(1) // sees a cordon in force on the device
	first.stop()
	resetLedger(t, g) // while no daemon runs: the operator's cordon is kept, in a new lineage
	require.Equal(t, ledger.CordonOperator, cordonOn(t, g, uuid).Source)

	// The daemon after reads the ledger when it starts, and judges its
	// first pass only once synchronized with the runtime: the operator
	// lifts the cordon in between.
	taken := make(chan struct{}, 4)
	second := runDaemon(t, h, g, nil, logs, func(w *Watch) {
		w.SetReady(false)
		w.guardTaken = func() { taken <- struct{}{} }
	})
	defer second.stop()
	testwait.Receive(t, taken, "the guard taken, the daemon before's findings read")
	operatorUncordon(t, g, uuid)
	second.w.SetReady(true)
	second.passes(2)
	assert.False(t, cordonedIn(t, g, uuid), "the operator's uncordon sticks")
	assert.NotContains(t, logs.String(), "intruder cordon lost")
	assert.Contains(t, logs.String(), "intruder cordon lifted by the operator")
	assert.Equal(t, 1, auditCount(t, g, OpIntruder), "one process, audited once")
}

// cordonOn is the cordon on uuid in g's ledger (the zero Cordon if none).
func cordonOn(t *testing.T, g *guard.Guard, uuid string) ledger.Cordon {
	t.Helper()
	st, err := g.Ledger().Snapshot(context.Background())
	require.NoError(t, err)
	for _, k := range st.Cordons {
		if k.Device.UUID == uuid {
			return k
		}
	}
	return ledger.Cordon{}
}

// The daemon after judges the cordons the daemon before watched or still
// had to write as every pass does (judgeCordons): a cordon on the device,
// whatever its source, is in force in the lineage read now, and a pending
// cordon in force needs no retry. A device on which the daemon before
// watched no cordon (the operator had lifted it) is not judged: the cordon
// on it now is not the observer's, which would otherwise write it again,
// as an intruder's, should the ledger lose it.
func TestPriorCordonsJudgedAsAtEveryPass(t *testing.T) {
	const old, now = "LINEAGE-SEEN", "LINEAGE-NOW"
	type tc struct {
		name string
		// watched: the file's lineage for the device; pending: its
		// cordon still to write; inForce: the source of the cordon the
		// ledger holds on it ("" none).
		watched, pending bool
		inForce          string
		// wantLineage: the lineage the new daemon watches the cordon in
		// ("" none); wantRetry: whether it writes it at its first pass.
		wantLineage string
		wantRetry   bool
	}
	cases := []tc{
		{name: "watched, the observer's in force", watched: true, inForce: ledger.CordonIntruder, wantLineage: now},
		{name: "watched, replaced by an operator's", watched: true, inForce: ledger.CordonOperator, wantLineage: now},
		{name: "watched, replaced by an unhealthy one", watched: true, inForce: ledger.CordonUnhealthy, wantLineage: now},
		{name: "watched, missing (the first pass judges it)", watched: true, wantLineage: old},
		{name: "pending, committed", pending: true, inForce: ledger.CordonIntruder, wantLineage: now},
		{name: "pending, the device cordoned by an operator", pending: true, inForce: ledger.CordonOperator, wantLineage: now},
		{name: "pending, missing", pending: true, wantRetry: true},
		{name: "lifted, an intruder cordon on it", inForce: ledger.CordonIntruder},
		{name: "lifted, an unhealthy cordon on it", inForce: ledger.CordonUnhealthy},
		{name: "lifted, an operator's cordon on it", inForce: ledger.CordonOperator},
	}
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	uuid := h.uuid(2)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			c := observe.Carry{BootID: g.Ledger().BootID(), Cordons: true, Findings: []observe.FileFinding{{Finding: observe.Finding{
				Kind: observe.KindIntruder, PID: 200, StartTicks: 4242, Device: observe.Device{UUID: uuid, Index: "2"}}}}}
			if tc.watched {
				c.CordonLineages = map[string]string{uuid: old}
			}
			if tc.pending {
				c.CordonRetries = []string{uuid}
			}
			require.NoError(t, observe.WriteCarry(dir, c))
			var cordons []ledger.Cordon
			if tc.inForce != "" {
				cordons = []ledger.Cordon{{Device: devices.Device{UUID: uuid, Index: "2"}, Source: tc.inForce}}
			}

			p := watchOver(g, nil).readPrior(dir, true, cordons, now, true)
			require.NotNil(t, p)
			assert.Len(t, p.reported, 1)
			lineage, watched := p.lineages[uuid]
			assert.Equal(t, tc.wantLineage != "", watched, "watched")
			assert.Equal(t, tc.wantLineage, lineage)
			_, retry := p.retry[uuid]
			assert.Equal(t, tc.wantRetry, retry, "written at the first pass")
		})
	}
}

// A daemon that dies between a pass's cordon writes and its carry file
// leaves the daemon after neither a finding to report again nor a cordon
// to lose: the file names the pass's findings, and the cordons it is about
// to write as pending, before they are written. The daemon after writes a
// pending cordon the ledger does not show, does not write again one it
// shows, and watches both (the operator's uncordon sticks). The file used
// to be written only after the cordons: the daemon after took the process
// for a new finding, logged, audited and cordoned again.
func TestDaemonDiesBetweenItsCordonAndItsCarryFile(t *testing.T) {
	for _, tc := range []struct {
		point string
		// written: the cordon is in the ledger when the daemon dies.
		written bool
	}{
		{point: "intruder cordons pending"},
		{point: "intruder cordons written", written: true},
	} {
		t.Run(tc.point, func(t *testing.T) {
			h := newGPUHost(t)
			g := cordonGuard(t, h)
			uuid := h.uuid(2)
			cordoned := func() bool { t.Helper(); return cordonedIn(t, g, uuid) }
			h.run(2, 200, idB) // no claim
			logs := &syncBuffer{}

			died := make(chan struct{})
			var dead atomic.Bool
			first := runDaemon(t, h, g, nil, logs, func(w *Watch) {
				w.crashAt = func(point string) bool {
					if point == tc.point && dead.CompareAndSwap(false, true) {
						w.SetReady(false) // no later pass writes anything either
						close(died)
					}
					return dead.Load()
				}
			})
			testwait.Receive(t, died, "the daemon dead at "+tc.point)
			first.stop()
			require.Equal(t, tc.written, cordoned())
			require.Equal(t, 1, auditCount(t, g, OpIntruder))

			second := runDaemon(t, h, g, nil, logs)
			defer second.stop()
			second.until("the device cordoned", cordoned)
			second.passes(2)
			assert.Equal(t, 1, auditCount(t, g, OpIntruder), "one process, audited once")
			assert.Equal(t, 1, strings.Count(logs.String(), "GPU process not admitted by the guard"), "one process, logged once")
			assert.Equal(t, 1, auditCount(t, g, ledger.OpCordon), "cordoned once")
			assert.NotContains(t, cordonOn(t, g, uuid).Reason, "cordoned again")

			operatorUncordon(t, g, uuid)
			second.passes(2)
			assert.False(t, cordoned(), "the operator's uncordon sticks")
			assert.Contains(t, logs.String(), "intruder cordon lifted by the operator")
		})
	}
}

// A pass under on_intruder = "cordon" writes the carry file before its
// cordon writes only when a cordon is pending (a new finding's, or a
// retry's), and always after them. Before, every pass, with nothing to
// cordon, built and wrote it before as well. The writes are counted by
// making them fail: each failed write is logged, and a failed write is
// tried again at the next call.
func TestCarryFileWrittenBeforeCordonsOnlyWhenOneIsPending(t *testing.T) {
	h := newGPUHost(t)
	g := cordonGuard(t, h)
	require.NoError(t, os.Mkdir(filepath.Join(g.Ledger().Dir(), observe.CarryFileName), 0o700))
	logs := &syncBuffer{}
	w := watchOver(g, logs)
	tries := func() int { return strings.Count(logs.String(), "findings not recorded for the next daemon") }
	pass := func(r observe.Report) { r.Time = time.Now(); w.onReport(context.Background(), g.Config(), r) }
	dev := observe.Device{UUID: h.uuid(2), Index: "2"}
	clean := observe.Report{Devices: []observe.DeviceReport{{Device: dev}}}
	intruder := observe.Report{Devices: []observe.DeviceReport{{Device: dev}}, Findings: []observe.Finding{{
		Kind: observe.KindIntruder, Device: dev, PID: 200, StartTicks: 7, ContainerID: idB,
		Message: "pid 200 runs on GPU 2 without a claim"}}}

	pass(clean)
	assert.Equal(t, 1, tries(), "nothing to cordon: written after the pass only")
	pass(intruder)
	assert.Equal(t, 3, tries(), "a cordon to write: before it and after")
	require.True(t, cordonedIn(t, g, dev.UUID))
	pass(intruder)
	assert.Equal(t, 4, tries(), "the cordon in force, nothing pending: after only")
}
