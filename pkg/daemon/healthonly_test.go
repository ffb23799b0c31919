// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package daemon

import (
	"context"
	"errors"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// settleTimer is Watch.After under the test's control: each wait asked
// for is reported on waits (never blocking the watch), and every wait ends
// when the test sends on fire (tick). settled gets a value after each
// settling (Watch.settled).
type settleTimer struct {
	waits   chan time.Duration
	fire    chan time.Time
	settled chan struct{}
}

func newSettleTimer() *settleTimer {
	return &settleTimer{waits: make(chan time.Duration, 64), fire: make(chan time.Time), settled: make(chan struct{}, 64)}
}

func (s *settleTimer) after(d time.Duration) <-chan time.Time {
	select {
	case s.waits <- d:
	default:
	}
	return s.fire
}

func (s *settleTimer) settle() {
	select {
	case s.settled <- struct{}{}:
	default:
	}
}

// tick ends the watch's wait before its next settling of its unhealthy
// devices, once it waits (the latest wait asked for is the one it waits
// on), and returns when that settling is done, with how long the wait
// would have been. The watch asks for its wait after the settling before
// it, so every value on settled is then of an earlier one.
func (s *settleTimer) tick(t *testing.T) time.Duration {
	t.Helper()
	d := testwait.Receive(t, s.waits, "the watch's wait before it settles its unhealthy devices again")
	for more := true; more; {
		select {
		case d = <-s.waits:
		case <-s.settled:
		default:
			more = false
		}
	}
	s.fire <- time.Time{}
	testwait.Receive(t, s.settled, "the settling after the wait")
	return d
}

// failingStates are device states whose next failing cordon writes fail.
type failingStates struct {
	DeviceStates
	mu      *sync.Mutex
	failing *int
}

func (s failingStates) CordonDevice(ctx context.Context, uuid, source, reason string) (ledger.Cordon, bool, error) {
	s.mu.Lock()
	fail := *s.failing > 0
	if fail {
		*s.failing--
	}
	s.mu.Unlock()
	if fail {
		return ledger.Cordon{}, false, errors.New("ledger lock busy")
	}
	return s.DeviceStates.CordonDevice(ctx, uuid, source, reason)
}

// A daemon whose observer does not account ([observe] interval = "0s")
// takes over the carry file of the daemon before it, which died after
// recording GPU 3 unhealthy (Xid 79) and before writing its cordon: it
// writes that cordon at once. It used to adopt the pending cordon for a
// retry that only an accounting pass runs: GPU 3 was listed unhealthy
// (observe.json, the gauge) but left uncordoned, and took new claims.
func TestUnhealthyCordonPendingWrittenByAHealthOnlyDaemon(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	uuid := h.uuid(3)
	f := observe.Finding{Kind: observe.KindUnhealthy, Xid: 79, Message: "GPU 3 reported critical Xid 79",
		Device: observe.Device{UUID: uuid, Index: "3"}, Time: time.Now()}
	// What onUnhealthy's first write leaves when the daemon dies before its
	// cordon.
	before := watchOver(g, nil)
	before.mu.Lock()
	before.carryTaken = true
	before.unhealthy = append(before.unhealthy, f)
	before.mu.Unlock()
	before.writeUnhealthyCarry(map[string]string{uuid: f.Message})
	require.False(t, cordonedIn(t, g, uuid))

	w, _, cordoned, _, stop := healthOnlyDaemon(t, h, g)
	defer stop()
	t.Cleanup(func() {
		if t.Failed() {
			w.mu.Lock()
			defer w.mu.Unlock()
			t.Logf("unhealthy listed: %v, cordonFailed: %v, cordoned: %t", unhealthyUUIDs(w.unhealthy), w.cordonFailed, cordonedIn(t, g, uuid))
		}
	})
	assert.Equal(t, uuid, testwait.Receive(t, cordoned, "the pending cordon of GPU 3"))
	k := cordonOn(t, g, uuid)
	assert.Equal(t, ledger.CordonUnhealthy, k.Source)
	assert.Equal(t, f.Message, k.Reason)
	stop()
	c, err := observe.ReadCarry(g.Ledger().Dir())
	require.NoError(t, err)
	require.Len(t, c.Unhealthy, 1)
	assert.Empty(t, c.Unhealthy[0].CordonRetry, "written: no longer pending")
	assert.NotNil(t, c.Unhealthy[0].CordonLineage)
}

// With accounting off, an unhealthy GPU whose cordon could not be written
// (ledger lock busy) is cordoned at a retry, after a back-off: nothing
// else would, as no accounting pass runs. It used to stay uncordoned, and
// take new claims, until the daemon's restart.
func TestUnhealthyCordonRetriedWithAccountingOff(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	uuid := h.uuid(5)
	var mu sync.Mutex
	failing := 2
	w, _, cordoned, timer, stop := healthOnlyDaemonWith(t, h, g, func(s DeviceStates) DeviceStates {
		return failingStates{DeviceStates: s, mu: &mu, failing: &failing}
	})
	defer stop()
	h.events <- xidEvent(h, 5)
	assert.Equal(t, uuid, testwait.Receive(t, cordoned, "the health watcher's cordon of GPU 5"), "asked for")
	require.False(t, cordonedIn(t, g, uuid), "the first write fails")

	first := timer.tick(t) // the retry fails again
	assert.Equal(t, uuid, testwait.Receive(t, cordoned, "the first retry"))
	require.False(t, cordonedIn(t, g, uuid))
	second := timer.tick(t)
	assert.Equal(t, uuid, testwait.Receive(t, cordoned, "the second retry"))
	assert.Equal(t, ledger.CordonUnhealthy, cordonOn(t, g, uuid).Source, "cordoned at last")
	assert.Less(t, first, second, "retried with back-off")
	w.mu.Lock()
	assert.Empty(t, w.cordonFailed, "nothing left to retry")
	w.mu.Unlock()
}

// With accounting off, an unhealthy GPU's cordon is still watched: one the
// ledger lost with its state (a reset) is written again, and one the
// operator lifted forgets the device, whose next critical Xid cordons it
// again. Neither happened without an accounting pass: the lost cordon left
// the failing GPU taking new claims, and after an uncordon the observer
// still held the GPU unhealthy, so its next Xid was taken for the one
// already reported and cordoned nothing.
func TestUnhealthyCordonKeptWithAccountingOff(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	// A lineage before the first cordon (see
	// TestIntruderCordonKeptWhileReportedUntilOperatorUncordons).
	_, err := g.Reconcile(context.Background(), ledger.FrontEndNRI, nil)
	require.NoError(t, err)
	uuid := h.uuid(3)
	w, m, cordoned, timer, stop := healthOnlyDaemon(t, h, g)
	defer stop()
	h.events <- xidEvent(h, 3)
	assert.Equal(t, uuid, testwait.Receive(t, cordoned, "the health watcher's cordon of GPU 3"))
	require.True(t, cordonedIn(t, g, uuid))

	resetLedger(t, g)
	require.False(t, cordonedIn(t, g, uuid))
	timer.tick(t)
	assert.Equal(t, uuid, testwait.Receive(t, cordoned, "the cordon written again"))
	k := cordonOn(t, g, uuid)
	assert.Equal(t, ledger.CordonUnhealthy, k.Source)
	assert.Contains(t, k.Reason, "cordoned again (the ledger was started afresh")

	operatorUncordon(t, g, uuid)
	timer.tick(t)
	w.mu.Lock()
	assert.Empty(t, w.unhealthy, "forgotten after the operator's uncordon")
	w.mu.Unlock()
	assert.Empty(t, gaugeByIndex(t, m, "nri_gpu_guard_unhealthy"), "no longer shown unhealthy")
	assert.False(t, cordonedIn(t, g, uuid), "the operator's uncordon stands")
	h.events <- xidEvent(h, 3) // it fails again
	assert.Equal(t, uuid, testwait.Receive(t, cordoned, "the cordon of GPU 3's next Xid"))
	assert.Equal(t, ledger.CordonUnhealthy, cordonOn(t, g, uuid).Source)
}

// A daemon whose observer does not account adopts the unhealthy cordons in
// force in the ledger that it does not carry (the carry file of an older
// daemon names no unhealthy device, or is missing), as one that accounts
// does: it lists the device, and cordons it again once the ledger loses
// the cordon. It used to leave them alone, as nothing settled them with
// accounting off: lost with the state, the cordon of a failing GPU was
// not written again before its next critical Xid.
func TestUnhealthyCordonInTheLedgerAdoptedWithAccountingOff(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	ctx := context.Background()
	uuid := h.uuid(3)
	before := watchOver(g, nil)
	before.onUnhealthy(ctx, observe.Finding{Kind: observe.KindUnhealthy, Xid: 79, Message: "GPU 3 reported critical Xid 79",
		Device: observe.Device{UUID: uuid, Index: "3"}})
	require.True(t, cordonedIn(t, g, uuid))
	require.NoFileExists(t, filepath.Join(g.Ledger().Dir(), observe.CarryFileName), "no carry file: the ledger alone says it")

	w, m, cordoned, timer, stop := healthOnlyDaemon(t, h, g)
	defer stop()
	w.mu.Lock()
	assert.Equal(t, []string{uuid}, unhealthyUUIDs(w.unhealthy), "adopted from the ledger")
	w.mu.Unlock()
	assert.Equal(t, map[string]float64{"3": 1}, gaugeByIndex(t, m, "nri_gpu_guard_unhealthy"))

	resetLedger(t, g)
	timer.tick(t)
	assert.Equal(t, uuid, testwait.Receive(t, cordoned, "the cordon written again"))
	k := cordonOn(t, g, uuid)
	assert.Equal(t, ledger.CordonUnhealthy, k.Source)
	assert.Equal(t, recordonReason+"GPU 3 reported critical Xid 79", k.Reason)
}
