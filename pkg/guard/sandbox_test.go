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

// inSandbox is ctr with the pod's sandbox id sb.
func inSandbox(o ledger.Owner, sb string) ledger.Owner {
	o.PodSandboxID = sb
	return o
}

// The kubelet replaces pod a's sandbox sb-a1 with sb-a2 (same pod UID):
// main stops in sb-a1 and runs again in sb-a2 on GPU 1, and side, queued
// for GPU 2 from sb-a1, retries from sb-a2 (keeping its place, under its
// key). The old sandbox's StopPodSandbox and RemovePodSandbox, later (the
// kubelet's garbage collection of dead sandboxes, a forced stop first),
// must neither release main's claim while it runs nor drop side from the
// queue; the removal of sb-a2, the pod's real end, ends both.
func TestPodGoneOfAReplacedSandboxKeepsTheNewOne(t *testing.T) {
	for _, idle := range []bool{false, true} {
		name := "release"
		if idle {
			name = "release_requires_idle"
		}
		t.Run(name, func(t *testing.T) {
			e, _ := newStateEnv(t, func(c *config.Config) {
				c.Observe.ReleaseRequiresIdle = idle
				c.Observe.IdleGrace = config.Duration{Duration: time.Hour}
			})
			holder := ctr("ml", "q", "main", "holder0000000001")
			require.Equal(t, guard.Admit, e.admit(holder, visible("2")).Result)

			old := inSandbox(ctr("ml", "a", "main", "main000000000001"), "sb-a1")
			require.Equal(t, guard.Admit, e.admit(old, visible("1")).Result)
			require.NoError(t, e.g.Started(ctx, old.ContainerID, 4242, "/k8s.io/"+old.ContainerID))
			side := inSandbox(ctr("ml", "a", "side", "side000000000001"), "sb-a1")
			require.Equal(t, guard.Queue, e.admit(side, visible("2")).Result)
			require.Equal(t, "sb-a1", e.state().Waiters[0].Owner.PodSandboxID)

			// main stops in sb-a1 ...
			require.NoError(t, e.g.Stopped(ctx, old))
			require.NoError(t, e.g.FinishDraining(ctx, old.ContainerID, "idle"))
			require.Equal(t, map[string]string{uuid(2): holder.ContainerID}, e.holders())

			// ... and the pod runs again in sb-a2.
			main := inSandbox(ctr("ml", "a", "main", "main000000000002"), "sb-a2")
			require.Equal(t, guard.Admit, e.admit(main, visible("1")).Result)
			require.NoError(t, e.g.Started(ctx, main.ContainerID, 4343, "/k8s.io/"+main.ContainerID))
			side2 := inSandbox(ctr("ml", "a", "side", "side000000000002"), "sb-a2")
			d := e.admit(side2, visible("2"))
			require.Equal(t, guard.Queue, d.Result)
			require.Equal(t, []string{"ml/uid-a/side"}, e.waiters(), "side waits under its key")
			require.Equal(t, "sb-a2", e.state().Waiters[0].Owner.PodSandboxID, "the retry recorded its new sandbox")

			// The old sandbox's stop and removal.
			require.NoError(t, e.g.PodGone(ctx, ledger.FrontEndNRI, old.PodUID, "sb-a1"))
			require.NoError(t, e.g.PodGone(ctx, ledger.FrontEndNRI, old.PodUID, "sb-a1"))
			st := e.state()
			assert.Equal(t, map[string]string{uuid(1): main.ContainerID, uuid(2): holder.ContainerID}, e.holders(),
				"main keeps GPU 1 while it runs")
			for _, c := range st.Claims {
				assert.True(t, c.Owner.DrainingSince.IsZero(), "nothing drains: %+v", c.Owner)
			}
			assert.Equal(t, []string{"ml/uid-a/side"}, e.waiters(), "side keeps its place")

			// The pod's real end: sb-a2 goes.
			require.NoError(t, e.g.PodGone(ctx, ledger.FrontEndNRI, main.PodUID, "sb-a2"))
			require.NoError(t, e.g.FinishDraining(ctx, main.ContainerID, "idle"))
			assert.Equal(t, map[string]string{uuid(2): holder.ContainerID}, e.holders())
			assert.Empty(t, e.waiters())
		})
	}
}

// A claim or waiter that records no sandbox id (written by an older
// version) still ends with its pod, matched by pod UID.
func TestPodGoneMatchesOwnersWithoutASandboxByUID(t *testing.T) {
	e, _ := newStateEnv(t, nil)
	holder := inSandbox(ctr("ml", "a", "main", "main000000000001"), "")
	waiter := inSandbox(ctr("ml", "a", "side", "side000000000001"), "")
	require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
	require.Equal(t, guard.Queue, e.admit(waiter, visible("1")).Result)
	require.NoError(t, e.g.PodGone(ctx, ledger.FrontEndNRI, holder.PodUID, "sb-a9"))
	assert.Empty(t, e.holders())
	assert.Empty(t, e.waiters())
}
