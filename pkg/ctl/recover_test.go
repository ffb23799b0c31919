// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// TestNeedsRecoveryAdvice: the advice under a ledger that needs recovery
// says once to run recover (the ledger's own error does), and mentions a bad
// file kept aside only when there is one (a corrupt file, not a missing one).
func TestNeedsRecoveryAdvice(t *testing.T) {
	for _, tc := range []struct {
		name    string
		damage  func(t *testing.T, dir string)
		badFile bool
	}{
		{name: "corrupt snapshot", badFile: true, damage: func(t *testing.T, dir string) {
			require.NoError(t, os.WriteFile(filepath.Join(dir, "ledger.json"), []byte("\x00\x00garbage"), 0o600))
		}},
		{name: "missing snapshot", damage: func(t *testing.T, dir string) {
			require.NoError(t, os.Remove(filepath.Join(dir, "ledger.json")))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.populate(t)
			tc.damage(t, f.dir)
			// explain, asked about a container, answers with the ledger's
			// error as status does: not with the refusal the guard would
			// give a container (which named explain's pseudo container and
			// said to run recover three times).
			for _, args := range [][]string{{"status"}, {"explain", "--env", "NVIDIA_VISIBLE_DEVICES=1"},
				{"explain", "--env", "NVIDIA_VISIBLE_DEVICES=2", "-o", "json"}} {
				r := f.run(t, args...)
				require.Equal(t, ExitError, r.code, "%v: %s", args, r.stderr)
				assert.Empty(t, r.stdout, args)
				assert.Equal(t, 1, strings.Count(r.stderr, "run `gpu-guard-ctl recover`")+strings.Count(r.stderr, "run `sudo gpu-guard-ctl recover`"),
					"%v: say once to run recover: %s", args, r.stderr)
				assert.Contains(t, r.stderr, "recover needs root (`sudo gpu-guard-ctl recover`)", args)
				assert.Equal(t, tc.badFile, strings.Contains(r.stderr, "moved aside"), "%v: a bad file is mentioned only when there is one: %s", args, r.stderr)
				assert.NotContains(t, r.stderr, "; refused ", args)
			}
		})
	}
}

// A damaged ledger: status fails (never prints GPUs as free), recover
// rebuilds it from the journal, releases the holder that exited, and status
// works again.
func TestRecoverDamagedLedger(t *testing.T) {
	f := newFixture(t)
	f.populate(t)
	before := f.state(t)
	require.NotEmpty(t, before.Claims)
	f.liveness[idStale] = "cgroup has no processes"
	require.NoError(t, os.WriteFile(filepath.Join(f.dir, "ledger.json"), []byte("\x00\x00garbage"), 0o600))

	r := f.run(t, "status")
	require.Equal(t, ExitError, r.code, "status of a damaged ledger exits 1")
	assert.Contains(t, r.stderr, "gpu-guard-ctl recover")
	assert.Contains(t, r.stderr, "NO container gets a GPU")
	assert.Contains(t, r.stderr, filepath.Join(f.dir, "ledger.json"))
	assert.Empty(t, r.stdout, "no device is shown as free")

	f.uid = 1000
	r = f.run(t, "recover")
	require.Equal(t, ExitError, r.code)
	assert.Contains(t, r.stderr, "needs root")

	f.uid = 0
	// A contradiction between flags is a usage error, found before the
	// ledger is touched.
	r = f.run(t, "recover", "--reset", "--dry-run")
	require.Equal(t, ExitUsage, r.code, r.stderr)
	assert.Contains(t, r.stderr, "--reset and --dry-run")

	r = f.run(t, "recover")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "recovered generation")
	assert.Contains(t, r.stdout, "released (holder exited)")
	assert.Contains(t, r.stdout, "moved aside (kept)")

	after := f.state(t)
	var want []string
	for _, c := range before.Claims {
		if c.Owner.ContainerID != idStale {
			want = append(want, c.Device.UUID+"="+c.Owner.ContainerID)
		}
	}
	var got []string
	for _, c := range after.Claims {
		got = append(got, c.Device.UUID+"="+c.Owner.ContainerID)
	}
	assert.Equal(t, want, got, "every claim is back but the exited holder's")
	assert.Equal(t, len(before.Waiters), len(after.Waiters))

	r = f.run(t, "recover")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "healthy")
}

// TestRecoverReset: --reset refuses a healthy ledger (nothing to recover)
// unless --force, changing nothing; a reset keeps the operator's cordons of
// the newest state that verifies and lists each, drops the observer's, and
// says so when no state verified to read them from.
func TestRecoverReset(t *testing.T) {
	for _, tc := range []struct {
		name      string
		args      []string
		damage    []string // state files overwritten with junk first
		code      int
		stderr    []string
		stdout    []string
		kept      bool     // the operator's cordon is in the reset state
		claims    []string // the holders whose claims the reset state keeps
		unchanged bool     // the ledger is as before
	}{
		{name: "healthy ledger, no --force", args: []string{"recover", "--reset", "--reason", "x"}, code: ExitError,
			stderr:    []string{"is healthy (generation", "4 claim(s)", "2 cordon(s)", "nothing to recover", "recover --reset --force"},
			unchanged: true},
		// The claims of the holders still running (trainer) or not yet
		// started (hook, ghost) are kept: the front ends admit against a
		// healthy ledger, and forgetting them would let a second container
		// onto their GPUs. The exited holder's (stale) is forgotten.
		{name: "healthy ledger, --force", args: []string{"recover", "--reset", "--force", "--reason", "x"}, code: ExitOK,
			stdout: []string{"the ledger was reset to the claims of the holders still running, not yet started or draining",
				"kept (holder running, not yet started or draining): GPU 1 (" + uuidGPU1 + ") by team-a/trainer-0/main",
				"kept (operator cordon, lasts until uncordoned): GPU 1 (" + uuidGPU1 + "), by uid 0 via gpu-guard-ctl since 2026-03-01T11:00:00Z: ECC errors"},
			kept: true, claims: []string{idTrainer, idHook, idGhost}},
		{name: "damaged snapshot", args: []string{"recover", "--reset"}, damage: []string{"ledger.json"}, code: ExitOK,
			stdout: []string{"the ledger was reset: empty", "kept (operator cordon, lasts until uncordoned): GPU 1 (" + uuidGPU1 + ")"},
			kept:   true},
		{name: "nothing verifies", args: []string{"recover", "--reset"}, damage: []string{"ledger.json", "ledger.json.prev", "ledger.journal", "ledger.journal.prev"},
			code: ExitOK, stdout: []string{"the ledger was reset: empty", "LOST: the operator's cordons: no state verified to read them from"}},
		{name: "--force without --reset", args: []string{"recover", "--force"}, code: ExitUsage,
			stderr: []string{"--force applies to --reset only"}, unchanged: true},
		{name: "--reset --force --dry-run", args: []string{"recover", "--reset", "--force", "--dry-run"}, code: ExitUsage,
			stderr: []string{"--reset and --dry-run"}, unchanged: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.populate(t)
			f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
				cordon(t, tx, f.dev(t, uuidGPU1), ledger.CordonOperator, "ECC errors", "uid 0 via gpu-guard-ctl")
				cordon(t, tx, f.dev(t, uuidGPU0), ledger.CordonIntruder, "pid 4242 not admitted", "nri-gpu-guard observer")
			})
			for _, name := range tc.damage {
				p := filepath.Join(f.dir, name)
				if _, err := os.Stat(p); err == nil {
					require.NoError(t, os.WriteFile(p, []byte("junk"), 0o600))
				}
			}
			var before ledger.State
			if tc.unchanged {
				before = f.state(t)
			}
			auditBefore := len(f.audit(t))
			f.uid = 0
			r := f.run(t, tc.args...)
			require.Equal(t, tc.code, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			for _, s := range tc.stderr {
				assert.Contains(t, r.stderr, s)
			}
			for _, s := range tc.stdout {
				assert.Contains(t, r.stdout, s)
			}
			if tc.unchanged {
				require.Equal(t, before, f.state(t), "a refused reset changes nothing")
				require.Len(t, f.audit(t), auditBefore)
				return
			}
			st := f.state(t)
			var claims []string
			for _, c := range st.Claims {
				claims = append(claims, c.Owner.ContainerID)
			}
			assert.ElementsMatch(t, tc.claims, claims, "the other claims are forgotten")
			assert.Empty(t, st.Waiters, "the waiters are forgotten")
			var cordons []string
			for _, k := range st.Cordons {
				cordons = append(cordons, k.Source+" "+k.Device.UUID)
			}
			if tc.kept {
				assert.Equal(t, []string{ledger.CordonOperator + " " + uuidGPU1}, cordons, "only the operator's cordon is kept")
				assert.NotContains(t, r.stdout, "LOST")
			} else {
				assert.Empty(t, cordons)
			}
		})
	}
}

// TestRecoverJSONKeys: recover -o json has every key docs/ctl-json.md lists,
// whatever happened: problem ("" on a healthy ledger) and lost as strings,
// every list a list ([] when empty, never null, never absent); only
// adopted, conflicts and kept_claims are absent when empty (the reset keeps
// the trainer's claim: its holder has not started yet).
func TestRecoverJSONKeys(t *testing.T) {
	strs := []string{"problem", "lost", "lineage"}
	lists := []string{"from", "claims", "waiters", "released", "quarantined", "kept_cordons"}
	others := []string{"replayed", "recovered_generation", "generation", "complete", "new_lineage", "empty"}
	for _, tc := range []struct {
		name        string
		args        []string
		damage      bool // ledger.json overwritten with junk first
		wantProblem bool
	}{
		{name: "healthy", args: []string{"recover", "-o", "json"}},
		{name: "healthy, dry run", args: []string{"recover", "--dry-run", "-o", "json"}},
		{name: "damaged, dry run", args: []string{"recover", "--dry-run", "-o", "json"}, damage: true, wantProblem: true},
		{name: "damaged", args: []string{"recover", "-o", "json"}, damage: true, wantProblem: true},
		{name: "reset", args: []string{"recover", "--reset", "--force", "-o", "json"}, wantProblem: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
				claim(t, tx, ownTrainer, "env", f.dev(t, uuidGPU1))
			})
			if tc.damage {
				require.NoError(t, os.WriteFile(filepath.Join(f.dir, "ledger.json"), []byte("junk"), 0o600))
			}
			f.uid = 0
			r := f.run(t, tc.args...)
			require.Equal(t, ExitOK, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			var out map[string]json.RawMessage
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &out), r.stdout)
			for _, k := range strs {
				var s string
				require.Contains(t, out, k, r.stdout)
				require.NoError(t, json.Unmarshal(out[k], &s), "%s is a string: %s", k, out[k])
			}
			for _, k := range lists {
				require.Contains(t, out, k, r.stdout)
				assert.True(t, strings.HasPrefix(string(out[k]), "["), "%s is a list, [] when empty: %s", k, out[k])
			}
			for _, k := range others {
				assert.Contains(t, out, k, r.stdout)
			}
			var problem string
			require.NoError(t, json.Unmarshal(out["problem"], &problem))
			assert.Equal(t, tc.wantProblem, problem != "", "problem = %q", problem)
			for _, k := range []string{"adopted", "conflicts"} {
				assert.NotContains(t, out, k, "absent when empty")
			}
			if tc.name == "reset" {
				assert.True(t, strings.HasPrefix(string(out["kept_claims"]), "["), "kept_claims is a list: %s", r.stdout)
			} else {
				assert.NotContains(t, out, "kept_claims", "absent when empty")
			}
		})
	}
}
