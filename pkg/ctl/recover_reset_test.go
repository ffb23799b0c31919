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

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// ownLate is a hook container admitted while recover runs, started (its
// cgroup has processes: the fixture's liveness lists it nowhere).
var ownLate = ledger.Owner{ContainerID: strings.Repeat("9a", 32), FrontEnd: ledger.FrontEndHook, Pid: 5151,
	Cgroup: "/k8s.io/" + strings.Repeat("9a", 32)}

// onRecoverLook runs fn in the window between recover's look at the ledger
// (and its runtime scan) and the change it makes under the ledger's lock.
func onRecoverLook(t *testing.T, fn func()) {
	t.Helper()
	afterRecoverLook = fn
	t.Cleanup(func() { afterRecoverLook = nil })
}

// admitLate claims GPU 3 for ownLate, as the OCI hook admits a container.
func (f *fixture) admitLate(t *testing.T) {
	t.Helper()
	f.update(t, now, func(tx *ledger.Tx) {
		claim(t, tx, ownLate, `env NVIDIA_VISIBLE_DEVICES="3"`, f.dev(t, uuidGPU3))
	})
}

// TestRecoverResetForceKeepsAClaimAdmittedAfterTheLook: `recover --reset
// --force` of a healthy ledger, during which (after its look and runtime
// scan, before its lock) a hook admits ownLate onto GPU 3: the reset keeps
// that claim, as it keeps every holder still running (trainer), and a
// second container asking for GPU 3 is refused. Before, the reset started
// from what the scan found and wiped ownLate's claim: GPU 3 was handed to
// the next container while ownLate ran on it.
func TestRecoverResetForceKeepsAClaimAdmittedAfterTheLook(t *testing.T) {
	f := newFixture(t)
	f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
		claim(t, tx, ownTrainer, `env NVIDIA_VISIBLE_DEVICES="1"`, f.dev(t, uuidGPU1))
		claim(t, tx, ownStale, `env NVIDIA_VISIBLE_DEVICES="2"`, f.dev(t, uuidGPU2))
		require.True(t, tx.SetStarted(idTrainer, 4242, 0, "/k8s.io/"+idTrainer))
		require.True(t, tx.SetStarted(idStale, 999, 0, "/k8s.io/"+idStale))
	})
	f.liveness[idStale] = "cgroup k8s.io/" + idStale + " has no processes"
	onRecoverLook(t, func() { f.admitLate(t) })
	f.uid = 0

	r := f.run(t, "recover", "--reset", "--force", "--reason", "start afresh")
	require.Equal(t, ExitOK, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	assert.Contains(t, r.stdout, "kept (holder running, not yet started or draining): GPU 3 ("+uuidGPU3+")")
	st := f.state(t)
	got := map[string]string{}
	for _, c := range st.Claims {
		got[c.Device.UUID] = c.Owner.ContainerID
	}
	assert.Equal(t, map[string]string{uuidGPU1: idTrainer, uuidGPU3: ownLate.ContainerID}, got,
		"the running holders keep their GPUs; the exited one's is forgotten")

	second := ledger.Owner{ContainerID: strings.Repeat("8b", 32), FrontEnd: ledger.FrontEndHook, Pid: 6161}
	l, err := ledger.Open(f.dir, f.ledgerOpts(0))
	require.NoError(t, err)
	err = l.Update(context.Background(), func(tx *ledger.Tx) error {
		_, err := tx.Claim("", second, []devices.Device{f.dev(t, uuidGPU3)}, "env")
		return err
	})
	var busy *ledger.BusyError
	require.ErrorAs(t, err, &busy, "GPU 3 is still ownLate's")

	var kept []string
	for _, rec := range f.audit(t) {
		if rec.Op == ledger.OpAdopt && strings.HasPrefix(rec.Reason, "kept across the reset") {
			kept = append(kept, rec.ContainerID)
		}
	}
	assert.ElementsMatch(t, []string{idTrainer, ownLate.ContainerID}, kept, "each kept claim is audited")
}

// TestRecoverResetForceKeepsADrainingClaim: under release_requires_idle a
// claim drains after its holder exited, until its processes leave the GPU
// (bounded by the drain grace); a forced reset used to forget it, handing
// the GPU to the next container while those processes could still run on
// it. A holder found exited whose claim nobody marked draining yet (the
// daemon missed its stop) is in the same case: the reset keeps its claim
// too, and marks it draining (as gc would), so that the drain grace bounds
// it from the reset on.
func TestRecoverResetForceKeepsADrainingClaim(t *testing.T) {
	for _, tc := range []struct {
		name   string
		marked bool // the claim is marked draining before the reset
	}{
		{name: "draining", marked: true},
		{name: "holder exited, not marked draining yet"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			if tc.marked {
				f.drainingStale(t)
			} else {
				appendConfig(t, f, "[observe]\nrelease_requires_idle = true\nidle_grace = \"10m\"\n")
				f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
					claim(t, tx, ownStale, `env NVIDIA_VISIBLE_DEVICES="2"`, f.dev(t, uuidGPU2))
					require.True(t, tx.SetStarted(idStale, 999, 0, "/k8s.io/"+idStale))
				})
			}
			require.Len(t, f.state(t).Claims, 1)
			f.liveness[idStale] = "cgroup k8s.io/" + idStale + " has no processes"
			f.uid = 0
			auditBefore := len(f.audit(t))

			r := f.run(t, "recover", "--reset", "--force", "--reason", "start afresh")
			require.Equal(t, ExitOK, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			assert.Contains(t, r.stdout, "kept (holder running, not yet started or draining): GPU 2 ("+uuidGPU2+")")
			st := f.state(t)
			require.Len(t, st.Claims, 1, "kept")
			assert.Equal(t, idStale, st.Claims[0].Owner.ContainerID)
			assert.False(t, st.Claims[0].Owner.DrainingSince.IsZero(), "draining, so the drain grace bounds it")
			if tc.marked {
				return
			}
			assert.Equal(t, now, st.Claims[0].Owner.DrainingSince.UTC(), "the drain grace runs from the reset")
			var ops []string
			for _, rec := range f.audit(t)[auditBefore:] {
				if rec.ContainerID == idStale {
					ops = append(ops, rec.Op)
					if rec.Op == ledger.OpAdopt {
						assert.Contains(t, rec.Reason, "its holder exited (cgroup k8s.io/"+idStale+" has no processes), "+
							"but its processes may still be on the GPU (release_requires_idle): kept, marked draining")
					}
				}
			}
			assert.Equal(t, []string{ledger.OpAdopt, ledger.OpDraining}, ops, "kept across the reset, then marked draining: both audited")

			// The JSON shows the kept claim draining, as the ledger has it.
			f = newFixture(t)
			appendConfig(t, f, "[observe]\nrelease_requires_idle = true\nidle_grace = \"10m\"\n")
			f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
				claim(t, tx, ownStale, `env NVIDIA_VISIBLE_DEVICES="2"`, f.dev(t, uuidGPU2))
				require.True(t, tx.SetStarted(idStale, 999, 0, "/k8s.io/"+idStale))
			})
			f.liveness[idStale] = "cgroup k8s.io/" + idStale + " has no processes"
			f.uid = 0
			r = f.run(t, "recover", "--reset", "--force", "-o", "json")
			require.Equal(t, ExitOK, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			var out struct {
				KeptClaims []ledger.Claim `json:"kept_claims"`
				Claims     []ledger.Claim `json:"claims"`
			}
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &out), r.stdout)
			require.Len(t, out.KeptClaims, 1)
			require.Len(t, out.Claims, 1)
			assert.Equal(t, now, out.KeptClaims[0].Owner.DrainingSince.UTC())
			assert.Equal(t, now, out.Claims[0].Owner.DrainingSince.UTC())
		})
	}
}

// TestRecoverResetForceJSON: the JSON of a forced reset lists the kept
// claims under kept_claims (docs/ctl-json.md), and they are the claims of
// the reset state.
func TestRecoverResetForceJSON(t *testing.T) {
	f := newFixture(t)
	f.admitLate(t)
	f.uid = 0
	r := f.run(t, "recover", "--reset", "--force", "-o", "json")
	require.Equal(t, ExitOK, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	assert.Contains(t, r.stdout, `"kept_claims": [`)
	assert.Contains(t, r.stdout, ownLate.ContainerID)
	assert.NotContains(t, r.stdout, `"adopted"`)
}

// TestRecoverResetRefusesALedgerRecoveredAfterTheLook: `recover --reset`
// (no --force) finds the ledger damaged, but before it takes the lock
// another recover rebuilds it and a hook admits ownLate: the reset refuses,
// saying so and what to run instead, and changes nothing. Before, it wiped
// the recovered claims and ownLate's, although --reset refuses a healthy
// ledger.
func TestRecoverResetRefusesALedgerRecoveredAfterTheLook(t *testing.T) {
	f := newFixture(t)
	f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
		claim(t, tx, ownTrainer, `env NVIDIA_VISIBLE_DEVICES="1"`, f.dev(t, uuidGPU1))
		require.True(t, tx.SetStarted(idTrainer, 4242, 0, "/k8s.io/"+idTrainer))
	})
	f.update(t, now.Add(-time.Minute), func(tx *ledger.Tx) {
		tx.Enqueue(key(ownNext), ownNext, []devices.Device{f.dev(t, uuidGPU1)})
	})
	require.NoError(t, os.WriteFile(filepath.Join(f.dir, "ledger.json"), []byte("junk"), 0o600))
	var recovered ledger.State
	onRecoverLook(t, func() {
		l, err := ledger.Open(f.dir, f.ledgerOpts(0))
		require.NoError(t, err)
		_, err = l.Recover(context.Background(), ledger.RecoverOptions{Reason: "a concurrent recover"})
		require.NoError(t, err)
		f.admitLate(t)
		recovered = f.state(t)
	})
	f.uid = 0

	r := f.run(t, "recover", "--reset", "--reason", "nothing verifies")
	require.Equal(t, ExitError, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	for _, s := range []string{"is healthy (generation", "became healthy after this command looked",
		"recover` checks it", "recover --reset --force` starts it afresh anyway"} {
		assert.Contains(t, r.stderr, s)
	}
	require.Len(t, recovered.Claims, 2, "the window ran: the recovered claim and ownLate's")
	require.Len(t, recovered.Waiters, 1)
	assert.Equal(t, recovered, f.state(t), "a refused reset changes nothing")
	for _, rec := range f.audit(t) {
		assert.NotEqual(t, ledger.OpReset, rec.Op, "nothing was reset")
	}
}

// A draining claim (release_requires_idle: the holder exited, its processes
// may still be on the GPU) is refused by release as a running holder is,
// unless --force: release let it through without a word, while a forced
// reset keeps it for the same reason.
func TestReleaseRefusesADrainingClaim(t *testing.T) {
	f := newFixture(t)
	f.drainingStale(t)
	f.uid = 0
	r := f.run(t, "release", "--container", idStale, "--reason", "x")
	require.Equal(t, ExitError, r.code, r.stdout+r.stderr)
	assert.Contains(t, r.stderr, "its claim drains until its processes leave the GPU")
	require.Len(t, f.state(t).Claims, 1, "kept")

	r = f.run(t, "release", "--container", idStale, "--reason", "x", "--force")
	require.Equal(t, ExitOK, r.code, r.stdout+r.stderr)
	require.Empty(t, f.state(t).Claims)
}

// drainingStale gives the fixture's stale holder a claim on GPU 2 that
// drains: it started, then stopped under release_requires_idle (the drain
// grace a minute, the default idle_grace).
func (f *fixture) drainingStale(t *testing.T) {
	t.Helper()
	opts := f.ledgerOpts(0)
	opts.DrainGrace = time.Minute
	l, err := ledger.Open(f.dir, opts)
	require.NoError(t, err)
	require.NoError(t, l.Update(context.Background(), func(tx *ledger.Tx) error {
		claim(t, tx, ownStale, `env NVIDIA_VISIBLE_DEVICES="2"`, f.dev(t, uuidGPU2))
		require.True(t, tx.SetStarted(idStale, 999, 0, "/k8s.io/"+idStale))
		require.NotEmpty(t, tx.MarkDraining(idStale, "stopped"))
		return nil
	}))
}
