// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// Device states shown by status (the "state" JSON field).
const (
	stateFree     = "free"
	stateHeld     = "held"
	stateReserved = "reserved"
	stateConflict = "conflict"
	// stateDraining: held by a claim kept after its holder stopped, until
	// its processes leave the GPU (release_requires_idle).
	stateDraining = "draining"
	// stateCordoned: a cordon covers the device (on it, its GPU or one of
	// its MIG instances); it takes no new claim, whoever holds it.
	stateCordoned = "cordoned"
)

// Problem kinds (the "kind" JSON field of status problems).
const (
	problemConflict      = "conflict"
	problemHolderExited  = "holder-exited"
	problemUnknownDevice = "unknown-device"
	// problemRemovalUnknown: an OCI hook holder that exited, kept under
	// release_on = "remove" until its container is removed, whose removal
	// cannot be told from the runtimes' state (a runtime root that cannot
	// be read, none configured or present): nothing will end its claim.
	problemRemovalUnknown = "holder-removal-unknown"
	// problemCordoned: a cordon the observer set (intruder, unhealthy); an
	// operator's cordon is intentional and not a problem.
	problemCordoned = "cordoned"
	// From the daemon's GPU observer (observe.json).
	problemIntruder      = "intruder"
	problemOutOfBounds   = "out-of-bounds"
	problemUnhealthy     = "unhealthy"
	problemObserverStale = "observer-stale"
	// problemObserverUnreadable: observe.json is there but cannot be read
	// (it does not parse, is too large, is a symlink): what the observer
	// saw is unknown, which is not the same as "no daemon".
	problemObserverUnreadable = "observer-unreadable"
	// problemUnobserved: NVML could not list a device's processes (the
	// observer's last pass, or ps's own), and it is not known to be lost
	// (that is unhealthy): nothing was looked at there, so an intruder on
	// it goes unseen. A pass that fails on every device still completes,
	// so the report stays fresh: without this problem, status and ps would
	// exit 0 while nothing was checked.
	problemUnobserved = "unobserved"
	// problemNotInInventory: the observer (the daemon's last pass, or
	// ps's own) found a device the inventory lacks: a MIG instance created
	// since discovery, whose processes were listed and judged but which
	// nothing can claim until the inventory is rebuilt, or the GPU of a
	// critical Xid NVML could not identify, which no one cordoned. Its
	// processes were not left unchecked: that is unobserved.
	problemNotInInventory = "not-in-inventory"
)

func (a *app) statusCommand() *cobra.Command {
	return newCommand("status",
		"Show every GPU and MIG device: free, held, draining, reserved, cordoned or in conflict",
		`Show one row per GPU and MIG instance of the inventory: its state (free, held,
draining, reserved for the head of its queue, cordoned, or conflict), the
holder (namespace/pod/container and short container id), how long it has been
held and how many requests wait for it, then a line counting the devices per
state and what is cordoned or draining.

A full GPU whose MIG instance is claimed (or a MIG instance whose GPU is
claimed) shows as held "via" the claimed device. A draining device is held by
a container that stopped under release_requires_idle: its claim is kept until
its processes leave the GPU (at most idle_grace). A cordoned device takes no
new claims (gpu-guard-ctl cordon, or the observer); a cordon on a GPU covers
its MIG instances and one on a MIG instance blocks its GPU, and the state
column says what else the device is ("cordoned,held"). A device the observer
reports unhealthy is marked so.

status exits 3 and lists what to do when a device is in conflict, a holder has
exited without releasing its claim (what gc acts on: it releases the claim,
or under release_requires_idle marks it draining; under release_on =
"remove", an OCI hook holder whose container no runtime knows any more, see
[hook] runtime_roots), an exited OCI hook holder kept under release_on =
"remove" cannot be told removed or not (a runtime root that cannot be read),
a claim names a device that is not in the inventory, or the observer
cordoned a device (an intruder, an unhealthy GPU). An operator's cordon and a draining claim are listed, not problems.
So is a claim kept until its exited holder's container is removed (release_on
= "remove"): its state shows "held,exited", and the list under the table
says when it exited and, for an OCI hook holder, the runtime root that still
has its container and how to end the claim if its engine no longer lists it.
So is, under [hook] poststop = false (no poststop releases a hook
container's claim), the claim of an exited OCI hook holder other than a
gpu-guard-ctl run ticket: it shows "held,exited" too, listed with how it is
known to have exited; it ends at the next request for its GPU or with gc.
The daemon's GPU observer adds what it saw on the devices themselves (its
last report, observe.json in the state dir): a process on a GPU its
container does not hold (intruder, out-of-bounds), an unhealthy device, and
a device whose processes it could not list (unobserved: nothing was checked
there), and a device the daemon's inventory lacks (not-in-inventory: a MIG
instance created since discovery, whose processes it did judge, or the GPU of
a critical Xid NVML could not identify; the line says what to do); a report
older than three observer intervals is not trusted but reported as stale, and
one that cannot be read (damaged, a symlink) is a problem too. It exits 1, showing no device, while the ledger needs recovery
(damaged, missing, moved or replaced: no container gets a GPU until
gpu-guard-ctl recover) or its state dir is unsafe.`,
		`  gpu-guard-ctl status
  gpu-guard-ctl status -o wide
  gpu-guard-ctl status -o json | jq '.devices[] | select(.state != "free")'
  gpu-guard-ctl status -o json | jq '.devices[] | select(.cordon != null) | .cordon'`,
		noArgs,
		func(cmd *cobra.Command, _ []string) error {
			defer pauseGC()()
			cfg, err := a.config()
			if err != nil {
				return err
			}
			rule := guard.NewReleaseRule(cfg, a.env.Liveness)
			// A bad --state-dir is the error, not a warning that the
			// inventory (whose cache is there) is missing before it.
			if _, err := a.stateDir(); err != nil {
				return err
			}
			// The inventory's warnings wait for the ledger read: when that
			// fails (not root, a ledger that needs recovery), its error is
			// what to fix, not a refused cache (unreadable for the same
			// reason) before it.
			inv, info, err := a.inventoryQuiet()
			if _, ok := errors.AsType[*NVMLHandoverError](err); ok {
				info.printWarnings(a.env.Stderr)
				return err
			}
			if err != nil {
				// The ledger alone still says who holds what; say why the
				// free devices are missing.
				info.warnings = append(info.warnings, fmt.Sprintf("%v; showing claimed devices only", err))
				inv = nil
			}
			var v *statusView
			err = a.view(cmd.Context(), func(tx *ledger.Tx) error {
				// Read once and rendered: no copy of the state
				// (buildStatus only reads it; TestReadersLeaveTheStateAsRead).
				v = buildStatus(tx.ReadState(), headOf(tx), inv, info, rule, cfg.Hook.Poststop)
				return nil
			})
			if err != nil {
				return err
			}
			if err := a.checkLedgerDir(); err != nil {
				return err
			}
			info.printWarnings(a.env.Stderr)
			v.setDrainDeadlines(cfg.Observe.IdleGrace.Duration)
			if dir, err := a.stateDir(); err == nil {
				v.addObserver(dir, a.env.Now())
			}
			if err := v.render(a.env.Stdout, a.output, a.env.Now()); err != nil {
				return err
			}
			if len(v.Problems) > 0 {
				return attention(len(v.Problems))
			}
			return nil
		})
}

// statusView is the status output; its JSON is a public interface
// (docs/ctl-json.md).
type statusView struct {
	Devices         []statusDevice `json:"devices"`
	Problems        []problem      `json:"problems"`
	InventorySource string         `json:"inventory_source"`
	Generation      uint64         `json:"generation"`
	UpdatedAt       *time.Time     `json:"updated_at,omitempty"`
	// Summary counts the devices by state.
	Summary statusSummary `json:"summary"`
	// Observer is the daemon's last GPU observer report; absent when there
	// is none (no daemon, no NVML, or a clean stop).
	Observer *observerJSON `json:"observer,omitempty"`

	// noInventory: no inventory could be loaded; the rows are the devices
	// the ledger names, and none is known to be missing from the inventory.
	noInventory bool
}

// observerJSON summarises observe.json.
type observerJSON struct {
	// Time is when the last accounting pass ran: omitted before the first
	// one, and always under interval = 0 (health only).
	Time            time.Time `json:"time,omitzero"`
	AgeSeconds      float64   `json:"age_seconds"`
	IntervalSeconds float64   `json:"interval_seconds"`
	Stale           bool      `json:"stale"`
	Findings        int       `json:"findings"`
	Unhealthy       int       `json:"unhealthy"`
	Errors          []string  `json:"errors"`
	Truncated       int       `json:"truncated,omitempty"`
}

type statusDevice struct {
	Index  string `json:"index"`
	UUID   string `json:"uuid"`
	Kind   string `json:"kind"`
	Parent string `json:"parent,omitempty"`
	Model  string `json:"model"`
	State  string `json:"state"`
	// Holder is the claim on this device, or on its parent GPU or one of its
	// MIG instances (then HeldVia names the claimed device).
	Holder  *holderJSON `json:"holder"`
	HeldVia string      `json:"held_via,omitempty"`
	// Reservation is what keeps the device for a waiter, or null: a
	// reservation on it, or on its GPU or one of its MIG instances (then
	// ReservedVia names the reserved device), or the head of the queue's
	// need of a conflicting device (KeptFor).
	Reservation *reservationJSON `json:"reservation"`
	ReservedVia string           `json:"reserved_via,omitempty"`
	Conflicts   []holderJSON     `json:"conflicts,omitempty"`
	Waiters     int              `json:"waiters"`
	InInventory bool             `json:"in_inventory"`
	// Stale is why the holder's claim is stale (its processes are gone).
	Stale string `json:"stale,omitempty"`
	// staleDrains: the stale claim is kept draining, not released, when gc
	// (or the daemon) acts on it (release_requires_idle).
	staleDrains bool
	// staleRemoved: the stale holder is an OCI hook's whose container no
	// runtime knows any more (release_on = "remove").
	staleRemoved bool
	// removalUnknown says why the removal of an exited OCI hook holder,
	// kept under release_on = "remove", cannot be told.
	removalUnknown string
	// Kept is set on the row of a claim whose holder has exited and keeps
	// it until its container is removed (release_on = "remove"), and whose
	// removal can be told (else removalUnknown). Not a problem: the policy
	// keeps it on purpose while the runtime's state has the container. But
	// the table says so, with the runtime root that has it and how to end
	// the claim, since an engine that lost the container (podman after its
	// conmon was killed) never deletes it there, and nothing else would.
	Kept *keptJSON `json:"kept,omitempty"`
	// Exited is set, instead of Stale, on the row of a claim whose holder,
	// an OCI hook container, has exited when no poststop runs ([hook]
	// poststop = false): the release rule ending it at the next request
	// for its device (or gc) is then how every such claim ends, so it is
	// listed, not a problem.
	Exited *exitedJSON `json:"exited,omitempty"`
	// Cordon is the cordon covering this device, on it or, then named by
	// CordonedVia, on its GPU or one of its MIG instances; nil if none.
	Cordon      *cordonJSON `json:"cordon"`
	CordonedVia string      `json:"cordoned_via,omitempty"`
	// UnhealthySince: the GPU observer reported this device, or its GPU,
	// unhealthy (observe.json; not set from a stale report).
	UnhealthySince *time.Time `json:"unhealthy_since,omitempty"`

	heldViaIndex     string
	reservedViaIndex string
	reservedFor      string // display name of the waiter a reservation is for
	underlying       string // the state a cordon hides (held, draining, free), for the table
}

type holderJSON struct {
	ContainerID string    `json:"container_id"`
	Namespace   string    `json:"namespace"`
	Pod         string    `json:"pod"`
	PodUID      string    `json:"pod_uid"`
	Container   string    `json:"container"`
	FrontEnd    string    `json:"front_end"`
	Pid         int       `json:"pid,omitempty"`
	Since       time.Time `json:"since"`
	// StoppedAt is set when the holder exited and, under release_on =
	// "remove", keeps its claim until it is removed.
	StoppedAt *time.Time `json:"stopped_at,omitempty"`
	// DrainingSince is set while the claim is draining: the holder stopped
	// under release_requires_idle and the claim is kept until its
	// processes leave the GPU, or until DrainingUntil (idle_grace).
	DrainingSince *time.Time `json:"draining_since,omitempty"`
	DrainingUntil *time.Time `json:"draining_until,omitempty"`
}

// keptJSON is why an exited holder's claim is kept until its removal.
type keptJSON struct {
	// Why is how it is known to have exited: "it exited at …" once its
	// stop was recorded, else the release rule's finding now ("pid 4242 is
	// gone"): no stop is recorded yet (the refusal of an OCI hook that
	// does not wait records nothing).
	Why string `json:"why"`
	// RuntimeRoot is the OCI runtime state root ([hook] runtime_roots)
	// that still has the container of an OCI hook holder: what keeps its
	// claim. Omitted for other front ends' holders.
	RuntimeRoot string `json:"runtime_root,omitempty"`
}

// endsNextRequest is exitedJSON.Ends: the guard ends the claim in the
// transaction that admits the next request for its device (or one
// conflicting with it), or gc does.
const endsNextRequest = "next-request"

// endsGC is exitedJSON.Ends on a cordoned device: no request is admitted
// to it, so only gc ends the claim.
const endsGC = "gc"

// exitedJSON is why the claim of an exited OCI hook holder stays until the
// next request for its device: no poststop ran to release it.
type exitedJSON struct {
	// Why is the release rule's finding that its processes are gone.
	Why string `json:"why"`
	// Ends is when its claim ends: "next-request", or "gc" on a cordoned
	// device (no request is admitted to it).
	Ends string `json:"ends"`
	// Drains: under release_requires_idle the claim is then marked
	// draining, not released, and ends once its processes leave the GPU.
	Drains bool `json:"drains,omitempty"`
}

type reservationJSON struct {
	For         string `json:"for"`
	ContainerID string `json:"container_id,omitempty"`
	// KeptFor is set, and Since and Until are not, for a free device kept
	// for the head of the queue without a stored reservation: the UUID of
	// the device the head asks for (a whole GPU another MIG instance of
	// which is in use). It lasts until the head starts or leaves the queue.
	KeptFor string    `json:"kept_for,omitempty"`
	Since   time.Time `json:"since,omitzero"`
	Until   time.Time `json:"until,omitzero"`
}

type problem struct {
	Kind        string `json:"kind"`
	Device      string `json:"device"`
	Index       string `json:"index"`
	ContainerID string `json:"container_id,omitempty"`
	// Pid and SeenAt are set for what the GPU observer saw.
	Pid     int        `json:"pid,omitempty"`
	SeenAt  *time.Time `json:"seen_at,omitempty"`
	Message string     `json:"message"`
}

// addObserver adds the daemon's last observer report: its findings as
// problems, or one observer-stale problem instead when it is too old to
// trust. No report is no problem: the daemon may run without NVML. A
// report that is there but cannot be read is one (observer-unreadable):
// the daemon writes it whole (a rename), so it was damaged or replaced,
// and the intruders or unhealthy GPUs it may list go unseen.
func (v *statusView) addObserver(dir string, now time.Time) {
	f, err := observe.ReadFile(dir)
	if errors.Is(err, observe.ErrNoFile) {
		return
	}
	if err != nil {
		v.Problems = append(v.Problems, problem{
			Kind: problemObserverUnreadable,
			Message: fmt.Sprintf("the GPU observer's report cannot be read (%v): its findings are not shown; the daemon "+
				"rewrites it at its next pass: if this persists, check nri-gpu-guard's log (`sudo %s ps` asks NVML directly)", err, programName),
		})
		return
	}
	at := f.Time
	if at.IsZero() {
		at = f.WrittenAt
	}
	o := &observerJSON{Time: f.Time.UTC(), AgeSeconds: now.Sub(at).Seconds(), IntervalSeconds: f.IntervalSeconds,
		Stale: f.Stale(now), Findings: len(f.Findings), Unhealthy: len(f.Unhealthy), Errors: f.Errors, Truncated: f.Truncated}
	if o.Errors == nil {
		o.Errors = []string{}
	}
	v.Observer = o
	if o.Stale {
		v.Problems = append(v.Problems, problem{
			Kind: problemObserverStale,
			Message: fmt.Sprintf("the GPU observer's last report is %s old (interval %s): its findings are not shown; is nri-gpu-guard running? (systemctl status nri-gpu-guard, and its log for NVML errors)",
				age(now.Sub(at)), age(time.Duration(f.IntervalSeconds*float64(time.Second)))),
		})
		return
	}
	v.markUnhealthy(f.Unhealthy)
	for _, u := range f.Unhealthy {
		seen := u.Time
		v.Problems = append(v.Problems, problem{
			Kind: problemUnhealthy, Device: u.Device.UUID, Index: u.Device.Index, SeenAt: timeOrNil(seen),
			Message: fmt.Sprintf("%s (seen %s ago)", u.Message, age(now.Sub(seen))),
		})
	}
	v.addUnobserved(f, now)
	v.addNotInInventory(f, now)
	for _, ff := range f.Findings {
		kind := problemIntruder
		if ff.Kind == observe.KindOutOfBounds {
			kind = problemOutOfBounds
		}
		msg := ff.Message
		if ff.Namespace != "" || ff.Pod != "" || ff.Container != "" {
			msg = fmt.Sprintf("%s [%s/%s/%s]", msg, ff.Namespace, ff.Pod, ff.Container)
		}
		v.Problems = append(v.Problems, problem{
			Kind: kind, Device: ff.Device.UUID, Index: ff.Device.Index, ContainerID: ff.ContainerID, Pid: ff.PID,
			SeenAt: timeOrNil(f.Time), Message: fmt.Sprintf("%s (seen %s ago)", msg, age(now.Sub(f.Time))),
		})
	}
}

// addUnobserved adds an unobserved problem for every device the observer's last
// pass could not list (observe.File.Unlisted), except one the report calls
// unhealthy (a lost GPU, or a MIG instance of one): that problem already
// says why. Each is matched to its row by UUID; one that matches no row (a
// device the inventory does not list) is still a problem, without a device.
// The file of an older daemon has the errors only, as text ("GPU 1
// (GPU-…): list compute processes: ERROR_UNKNOWN"): those are matched to
// the rows by the label the observer gives a device
// (observe.Device.String).
func (v *statusView) addUnobserved(f *observe.File, now time.Time) {
	if len(f.Unlisted) == 0 && len(f.Errors) == 0 {
		return
	}
	sick := make(map[string]bool, len(f.Unhealthy))
	for _, u := range f.Unhealthy {
		sick[u.Device.UUID] = true
	}
	add := func(d *statusDevice, why string) {
		uuid, index, label, holder := "", "", "a device", ""
		if d != nil {
			uuid, index, label = d.UUID, d.Index, d.label()
			if d.Holder != nil {
				holder = d.Holder.who()
			}
		}
		p := unobservedProblem(uuid, index, label, holder,
			fmt.Sprintf("the GPU observer could not list its processes in its last pass, %s ago (%s)", age(now.Sub(f.Time)), why),
			fmt.Sprintf("nri-gpu-guard's log (`sudo %s ps` asks NVML now)", programName))
		p.SeenAt = timeOrNil(f.Time)
		v.Problems = append(v.Problems, p)
	}
	rows := make(map[string]*statusDevice, len(v.Devices))
	if len(f.Unlisted) > 0 {
		for i := range v.Devices {
			rows[v.Devices[i].UUID] = &v.Devices[i]
		}
		for _, u := range f.Unlisted {
			if reportedUnhealthy(sick, u.Device.UUID, u.Device.ParentUUID) {
				continue
			}
			if d := rows[u.Device.UUID]; d != nil {
				add(d, u.Error)
			} else {
				add(nil, u.String())
			}
		}
		return
	}
	for i := range v.Devices {
		d := &v.Devices[i]
		rows[observe.Device{Index: d.Index, UUID: d.UUID, ParentUUID: d.Parent}.String()] = d
	}
	for _, e := range f.Errors {
		if i := strings.Index(e, "): "); i >= 0 {
			if d := rows[e[:i+1]]; d != nil {
				if !reportedUnhealthy(sick, d.UUID, d.Parent) {
					add(d, e[i+3:])
				}
				continue
			}
		}
		add(nil, e)
	}
}

// addNotInInventory adds a not-in-inventory problem for every device of
// the observer's last pass that the daemon's inventory lacks
// (observe.File.NotInInventory), with its notice: what it is and what to
// do. Its processes were listed and judged (an intruder on it is among the
// findings), so it is no unobserved device, unless NVML could not list it
// (then it is in Unlisted too, and both are said). None is left out for
// an unhealthy GPU: the notice is no listing error that the unhealthy
// problem explains. A file of an older daemon has them in Unlisted only.
func (v *statusView) addNotInInventory(f *observe.File, now time.Time) {
	for _, n := range f.NotInInventory {
		v.Problems = append(v.Problems, notInInventoryProblem(n.Device, n.Notice,
			fmt.Sprintf(" (seen %s ago)", age(now.Sub(f.Time))), timeOrNil(f.Time)))
	}
}

// notInInventoryProblem is the problem of a device the inventory lacks
// (status: the daemon's last pass; ps: its own): "MIG 1:5 (MIG-…): not in
// the inventory: <notice>", then tail. The device is named by what the
// report records of it (index, UUID, its GPU's UUID; "an unidentified GPU"
// for none).
func notInInventoryProblem(d observe.Device, notice, tail string, seen *time.Time) problem {
	label := observe.Device{Index: d.Index, UUID: d.UUID, ParentUUID: d.ParentUUID}.String()
	index := d.Index
	if d.UUID == "" {
		index = "" // the unidentified GPU: its "?" names nothing
	}
	return problem{Kind: problemNotInInventory, Device: d.UUID, Index: index, SeenAt: seen,
		Message: fmt.Sprintf("%s: not in the inventory: %s%s", label, notice, tail)}
}

// reportedUnhealthy reports whether a device, or the GPU of a MIG instance
// (parent), is among those found unhealthy (sick, by UUID): the problem of
// a device NVML could not list is left to the unhealthy one, which says
// why.
func reportedUnhealthy(sick map[string]bool, uuid, parent string) bool {
	return sick[uuid] || (parent != "" && sick[parent])
}

// unobservedProblem is the problem of a device whose processes NVML could
// not list (status: the observer's last pass; ps: its own): nothing was
// looked at on it, which is not "no intruder". label names the device
// ("a device" for one no row shows), holder its holder (holderJSON.who;
// "" for none); how says which listing failed and why; also is what to
// check besides the driver.
func unobservedProblem(uuid, index, label, holder, how, also string) problem {
	if holder != "" {
		label += ", held by " + holder + ","
	}
	return problem{Kind: problemUnobserved, Device: uuid, Index: index,
		Message: fmt.Sprintf("%s was not checked: %s, so a process the guard did not admit would go unseen there; "+
			"check the driver (`nvidia-smi`, the kernel log) and %s", label, how, also)}
}

func holderOf(o ledger.Owner, since time.Time) *holderJSON {
	return &holderJSON{
		ContainerID: o.ContainerID,
		Namespace:   o.Namespace,
		Pod:         o.Pod,
		PodUID:      o.PodUID,
		Container:   o.Container,
		FrontEnd:    string(o.FrontEnd),
		Pid:         o.Pid,
		Since:       since,
		StoppedAt:   timeOrNil(o.StoppedAt),
		// DrainingUntil needs the configured grace: setDrainDeadlines.
		DrainingSince: timeOrNil(o.DrainingSince),
	}
}

// who names the holder in a sentence: "ns/pod/container (0123456789ab)",
// or, for pod names the container's creator wrote itself (the OCI hook's),
// "container 0123456789ab (ns/pod/container by its own annotations,
// unverified)".
func (h *holderJSON) who() string {
	if ledger.FrontEnd(h.FrontEnd) == ledger.FrontEndHook && (h.Namespace != "" || h.Pod != "") {
		return naming.Holder(h.Namespace, h.Pod, h.Container, h.ContainerID, false)
	}
	return h.name() + " (" + naming.ShortID(h.ContainerID) + ")"
}

func (h *holderJSON) name() string {
	return holderName(ledger.Owner{ContainerID: h.ContainerID, Namespace: h.Namespace, Pod: h.Pod, Container: h.Container,
		FrontEnd: ledger.FrontEnd(h.FrontEnd)})
}

// statusIndex holds the ledger state keyed the way status looks it up, so
// that building the view is linear in the size of the state.
type statusIndex struct {
	claims       map[string]*ledger.Claim       // by device UUID
	migClaims    map[string][]*ledger.Claim     // claims on MIG instances, by parent UUID
	reservations map[string]*ledger.Reservation // by device UUID
	// migReservations are the reservations of MIG instances, by parent UUID.
	migReservations map[string][]*ledger.Reservation
	conflicts       map[string][]ledger.Conflict // by device UUID
	waiters         map[string]int               // waiters wanting each device UUID
	waiterByKey     map[string]*ledger.Waiter    // the waiters a reservation is for
	cordons         cordonIndex
	head            headWait
}

// headWait is the head of the queue and what it waits for (see
// ledger.Tx.HeadWaitsFor); a free device conflicting with one of those is
// kept for it.
type headWait struct {
	waiter ledger.Waiter
	wants  []devices.Device
}

// keptThrough reports whether d, free, is kept for the head of the queue,
// and the device the head asks for that it conflicts with.
func (x statusIndex) keptThrough(d devices.Device) (devices.Device, bool) {
	for _, w := range x.head.wants {
		if devices.Conflicts(w, d) {
			return w, true
		}
	}
	return devices.Device{}, false
}

func indexState(st *ledger.State) statusIndex {
	x := statusIndex{
		claims:          make(map[string]*ledger.Claim, len(st.Claims)),
		migClaims:       map[string][]*ledger.Claim{},
		migReservations: map[string][]*ledger.Reservation{},
		reservations:    make(map[string]*ledger.Reservation, len(st.Reservations)),
		conflicts:       map[string][]ledger.Conflict{},
		waiters:         map[string]int{},
		waiterByKey:     make(map[string]*ledger.Waiter, len(st.Reservations)),
		cordons:         newCordonIndex(st.Cordons),
	}
	for i := range st.Claims {
		c := &st.Claims[i]
		x.claims[c.Device.UUID] = c
		if c.Device.Parent != "" {
			x.migClaims[c.Device.Parent] = append(x.migClaims[c.Device.Parent], c)
		}
	}
	for i := range st.Reservations {
		r := &st.Reservations[i]
		x.reservations[r.Device.UUID] = r
		if r.Device.Parent != "" {
			x.migReservations[r.Device.Parent] = append(x.migReservations[r.Device.Parent], r)
		}
		x.waiterByKey[r.For] = nil // looked up below: only these of thousands of waiters
	}
	for _, c := range st.Conflicts {
		x.conflicts[c.Device.UUID] = append(x.conflicts[c.Device.UUID], c)
	}
	for i := range st.Waiters {
		w := &st.Waiters[i]
		if _, ok := x.waiterByKey[w.Key]; ok {
			x.waiterByKey[w.Key] = w
		}
		for _, d := range w.Devices {
			x.waiters[d.UUID]++
		}
	}
	return x
}

// buildStatus joins the ledger state with the inventory (nil when it could not
// be loaded) and the holders' liveness.
// poststop is [hook] poststop: whether the OCI hook's poststop releases its
// containers' claims.
func buildStatus(st *ledger.State, head headWait, inv *devices.Inventory, info inventoryInfo, rule guard.ReleaseRule,
	poststop bool) *statusView {
	x := indexState(st)
	x.head = head
	v := &statusView{Devices: []statusDevice{}, Problems: []problem{}, Generation: st.Generation, UpdatedAt: timeOrNil(st.UpdatedAt)}
	if inv != nil {
		v.InventorySource = inv.Source
		if info.Origin == "cache" {
			v.InventorySource += " (cache)"
		}
	}

	shown := map[string]bool{}
	add := func(d devices.Device, model string, inInventory bool) {
		shown[d.UUID] = true
		v.Devices = append(v.Devices, x.device(d, model, inInventory))
	}
	if inv != nil {
		models := modelsOf(inv)
		for _, d := range inv.Devices() {
			add(d, models[d.UUID], true)
		}
	}
	// Devices the ledger knows but the inventory does not: claims that
	// outlived a GPU (or an inventory that could not be loaded).
	extra := func(d devices.Device) {
		if !shown[d.UUID] {
			add(d, "", false)
		}
	}
	for _, c := range st.Claims {
		extra(c.Device)
	}
	for _, c := range st.Conflicts {
		extra(c.Device)
	}
	for _, r := range st.Reservations {
		extra(r.Device)
	}
	// A cordoned device gone from the inventory (a MIG instance whose
	// layout changed across a reboot) stays listed until it is uncordoned.
	for _, k := range st.Cordons {
		extra(k.Device)
	}
	if inv == nil {
		// The rows come from the ledger alone, in its order: put them in
		// the inventory's (a GPU, then its MIG instances, numerically).
		v.noInventory = true
		slices.SortStableFunc(v.Devices, func(a, b statusDevice) int {
			if c := compareIndex(a.Index, b.Index); c != 0 {
				return c
			}
			return strings.Compare(a.UUID, b.UUID)
		})
	}

	// A claim is stale when the release rule (the one gc and the guard
	// apply) would end it now: release it, or, under [observe]
	// release_requires_idle, mark it draining (gc does either). A holder
	// kept by policy (release_on = "remove") is not stale. A container id
	// names one container only within one runtime root or namespace, so, as
	// gc does, every incarnation (recorded process) of an id is checked on
	// its own and its verdict applies to its own claims only: keyed by id,
	// a live incarnation would hide an exited one or lend it its finding.
	// A claim the rule keeps because it cannot tell whether its holder
	// was removed (Verdict.Unsure) is a problem too: nothing ends it.
	// A claim kept until its holder's removal is listed (Kept), not a
	// problem, and so is one that only the next request can end
	// (Exited: see endsAtNextRequest).
	check := memoCheck(rule)            // one liveness check per incarnation
	stale := map[string]guard.Verdict{} // by claimed device UUID
	kept := map[string]*keptJSON{}      // by claimed device UUID
	exited := map[string]*exitedJSON{}  // by claimed device UUID
	for _, c := range st.Claims {
		verdict := check(c.Owner)
		switch {
		case endsAtNextRequest(c.Owner, verdict, poststop):
			exited[c.Device.UUID] = &exitedJSON{Why: verdict.Why, Ends: endsNextRequest, Drains: verdict.Action == guard.MarkDraining}
		case verdict.Release() || verdict.Action == guard.MarkDraining || verdict.Unsure != "":
			stale[c.Device.UUID] = verdict
		case verdict.Action == guard.MarkStopped || verdict.Action == guard.KeepStopped:
			kept[c.Device.UUID] = keptOf(c.Owner, verdict)
		}
	}
	for i := range v.Devices {
		d := &v.Devices[i]
		if d.Holder != nil && d.HeldVia == "" {
			// The row of the claimed device itself: its holder is that
			// claim's owner (a row held via another device reports nothing,
			// the claimed device's row does).
			d.Kept = kept[d.UUID]
			d.Exited = exited[d.UUID]
			if d.Exited != nil && d.Cordon != nil && (d.CordonedVia == "" || d.CordonedVia == d.Parent) {
				// A cordon on the device or on its GPU refuses every
				// request that could meet this claim before any holder is
				// settled: only gc ends it. (One on a MIG instance of a
				// claimed GPU leaves its sibling instances to requests.)
				e := *d.Exited
				e.Ends = endsGC
				d.Exited = &e
			}
			switch verdict, ok := stale[d.UUID]; {
			case !ok:
			case verdict.Unsure != "":
				d.removalUnknown = verdict.Unsure
			default:
				d.Stale = verdict.Why
				d.staleDrains = verdict.Action == guard.MarkDraining
				d.staleRemoved = verdict.Deleted
			}
		}
		v.Problems = append(v.Problems, d.problems(inv)...)
		v.Summary.count(d)
	}
	return v
}

// endsAtNextRequest reports whether the claim of o, with the release
// rule's verdict v, is one status lists as Exited rather than a problem:
// an OCI hook holder found exited (released now, or marked draining under
// release_requires_idle) on a host whose hook runs no poststop ([hook]
// poststop = false). There nothing but the next request for its device or
// gc ever ends it, by design, so calling it a problem would flag every
// container that ran. An NRI holder is still one (containerd's stop event
// should have ended it), and so is a ticket of `gpu-guard-ctl run` (its
// ctl releases it on exit, so one found exited was killed) and a holder
// whose removal cannot be told (Unsure: nothing will end it).
func endsAtNextRequest(o ledger.Owner, v guard.Verdict, poststop bool) bool {
	return !poststop && o.FrontEnd == ledger.FrontEndHook && !guard.IsTicket(o) && v.Unsure == "" &&
		(v.Release() || v.Action == guard.MarkDraining)
}

// keptOf is the Kept of a claim of o, which the release rule keeps until
// its container is removed (verdict v: MarkStopped or KeepStopped).
func keptOf(o ledger.Owner, v guard.Verdict) *keptJSON {
	why := v.Why
	if !o.StoppedAt.IsZero() {
		// The rule checks no process of a holder recorded as stopped:
		// what is known is when.
		why = "it exited at " + o.StoppedAt.UTC().Format(time.RFC3339)
	}
	return &keptJSON{Why: why, RuntimeRoot: v.Listed}
}

// device builds one row.
func (x statusIndex) device(d devices.Device, model string, inInventory bool) statusDevice {
	sd := statusDevice{
		Index:       d.Index,
		UUID:        d.UUID,
		Kind:        string(d.Kind),
		Parent:      d.Parent,
		Model:       model,
		State:       stateFree,
		Waiters:     x.waiters[d.UUID],
		InInventory: inInventory,
	}
	if c := x.claims[d.UUID]; c != nil {
		sd.State = heldState(c)
		sd.Holder = holderOf(c.Owner, c.Since)
	} else if via := x.relatedClaim(d); via != nil {
		sd.State = heldState(via)
		sd.Holder = holderOf(via.Owner, via.Since)
		sd.HeldVia = via.Device.UUID
		sd.heldViaIndex = via.Device.Index
	} else if r := x.reservation(d); r != nil {
		sd.State = stateReserved
		sd.Reservation = &reservationJSON{For: r.For, Since: r.Since, Until: r.Until}
		sd.reservedFor = r.For
		if w := x.waiterByKey[r.For]; w != nil {
			sd.Reservation.ContainerID = w.Owner.ContainerID
			sd.reservedFor = holderName(w.Owner)
		}
		if r.Device.UUID != d.UUID {
			// The GPU of a reserved MIG instance, or a MIG instance of a
			// reserved GPU: nobody else can have it either.
			sd.ReservedVia, sd.reservedViaIndex = r.Device.UUID, r.Device.Index
			sd.reservedFor += " (via " + r.Device.Index + ")"
		}
	} else if through, ok := x.keptThrough(d); ok {
		sd.State = stateReserved
		h := x.head.waiter
		sd.Reservation = &reservationJSON{For: h.Key, ContainerID: h.Owner.ContainerID, KeptFor: through.UUID}
		sd.reservedFor = holderName(h.Owner) + " (first in line for " + through.Index + ")"
	}
	if k := x.cordons.lookup(d); k != nil {
		// Above held, draining and reserved (which a cordon excludes
		// anyway): what matters first is that the device takes no new
		// claim; the holder is still shown.
		sd.underlying = sd.State
		sd.State = stateCordoned
		sd.Cordon = cordonJSONOf(*k)
		if k.Device.UUID != d.UUID {
			sd.CordonedVia = k.Device.UUID
		}
	}
	for _, c := range x.conflicts[d.UUID] {
		sd.State = stateConflict
		sd.Conflicts = append(sd.Conflicts, *holderOf(c.Owner, c.Since))
	}
	return sd
}

// heldState is the state a claim gives the devices it covers.
func heldState(c *ledger.Claim) string {
	if !c.Owner.DrainingSince.IsZero() {
		return stateDraining
	}
	return stateHeld
}

// reservation is the reservation on d, or else on a device conflicting
// with it (its GPU, or one of its MIG instances), or nil.
func (x statusIndex) reservation(d devices.Device) *ledger.Reservation {
	if r := x.reservations[d.UUID]; r != nil {
		return r
	}
	if d.Parent != "" {
		return x.reservations[d.Parent]
	}
	if rs := x.migReservations[d.UUID]; len(rs) > 0 {
		return rs[0]
	}
	return nil
}

// relatedClaim is a claim that makes d unavailable without naming it: on d's
// parent GPU, or on one of d's MIG instances. Of a GPU's MIG claims, one
// that is not draining comes first: the GPU is held while any of its
// instances is held by a running container, and draining (which ends by
// itself) only once every claim on it is.
func (x statusIndex) relatedClaim(d devices.Device) *ledger.Claim {
	if d.Parent != "" {
		return x.claims[d.Parent]
	}
	cs := x.migClaims[d.UUID]
	for _, c := range cs {
		if heldState(c) == stateHeld {
			return c
		}
	}
	if len(cs) > 0 {
		return cs[0]
	}
	return nil
}

// problems lists what an operator must act on for this row.
func (d *statusDevice) problems(inv *devices.Inventory) []problem {
	var out []problem
	label := naming.Device(devices.Device{UUID: d.UUID, Index: d.Index, Kind: devices.Kind(d.Kind)})
	if d.Stale != "" {
		what := fmt.Sprintf("release it with `sudo %s gc`", programName)
		if d.staleDrains {
			// gc does not release it: it marks the claim draining, and the
			// daemon's observer releases it once the GPU shows the processes
			// gone (or at idle_grace).
			what = fmt.Sprintf("run `sudo %s gc` to mark its claim draining (release_requires_idle: it is released once its processes leave the GPU, at the latest after idle_grace)", programName)
		}
		gone := "whose processes are gone"
		if d.staleRemoved {
			gone = "whose processes are gone and whose container was removed"
		}
		out = append(out, problem{
			Kind: problemHolderExited, Device: d.UUID, Index: d.Index, ContainerID: d.Holder.ContainerID,
			Message: fmt.Sprintf("%s is held by %s %s (%s); %s",
				label, d.Holder.who(), gone, d.Stale, what),
		})
	}
	if d.removalUnknown != "" {
		out = append(out, problem{
			Kind: problemRemovalUnknown, Device: d.UUID, Index: d.Index, ContainerID: d.Holder.ContainerID,
			Message: fmt.Sprintf("%s is held by %s, which exited and keeps its claim until its container is removed "+
				"(release_on = \"remove\"), but whether it was removed cannot be told: %s; check that [hook] runtime_roots "+
				"names this host's runtime state roots and that they can be read, or, if its engine no longer lists it, end its claim with `sudo %s release --container %s --reason \"container removed\"`",
				label, d.Holder.who(), d.removalUnknown, programName, d.Holder.ContainerID),
		})
	}
	for _, c := range d.Conflicts {
		holder := "no recorded holder"
		if d.Holder != nil {
			holder = d.Holder.who()
		}
		out = append(out, problem{
			Kind: problemConflict, Device: d.UUID, Index: d.Index, ContainerID: c.ContainerID,
			Message: fmt.Sprintf("%s is held by %s but %s uses it too (seen at reconcile); nothing is killed automatically: stop one of them",
				label, holder, c.who()),
		})
	}
	if p, ok := d.cordonProblem(label); ok {
		out = append(out, p)
	}
	if !d.InInventory && inv != nil && d.Holder != nil && d.HeldVia == "" {
		out = append(out, problem{
			Kind: problemUnknownDevice, Device: d.UUID, Index: d.Index, ContainerID: d.Holder.ContainerID,
			Message: fmt.Sprintf("%s is claimed by %s but is not in the inventory (source %s); if the GPU is gone, release the claim with `sudo %s release --device %s --reason \"GPU removed\"`, if it was added, run `sudo %s devices --refresh`",
				label, d.Holder.who(), inv.Source, programName, d.UUID, programName),
		})
	}
	return out
}

// modelsOf maps every device UUID of inv to its model for the MODEL column.
func modelsOf(inv *devices.Inventory) map[string]string {
	models := map[string]string{}
	for _, g := range inv.GPUs {
		models[g.UUID] = g.Model
		for _, m := range g.MIG {
			models[m.UUID] = migModel(g, m)
		}
	}
	return models
}

// migModel describes a MIG instance for the MODEL column.
func migModel(g devices.GPU, m devices.MIG) string {
	if m.Model != "" {
		return m.Model
	}
	if g.Model == "" {
		return ""
	}
	return g.Model + " (MIG gi " + strconv.Itoa(m.GI) + " ci " + strconv.Itoa(m.CI) + ")"
}

func (v *statusView) render(w io.Writer, output string, now time.Time) error {
	if output == outputJSON {
		return writeJSON(w, v)
	}
	wide := output == outputWide
	header := []string{"INDEX", "UUID", "MODEL", "STATE", "HOLDER", "ID", "SINCE", "WAITERS"}
	if wide {
		header = []string{"INDEX", "UUID", "MODEL", "STATE", "HOLDER", "CONTAINER ID", "FRONT END", "PID", "SINCE", "WAITERS"}
	}
	t := newTable(w, header...)
	for _, d := range v.Devices {
		uuid := d.UUID
		if !wide {
			uuid = shortUUID(uuid)
		}
		model := d.Model
		switch {
		case v.noInventory:
			model = "(inventory unavailable)"
		case !d.InInventory:
			model = "(not in inventory)"
		}
		holder, id, frontEnd, pid, sinceCol := none, "", none, none, none
		switch {
		case d.Holder != nil:
			holder = d.Holder.name()
			if d.HeldVia != "" {
				holder += " (via " + d.heldViaIndex + ")"
			}
			id = d.Holder.ContainerID
			frontEnd = d.Holder.FrontEnd
			if d.Holder.Pid > 0 {
				pid = strconv.Itoa(d.Holder.Pid)
			}
			sinceCol = since(now, d.Holder.Since)
		case d.Reservation != nil:
			holder = "for " + d.reservedFor
			id = d.Reservation.ContainerID
			sinceCol = since(now, d.Reservation.Since)
		}
		if !wide {
			id = naming.ShortID(id)
		}
		state := d.stateLabel()
		row := []string{d.Index, uuid, model, state, holder, id, sinceCol, strconv.Itoa(d.Waiters)}
		if wide {
			row = []string{d.Index, uuid, model, state, holder, id, frontEnd, pid, sinceCol, strconv.Itoa(d.Waiters)}
		}
		t.row(row...)
	}
	if err := t.flush(); err != nil {
		return err
	}
	if err := v.renderNotes(w, now); err != nil {
		return err
	}
	return renderProblems(w, v.Problems)
}

// renderProblems prints the attention list under a table.
func renderProblems(w io.Writer, problems []problem) error {
	if len(problems) == 0 {
		return nil
	}
	if _, err := fmt.Fprintf(w, "\nATTENTION (%d):\n", len(problems)); err != nil {
		return fmt.Errorf("write output: %w", err)
	}
	for _, p := range problems {
		if _, err := fmt.Fprintf(w, "  - %s\n", escapeLine(p.Message)); err != nil {
			return fmt.Errorf("write output: %w", err)
		}
	}
	return nil
}

// headOf is the head of tx's queue and what it waits for.
func headOf(tx *ledger.Tx) headWait {
	w, wants, ok := tx.HeadWaitsFor()
	if !ok {
		return headWait{}
	}
	return headWait{waiter: w, wants: wants}
}
