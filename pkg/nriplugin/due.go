// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// A release whose ledger update failed (the ledger lock held past the
// handler's budget, say) is due: nothing else would ever end it. containerd
// sends StopContainer and RemoveContainer once each; a launched plugin gets
// no new Synchronize; and the liveness check keeps the claim of a container
// created but never started (no pid, no cgroup), so neither a later
// admission nor gpu-guard-ctl gc releases it. The plugin retries every due
// release at the start of each later handler that takes the ledger lock
// anyway (before its own work, so that a create sees the GPUs freed) and on
// a timer with backoff, until it succeeds; a reconcile (Synchronize, an
// in-place rebuild) settles the containers' ones, since it releases every
// claim of a container the runtime no longer lists.

// releaseKind is what a due release does.
type releaseKind int

const (
	// releaseStop is StopContainer's release (guard.Stopped): the claims go
	// under release_on = "stop", are marked stopped under "remove".
	releaseStop releaseKind = iota
	// releaseRemove is RemoveContainer's (guard.Removed).
	releaseRemove
	// releasePod is StopPodSandbox's and RemovePodSandbox's
	// (guard.PodGone): the pod's claims and waiters go.
	releasePod
)

func (k releaseKind) String() string {
	switch k {
	case releaseStop:
		return "stop"
	case releaseRemove:
		return "remove"
	default:
		return "pod gone"
	}
}

// dueRelease is one release to retry.
type dueRelease struct {
	kind releaseKind
	// owner is the container as its event named it (stop, remove); for a
	// pod, its uid and sandbox id (and names, for the log).
	owner ledger.Owner
	// seq orders the entries and tells a retry whether the entry it ran is
	// still the one due (an event may have replaced it meanwhile).
	seq   uint64
	since time.Time
	tries int
	err   error
}

// dueKey is the key of a due release: the container id, or the pod's
// sandbox id (container ids never contain '/').
func dueKey(kind releaseKind, o ledger.Owner) string {
	if kind == releasePod {
		return "pod/" + o.PodSandboxID
	}
	return o.ContainerID
}

// stillDue reports whether the due release of key is still the one of seq
// (no event replaced it since it was read).
func (p *Plugin) stillDue(key string, seq uint64) bool {
	p.dueMu.Lock()
	defer p.dueMu.Unlock()
	cur, ok := p.due[key]
	return ok && cur.seq == seq
}

// releaseDue runs one due release.
func (p *Plugin) releaseDue(ctx context.Context, g *guard.Guard, r dueRelease) error {
	switch r.kind {
	case releaseStop:
		return g.Stopped(ctx, r.owner)
	case releaseRemove:
		return g.Removed(ctx, r.owner)
	default:
		return g.PodGone(ctx, ledger.FrontEndNRI, r.owner.PodUID, r.owner.PodSandboxID)
	}
}

// released updates tracked once a release succeeded, as its handler does.
func (p *Plugin) released(g *guard.Guard, r dueRelease) {
	switch r.kind {
	case releaseStop:
		if !g.ClaimOutlivesStop() {
			p.untrack(r.owner.ContainerID)
		} // else kept (stopped): its removal comes
	case releaseRemove:
		p.untrack(r.owner.ContainerID)
	default:
		p.untrackPod(r.owner.PodSandboxID)
	}
}

// addDue records a release that failed with err, replacing any due for the
// same container or pod (a removal ends what its stop had to), and makes
// sure the timer retries it.
func (p *Plugin) addDue(kind releaseKind, o ledger.Owner, err error) {
	key := dueKey(kind, o)
	p.dueMu.Lock()
	p.dueSeq++
	r := dueRelease{kind: kind, owner: o, seq: p.dueSeq, since: time.Now(), tries: 1, err: err}
	if old, ok := p.due[key]; ok {
		r.since, r.tries = old.since, old.tries+1
	}
	p.due[key] = r
	p.showDueLocked()
	start := !p.retrying
	p.retrying = true
	p.dueMu.Unlock()
	if start {
		go p.retryReleases()
	}
}

// clearDue drops the due release of a container or pod whose own event's
// release just succeeded.
func (p *Plugin) clearDue(kind releaseKind, o ledger.Owner) {
	key := dueKey(kind, o)
	p.dueMu.Lock()
	if _, ok := p.due[key]; ok {
		delete(p.due, key)
		p.showDueLocked()
	}
	p.dueMu.Unlock()
}

// dueMark is the last due release recorded so far: a reconcile started
// after it settles it and every earlier one (settleDue).
func (p *Plugin) dueMark() uint64 {
	p.dueMu.Lock()
	defer p.dueMu.Unlock()
	return p.dueSeq
}

// settleDue drops the containers' due releases up to mark once a reconcile
// has made the ledger match the runtime's containers: it released the
// claims of every container the runtime no longer listed, which a container
// with a due release is (containerd lists neither stopped nor removed
// ones). A pod's due release is kept: a reconcile keeps its waiters.
func (p *Plugin) settleDue(mark uint64) {
	p.dueMu.Lock()
	settled := 0
	for key, r := range p.due {
		if r.kind != releasePod && r.seq <= mark {
			delete(p.due, key)
			settled++
		}
	}
	if settled > 0 {
		p.showDueLocked()
	}
	p.dueMu.Unlock()
	if settled > 0 {
		p.log.Info("failed releases settled by reconciling the ledger with the runtime's containers", "settled", settled)
	}
}

// showDueLocked publishes how many releases are due; dueMu is held, so
// that the gauge follows the changes in the order they were made (a count
// published after the lock is released could land after a newer one).
func (p *Plugin) showDueLocked() {
	if p.gauges != nil {
		p.gauges.SetReleasesDue(len(p.due))
	}
}

// hasDue reports whether any release is due.
func (p *Plugin) hasDue() bool {
	p.dueMu.Lock()
	defer p.dueMu.Unlock()
	return len(p.due) > 0
}

// lockReleasing takes the releasing slot within ctx.
func (p *Plugin) lockReleasing(ctx context.Context) bool {
	select {
	case p.releasing <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

func (p *Plugin) unlockReleasing() { <-p.releasing }

// retryDue retries the due releases, oldest first, within ctx. It stops at
// the first that fails: the ledger lock is then busy, and every other one
// would wait for it too. progressed reports whether one succeeded.
func (p *Plugin) retryDue(ctx context.Context, g *guard.Guard, by string) (progressed bool) {
	if g == nil || !p.hasDue() || !p.lockReleasing(ctx) {
		return false
	}
	defer p.unlockReleasing()
	p.dueMu.Lock()
	todo := make([]dueRelease, 0, len(p.due))
	for _, r := range p.due {
		todo = append(todo, r)
	}
	p.dueMu.Unlock()
	slices.SortFunc(todo, func(a, b dueRelease) int { return cmp.Compare(a.seq, b.seq) })
	for _, r := range todo {
		key := dueKey(r.kind, r.owner)
		err := p.releaseDue(ctx, g, r)
		still := p.stillDue(key, r.seq)
		if err == nil && still {
			// Tracking follows the release before the entry leaves the
			// due list: whoever sees the count of due releases fall (the
			// gauge) sees the container's events over too.
			p.released(g, r)
		}
		p.dueMu.Lock()
		if cur, ok := p.due[key]; ok && cur.seq == r.seq {
			if err == nil {
				delete(p.due, key)
			} else {
				cur.tries++
				cur.err = err
				p.due[key] = cur
			}
		}
		p.showDueLocked()
		p.dueMu.Unlock()
		if err != nil {
			p.ledgerTrouble(err)
			p.log.Warn("retrying a failed release failed; retried again in the background and at the next NRI event (its GPU stays held until then)",
				"release", r.kind.String(), "container_id", r.owner.ContainerID, "pod_sandbox_id", r.owner.PodSandboxID,
				"tries", r.tries+1, "due_for", time.Since(r.since).Round(time.Millisecond).String(), "retried_by", by, "error", err)
			return progressed
		}
		progressed = true
		if still {
			p.log.Info("released on retry after a failed release", "release", r.kind.String(),
				"container_id", r.owner.ContainerID, "pod_uid", r.owner.PodUID, "pod_sandbox_id", r.owner.PodSandboxID,
				"namespace", r.owner.Namespace, "pod", r.owner.Pod, "tries", r.tries+1,
				"due_for", time.Since(r.since).Round(time.Millisecond).String(), "retried_by", by)
		}
	}
	return progressed
}

// retryReleases is the timer of the due releases: it retries them with
// backoff (minBackoff doubling to maxBackoff, back to minBackoff after a
// success) until none is left or the plugin stops (halt).
func (p *Plugin) retryReleases() {
	backoff := minBackoff
	for {
		timer := time.NewTimer(backoff)
		select {
		case <-p.life.Done():
			timer.Stop()
			p.dueMu.Lock()
			p.retrying = false
			p.dueMu.Unlock()
			return
		case <-timer.C:
		}
		progressed := false
		if g := p.Guard(); g != nil {
			ctx, cancel := context.WithTimeout(p.life, g.Config().Ledger.LockTimeout.Duration)
			p.settleStarts(ctx)
			progressed = p.retryDue(ctx, g, "timer")
			cancel()
		}
		p.dueMu.Lock()
		if len(p.due) == 0 {
			p.retrying = false
			p.dueMu.Unlock()
			return
		}
		p.dueMu.Unlock()
		if progressed {
			backoff = minBackoff
		} else {
			backoff = min(backoff*2, maxBackoff)
		}
	}
}

// claimDueFor makes way for a create of container id that is decided on
// the ledger: the due release of an earlier container of that id must have
// run first, since releases name a container by id alone and a retry after
// the admission would end the new container's claims. An error refuses the
// create. (A pod's due release names its sandbox, which a new sandbox of
// the same pod never shares: it stays due.)
func (p *Plugin) claimDueFor(ctx context.Context, id string) error {
	if !p.hasDue() {
		return nil
	}
	if !p.lockReleasing(ctx) {
		// Not wrapped, like every refusal (see refusal): a context error
		// must never read as the plugin timing out.
		return fmt.Errorf("nri-gpu-guard: no decision for container %s before the request deadline (a failed release was being retried); "+
			"refused to stay safe, retrying is automatic: %v", id, ctx.Err())
	}
	// Held to the end of the check only: once no entry of id is due, none
	// is ever added before this container's own stop or removal.
	defer p.unlockReleasing()
	p.dueMu.Lock()
	defer p.dueMu.Unlock()
	if r, ok := p.due[id]; ok && r.kind != releasePod {
		return fmt.Errorf("nri-gpu-guard: container id %s belonged to a container whose release failed and is still being retried "+
			"(last error: %v); refused to stay safe until it is released, retrying is automatic", id, r.err)
	}
	return nil
}
