// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"maps"
	"slices"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/ledgerfault"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// failNextJournalSync makes the next sync of e's journal fail with EIO,
// after the record was written.
func (e *env) failNextJournalSync() {
	e.t.Helper()
	journal := e.l.JournalPath()
	var once atomic.Bool
	lift := ledgerfault.FailSync(func(path string) error {
		if path == journal && once.CompareAndSwap(false, true) {
			return syscall.EIO
		}
		return nil
	})
	e.t.Cleanup(lift)
}

// An admission whose claim was written but not made durable is refused with
// an error that says so (it wraps ledger.ErrMaybeCommitted): the claim is in
// the ledger for every reader, and the caller ends it as the claim of a
// container that never ran. Under release_on = "remove" a restart whose
// takeover may stand hands the claims back to its stopped predecessor when
// its create is undone, as after an admission that succeeded.
func TestAdmitWrittenButNotSynced(t *testing.T) {
	old := ctr("ml", "a", "main", "old0000000000001")
	restart := ctr("ml", "a", "main", "new0000000000001")
	hook := ledger.Owner{ContainerID: "hook000000000001", Container: "hook000000000001", FrontEnd: ledger.FrontEndHook,
		Pid: 4242, PidStart: 42420}
	for _, tc := range []struct {
		name     string
		mutate   func(*config.Config)
		setup    func(e *env)
		req      guard.Request
		words    []string
		undo     func(t *testing.T, e *env)
		afterAll map[string]string // holders once the caller ended what may stand
	}{{
		name:  "an NRI container's claim",
		req:   guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: old, Spec: visible("0")},
		words: []string{"the decision for ml/a/main (id old000000000) was written, then the disk failed to make it durable: it is refused to stay safe, though its claim of GPU 0 (" + uuid(0) + ") may stand", "when the runtime undoes the refused create"},
		// containerd's undo of the refused create.
		undo: func(t *testing.T, e *env) {
			require.NoError(t, e.g.Stopped(ctx, old))
			require.NoError(t, e.g.Removed(ctx, old))
		},
		afterAll: map[string]string{},
	}, {
		name:   "a restart's takeover",
		mutate: func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove },
		setup: func(e *env) {
			require.Equal(t, guard.Admit, e.admit(old, visible("1")).Result)
			require.NoError(t, e.g.Stopped(ctx, old))
		},
		req:   guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: restart, Spec: visible("1")},
		words: []string{"its claim of GPU 1 (" + uuid(1) + ") may stand"},
		undo: func(t *testing.T, e *env) {
			require.NoError(t, e.g.Stopped(ctx, restart))
			require.NoError(t, e.g.Removed(ctx, restart))
		},
		afterAll: map[string]string{uuid(1): old.ContainerID},
	}, {
		name:  "an OCI hook container's claim",
		req:   guard.Request{FrontEnd: ledger.FrontEndHook, Owner: hook, Key: hook.ContainerID, Spec: visible("2")},
		words: []string{"its claim of GPU 2 (" + uuid(2) + ") may stand", "once the refused container is gone"},
		// The runtime kills the refused container: its process is gone,
		// and the next request for the GPU releases the claim.
		undo: func(t *testing.T, e *env) {
			e.live.exitPid(hook.Pid)
			other := ctr("ml", "b", "main", "other00000000001")
			require.Equal(t, guard.Admit, e.admit(other, visible("2")).Result)
		},
		afterAll: map[string]string{uuid(2): "other00000000001"},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, tc.mutate)
			if tc.setup != nil {
				tc.setup(e)
			}
			e.failNextJournalSync()
			_, err := e.g.Admit(ctx, tc.req)
			require.Error(t, err)
			require.ErrorIs(t, err, ledger.ErrMaybeCommitted)
			for _, w := range tc.words {
				assert.Contains(t, err.Error(), w)
			}
			assert.Contains(t, err.Error(), "check the disk of the ledger directory")
			assert.Contains(t, slices.Collect(maps.Values(e.holders())), tc.req.Owner.ContainerID, "the claim stands")

			tc.undo(t, e)
			assert.Equal(t, tc.afterAll, e.holders())
		})
	}
}
