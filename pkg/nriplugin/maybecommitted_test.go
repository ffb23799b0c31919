// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/ledgerfault"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// failNextJournalSync makes the next sync of the plugin's ledger journal
// fail with EIO, once its record is written: the commit stands for every
// reader, and its Update fails.
func failNextJournalSync(t *testing.T, pl *plugin) {
	t.Helper()
	journal := pl.p.Guard().Ledger().JournalPath()
	var once atomic.Bool
	lift := ledgerfault.FailSync(func(path string) error {
		if path == journal && once.CompareAndSwap(false, true) {
			return syscall.EIO
		}
		return nil
	})
	t.Cleanup(lift)
}

// A create whose admission was written to the ledger, whose sync then failed,
// is refused, but its claim stands for every reader. The plugin tracked only
// admitted creates, so containerd's undo of the refused one (StopContainer,
// RemoveContainer) released nothing; the claim of a container that never
// runs (no process: the liveness check keeps it) stayed, and the pod's
// retries, new container ids, queued behind it until the pod went. The undo
// now releases it, whether it comes after the refusal or while the create
// still ran, and the retry is admitted.
func TestCreateRefusedWithItsClaimWrittenLeavesNoClaim(t *testing.T) {
	for _, tc := range []struct {
		name      string
		releaseOn config.ReleaseOn
		// undoneWhileRunning: the runtime undoes the create while it waits
		// for the ledger lock (it answered past the runtime's deadline).
		undoneWhileRunning bool
		released           []string // the audit's release reasons of the refused id
	}{
		{name: "undone after the refusal", releaseOn: config.ReleaseOnStop, released: []string{"stopped"}},
		{name: "undone after the refusal, release_on remove", releaseOn: config.ReleaseOnRemove, released: []string{"removed"}},
		{name: "undone while the create ran", releaseOn: config.ReleaseOnStop, undoneWhileRunning: true, released: []string{"removed"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rt := newRuntime(t, func(c *config.Config) {
				c.Policy.ReleaseOn = tc.releaseOn
				c.Ledger.LockTimeout = config.Duration{Duration: time.Minute}
			})
			pl := rt.startPlugin()
			pod := rt.addPod("train")
			refused := container(pod, "main", "refused-1", "NVIDIA_VISIBLE_DEVICES=0")

			failNextJournalSync(t, pl)
			var err error
			if tc.undoneWhileRunning {
				entered := make(chan string, 16)
				pl.p.entered = func(h string) { entered <- h }
				err = createUndoneWhileItWaits(t, rt, pl, entered, pod, refused)
				pl.p.entered = nil
			} else {
				err = rt.create(pod, refused) // refused, then containerd's undo
			}
			require.Error(t, err)
			assert.Contains(t, err.Error(), "its claim of GPU 0 ("+gpuUUID(0)+") may stand")

			assert.Empty(t, rt.holders(), "the claim the refused create left is released by its undo")
			assert.Equal(t, tc.released, releaseAudits(t, rt, refused.Id))
			_, tracked := pl.p.trackedGuard(refused.Id)
			assert.False(t, tracked, "the refused create's events are over")

			// The pod's retry: another container id, the same pod and name.
			retry := container(pod, "main", "retry-1", "NVIDIA_VISIBLE_DEVICES=0")
			require.NoError(t, rt.create(pod, retry))
			assert.Equal(t, map[string]string{"0": retry.Id}, rt.holders())
			assert.Empty(t, rt.waiters())
		})
	}
}

// A create refused by a ledger error that comes before anything is written
// (here the lock held past lock_timeout) is not tracked: its undo costs no
// ledger write (none is tried, so none fails and is retried), as for any
// refused create.
func TestCreateRefusedBeforeAnyWriteIsNotTracked(t *testing.T) {
	rt := newRuntime(t, shortLock)
	pl := rt.startPlugin()
	due := newDueWatch()
	pl.p.gauges = due
	pod := rt.addPod("a")
	lk := rt.lockLedger()
	err := rt.create(pod, container(pod, "main", "late-1", "NVIDIA_VISIBLE_DEVICES=1")) // refused, then undone
	require.NoError(t, lk.Unlock())
	require.ErrorContains(t, err, "GPU ledger busy")
	_, tracked := pl.p.trackedGuard("late-1")
	assert.False(t, tracked)
	assert.Equal(t, 0, due.count(), "no release was tried while the lock was held")
	assert.Empty(t, rt.holders())
}
