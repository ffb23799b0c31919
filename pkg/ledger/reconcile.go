// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"fmt"
)

// Reconcile makes the claims of front end fe match live, the runtime's list
// of its running (or created) containers and the devices each reaches:
//
//   - a claim of fe whose container is not listed, or whose device the
//     listed container no longer reaches, is released ("stale"), unless it
//     is draining (its container stopped under release_requires_idle);
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
func (tx *Tx) Reconcile(fe FrontEnd, live []Holding) ReconcileResult {
	tx.check()
	var res ReconcileResult
	if tx.freshLineage {
		// Store the new lineage now, even if nothing else changes: the
		// daemon fences its later decisions with the lineage it reconciled,
		// which must therefore be the one on disk. Audited, as every
		// commit is: one that changes nothing else has no other record.
		tx.touch()
		tx.record(OpLineage, nil, "", nil, fmt.Sprintf("lineage %s stored (%s)", tx.st.Lineage, tx.lineageOrigin()))
		tx.freshLineage = false // stored by this commit
	}
	res.Lineage = tx.st.Lineage
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

	// A draining claim's container has stopped, so the runtime no longer
	// lists it: it ends when its processes leave the GPU or after the drain
	// grace (expireDraining), not here.
	res.Released = tx.releaseWhere(func(c *Claim) bool {
		return c.Owner.FrontEnd == fe && !listed[c.Owner.ContainerID][c.Device.UUID] && c.Owner.DrainingSince.IsZero()
	}, "stale: the runtime no longer lists this container on the device")
	tx.clearConflictsWhere(func(c *Conflict) bool {
		return c.Owner.FrontEnd == fe && !listed[c.Owner.ContainerID][c.Device.UUID]
	}, "stale: the runtime no longer lists this container on the device")

	res.Adopted, res.Conflicts = tx.adoptListed(fe, live, nil)
	tx.maintain()
	return res
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
