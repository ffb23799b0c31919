// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// maintain applies the queue mechanics. It is the one place they live, and
// runs at the start of every Update (and View), after every change that can
// free a device, and before the commit:
//
//  0. claims draining for longer than the drain grace are released;
//  1. waiters not seen retrying for queue_ttl leave the queue ("expired");
//  2. a reservation past its deadline is dropped together with its waiter:
//     the waiter did not come back in time, and a later retry re-enqueues it
//     at the tail ("reservation-expired");
//  3. a conflict record becomes the claim once nobody else holds its device
//     (the container was running on it all along: reality wins);
//  4. reservations whose waiter is gone, no longer asks for the device, or
//     whose device is now held or in use by a container found running on
//     a device conflicting with it (a conflict record), are dropped, and so are the remaining
//     reservations of any waiter but the head (below) that no longer has
//     every device it asks for reserved ("unreserve");
//  5. the head of the queue — the earliest waiter that still waits for
//     something (not every device it asks for is reserved for it or held by
//     its own container) and asks for no cordoned device — gets every device
//     it asks for that is free (no conflicting claim or conflict record, no
//     reservation for another waiter) reserved, for reservation_ttl ("reserve"); once that
//     covers its whole request, the next such waiter is the head;
//  6. in arrival order, every other waiter all of whose devices are free
//     (no conflicting claim, conflict record, reservation or cordon, and
//     none kept for the head: see keptForHead) gets all of them reserved, for
//     reservation_ttl ("reserve").
//
// A reservation is always on a free device (no claim or conflict record
// conflicts with it),
// and only the head holds reservations on part of its request. That keeps
// the queue both live and fair:
//
//   - No deadlock. Partial reservations for several waiters were what let
//     two of them block each other: with X on GPU 4's MIG instance 4:1 and
//     Y on GPU 1, A asking for GPU 4 and GPU 1, then B for 4:0 and GPU 1, B
//     got the free 4:0 and, once Y stopped, A got GPU 1; A then waited for
//     B's 4:0 and B for A's GPU 1, each retry renewing both, and both GPUs
//     idled. With one partial holder, the head waits only for claims, which
//     end, and for other waiters' reservations, which cover requests that
//     can start and so are used at their next retry or expire; every other
//     reservation can be used at its waiter's next retry.
//   - No starvation. Each device the head asks for is kept for it as soon
//     as it is free — in the very commit that releases it — so a request
//     for several devices is not overtaken for ever by later requests for
//     one of them, each taking a device as it frees (what all or nothing
//     reservations alone allowed). Once the head starts, the next waiter is
//     the head, so every waiter that keeps retrying is served.
//   - Backfill elsewhere. A later waiter whose devices are all free and
//     conflict with nothing reserved gets them at once (step 6).
//
// The price of fairness: a device the head asks for stays idle while the
// head waits for its other devices. A waiter asking for a cordoned device
// is never the head: it waits for an operator, not for holders, and must
// not keep devices idle meanwhile. A head asking for a whole GPU one of
// whose MIG instances is in use cannot have the GPU reserved (a
// reservation is on a free device, which every reader, older versions
// included, checks); its free instances are kept for it all the same,
// without a stored reservation (keptForHead), so that requests for them do
// not keep the GPU from ever being whole again.
//
// Reservations, like claims, are never taken back before they are used or
// expire, except when they stop being of use: their waiter's retry asked
// for other devices, a container found running on the device took it
// (reality wins), or a waiter other than the head (which includes a former
// head, once an earlier waiter lost a reservation) holds part of its
// request.
//
// Steps 3 to 6 depend on the claims, conflicts, reservations and waiters
// alone, not on the time (which only dates what they create), and a state
// they just ran over is their fixed point: promoting a conflict needs a
// freed device, and none is freed by steps 4 to 6; the head is the same
// waiter again and has every device it can have; reserving makes devices
// busier, so a waiter passed over stays passed over. So when the Tx starts
// from a state this process committed right after maintain ran
// (baseSettled) and steps 1 and 2 expire nothing, steps 3 to 5 would
// change nothing and are skipped: a commit then makes one pass over the
// queue, not two. A state read from the files never counts as such.
func (tx *Tx) maintain() {
	if tx.settled {
		return
	}
	tx.expireDraining()
	tx.expireWaiters()
	tx.expireReservations()
	if tx.baseSettled && !tx.dirty {
		tx.settled = true
		return
	}
	tx.baseSettled = false
	tx.promoteConflicts()
	tx.dropInvalidReservations()
	// The head is the keep's (found once per version of the state, and
	// used again by the steps below when these change nothing).
	head := tx.keptForHead().key
	tx.dropPartialReservations(head)
	tx.reserveForHead(head)
	tx.reserveFreeDevices(tx.reserveCandidates())
	tx.fixed = &queueFixed{claims: slices.Clone(tx.st.Claims), reservations: slices.Clone(tx.st.Reservations),
		conflicts: slices.Clone(tx.st.Conflicts), cordons: slices.Clone(tx.st.Cordons), keep: tx.keptForHead(),
		touched: len(tx.touchedWaiters)}
	tx.settled = true
}

// queueFixed is what step 6 depends on besides the waiters — the claims,
// reservations, conflict records and cordons, and what is kept for the
// head — at a moment when the waiters were its fixed point, and how many
// waiter changes the Tx had recorded then.
type queueFixed struct {
	claims       []Claim
	reservations []Reservation
	conflicts    []Conflict
	cordons      []Cordon
	keep         headKeep
	touched      int
}

// reserveCandidates says which waiters step 6 has to look at, or nil for
// all of them. Whether a waiter can be reserved depends on its own entry
// (key, devices, container) and on the claims, conflict records,
// reservations and cordons of the devices conflicting with the ones it
// asks for. At the last fixed point every waiter that could be reserved
// was; reserving only makes devices busier. So a waiter whose entry did not
// change since (every change of a waiter is in touchedWaiters, which the
// journal record is made from) and none of whose devices conflicts with a
// device whose claim, conflict record, reservation or cordon changed, still
// cannot be, and is skipped: a commit that claims or releases one GPU looks at the waiters for that GPU, not at
// the whole queue. TestSettledSkipAgreesWithFullPass compares it with full
// passes.
func (tx *Tx) reserveCandidates() func(*Waiter) bool {
	f := tx.fixed
	if f == nil || tx.l.fullPasses {
		return nil
	}
	var changed []devices.Device
	changed = appendChanged(changed, f.claims, tx.st.Claims, func(c *Claim) devices.Device { return c.Device }, sameClaim)
	changed = appendChanged(changed, f.reservations, tx.st.Reservations, func(r *Reservation) devices.Device { return r.Device }, sameReservation)
	// A fixed point taken as the Tx started (a settled base: see
	// Ledger.Update) is the base state's and leaves its conflict records
	// out: the base's stand in for them. Where nil means there were none,
	// the base's add candidates at most, and looking at a waiter more is
	// never wrong (the full pass looks at all of them).
	fixedConflicts := f.conflicts
	if fixedConflicts == nil {
		fixedConflicts = tx.base.Conflicts
	}
	changed = appendChangedConflicts(changed, fixedConflicts, tx.st.Conflicts)
	changed = appendChanged(changed, f.cordons, tx.st.Cordons, func(k *Cordon) devices.Device { return k.Device }, sameCordon)
	if keep := tx.keptForHead(); !keep.same(&f.keep) {
		changed = append(append(changed, f.keep.wants...), keep.wants...)
	}
	touched := map[string]struct{}{}
	for _, k := range tx.touchedWaiters[min(f.touched, len(tx.touchedWaiters)):] {
		touched[k] = struct{}{}
	}
	if len(changed) == 0 && len(touched) == 0 {
		return func(*Waiter) bool { return false }
	}
	return func(w *Waiter) bool {
		for _, d := range w.Devices {
			for _, c := range changed {
				if devices.Conflicts(c, d) {
					return true
				}
			}
		}
		if len(touched) == 0 {
			return false
		}
		_, ok := touched[w.Key]
		return ok
	}
}

// appendChangedConflicts appends the devices of the conflict records of a
// and b that are not in both alike. Unlike claims and reservations there
// may be several records on one device (one per container found on it), so
// they are matched by device and container.
func appendChangedConflicts(out []devices.Device, a, b []Conflict) []devices.Device {
	in := func(c *Conflict, s []Conflict) bool {
		return slices.ContainsFunc(s, func(o Conflict) bool {
			return o.Device.UUID == c.Device.UUID && o.Owner.ContainerID == c.Owner.ContainerID && sameConflict(o, *c)
		})
	}
	for i := range a {
		if !in(&a[i], b) {
			out = append(out, a[i].Device)
		}
	}
	for i := range b {
		if !in(&b[i], a) {
			out = append(out, b[i].Device)
		}
	}
	return out
}

// appendChanged appends the devices of the entries of a and b (one entry
// per device each) that are not in both alike.
func appendChanged[T any](out []devices.Device, a, b []T, dev func(*T) devices.Device, same func(*T, *T) bool) []devices.Device {
	if len(a) == len(b) {
		alike := true
		for i := range a {
			if dev(&a[i]).UUID != dev(&b[i]).UUID || !same(&a[i], &b[i]) {
				alike = false
				break
			}
		}
		if alike {
			return out
		}
	}
	inB := make(map[string]int, len(b))
	for i := range b {
		inB[dev(&b[i]).UUID] = i
	}
	for i := range a {
		d := dev(&a[i])
		if j, ok := inB[d.UUID]; !ok || !same(&a[i], &b[j]) {
			out = append(out, d)
		}
	}
	inA := make(map[string]struct{}, len(a))
	for i := range a {
		inA[dev(&a[i]).UUID] = struct{}{}
	}
	for i := range b {
		// An entry of both that changed was appended from a above.
		if d := dev(&b[i]); !hasKey(inA, d.UUID) {
			out = append(out, d)
		}
	}
	return out
}

func hasKey(m map[string]struct{}, k string) bool {
	_, ok := m[k]
	return ok
}

// expireWaiters drops the waiters not seen for queue_ttl. It scans the
// queue only when something may have expired: not again in the same Tx (a
// waiter is only ever added or refreshed at tx.now), and not while the
// cutoff is at or before the earliest LastSeen known for this state
// (minLastSeen: the exact minimum after a scan, lowered by every waiter
// added or refreshed since, so a lower bound). A long-lived writer then makes
// one scan per queue_ttl-worth of its earliest waiter, not one per commit;
// a state read from the files is always scanned.
// TestSettledSkipAgreesWithFullPass compares it with a fresh handle per
// step.
func (tx *Tx) expireWaiters() {
	ttl := tx.l.opts.QueueTTL
	// LastSeen+ttl before now, with the addition done once, not per waiter.
	cutoff := tx.now.Add(-ttl)
	if tx.expiryRan || (tx.minKnown && !tx.minLastSeen.Before(cutoff)) {
		return
	}
	var gone []Waiter
	low := tx.now
	for i := range tx.st.Waiters {
		w := &tx.st.Waiters[i]
		if w.LastSeen.Before(cutoff) {
			gone = append(gone, *w)
		} else if w.LastSeen.Before(low) {
			low = w.LastSeen
		}
	}
	tx.expiryRan = true
	tx.minLastSeen, tx.minKnown = low, true
	if len(gone) == 0 {
		return
	}
	// One pass, not a removeWaiter (a scan and a shift of the queue) per
	// expired waiter: a thousand waiters expiring together (a daemon that
	// was down) made every read quadratic.
	ws := tx.ownWaiters()
	kept := ws[:0]
	for i := range ws {
		if !ws[i].LastSeen.Before(cutoff) {
			kept = append(kept, ws[i])
		}
	}
	clear(ws[len(kept):])
	tx.st.Waiters = kept
	tx.touch()
	for _, w := range gone {
		tx.touchedWaiters = append(tx.touchedWaiters, w.Key)
		tx.removeReservationsFor(w.Key)
		tx.record(OpExpired, &w.Owner, w.Key, uuids(w.Devices, plainDevice),
			fmt.Sprintf("not seen retrying since %s (queue_ttl %s)", w.LastSeen.Format(time.RFC3339), ttl))
	}
}

func (tx *Tx) expireReservations() {
	var keys []string
	for _, r := range tx.st.Reservations {
		if r.Until.Before(tx.now) && !slices.Contains(keys, r.For) {
			keys = append(keys, r.For)
		}
	}
	for _, key := range keys {
		var devs []string
		var until string
		for _, r := range tx.st.Reservations {
			if r.For == key {
				devs = append(devs, r.Device.UUID)
				if r.Until.Before(tx.now) {
					until = r.Until.Format(time.RFC3339)
				}
			}
		}
		var owner *Owner
		if i := tx.waiterIndex(key); i >= 0 {
			o := tx.st.Waiters[i].Owner
			owner = &o
		}
		tx.removeWaiter(key)
		tx.removeReservationsFor(key)
		tx.record(OpReservationExpired, owner, key, devs,
			fmt.Sprintf("did not come back to claim by %s (reservation_ttl %s); a retry queues again at the tail", until, tx.l.opts.ReservationTTL))
	}
}

// dropInvalidReservations drops the reservations whose waiter is gone or no
// longer asks for the device, and those of a device now held, or in use by a
// container found running on a device conflicting with it (a conflict
// record: reality wins).
func (tx *Tx) dropInvalidReservations() {
	if len(tx.st.Reservations) == 0 {
		return
	}
	kept := tx.st.Reservations[:0]
	for i := range tx.st.Reservations {
		r := tx.st.Reservations[i]
		reason := ""
		if wi := tx.waiterIndex(r.For); wi < 0 {
			reason = "the waiter left the queue"
		} else if !wantsUUID(tx.st.Waiters[wi].Devices, r.Device.UUID) {
			reason = "the waiter no longer asks for it"
		} else if c := tx.conflictingClaim(r.Device, nil); c != nil {
			reason = "held by " + DescribeOwner(c.Owner) + " through " + DescribeDevice(c.Device)
		} else if c := tx.conflictingRecord(r.Device); c != nil {
			// Its waiter could not claim it (Busy counts the record):
			// a reservation it cannot use only keeps others off.
			reason = "in use by running " + DescribeOwner(c.Owner) + " through " + DescribeDevice(c.Device)
		}
		if reason == "" {
			kept = append(kept, r)
			continue
		}
		tx.record(OpUnreserve, nil, r.For, []string{r.Device.UUID}, reason)
		tx.touch()
	}
	tx.st.Reservations = kept
}

// dropReservationsOn ends every reservation of a device conflicting with d,
// whoever it is for: a container found running on d at reconcile holds it,
// and reality wins over the queue.
func (tx *Tx) dropReservationsOn(d devices.Device, reason string) {
	for j := 0; j < len(tx.st.Reservations); {
		if r := tx.st.Reservations[j]; devices.Conflicts(r.Device, d) {
			tx.st.Reservations = slices.Delete(tx.st.Reservations, j, j+1)
			tx.record(OpUnreserve, nil, r.For, []string{r.Device.UUID}, reason)
			tx.touch()
			continue
		}
		j++
	}
}

// conflictingClaim is a claim on a device conflicting with d held by a
// container other than except (another incarnation of its id counts as
// another container, see SameIncarnation; nil excepts nobody), or nil.
func (tx *Tx) conflictingClaim(d devices.Device, except *Owner) *Claim {
	for i := range tx.st.Claims {
		if c := &tx.st.Claims[i]; (except == nil || !SameIncarnation(&c.Owner, except)) && devices.Conflicts(c.Device, d) {
			return c
		}
	}
	return nil
}

// conflictingRecord is a conflict record on a device conflicting with d, or
// nil: a container found running there at reconcile, while another holds a
// device conflicting with its own. The device is in use although no claim
// says so (a MIG instance of a GPU such a container runs on whole): Busy
// counts it, and nothing is reserved on it. promoteConflicts does not ask:
// two records on one device must not keep each other from becoming the
// claim once the holder goes.
func (tx *Tx) conflictingRecord(d devices.Device) *Conflict {
	for i := range tx.st.Conflicts {
		if c := &tx.st.Conflicts[i]; devices.Conflicts(c.Device, d) {
			return c
		}
	}
	return nil
}

func (tx *Tx) promoteConflicts() {
	if len(tx.st.Conflicts) == 0 {
		return
	}
	// Earliest seen first: if two recorded containers share a freed device,
	// the one seen first on it becomes its holder.
	order := make([]int, len(tx.st.Conflicts))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		return tx.st.Conflicts[a].Since.Compare(tx.st.Conflicts[b].Since)
	})
	drop := make([]bool, len(tx.st.Conflicts))
	for _, i := range order {
		c := tx.st.Conflicts[i]
		if tx.conflictingClaim(c.Device, &c.Owner) != nil {
			continue // still held by someone else
		}
		drop[i] = true
		tx.touch()
		if _, held := tx.claimIndex(c.Device.UUID); held {
			// The container holds it itself now (adopted or claimed).
			tx.record(OpConflictCleared, &c.Owner, "", []string{c.Device.UUID}, "the container holds the device")
			continue
		}
		tx.dropReservationsOn(c.Device, "in use by running "+DescribeOwner(c.Owner))
		tx.insertClaim(Claim{Device: c.Device, Owner: c.Owner, Source: "reconcile", Since: tx.now})
		tx.record(OpPromote, &c.Owner, "", []string{c.Device.UUID}, "device free: the container found on it holds it now")
	}
	kept := tx.st.Conflicts[:0]
	for i, c := range tx.st.Conflicts {
		if !drop[i] {
			kept = append(kept, c)
		}
	}
	tx.st.Conflicts = kept
}

// dropPartialReservations drops the reservations of every waiter but head
// (the head of the queue's key, or "") that cannot start on them: they
// could not be used at its next retry and would only block others.
func (tx *Tx) dropPartialReservations(head string) {
	if len(tx.st.Reservations) == 0 {
		return
	}
	var partial []string
	for _, r := range tx.st.Reservations {
		if (r.For == head && head != "") || slices.Contains(partial, r.For) {
			continue
		}
		wi := tx.waiterIndex(r.For)
		if wi < 0 || !tx.canStart(&tx.st.Waiters[wi]) { // wi < 0: dropInvalidReservations ran first; kept for safety
			partial = append(partial, r.For)
		}
	}
	for _, key := range partial {
		var devs []string
		for _, r := range tx.st.Reservations {
			if r.For == key {
				devs = append(devs, r.Device.UUID)
			}
		}
		tx.removeReservationsFor(key)
		tx.record(OpUnreserve, nil, key, devs,
			"no longer covers every device the waiter asks for (reservations are all or nothing)")
	}
}

// canStart reports whether w has every device it asks for, so that its
// next retry is admitted: each one reserved for it (a reserved device is
// free: no claim conflicts with a reservation) or held by its own
// container.
func (tx *Tx) canStart(w *Waiter) bool {
	for _, d := range w.Devices {
		if !tx.reservedFor(d, w.Key) && !tx.heldBy(d, &w.Owner) {
			return false
		}
	}
	return true
}

// HoldsPartOfRequest reports whether key's waiter holds reservations but
// cannot start on them yet: the head of the queue, keeping the devices it
// asks for as they free until the rest is free too.
func (tx *Tx) HoldsPartOfRequest(key string) bool {
	tx.check()
	i := tx.waiterIndex(key)
	if i < 0 {
		return false
	}
	w := &tx.st.Waiters[i]
	return slices.ContainsFunc(w.Devices, func(d devices.Device) bool { return tx.reservedFor(d, key) }) && !tx.canStart(w)
}

// headKeep is what the head of the queue still waits for (keptForHead).
type headKeep struct {
	key   string           // the head's key; "" when there is no head
	index int              // its index in the waiters
	wants []devices.Device // what it asks for and has neither reserved nor held
}

// keptForHead finds the head of the queue (queueHead) and the devices it
// asks for that are neither reserved for it nor held by its own container.
// A device conflicting with one of them is kept for the head: nobody else
// is admitted on it (Busy) or gets it reserved (maintain, step 6), although
// no claim or reservation is on it. That matters for one kind of device
// only: a MIG instance of a GPU the head asks for whole while another
// instance of that GPU is in use (or reserved for a waiter that can start).
// The GPU itself cannot be reserved then (a reservation is on a free
// device, which every reader, older versions included, checks), and without
// the keep, requests for its free instances would still be admitted, one
// after another, and the head might never see the whole GPU free. Every
// other device the head waits for is busy for others already: held, or
// reserved.
//
// The keep is not stored: it follows from the waiters, claims and
// reservations, so it ends when the head starts, leaves the queue (its
// pod is removed, or it stops retrying for queue_ttl) or stops being the
// head, and a ledger of this format needs nothing new to hold it.
//
// It is found once per version of the state: every change of the state
// goes through touch, which forgets it (checkKeep verifies that in tests).
func (tx *Tx) keptForHead() headKeep {
	if tx.keep != nil && !checkKeep {
		return *tx.keep
	}
	k := tx.findKeptForHead()
	if tx.keep != nil && (k.index != tx.keep.index || !k.same(tx.keep)) {
		panic(fmt.Sprintf("ledger: the head's keep was not forgotten at a change of the state: %+v, now %+v", *tx.keep, k))
	}
	tx.keep = &k
	return k
}

// checkKeep, set by tests only, makes keptForHead find the keep again at
// every call and panic if the one it remembered is stale.
var checkKeep bool

func (tx *Tx) findKeptForHead() headKeep {
	key := tx.queueHead()
	if key == "" {
		return headKeep{}
	}
	i := tx.waiterIndex(key)
	w := &tx.st.Waiters[i]
	k := headKeep{key: key, index: i}
	for _, d := range w.Devices {
		if !tx.reservedFor(d, key) && !tx.heldBy(d, &w.Owner) {
			k.wants = append(k.wants, d)
		}
	}
	return k
}

// HeadWaitsFor is the head of the queue (a copy of its waiter) and the
// devices it asks for that are neither reserved for it nor held by its own
// container: a device conflicting with one of them is kept for it (Busy
// reports it as KeptFor). ok is false when nobody heads the queue.
func (tx *Tx) HeadWaitsFor() (head Waiter, wants []devices.Device, ok bool) {
	tx.check()
	k := tx.keptForHead()
	if k.key == "" {
		return Waiter{}, nil, false
	}
	head = tx.st.Waiters[k.index]
	head.Devices = slices.Clone(head.Devices)
	return head, slices.Clone(k.wants), true
}

// conflicting is the device the head waits for that d conflicts with, if
// any.
func (k *headKeep) conflicting(d devices.Device) (devices.Device, bool) {
	for _, h := range k.wants {
		if devices.Conflicts(h, d) {
			return h, true
		}
	}
	return devices.Device{}, false
}

// same reports whether k and o keep the same devices for the same head.
func (k *headKeep) same(o *headKeep) bool {
	return k.key == o.key && slices.EqualFunc(k.wants, o.wants, func(a, b devices.Device) bool { return a.UUID == b.UUID })
}

// queueHead is the key of the head of the queue (see maintain, step 5): the
// earliest waiter that cannot start yet and asks for no cordoned device, or
// "" when there is none. The waiters before it can start, and there are
// rarely more than a few: finding it costs a few lookups, not a pass over
// a long queue.
func (tx *Tx) queueHead() string {
	for i := range tx.st.Waiters {
		w := &tx.st.Waiters[i]
		if len(w.Devices) == 0 || tx.canStart(w) || len(tx.CordonsOn(w.Owner.ContainerID, w.Devices)) > 0 {
			continue
		}
		return w.Key
	}
	return ""
}

// reserveForHead is step 5 of maintain: it reserves for the head of the
// queue every device it asks for that is free (no conflicting claim or
// conflict record, no reservation for another waiter; it asks for no
// cordoned one), and moves
// on to the next head when that lets the head start. key is the head's
// key (queueHead) as step 4 found it: step 4 drops only reservations of
// waiters that cannot start and are not the head, which the waiters
// before the head (all able to start) and the head itself do not hold,
// so the head is the same after it.
func (tx *Tx) reserveForHead(key string) {
	until := tx.now.Add(tx.l.opts.ReservationTTL)
	for ; key != ""; key = tx.queueHead() {
		w := &tx.st.Waiters[tx.waiterIndex(key)]
		var got []string
		for _, d := range w.Devices {
			if tx.reservedFor(d, key) || tx.heldBy(d, &w.Owner) || tx.conflictingClaim(d, nil) != nil ||
				tx.conflictingRecord(d) != nil || tx.reservedForAnother(d, key) {
				continue
			}
			tx.insertReservation(Reservation{Device: d, For: key, Since: tx.now, Until: until})
			got = append(got, d.UUID)
		}
		start := tx.canStart(w)
		if len(got) > 0 {
			why := "head of the queue; until %s"
			if !start {
				why = "head of the queue, kept until its other devices are free; until %s"
			}
			tx.record(OpReserve, &w.Owner, key, got, fmt.Sprintf(why, until.Format(time.RFC3339)))
		}
		if !start {
			return
		}
	}
}

// reservedForAnother reports whether a device conflicting with d is
// reserved for a waiter other than key.
func (tx *Tx) reservedForAnother(d devices.Device, key string) bool {
	return slices.ContainsFunc(tx.st.Reservations, func(r Reservation) bool { return r.For != key && devices.Conflicts(r.Device, d) })
}

// reservedFor reports whether d itself is reserved for key.
func (tx *Tx) reservedFor(d devices.Device, key string) bool {
	i, found := slices.BinarySearchFunc(tx.st.Reservations, d.UUID, func(r Reservation, u string) int { return strings.Compare(r.Device.UUID, u) })
	return found && tx.st.Reservations[i].For == key
}

// heldBy reports whether o's container (this incarnation of it, see
// SameIncarnation: what Busy ignores) holds d itself and nobody else holds a
// device conflicting with it.
func (tx *Tx) heldBy(d devices.Device, o *Owner) bool {
	return tx.holdsItself(d, o) && tx.conflictingClaim(d, o) == nil
}

// reserveFreeDevices is step 6 of maintain: it reserves, in arrival order,
// all the devices of every waiter whose devices are all free, and nothing
// for a waiter with any device busy (the head's reservations, made in step
// 5, make its devices busy for everyone else). Whether a device is free is memoised per pass (hundreds of
// waiters usually ask for the same few held devices) and forgotten whenever
// a reservation is made.
func (tx *Tx) reserveFreeDevices(consider func(*Waiter) bool) {
	if len(tx.st.Waiters) == 0 {
		return
	}
	memo := map[string]bool{}
	// Reservations made below are for waiters that can start, so the head
	// (step 5 moved it past every waiter that can) and what is kept for it
	// stay the same during the pass.
	keep := tx.keptForHead()
	// isFree: no claim, conflict record or reservation on a device
	// conflicting with d, and not kept for the head (the head itself is
	// never reserved here: what it waits for conflicts with what is kept).
	isFree := func(d devices.Device) bool {
		if f, ok := memo[d.UUID]; ok {
			return f
		}
		_, kept := keep.conflicting(d)
		f := !kept && tx.conflictingClaim(d, nil) == nil && tx.conflictingRecord(d) == nil && !tx.reservedConflicting(d) && !tx.cordoned(d)
		memo[d.UUID] = f
		return f
	}
	// Who holds a claim and who has reservations, gathered once: asked for
	// every waiter, a scan of the claims or reservations each time made a
	// pass O(waiters × claims), most of a commit's CPU at 10,000 waiters.
	// Claims do not change during the pass; reservations made in it are for
	// the waiter at hand, which is not looked at again.
	holders := make(map[string]struct{}, len(tx.st.Claims))
	for i := range tx.st.Claims {
		if id := tx.st.Claims[i].Owner.ContainerID; id != "" {
			holders[id] = struct{}{}
		}
	}
	reserved := make(map[string]struct{}, len(tx.st.Reservations))
	for i := range tx.st.Reservations {
		reserved[tx.st.Reservations[i].For] = struct{}{}
	}
	until := tx.now.Add(tx.l.opts.ReservationTTL)
	// Most waiters of a long queue wait for a held device: the first
	// device that is not free decides, so the lookups by container id and
	// by key (each a hash of the string) come only after it.
	for wi := range tx.st.Waiters {
		w := &tx.st.Waiters[wi]
		if len(w.Devices) == 0 || (consider != nil && !consider(w)) {
			continue
		}
		var need []devices.Device
		all := true
		ownsKnown, owns := false, false
		for _, d := range w.Devices {
			if isFree(d) {
				need = append(need, d)
				continue
			}
			// Devices the waiter's own container holds need no
			// reservation (Busy ignores them); that is rare, so only
			// then the slow path.
			if !ownsKnown {
				_, owns = holders[w.Owner.ContainerID]
				owns = owns && w.Owner.ContainerID != ""
				ownsKnown = true
			}
			if owns && tx.heldBy(d, &w.Owner) && !tx.reservedConflicting(d) {
				continue
			}
			all = false
			break
		}
		if !all || len(need) == 0 {
			continue
		}
		if _, done := reserved[w.Key]; done {
			continue // complete already (dropPartialReservations ran), or the head
		}
		got := make([]string, 0, len(need))
		for _, d := range need {
			tx.insertReservation(Reservation{Device: d, For: w.Key, Since: tx.now, Until: until})
			got = append(got, d.UUID)
		}
		reserved[w.Key] = struct{}{}
		clear(memo)
		// "head of the queue": the earliest waiter that can start (ctl
		// and log readers match on the wording).
		tx.record(OpReserve, &w.Owner, w.Key, got, fmt.Sprintf("head of the queue; until %s", until.Format(time.RFC3339)))
	}
}

// reservedConflicting reports whether a device conflicting with d is
// reserved for anyone.
func (tx *Tx) reservedConflicting(d devices.Device) bool {
	return slices.ContainsFunc(tx.st.Reservations, func(r Reservation) bool { return devices.Conflicts(r.Device, d) })
}

// sawWaiterAt keeps minLastSeen a lower bound when a waiter is added or
// refreshed at t (a clock stepped back could make t the earliest).
func (tx *Tx) sawWaiterAt(t time.Time) {
	if tx.minKnown && t.Before(tx.minLastSeen) {
		tx.minLastSeen = t
	}
}
