// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// holderState is one situation a claim holder can be in, laid out as a fake
// cgroup v2 tree and a fake procfs for the real liveness checker.
type holderState struct {
	name     string
	pid      int
	pidStart uint64 // recorded in the ledger
	cgroup   string // recorded in the ledger
	stopped  bool   // marked stopped in the ledger (release_on = "remove")
	// populated is the cgroup's "populated" value; "" = no such cgroup.
	populated string
	// procStart is the start time /proc/<pid>/stat shows; 0 = no such pid.
	procStart uint64
	want      map[config.ReleaseOn]guard.ReleaseAction
}

func exitedAs(stop, remove guard.ReleaseAction) map[config.ReleaseOn]guard.ReleaseAction {
	return map[config.ReleaseOn]guard.ReleaseAction{config.ReleaseOnStop: stop, config.ReleaseOnRemove: remove}
}

var holderStates = []holderState{
	{name: "never started", want: exitedAs(guard.KeepNotStarted, guard.KeepNotStarted)},
	{name: "running", pid: 10, cgroup: "/k8s.io/" + idTrainer, populated: "1", procStart: 5,
		want: exitedAs(guard.KeepRunning, guard.KeepRunning)},
	{name: "exited", pid: 10, cgroup: "/k8s.io/" + idTrainer, populated: "0",
		want: exitedAs(guard.ReleaseNow, guard.MarkStopped)},
	{name: "stopped but not removed", pid: 10, cgroup: "/k8s.io/" + idTrainer, populated: "0", stopped: true,
		want: exitedAs(guard.KeepStopped, guard.KeepStopped)},
	{name: "no cgroup, pid running", pid: 20, pidStart: 7, procStart: 7,
		want: exitedAs(guard.KeepRunning, guard.KeepRunning)},
	{name: "no cgroup, pid gone", pid: 20, pidStart: 7,
		want: exitedAs(guard.ReleaseNow, guard.MarkStopped)},
	{name: "no cgroup, pid reused", pid: 20, pidStart: 7, procStart: 8,
		want: exitedAs(guard.ReleaseNow, guard.MarkStopped)},
	{name: "cgroup not on this host, pid running", pid: 30, pidStart: 3, cgroup: "/k8s.io/elsewhere", procStart: 3,
		want: exitedAs(guard.KeepRunning, guard.KeepRunning)},
	{name: "cgroup not on this host, no pid", cgroup: "/k8s.io/elsewhere",
		want: exitedAs(guard.KeepRunning, guard.KeepRunning)},
}

// releaseRuleFixture is a fixture whose configuration sets release_on and
// whose only claim is ownTrainer's on GPU 1, in state h, with the real
// liveness checker over fake trees.
func releaseRuleFixture(t *testing.T, releaseOn config.ReleaseOn, h holderState) (*fixture, *liveness.Checker) {
	t.Helper()
	f := newFixture(t)
	cfg, err := os.ReadFile(f.config)
	require.NoError(t, err)
	cfg = append(cfg, []byte("[policy]\nrelease_on = \""+string(releaseOn)+"\"\n")...)
	require.NoError(t, os.WriteFile(f.config, cfg, 0o600))

	cg, proc := t.TempDir(), t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(cg, "cgroup.controllers"), []byte("cpu memory pids\n"), 0o644))
	if h.populated != "" {
		dir := filepath.Join(cg, filepath.FromSlash(h.cgroup))
		require.NoError(t, os.MkdirAll(dir, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "cgroup.events"), []byte("populated "+h.populated+"\nfrozen 0\n"), 0o644))
	}
	if h.procStart != 0 {
		dir := filepath.Join(proc, strconv.Itoa(h.pid))
		require.NoError(t, os.MkdirAll(dir, 0o755))
		stat := fmt.Sprintf("%d (python3) S 1%s %d 0 0\n", h.pid, strings.Repeat(" 0", 17), h.procStart)
		require.NoError(t, os.WriteFile(filepath.Join(dir, "stat"), []byte(stat), 0o644))
	}
	f.update(t, now, func(tx *ledger.Tx) {
		claim(t, tx, ownTrainer, "env", f.dev(t, uuidGPU1))
		if h.pid > 0 || h.cgroup != "" {
			require.True(t, tx.SetStarted(idTrainer, h.pid, h.pidStart, h.cgroup))
		}
		if h.stopped {
			require.True(t, tx.MarkStopped(idTrainer))
		}
	})
	return f, liveness.New(cg, proc)
}

// runLive runs gpu-guard-ctl against f with the liveness checker live.
func runLive(f *fixture, live guard.Liveness, args ...string) result {
	var stdout, stderr syncBuffer
	env := f.env(&stdout, &stderr)
	env.Liveness = live
	code := Run(context.Background(), append([]string{"--config", f.config}, args...), env)
	return result{code: code, stdout: stdout.String(), stderr: stderr.String()}
}

// TestReleaseRuleAgrees runs every release_on × holder state through the
// one release rule (guard.Releasable), through `status` (stale), through
// `gc` and through the guard's own decision when another container asks for
// the holder's GPU, and asserts that they give one answer.
func TestReleaseRuleAgrees(t *testing.T) {
	for _, releaseOn := range []config.ReleaseOn{config.ReleaseOnStop, config.ReleaseOnRemove} {
		for _, h := range holderStates {
			t.Run(string(releaseOn)+"/"+h.name, func(t *testing.T) {
				f, live := releaseRuleFixture(t, releaseOn, h)
				holder := claimOwner(t, f.state(t), idTrainer)

				v := guard.Releasable(holder, releaseOn, live)
				require.Equal(t, h.want[releaseOn], v.Action, "why: %s", v.Why)

				// status: stale exactly when the rule releases.
				r := runLive(f, live, "status", "-o", "json")
				require.Contains(t, []int{ExitOK, ExitAttention}, r.code, r.stderr)
				stale := staleOf(t, r.stdout, uuidGPU1)
				assert.Equal(t, v.Release(), stale != "", "status stale = %q", stale)
				if v.Release() {
					assert.Equal(t, v.Why, stale)
				}

				// gc --dry-run lists it, and gc releases it, exactly then.
				r = runLive(f, live, "gc", "--dry-run")
				require.Equal(t, ExitOK, r.code, r.stderr)
				assert.Equal(t, v.Release(), strings.Contains(r.stdout, uuidGPU1), r.stdout)
				r = runLive(f, live, "gc")
				require.Equal(t, ExitOK, r.code, r.stderr)
				assert.Equal(t, v.Release(), len(claimedBy(f.state(t), idTrainer)) == 0, r.stdout)

				// The guard, asked for the same GPU by another container on a
				// fresh copy of the state, applies the same rule.
				f, live = releaseRuleFixture(t, releaseOn, h)
				cfg := config.Default()
				cfg.Policy.ReleaseOn = releaseOn
				l, err := ledger.Open(f.dir, f.ledgerOpts(0))
				require.NoError(t, err)
				g, err := guard.New(guard.Options{Config: cfg, Inventory: f.inv, Ledger: l, Liveness: live,
					Now: func() time.Time { return now }})
				require.NoError(t, err)
				d, err := g.Admit(t.Context(), guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: ownW1,
					Spec: devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=1"}}})
				require.NoError(t, err)
				st := f.state(t)
				assert.Equal(t, v.Release(), d.Result == guard.Admit, "decision %s: %s", d.Result, d.Message)
				assert.Equal(t, v.Release(), len(claimedBy(st, idTrainer)) == 0)
				if !v.Release() {
					kept := claimOwner(t, st, idTrainer)
					wantStopped := v.Action == guard.MarkStopped || v.Action == guard.KeepStopped
					assert.Equal(t, wantStopped, !kept.StoppedAt.IsZero(), "holder recorded as stopped")
					assert.Equal(t, g.Releasable(kept).Action == guard.KeepStopped, wantStopped,
						"after the guard's decision the rule sees what the guard recorded")
				}
			})
		}
	}
}

func claimOwner(t *testing.T, st ledger.State, id string) ledger.Owner {
	t.Helper()
	for _, c := range st.Claims {
		if c.Owner.ContainerID == id {
			return c.Owner
		}
	}
	t.Fatalf("no claim of %s", id)
	return ledger.Owner{}
}

// staleOf is the "stale" field `status -o json` (stdout) gives device uuid.
func staleOf(t *testing.T, stdout, uuid string) string {
	t.Helper()
	var view struct {
		Devices []struct {
			UUID  string `json:"uuid"`
			Stale string `json:"stale"`
		} `json:"devices"`
	}
	require.NoError(t, json.Unmarshal([]byte(stdout), &view))
	for _, d := range view.Devices {
		if d.UUID == uuid {
			return d.Stale
		}
	}
	return ""
}
