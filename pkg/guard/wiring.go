// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"context"
	"fmt"
	"log/slog"
	"slices"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// LedgerOptions are the ledger's tunables from the configuration: the one
// translation of [ledger] and the queue's TTLs into ledger.Options, used by
// the daemon, the OCI hook and gpu-guard-ctl alike so that all of them open
// the shared ledger with the same expiry rules. The clock, boot id and
// logger are the caller's to set.
func LedgerOptions(cfg config.Config) ledger.Options {
	return ledger.Options{
		LockTimeout:    cfg.Ledger.LockTimeout.Duration,
		AuditMaxBytes:  cfg.Ledger.AuditMaxBytes,
		ReservationTTL: cfg.Policy.ReservationTTL.Duration,
		QueueTTL:       cfg.Policy.QueueTTL.Duration,
		// Every process bounds draining claims the same way, whether or
		// not it has an observer (a hook-only host has none).
		DrainGrace: cfg.Observe.IdleGrace.Duration,
	}
}

// Prescreen tells a container that reaches no GPU (skip: nothing to check,
// no ledger access) from one that must go through Admit, for a front end that
// has no inventory loaded yet or could not load one (invErr). It applies the
// same resolution policies as Admit:
//   - with an inventory, a request that resolves to no device (and does not
//     name "all") is skipped; one that fails to resolve is left to Admit,
//     which words and audits the refusal;
//   - without one, a request that still resolves to nothing against an empty
//     inventory, with every id unknown and refused whatever unknown_device
//     says, names no GPU at all and is skipped; any other fails closed with
//     invErr. A privileged container follows policy.privileged: under
//     "declared" it claims only what it names (so it is skipped when it names
//     nothing, like the CNI and storage agents every node runs), under "all"
//     it resolves to "all" and under "reject" to an error, both failing
//     closed.
func Prescreen(cfg config.Config, inv *devices.Inventory, invErr error, req devices.Request) (skip bool, err error) {
	if invErr == nil {
		res, err := devices.NewResolver(inv, cfg.Policy).Resolve(req)
		if err != nil {
			return false, nil
		}
		return len(res.Devices) == 0 && !res.All, nil
	}
	none, nerr := devices.NewInventory("none", nil)
	if nerr != nil {
		return false, fmt.Errorf("the container names a GPU, but %w", invErr)
	}
	// Against an empty inventory every id is unknown: under
	// unknown_device = "ignore" a container naming GPU 0 would resolve to
	// nothing and pass unchecked. Without an inventory nobody can tell a
	// typo from a real GPU, so every named id counts.
	strict := cfg.Policy
	strict.UnknownDevice = config.UnknownReject
	res, err := devices.NewResolver(none, strict).Resolve(req)
	if err == nil && len(res.Devices) == 0 && !res.All {
		return true, nil
	}
	return false, fmt.Errorf("the container names a GPU, but %w", invErr)
}

// ClaimOutlivesStop reports whether a stopped container keeps its claims
// until it is removed (release_on = "remove"): a front end that tracks which
// containers hold claims keeps tracking it past its stop event.
func (g *Guard) ClaimOutlivesStop() bool { return g.policy.ReleaseOn == config.ReleaseOnRemove }

// ForgetVanishedPods drops the waiters of the pods of front end fe that the
// runtime no longer lists: a pod removed while the front end was away never
// gets its pod-removal event, and a waiter whose pod is gone never claims.
// livePods are the pod UIDs the runtime lists. It returns how many pods'
// waiters it dropped.
//
// It leaves claims alone: the reconcile of the same Synchronize decides
// them from the containers the runtime lists. A pod missing from the pod
// list is not always gone: containerd's ListPodSandboxes leaves out a pod
// in StateUnknown while ListContainers still lists its running containers,
// so releasing a vanished pod's claims here would end the claim the
// reconcile just kept for a container that runs on the GPU. A waiter of
// such a pod loses its place, but a live pod's next create retry queues it
// again.
func (g *Guard) ForgetVanishedPods(ctx context.Context, fe ledger.FrontEnd, livePods []string) (int, error) {
	live := make(map[string]bool, len(livePods))
	for _, uid := range livePods {
		live[uid] = true
	}
	return g.ForgetPodsNotLive(ctx, fe, func(uid string) bool { return live[uid] })
}

// ForgetPodsNotLive is ForgetVanishedPods with the live pods given by a
// function, asked under the ledger lock: a front end that admits creations
// meanwhile (a launched plugin after its in-place rebuild) counts the pod
// of a create that queued a waiter just before as live, which a list taken
// before the update would have left out.
func (g *Guard) ForgetPodsNotLive(ctx context.Context, fe ledger.FrontEnd, isLive func(uid string) bool) (int, error) {
	var dropped []ledger.Waiter
	err := g.update(ctx, "forget vanished pods", func(tx *ledger.Tx) bool {
		dropped = nil // fn may be retried
		// Gathered first: DropWaiter changes the queue.
		var gone []ledger.Waiter
		for _, w := range tx.ReadState().Waiters {
			if w.Owner.FrontEnd == fe && w.Owner.PodUID != "" && !isLive(w.Owner.PodUID) {
				gone = append(gone, w)
			}
		}
		for _, w := range gone {
			if tx.DropWaiter(w.Key, "pod gone: the runtime no longer lists it") {
				w.Devices = slices.Clone(w.Devices) // logged after the Tx, as Tx.Waiter would copy it
				dropped = append(dropped, w)
			}
		}
		return len(dropped) > 0
	})
	if err != nil {
		return 0, fmt.Errorf("drop the waiters of vanished pods: %w", err)
	}
	pods := map[string]bool{}
	for _, w := range dropped {
		pods[w.Owner.PodUID] = true
		g.log.Info("waiter dropped: its pod is no longer listed", append(ownerAttrs(w.Owner, w.Key),
			slog.Any("devices", deviceUUIDs(w.Devices)))...)
	}
	return len(pods), nil
}
