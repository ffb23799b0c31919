// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
)

// Tx is one mutation in progress (see Ledger.Update). It is valid only inside
// the function passed to Update or View and must not be used from other
// goroutines. Every method keeps the ledger's invariants when it returns: no
// two containers hold conflicting devices, and reservations are all or
// nothing, every waiter whose devices are all free having them reserved, the
// earliest first (the queue mechanics run after every change that can free a
// device).
type Tx struct {
	l   *Ledger
	now time.Time
	// boot is the boot clock's reading at now (-1: unknown); see
	// checkClock.
	boot time.Duration
	// anchored: st's clock anchor is one to compare with (checkClock);
	// clockStep is the step of the wall clock checkClock applied, or 0.
	anchored  bool
	clockStep time.Duration
	st        State
	// base is the state the Tx started from (shares storage with the
	// cache; never written): the commit journals the difference.
	base State
	// touchedWaiters are the keys of waiters added, changed or removed.
	touchedWaiters []string
	// view is State's copy, until the next change.
	view  *State
	dirty bool
	audit []AuditRecord
	// waitersOwned is false while st.Waiters still shares its array with the
	// ledger's cache; ownWaiters copies it before the first change. (Claims,
	// reservations and conflicts are small and copied up front.)
	waitersOwned bool
	// settled: nothing changed since the queue mechanics last ran, so
	// running them again would change nothing either.
	settled bool
	// baseSettled: the Tx started from a state this process committed after
	// the queue mechanics ran (loaded.settled); see maintain.
	baseSettled bool
	// expiryRan: expireWaiters scanned the waiters at tx.now, and every
	// waiter the Tx adds or refreshes is last seen at tx.now, so there is
	// nothing more to expire in this Tx. minLastSeen, when minKnown, is at
	// most the LastSeen of every waiter of st (see expireWaiters).
	expiryRan   bool
	minLastSeen time.Time
	minKnown    bool
	// fixed, when set, is what the reservation pass depends on as it was
	// when the waiters were last its fixed point (see reserveCandidates).
	fixed *queueFixed
	// keep is keptForHead's answer for st, until the next change (touch
	// forgets it, as it forgets view).
	keep   *headKeep
	closed bool
	// freshLineage: the state got its lineage from this Update's load (it
	// started empty, or its file had none) and it is not stored yet.
	freshLineage bool
}

// Changed reports whether the state has changed in the transaction so far
// (every mutation goes through touch): the caller's own operations, and any
// maintenance the ledger ran first (an expiry, a reservation).
func (tx *Tx) Changed() bool { return tx.dirty }

// touch records a change of the state.
func (tx *Tx) touch() {
	tx.dirty = true
	tx.settled = false
	tx.view = nil
	tx.keep = nil
}

// newTx starts a transaction on st at the clock readings now and boot
// (Ledger.clock), and moves the stored times by a step of the wall clock
// found since st's anchor (checkClock) before anything else looks at them.
func newTx(l *Ledger, st State, now time.Time, boot time.Duration) *Tx {
	tx := &Tx{l: l, now: now, boot: boot, st: st, base: st}
	tx.st.Claims = slices.Clone(st.Claims)
	tx.st.Reservations = slices.Clone(st.Reservations)
	tx.st.Conflicts = slices.Clone(st.Conflicts)
	tx.checkClock()
	return tx
}

func (tx *Tx) close() { tx.closed = true }

func (tx *Tx) check() {
	if tx.closed {
		panic("ledger: Tx used after its Update or View returned")
	}
}

func (tx *Tx) ownWaiters() []Waiter {
	if !tx.waitersOwned {
		tx.st.Waiters = slices.Clone(tx.st.Waiters)
		tx.waitersOwned = true
	}
	return tx.st.Waiters
}

// Now is the time of this transaction (Options.Now, read once), used for
// every timestamp it writes.
func (tx *Tx) Now() time.Time { return tx.now }

// ReadState is the state being built, not a copy: for a reader that only
// looks at it, within View's fn (gpu-guard-ctl rendering thousands of
// waiters once). It may share storage with the ledger's cache, so it must
// never be modified, nor kept past the Tx; what must be is State's.
func (tx *Tx) ReadState() *State {
	tx.check()
	return &tx.st
}

// State is a copy of the state being built, taken at the call (and reused
// until the next change): modifying it changes nothing in the ledger, and it
// shares no storage with the Tx or with the ledger's cache.
func (tx *Tx) State() *State {
	tx.check()
	if tx.view == nil {
		v := tx.st.Clone()
		tx.view = &v
	}
	return tx.view
}

// Audit adds a record to the audit log (for instance a refused request); it
// is written with the commit, or alone if nothing else changed.
func (tx *Tx) Audit(op string, rec AuditRecord) {
	tx.check()
	rec.Op = op
	if rec.Time.IsZero() {
		rec.Time = tx.now
	}
	tx.audit = append(tx.audit, rec)
}

func (tx *Tx) record(op string, o *Owner, key string, devs []string, reason string) {
	r := AuditRecord{Time: tx.now, Op: op, Devices: devs, Key: key, Reason: reason}
	if o != nil {
		r.ContainerID, r.Namespace, r.Pod, r.Container, r.FrontEnd = o.ContainerID, o.Namespace, o.Pod, o.Container, string(o.FrontEnd)
	}
	tx.audit = append(tx.audit, r)
}

// requesterKey is the waiter key of a request: key, or the container id when
// key is empty.
func requesterKey(key string, o Owner) string {
	if key != "" {
		return key
	}
	return o.ContainerID
}

// uniqueDevices drops repeated UUIDs, keeping the first occurrence.
func uniqueDevices(devs []devices.Device) []devices.Device {
	if len(devs) < 2 {
		return devs
	}
	out := make([]devices.Device, 0, len(devs))
	for _, d := range devs {
		if !slices.ContainsFunc(out, func(o devices.Device) bool { return o.UUID == d.UUID }) {
			out = append(out, d)
		}
	}
	return out
}

func uuids[T any](xs []T, dev func(*T) devices.Device) []string {
	out := make([]string, 0, len(xs))
	for i := range xs {
		out = append(out, dev(&xs[i]).UUID)
	}
	return out
}

func claimDevice(c *Claim) devices.Device          { return c.Device }
func plainDevice(d *devices.Device) devices.Device { return *d }

func validRequest(owner Owner, devs []devices.Device) error {
	if owner.ContainerID == "" {
		return fmt.Errorf("%w: no container id", ErrInvalid)
	}
	if len(devs) == 0 {
		return fmt.Errorf("%w: no devices for container %s", ErrInvalid, ShortID(owner.ContainerID))
	}
	for _, d := range devs {
		if d.UUID == "" {
			return fmt.Errorf("%w: device with index %q has no UUID (container %s)", ErrInvalid, d.Index, ShortID(owner.ContainerID))
		}
	}
	return nil
}

func (tx *Tx) claimIndex(uuid string) (int, bool) {
	return slices.BinarySearchFunc(tx.st.Claims, uuid, func(c Claim, u string) int { return strings.Compare(c.Device.UUID, u) })
}

func (tx *Tx) insertClaim(c Claim) {
	tx.st.Claims = upsertByUUID(tx.st.Claims, c, func(c Claim) string { return c.Device.UUID })
	tx.touch()
}

func (tx *Tx) insertReservation(r Reservation) {
	tx.st.Reservations = upsertByUUID(tx.st.Reservations, r, func(r Reservation) string { return r.Device.UUID })
	tx.touch()
}

// upsertByUUID replaces the element with v's device UUID in a slice sorted by
// it, or inserts v in order.
func upsertByUUID[T any](s []T, v T, uuid func(T) string) []T {
	i, found := slices.BinarySearchFunc(s, uuid(v), func(e T, u string) int { return strings.Compare(uuid(e), u) })
	if found {
		s[i] = v
		return s
	}
	return slices.Insert(s, i, v)
}

// Waiter is a copy of the queue entry of key, if there is one: what a
// caller needs of one waiter without copying the whole state.
func (tx *Tx) Waiter(key string) (Waiter, bool) {
	tx.check()
	i := tx.waiterIndex(key)
	if i < 0 {
		return Waiter{}, false
	}
	w := tx.st.Waiters[i]
	w.Devices = slices.Clone(w.Devices)
	return w, true
}

func (tx *Tx) waiterIndex(key string) int {
	for i := range tx.st.Waiters {
		if tx.st.Waiters[i].Key == key {
			return i
		}
	}
	return -1
}

// Busy lists what stands between a request and its devices: claims of other
// containers on a conflicting device, containers found running on a
// conflicting device at reconcile (conflict records, reported as holders:
// see conflictHolder), reservations of a conflicting device for another
// requester key, and, for a device none of these makes busy, what the head
// of the queue waits for (see keptForHead). Claims and conflict records of
// owner's own container (see SameIncarnation) and reservations for key do
// not count, nor does a conflict record on a device owner's container
// holds itself (the record is there because of that claim, and asking
// again for what it holds changes nothing). Empty means Claim would
// succeed.
func (tx *Tx) Busy(key string, owner Owner, devs []devices.Device) []BusyDevice {
	tx.check()
	key = requesterKey(key, owner)
	var out []BusyDevice
	var keep *headKeep
	for _, d := range uniqueDevices(devs) {
		n := len(out)
		for i := range tx.st.Claims {
			if c := tx.st.Claims[i]; !SameIncarnation(&c.Owner, &owner) && devices.Conflicts(c.Device, d) {
				out = append(out, BusyDevice{Wanted: d, Holder: &c})
			}
		}
		own := tx.holdsItself(d, &owner)
		if !own {
			// A container running on a whole GPU while another holds one
			// of its MIG instances uses every instance of it: admitting a
			// request for a free one would put a third container on a GPU
			// known in use, and the record could then never become the
			// claim it waits to be (promoteConflicts).
			for i := range tx.st.Conflicts {
				if c := &tx.st.Conflicts[i]; !SameIncarnation(&c.Owner, &owner) && devices.Conflicts(c.Device, d) {
					out = append(out, BusyDevice{Wanted: d, Holder: conflictHolder(c), Conflict: true})
				}
			}
		}
		for i := range tx.st.Reservations {
			if r := tx.st.Reservations[i]; r.For != key && devices.Conflicts(r.Device, d) {
				out = append(out, BusyDevice{Wanted: d, Reservation: &r})
			}
		}
		if len(out) > n || tx.reservedFor(d, key) || own {
			continue
		}
		if keep == nil {
			k := tx.keptForHead()
			keep = &k
		}
		if keep.key == "" || keep.key == key {
			continue
		}
		if through, ok := keep.conflicting(d); ok {
			w := tx.st.Waiters[keep.index]
			w.Devices = slices.Clone(w.Devices)
			out = append(out, BusyDevice{Wanted: d, KeptFor: &w, Through: through})
		}
	}
	return out
}

// ConflictSource is the Source of the claim Busy reports as the holder of a
// device for a conflict record: a container found running on it at
// reconcile without a claim of its own (see Conflict). Text to show only:
// BusyDevice.Conflict is what tells a record from a claim.
const ConflictSource = "found running on it at reconcile, without a claim"

// conflictHolder is a conflict record as Busy reports it: the claim its
// container would hold, since when it was found running on the device.
func conflictHolder(c *Conflict) *Claim {
	return &Claim{Device: c.Device, Owner: c.Owner, Source: ConflictSource, Since: c.Since}
}

// BusyAfterTakeOver is what Busy would list for the request once owner's
// container took over the claims of the containers from that stand in the
// way of devs (TakeOver: the same claims, chosen by the same code), found
// without moving anything: a caller takes the claims over only when that
// admits the request. Before the takeover the predecessors' claims hide
// what else stands in the way (a device kept for the head of the queue is
// looked for only where nothing holds it), so Busy as it is cannot tell.
func (tx *Tx) BusyAfterTakeOver(key string, owner Owner, devs []devices.Device, from []string) []BusyDevice {
	tx.check()
	if owner.ContainerID == "" {
		return tx.Busy(key, owner, devs)
	}
	// A scratch transaction over the state with the claims moved, as
	// TakeOver would move them: Busy reads it and writes nothing but its
	// own memo of the head's keep.
	sim := &Tx{l: tx.l, now: tx.now, st: tx.st}
	sim.st.Claims = slices.Clone(tx.st.Claims)
	for _, id := range from {
		moveClaims(sim.st.Claims, id, owner, devs, tx.now)
	}
	return sim.Busy(key, owner, devs)
}

// holdsItself reports whether owner's container (this incarnation of it)
// holds d itself: asking for it again changes nothing.
func (tx *Tx) holdsItself(d devices.Device, owner *Owner) bool {
	i, found := tx.claimIndex(d.UUID)
	return found && owner.ContainerID != "" && SameIncarnation(&tx.st.Claims[i].Owner, owner)
}

// SameIncarnation reports whether a and b may be the same container: the
// same container id, and not two different recorded processes (both a pid
// and its start time known on each side, and unequal). A container id is
// unique only within one runtime root or containerd namespace: two plain
// runc roots, or two namespaces behind the containerd hooks wrapper, may
// each run a container "train" at once, and the pid of each one's process
// tells them apart.
func SameIncarnation(a, b *Owner) bool {
	if a.ContainerID != b.ContainerID {
		return false
	}
	if a.Pid > 0 && b.Pid > 0 && a.PidStart > 0 && b.PidStart > 0 {
		return a.Pid == b.Pid && a.PidStart == b.PidStart
	}
	return true
}

// Claim gives every device of devs to owner's container, or none: if any is
// cordoned (see CordonsOn) it returns a *CordonError, if any is busy (see
// Busy) a *BusyError, and changes nothing. Re-claiming a
// device the container already holds is a no-op. A successful claim consumes
// the reservations of key (default: the container id) and removes its
// waiter. It returns the container's claims on devs.
func (tx *Tx) Claim(key string, owner Owner, devs []devices.Device, source string) ([]Claim, error) {
	tx.check()
	devs = uniqueDevices(devs)
	if err := validRequest(owner, devs); err != nil {
		return nil, err
	}
	key = requesterKey(key, owner)
	if err := tx.cordonError(owner.ContainerID, devs); err != nil {
		return nil, err
	}
	if busy := tx.Busy(key, owner, devs); len(busy) > 0 {
		return nil, &BusyError{Busy: busy}
	}
	out := make([]Claim, 0, len(devs))
	var added []string
	for _, d := range devs {
		if i, ok := tx.claimIndex(d.UUID); ok {
			out = append(out, tx.st.Claims[i]) // held by this container already
			continue
		}
		c := Claim{Device: d, Owner: owner, Source: source, Since: tx.now}
		tx.insertClaim(c)
		out = append(out, c)
		added = append(added, d.UUID)
	}
	reserved := tx.removeReservationsFor(key)
	waited := tx.removeWaiter(key)
	switch {
	case len(added) > 0:
		reason := source
		if reserved > 0 {
			reason = strings.TrimPrefix(reason+"; used its reservation", "; ")
		}
		tx.record(OpClaim, &owner, key, added, reason)
	case waited || reserved > 0:
		tx.record(OpDequeue, &owner, key, uuids(devs, plainDevice), "admitted: devices already held by the container")
	}
	tx.maintain()
	return out, nil
}

// removeReservationsFor drops every reservation for key, without an audit
// record (the caller writes one).
func (tx *Tx) removeReservationsFor(key string) int {
	n := len(tx.st.Reservations)
	tx.st.Reservations = slices.DeleteFunc(tx.st.Reservations, func(r Reservation) bool { return r.For == key })
	if d := n - len(tx.st.Reservations); d > 0 {
		tx.touch()
		return d
	}
	return 0
}

// removeWaiter drops key's waiter and its reservations, without an audit
// record.
func (tx *Tx) removeWaiter(key string) bool {
	i := tx.waiterIndex(key)
	if i < 0 {
		return false
	}
	tx.st.Waiters = slices.Delete(tx.ownWaiters(), i, i+1)
	tx.touchedWaiters = append(tx.touchedWaiters, key)
	tx.removeReservationsFor(key)
	tx.touch()
	return true
}

// Enqueue records key as waiting for devs: a new waiter goes to the tail
// (next arrival number); a known one keeps its place and is refreshed (last
// seen, owner, devices), which also renews its reservations — it came back in
// time. It returns the waiter's position (see Position). An empty key (and
// container id) or no devices enqueues nothing and returns 0, 0.
func (tx *Tx) Enqueue(key string, owner Owner, devs []devices.Device) (position, total int) {
	tx.check()
	key = requesterKey(key, owner)
	devs = uniqueDevices(devs)
	if key == "" || len(devs) == 0 {
		return 0, 0
	}
	if i := tx.waiterIndex(key); i >= 0 {
		w := &tx.ownWaiters()[i]
		w.LastSeen = tx.now
		tx.sawWaiterAt(tx.now)
		w.Owner = owner
		w.Devices = slices.Clone(devs)
		until := tx.now.Add(tx.l.opts.ReservationTTL)
		for j := range tx.st.Reservations {
			r := &tx.st.Reservations[j]
			if r.For == key && wantsUUID(devs, r.Device.UUID) && r.Until.Before(until) {
				r.Until = until
			}
		}
		tx.record(OpRefresh, &owner, key, uuids(devs, plainDevice), "")
	} else {
		seq := max(tx.st.NextSeq, 1)
		tx.st.NextSeq = seq + 1
		tx.st.Waiters = append(tx.ownWaiters(), Waiter{
			Key: key, Seq: seq, Devices: slices.Clone(devs), Owner: owner, FirstSeen: tx.now, LastSeen: tx.now,
		})
		tx.sawWaiterAt(tx.now)
		tx.record(OpEnqueue, &owner, key, uuids(devs, plainDevice), fmt.Sprintf("arrival %d", seq))
	}
	tx.touchedWaiters = append(tx.touchedWaiters, key)
	tx.touch()
	tx.maintain()
	position, total, _ = tx.Position(key)
	return position, total
}

func wantsUUID(devs []devices.Device, uuid string) bool {
	return slices.ContainsFunc(devs, func(d devices.Device) bool { return d.UUID == uuid })
}

func anyConflict(a, b []devices.Device) bool {
	for _, x := range a {
		for _, y := range b {
			if devices.Conflicts(x, y) {
				return true
			}
		}
	}
	return false
}

// Position is key's place in its queue: among the waiters whose devices
// conflict with key's (key included), ordered by arrival, key is number
// position of total ("position 2 of 3"). ok is false if key is not waiting.
func (tx *Tx) Position(key string) (position, total int, ok bool) {
	tx.check()
	i := tx.waiterIndex(key)
	if i < 0 {
		return 0, 0, false
	}
	w := &tx.st.Waiters[i]
	for j := range tx.st.Waiters {
		v := &tx.st.Waiters[j]
		if j == i || anyConflict(v.Devices, w.Devices) {
			total++
			if v.Seq <= w.Seq {
				position++
			}
		}
	}
	return position, total, true
}

// QueuePlace is a waiter's place in its queue (see Position).
type QueuePlace struct {
	Position, Total int
}

// Positions is Position for every waiter, computed in one pass over the
// queue: waiters asking for the same set of devices share a conflict set,
// so each waiter costs one sum over the few device sets that conflict with
// its own, not a scan of the queue (ctl queue lists thousands).
func (tx *Tx) Positions() map[string]QueuePlace {
	tx.check()
	ws := tx.st.Waiters
	out := make(map[string]QueuePlace, len(ws))
	// Group waiters by their device set.
	type group struct {
		devs      []devices.Device
		conflicts []int // groups (this one included) whose waiters conflict
		seen      int   // waiters of this group met so far, in arrival order
		size      int
	}
	var groups []group
	byKey := map[string]int{}
	of := make([]int, len(ws))
	var key strings.Builder
	for i := range ws {
		key.Reset()
		for _, d := range ws[i].Devices {
			key.WriteString(d.UUID)
			key.WriteByte(0)
		}
		g, ok := byKey[key.String()]
		if !ok {
			g = len(groups)
			byKey[key.String()] = g
			groups = append(groups, group{devs: ws[i].Devices})
		}
		groups[g].size++
		of[i] = g
	}
	for a := range groups {
		for b := range groups {
			if a == b || anyConflict(groups[a].devs, groups[b].devs) {
				groups[a].conflicts = append(groups[a].conflicts, b)
			}
		}
	}
	// Waiters are in arrival order: a waiter's position is the number of
	// conflicting waiters met so far, itself included.
	for i := range ws {
		g := &groups[of[i]]
		g.seen++
		pos, total := 0, 0
		for _, c := range g.conflicts {
			pos += groups[c].seen
			total += groups[c].size
		}
		out[ws[i].Key] = QueuePlace{Position: pos, Total: total}
	}
	return out
}

// DropWaiter removes key from the queue (with its reservations). It reports
// whether key was waiting.
func (tx *Tx) DropWaiter(key, reason string) bool {
	tx.check()
	i := tx.waiterIndex(key)
	if i < 0 {
		return false
	}
	w := tx.st.Waiters[i]
	tx.removeWaiter(key)
	tx.record(OpDequeue, &w.Owner, key, uuids(w.Devices, plainDevice), reason)
	tx.maintain()
	return true
}

// DropPodWaiters removes every waiter of front end fe's pod sandbox (matched
// as PodMatches says) and returns them.
func (tx *Tx) DropPodWaiters(fe FrontEnd, podUID, sandboxID, reason string) []Waiter {
	tx.check()
	var out []Waiter
	for _, w := range tx.st.Waiters {
		if PodMatches(&w.Owner, fe, podUID, sandboxID) {
			out = append(out, w)
		}
	}
	for _, w := range out {
		tx.removeWaiter(w.Key)
		tx.record(OpDequeue, &w.Owner, w.Key, uuids(w.Devices, plainDevice), reason)
	}
	if len(out) > 0 {
		tx.maintain()
	}
	return out
}

// PodMatches reports whether o belongs to the pod sandbox of front end fe
// that a pod event names by pod UID and sandbox id.
//
// The sandbox id decides whenever both the event and o have one: a pod
// keeps its UID when the kubelet replaces its sandbox (a new sandbox id, the
// old one stopped and removed later by its garbage collection, while the
// containers of the new one run), so the old sandbox's stop or removal must
// not end the claims, or drop the waiters, of the new one's containers. A
// waiter records the sandbox of its latest retry (Enqueue refreshes the
// owner), so a waiter that retried in the new sandbox stays too. Only an
// event without a sandbox id, or an owner that records none (written by an
// older version, or by a front end that knows no sandbox), is matched by
// pod UID.
//
// Only fe's own owners match: a front end's pod events speak for its pods
// alone, and the pod identity of another front end's owner may be nothing
// but annotations its creator wrote (an OCI hook container naming a
// Kubernetes pod's UID must not lose its claim, while it keeps the GPU, when
// that pod goes).
func PodMatches(o *Owner, fe FrontEnd, podUID, sandboxID string) bool {
	if o.FrontEnd != fe {
		return false
	}
	if sandboxID != "" && o.PodSandboxID != "" {
		return o.PodSandboxID == sandboxID
	}
	return podUID != "" && o.PodUID == podUID
}

// Release ends every claim of containerID (and its conflict records) and
// returns the claims it ended. It is idempotent and never touches another
// container's claims. Waiters are not affected: a refused container's id is
// released by the runtime while its requester stays queued.
func (tx *Tx) Release(containerID, reason string) []Claim {
	tx.check()
	if containerID == "" {
		return nil
	}
	out := tx.releaseWhere(func(c *Claim) bool { return c.Owner.ContainerID == containerID }, reason)
	tx.clearConflictsWhere(func(c *Conflict) bool { return c.Owner.ContainerID == containerID }, reason)
	tx.maintain()
	return out
}

// ReleaseIncarnation is Release for the one incarnation of a container that
// o names: what a liveness check found exited is that process's container,
// not another one that runs under the same id. With o's process recorded
// only claims recording that same process end (see SameRecordedProcess); a
// claim of the id that records none may be another container not started
// yet, and is kept (unlike SameIncarnation, which calls such a pair the same
// container so as never to count one container twice as busy).
func (tx *Tx) ReleaseIncarnation(o Owner, reason string) []Claim {
	tx.check()
	if o.ContainerID == "" {
		return nil
	}
	out := tx.releaseWhere(func(c *Claim) bool { return SameRecordedProcess(&c.Owner, &o) }, reason)
	tx.clearConflictsWhere(func(c *Conflict) bool { return SameRecordedProcess(&c.Owner, &o) }, reason)
	tx.maintain()
	return out
}

// recordsProcess reports whether o records anything of its process: a pid
// or a cgroup.
func recordsProcess(o *Owner) bool { return o.Pid > 0 || o.Cgroup != "" }

// SameRecordedProcess reports whether a is the incarnation o names: the same
// container id and, when o records its process, the same process recorded in
// a. It decides which claims the incarnation operations end, so it matches
// only on evidence, never on its absence: a claim is o's only when it
// records a process too and every field both record agrees — the pid (one
// recording a pid and the other none are two stages of two containers, not
// one), the pid's start time when both know it, the cgroup when both know
// it. Any difference in a known field makes it another container of the id
// (another runtime root or namespace), which is kept: an exited container
// whose pid start time could not be read, or that records only its cgroup
// (an NRI claim before its start record), must not end the claim of a live
// one of the same id. An o that records no process at all names the
// container by id (MarkStopped, MarkDraining): every claim of the id.
func SameRecordedProcess(a, o *Owner) bool {
	if a.ContainerID != o.ContainerID {
		return false
	}
	if !recordsProcess(o) {
		return true
	}
	if !recordsProcess(a) || (a.Pid > 0) != (o.Pid > 0) {
		return false
	}
	if a.Pid > 0 && a.Pid != o.Pid {
		return false
	}
	if a.PidStart > 0 && o.PidStart > 0 && a.PidStart != o.PidStart {
		return false
	}
	if a.Cgroup != "" && o.Cgroup != "" && a.Cgroup != o.Cgroup {
		return false
	}
	return true
}

// ReleasePod ends every claim (and conflict record) of the containers of
// front end fe's pod sandbox, matched by sandbox id, or by pod UID where
// the event or the claim has no sandbox id (see PodMatches).
func (tx *Tx) ReleasePod(fe FrontEnd, podUID, sandboxID, reason string) []Claim {
	tx.check()
	if podUID == "" && sandboxID == "" {
		return nil
	}
	out := tx.releaseWhere(func(c *Claim) bool { return PodMatches(&c.Owner, fe, podUID, sandboxID) }, reason)
	tx.clearConflictsWhere(func(c *Conflict) bool { return PodMatches(&c.Owner, fe, podUID, sandboxID) }, reason)
	tx.maintain()
	return out
}

// ReleaseDevice ends the claim on one device whoever holds it (operator
// force-release), or returns an error wrapping ErrNotFound.
func (tx *Tx) ReleaseDevice(uuid, reason string) (Claim, error) {
	tx.check()
	i, ok := tx.claimIndex(uuid)
	if !ok {
		return Claim{}, fmt.Errorf("%w: no claim on device %s (gpu-guard-ctl status lists the held devices)", ErrNotFound, uuid)
	}
	c := tx.st.Claims[i]
	tx.releaseWhere(func(x *Claim) bool { return x.Device.UUID == uuid }, reason)
	tx.maintain()
	return c, nil
}

// releaseWhere removes the matching claims, writing one audit record per
// container, and returns them.
func (tx *Tx) releaseWhere(match func(*Claim) bool, reason string) []Claim {
	var out []Claim
	kept := tx.st.Claims[:0]
	for i := range tx.st.Claims {
		if c := tx.st.Claims[i]; match(&c) {
			out = append(out, c)
		} else {
			kept = append(kept, c)
		}
	}
	if len(out) == 0 {
		return nil
	}
	tx.st.Claims = kept
	tx.touch()
	tx.recordPerContainer(OpRelease, out, reason)
	return out
}

// recordPerContainer writes one op audit record per container of claims, in
// order of first appearance, naming its devices among them.
func (tx *Tx) recordPerContainer(op string, claims []Claim, reason string) {
	var ids []string
	for _, c := range claims {
		if !slices.Contains(ids, c.Owner.ContainerID) {
			ids = append(ids, c.Owner.ContainerID)
		}
	}
	for _, id := range ids {
		var devs []string
		var owner Owner
		for _, c := range claims {
			if c.Owner.ContainerID == id {
				devs = append(devs, c.Device.UUID)
				owner = c.Owner
			}
		}
		tx.record(op, &owner, "", devs, reason)
	}
}

func (tx *Tx) clearConflictsWhere(match func(*Conflict) bool, reason string) {
	kept := tx.st.Conflicts[:0]
	for i := range tx.st.Conflicts {
		c := tx.st.Conflicts[i]
		if match(&c) {
			tx.record(OpConflictCleared, &c.Owner, "", []string{c.Device.UUID}, reason)
			tx.touch()
			continue
		}
		kept = append(kept, c)
	}
	tx.st.Conflicts = kept
}

// SetStarted records the pid (with its start time, against pid reuse) and
// cgroup of a holder once it started, in its claims and in its conflict
// records: a record becomes the container's claim once the device is free
// (promoteConflicts), and a claim without a process is never checked for
// liveness, so without them a container that ended without a stop event
// would keep the device for good. It reports whether the container holds
// anything or is recorded in conflict.
func (tx *Tx) SetStarted(containerID string, pid int, pidStart uint64, cgroup string) bool {
	tx.check()
	if containerID == "" {
		return false
	}
	var devs []string
	var owner Owner
	set := func(o *Owner, uuid string) {
		o.Pid, o.PidStart, o.Cgroup = pid, pidStart, cgroup
		if o.StartedAt.IsZero() {
			o.StartedAt = tx.now
		}
		devs = append(devs, uuid)
		owner = *o
	}
	for i := range tx.st.Claims {
		if c := &tx.st.Claims[i]; c.Owner.ContainerID == containerID {
			set(&c.Owner, c.Device.UUID)
		}
	}
	for i := range tx.st.Conflicts {
		if c := &tx.st.Conflicts[i]; c.Owner.ContainerID == containerID {
			set(&c.Owner, c.Device.UUID)
		}
	}
	if len(devs) == 0 {
		return false
	}
	tx.touch()
	tx.record(OpStarted, &owner, "", devs, fmt.Sprintf("pid %d, cgroup %q", pid, cgroup))
	return true
}

// MarkStopped records that a holder exited under release_on = "remove": the
// claim stays until removal, and another container of the same pod (a
// restart, the app after its init container) may take it over (TakeOver). It reports whether the container holds anything.
func (tx *Tx) MarkStopped(containerID string) bool {
	return tx.MarkStoppedIncarnation(Owner{ContainerID: containerID})
}

// MarkStoppedIncarnation is MarkStopped for the one incarnation of a
// container that o names (see ReleaseIncarnation).
func (tx *Tx) MarkStoppedIncarnation(o Owner) bool {
	tx.check()
	var devs []string
	var owner Owner
	for i := range tx.st.Claims {
		c := &tx.st.Claims[i]
		if o.ContainerID == "" || !SameRecordedProcess(&c.Owner, &o) {
			continue
		}
		if c.Owner.StoppedAt.IsZero() {
			c.Owner.StoppedAt = tx.now
			tx.touch()
		}
		devs = append(devs, c.Device.UUID)
		owner = c.Owner
	}
	if len(devs) == 0 {
		return false
	}
	tx.record(OpStopped, &owner, "", devs, "claim kept until the container is removed")
	return true
}

// TakeOver moves to the container to (a container of the same pod under
// release_on = "remove", or the container a gpu-guard-ctl run ticket is
// handed to) the claims of fromContainerID that stand in the way of devs,
// the devices to asks for, and returns the new claims; fromContainerID
// keeps its other claims. Only those move: the kubelet's device manager
// splits an init container's devices between the pod's app containers,
// and a container given the claim on a device it does not ask for would
// keep out the sibling that does, for as long as it runs, while status
// and refusals named it as the holder of a device it does not reach.
// What stands in the way is what Busy reports of fromContainerID's claims:
// a claim on a device of devs, on the whole GPU of a MIG instance of devs,
// or on a MIG instance of a GPU of devs (devices.Conflicts). A claim that
// conflicts with one so moved moves too (a container may hold a GPU and
// one of its instances, after an earlier takeover): two containers never
// hold one GPU. Nothing happens if from holds none of them or to has no
// id. The audit record names what moved and, in its reason, what from
// keeps.
func (tx *Tx) TakeOver(fromContainerID string, to Owner, devs []devices.Device, reason string) []Claim {
	tx.check()
	out := moveClaims(tx.st.Claims, fromContainerID, to, devs, tx.now)
	if len(out) == 0 {
		return nil
	}
	tx.touch()
	reason = fmt.Sprintf("from container %s: %s", fromContainerID, reason)
	var kept []devices.Device
	for i := range tx.st.Claims {
		if c := &tx.st.Claims[i]; c.Owner.ContainerID == fromContainerID {
			kept = append(kept, c.Device)
		}
	}
	if len(kept) > 0 {
		reason += fmt.Sprintf("; container %s keeps %s, which container %s does not ask for",
			ShortID(fromContainerID), naming.Devices(kept), ShortID(to.ContainerID))
	}
	tx.record(OpTakeover, &to, "", uuids(out, claimDevice), reason)
	return out
}

// moveClaims gives to, since now, the claims in claims of the container
// from that stand in the way of want (see TakeOver), and returns the moved
// claims in device order: the move of TakeOver, which BusyAfterTakeOver
// simulates on a copy (one code, so the simulation is the move). Nothing
// moves when from is empty, to has no id, or they are one.
func moveClaims(claims []Claim, from string, to Owner, want []devices.Device, now time.Time) []Claim {
	if from == "" || to.ContainerID == "" || from == to.ContainerID {
		return nil
	}
	var out []Claim
	conflicts := func(d devices.Device) bool {
		return slices.ContainsFunc(want, func(w devices.Device) bool { return devices.Conflicts(d, w) }) ||
			slices.ContainsFunc(out, func(m Claim) bool { return devices.Conflicts(d, m.Device) })
	}
	// Until nothing more moves: a claim moved on a GPU whole takes its
	// instances, which may sort before it, along.
	for moved := true; moved; {
		moved = false
		for i := range claims {
			c := &claims[i]
			if c.Owner.ContainerID != from || !conflicts(c.Device) {
				continue
			}
			c.Owner = to
			c.Since = now
			out = append(out, *c)
			moved = true
		}
	}
	slices.SortFunc(out, func(a, b Claim) int { return strings.Compare(a.Device.UUID, b.Device.UUID) })
	return out
}

// HandBack gives claims a restart took over back to their earlier holder as
// they were (originals: the claims TakeOver moved, read before it moved
// them), when the restart never started: its create was undone (refused by
// a later check, or failed in the runtime), so the takeover never became
// real. A device whose claim is no longer restartID's, or whose holder
// started, is left alone, and so is an original that never moved (the
// earlier holder's claim on a device the restart did not ask for is still
// its own). The restart's own claims that conflict with one given back end
// in the same transaction (it asked for a GPU whole and took over one of
// its MIG instances, or the reverse): two containers never hold one GPU,
// and the restart never started, so nothing of it ran there to drain. It
// returns the claims given back.
func (tx *Tx) HandBack(restartID string, originals []Claim, reason string) []Claim {
	tx.check()
	var out []Claim
	for _, o := range originals {
		i, found := tx.claimIndex(o.Device.UUID)
		if !found {
			continue
		}
		c := &tx.st.Claims[i]
		if c.Owner.ContainerID != restartID || c.Owner.Pid > 0 || o.Owner.ContainerID == restartID {
			continue
		}
		*c = o
		out = append(out, o)
	}
	if len(out) == 0 {
		return nil
	}
	tx.touch()
	// One record per container handed back to (a restart may have taken
	// over from several).
	for i := range out {
		o := out[i].Owner
		if slices.ContainsFunc(out[:i], func(c Claim) bool { return c.Owner.ContainerID == o.ContainerID }) {
			continue
		}
		var devs []string
		for _, c := range out[i:] {
			if c.Owner.ContainerID == o.ContainerID {
				devs = append(devs, c.Device.UUID)
			}
		}
		tx.record(OpTakeover, &o, "", devs, fmt.Sprintf("handed back from container %s: %s", restartID, reason))
	}
	// What the restart claimed itself beside what it took over, on the
	// same GPU as a claim handed back.
	conflictsBack := func(d devices.Device) bool {
		return slices.ContainsFunc(out, func(o Claim) bool { return devices.Conflicts(o.Device, d) })
	}
	var mine []devices.Device
	for i := range tx.st.Claims {
		if c := &tx.st.Claims[i]; c.Owner.ContainerID == restartID && conflictsBack(c.Device) {
			mine = append(mine, c.Device)
		}
	}
	if len(mine) == 0 {
		return out
	}
	tx.releaseWhere(func(c *Claim) bool { return c.Owner.ContainerID == restartID && conflictsBack(c.Device) },
		fmt.Sprintf("%s; %s conflicts with what was handed back", reason, naming.Devices(mine)))
	tx.maintain()
	return out
}
