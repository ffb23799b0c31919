// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"context"
	"errors"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/containerd/nri/pkg/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// dueWatch records the plugin's count of due releases and lets a test wait
// until it reaches a value.
type dueWatch struct {
	mu   sync.Mutex
	n    int
	cond *sync.Cond
}

func newDueWatch() *dueWatch {
	w := &dueWatch{}
	w.cond = sync.NewCond(&w.mu)
	return w
}

func (w *dueWatch) SetRebuilding(bool) {}

func (w *dueWatch) SetReleasesDue(n int) {
	w.mu.Lock()
	w.n = n
	w.cond.Broadcast()
	w.mu.Unlock()
}

func (w *dueWatch) count() int { w.mu.Lock(); defer w.mu.Unlock(); return w.n }

// wait waits until n releases are due; a bounded guard fails the test.
func (w *dueWatch) wait(t *testing.T, n int) {
	t.Helper()
	guard := time.AfterFunc(30*time.Second, func() {
		w.mu.Lock()
		w.n = -1 // wakes the wait below, which then fails
		w.cond.Broadcast()
		w.mu.Unlock()
	})
	defer guard.Stop()
	w.mu.Lock()
	defer w.mu.Unlock()
	for w.n != n && w.n != -1 {
		w.cond.Wait()
	}
	require.Equal(t, n, w.n, "releases due (-1: not within 30s)")
}

// shortLock makes the handlers give up on a held ledger lock quickly.
func shortLock(c *config.Config) {
	c.Ledger.LockTimeout = config.Duration{Duration: 100 * time.Millisecond}
}

// releaseAudits lists the reasons of the audit's release records of
// container id.
func releaseAudits(t *testing.T, rt *runtime, id string) []string {
	t.Helper()
	recs, err := ledger.ReadAudit(filepath.Join(rt.ledgerDir, "audit.log"))
	require.NoError(t, err)
	var out []string
	for _, r := range recs {
		if r.Op == ledger.OpRelease && r.ContainerID == id {
			out = append(out, r.Reason)
		}
	}
	return out
}

// A GPU container created but never started (no pid, no cgroup: the
// liveness check keeps its claim, gc too) is stopped and removed while the
// ledger lock is held by another process: both releases fail. They are due,
// and retried until they succeed, by the next handler that takes the
// ledger lock (here the create that wants the GPU) or by the timer, and the
// retry is audited like any release.
func TestFailedReleaseIsRetried(t *testing.T) {
	for _, by := range []string{"next create", "timer"} {
		t.Run(by, func(t *testing.T) {
			rt := newRuntime(t, shortLock)
			pl := rt.startPlugin()
			due := newDueWatch()
			pl.p.gauges = due
			a, b := rt.addPod("a"), rt.addPod("b")
			c1 := container(a, "main", "c1", "NVIDIA_VISIBLE_DEVICES=0")
			require.NoError(t, rt.create(a, c1))

			lk := rt.lockLedger()
			rt.stop(a, c1)
			rt.remove(a, c1)
			assert.Equal(t, 1, due.count(), "the removal's release replaced the stop's")
			require.NoError(t, lk.Unlock())

			if by == "next create" {
				pl.p.halt() // no timer: only the handler retries
				require.NoError(t, rt.create(b, container(b, "main", "c2", "NVIDIA_VISIBLE_DEVICES=0")),
					"the create retried c1's release before deciding")
				assert.Equal(t, map[string]string{"0": "c2"}, rt.holders())
			} else {
				due.wait(t, 0)
				assert.Empty(t, rt.holders(), "c1 was removed: GPU 0 is free")
			}
			assert.Equal(t, 0, due.count())
			assert.Equal(t, []string{"removed"}, releaseAudits(t, rt, "c1"), "the retry is audited as the removal's release")
			pl.p.mu.Lock()
			_, tracked := pl.p.tracked["c1"]
			pl.p.mu.Unlock()
			assert.False(t, tracked, "c1's events are over")
		})
	}
}

// A failed release is retried with its own event's meaning: under
// release_on = "remove" a stop only marks the claim stopped (kept until the
// removal), and a failed pod stop releases the pod's claims and waiters.
func TestFailedReleaseKeepsItsMeaning(t *testing.T) {
	t.Run("stop under release_on remove", func(t *testing.T) {
		rt := newRuntime(t, func(c *config.Config) { shortLock(c); c.Policy.ReleaseOn = config.ReleaseOnRemove })
		pl := rt.startPlugin()
		due := newDueWatch()
		pl.p.gauges = due
		a := rt.addPod("a")
		c1 := container(a, "main", "c1", "NVIDIA_VISIBLE_DEVICES=0")
		require.NoError(t, rt.create(a, c1))
		rt.start(a, c1, 4242)

		lk := rt.lockLedger()
		rt.stop(a, c1)
		assert.Equal(t, 1, due.count())
		require.NoError(t, lk.Unlock())
		due.wait(t, 0)
		st := rt.state()
		require.Len(t, st.Claims, 1, "kept until the removal")
		assert.False(t, st.Claims[0].Owner.StoppedAt.IsZero(), "marked stopped by the retried stop")
		rt.remove(a, c1)
		assert.Empty(t, rt.holders())
	})
	t.Run("pod stop", func(t *testing.T) {
		rt := newRuntime(t, shortLock)
		pl := rt.startPlugin()
		due := newDueWatch()
		pl.p.gauges = due
		a := rt.addPod("a")
		require.NoError(t, rt.create(a, container(a, "main", "c1", "NVIDIA_VISIBLE_DEVICES=0")))
		require.Error(t, rt.create(a, container(a, "side", "c2", "NVIDIA_VISIBLE_DEVICES=0")), "queued")
		require.Len(t, rt.waiters(), 1)

		lk := rt.lockLedger()
		rt.stopPod(a)
		assert.Equal(t, 1, due.count())
		require.NoError(t, lk.Unlock())
		due.wait(t, 0)
		assert.Empty(t, rt.holders())
		assert.Empty(t, rt.waiters())
	})
}

// A release retried after a container of the same id was admitted would end
// the new container's claims (releases name a container by id alone): the
// create of that id runs the old container's due release first, and is
// refused while it cannot.
func TestDueReleaseNeverEndsANewContainerOfTheSameID(t *testing.T) {
	t.Run("through NRI", func(t *testing.T) {
		rt := newRuntime(t, shortLock)
		pl := rt.startPlugin()
		pl.p.halt() // no timer: the create has to run it
		a := rt.addPod("a")
		old := container(a, "main", "x", "NVIDIA_VISIBLE_DEVICES=0")
		require.NoError(t, rt.create(a, old))
		lk := rt.lockLedger()
		rt.stop(a, old)
		rt.remove(a, old)
		require.NoError(t, lk.Unlock())

		again := container(a, "main", "x", "NVIDIA_VISIBLE_DEVICES=1")
		require.NoError(t, rt.create(a, again))
		assert.Equal(t, map[string]string{"1": "x"}, rt.holders(), "the old x's claim went before the new x was admitted, the new one's stays")
		assert.False(t, pl.p.hasDue())
	})
	t.Run("while it is due", func(t *testing.T) {
		rt := newRuntime(t, shortLock)
		pl := rt.startPlugin()
		pl.p.halt()
		boom := errors.New("ledger lock not acquired in time")
		pl.p.addDue(releaseRemove, ledger.Owner{ContainerID: "x", PodUID: "uid-a", PodSandboxID: "sb-a"}, boom)
		pl.p.addDue(releasePod, ledger.Owner{PodUID: "uid-b", PodSandboxID: "sb-b-old"}, boom)
		ctx := context.Background()
		err := pl.p.claimDueFor(ctx, "x")
		require.Error(t, err, "a new x is not admitted while the old x's release is due")
		assert.Contains(t, err.Error(), "retrying is automatic")
		require.NoError(t, pl.p.claimDueFor(ctx, "y"), "another id is admitted: a pod's due release names its sandbox only")
	})
}

// A reconcile settles the containers' due releases: it released every
// claim of a container the runtime no longer lists.
func TestSynchronizeSettlesDueReleases(t *testing.T) {
	rt := newRuntime(t, shortLock)
	first := rt.startPlugin()
	first.p.halt()
	a := rt.addPod("a")
	c1 := container(a, "main", "c1", "NVIDIA_VISIBLE_DEVICES=0")
	require.NoError(t, rt.create(a, c1))
	lk := rt.lockLedger()
	rt.stop(a, c1)
	require.NoError(t, lk.Unlock())
	require.True(t, first.p.hasDue())

	// The same plugin reconnects (as Run does): its Synchronize does not
	// list c1.
	first.stub.Stop()
	_, err := first.p.Synchronize(context.Background(), []*api.PodSandbox{a}, nil)
	require.NoError(t, err)
	assert.False(t, first.p.hasDue())
	assert.Empty(t, rt.holders())
}
