package ledger

import (
	"fmt"
	"slices"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// maintain applies the queue mechanics. It is the one place they live, and
// runs at the start of every Update (and View), after every change that can
// free a device, and before the commit:
//
//  1. waiters not seen retrying for queue_ttl leave the queue ("expired");
//  2. a reservation past its deadline is dropped together with its waiter:
//     the head did not come back in time, and a later retry re-enqueues it at
//     the tail ("reservation-expired");
//  3. reservations whose waiter is gone, no longer asks for the device, or
//     whose device is now held, are dropped ("unreserve");
//  4. a conflict record becomes the claim once nobody else holds its device
//     (the container was running on it all along: reality wins);
//  5. every free device (no conflicting claim or reservation) that some
//     waiter asks for is reserved for the earliest such waiter, for
//     reservation_ttl ("reserve").
//
// Step 5 is what keeps a newcomer from jumping the queue: a free device
// somebody waits for is always reserved, so Busy reports it to everyone else.
//
// Reservations, like claims, are never taken back before they are used or
// expire. Consequence (by design of the device model): a waiter for a full
// GPU whose MIG instance is held does not get the GPU's other instances
// reserved (it does not ask for them), so a later waiter for one of those
// instances may be served first, and the full-GPU waiter is served once the
// GPU as a whole is free. Among waiters for the same device, FIFO is strict.
func (tx *Tx) maintain() {
	if tx.settled {
		return
	}
	tx.expireWaiters()
	tx.expireReservations()
	tx.dropInvalidReservations()
	tx.promoteConflicts()
	tx.reserveFreeDevices()
	tx.settled = true
}

func (tx *Tx) expireWaiters() {
	ttl := tx.l.opts.QueueTTL
	var gone []Waiter
	for _, w := range tx.st.Waiters {
		if w.LastSeen.Add(ttl).Before(tx.now) {
			gone = append(gone, w)
		}
	}
	for _, w := range gone {
		tx.removeWaiter(w.Key)
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
		} else if c := tx.conflictingClaim(r.Device, ""); c != nil {
			reason = "held by " + DescribeOwner(c.Owner) + " through " + DescribeDevice(c.Device)
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
// container other than exceptID, or nil.
func (tx *Tx) conflictingClaim(d devices.Device, exceptID string) *Claim {
	for i := range tx.st.Claims {
		if c := &tx.st.Claims[i]; c.Owner.ContainerID != exceptID && devices.Conflicts(c.Device, d) {
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
		if tx.conflictingClaim(c.Device, c.Owner.ContainerID) != nil {
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

// reserveFreeDevices reserves, in arrival order, every free device a waiter
// asks for. Whether a device is free is memoised per pass (hundreds of
// waiters usually ask for the same few held devices) and forgotten whenever a
// reservation is made.
func (tx *Tx) reserveFreeDevices() {
	if len(tx.st.Waiters) == 0 {
		return
	}
	// A few distinct devices, asked for by many: a short list beats a map.
	type known struct {
		uuid string
		free bool
	}
	var memo []known
	isFree := func(d devices.Device) bool {
		for _, k := range memo {
			if k.uuid == d.UUID {
				return k.free
			}
		}
		f := tx.conflictingClaim(d, "") == nil
		for i := 0; f && i < len(tx.st.Reservations); i++ {
			if devices.Conflicts(tx.st.Reservations[i].Device, d) {
				f = false
			}
		}
		memo = append(memo, known{d.UUID, f})
		return f
	}
	until := tx.now.Add(tx.l.opts.ReservationTTL)
	for wi := range tx.st.Waiters {
		w := &tx.st.Waiters[wi]
		var got []string
		for _, d := range w.Devices {
			if !isFree(d) {
				continue
			}
			tx.insertReservation(Reservation{Device: d, For: w.Key, Since: tx.now, Until: until})
			got = append(got, d.UUID)
			memo = memo[:0]
		}
		if len(got) > 0 {
			tx.record(OpReserve, &w.Owner, w.Key, got, fmt.Sprintf("head of the queue; until %s", until.Format(time.RFC3339)))
		}
	}
}
