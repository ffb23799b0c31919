// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// hookIncarnation is container id as an OCI hook records one create of it:
// its init process (pid) and the cgroup the runtime names after the id.
func hookIncarnation(id string, pid int) ledger.Owner {
	return ledger.Owner{ContainerID: id, FrontEnd: ledger.FrontEndHook, Pid: pid, PidStart: uint64(pid) * 10,
		Cgroup: "/machine.slice/libpod-" + id + ".scope"}
}

// A container created again under its id (podman restarts a container, or
// starts one whose create it undid after admission, by a new create of the
// same id, and runs no poststop for the undone one) finds the claim of its
// earlier incarnation on its GPU. The runtime names the cgroup after the id,
// so the restart runs in the cgroup its predecessor recorded: counted as
// the predecessor's, that process kept the claim "alive" and the restart was
// refused as "held by container c1", by itself, until an operator released
// it. Now the restart's own process does not count for its predecessor, and
// a runtime that created the id again has deleted the earlier container
// (release_on = "remove" too).
func TestRestartIsNotRefusedByItsOwnEarlierIncarnation(t *testing.T) {
	for _, tc := range []struct {
		name               string
		mutate             func(*config.Config)
		earlier            func(e *env, o ledger.Owner) // after its admission
		onlyTheRestartRuns bool                         // the earlier cgroup holds the restart's process alone
		restartID          string
		want               guard.Result
		wantWhy            string // in the release's audit reason
		draining           bool   // the earlier claim drains
	}{
		{name: "release_on stop: only the restart runs in the cgroup", onlyTheRestartRuns: true,
			want: guard.Admit, wantWhy: "has no process but pid 200, the restarted container's; its container was created again (a restart)"},
		{name: "release_on stop: another process still runs there", want: guard.Queue},
		{name: "another container in the same cgroup is no restart", onlyTheRestartRuns: true, restartID: "c2", want: guard.Queue},
		{name: "release_on remove: exited now, the runtime lists the id (the restart)", onlyTheRestartRuns: true,
			mutate:  func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove },
			earlier: func(e *env, o ledger.Owner) { e.runtimeKnows(o.ContainerID) },
			want:    guard.Admit, wantWhy: "the restarted container's; its container was created again (a restart)"},
		{name: "release_on remove: found exited before, kept until its removal",
			mutate: func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove },
			earlier: func(e *env, o ledger.Owner) {
				e.runtimeKnows(o.ContainerID)
				e.live.exited["libpod-"+o.ContainerID+".scope"] = true
				// A request for the GPU finds it exited: kept, stopped.
				require.Equal(t, guard.Queue, e.admitHook(hookIncarnation("other", 300), visible("0")).Result)
				require.NoError(t, e.g.Withdraw(context.Background(), "other", "test"))
				delete(e.live.exited, "libpod-"+o.ContainerID+".scope")
				require.False(t, e.state().Claims[0].Owner.StoppedAt.IsZero(), "kept as stopped")
			},
			want: guard.Admit, wantWhy: "it exited at 2026-05-09T08:00:00Z; its container was created again (a restart)"},
		{name: "release_requires_idle: the earlier claim drains first", onlyTheRestartRuns: true,
			mutate: func(c *config.Config) { c.Observe.ReleaseRequiresIdle = true },
			want:   guard.Queue, draining: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, tc.mutate)
			e.live.only = map[string]int{}
			first := hookIncarnation("c1", 100)
			require.Equal(t, guard.Admit, e.admitHook(first, visible("0")).Result)
			if tc.earlier != nil {
				tc.earlier(e, first)
			}
			e.clock.advance(time.Minute)
			restart := hookIncarnation("c1", 200)
			if tc.restartID != "" {
				restart.ContainerID = tc.restartID // same cgroup, another id
			}
			if tc.onlyTheRestartRuns {
				e.live.only["libpod-c1.scope"] = 200
			}
			d := e.admitHook(restart, visible("0"))
			require.Equal(t, tc.want, d.Result, d.Message)
			if tc.draining {
				// Not admitted before its predecessor's processes have
				// left the GPU.
				assert.Contains(t, d.Message, "held by container c1")
				assert.Contains(t, d.Message, "draining since")
				return
			}
			claims := e.state().Claims
			require.Len(t, claims, 1)
			if tc.want == guard.Admit {
				assert.Equal(t, 200, claims[0].Owner.Pid, "the restart holds GPU 0")
				var why []string
				for _, r := range e.audit(ledger.OpRelease) {
					why = append(why, r.Reason)
				}
				require.Len(t, why, 1)
				assert.Contains(t, why[0], tc.wantWhy)
				return
			}
			assert.Equal(t, 100, claims[0].Owner.Pid, "the earlier incarnation keeps GPU 0")
			assert.True(t, strings.Contains(d.Message, "c1"), "the refusal names the holder: %s", d.Message)
			if tc.restartID == "" {
				assert.Contains(t, d.Message, "held by container c1 (an earlier incarnation of this container, pid 100: alive)")
			} else {
				assert.NotContains(t, d.Message, "earlier incarnation", "another container is not told it is this one")
			}
		})
	}
}

// The release rule as a waiter applies it (ReleaseRule.CheckFor) judges an
// earlier incarnation of the waiter's own container as its Admit does: a
// --wait restart queued behind its predecessor (another process was left in
// the cgroup) sees at its next poll that only its own process is left,
// where Check, which knows no requester, counts that process and keeps the
// waiter polling until its next refresh.
func TestReleaseRuleCheckForJudgesTheRequestersEarlierIncarnation(t *testing.T) {
	live := &liveness{exited: map[string]bool{}, only: map[string]int{"libpod-c1.scope": 200}}
	rule := guard.NewReleaseRule(config.Default(), live)
	earlier, restart := hookIncarnation("c1", 100), hookIncarnation("c1", 200)
	assert.False(t, rule.Check(earlier).Exited(), "without the requester its process counts")
	v := rule.CheckFor(earlier, restart)
	assert.True(t, v.Release(), "%+v", v)
	assert.Contains(t, v.Why, "its container was created again (a restart)")
	other := hookIncarnation("c2", 200)
	other.Cgroup = restart.Cgroup
	assert.False(t, rule.CheckFor(earlier, other).Exited(), "another container's process is not excluded")
}

// The refusal calls the holder an earlier incarnation of the requester only
// where the two share the cgroup the runtime names after the id: a
// container of the same id in another cgroup (another runtime root) is
// another container, refused in the usual words.
func TestSameIDInAnotherCgroupIsNotCalledAnEarlierIncarnation(t *testing.T) {
	e := newEnv(t, nil)
	first := hookIncarnation("c1", 100)
	require.Equal(t, guard.Admit, e.admitHook(first, visible("0")).Result)
	other := hookIncarnation("c1", 200)
	other.Cgroup = "/root-b/c1"
	d := e.admitHook(other, visible("0"))
	require.Equal(t, guard.Queue, d.Result, d.Message)
	assert.Contains(t, d.Message, "held by container c1 since")
	assert.NotContains(t, d.Message, "earlier incarnation")
}
