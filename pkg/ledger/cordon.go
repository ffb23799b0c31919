// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// Persistent device states: cordons (a device taken out of new claims) and
// draining claims (a stopped holder's claim kept until its processes have
// left the GPU). Both live in the state like claims, are journaled by device
// UUID (cordons) or with the claim (draining), and survive recovery.

// Cordon sources.
const (
	CordonOperator  = "operator"  // gpu-guard-ctl cordon
	CordonIntruder  = "intruder"  // the observer found a process the ledger does not explain ([observe] on_intruder = "cordon")
	CordonUnhealthy = "unhealthy" // the observer found the device sick (critical Xid, lost, needs a reset)
)

// Audit operations of device states.
const (
	OpCordon   = "cordon"   // a device was taken out of new claims (Reason: source and why)
	OpUncordon = "uncordon" // a cordon was lifted
	OpDraining = "draining" // a stopped holder's claims are kept until its processes leave the GPU
)

// ErrCordoned is wrapped by every refusal of a cordoned device (see CordonError).
var ErrCordoned = errors.New("device cordoned")

// CordonError lists the cordons standing between a request and its devices.
type CordonError struct {
	Cordoned []CordonedDevice
}

// CordonedDevice is one device of a request and the cordon that covers it
// (on the device itself, on its GPU, or on one of its MIG instances).
type CordonedDevice struct {
	Wanted devices.Device
	Cordon Cordon
}

// Error names every cordoned device (index and UUID) and its cordon.
func (e *CordonError) Error() string {
	parts := make([]string, 0, len(e.Cordoned))
	for _, c := range e.Cordoned {
		s := DescribeDevice(c.Wanted) + " is cordoned"
		if c.Cordon.Device.UUID != c.Wanted.UUID {
			s += " through " + DescribeDevice(c.Cordon.Device)
		}
		s += fmt.Sprintf(" (%s, by %s since %s: %s)", c.Cordon.Source, c.Cordon.By,
			c.Cordon.Since.UTC().Format(time.RFC3339), c.Cordon.Reason)
		parts = append(parts, s)
	}
	return strings.Join(parts, "; ")
}

// Unwrap makes errors.Is(err, ErrCordoned) hold.
func (e *CordonError) Unwrap() error { return ErrCordoned }

// ValidCordonSource reports whether s is a cordon source.
func ValidCordonSource(s string) bool {
	return s == CordonOperator || s == CordonIntruder || s == CordonUnhealthy
}

func validateCordons(ks []Cordon) error {
	for i := range ks {
		k := &ks[i]
		if k.Device.UUID == "" {
			return errors.New("a cordon has no device UUID")
		}
		if !ValidCordonSource(k.Source) {
			return fmt.Errorf("cordon on %s has source %q, not operator, intruder or unhealthy", DescribeDevice(k.Device), truncate(k.Source, 64))
		}
		if i > 0 && ks[i-1].Device.UUID >= k.Device.UUID {
			return fmt.Errorf("cordons are not sorted by unique device UUID at %s", DescribeDevice(k.Device))
		}
	}
	return nil
}

// applyCordons returns ks with the journal's upserts and removals applied,
// in a new array (ks may be shared with a cached state).
func applyCordons(ks, upserts []Cordon, gone []string) []Cordon {
	out := slices.Clone(ks)
	for _, u := range gone {
		out = deleteByUUID(out, u, cordonUUID)
	}
	for _, k := range upserts {
		out = upsertByUUID(out, k, cordonUUID)
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

func cordonUUID(k Cordon) string { return k.Device.UUID }

// cordonIndex finds the cordon of the device uuid in the sorted cordons.
func (tx *Tx) cordonIndex(uuid string) (int, bool) {
	return slices.BinarySearchFunc(tx.st.Cordons, uuid, func(c Cordon, u string) int { return strings.Compare(c.Device.UUID, u) })
}

// Cordons returns a copy of the cordons in force.
func (tx *Tx) Cordons() []Cordon {
	tx.check()
	return slices.Clone(tx.st.Cordons)
}

// Cordon takes d out of new claims: from now on no request may claim d or a
// device conflicting with it (Tx.Claim returns a *CordonError), and no
// reservation is made on it; the reservations already on it are dropped
// (their waiters keep their places). Whoever holds d keeps its claim. A
// repeated cordon of the same device updates source, reason and by and keeps
// Since, unless its source ranks below the source of the cordon in force
// (operator > unhealthy > intruder, see CordonKept): that cordon then stays
// as it is, and the finding is audited after it. It returns the cordon in
// force and whether it is new.
//
// Cordons are kept by device UUID: one on a GPU and one on a MIG instance
// of it are two cordons, each lifted and each carried across a reboot on
// its own, so an observer's cordon on a MIG instance of an
// operator-cordoned GPU (or the reverse) stands next to the operator's and
// still covers its device once the operator's is lifted.
func (tx *Tx) Cordon(d devices.Device, source, reason, by string) (Cordon, bool, error) {
	tx.check()
	if d.UUID == "" {
		return Cordon{}, false, fmt.Errorf("%w: cordon of a device without a UUID (index %q)", ErrInvalid, d.Index)
	}
	if !ValidCordonSource(source) {
		return Cordon{}, false, fmt.Errorf("%w: cordon source %q for %s: use operator, intruder or unhealthy", ErrInvalid, source, DescribeDevice(d))
	}
	k := Cordon{Device: d, Source: source, Reason: reason, By: by, Since: tx.now}
	i, found := tx.cordonIndex(d.UUID)
	var was string
	if found {
		old := tx.st.Cordons[i]
		if CordonKept(&old, source) {
			// The device is out of new claims either way; what the cordon
			// says is what its lifting is decided on (see CordonKept). The
			// finding is kept in the audit log for whoever lifts it.
			tx.Audit(OpCordon, AuditRecord{Devices: []string{d.UUID},
				Reason: fmt.Sprintf("%s %s (%s) by %s: %s", CordonKeptPrefix(old.Source), cordonText(&old), source, by, reason)})
			return old, false, nil
		}
		k.Since = old.Since
		if sameCordon(&old, &k) {
			return old, false, nil
		}
		was = " (was " + cordonText(&old) + ")"
	}
	// A new array: st.Cordons may share its storage with the cache.
	tx.st.Cordons = upsertByUUID(slices.Clone(tx.st.Cordons), k, cordonUUID)
	tx.touch()
	verb := "cordoned"
	if found {
		verb = "cordon updated"
	}
	tx.Audit(OpCordon, AuditRecord{Devices: []string{d.UUID},
		Reason: fmt.Sprintf("%s (%s) by %s: %s%s", verb, source, by, reason, was)})
	tx.dropReservationsOn(d, "cordoned ("+source+"): "+reason)
	tx.maintain()
	return k, !found, nil
}

// cordonKeptText follows the source of the cordon kept at the start of the
// reason of a finding's audit record (CordonKeptPrefix).
const cordonKeptText = " cordon kept, not replaced by the observer's finding:"

// CordonKeptPrefix returns the start of the reason of the audit record
// (OpCordon) of an observer's finding that left the cordon from source in
// force (CordonKept): "operator cordon kept, not replaced by the observer's
// finding:" (the words every release wrote for an operator's cordon) or
// "unhealthy cordon kept, …". The cordon stays as it was, and the finding
// is recorded after it.
func CordonKeptPrefix(source string) string { return source + cordonKeptText }

// cordonRank is the precedence of a cordon source: an operator's cordon,
// then an unhealthy device's, then an intruder's.
func cordonRank(source string) int {
	switch source {
	case CordonOperator:
		return 3
	case CordonUnhealthy:
		return 2
	case CordonIntruder:
		return 1
	default:
		return 0
	}
}

// CordonKept reports whether a cordon from source leaves the cordon old in
// force as it is: source ranks below old's source, in the order operator >
// unhealthy > intruder. A cordon of equal or higher rank replaces old (an
// operator's replaces any, an unhealthy device's an intruder's).
//
// What a cordon says is what its lifting is decided on, and what the
// daemon and a reboot do with it. An operator's cordon is maintenance set
// on purpose (a GPU waiting for an RMA): rewritten with the observer's
// source it would lose its reason and author, and be dropped at the next
// reboot as the observer's, after which the GPU takes claims again. An
// unhealthy device's cordon is about a GPU that failed (a double-bit ECC
// error, fallen off the bus), which NVML reports once: rewritten as an
// intruder's, it would be lifted once the intruder is dealt with, and the
// broken GPU would take claims again, with nothing to find it again.
func CordonKept(old *Cordon, source string) bool {
	return cordonRank(source) < cordonRank(old.Source)
}

// cordonText describes a cordon for audit records.
func cordonText(k *Cordon) string {
	return fmt.Sprintf("%s cordon by %s since %s: %s", k.Source, k.By, k.Since.UTC().Format(time.RFC3339), k.Reason)
}

// Uncordon lifts the cordon on the device uuid and returns it; ok is false
// when there was none (nothing changes). The queue mechanics run at once: the
// head of the queue keeps the device if it asks for it, and any other waiter
// whose devices are now all free gets them reserved.
func (tx *Tx) Uncordon(uuid, by string) (Cordon, bool) {
	tx.check()
	i, found := tx.cordonIndex(uuid)
	if !found {
		return Cordon{}, false
	}
	k := tx.st.Cordons[i]
	tx.st.Cordons = slices.Delete(slices.Clone(tx.st.Cordons), i, i+1)
	if len(tx.st.Cordons) == 0 {
		tx.st.Cordons = nil
	}
	tx.touch()
	tx.Audit(OpUncordon, AuditRecord{Devices: []string{uuid},
		Reason: fmt.Sprintf("uncordoned by %s (was %s by %s since %s: %s)", by, k.Source, k.By, k.Since.UTC().Format(time.RFC3339), k.Reason)})
	tx.maintain()
	return k, true
}

// CordonsOn lists, for each device of devs, the cordons that cover it: on
// the device itself, on its full GPU (which covers its MIG instances), or on
// one of its MIG instances (which blocks the full GPU). A device that
// containerID holds already is skipped: asking again for it is not a new
// claim, and a cordon never takes a claim away.
func (tx *Tx) CordonsOn(containerID string, devs []devices.Device) []CordonedDevice {
	tx.check()
	if len(tx.st.Cordons) == 0 {
		return nil
	}
	var out []CordonedDevice
	for _, d := range uniqueDevices(devs) {
		if i, ok := tx.claimIndex(d.UUID); ok && containerID != "" && tx.st.Claims[i].Owner.ContainerID == containerID {
			continue
		}
		for _, k := range tx.st.Cordons {
			if devices.Conflicts(k.Device, d) {
				out = append(out, CordonedDevice{Wanted: d, Cordon: k})
			}
		}
	}
	return out
}

// cordoned reports whether a cordon covers d (see CordonsOn).
func (tx *Tx) cordoned(d devices.Device) bool {
	return slices.ContainsFunc(tx.st.Cordons, func(k Cordon) bool { return devices.Conflicts(k.Device, d) })
}

// cordonError is the *CordonError of containerID's request for devs, or nil.
func (tx *Tx) cordonError(containerID string, devs []devices.Device) error {
	if cs := tx.CordonsOn(containerID, devs); len(cs) > 0 {
		return &CordonError{Cordoned: cs}
	}
	return nil
}

// MarkDraining keeps containerID's claims, draining, after the container
// stopped or was removed under release_requires_idle: they end with
// FinishDraining (its processes left the GPU) or once older than
// Options.DrainGrace. A claim already draining keeps its DrainingSince. It
// returns the container's claims.
//
// The container's conflict records that name no process end now, as
// Release ends them: one left behind by a container that never started
// would be promoted once the device is free, handing the GPU to a container
// that is gone with no process to check, for good. A record that names the
// container's process stays: its processes, like those of its draining
// claims, may still be on that device, which must not go to anyone else
// until they have left; promoted once the holder's claim ends, it is a
// claim of an exited container, which the release rule drains like any.
func (tx *Tx) MarkDraining(containerID, reason string) []Claim {
	return tx.MarkDrainingIncarnation(Owner{ContainerID: containerID}, reason)
}

// MarkDrainingIncarnation is MarkDraining for the one incarnation of a
// container that o names (see ReleaseIncarnation). Its conflict records
// that name no process end only when o names none either: an o that names
// a process is not theirs by evidence (SameRecordedProcess), so, as for
// ReleaseIncarnation, it clears nothing.
func (tx *Tx) MarkDrainingIncarnation(o Owner, reason string) []Claim {
	tx.check()
	if o.ContainerID == "" {
		return nil
	}
	if !recordsProcess(&o) {
		tx.clearConflictsWhere(func(c *Conflict) bool {
			return c.Owner.ContainerID == o.ContainerID && !recordsProcess(&c.Owner)
		}, reason)
	}
	var out []Claim
	var marked []string
	for i := range tx.st.Claims {
		c := &tx.st.Claims[i]
		if !SameRecordedProcess(&c.Owner, &o) {
			continue
		}
		if c.Owner.DrainingSince.IsZero() {
			c.Owner.DrainingSince = tx.now
			marked = append(marked, c.Device.UUID)
		}
		out = append(out, *c)
	}
	if len(marked) > 0 {
		tx.touch()
		tx.record(OpDraining, &out[0].Owner, "", marked,
			fmt.Sprintf("%s: claim kept until its processes leave the GPU (at most %s)", reason, tx.l.opts.DrainGrace))
	}
	return out
}

// Draining lists the draining claims (Owner.DrainingSince set).
func (tx *Tx) Draining() []Claim {
	tx.check()
	var out []Claim
	for _, c := range tx.st.Claims {
		if !c.Owner.DrainingSince.IsZero() {
			out = append(out, c)
		}
	}
	return out
}

// FinishDraining releases the draining claims of containerID (its processes
// have left the GPU) and returns them; the container's other claims, if
// any, are untouched. Nothing happens if it has none.
func (tx *Tx) FinishDraining(containerID, reason string) []Claim {
	tx.check()
	if containerID == "" {
		return nil
	}
	out := tx.releaseWhere(func(c *Claim) bool {
		return c.Owner.ContainerID == containerID && !c.Owner.DrainingSince.IsZero()
	}, "drained: "+reason)
	if len(out) > 0 {
		tx.maintain()
	}
	return out
}

// expireDraining releases every claim that has been draining for longer
// than Options.DrainGrace: a host without an observer (hook-only), or an
// observer that cannot tell, still gets the device back after the grace,
// never hangs on it. It runs with the queue mechanics, at every Update and View.
func (tx *Tx) expireDraining() {
	grace := tx.l.opts.DrainGrace
	over := func(c *Claim) bool {
		return !c.Owner.DrainingSince.IsZero() && tx.now.Sub(c.Owner.DrainingSince) >= grace
	}
	// Looked for first: this runs at every Update and View, almost always
	// with nothing to release, and the reason need not be formatted then.
	if !slices.ContainsFunc(tx.st.Claims, func(c Claim) bool { return over(&c) }) {
		return
	}
	expired := tx.releaseWhere(over, fmt.Sprintf("idle grace over: still draining after %s (idle_grace)", grace))
	for _, c := range expired {
		tx.l.log.Warn("ledger: draining claim released: idle grace over, its processes were not seen leaving the GPU",
			"device", DescribeDevice(c.Device), "device_uuid", c.Device.UUID,
			"holder", DescribeOwner(c.Owner), "container_id", c.Owner.ContainerID,
			"draining_since", c.Owner.DrainingSince.UTC().Format(time.RFC3339), "idle_grace", grace.String())
	}
}

// A reboot ends every claim, waiter and reservation of the earlier boot, and
// every cordon the observer set: those describe processes and driver state
// that are gone (the observer cordons again a device still sick, or still
// used by a process the ledger does not explain). An operator's cordon is
// maintenance set on purpose — a GPU waiting for an RMA is no better after a
// reboot — so it is kept until uncordoned.

// bootKeptCordons returns the cordons of an earlier boot's state that the
// fresh state keeps (the operator's), in a new array, in order; nil if none.
func bootKeptCordons(ks []Cordon) []Cordon {
	var out []Cordon
	for _, k := range ks {
		if k.Source == CordonOperator {
			out = append(out, k)
		}
	}
	return out
}

// keepCordonsAcrossBoot runs first in the Tx of the first Update after a
// reboot, on the fresh state that replaces the earlier boot's (whose cordons
// are old): it keeps the operator's cordons, as changes of this Tx, so that
// the commit's journal record carries them over the empty base (a journal
// replayed from nothing restores them), and audits every cordon kept or
// dropped, so that none ends silently.
func (tx *Tx) keepCordonsAcrossBoot(old []Cordon) {
	tx.st.Cordons = bootKeptCordons(old)
	if len(tx.st.Cordons) > 0 {
		tx.touch()
	}
	for _, k := range old {
		was := cordonText(&k)
		if k.Source == CordonOperator {
			tx.Audit(OpCordon, AuditRecord{Devices: []string{k.Device.UUID},
				Reason: "kept across the reboot (an operator's cordon lasts until uncordoned): " + was})
			tx.l.log.Info("ledger: operator cordon kept across the reboot", "device", DescribeDevice(k.Device),
				"device_uuid", k.Device.UUID, "by", k.By, "reason", k.Reason)
			continue
		}
		again := "if it finds the device still unhealthy"
		if k.Source == CordonIntruder {
			again = "if a process the ledger does not explain runs on it again"
		}
		tx.Audit(OpUncordon, AuditRecord{Devices: []string{k.Device.UUID},
			Reason: "dropped at the reboot (the observer cordons it again " + again + "): was " + was})
		tx.l.log.Info("ledger: observer cordon dropped at the reboot", "device", DescribeDevice(k.Device),
			"device_uuid", k.Device.UUID, "source", k.Source, "reason", k.Reason)
	}
}
