// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"fmt"
	"strings"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
)

// conflictText is what a refusal over busy devices says.
type conflictText struct {
	now    time.Time
	policy config.PolicyConfig
	busy   []ledger.BusyDevice
	// waiter resolves a reservation's waiter key to the waiter, so that
	// "reserved for" names a container rather than a key.
	waiter func(key string) (ledger.Waiter, bool)
	// partial reports whether a waiter holds reservations it cannot start
	// on yet (the head of the queue, keeping what frees for it); nil: never.
	partial func(key string) bool
	// key is the requester's waiter key: a reservation for a waiter that
	// arrived after it is not called "earlier in the queue".
	key string
	// queued: the request is queued at position of total, waiting waited.
	queued          bool
	position, total int
	waited          time.Duration
	// free are the GPUs nobody holds or has reserved right now.
	free []devices.Device
	// hook: the request comes from the OCI hook front end. Nothing retries
	// it (no kubelet), and whether the hook waits is the hook's business, so
	// the text says only how many requests wait before this one.
	hook bool
	// kept are the release rule's verdicts on the holders it kept (by
	// incarnation): what it found out about a holder that the ledger does
	// not record (its container removed, or its removal unknown).
	kept map[incarnation]Verdict
}

// String renders the refusal: every busy device with its holder or
// reservation, the queue position, and what to do.
func (c conflictText) String() string {
	var b strings.Builder
	b.WriteString(c.busyList())
	switch {
	case c.queued && c.hook:
		switch ahead := c.position - 1; {
		case ahead <= 0:
			b.WriteString("; no other request waits for it.")
		case ahead == 1:
			b.WriteString("; 1 request waits for it before this one.")
		default:
			fmt.Fprintf(&b, "; %d requests wait for it before this one.", ahead)
		}
	case c.queued:
		fmt.Fprintf(&b, "; queued at position %d of %d, waiting %s. ", c.position, c.total, age(c.waited))
		if c.onlyReserved() {
			b.WriteString("The request will be admitted once the requesters holding the reservations have started or let them expire; retrying is automatic under Kubernetes")
		} else {
			when, _ := c.holderEnds()
			b.WriteString("The request will be admitted when " + when + " and its turn comes; retrying is automatic under Kubernetes")
		}
		fmt.Fprintf(&b, " (the head of the queue keeps a freed GPU for %s).", c.policy.ReservationTTL.Duration)
	default:
		_, once := c.holderEnds()
		b.WriteString(". Refused and not queued (policy on_conflict = \"reject\"): retry once " + once + ".")
	}
	b.WriteString(" ")
	b.WriteString(freeText(c.free))
	return b.String()
}

// busyList names what stands in the way of each busy device, "; " between
// them.
func (c conflictText) busyList() string {
	var b strings.Builder
	for i, bd := range c.busy {
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(c.busyText(bd))
	}
	return b.String()
}

// busyWords is what the words for a decision's busy devices need from the
// transaction that decided it, resolved before it ended (a Tx cannot be
// read after its Update returns), so that Decision.BusyText can say them
// again later, with ages counted then.
type busyWords struct {
	key      string
	queued   bool
	position int
	// waiters are the waiters the busy devices are reserved for, and the
	// requester's own, by key.
	waiters map[string]ledger.Waiter
	// partial: the waiter of the key holds reservations it cannot start
	// on yet (see conflictText.partial).
	partial map[string]bool
	kept    map[incarnation]Verdict
}

// words resolves what busyText asks of the transaction, for BusyText.
func (c conflictText) words() *busyWords {
	w := &busyWords{key: c.key, queued: c.queued, position: c.position, kept: c.kept,
		waiters: map[string]ledger.Waiter{}, partial: map[string]bool{}}
	keys := []string{c.key}
	for _, bd := range c.busy {
		if bd.Reservation != nil {
			keys = append(keys, bd.Reservation.For)
		}
	}
	for _, k := range keys {
		if c.waiter == nil || k == "" {
			continue
		}
		if v, ok := c.waiter(k); ok {
			w.waiters[k] = v
		}
		if c.partial != nil && c.partial(k) {
			w.partial[k] = true
		}
	}
	return w
}

// BusyText names what stands between the request and each of its busy
// devices (Busy), in the words of the refusal's Message, with ages counted
// at now: the holder (and the device it holds, when that is not the one
// asked for), the waiter a device is reserved or kept for (and through
// which device), and whether a stopped holder waits for its removal. ""
// when nothing is busy. A front end that reports a wait in its own lines
// (the waiting OCI hook's progress and its give-up errors, gpu-guard-ctl
// run) says it with this, so that it says what a refusal says.
func (d Decision) BusyText(now time.Time) string {
	c := conflictText{now: now, busy: d.Busy}
	if w := d.words; w != nil {
		c.key, c.queued, c.position, c.kept = w.key, w.queued, w.position, w.kept
		c.waiter = func(key string) (ledger.Waiter, bool) {
			v, ok := w.waiters[key]
			return v, ok
		}
		c.partial = func(key string) bool { return w.partial[key] }
	} else {
		// A decision made elsewhere (a test's): no waiter is known.
		c.waiter = func(string) (ledger.Waiter, bool) { return ledger.Waiter{}, false }
	}
	return c.busyList()
}

// holderEnds says what ends the holders' claims, for "admitted when …"
// (when) and "retry once …" (once). A holder that has already stopped —
// kept until its removal (release_on = "remove") or draining — does not
// "stop" again: told so, the reader would wait for nothing, or stop a
// container that is gone.
func (c conflictText) holderEnds() (when, once string) {
	var stopped, draining bool
	for _, bd := range c.busy {
		switch h := bd.Holder; {
		case h == nil:
		case !h.Owner.DrainingSince.IsZero():
			draining = true
		case !h.Owner.StoppedAt.IsZero():
			stopped = true
		default:
			return "the holder stops", "the holder has stopped"
		}
	}
	switch {
	case draining && stopped:
		return "the stopped holders' claims end (at their removal, or once their processes have left the GPU)",
			"the stopped holders' claims have ended (at their removal, or once their processes have left the GPU)"
	case draining:
		return "the draining holder's processes have left the GPU (or its claim's idle grace is over)",
			"the draining holder's processes have left the GPU (or its claim's idle grace is over)"
	case stopped:
		return "the stopped holder's container is removed", "the stopped holder's container has been removed"
	}
	return "the holder stops", "the holder has stopped"
}

// keptText is what follows a holder that exited and keeps its claim until
// its container is removed (release_on = "remove"), v the release rule's
// verdict on it in this decision (zero when it was not checked).
//
// It says when the holder exited only if an earlier transaction recorded
// it: a stop this decision found (MarkStopped) carries the decision's own
// time, which is not when the holder exited, and a decision that commits
// nothing (the hook's refusal, explain) finds it again the next time, so
// each refusal would say it exited just then.
//
// A claim nothing will end by itself gets the way to end it: one whose
// removal cannot be told, and one whose container a runtime root still has
// (its engine may have lost it, and then never deletes it there).
func keptText(o ledger.Owner, v Verdict, now time.Time) string {
	exited := "exited " + stamp(o.StoppedAt, now)
	if v.Action == MarkStopped {
		exited = "has exited"
	}
	var b strings.Builder
	b.WriteString(" (" + exited + ", kept until the container is removed: policy release_on = \"remove\"")
	switch {
	case v.Unsure != "":
		fmt.Fprintf(&b, "; whether it was removed cannot be told: %s; if its engine no longer lists it, end its claim with "+
			"`sudo gpu-guard-ctl release --container %s --reason \"container removed\"`", v.Unsure, o.ContainerID)
	case v.Listed != "":
		fmt.Fprintf(&b, "; runtime root %s still has its container: %s", v.Listed, KeptRemedy(v.Listed, o.ContainerID))
	}
	b.WriteString(")")
	return b.String()
}

// onlyReserved reports whether every busy device is merely reserved for
// another requester (nobody holds it).
func (c conflictText) onlyReserved() bool {
	for _, bd := range c.busy {
		if bd.Holder != nil || bd.KeptFor != nil { // a kept device waits for a holder too
			return false
		}
	}
	return len(c.busy) > 0
}

func (c conflictText) busyText(bd ledger.BusyDevice) string {
	name := naming.Device(bd.Wanted)
	switch {
	case bd.Holder != nil:
		h := bd.Holder
		var b strings.Builder
		b.WriteString(name)
		record := bd.Conflict
		if record {
			b.WriteString(" is in use by ")
		} else {
			b.WriteString(" is held by ")
		}
		b.WriteString(HolderName(h.Owner))
		v := c.kept[incarnationOf(h.Owner)]
		if v.EarlierIncarnation {
			// The requester's own id: say which of its incarnations holds
			// it and why that one counts as running.
			fmt.Fprintf(&b, " (an earlier incarnation of this container, pid %d: %s)", h.Owner.Pid, v.Why)
		}
		if h.Device.UUID != bd.Wanted.UUID {
			// A full GPU against one of its MIG instances, or the reverse.
			fmt.Fprintf(&b, " through %s", naming.Device(h.Device))
		}
		fmt.Fprintf(&b, " since %s", stamp(h.Since, c.now))
		if record {
			// No claim: the container was found running on the device
			// while another held it. It is a holder all the same: it
			// becomes the claim once the other one's ends.
			b.WriteString(" (running on it without a claim: found there at reconcile while another container held it)")
		}
		switch {
		case !h.Owner.DrainingSince.IsZero() && v.Deleted:
			fmt.Fprintf(&b, " (exited and removed: no runtime knows its container any more; draining since %s, "+
				"waiting for its processes to leave the GPU)", stamp(h.Owner.DrainingSince, c.now))
		case !h.Owner.DrainingSince.IsZero():
			b.WriteString(drainingText(h.Owner, c.now))
		case !h.Owner.StoppedAt.IsZero():
			b.WriteString(keptText(h.Owner, v, c.now))
		}
		return b.String()
	case bd.Reservation != nil:
		r := bd.Reservation
		who := r.For
		w, known := c.waiter(r.For)
		if known {
			who = HolderName(w.Owner)
		}
		order := c.order(w, known)
		if c.partial != nil && c.partial(r.For) {
			// The head of the queue: it keeps the device while it waits
			// for its other ones, so it is not used at its next retry.
			order += ", first in line: kept for it until the other devices it asks for are free"
		}
		through := ""
		if r.Device.UUID != bd.Wanted.UUID {
			// A MIG instance of a GPU reserved whole, or the reverse.
			through = " through " + naming.Device(r.Device)
		}
		return fmt.Sprintf("%s is reserved for %s%s (%s) until %s (%s left)",
			name, who, through, order, r.Until.UTC().Format(time.RFC3339), age(r.Until.Sub(c.now)))
	case bd.KeptFor != nil:
		// Nobody holds or reserves the device, but the head of the queue
		// asks for a whole GPU it belongs to (or a MIG instance of it),
		// which cannot be reserved while part of it is in use.
		w := bd.KeptFor
		return fmt.Sprintf("%s is kept for %s (%s, first in line for %s, which waits until the rest of it is free)",
			name, HolderName(w.Owner), c.order(*w, true), naming.Device(bd.Through))
	default:
		return name + " is busy"
	}
}

// order says where the waiter a device is reserved for stands relative to
// the requester. Reservations go to the earliest waiter whose devices are all
// free, which may have arrived after a requester still waiting for a held
// device.
func (c conflictText) order(reserver ledger.Waiter, known bool) string {
	later := c.queued && c.position == 1 // nobody conflicting is ahead of it
	if me, ok := c.waiter(c.key); ok && known && c.key != "" {
		later = reserver.Seq > me.Seq
	}
	if later {
		return "later in the queue, but all it asks for was free first"
	}
	return "earlier in the queue"
}

// freeText names the GPUs that are free now. Docker's `--gpus N` always asks
// for GPUs 0..N-1; naming the free ones tells its users what to ask for.
func freeText(free []devices.Device) string {
	if len(free) == 0 {
		return "No GPU is free now."
	}
	idx := make([]string, len(free))
	for i, d := range free {
		idx[i] = d.Index
	}
	return fmt.Sprintf("Free GPUs now: %s (e.g. NVIDIA_VISIBLE_DEVICES=%s).", strings.Join(idx, ", "), free[0].Index)
}

// stamp renders a point in time as RFC 3339 (UTC) with its age.
func stamp(t, now time.Time) string {
	if t.IsZero() {
		return "an unknown time"
	}
	return fmt.Sprintf("%s (%s ago)", t.UTC().Format(time.RFC3339), age(now.Sub(t)))
}

// age renders a duration rounded to the second; negative (clock skew) is 0s.
func age(d time.Duration) string {
	if d < 0 {
		d = 0
	}
	return d.Round(time.Second).String()
}

// policyText explains a refusal that comes from resolution, not from a busy
// device, and how to get past it.
func policyText(err error, policy config.PolicyConfig, inv *devices.Inventory, fe ledger.FrontEnd) string {
	// The resolver's own words may already say what to do (name a GPU of
	// this host, which CDI names work, name the GPUs instead of a device
	// rule): the generic advice would then repeat or contradict them.
	said := func(kind error) bool { return devices.Advises(err, kind) }
	var hint string
	switch reasonFor(err) {
	case "unknown-device":
		hint = fmt.Sprintf("name a GPU of this host (policy unknown_device = %q). GPUs here: %s",
			policy.UnknownDevice, inventoryText(inv))
		if said(devices.ErrUnknownDevice) {
			hint = "GPUs here: " + inventoryText(inv)
		}
	case "invalid-id":
		hint = "fix the device id (an index, a GPU-/MIG- UUID, \"<gpu>:<mig>\", \"all\" or \"none\"). GPUs here: " +
			inventoryText(inv)
		if said(devices.ErrInvalidID) {
			hint = "GPUs here: " + inventoryText(inv)
		}
	case "policy-all":
		hint = fmt.Sprintf("requests for every GPU are refused (policy all_devices = %q); name the GPUs the container needs", policy.AllDevices)
		if said(devices.ErrAllRejected) {
			hint = "GPUs here: " + inventoryText(inv)
		}
	case "policy-privileged":
		hint = fmt.Sprintf("privileged containers are refused (policy privileged = %q); drop privileged or exempt the namespace", policy.Privileged)
		if !TrustsIdentity(fe) {
			// An exemption is never granted on this front end's word
			// (see TrustsIdentity): only dropping privileged helps.
			hint = fmt.Sprintf("privileged containers are refused (policy privileged = %q); drop privileged "+
				"(exempt_namespaces does not apply to this front end: the container names its namespace itself)", policy.Privileged)
		}
		if said(devices.ErrPrivilegedRejected) {
			hint = "GPUs here: " + inventoryText(inv)
		}
	case "too-large":
		hint = "the container's device request is larger than any real one"
	default:
		hint = "the container's device request could not be understood"
	}
	return fmt.Sprintf("GPU request refused: %v; %s.", err, hint)
}

// inventoryText lists the host's GPUs for a message: "0 (GPU-…), 1 (GPU-…)".
func inventoryText(inv *devices.Inventory) string {
	if inv == nil || len(inv.GPUs) == 0 {
		return "none"
	}
	parts := make([]string, 0, len(inv.GPUs))
	for _, g := range inv.GPUs {
		parts = append(parts, fmt.Sprintf("%d (%s)", g.Index, g.UUID))
	}
	return strings.Join(parts, ", ")
}
