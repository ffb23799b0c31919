// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// conflictOnGPU2 reconciles a running holder and a container created while
// the front end was away, both on GPU 2: the holder keeps it, the other is
// recorded in conflict (the device becomes its claim once it is free).
func conflictOnGPU2(t *testing.T, e *env, holder, late ledger.Owner) {
	t.Helper()
	holder.Pid, holder.Cgroup = 4242, "/k8s.io/"+holder.ContainerID
	_, err := e.g.Reconcile(ctx, ledger.FrontEndNRI, []guard.Request{
		{FrontEnd: ledger.FrontEndNRI, Owner: holder, Spec: visible("2")},
		{FrontEnd: ledger.FrontEndNRI, Owner: late, Spec: visible("2")},
	})
	require.NoError(t, err)
	st := e.state()
	require.Equal(t, map[string]string{uuid(2): holder.ContainerID}, e.holders())
	require.Len(t, st.Conflicts, 1)
	require.Equal(t, late.ContainerID, st.Conflicts[0].Owner.ContainerID)
}

// Under release_requires_idle a container that stops or is removed (or
// whose pod goes) keeps its claims draining; its conflict records that name
// no process must end as a release ends them. Kept, the record of a
// container that is gone was promoted to a claim once the holder's claim
// drained away, and held the GPU for good: it records no process, so
// nothing ever found it exited. A record that names the container's process
// stays (its processes may still be on the device): promoted, it drains.
func TestDrainEndsConflictRecords(t *testing.T) {
	idle := func(c *config.Config) {
		c.Observe.ReleaseRequiresIdle = true
		c.Observe.IdleGrace = config.Duration{Duration: time.Minute}
	}
	holder := ctr("ml", "c", "main", "holder0000000001")
	late := ctr("ml", "d", "main", "late000000000001")
	next := ctr("ml", "e", "main", "next000000000001")
	for _, tc := range []struct {
		name string
		ends func(e *env)
		// started: the container's process was recorded in its record.
		started bool
	}{
		{"stop", func(e *env) { require.NoError(t, e.g.Stopped(ctx, late)) }, false},
		{"remove", func(e *env) { require.NoError(t, e.g.Removed(ctx, late)) }, false},
		{"started, stopped, removed", func(e *env) {
			require.NoError(t, e.g.Started(ctx, late.ContainerID, 5151, "/k8s.io/"+late.ContainerID))
			require.NoError(t, e.g.Stopped(ctx, late))
			require.NoError(t, e.g.Removed(ctx, late))
		}, true},
		{"pod gone", func(e *env) { require.NoError(t, e.g.PodGone(ctx, ledger.FrontEndNRI, late.PodUID, late.PodSandboxID)) }, false},
		{"removed, named by id alone", func(e *env) {
			kept, err := e.g.RemovedExited(ctx, late, func(ledger.Owner) bool { return false })
			require.NoError(t, err)
			assert.Empty(t, kept)
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, _ := newStateEnv(t, idle)
			conflictOnGPU2(t, e, holder, late)
			before := len(e.obs.states)
			tc.ends(e)
			assert.Greater(t, len(e.obs.states), before, "the change is reported")
			if tc.started {
				st := e.state()
				require.Len(t, st.Conflicts, 1, "a record naming the process stays: it may still be on GPU 2")
				assert.Equal(t, 5151, st.Conflicts[0].Owner.Pid)
				e.live.exited[late.ContainerID] = true
			} else {
				assert.Empty(t, e.state().Conflicts, "the gone container's conflict record ended with it")
			}

			// The holder goes too; its claim drains, then the grace ends.
			require.NoError(t, e.g.Stopped(ctx, holder))
			e.clock.advance(2 * time.Minute)
			d := e.admit(next, visible("2"))
			if tc.started {
				// The record became the gone container's claim, which
				// drains in its turn.
				require.Equal(t, guard.Queue, d.Result, d.Message)
				assert.Contains(t, d.Message, "draining since")
				e.clock.advance(2 * time.Minute)
				d = e.admit(next, visible("2"))
			}
			require.Equal(t, guard.Admit, d.Result, "GPU 2 runs nothing: %s", d.Message)
			assert.Equal(t, map[string]string{uuid(2): next.ContainerID}, e.holders())
		})
	}
}

// A holder found exited under release_requires_idle drains; its conflict
// record on another GPU, which names its process, stays: its processes may
// be on that GPU too, so the GPU must not go to anyone else once its holder
// is gone until they have left. The observer's idle check of the holder
// (its processes only) finishes the holder's drain; the record then becomes
// the exited container's claim, which drains in its turn.
func TestExitedHolderDrainKeepsItsConflictRecords(t *testing.T) {
	e, _ := newStateEnv(t, func(c *config.Config) {
		c.Observe.ReleaseRequiresIdle = true
		c.Observe.IdleGrace = config.Duration{Duration: time.Minute}
	})
	holder := ctr("ml", "c", "main", "holder0000000001")
	late := ctr("ml", "d", "main", "late000000000001")
	late.Pid, late.Cgroup = 5151, "/k8s.io/"+late.ContainerID
	holder.Pid, holder.Cgroup = 4242, "/k8s.io/"+holder.ContainerID
	_, err := e.g.Reconcile(ctx, ledger.FrontEndNRI, []guard.Request{
		{FrontEnd: ledger.FrontEndNRI, Owner: holder, Spec: visible("2")},
		{FrontEnd: ledger.FrontEndNRI, Owner: late, Spec: visible("1,2")},
	})
	require.NoError(t, err)
	require.Equal(t, map[string]string{uuid(1): late.ContainerID, uuid(2): holder.ContainerID}, e.holders())
	require.Len(t, e.state().Conflicts, 1)

	e.live.exited[late.ContainerID] = true
	next := ctr("ml", "e", "main", "next000000000001")
	d := e.admit(next, visible("1"))
	require.Equal(t, guard.Queue, d.Result, "the exited holder's claim drains")
	assert.Contains(t, d.Message, "draining since")
	require.Len(t, e.state().Conflicts, 1, "its record on GPU 2 stays: its processes may be there")

	// GPU 2's holder stops and its processes leave (the observer's idle
	// check sees only them): GPU 2 is not handed out while the exited
	// container may still be on it.
	require.NoError(t, e.g.Stopped(ctx, holder))
	require.NoError(t, e.g.FinishDraining(ctx, holder.ContainerID, "idle"))
	other := ctr("ml", "f", "main", "other00000000001")
	d = e.admit(other, visible("2"))
	require.NotEqual(t, guard.Admit, d.Result, "GPU 2 while the exited container may still be on it: %s", d.Message)
	assert.Equal(t, late.ContainerID, e.holders()[uuid(2)], "the record became its claim")
}

// A container recorded in conflict that starts gets its pid and cgroup
// recorded in the record, as in a claim: promoted once the holder goes, its
// claim can then be found exited. Without them it was kept as "never
// started" for good, whatever became of the container.
func TestStartRecordedInConflictRecord(t *testing.T) {
	e := newEnv(t, nil)
	holder := ctr("ml", "c", "main", "holder0000000001")
	late := ctr("ml", "d", "main", "late000000000001")
	conflictOnGPU2(t, e, holder, late)

	require.NoError(t, e.g.Started(ctx, late.ContainerID, 5151, "/k8s.io/"+late.ContainerID))
	c := e.state().Conflicts[0].Owner
	assert.Equal(t, 5151, c.Pid)
	assert.Equal(t, uint64(51510), c.PidStart)
	assert.Equal(t, "/k8s.io/"+late.ContainerID, c.Cgroup)
	assert.False(t, c.StartedAt.IsZero())

	// The holder stops: the record becomes the claim, with the process.
	require.NoError(t, e.g.Stopped(ctx, holder))
	st := e.state()
	require.Empty(t, st.Conflicts)
	require.Len(t, st.Claims, 1)
	assert.Equal(t, late.ContainerID, st.Claims[0].Owner.ContainerID)
	assert.Equal(t, 5151, st.Claims[0].Owner.Pid)

	// It ends without a stop event (one missed): the next request finds it
	// exited and gets the GPU.
	e.live.exited[late.ContainerID] = true
	next := ctr("ml", "e", "main", "next000000000001")
	d := e.admit(next, visible("2"))
	require.Equal(t, guard.Admit, d.Result, d.Message)
	assert.Equal(t, "holder-exited", d.Reason)
}
