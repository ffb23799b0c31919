// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"encoding/json"
	"os"
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

// cordonFixture: the trainer holds GPU 1.
func cordonFixture(t *testing.T) *fixture {
	t.Helper()
	f := newFixture(t)
	f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
		claim(t, tx, ownTrainer, `env NVIDIA_VISIBLE_DEVICES="1"`, f.dev(t, uuidGPU1))
	})
	return f
}

func TestCordonCommandRefusals(t *testing.T) {
	for _, tc := range []struct {
		name string
		uid  int
		args []string
		code int
		want string
	}{
		{"not root", 1000, []string{"cordon", "1", "--reason", "x"}, ExitError, "cordon changes the ledger and needs root (running as uid 1000)"},
		{"uncordon not root", 1000, []string{"uncordon", "1"}, ExitError, "uncordon changes the ledger and needs root"},
		{"unknown index", 0, []string{"cordon", "9", "--reason", "x"}, ExitError, `no GPU or MIG instance "9" on this host`},
		{"unknown mig", 0, []string{"cordon", "1:5", "--reason", "x"}, ExitError, uuidGPU1},
		{"unknown uuid", 0, []string{"uncordon", "GPU-nope"}, ExitError, `no GPU or MIG instance "GPU-nope"`},
		{"no reason", 0, []string{"cordon", "1"}, ExitUsage, "--reason is required"},
		{"blank reason", 0, []string{"cordon", "1", "--reason", "  "}, ExitUsage, "--reason is required"},
		{"long reason", 0, []string{"cordon", "1", "--reason", strings.Repeat("x", maxReasonLen+1)}, ExitUsage, "keep it under"},
		{"no device", 0, []string{"cordon", "--reason", "x"}, ExitUsage, "takes one device"},
		{"two devices", 0, []string{"uncordon", "1", "2"}, ExitUsage, "takes one device"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := cordonFixture(t)
			f.uid = tc.uid
			r := f.run(t, tc.args...)
			require.Equal(t, tc.code, r.code, r.stderr)
			assert.Contains(t, r.stderr, tc.want)
			assert.Empty(t, f.state(t).Cordons, "nothing cordoned")
		})
	}
}

// cordon → explain refuses → holder kept → uncordon → explain queues
// again, with -o json throughout and every step audited.
func TestCordonUncordonCommands(t *testing.T) {
	f := cordonFixture(t)
	f.getenv["SUDO_USER"] = "alice"

	r := f.run(t, "cordon", "1", "--reason", "ECC errors, RMA 4711")
	require.Equal(t, ExitOK, r.code, r.stderr)
	for _, s := range []string{"cordoned GPU 1", uuidGPU1, "ECC errors, RMA 4711", "gpu-guard-ctl uncordon 1",
		"team-a/trainer-0/main", "keeps its claim"} {
		assert.Contains(t, r.stdout, s)
	}
	st := f.state(t)
	require.Len(t, st.Cordons, 1)
	k := st.Cordons[0]
	assert.Equal(t, ledger.CordonOperator, k.Source)
	assert.Equal(t, "uid 0 (sudo user alice) via gpu-guard-ctl", k.By)
	assert.Len(t, claimedBy(st, idTrainer), 1, "the holder keeps its claim")

	// Again, as JSON: the same cordon, unchanged.
	r = f.run(t, "cordon", "1", "--reason", "ECC errors, RMA 4711", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	var v struct {
		Action  string `json:"action"`
		Changed bool   `json:"changed"`
		Cordon  *struct {
			Device, Index, Kind, Source, Reason, By string
			Since                                   time.Time
		} `json:"cordon"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	assert.Equal(t, "cordon", v.Action)
	assert.False(t, v.Changed)
	require.NotNil(t, v.Cordon)
	assert.Equal(t, uuidGPU1, v.Cordon.Device)
	assert.Equal(t, "1", v.Cordon.Index)
	assert.Equal(t, "gpu", v.Cordon.Kind)
	assert.Equal(t, "operator", v.Cordon.Source)
	assert.True(t, v.Cordon.Since.Equal(now))

	// explain shows the refusal a request for GPU 1 would get.
	r = f.run(t, "explain", "--env", "NVIDIA_VISIBLE_DEVICES=1", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	var x struct {
		Decision, Reason, Message string
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &x))
	assert.Equal(t, string(guard.Reject), x.Decision)
	assert.Equal(t, guard.ReasonCordoned, x.Reason)
	for _, s := range []string{uuidGPU1, "cordoned", "ECC errors, RMA 4711", "sudo gpu-guard-ctl uncordon 1"} {
		assert.Contains(t, x.Message, s)
	}

	r = f.run(t, "uncordon", "1", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	assert.Equal(t, "uncordon", v.Action)
	assert.True(t, v.Changed)
	require.NotNil(t, v.Cordon, "the cordon lifted")
	assert.Equal(t, "ECC errors, RMA 4711", v.Cordon.Reason)
	assert.Empty(t, f.state(t).Cordons)

	r = f.run(t, "uncordon", "1")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Equal(t, "GPU 1 ("+uuidGPU1+") is not cordoned; nothing changed.\n", r.stdout)

	r = f.run(t, "explain", "--env", "NVIDIA_VISIBLE_DEVICES=1", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &x))
	assert.NotEqual(t, guard.ReasonCordoned, x.Reason)

	var ops []string
	for _, rec := range f.audit(t) {
		if rec.Op == ledger.OpCordon || rec.Op == ledger.OpUncordon {
			ops = append(ops, rec.Op)
			assert.Equal(t, []string{uuidGPU1}, rec.Devices)
			assert.Contains(t, rec.Reason, "uid 0 (sudo user alice)")
		}
	}
	assert.Equal(t, []string{ledger.OpCordon, ledger.OpUncordon}, ops, "audited once each (the repeat changed nothing)")
}

// A cordon on a MIG instance blocks its GPU; uncordoning the GPU says where
// the cordon is.
func TestCordonMIGByIndexAndUUID(t *testing.T) {
	f := cordonFixture(t)
	r := f.run(t, "cordon", "0:1", "--reason", "MIG layout change")
	require.Equal(t, ExitOK, r.code, r.stderr)
	require.Equal(t, uuidMIG1, f.state(t).Cordons[0].Device.UUID)

	r = f.run(t, "explain", "--env", "NVIDIA_VISIBLE_DEVICES=0", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, `"reason": "cordoned"`)
	assert.Contains(t, r.stdout, "through")

	r = f.run(t, "uncordon", "0")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "is not cordoned itself, but MIG 0:1")
	require.Len(t, f.state(t).Cordons, 1)

	r = f.run(t, "uncordon", strings.ToLower(uuidMIG1))
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "uncordoned")
	assert.Empty(t, f.state(t).Cordons)
}

// TestReleaseRuleAgreesUnderRequiresIdle is TestReleaseRuleAgrees for
// [observe] release_requires_idle = true: the rule, gc and the guard's own
// decision agree on a holder that exited (kept draining, not released) and
// on one already draining (kept).
func TestReleaseRuleAgreesUnderRequiresIdle(t *testing.T) {
	states := []struct {
		h        holderState
		draining bool // marked draining in the ledger
		want     guard.ReleaseAction
	}{
		{h: holderStates[2], want: guard.MarkDraining},                 // exited
		{h: holderStates[1], want: guard.KeepRunning},                  // running
		{h: holderStates[1], draining: true, want: guard.KeepDraining}, // running, but already draining
		{h: holderStates[5], want: guard.MarkDraining},                 // no cgroup, pid gone
	}
	for _, s := range states {
		name := s.h.name
		if s.draining {
			name += ", draining"
		}
		t.Run(name, func(t *testing.T) {
			setup := func() (*fixture, guard.Liveness) {
				f, live := releaseRuleFixture(t, config.ReleaseOnStop, s.h)
				appendConfig(t, f, "[observe]\nrelease_requires_idle = true\nidle_grace = \"10m\"\n")
				if s.draining {
					opts := f.ledgerOpts(0)
					opts.DrainGrace = 10 * time.Minute
					l, err := ledger.Open(f.dir, opts)
					require.NoError(t, err)
					require.NoError(t, l.Update(context.Background(), func(tx *ledger.Tx) error {
						require.Len(t, tx.MarkDraining(idTrainer, "stopped"), 1)
						return nil
					}))
				}
				return f, live
			}
			f, live := setup()
			cfg := config.Default()
			cfg.Observe.ReleaseRequiresIdle = true
			cfg.Observe.IdleGrace = config.Duration{Duration: 10 * time.Minute}
			v := guard.NewReleaseRule(cfg, live).Check(claimOwner(t, f.state(t), idTrainer))
			require.Equal(t, s.want, v.Action, "why: %s", v.Why)
			wantDraining := s.want == guard.MarkDraining || s.want == guard.KeepDraining

			// gc: never releases; marks draining exactly when the rule does.
			r := runLive(f, live, "gc", "--dry-run", "-o", "json")
			require.Equal(t, ExitOK, r.code, r.stderr)
			var gv struct {
				Released []json.RawMessage `json:"released"`
				Draining []json.RawMessage `json:"draining"`
			}
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &gv))
			assert.Empty(t, gv.Released)
			assert.Equal(t, s.want == guard.MarkDraining, len(gv.Draining) == 1, r.stdout)
			r = runLive(f, live, "gc")
			require.Equal(t, ExitOK, r.code, r.stderr)
			kept := claimOwner(t, f.state(t), idTrainer)
			assert.Equal(t, wantDraining, !kept.DrainingSince.IsZero(), "gc: %s", r.stdout)

			// The guard, asked for the same GPU on a fresh copy, agrees.
			f, live = setup()
			opts := f.ledgerOpts(0)
			opts.DrainGrace = 10 * time.Minute
			l, err := ledger.Open(f.dir, opts)
			require.NoError(t, err)
			g, err := guard.New(guard.Options{Config: cfg, Inventory: f.inv, Ledger: l, Liveness: live,
				Now: func() time.Time { return now }})
			require.NoError(t, err)
			d, err := g.Admit(t.Context(), guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: ownW1,
				Spec: devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=1"}}})
			require.NoError(t, err)
			require.Equal(t, guard.Queue, d.Result, d.Message)
			kept = claimOwner(t, f.state(t), idTrainer)
			assert.Equal(t, wantDraining, !kept.DrainingSince.IsZero())
			assert.Equal(t, wantDraining, strings.Contains(d.Message, "draining since"), d.Message)
			assert.Equal(t, wantDraining, g.Releasable(kept).Action == guard.KeepDraining,
				"after the guard's decision the rule sees what the guard recorded")
		})
	}
}

func appendConfig(t *testing.T, f *fixture, toml string) {
	t.Helper()
	cfg, err := os.ReadFile(f.config)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(f.config, append(cfg, []byte(toml)...), 0o600))
}

// A cordon on a MIG instance gone from the inventory (a layout change)
// keeps its old index, which names another instance now: the hint of
// `uncordon <its GPU>` gives the UUID, which lifts the right one.
func TestUncordonHintNamesAGoneDeviceByUUID(t *testing.T) {
	f := cordonFixture(t)
	gone := devices.Device{UUID: uuidGoneMIG, Index: "0:1", Kind: devices.KindMIG, Parent: uuidGPU0}
	f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
		_, _, err := tx.Cordon(gone, ledger.CordonOperator, "MIG layout change", "uid 0")
		require.NoError(t, err)
	})
	r := f.run(t, "uncordon", "0")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Equal(t, "GPU 0 ("+uuidGPU0+") is not cordoned itself, but MIG 0:1 ("+uuidGoneMIG+") is: run `gpu-guard-ctl uncordon "+uuidGoneMIG+"`\n", r.stdout)

	r = f.run(t, "uncordon", uuidGoneMIG)
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "uncordoned MIG 0:1 ("+uuidGoneMIG+")")
	assert.Empty(t, f.state(t).Cordons)
}

// onUncordonLook runs fn in the window between uncordon's look at the ledger
// and the transaction that lifts the cordon.
func onUncordonLook(t *testing.T, fn func()) {
	t.Helper()
	afterUncordonLook = fn
	t.Cleanup(func() { afterUncordonLook = nil })
}

// TestUncordonLiftsOnlyTheCordonItRead: a cordon set on the device between
// uncordon's look and its write (the daemon's observer finds the GPU
// unhealthy, another operator cordons it again) is not lifted unseen: with
// no cordon read, nothing is lifted; with another cordon read, the uncordon
// is refused naming both. What it lifts is what its transaction lifted, in
// the output and the audit record. Before, the cordon set meanwhile was
// lifted, and the text output panicked on the cordon it had not read.
func TestUncordonLiftsOnlyTheCordonItRead(t *testing.T) {
	for _, tc := range []struct {
		name    string
		before  string // the reason of an operator's cordon on GPU 2 before uncordon looks; "" = none
		window  func(t *testing.T, f *fixture)
		json    bool
		code    int
		stdout  string
		stderr  []string
		reason  string // of the cordon on GPU 2 afterwards; "" = none
		audited bool   // an uncordon audit record, naming before
	}{
		{name: "not cordoned when read, the observer cordons it meanwhile", window: cordonUnhealthy,
			code: ExitOK, stdout: "GPU 2 (" + uuidGPU2 + ") is not cordoned; nothing changed.\n", reason: "Xid 79: fallen off the bus"},
		{name: "the same, json", window: cordonUnhealthy, json: true,
			code: ExitOK, stdout: `"cordon": null`, reason: "Xid 79: fallen off the bus"},
		{name: "cordoned again meanwhile, with another reason", before: "fan", window: func(t *testing.T, f *fixture) {
			f.update(t, now, func(tx *ledger.Tx) {
				_, _, err := tx.Cordon(f.dev(t, uuidGPU2), ledger.CordonOperator, "RMA 4711", "uid 0 (sudo user bob) via gpu-guard-ctl")
				require.NoError(t, err)
			})
		}, code: ExitError, reason: "RMA 4711", stderr: []string{"uncordon GPU 2 (" + uuidGPU2 + "): the cordon changed since it was read: " +
			`it is now cordoned operator by uid 0 (sudo user bob) via gpu-guard-ctl since 2026-03-01T11:00:00Z: "RMA 4711", ` +
			`not cordoned operator by uid 0 via gpu-guard-ctl since 2026-03-01T11:00:00Z: "fan"; nothing was lifted; ` +
			"check it (`gpu-guard-ctl status`) and run uncordon again"}},
		{name: "lifted meanwhile", before: "fan", window: func(t *testing.T, f *fixture) {
			f.update(t, now, func(tx *ledger.Tx) {
				_, was := tx.Uncordon(uuidGPU2, "uid 0 (sudo user bob) via gpu-guard-ctl")
				require.True(t, was)
			})
		}, code: ExitOK, stdout: "GPU 2 (" + uuidGPU2 + ") is not cordoned; nothing changed.\n"},
		{name: "unchanged", before: "fan", window: func(*testing.T, *fixture) {},
			code: ExitOK, stdout: "uncordoned GPU 2 (" + uuidGPU2 + ") (cordoned operator by uid 0 via gpu-guard-ctl since 2026-03-01T11:00:00Z: fan); " +
				"it takes new claims again.\n", audited: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := cordonFixture(t)
			f.uid = 0
			if tc.before != "" {
				f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
					_, _, err := tx.Cordon(f.dev(t, uuidGPU2), ledger.CordonOperator, tc.before, "uid 0 via gpu-guard-ctl")
					require.NoError(t, err)
				})
			}
			onUncordonLook(t, func() { tc.window(t, f) })
			auditBefore := len(f.audit(t))
			args := []string{"uncordon", "2"}
			if tc.json {
				args = append(args, "-o", "json")
			}
			r := f.run(t, args...)
			require.Equal(t, tc.code, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			if tc.json {
				assert.Contains(t, r.stdout, tc.stdout)
				assert.Contains(t, r.stdout, `"changed": false`)
			} else {
				assert.Equal(t, tc.stdout, r.stdout)
			}
			for _, s := range tc.stderr {
				assert.Contains(t, r.stderr, s)
			}
			st := f.state(t)
			if tc.reason == "" {
				assert.Empty(t, st.Cordons)
			} else {
				require.Len(t, st.Cordons, 1, "the cordon set meanwhile is kept")
				assert.Equal(t, tc.reason, st.Cordons[0].Reason)
			}
			var mine []ledger.AuditRecord
			for _, rec := range f.audit(t)[auditBefore:] {
				if rec.Op == ledger.OpUncordon && strings.Contains(rec.Reason, "uncordoned by uid 0 via") {
					mine = append(mine, rec)
				}
			}
			if !tc.audited {
				assert.Empty(t, mine)
				return
			}
			require.Len(t, mine, 1)
			assert.Contains(t, mine[0].Reason, "(was operator by uid 0 via gpu-guard-ctl since 2026-03-01T11:00:00Z: "+tc.before+")")
		})
	}
}

// cordonUnhealthy is the daemon's observer cordoning GPU 2.
func cordonUnhealthy(t *testing.T, f *fixture) {
	f.update(t, now, func(tx *ledger.Tx) {
		_, _, err := tx.Cordon(f.dev(t, uuidGPU2), ledger.CordonUnhealthy, "Xid 79: fallen off the bus", guard.ObserverBy)
		require.NoError(t, err)
	})
}

// The inventory does not load (devices.source "proc" and no driver there, the
// cache unusable: a GPU whose driver broke): a cordon the ledger records is
// still lifted by its UUID, as the help promises for a device no longer in
// the inventory; anything else still needs the inventory.
func TestUncordonByUUIDWithoutInventory(t *testing.T) {
	f := cordonFixture(t)
	f.uid = 0
	f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
		_, _, err := tx.Cordon(f.dev(t, uuidGPU2), ledger.CordonUnhealthy, "Xid 79: fallen off the bus", guard.ObserverBy)
		require.NoError(t, err)
	})
	f.setSource(t, "proc")
	require.NoError(t, os.WriteFile(filepath.Join(f.dir, devices.CacheFile), []byte("{not json"), 0o600))

	r := f.run(t, "uncordon", "2")
	require.Equal(t, ExitError, r.code, "an index needs the inventory: stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	assert.Contains(t, r.stderr, "load the GPU inventory")
	require.Len(t, f.state(t).Cordons, 1)

	r = f.run(t, "uncordon", strings.ToLower(uuidGPU2))
	require.Equal(t, ExitOK, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	assert.Equal(t, "uncordoned GPU 2 ("+uuidGPU2+") (cordoned unhealthy by "+guard.ObserverBy+" since 2026-03-01T11:00:00Z: "+
		"Xid 79: fallen off the bus); it takes new claims again.\n", r.stdout)
	assert.Contains(t, r.stderr, "warning: load the GPU inventory: ")
	assert.Contains(t, r.stderr, "; lifting the cordon the ledger records on "+strings.ToLower(uuidGPU2))
	assert.Empty(t, f.state(t).Cordons)
}
