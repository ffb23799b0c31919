// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// ReleaseAction is what the release rule says to do with a holder's claim
// that no stop or remove event ended.
type ReleaseAction string

// Release actions, from "nothing to do" to "release".
const (
	// KeepRunning: the holder has processes, or the evidence is missing or
	// ambiguous. A claim is never released on doubt.
	KeepRunning ReleaseAction = "running"
	// KeepNotStarted: the holder was created but never started (no pid, no
	// cgroup): it has no process yet, and containerd sends no stop event for
	// a container that never ran.
	KeepNotStarted ReleaseAction = "not-started"
	// KeepStopped: the holder is already recorded as stopped (release_on =
	// "remove"); its claim lasts until its container is removed.
	KeepStopped ReleaseAction = "stopped"
	// MarkStopped: the holder's processes are gone, but release_on =
	// "remove" keeps the claim until removal; the ledger should record it
	// as stopped (it then stops being a candidate for liveness checks and a
	// restart in the same pod may take it over).
	MarkStopped ReleaseAction = "mark-stopped"
	// KeepDraining: the holder stopped under release_requires_idle; its
	// claim is kept until its processes leave the GPU (FinishDraining) or
	// the drain grace passes (the ledger releases it then).
	KeepDraining ReleaseAction = "draining"
	// MarkDraining: the holder's processes are gone from its cgroup, but
	// release_requires_idle keeps the claim until the GPU shows them gone
	// too: the ledger should record it as draining.
	MarkDraining ReleaseAction = "mark-draining"
	// ReleaseNow: the holder's processes are gone and release_on = "stop":
	// its claim may be released now.
	ReleaseNow ReleaseAction = "release"
)

// Verdict is the answer of the release rule for one holder.
type Verdict struct {
	Action ReleaseAction
	// Why is the liveness finding ("cgroup /k8s.io/abc has no processes"),
	// for the audit trail and messages; empty when no check was made.
	Why string
}

// Release reports whether the claim may be released now.
func (v Verdict) Release() bool { return v.Action == ReleaseNow }

// Exited reports whether the check found the holder's processes gone just
// now (a later Admit would change the ledger: release or mark stopped).
func (v Verdict) Exited() bool {
	return v.Action == ReleaseNow || v.Action == MarkStopped || v.Action == MarkDraining
}

// ProcessOf is what the liveness check needs of a holder.
func ProcessOf(o ledger.Owner) liveness.Process {
	return liveness.Process{Pid: o.Pid, PidStart: o.PidStart, Cgroup: o.Cgroup}
}

// Releasable is the one rule that decides whether a holder's claim may be
// released without a stop or remove event for it: the guard before refusing a
// request, `gpu-guard-ctl gc` and `status` (a "stale" claim), and the waiting
// OCI hook (whether an Admit would change anything) all ask it, so that they
// give one answer.
//
// A draining holder, one already recorded as stopped, or one that never
// started, is kept without a check. Otherwise live decides; a holder whose
// processes are gone is released under release_on = "stop" and marked
// stopped (kept until its container is removed) under "remove".
//
// Releasable is the rule with release_requires_idle off; ReleasableIdle
// is the whole rule, which the guard and ReleaseRule apply.
func Releasable(o ledger.Owner, releaseOn config.ReleaseOn, live Liveness) Verdict {
	return ReleasableIdle(o, releaseOn, false, live)
}

// ReleasableIdle is the release rule under [observe]
// release_requires_idle = requiresIdle: as Releasable, except that a holder
// found exited under release_on = "stop" is marked draining, not released
// (its cgroup is empty, but only the GPU can say that its processes left it).
func ReleasableIdle(o ledger.Owner, releaseOn config.ReleaseOn, requiresIdle bool, live Liveness) Verdict {
	if !o.DrainingSince.IsZero() {
		return Verdict{Action: KeepDraining}
	}
	if !o.StoppedAt.IsZero() {
		return Verdict{Action: KeepStopped}
	}
	if o.Pid <= 0 && o.Cgroup == "" {
		return Verdict{Action: KeepNotStarted}
	}
	exited, why := live.Exited(ProcessOf(o))
	switch {
	case !exited:
		return Verdict{Action: KeepRunning, Why: why}
	case releaseOn == config.ReleaseOnRemove:
		return Verdict{Action: MarkStopped, Why: why}
	case requiresIdle:
		return Verdict{Action: MarkDraining, Why: why}
	default:
		return Verdict{Action: ReleaseNow, Why: why}
	}
}

// ReleaseRule is Releasable bound to a configuration and a liveness check,
// for callers that hold a config.Config rather than a Guard (ctl, the hook).
type ReleaseRule struct {
	releaseOn    config.ReleaseOn
	requiresIdle bool
	live         Liveness
}

// NewReleaseRule binds Releasable to cfg's policy and live; nil live is
// liveness.New over the host's /sys/fs/cgroup and /proc.
func NewReleaseRule(cfg config.Config, live Liveness) ReleaseRule {
	if live == nil {
		live = liveness.New("", "")
	}
	return ReleaseRule{releaseOn: cfg.Policy.ReleaseOn, requiresIdle: cfg.Observe.ReleaseRequiresIdle, live: live}
}

// Check applies the rule to holder o.
func (r ReleaseRule) Check(o ledger.Owner) Verdict {
	return ReleasableIdle(o, r.releaseOn, r.requiresIdle, r.live)
}
