// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"context"
	goruntime "runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/nri/pkg/api"
	"github.com/gofrs/flock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// A create that passed its first rebuilding check when the news of a ledger
// started afresh arrives (here, as in production, while it waits for a
// background start record) must not decide against that ledger: the rebuild
// lifts the lineage fence to rebuild on the new lineage, and an Admit then
// would hand out a GPU the fresh ledger forgot. The create finds the
// rebuild running and is refused as "being rebuilt", without waiting for
// the ledger.
func TestCreateDuringInPlaceRebuildIsRefused(t *testing.T) {
	rt := newRuntime(t, nil)
	podA, podB := rt.addPod("a"), rt.addPod("b")
	var armed atomic.Bool
	var held atomic.Pointer[flock.Flock]
	waitReady := runPluginWith(t, rt, func(p *Plugin) {
		p.forceInPlace = true
		p.decisionCtx = func(ctx context.Context, limit time.Duration) (context.Context, context.CancelFunc) {
			if armed.CompareAndSwap(true, false) {
				// Inside the create, before it waits for start records:
				// what a background start record's commit does when it
				// finds the new lineage. The ledger lock, held by another
				// process, keeps the rebuild inside its reconcile.
				lk := rt.lockLedger()
				t.Cleanup(func() { _ = lk.Unlock() })
				p.ledgerTrouble(ledger.ErrLineageChanged)
				for p.admitting.TryRLock() {
					p.admitting.RUnlock()
					goruntime.Gosched()
				}
				held.Store(lk)
			}
			return decisionContext(ctx, limit)
		}
	})
	holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, holder))
	rt.start(podA, holder, 4242)
	startAfreshElsewhere(t, rt) // the fresh ledger forgot holder-1

	armed.Store(true)
	err := rt.create(podB, container(podB, "main", "c-1", "NVIDIA_VISIBLE_DEVICES=1"))
	require.ErrorContains(t, err, "being rebuilt", "refused at once, not decided (nor timed out) against the fresh ledger")
	require.NoError(t, held.Load().Unlock())
	waitReady(false)
	waitReady(true)
	assert.Equal(t, map[string]string{"1": holder.Id, "3": "hook-1"}, rt.holders())
}

// A stopped or removed container (or one of a stopped pod) leaves the set a
// rebuild works from before its claims are released, not after: a rebuild
// that listed it earlier then sees the change and runs again, instead of
// adopting back the claim the release ended (kept forever under release_on = "remove"). Observed here
// while the release waits for the ledger lock (before, the container was
// marked only once the release had given up).
func TestStopLeavesRebuildsBeforeItsRelease(t *testing.T) {
	for _, event := range []string{"stop", "remove", "pod stop"} {
		t.Run(event, func(t *testing.T) {
			rt := newRuntime(t, nil)
			podA := rt.addPod("a")
			var plugin atomic.Pointer[Plugin]
			runPluginWith(t, rt, func(p *Plugin) { plugin.Store(p) })
			p := plugin.Load()
			holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")
			require.NoError(t, rt.create(podA, holder))
			rt.start(podA, holder, 4242)

			lk := rt.lockLedger()
			done := make(chan struct{})
			go func() {
				defer close(done)
				switch event {
				case "stop":
					_, _ = rt.nri.StopContainer(context.Background(), &api.StopContainerRequest{Pod: podA, Container: holder})
				case "remove":
					_ = rt.nri.RemoveContainer(context.Background(), &api.RemoveContainerRequest{Pod: podA, Container: holder})
				default:
					_ = rt.nri.StopPodSandbox(context.Background(), &api.StopPodSandboxRequest{Pod: podA})
				}
			}()
			for {
				p.mu.Lock()
				stopped := p.tracked[holder.Id].stopped
				p.mu.Unlock()
				if stopped {
					break
				}
				select {
				case <-done:
					t.Fatal("the container was still in the rebuild set while its release ran")
				default:
					goruntime.Gosched()
				}
			}
			select {
			case <-done:
				t.Fatal("the release finished while the ledger lock was held")
			default:
			}
			require.NoError(t, lk.Unlock())
			<-done
			assert.Empty(t, rt.holders(), "the release went through once the lock was free")
		})
	}
}
