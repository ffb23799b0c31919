// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"bytes"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// newStateEnv is newEnv with the ledger opened as every process opens it
// (guard.LedgerOptions: the drain grace included) and the logs kept.
func newStateEnv(t *testing.T, mutate func(*config.Config)) (*env, *bytes.Buffer) {
	t.Helper()
	cfg := config.Default()
	cfg.Ledger.Dir = filepath.Join(t.TempDir(), "state")
	cfg.Hook.RuntimeRoots = testRuntimeRoots(t)
	if mutate != nil {
		mutate(&cfg)
	}
	e := &env{t: t, cfg: cfg,
		clock: &clock{now: time.Date(2026, 5, 9, 8, 0, 0, 0, time.UTC)},
		live:  &liveness{exited: map[string]bool{}},
		obs:   &observer{released: map[string]int{}},
	}
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	opts := guard.LedgerOptions(cfg)
	opts.Now, opts.BootID, opts.Logger = e.clock.Now, "boot-1", log
	l, err := ledger.Open(cfg.Ledger.Dir, opts)
	require.NoError(t, err)
	e.l = l
	e.g, err = guard.New(guard.Options{Config: cfg, Inventory: inventory(t), Ledger: l,
		Liveness: e.live, Now: e.clock.Now, Observer: e.obs, Logger: log})
	require.NoError(t, err)
	return e, &logs
}

func (e *env) admitVia(fe ledger.FrontEnd, o ledger.Owner, spec devices.Request) guard.Decision {
	e.t.Helper()
	o.FrontEnd = fe
	d, err := e.g.Admit(ctx, guard.Request{FrontEnd: fe, Owner: o, Spec: spec})
	require.NoError(e.t, err)
	return d
}

func auditOf(t *testing.T, l *ledger.Ledger) []ledger.AuditRecord {
	t.Helper()
	recs, err := ledger.ReadAudit(l.AuditPath())
	require.NoError(t, err)
	return recs
}

// A request that wants a cordoned device is refused, not queued, by both
// front ends and by explain, whichever way the GPU/MIG relation runs; the
// message names the device, the cordon and what to do.
func TestCordonRefusesRequests(t *testing.T) {
	for _, tc := range []struct {
		name    string
		cordon  string // UUID
		ask     string // NVIDIA_VISIBLE_DEVICES
		refused bool
		through bool // the cordon is on the GPU of a MIG instance asked for, or the reverse
	}{
		{name: "gpu", cordon: uuid(1), ask: "1", refused: true},
		{name: "gpu cordon covers its mig", cordon: uuid(3), ask: "3:0", refused: true, through: true},
		{name: "mig cordon blocks its gpu", cordon: migUUID(1), ask: "3", refused: true, through: true},
		{name: "sibling mig is not blocked", cordon: migUUID(1), ask: "3:0"},
		{name: "other gpu is not blocked", cordon: uuid(1), ask: "2"},
	} {
		for _, fe := range []ledger.FrontEnd{ledger.FrontEndNRI, ledger.FrontEndHook} {
			t.Run(tc.name+"/"+string(fe), func(t *testing.T) {
				e, _ := newStateEnv(t, nil) // on_conflict = "queue"
				require.NoError(t, e.g.CordonDevice(ctx, tc.cordon, ledger.CordonOperator, "reseating the riser"))
				req := ctr("ml", "b", "main", "req0000000000001")

				x, err := e.g.Explain(ctx, guard.Request{FrontEnd: fe, Owner: req, Spec: visible(tc.ask)})
				require.NoError(t, err)
				d := e.admitVia(fe, req, visible(tc.ask))
				assert.Equal(t, d.Result, x.Result, "explain gives the decision Admit gives")
				if !tc.refused {
					require.Equal(t, guard.Admit, d.Result, d.Message)
					return
				}
				require.Equal(t, guard.Reject, d.Result, "refused outright, not queued")
				assert.Equal(t, guard.ReasonCordoned, d.Reason)
				assert.True(t, d.Audited, "the cordon refusal records itself")
				assert.Equal(t, guard.ReasonCordoned, x.Reason)
				assert.ErrorIs(t, d.Err(), guard.ErrRejected)
				assert.Empty(t, e.holders(), "nothing claimed")
				assert.Empty(t, e.waiters(), "nothing queued")
				for _, s := range []string{tc.cordon, "cordoned", "by an operator", "reseating the riser",
					"2026-05-09T08:00:00Z", "sudo gpu-guard-ctl uncordon"} {
					assert.Contains(t, d.Message, s)
				}
				assert.Equal(t, tc.through, strings.Contains(d.Message, " through "), d.Message)
				assert.Equal(t, x.Message, d.Message)

				var refusal *ledger.AuditRecord
				for _, r := range auditOf(t, e.l) {
					if r.Op == guard.AuditRefuse {
						refusal = &r
					}
				}
				require.NotNil(t, refusal, "the refusal is audited")
				assert.Equal(t, req.ContainerID, refusal.ContainerID)
				assert.True(t, strings.HasPrefix(refusal.Reason, guard.AuditRefuseCordoned), refusal.Reason)
			})
		}
	}
}

// The holder of a device keeps its claim through a cordon, a waiter queued
// before it keeps its place but never gets the device while it lasts, and
// the next request after uncordon is decided as usual.
func TestCordonKeepsHolderAndQueue(t *testing.T) {
	e, _ := newStateEnv(t, nil)
	holder := ctr("ml", "a", "main", "holder0000000001")
	w := ctr("ml", "w", "main", "waiter0000000001")
	require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
	require.Equal(t, guard.Queue, e.admit(w, visible("1")).Result)

	require.NoError(t, e.g.CordonDevice(ctx, uuid(1), ledger.CordonUnhealthy, "Xid 79: fallen off the bus"))
	require.NoError(t, e.g.CordonDevice(ctx, uuid(1), ledger.CordonUnhealthy, "Xid 79 again"), "idempotent")
	st := e.state()
	require.Len(t, st.Cordons, 1)
	assert.Equal(t, "Xid 79 again", st.Cordons[0].Reason)
	assert.Equal(t, guard.ObserverBy, st.Cordons[0].By)
	assert.Equal(t, map[string]string{uuid(1): holder.ContainerID}, e.holders(), "the holder keeps its claim")

	require.NoError(t, e.g.Stopped(ctx, holder))
	st = e.state()
	assert.Empty(t, st.Claims)
	assert.Empty(t, st.Reservations, "no reservation on a cordoned GPU")
	d := e.admit(w, visible("1"))
	require.Equal(t, guard.Reject, d.Result, "the waiter is never granted a cordoned device")
	assert.Contains(t, d.Message, "unhealthy")
	assert.Equal(t, []string{"ml/uid-w/main"}, e.waiters(), "it keeps its place")
	assert.NotContains(t, d.Message, "Free GPUs now: 0, 1", "a cordoned GPU is not offered as free")

	_, was, err := e.g.Uncordon(ctx, uuid(1), "uid 0", nil)
	require.NoError(t, err)
	assert.True(t, was)
	_, was, err = e.g.Uncordon(ctx, uuid(1), "uid 0", nil)
	require.NoError(t, err)
	assert.False(t, was)
	assert.Equal(t, map[string]string{uuid(1): "ml/uid-w/main"}, reservationsOf(e.state()), "the head gets it once lifted")
	require.Equal(t, guard.Admit, e.admit(w, visible("1")).Result)

	ops := map[string]bool{}
	for _, r := range auditOf(t, e.l) {
		ops[r.Op] = true
	}
	assert.True(t, ops[ledger.OpCordon] && ops[ledger.OpUncordon], "cordon and uncordon are audited")
}

func reservationsOf(st ledger.State) map[string]string {
	out := map[string]string{}
	for _, r := range st.Reservations {
		out[r.Device.UUID] = r.For
	}
	return out
}

func TestCordonDeviceInput(t *testing.T) {
	e, _ := newStateEnv(t, nil)
	err := e.g.CordonDevice(ctx, "GPU-nope", ledger.CordonOperator, "x")
	require.ErrorIs(t, err, ledger.ErrNotFound)
	assert.Contains(t, err.Error(), uuid(0), "names the GPUs of the host")
	err = e.g.CordonDevice(ctx, uuid(0), "whim", "x")
	require.Error(t, err)
	assert.Contains(t, err.Error(), `"whim"`)
	assert.Empty(t, e.state().Cordons)
}

// release_requires_idle: a stop (or removal, or pod removal, or a holder
// found exited) keeps the claim draining; FinishDraining releases it, and
// without it the idle grace does, at the next ledger update of anyone.
func TestReleaseRequiresIdle(t *testing.T) {
	idle := func(c *config.Config) {
		c.Observe.ReleaseRequiresIdle = true
		c.Observe.IdleGrace = config.Duration{Duration: time.Minute}
	}
	holder := ctr("ml", "a", "main", "holder0000000001")
	req := ctr("ml", "b", "main", "req0000000000001")
	for _, tc := range []struct {
		name string
		ends func(e *env)
	}{
		{"stop", func(e *env) { require.NoError(t, e.g.Stopped(ctx, holder)) }},
		{"remove", func(e *env) { require.NoError(t, e.g.Removed(ctx, holder)) }},
		{"stop then remove", func(e *env) {
			require.NoError(t, e.g.Stopped(ctx, holder))
			e.clock.advance(30 * time.Second)
			require.NoError(t, e.g.Removed(ctx, holder)) // keeps the drain's start
		}},
		{"pod gone", func(e *env) { require.NoError(t, e.g.PodGone(ctx, ledger.FrontEndNRI, holder.PodUID, "")) }},
		{"not listed at reconcile", func(e *env) {
			res, err := e.g.Reconcile(ctx, ledger.FrontEndNRI, nil)
			require.NoError(t, err)
			assert.Empty(t, res.Released, "a stopped holder's claim drains, it is not released as stale")
		}},
		{"holder found exited", func(e *env) {
			require.NoError(t, e.g.Started(ctx, holder.ContainerID, 4242, "/k8s.io/"+holder.ContainerID))
			e.live.exited[holder.ContainerID] = true
			assert.Equal(t, guard.MarkDraining, e.g.Releasable(e.state().Claims[0].Owner).Action)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, finish := range []bool{true, false} {
				e, logs := newStateEnv(t, idle)
				require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
				tc.ends(e)

				d := e.admit(req, visible("1"))
				require.Equal(t, guard.Queue, d.Result, "the draining claim still holds the GPU")
				assert.Contains(t, d.Message, "(draining since 2026-05-09T08:00:00Z")
				assert.Contains(t, d.Message, "waiting for its processes to leave the GPU")
				draining, err := e.g.Draining(ctx)
				require.NoError(t, err)
				require.Len(t, draining, 1)
				assert.Equal(t, holder.ContainerID, draining[0].Owner.ContainerID)
				assert.Equal(t, guard.KeepDraining, e.g.Releasable(draining[0].Owner).Action, "the release rule keeps it")

				if finish {
					require.NoError(t, e.g.FinishDraining(ctx, "someone-else", "idle"), "no-op")
					assert.Len(t, e.state().Claims, 1)
					require.NoError(t, e.g.FinishDraining(ctx, holder.ContainerID, "idle"))
					assert.Equal(t, 1, e.obs.released[guard.ReasonDrained])
				} else {
					left := draining[0].Owner.DrainingSince.Add(time.Minute).Sub(e.clock.Now())
					e.clock.advance(left - time.Second)
					require.Equal(t, guard.Queue, e.admit(req, visible("1")).Result, "still within the grace")
					e.clock.advance(time.Second)
					// Any update ends it: a hook-only host has no observer.
					require.NoError(t, e.g.Withdraw(ctx, "nobody", "test"))
					assert.Contains(t, logs.String(), "idle grace over")
					assert.Contains(t, logs.String(), uuid(1))
					assert.Contains(t, logs.String(), holder.ContainerID)
				}
				st := e.state()
				assert.Empty(t, st.Claims, "released")
				assert.Equal(t, map[string]string{uuid(1): "ml/uid-b/main"}, reservationsOf(st), "the queue head gets it")
				require.Equal(t, guard.Admit, e.admit(req, visible("1")).Result)
			}
		})
	}
}

// Without release_requires_idle nothing drains: a stop releases at once.
func TestStopReleasesWithoutRequiresIdle(t *testing.T) {
	e, _ := newStateEnv(t, nil)
	holder := ctr("ml", "a", "main", "holder0000000001")
	require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
	require.NoError(t, e.g.Stopped(ctx, holder))
	assert.Empty(t, e.state().Claims)
	draining, err := e.g.Draining(ctx)
	require.NoError(t, err)
	assert.Empty(t, draining)
}

// Cordon says whether it changed the ledger, decided in its own transaction:
// a new cordon or another source, reason or by does; a repeat does not, nor
// does a finding of a source that ranks below the cordon in force (an
// intruder on an unhealthy device, any finding on an operator's cordon),
// which stays as it is.
func TestCordonReportsWhetherItChangedTheLedger(t *testing.T) {
	e, _ := newStateEnv(t, nil)
	for i, tc := range []struct {
		source, reason, by string
		changed            bool
		// the cordon in force after the call, when not the one asked for
		wantSource, wantReason string
	}{
		{source: ledger.CordonIntruder, reason: "pid 4141", by: guard.ObserverBy, changed: true},
		{source: ledger.CordonUnhealthy, reason: "Xid 79", by: guard.ObserverBy, changed: true},
		{source: ledger.CordonUnhealthy, reason: "Xid 79", by: guard.ObserverBy, changed: false},
		{source: ledger.CordonIntruder, reason: "pid 4242", by: guard.ObserverBy, changed: false,
			wantSource: ledger.CordonUnhealthy, wantReason: "Xid 79"},
		{source: ledger.CordonOperator, reason: "fan", by: "uid 0", changed: true},
		{source: ledger.CordonOperator, reason: "fan", by: "uid 0", changed: false},
		{source: ledger.CordonOperator, reason: "fan replaced", by: "uid 0", changed: true},
		{source: ledger.CordonOperator, reason: "fan replaced", by: "uid 1000 (alice)", changed: true},
		{source: ledger.CordonUnhealthy, reason: "Xid 48", by: guard.ObserverBy, changed: false,
			wantSource: ledger.CordonOperator, wantReason: "fan replaced"},
		{source: ledger.CordonIntruder, reason: "pid 4343", by: guard.ObserverBy, changed: false,
			wantSource: ledger.CordonOperator, wantReason: "fan replaced"},
	} {
		if tc.wantSource == "" {
			tc.wantSource, tc.wantReason = tc.source, tc.reason
		}
		gen := e.state().Generation
		k, changed, err := e.g.Cordon(ctx, uuid(2), tc.source, tc.reason, tc.by)
		require.NoError(t, err, "step %d", i)
		assert.Equal(t, tc.changed, changed, "step %d", i)
		assert.Equal(t, tc.wantSource, k.Source, "step %d", i)
		assert.Equal(t, tc.wantReason, k.Reason, "step %d", i)
		assert.Equal(t, tc.changed, e.state().Generation != gen, "step %d: written iff changed", i)
	}
}

// CordonRefusal (for a front end that moves claims itself inside a
// transaction: the hook's ticket hand-over) is the decision Admit makes for
// a request that wants a cordoned device, and writes nothing.
func TestCordonRefusalIsAdmitsDecision(t *testing.T) {
	e, _ := newStateEnv(t, nil)
	require.NoError(t, e.g.CordonDevice(ctx, uuid(1), ledger.CordonUnhealthy, "Xid 79"))
	req := ctr("ml", "b", "main", "req0000000000001")
	x, err := e.g.Explain(ctx, guard.Request{FrontEnd: ledger.FrontEndHook, Owner: req, Spec: visible("1")})
	require.NoError(t, err)
	before := len(auditOf(t, e.l))

	res, err := e.g.Resolve(visible("1"))
	require.NoError(t, err)
	want := []devices.Device{res.Devices[0].Device}
	require.NoError(t, e.l.Update(ctx, func(tx *ledger.Tx) error {
		cordoned := tx.CordonsOn(req.ContainerID, want)
		require.Len(t, cordoned, 1)
		d := e.g.CordonRefusal(tx, req.ContainerID, res.Devices, cordoned)
		assert.Equal(t, guard.Reject, d.Result)
		assert.Equal(t, guard.ReasonCordoned, d.Reason)
		assert.Equal(t, x.Message, d.Message, "Admit's words")
		assert.Equal(t, cordoned, d.Cordoned)
		assert.ErrorIs(t, d.Err(), guard.ErrRejected)
		return nil
	}))
	assert.Len(t, auditOf(t, e.l), before, "CordonRefusal audits nothing")
}

// Uncordon returns the cordon its transaction lifted. Told which cordon the
// caller read (seen), it lifts only that one: a cordon set since (the
// observer found the GPU unhealthy, another operator cordoned it again) is
// kept and named in ErrCordonChanged, so that no cordon is lifted unseen;
// one lifted meanwhile is no error.
func TestUncordonLiftsOnlyTheCordonSeen(t *testing.T) {
	for _, tc := range []struct {
		name string
		// then changes the cordon between the caller's read and Uncordon.
		then    func(e *env)
		changed bool   // ErrCordonChanged, the cordon in force kept
		was     bool   // a cordon was lifted
		reason  string // of the cordon left (changed) or lifted (was)
	}{
		{name: "unchanged", was: true, reason: "pid 4242"},
		{name: "the observer found it unhealthy", changed: true, reason: "Xid 79",
			then: func(e *env) {
				require.NoError(e.t, e.g.CordonDevice(ctx, uuid(2), ledger.CordonUnhealthy, "Xid 79"))
			}},
		{name: "cordoned again by an operator", changed: true, reason: "RMA 4711",
			then: func(e *env) {
				_, _, err := e.g.Cordon(ctx, uuid(2), ledger.CordonOperator, "RMA 4711", "uid 0")
				require.NoError(e.t, err)
			}},
		{name: "lifted meanwhile",
			then: func(e *env) {
				_, _, err := e.g.Uncordon(ctx, uuid(2), "uid 0", nil)
				require.NoError(e.t, err)
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, _ := newStateEnv(t, nil)
			seen, _, err := e.g.Cordon(ctx, uuid(2), ledger.CordonIntruder, "pid 4242", guard.ObserverBy)
			require.NoError(t, err)
			if tc.then != nil {
				e.clock.advance(time.Minute)
				tc.then(e)
			}
			before := e.state()
			lifted, was, err := e.g.Uncordon(ctx, uuid(2), "uid 0", &seen)
			if tc.changed {
				require.ErrorIs(t, err, guard.ErrCordonChanged)
				for _, s := range []string{uuid(2), tc.reason, "pid 4242", "nothing was lifted"} {
					assert.Contains(t, err.Error(), s)
				}
				assert.False(t, was)
				assert.Equal(t, before, e.state(), "nothing written")
				require.Len(t, e.state().Cordons, 1)
				assert.Equal(t, tc.reason, e.state().Cordons[0].Reason)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.was, was)
			assert.Empty(t, e.state().Cordons)
			if tc.was {
				assert.Equal(t, seen, lifted, "the cordon lifted, as the transaction found it")
			}
		})
	}

	// Without seen, whatever cordon is in force is lifted, and returned.
	e, _ := newStateEnv(t, nil)
	k, _, err := e.g.Cordon(ctx, uuid(2), ledger.CordonUnhealthy, "Xid 79", guard.ObserverBy)
	require.NoError(t, err)
	lifted, was, err := e.g.Uncordon(ctx, uuid(2), "uid 0", nil)
	require.NoError(t, err)
	assert.True(t, was)
	assert.Equal(t, k, lifted)
}
