// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package daemon

import (
	"context"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// rexidSetup is a daemon whose observer watches health only (no
// accounting pass, no settleLoop: the test settles), over a host whose
// GPU 3 reported a critical Xid and was cordoned. Each device the observer
// reports is sent on reported before the daemon takes it (onUnhealthy
// waits for a settling in progress), and on taken after.
func rexidSetup(t *testing.T) (h *gpuHost, g *guard.Guard, w *Watch, o *observe.Observer, reported, taken chan string) {
	h = newGPUHost(t)
	g = guardFor(t, h, nil)
	_, err := g.Reconcile(context.Background(), ledger.FrontEndNRI, nil)
	require.NoError(t, err)
	w = watchOver(g, nil)
	w.ProcRoot = h.proc
	ctx, cancel := context.WithCancel(context.Background())
	src, err := observe.OpenNVML(h.srv)
	require.NoError(t, err)
	reported, taken = make(chan string, 8), make(chan string, 8)
	o, err = observe.New(observe.Options{Source: src, GPUs: g.Inventory().GPUs, ProcRoot: h.proc, Xids: g.Config().Observe.Xids,
		Ledger: observe.EpochLedgerFunc(func() ([]observe.Holding, uint64, error) { return w.holdingsAt(ctx) }),
		OnUnhealthy: func(f observe.Finding) {
			reported <- f.Device.UUID
			w.onUnhealthy(ctx, f)
			taken <- f.Device.UUID
		}})
	require.NoError(t, err)
	done := make(chan struct{})
	go func() { o.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done; _ = src.Close() })
	h.events <- xidEvent(h, 3)
	require.Equal(t, h.uuid(3), testwait.Receive(t, reported, "GPU 3's report"))
	require.Equal(t, h.uuid(3), testwait.Receive(t, taken, "GPU 3's cordon"))
	w.settleUnhealthy(context.Background(), o) // sees the cordon in force
	require.True(t, cordonedIn(t, g, h.uuid(3)), "GPU 3 cordoned for its Xid")
	return h, g, w, o, reported, taken
}

// xidAgainOn3 is GPU 3 failing again (a new critical Xid), and returns once
// the observer has taken it: its watcher handles events in order, and GPU
// 5's Xid, sent after, is reported.
func xidAgainOn3(t *testing.T, h *gpuHost, reported <-chan string) {
	h.events <- xidEvent(h, 3)
	h.events <- xidEvent(h, 5)
	require.Equal(t, h.uuid(5), testwait.Receive(t, reported, "GPU 5's report, after GPU 3's new Xid"))
}

func listedUnhealthy(w *Watch, uuid string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.ContainsFunc(w.unhealthy, func(f observe.Finding) bool { return f.Device.UUID == uuid })
}

// The operator uncordons GPU 3, still broken, and it reports a new
// critical Xid before the next settling. The observer used to take it for
// the one already reported (nothing reported, nothing logged), and the
// settling then found the cordon lifted and forgot GPU 3: uncordoned, not
// listed unhealthy, open to claims. It is cordoned again instead, as a new
// finding; an uncordon after that, with no Xid since, forgets it.
func TestXidAgainAfterUncordonCordonsAgain(t *testing.T) {
	h, g, w, o, reported, taken := rexidSetup(t)
	uuid := h.uuid(3)
	operatorUncordon(t, g, uuid)
	xidAgainOn3(t, h, reported)
	require.Equal(t, h.uuid(5), testwait.Receive(t, taken, "GPU 5's cordon"))
	w.settleUnhealthy(context.Background(), o)
	assert.True(t, cordonedIn(t, g, uuid), "GPU 3 failed after the uncordon: cordoned again")
	assert.True(t, listedUnhealthy(w, uuid), "GPU 3 still listed unhealthy")
	_, unhealthy := o.Health(uuid)
	assert.True(t, unhealthy, "the observer still holds GPU 3 unhealthy")

	// Repaired: the operator uncordons it again; no Xid since, so the
	// settling forgets it, and its next Xid is reported anew.
	w.settleUnhealthy(context.Background(), o) // sees the new cordon in force
	operatorUncordon(t, g, uuid)
	w.settleUnhealthy(context.Background(), o)
	assert.False(t, cordonedIn(t, g, uuid), "uncordoned with no new Xid: stays uncordoned")
	assert.False(t, listedUnhealthy(w, uuid), "forgotten")
	h.events <- xidEvent(h, 3)
	require.Equal(t, uuid, testwait.Receive(t, reported, "GPU 3's next Xid, reported anew"))
	require.Equal(t, uuid, testwait.Receive(t, taken, "GPU 3's new cordon"))
	w.settleUnhealthy(context.Background(), o)
	assert.True(t, cordonedIn(t, g, uuid), "its next Xid cordons it")
}

// xidInsideForget is the observer with GPU 3 failing again inside the
// settling, after it read the ledger (the cordon lifted) and just before
// it forgets the device.
type xidInsideForget struct {
	*observe.Observer
	inject func()
}

func (k xidInsideForget) ForgetHealth(uuid string, seen uint64) (observe.Finding, uint64, bool) {
	k.inject()
	return k.Observer.ForgetHealth(uuid, seen)
}

// The narrower variant: the settling finds GPU 3's cordon lifted, then GPU
// 3 reports a new critical Xid before the settling forgets it. The Xid
// used to be taken for the one already reported and then forgotten with
// the device; the check and the forgetting are one step, so it is cordoned
// again.
func TestXidAgainInsideForgetCordonsAgain(t *testing.T) {
	h, g, w, o, reported, _ := rexidSetup(t)
	uuid := h.uuid(3)
	operatorUncordon(t, g, uuid)
	injected := 0
	w.settleUnhealthy(context.Background(), xidInsideForget{Observer: o, inject: func() {
		injected++
		xidAgainOn3(t, h, reported)
	}})
	require.Equal(t, 1, injected, "the settling found the cordon lifted and went to forget GPU 3")
	assert.True(t, cordonedIn(t, g, uuid), "GPU 3 failed again before it was forgotten: cordoned again")
	assert.True(t, listedUnhealthy(w, uuid), "GPU 3 still listed unhealthy")
}
