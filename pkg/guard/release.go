// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"path/filepath"
	"strconv"
	"strings"
	"time"

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
	// container of the same pod may take it over).
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
	// Deleted: the holder is an OCI hook's whose processes are gone and
	// whose container no runtime knows any more (release_on = "remove"):
	// its claim ends as at its removal (Action ReleaseNow, or MarkDraining
	// under release_requires_idle), and Why says so.
	Deleted bool
	// Unsure says, for such a holder kept until its removal (MarkStopped,
	// KeepStopped), why its container could not be told deleted (a runtime
	// root that cannot be read, none configured or none present): the
	// claim is kept, and only an operator can end it.
	Unsure string
	// Listed is, for such a holder whose container a runtime root still
	// has (stopped, not deleted), that root. The claim is kept as the
	// runtime's state says, but an engine that lost track of the container
	// (podman after its conmon was killed, then `podman rm -f`) never
	// deletes it there: the words for the holder say where it is and how
	// to end it (KeptRemedy).
	Listed string
	// EarlierIncarnation: the holder, kept running (Why says on what
	// finding), is an earlier incarnation of the requester's own container
	// (its id created again) in the cgroup both run in: the refusal says so
	// rather than naming the container as if it were another. Not set
	// where they share no cgroup (another runtime root's container of the
	// same id is another container).
	EarlierIncarnation bool
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
// A ticket of `gpu-guard-ctl run` (IsTicket) is the exception: released as
// soon as its process is gone, whatever the policy (see ticketVerdict).
//
// Releasable is the rule with release_requires_idle off and without the
// runtimes' state; ReleasableIdle is the whole rule, which the guard and
// ReleaseRule apply.
func Releasable(o ledger.Owner, releaseOn config.ReleaseOn, live Liveness) Verdict {
	return ReleasableIdle(o, releaseOn, false, live, nil)
}

// ReleasableIdle is the release rule under [observe]
// release_requires_idle = requiresIdle: as Releasable, except that a holder
// found exited under release_on = "stop" is marked draining, not released
// (its cgroup is empty, but only the GPU can say that its processes left it).
//
// Under release_on = "remove" an OCI hook holder (front end "hook") is
// also checked against the runtimes' state (rt; nil: never): once its
// processes are gone (found now, or recorded as stopped) and no runtime
// knows its container any more (Runtimes.Deleted), it has been removed, and
// its claim ends as at its removal: released, or marked draining under
// release_requires_idle. A hook front end learns of a removal only from the
// container's poststop, which runs when the container is deleted; a
// container whose create failed after its createRuntime hook admitted it (a
// later hook failed, a missing executable) is deleted without one under
// podman (which runs the poststop hooks itself) and crun, and no later event
// would ever name it. A container the runtime still knows (stopped, not
// deleted) keeps its claim, and so does one whose deletion cannot be told
// (Verdict.Unsure).
func ReleasableIdle(o ledger.Owner, releaseOn config.ReleaseOn, requiresIdle bool, live Liveness, rt Runtimes) Verdict {
	if IsTicket(o) {
		return ticketVerdict(o, live)
	}
	if !o.DrainingSince.IsZero() {
		return Verdict{Action: KeepDraining}
	}
	byRuntime := releaseOn == config.ReleaseOnRemove && o.FrontEnd == ledger.FrontEndHook && rt != nil
	if !o.StoppedAt.IsZero() {
		if byRuntime {
			return deletedVerdict(o, requiresIdle, rt, KeepStopped,
				"it exited at "+o.StoppedAt.UTC().Format(time.RFC3339))
		}
		return Verdict{Action: KeepStopped}
	}
	if o.Pid <= 0 && o.Cgroup == "" {
		return Verdict{Action: KeepNotStarted}
	}
	exited, why := live.Exited(ProcessOf(o))
	switch {
	case !exited:
		return Verdict{Action: KeepRunning, Why: why}
	case byRuntime:
		return deletedVerdict(o, requiresIdle, rt, MarkStopped, why)
	case releaseOn == config.ReleaseOnRemove:
		return Verdict{Action: MarkStopped, Why: why}
	case requiresIdle:
		return Verdict{Action: MarkDraining, Why: why}
	default:
		return Verdict{Action: ReleaseNow, Why: why}
	}
}

// deletedVerdict is the verdict on an exited OCI hook holder under
// release_on = "remove" (exited says how it was found so): its claim ends
// when no runtime knows its container any more, and is kept (keep: marked
// stopped, or left stopped) otherwise.
func deletedVerdict(o ledger.Owner, requiresIdle bool, rt Runtimes, keep ReleaseAction, exited string) Verdict {
	deleted, unsure, why, listedIn := rt.Deleted(o.ContainerID)
	if !deleted {
		v := Verdict{Action: keep, Why: exited}
		if unsure {
			v.Unsure = why
		} else {
			v.Listed = listedIn
		}
		return v
	}
	v := Verdict{Action: ReleaseNow, Deleted: true, Why: exited + "; removed: " + why}
	if requiresIdle {
		v.Action = MarkDraining
	}
	return v
}

// ticketVerdict is the release rule for a ticket of `gpu-guard-ctl run`
// (IsTicket), whatever release_on and release_requires_idle say. Both
// policies wait for an event that never comes for a ticket: no container
// runs under its id, so nothing removes it, and its process is the ctl,
// which never used the GPU, so there is nothing to drain. Kept until
// removal, a killed ctl's claim would never end. So a ticket whose process is
// gone is released now, including one that an earlier version recorded as
// stopped or draining (its process was found gone then).
func ticketVerdict(o ledger.Owner, live Liveness) Verdict {
	switch {
	case !o.StoppedAt.IsZero(), !o.DrainingSince.IsZero():
		return Verdict{Action: ReleaseNow, Why: "the process of ticket " + o.ContainerID + " (gpu-guard-ctl run, pid " +
			strconv.Itoa(o.Pid) + ") exited earlier"}
	case o.Pid <= 0 && o.Cgroup == "":
		// Not what AcquireTicket records (it sets the ctl's pid); without a
		// process to check, doubt keeps the claim.
		return Verdict{Action: KeepNotStarted}
	}
	exited, why := live.Exited(ProcessOf(o))
	if !exited {
		return Verdict{Action: KeepRunning, Why: why}
	}
	return Verdict{Action: ReleaseNow, Why: "ticket " + o.ContainerID + " (gpu-guard-ctl run): " + why}
}

// ReleaseRule is ReleasableIdle bound to a configuration, a liveness check
// and the runtimes' state, for callers that hold a config.Config rather than
// a Guard (ctl, the hook).
type ReleaseRule struct {
	releaseOn    config.ReleaseOn
	requiresIdle bool
	live         Liveness
	rt           Runtimes
}

// NewReleaseRule binds ReleasableIdle to cfg's policy, live and the state
// roots of cfg's [hook] runtime_roots (RuntimeRoots); nil live is
// liveness.New over the host's /sys/fs/cgroup and /proc.
func NewReleaseRule(cfg config.Config, live Liveness) ReleaseRule {
	if live == nil {
		live = liveness.New("", "")
	}
	return ReleaseRule{releaseOn: cfg.Policy.ReleaseOn, requiresIdle: cfg.Observe.ReleaseRequiresIdle, live: live,
		rt: RuntimeRoots(cfg.Hook.RuntimeRoots)}
}

// Check applies the rule to holder o.
func (r ReleaseRule) Check(o ledger.Owner) Verdict {
	return ReleasableIdle(o, r.releaseOn, r.requiresIdle, r.live, r.rt)
}

// CheckFor applies the rule to holder o as the request of requester sees
// it, as the guard's decision does: an earlier incarnation of the
// requester's own container is judged without the requester's process and
// as removed (see Guard.Admit). A waiter asks this, so that it sees at its
// next poll what its next Admit would release.
func (r ReleaseRule) CheckFor(o, requester ledger.Owner) Verdict {
	return releasableForRequester(o, requester, r.releaseOn, r.requiresIdle, r.live, r.rt)
}

// ReleaseAdvice is what an operator runs, once the ledger is reachable, to
// end the claims of container id, which is gone but whose release failed:
// gc releases an exited holder's claim, except under release_on = "remove",
// where it keeps it until a removal that will not come again.
func ReleaseAdvice(cfg config.Config, id string) string {
	if cfg.Policy.ReleaseOn == config.ReleaseOnRemove {
		return "run `sudo gpu-guard-ctl release --container " + id + " --reason \"poststop failed\"` once the ledger is reachable"
	}
	return "run `gpu-guard-ctl gc` once the ledger is reachable"
}

// KeptRemedy says how to end the claim of container id, an exited OCI hook
// holder kept under release_on = "remove" because runtime root root still
// has its container (Verdict.Listed), once its engine no longer lists it:
// delete it from that runtime, after which gc finds it removed, or release
// it by hand.
func KeptRemedy(root, id string) string {
	return "if its engine no longer lists it, delete it from the runtime (" + runtimeDelete(root, id) +
		"), then run `sudo gpu-guard-ctl gc`, or end its claim with " +
		"`sudo gpu-guard-ctl release --container " + id + " --reason \"container removed\"`"
}

// runtimeDelete is the command that deletes container id from the runtime
// whose state root is root: runc's or crun's by the root's name (their
// defaults are /run/runc and /run/crun), both when the name says neither.
func runtimeDelete(root, id string) string {
	cmd := func(rt string) string { return "`sudo " + rt + " --root " + root + " delete --force " + id + "`" }
	base := filepath.Base(root)
	switch {
	case strings.Contains(base, "crun"):
		return cmd("crun")
	case strings.Contains(base, "runc"):
		return cmd("runc")
	}
	return cmd("runc") + " or " + cmd("crun") + ", whichever runtime keeps its state there"
}
