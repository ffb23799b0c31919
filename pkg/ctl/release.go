// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
)

// maxReasonLen bounds --reason: it goes into every audit record of the
// release and is printed by `audit`.
const maxReasonLen = 512

func (a *app) releaseCommand() *cobra.Command {
	var (
		containerID, device, reason string
		dryRun, force               bool
	)
	cmd := newCommand("release (--container ID | --device UUID) --reason TEXT [--force]",
		"Force-release a claim (root only, audited)",
		`Release the claims of one container (--container: the full id or a unique
prefix, as status and claims show it), or the claim on one device (--device:
its UUID or index). An index that names more than one claimed device (a claim
on a MIG instance or GPU gone from the inventory keeps an index another device
may have now) is refused, naming each: give the UUID. The reason is required
and is written to the audit log with the released claims and the operator's uid.

Use it when a holder is known to be gone but its claim stayed (the daemon was
down when it stopped), or to clear a claim on a GPU that was removed. A released
GPU is reserved for the head of its queue, if anyone waits for it.

--container also removes the container's queue entry, if it waits (a
gpu-guard-ctl run ticket, a hook or a pod container), with the GPUs reserved
for it: the id is matched against the queue's container ids and requesters
too. A released GPU goes to the next in line.

Releasing a claim does not stop the container: if it still ran, it would keep
using the GPU and the next container would share it. So a holder (or waiter)
whose process still runs, or whose liveness cannot be told, is refused (exit 1,
naming the device and the holder): stop it first, or add --force to release
anyway (a warning is printed on stderr). A draining claim (release_requires_idle:
its holder exited, its processes may still be on the GPU) is refused the
same way: it ends by itself once they leave (at the latest after idle_grace);
add --force if you know they are gone. So is, under release_requires_idle, a
holder found exited whose claim is not marked draining yet: gc marks it.
A holder that never started (no pid,
no cgroup recorded) has nothing to check: it is released, with a note. Prefer
`+"`gc`"+` for holders that exited.

--container also clears the container's conflict records (it was found
running on a GPU another container holds): such a record becomes the
container's claim once the GPU is free, and is checked as a claim is.

--dry-run shows what would be released and changes nothing (it does not
demand root, but reading the ledger needs it: run it with sudo); it refuses
what the release would refuse.`,
		`  sudo gpu-guard-ctl release --container 4f2a9c1be0d3 --reason "node drained, pod force-deleted"
  sudo gpu-guard-ctl release --device GPU-6c1a2f2e-0000-4000-8000-000000000000 --reason "GPU removed"
  sudo gpu-guard-ctl release --device 1 --reason "check" --dry-run`,
		noArgs,
		func(cmd *cobra.Command, _ []string) error {
			if (containerID == "") == (device == "") {
				return usagef("name exactly one of --container ID or --device UUID")
			}
			reason = strings.TrimSpace(reason)
			if reason == "" {
				return usagef("--reason is required: say why the claim is released; it is written to the audit log")
			}
			if len(reason) > maxReasonLen {
				return usagef("--reason is %d bytes long; keep it under %d", len(reason), maxReasonLen)
			}
			if !dryRun {
				if err := a.requireRoot("release"); err != nil {
					return err
				}
			}
			return a.release(cmd.Context(), releaseTarget{containerID: containerID, device: device}, reason, dryRun, force)
		})
	f := cmd.Flags()
	f.StringVar(&containerID, "container", "", "release every claim and queue entry of this container (full id or unique prefix, or a requester as queue shows it)")
	f.StringVar(&device, "device", "", "release the claim on this device (UUID or index)")
	f.StringVar(&reason, "reason", "", "why (required; written to the audit log)")
	f.BoolVar(&dryRun, "dry-run", false, "show what would be released; change nothing")
	f.BoolVar(&force, "force", false, "release even a holder whose process still runs (it keeps using the GPU)")
	return cmd
}

// releaseTarget is what the operator named: one of the two is set.
type releaseTarget struct {
	containerID string
	device      string
}

func (a *app) release(ctx context.Context, target releaseTarget, reason string, dryRun, force bool) error {
	st, err := a.snapshot(ctx)
	if err != nil {
		return err
	}
	var (
		claims    []ledger.Claim
		conflicts []ledger.Conflict // --container: its conflict records, which the release clears
		waiters   []ledger.Waiter
		id        string // the full container id (or requester), for --container
		dev       string // the device UUID, for --device
		holder    string // the container holding dev when the operator looked
	)
	if target.containerID != "" {
		id, err = matchContainer(st, target.containerID)
		if err != nil {
			return err
		}
		claims, conflicts, waiters = claimsOf(st, id), conflictsOf(&st, id), waitersOf(st, id)
	} else {
		c, err := matchDevice(st, target.device)
		if err != nil {
			return err
		}
		dev, holder, claims = c.Device.UUID, c.Owner.ContainerID, []ledger.Claim{c}
	}
	cfg, err := a.config()
	if err != nil {
		return err
	}
	// Liveness reads cgroupfs and procfs: checked before the lock is taken,
	// and the transaction then makes sure it ends exactly what was checked.
	chk := checkRelease(guard.NewReleaseRule(cfg, a.env.Liveness), &st, claims, conflicts, waiters)
	if err := chk.refusal(); err != nil && !force {
		return err
	}
	for _, n := range chk.notes {
		fmt.Fprintln(a.env.Stderr, escapeLine("note: "+n))
	}
	if force {
		for _, r := range chk.running {
			fmt.Fprintln(a.env.Stderr, escapeLine("warning: --force: "+r+"; released anyway: it keeps using the GPU, and the next container will share it"))
		}
		for _, r := range slices.Concat(chk.draining, chk.exited, chk.exitedConflicts) {
			fmt.Fprintln(a.env.Stderr, escapeLine("warning: --force: "+r+"; released anyway: a process of it still on the GPU shares it with the next container"))
		}
	}
	if dryRun {
		return renderReleaseOf(a.env.Stdout, a.output, releaseOutcome{dryRun: true, id: id, claims: claims,
			cleared: conflicts, dequeued: dequeuedOf(&st, waiters)}, a.env.Now())
	}

	auditReason := a.operatorReason(reason)
	var out releaseOutcome
	err = a.update(ctx, func(tx *ledger.Tx) error {
		out = releaseOutcome{id: id} // fn may be retried; start over each time
		if id != "" {
			if err := claimsUnchanged(claimsOf(*tx.State(), id), claims); err != nil {
				return err
			}
			if err := waitersUnchanged(tx.State(), waiters); err != nil {
				return err
			}
			out.cleared = conflictsOf(tx.State(), id)
			if err := conflictsUnchanged(out.cleared, conflicts); err != nil {
				return err
			}
			var still []ledger.Waiter // the checked entries still queued
			for _, w := range tx.State().Waiters {
				if slices.ContainsFunc(waiters, func(k ledger.Waiter) bool { return k.Key == w.Key }) {
					still = append(still, w)
				}
			}
			out.dequeued = dequeuedOf(tx.State(), still)
			out.claims = tx.Release(id, auditReason)
			for _, w := range still {
				tx.DropWaiter(w.Key, auditReason)
			}
			if len(out.claims) == 0 && len(out.cleared) == 0 && len(out.dequeued) == 0 {
				return fmt.Errorf("container %s: %w (released by someone else meanwhile?)", id, ledger.ErrNotFound)
			}
			return nil
		}
		if err := sameHolder(tx.State(), dev, holder); err != nil {
			return err
		}
		for _, c := range tx.State().Claims {
			if c.Device.UUID == dev {
				if err := claimsUnchanged([]ledger.Claim{c}, claims); err != nil {
					return err
				}
			}
		}
		c, err := tx.ReleaseDevice(dev, auditReason)
		if err != nil {
			return fmt.Errorf("release %s: %w", dev, err)
		}
		out.claims = []ledger.Claim{c}
		return nil
	})
	if err != nil {
		return err
	}
	return renderReleaseOf(a.env.Stdout, a.output, out, a.env.Now())
}

// errHolderRunning: release refused because the holder (or waiter) it would
// end still runs, or its liveness cannot be told.
var errHolderRunning = errors.New("release refused")

// releaseCheck is the release rule's finding about what a release would end:
// running lists, one line each, the claims (and queue entries) whose process
// still runs or cannot be told gone; draining, the claims of holders that
// exited whose processes may still be on the GPU (release_requires_idle),
// kept draining already; exited, the same found just now, their claims not
// yet marked draining; exitedConflicts, the conflict records of such
// containers; notes, those that never started.
type releaseCheck struct {
	running, draining, exited, exitedConflicts, notes []string
}

// refusal is the error that refuses the release without --force (nil when
// nothing stands in its way), with the advice that fits each holder: a
// running one is stopped first; a draining one has stopped already, and
// only its processes leaving the GPU (or idle_grace) end its claim.
func (chk releaseCheck) refusal() error {
	var parts []string
	if len(chk.running) > 0 {
		parts = append(parts, strings.Join(chk.running, "; ")+"; stop it first, or add --force to release anyway "+
			"(a process that runs on keeps using the GPU, and the next container will share it)")
	}
	if len(chk.draining) > 0 {
		parts = append(parts, strings.Join(chk.draining, "; ")+"; its processes may still use the GPU: wait for the claim "+
			"to end by itself (when the GPU observer sees them gone, at the latest after idle_grace), or add --force "+
			"if you know they are gone (`nvidia-smi` lists none on the device)")
	}
	if len(chk.exited) > 0 {
		// Not draining yet, so idle_grace does not bound it: gc (or the
		// daemon's next decision on the GPU) marks it.
		parts = append(parts, strings.Join(chk.exited, "; ")+"; its processes may still use the GPU: run `sudo "+programName+
			" gc` to mark its claim draining (it then ends by itself when the GPU observer sees them gone, at the latest "+
			"after idle_grace), or add --force if you know they are gone (`nvidia-smi` lists none on the device)")
	}
	if len(chk.exitedConflicts) > 0 {
		parts = append(parts, strings.Join(chk.exitedConflicts, "; ")+"; leave the record (once the device is free it "+
			"becomes the container's claim, which gc then marks draining), or add --force if you know they are gone "+
			"(`nvidia-smi` lists none on the device)")
	}
	if len(parts) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s", errHolderRunning, strings.Join(parts, "; and "))
}

// checkRelease applies the release rule (the one gc, status and the guard
// apply) to the holders of claims, to the containers of conflicts and to
// waiters (st is the state they were read from, to name who holds a
// conflict's device). A conflict record is a container found running on a
// device another holds: it becomes the device's claim when the holder
// stops. Cleared while the container runs, the ledger would show the
// device free once its holder stops, with the container still on it; so
// a conflict is judged as the claim it stands for. KeepRunning (processes
// found, or the evidence missing or ambiguous) is what a force-release must
// not end silently: the container would go on using the GPU and share it
// with the next one. A holder that never started has no process to check
// and is what release exists for besides exited holders (containerd sends
// no stop event for a container that never ran, and gc keeps it), so it is
// let through with a note. A holder found exited under
// release_requires_idle (MarkDraining) is refused like a draining one: its
// cgroup is empty, but only the GPU can say that its processes left it,
// which is what the rule keeps its claim for; that nobody has marked it
// draining yet changes nothing on the GPU. Every other verdict means the
// process is gone.
func checkRelease(rule guard.ReleaseRule, st *ledger.State, claims []ledger.Claim, conflicts []ledger.Conflict, waiters []ledger.Waiter) releaseCheck {
	var chk releaseCheck
	check := memoCheck(rule)
	for _, c := range conflicts {
		on := fmt.Sprintf("%s runs on %s, which %s holds (a conflict record: the device becomes its claim once free)",
			guard.HolderName(c.Owner), naming.Device(c.Device), conflictHolder(st, c))
		switch v := check(c.Owner); v.Action {
		case guard.KeepRunning:
			chk.running = append(chk.running, fmt.Sprintf("%s, and is %s", on, runningWhy(c.Owner, v)))
		case guard.KeepDraining, guard.MarkDraining:
			chk.exitedConflicts = append(chk.exitedConflicts, fmt.Sprintf("%s, and exited%s, but under release_requires_idle its processes "+
				"are not known to have left the GPU", on, inParens(v.Why)))
		case guard.KeepNotStarted:
			chk.notes = append(chk.notes, fmt.Sprintf("%s, and records no process (no pid, no cgroup): nothing to check; "+
				"if it runs there, the device shows free once its holder stops", on))
		}
	}
	for _, c := range claims {
		switch v := check(c.Owner); v.Action {
		case guard.KeepRunning:
			chk.running = append(chk.running, fmt.Sprintf("%s is held by %s, which is %s",
				naming.Device(c.Device), guard.HolderName(c.Owner), runningWhy(c.Owner, v)))
		case guard.KeepDraining:
			chk.draining = append(chk.draining, fmt.Sprintf("%s is held by %s, which exited, but its claim drains until its processes "+
				"leave the GPU (release_requires_idle)", naming.Device(c.Device), guard.HolderName(c.Owner)))
		case guard.MarkDraining:
			chk.exited = append(chk.exited, fmt.Sprintf("%s is held by %s, which exited%s, but its claim is kept until its "+
				"processes leave the GPU (release_requires_idle)", naming.Device(c.Device), guard.HolderName(c.Owner), inParens(v.Why)))
		case guard.KeepNotStarted:
			chk.notes = append(chk.notes, fmt.Sprintf("%s is held by %s, which never started (no pid, no cgroup recorded): "+
				"nothing to check; if it starts after the release, it runs without a claim",
				naming.Device(c.Device), guard.HolderName(c.Owner)))
		}
	}
	for _, w := range waiters {
		switch v := check(w.Owner); v.Action {
		case guard.KeepRunning:
			chk.running = append(chk.running, fmt.Sprintf("%s waits in the queue (requester %s) for %s and is %s; "+
				"removed, it would join the queue again at its tail on its next try",
				guard.HolderName(w.Owner), w.Key, naming.Devices(w.Devices), runningWhy(w.Owner, v)))
		case guard.KeepNotStarted:
			// A pod's container waits between the kubelet's retries with
			// no process of its own: nothing tells whether it will retry.
			chk.notes = append(chk.notes, fmt.Sprintf("%s waits in the queue (requester %s) for %s; no process is recorded "+
				"to check: if it is retried (the kubelet retries a refused pod), it joins the queue again at its tail",
				guard.HolderName(w.Owner), w.Key, naming.Devices(w.Devices)))
		}
	}
	return chk
}

// runningWhy words a KeepRunning verdict: "still running (pid 4242: …)",
// or, with no pid recorded, "may still be running (…)" (the cgroup could
// not tell).
func runningWhy(o ledger.Owner, v guard.Verdict) string {
	if o.Pid > 0 {
		if v.Why == "" {
			return fmt.Sprintf("still running (pid %d)", o.Pid)
		}
		return fmt.Sprintf("still running (pid %d: %s)", o.Pid, v.Why)
	}
	if v.Why == "" {
		return "may still be running"
	}
	return "may still be running (" + v.Why + ")"
}

// claimsUnchanged refuses a release when the claims it would end (now) are
// not those checkRelease judged (checked): a new incarnation of the
// container, or a claim on another device, was recorded in between.
func claimsUnchanged(now, checked []ledger.Claim) error {
	for _, c := range now {
		if !slices.ContainsFunc(checked, func(k ledger.Claim) bool {
			return k.Device.UUID == c.Device.UUID && incarnationOf(&k.Owner) == incarnationOf(&c.Owner)
		}) {
			return fmt.Errorf("%s held by %s changed since it was checked; check `%s status` and run release again",
				naming.Device(c.Device), guard.HolderName(c.Owner), programName)
		}
	}
	return nil
}

// conflictsUnchanged refuses a release when the conflict records it would
// clear (now) are not those checkRelease judged (checked): the container
// was recorded on another device, or another incarnation of it was, in
// between.
func conflictsUnchanged(now, checked []ledger.Conflict) error {
	for _, c := range now {
		if !slices.ContainsFunc(checked, func(k ledger.Conflict) bool {
			return k.Device.UUID == c.Device.UUID && incarnationOf(&k.Owner) == incarnationOf(&c.Owner)
		}) {
			return fmt.Errorf("the conflict record of %s on %s changed since it was checked; check `%s status` and run release again",
				guard.HolderName(c.Owner), naming.Device(c.Device), programName)
		}
	}
	return nil
}

// conflictHolder names the container holding the device of conflict c (a
// claim on it, or on a device conflicting with it), as st has it.
func conflictHolder(st *ledger.State, c ledger.Conflict) string {
	for _, h := range st.Claims {
		if h.Owner.ContainerID != c.Owner.ContainerID && devices.Conflicts(h.Device, c.Device) {
			return guard.HolderName(h.Owner)
		}
	}
	return "another container"
}

// waitersUnchanged refuses a release when a queue entry it would remove
// records another process now than when checkRelease judged it. A pod
// container's entry changes its container id with every retry and records
// no process: that is the same entry.
func waitersUnchanged(st *ledger.State, checked []ledger.Waiter) error {
	for _, k := range checked {
		for _, w := range st.Waiters {
			if w.Key == k.Key && !sameProcess(k.Owner, w.Owner) {
				return fmt.Errorf("the queue entry of %s changed since it was checked; check `%s queue` and run release again",
					guard.HolderName(w.Owner), programName)
			}
		}
	}
	return nil
}

// sameProcess reports whether a and b record the same process (or both
// none).
func sameProcess(a, b ledger.Owner) bool {
	return a.Pid == b.Pid && a.PidStart == b.PidStart && a.Cgroup == b.Cgroup
}

// update applies fn in one ledger transaction.
func (a *app) update(ctx context.Context, fn func(tx *ledger.Tx) error) error {
	l, err := a.openLedger(false)
	if err != nil {
		return err
	}
	if err := l.Update(ctx, fn); err != nil {
		return fmt.Errorf("update ledger %s: %w", l.StatePath(), err)
	}
	return nil
}

// operatorReason is the reason recorded in the audit log: the operator's text
// and who ran the command.
func (a *app) operatorReason(reason string) string {
	who := fmt.Sprintf("uid %d", a.env.Getuid())
	if u := a.env.Getenv("SUDO_USER"); u != "" {
		who += ", sudo user " + u
	}
	return fmt.Sprintf("%s (%s via %s)", reason, who, programName)
}

// matchContainer resolves a full container id or a unique prefix of one
// against the containers that hold claims, are recorded in conflicts or wait
// in the queue; a waiter's requester (as `queue` shows it) matches exactly.
func matchContainer(st ledger.State, want string) (string, error) {
	ids := map[string]bool{}
	for _, c := range st.Claims {
		ids[c.Owner.ContainerID] = true
	}
	for _, c := range st.Conflicts {
		ids[c.Owner.ContainerID] = true
	}
	for _, w := range st.Waiters {
		ids[w.Owner.ContainerID] = true
		if w.Key == want {
			return want, nil
		}
	}
	if ids[want] {
		return want, nil
	}
	var matches []string
	for id := range ids {
		if strings.HasPrefix(id, want) {
			matches = append(matches, id)
		}
	}
	sort.Strings(matches)
	switch len(matches) {
	case 1:
		return matches[0], nil
	case 0:
		return "", fmt.Errorf("no claim is held by container %q, and it waits in no queue: %w (see `%s claims` for the holders, `%s queue` for the waiters)",
			want, ledger.ErrNotFound, programName, programName)
	default:
		return "", fmt.Errorf("container id prefix %q is ambiguous: it matches %s; give more of the id", want, strings.Join(matches, ", "))
	}
}

// matchDevice finds the claim on a device named by UUID (case-insensitive, as
// the NVIDIA runtime compares them) or index. An index may name more than one
// claimed device: a claim on a MIG instance the inventory no longer has keeps
// its old index, which a new instance may have now (a MIG layout change), and
// a removed GPU's index may be another GPU's. A force-release must not guess
// between them (it could end a live container's claim): such an index is a
// usage error naming every device it matches, and the operator gives the
// UUID.
func matchDevice(st ledger.State, want string) (ledger.Claim, error) {
	var byIndex []ledger.Claim
	for _, c := range st.Claims {
		if strings.EqualFold(c.Device.UUID, want) {
			return c, nil // a UUID names one device, and a device has one claim
		}
		if c.Device.Index == want {
			byIndex = append(byIndex, c)
		}
	}
	switch len(byIndex) {
	case 0:
		return ledger.Claim{}, fmt.Errorf("no claim on device %q: %w (see `%s claims`)", want, ledger.ErrNotFound, programName)
	case 1:
		return byIndex[0], nil
	}
	held := make([]string, len(byIndex))
	for i, c := range byIndex {
		held[i] = fmt.Sprintf("%s held by %s", naming.Device(c.Device), guard.HolderName(c.Owner))
	}
	return ledger.Claim{}, usagef("device index %q names %d claimed devices: %s; give the UUID of the one to release (--device UUID)",
		want, len(byIndex), strings.Join(held, "; "))
}

// sameHolder refuses to release dev when it changed hands since the operator
// looked: a force-release must never end a claim nobody has seen.
func sameHolder(st *ledger.State, dev, holder string) error {
	for _, c := range st.Claims {
		if c.Device.UUID == dev && c.Owner.ContainerID != holder {
			return fmt.Errorf("%s changed hands: it is now held by %s, not %s; check `%s status` and run release again",
				naming.Device(c.Device), guard.HolderName(c.Owner), naming.ShortID(holder), programName)
		}
	}
	return nil
}

func claimsOf(st ledger.State, id string) []ledger.Claim {
	var out []ledger.Claim
	for _, c := range st.Claims {
		if c.Owner.ContainerID == id {
			out = append(out, c)
		}
	}
	return out
}

// waitersOf lists the queue entries of container id: its own (a hook's or
// a ticket's key is the id) or those whose latest attempt it was (a pod
// container's key is namespace/pod UID/name), or the entry whose requester
// is id.
func waitersOf(st ledger.State, id string) []ledger.Waiter {
	var out []ledger.Waiter
	for _, w := range st.Waiters {
		if id != "" && (w.Owner.ContainerID == id || w.Key == id) {
			out = append(out, w)
		}
	}
	return out
}

// dequeuedJSON is one queue entry a release removed.
type dequeuedJSON struct {
	Requester   string   `json:"requester"`
	ContainerID string   `json:"container_id"`
	Devices     []string `json:"devices"`
	// Reserved: the devices that were reserved for it, handed on.
	Reserved []string `json:"reserved"`
}

// dequeued is a queue entry a release removes, with its reservations.
type dequeued struct {
	waiter   ledger.Waiter
	reserved []devices.Device
}

func dequeuedOf(st *ledger.State, waiters []ledger.Waiter) []dequeued {
	var out []dequeued
	for _, w := range waiters {
		d := dequeued{waiter: w}
		for _, r := range st.Reservations {
			if r.For == w.Key {
				d.reserved = append(d.reserved, r.Device)
			}
		}
		out = append(out, d)
	}
	return out
}

// conflictsOf lists the conflict records of container id ("" = none): what
// a release of the container clears besides its claims.
func conflictsOf(st *ledger.State, id string) []ledger.Conflict {
	var out []ledger.Conflict
	for _, c := range st.Conflicts {
		if id != "" && c.Owner.ContainerID == id {
			out = append(out, c)
		}
	}
	return out
}

// releaseOutcome is what a release did (or, for a dry run, would do).
type releaseOutcome struct {
	dryRun   bool
	id       string // --container: the container id (or requester)
	claims   []ledger.Claim
	cleared  []ledger.Conflict
	dequeued []dequeued
}

// renderReleaseOf is the output of release: the claims released, the
// conflict records of the container cleared and its queue entries removed
// (or, for a dry run, that would be).
func renderReleaseOf(w io.Writer, output string, o releaseOutcome, now time.Time) error {
	if output == outputJSON {
		v := releasedView{DryRun: o.dryRun, Released: make([]releasedJSON, 0, len(o.claims))}
		for _, c := range o.claims {
			v.Released = append(v.Released, releasedJSON{claimJSON: claimView(c)})
		}
		for _, c := range o.cleared {
			v.ConflictsCleared = append(v.ConflictsCleared, clearedJSON{Device: c.Device.UUID, Index: c.Device.Index, ContainerID: c.Owner.ContainerID})
		}
		for _, d := range o.dequeued {
			j := dequeuedJSON{Requester: d.waiter.Key, ContainerID: d.waiter.Owner.ContainerID, Devices: []string{}, Reserved: []string{}}
			for _, dev := range d.waiter.Devices {
				j.Devices = append(j.Devices, dev.UUID)
			}
			for _, dev := range d.reserved {
				j.Reserved = append(j.Reserved, dev.UUID)
			}
			v.Dequeued = append(v.Dequeued, j)
		}
		return writeJSON(w, v)
	}
	if len(o.claims) > 0 || (len(o.cleared) == 0 && len(o.dequeued) == 0) {
		if err := renderReleased(w, output, o.dryRun, o.claims, now); err != nil {
			return err
		}
	}
	var lines []string
	if len(o.cleared) > 0 {
		verb := "cleared"
		if o.dryRun {
			verb = "would clear"
		}
		devs := make([]string, len(o.cleared))
		for i, c := range o.cleared {
			devs[i] = naming.Device(c.Device)
		}
		lines = append(lines, fmt.Sprintf("%s the conflict record(s) of container %s on %s (it was found using them while another container held them; "+
			"check that it no longer runs there)", verb, o.id, strings.Join(devs, ", ")))
	}
	for _, d := range o.dequeued {
		verb := "removed"
		if o.dryRun {
			verb = "would remove"
		}
		line := fmt.Sprintf("%s the queue entry of %s (requester %s, waiting for %s since %s)", verb, guard.HolderName(d.waiter.Owner),
			d.waiter.Key, naming.Devices(d.waiter.Devices), d.waiter.FirstSeen.UTC().Format(time.RFC3339))
		if len(d.reserved) > 0 {
			line += "; the reservation of " + naming.Devices(d.reserved) + " for it goes to the next in line"
		}
		lines = append(lines, line)
	}
	for _, line := range lines {
		if _, err := fmt.Fprintln(w, escapeLine(line)); err != nil {
			return fmt.Errorf("write output: %w", err)
		}
	}
	return nil
}

// releasedView is the output of release and gc; its JSON is a public interface.
type releasedView struct {
	DryRun   bool           `json:"dry_run"`
	Released []releasedJSON `json:"released"`
	// Draining (gc under release_requires_idle): claims of exited holders
	// kept draining instead of released.
	Draining []releasedJSON `json:"draining,omitempty"`
	// ConflictsCleared (release --container): the container's conflict
	// records cleared with its claims.
	ConflictsCleared []clearedJSON `json:"conflicts_cleared,omitempty"`
	// Dequeued (release --container): the container's queue entries
	// removed, with the devices that were reserved for them.
	Dequeued []dequeuedJSON `json:"dequeued,omitempty"`
}

// clearedJSON is one conflict record a release cleared.
type clearedJSON struct {
	Device      string `json:"device"`
	Index       string `json:"index"`
	ContainerID string `json:"container_id"`
}

type releasedJSON struct {
	claimJSON
	// Why is set by gc: the liveness finding that the holder exited.
	Why string `json:"why,omitempty"`
}

// renderReleased prints the claims released (or, for a dry run, that would
// be).
func renderReleased(w io.Writer, output string, dryRun bool, claims []ledger.Claim, now time.Time) error {
	return renderReleasedDraining(w, output, dryRun, claims, nil, nil, now)
}

// renderReleasedDraining is renderReleased, with the claims kept draining
// (or, for a dry run, that would be); why, when set, gives gc's finding for
// each claim.
func renderReleasedDraining(w io.Writer, output string, dryRun bool, claims, draining []ledger.Claim, why func(ledger.Claim) string, now time.Time) error {
	if why == nil {
		why = func(ledger.Claim) string { return "" }
	}
	if output == outputJSON {
		v := releasedView{DryRun: dryRun, Released: make([]releasedJSON, 0, len(claims))}
		for _, c := range claims {
			v.Released = append(v.Released, releasedJSON{claimJSON: claimView(c), Why: why(c)})
		}
		for _, c := range draining {
			v.Draining = append(v.Draining, releasedJSON{claimJSON: claimView(c), Why: why(c)})
		}
		return writeJSON(w, v)
	}
	for _, c := range draining {
		verb := "kept draining"
		if dryRun {
			verb = "would keep draining"
		}
		line := fmt.Sprintf("%s %s held by %s: %s; released once its processes leave the GPU (release_requires_idle)",
			verb, naming.Device(c.Device), guard.HolderName(c.Owner), why(c))
		if _, err := fmt.Fprintln(w, escapeLine(line)); err != nil {
			return fmt.Errorf("write output: %w", err)
		}
	}
	verb := "released"
	if dryRun {
		verb = "would release"
	}
	if len(claims) == 0 && len(draining) > 0 {
		return nil
	}
	if len(claims) == 0 {
		if _, err := fmt.Fprintf(w, "nothing to release\n"); err != nil {
			return fmt.Errorf("write output: %w", err)
		}
		return nil
	}
	for _, c := range claims {
		line := fmt.Sprintf("%s %s held by %s for %s", verb, naming.Device(c.Device), guard.HolderName(c.Owner), since(now, c.Since))
		if r := why(c); r != "" {
			line += ": " + r
		}
		if _, err := fmt.Fprintln(w, escapeLine(line)); err != nil {
			return fmt.Errorf("write output: %w", err)
		}
	}
	return nil
}

// inParens is " (s)", or "" for an empty s: a verdict's reason in a message.
func inParens(s string) string {
	if s == "" {
		return ""
	}
	return " (" + s + ")"
}
