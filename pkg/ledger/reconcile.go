// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"fmt"
	"slices"
)

// OpUnlisted is the audit operation of a reconcile that kept the claims (or
// conflict records) of a container the runtime does not list, because the
// release rule found its processes still running or could not tell (Reason
// says what it found).
const OpUnlisted = "unlisted"

// Reconcile is ReconcileWith with a rule that releases every claim of fe
// whose container is not listed. Only for a list known to name every
// container that still runs (tests, fixtures); the daemon passes the guard's
// rule, because containerd leaves running containers out of its list.
func (tx *Tx) Reconcile(fe FrontEnd, live []Holding) ReconcileResult {
	return tx.ReconcileWith(fe, live, releaseUnlisted).ReconcileResult
}

// releaseUnlisted is the rule of a list known to be complete: a container it
// leaves out is gone.
func releaseUnlisted(Owner) UnlistedVerdict { return UnlistedVerdict{Action: UnlistedRelease} }

// UnlistedAction is what ReconcileWith does with the claims of a container
// the runtime does not list.
type UnlistedAction int

const (
	// UnlistedKeep keeps them (the zero value: doubt keeps a claim). Not
	// being listed is no evidence of exit: containerd leaves out of its
	// list a running container it could not load after a restart (CRI
	// state UNKNOWN: its shim did not answer in time, its task is paused),
	// and that container goes on using its GPU.
	UnlistedKeep UnlistedAction = iota
	// UnlistedRelease releases them ("stale"): its processes are gone, or
	// it never had any.
	UnlistedRelease
	// UnlistedDrain marks them draining (release_requires_idle): its
	// processes are gone from its cgroup; the GPU has to show them gone
	// too.
	UnlistedDrain
)

// UnlistedVerdict is a release rule's answer about a container the runtime
// does not list.
type UnlistedVerdict struct {
	Action UnlistedAction
	// Why is what the rule found ("cgroup /k8s.io/abc has processes"), for
	// the audit records.
	Why string
}

// UnlistedRule decides about o, a container of the reconciled front end
// that holds claims or conflict records the runtime does not list it for
// at all. Its verdict holds for every claim and record of the container:
// it is asked once per distinct process they record (the verdict keeping
// most stands), about an owner recording no process only when none records
// one, and never about a draining claim. It runs under the ledger lock: it
// must be quick.
type UnlistedRule func(o Owner) UnlistedVerdict

// ReconcileReport is what ReconcileWith changed: ReconcileResult, and what
// became of the claims of containers not listed that the rule did not let go.
type ReconcileReport struct {
	ReconcileResult
	// Kept are the claims of containers not listed that the rule keeps
	// (UnlistedKeep): they still run, or cannot be told gone.
	Kept []Claim
	// Drained are the claims the rule marked draining (UnlistedDrain).
	Drained []Claim
}

// ReconcileWith makes the claims of front end fe match live, the runtime's
// list of its running (or created) containers and the devices each reaches:
//
//   - a claim of fe whose listed container no longer reaches its device is
//     released ("stale");
//   - a claim of fe whose container is not listed at all is released, marked
//     draining or kept as unlisted says (nil: kept); a kept one gets an
//     OpUnlisted audit record at every reconcile that keeps it, and ends as
//     any holder's claim does: at its container's stop or removal, or once a
//     liveness check finds it exited. A draining claim is left alone: its
//     container stopped under release_requires_idle, and it ends when its
//     processes leave the GPU or after the drain grace (expireDraining);
//   - a conflict record of fe whose container is not listed on its device
//     ends, unless unlisted keeps its container (a running container on a
//     GPU another holds is still in conflict there);
//   - a listed device with no claim is adopted by its container (reality
//     wins over a reservation: the reservation is dropped);
//   - a listed container on a device another container holds gets a Conflict
//     record — nothing is killed, ctl and metrics show it, and the record
//     becomes the claim once the device is free;
//   - claims and conflict records of other front ends are left alone.
//
// When two listed containers reach one unclaimed device, the one earlier in
// live adopts it and the other is recorded as a conflict. A state whose
// lineage is not stored yet (it started empty in this Update, or its file
// predates lineages) is written even if nothing else changed, and the result
// carries the lineage.
func (tx *Tx) ReconcileWith(fe FrontEnd, live []Holding, unlisted UnlistedRule) ReconcileReport {
	tx.check()
	var rep ReconcileReport
	if tx.freshLineage {
		// Store the new lineage now, even if nothing else changes: the
		// daemon fences its later decisions with the lineage it reconciled,
		// which must therefore be the one on disk. Audited, as every
		// commit is: one that changes nothing else has no other record.
		tx.touch()
		tx.record(OpLineage, nil, "", nil, fmt.Sprintf("lineage %s stored (%s)", tx.st.Lineage, tx.lineageOrigin()))
		tx.freshLineage = false // stored by this commit
	}
	rep.Lineage = tx.st.Lineage
	listed := make(map[string]map[string]bool, len(live))
	for _, h := range live {
		id := h.Owner.ContainerID
		if id == "" {
			continue
		}
		if listed[id] == nil {
			listed[id] = make(map[string]bool, len(h.Devices))
		}
		for _, d := range h.Devices {
			listed[id][d.UUID] = true
		}
	}

	const stale = "stale: the runtime no longer lists this container on the device"
	// A listed container that no longer reaches a device it holds: the
	// runtime's list is the evidence (it runs, and not on that device).
	moved := tx.releaseWhere(func(c *Claim) bool {
		return c.Owner.FrontEnd == fe && listed[c.Owner.ContainerID] != nil && !listed[c.Owner.ContainerID][c.Device.UUID] &&
			c.Owner.DrainingSince.IsZero()
	}, stale)
	rep.Released = append(rep.Released, moved...)
	tx.clearConflictsWhere(func(c *Conflict) bool {
		return c.Owner.FrontEnd == fe && listed[c.Owner.ContainerID] != nil && !listed[c.Owner.ContainerID][c.Device.UUID]
	}, stale)

	for _, u := range tx.judgeUnlisted(fe, listed, unlisted) {
		ours := func(o *Owner) bool { return o.FrontEnd == fe && o.ContainerID == u.id }
		switch u.v.Action {
		case UnlistedRelease:
			why := "stale: the runtime no longer lists this container"
			if u.v.Why != "" {
				why += " (" + u.v.Why + ")"
			}
			rep.Released = append(rep.Released, tx.releaseWhere(func(c *Claim) bool {
				return ours(&c.Owner) && c.Owner.DrainingSince.IsZero()
			}, why)...)
			tx.clearConflictsWhere(func(c *Conflict) bool { return ours(&c.Owner) }, why)
		case UnlistedDrain:
			why := "stale: the runtime no longer lists this container"
			if u.v.Why != "" {
				why += " (" + u.v.Why + ")"
			}
			rep.Drained = append(rep.Drained, tx.drainWhere(func(c *Claim) bool { return ours(&c.Owner) }, why)...)
			// A record ends when its container stops, under every
			// release rule: a container that is gone takes nothing over.
			tx.clearConflictsWhere(func(c *Conflict) bool { return ours(&c.Owner) }, why)
		default:
			var uuids []string
			for _, c := range tx.st.Claims {
				if ours(&c.Owner) && c.Owner.DrainingSince.IsZero() {
					rep.Kept = append(rep.Kept, c)
					uuids = append(uuids, c.Device.UUID)
				}
			}
			for _, c := range tx.st.Conflicts {
				if ours(&c.Owner) {
					uuids = append(uuids, c.Device.UUID)
				}
			}
			why := "kept: the runtime does not list this container, but it is not known to have exited"
			if u.v.Why != "" {
				why += " (" + u.v.Why + ")"
			}
			tx.record(OpUnlisted, &u.owner, "", uuids, why+"; containerd leaves out of its list a running container it "+
				"could not load after a restart (CRI state UNKNOWN). It ends at the container's stop or removal, "+
				"or once it is found exited")
		}
	}

	rep.Adopted, rep.Conflicts = tx.adoptListed(fe, live, nil)
	tx.maintain()
	return rep
}

// unlistedContainer is a container not listed, with the rule's verdict on
// it and the owner that verdict was given for (the audit records name it).
type unlistedContainer struct {
	id    string
	owner Owner
	v     UnlistedVerdict
}

// unlistedRank orders verdicts by how much they keep: where a container's
// owners get different verdicts, the one keeping most stands.
func unlistedRank(a UnlistedAction) int {
	switch a {
	case UnlistedKeep:
		return 2
	case UnlistedDrain:
		return 1
	default:
		return 0
	}
}

// judgeUnlisted gives one verdict per container of fe that has a claim (not
// draining) or conflict record and that live does not list at all, in order
// of first appearance, claims first. All of a container's claims and
// records share it: they say where one container runs. So the rule is asked
// about the processes they record (each distinct one once; the verdict
// keeping most stands), and about a process-less owner only when none
// records one. Asked apart, a record made without the process (a list
// entry that carried none) would read as a container never started and be
// cleared while the claim that names the process is kept: the device the
// record says the container runs on would be free while it runs there.
// A nil rule keeps them all: doubt keeps a claim.
func (tx *Tx) judgeUnlisted(fe FrontEnd, listed map[string]map[string]bool, unlisted UnlistedRule) []unlistedContainer {
	var ids []string
	owners := map[string][]*Owner{}
	add := func(o *Owner) {
		if o.FrontEnd != fe || o.ContainerID == "" || listed[o.ContainerID] != nil {
			return
		}
		if owners[o.ContainerID] == nil {
			ids = append(ids, o.ContainerID)
		}
		owners[o.ContainerID] = append(owners[o.ContainerID], o)
	}
	for i := range tx.st.Claims {
		if tx.st.Claims[i].Owner.DrainingSince.IsZero() {
			add(&tx.st.Claims[i].Owner)
		}
	}
	for i := range tx.st.Conflicts {
		add(&tx.st.Conflicts[i].Owner)
	}
	out := make([]unlistedContainer, 0, len(ids))
	for _, id := range ids {
		var ask []*Owner
		for _, o := range owners[id] {
			if recordsProcess(o) && !slices.ContainsFunc(ask, func(a *Owner) bool { return sameProcess(a, o) }) {
				ask = append(ask, o)
			}
		}
		if len(ask) == 0 {
			ask = owners[id][:1]
		}
		u := unlistedContainer{id: id, owner: *ask[0]} // the zero verdict keeps
		if unlisted != nil {
			for i, o := range ask {
				if v := unlisted(*o); i == 0 || unlistedRank(v.Action) > unlistedRank(u.v.Action) {
					u.owner, u.v = *o, v
				}
			}
		}
		out = append(out, u)
	}
	return out
}

// sameProcess reports whether a and b record the same process (pid, its
// start time and cgroup all equal).
func sameProcess(a, b *Owner) bool {
	return a.Pid == b.Pid && a.PidStart == b.PidStart && a.Cgroup == b.Cgroup
}

// drainWhere marks draining the claims match selects that are not draining
// yet, with one OpDraining record per container (see releaseWhere), and
// returns them.
func (tx *Tx) drainWhere(match func(*Claim) bool, reason string) []Claim {
	var out []Claim
	for i := range tx.st.Claims {
		c := &tx.st.Claims[i]
		if !c.Owner.DrainingSince.IsZero() || !match(c) {
			continue
		}
		c.Owner.DrainingSince = tx.now
		out = append(out, *c)
	}
	if len(out) == 0 {
		return nil
	}
	tx.touch()
	tx.recordPerContainer(OpDraining, out,
		fmt.Sprintf("%s: claim kept until its processes leave the GPU (at most %s)", reason, tx.l.opts.DrainGrace))
	return out
}

// lineageOrigin says why a state without a stored lineage got one (prepare's
// origins, told apart by what they leave in the Tx).
func (tx *Tx) lineageOrigin() string {
	for i := range tx.audit {
		if tx.audit[i].Op == OpDiscard {
			return "fresh start: the state of an earlier boot was discarded"
		}
	}
	if tx.base.Generation == 0 {
		return "fresh start: a new ledger"
	}
	return "the state file had none: written by an older nri-gpu-guard, or restored from an old copy"
}

// adoptListed is the adopting half of Reconcile: every device of live
// without a claim is claimed by its listed container (a reservation on it
// is dropped: reality wins), and a listed container on a device another
// container holds gets a Conflict record. The one earlier in live adopts a
// device two listed containers reach. why, when set, gives the reason of
// the audit records of live[i] (Recover says where it found the
// container); nil words them as reconcile does.
func (tx *Tx) adoptListed(fe FrontEnd, live []Holding, why func(i int) string) (adoptedClaims []Claim, conflicts []Conflict) {
	for i, h := range live {
		owner := h.Owner
		if owner.ContainerID == "" {
			continue
		}
		if owner.FrontEnd == "" {
			owner.FrontEnd = fe
		}
		adoptReason, conflictPrefix := "running container without a claim", ""
		if why != nil {
			adoptReason = why(i)
			conflictPrefix = adoptReason + "; "
		}
		var adopted []string
		for _, d := range uniqueDevices(h.Devices) {
			if d.UUID == "" {
				continue
			}
			if k, ok := tx.claimIndex(d.UUID); ok && SameIncarnation(&tx.st.Claims[k].Owner, &owner) {
				tx.learnStarted(&tx.st.Claims[k].Owner, &owner, d.UUID)
				continue
			}
			if holder := tx.conflictingClaim(d, &owner); holder != nil {
				c := Conflict{Device: d, Owner: owner, Since: tx.now}
				if j := tx.conflictIndex(d.UUID, owner.ContainerID); j >= 0 {
					// The record learns the process the runtime lists now (it
					// was recorded before the container started, or while a
					// start event was missed): promoted once the holder goes,
					// a claim without a process is never found exited.
					if SameIncarnation(&tx.st.Conflicts[j].Owner, &owner) {
						tx.learnStarted(&tx.st.Conflicts[j].Owner, &owner, d.UUID)
					}
					c = tx.st.Conflicts[j]
				} else {
					tx.st.Conflicts = append(tx.st.Conflicts, c)
					tx.touch()
					tx.record(OpConflict, &owner, "", []string{d.UUID},
						fmt.Sprintf("%srunning on a device held by %s through %s", conflictPrefix, DescribeOwner(holder.Owner), DescribeDevice(holder.Device)))
				}
				conflicts = append(conflicts, c)
				continue
			}
			tx.dropReservationsOn(d, "in use by running "+DescribeOwner(owner))
			c := Claim{Device: d, Owner: owner, Source: h.Source, Since: tx.now}
			tx.insertClaim(c)
			adoptedClaims = append(adoptedClaims, c)
			adopted = append(adopted, d.UUID)
		}
		if len(adopted) > 0 {
			tx.record(OpAdopt, &owner, "", adopted, adoptReason)
		}
	}
	return adoptedClaims, conflicts
}

func (tx *Tx) conflictIndex(uuid, containerID string) int {
	for i := range tx.st.Conflicts {
		if c := &tx.st.Conflicts[i]; c.Device.UUID == uuid && c.Owner.ContainerID == containerID {
			return i
		}
	}
	return -1
}

// fillStarted copies process details the runtime reports into a claim that
// lacks them (the daemon restarted after the container started). It reports
// whether anything changed.
// learnStarted fills into dst, a claim's or conflict record's owner on the
// device uuid, the process details the runtime lists for it (owner), and
// records that it did.
func (tx *Tx) learnStarted(dst, owner *Owner, uuid string) {
	if fillStarted(dst, owner) {
		tx.touch()
		tx.record(OpStarted, owner, "", []string{uuid}, "process details reported by the runtime at reconcile")
	}
}

func fillStarted(dst, src *Owner) bool {
	changed := false
	if dst.Pid == 0 && src.Pid != 0 {
		dst.Pid, dst.PidStart = src.Pid, src.PidStart
		changed = true
	}
	if dst.Cgroup == "" && src.Cgroup != "" {
		dst.Cgroup = src.Cgroup
		changed = true
	}
	if dst.StartedAt.IsZero() && !src.StartedAt.IsZero() {
		dst.StartedAt = src.StartedAt
		changed = true
	}
	return changed
}
