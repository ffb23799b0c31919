// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"errors"
	"log/slog"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// FrontEnd names the front end that made a claim.
type FrontEnd string

// Front ends.
const (
	FrontEndNRI  FrontEnd = "nri"
	FrontEndHook FrontEnd = "hook"
	FrontEndCtl  FrontEnd = "ctl"
)

// Owner identifies a container (the holder of a claim, or a waiter's latest
// attempt). ContainerID is the only identity a claim is released by.
type Owner struct {
	ContainerID  string   `json:"container_id"`
	Container    string   `json:"container,omitempty"` // container name
	Namespace    string   `json:"namespace,omitempty"`
	Pod          string   `json:"pod,omitempty"`
	PodUID       string   `json:"pod_uid,omitempty"`
	PodSandboxID string   `json:"pod_sandbox_id,omitempty"`
	FrontEnd     FrontEnd `json:"front_end"`
	// Pid, PidStart (field 22 of /proc/<pid>/stat, against pid reuse) and
	// Cgroup are known once the container started.
	Pid       int       `json:"pid,omitempty"`
	PidStart  uint64    `json:"pid_start,omitempty"`
	Cgroup    string    `json:"cgroup,omitempty"`
	StartedAt time.Time `json:"started_at,omitzero"`
	// StoppedAt is set under release_on = "remove" once the container exited:
	// the claim is kept until removal, and another container of the same pod
	// may take it over.
	StoppedAt time.Time `json:"stopped_at,omitzero"`
	// DrainingSince is set when the holder stopped (or was removed) under
	// release_requires_idle: the claim is kept, draining, until its
	// processes have left the GPU (Tx.FinishDraining) or the drain grace
	// (Options.DrainGrace) passes, whichever comes first.
	DrainingSince time.Time `json:"draining_since,omitzero"`
}

// Claim is one device held by one container.
type Claim struct {
	Device devices.Device `json:"device"`
	Owner  Owner          `json:"owner"`
	// Source says how the container named the device (for messages).
	Source string    `json:"source,omitempty"`
	Since  time.Time `json:"since"`
}

// Waiter is a queued request. Key is stable across retries
// ("namespace/pod-uid/container-name" for CRI, the container id for hooks).
type Waiter struct {
	Key       string           `json:"key"`
	Seq       uint64           `json:"seq"` // global arrival order (FIFO)
	Devices   []devices.Device `json:"devices"`
	Owner     Owner            `json:"owner"` // identity of the latest attempt
	FirstSeen time.Time        `json:"first_seen"`
	LastSeen  time.Time        `json:"last_seen"`
}

// Reservation holds a released device for the head of its queue.
type Reservation struct {
	Device devices.Device `json:"device"`
	For    string         `json:"for"` // waiter key
	Since  time.Time      `json:"since"`
	Until  time.Time      `json:"until"`
}

// Conflict records a container seen using a device that another container
// holds (found at reconcile). Nothing is killed; ctl and metrics show it.
type Conflict struct {
	Device devices.Device `json:"device"`
	Owner  Owner          `json:"owner"`
	Since  time.Time      `json:"since"`
}

// Cordon takes a device out of new claims (see Tx.Cordon): nobody may claim
// it, or a device conflicting with it (a cordon on a GPU covers its MIG
// instances; one on a MIG instance blocks its full GPU), and nothing is
// reserved on it. Its holder, if any, keeps its claim.
type Cordon struct {
	Device devices.Device `json:"device"`
	// Source is who or what cordoned it: CordonOperator, CordonIntruder or
	// CordonUnhealthy.
	Source string `json:"source"`
	Reason string `json:"reason"`
	By     string `json:"by"`
	// Since is when the device was first cordoned; a repeated cordon
	// updates source, reason and by, and keeps it.
	Since time.Time `json:"since"`
}

// State is the ledger's content. Slices are kept sorted (claims by device UUID,
// waiters by Seq, reservations by device UUID, conflicts by device then id,
// cordons by device UUID).
type State struct {
	Claims       []Claim       `json:"claims"`
	Waiters      []Waiter      `json:"waiters"`
	Reservations []Reservation `json:"reservations"`
	Conflicts    []Conflict    `json:"conflicts"`
	// Cordons is omitted when empty, so that a state without one is
	// written as before (the format version still marks it: see
	// FormatVersion).
	Cordons    []Cordon `json:"cordons,omitempty"`
	Generation uint64   `json:"generation"`
	BootID     string   `json:"boot_id"`
	// Lineage is a random id given to a state when it starts empty: no
	// state file, a file moved aside as corrupt, or an earlier boot's state
	// discarded. Every other mutation keeps it, so a reader that remembers
	// it learns when the ledger was started afresh behind its back and no
	// longer knows the holders it knew (see RequireLineage). "" is a file
	// written before lineages existed; the first commit gives it one.
	Lineage   string    `json:"lineage"`
	NextSeq   uint64    `json:"next_seq"`
	UpdatedAt time.Time `json:"updated_at"`
	// Clock ties the wall clock, which every stored time is read from, to
	// the time since boot, which nobody steps (see ClockAnchor). Zero in a
	// state written before format 4 (or that never committed): set at its
	// next commit.
	Clock ClockAnchor `json:"clock,omitzero"`
}

// ClockAnchor is one reading of the wall clock (Wall) and of the time since
// boot (Boot, CLOCK_BOOTTIME: the same clock for every process of the boot,
// counting suspend, and never stepped) taken together. Every TTL counts from
// a stored wall-clock time, and a step of the wall clock (date -s, chronyc
// makestep, NTP's first sync after boot, a VM resumed) would move every
// deadline by the step at once. Both clocks advance at the same rate (NTP
// slews both), so wall - boot stays what the anchor says until the wall
// clock is stepped: a transaction that finds them apart by more than
// clockStepTolerance moves every stored time by the step (see
// Tx.checkClock) and anchors anew. The anchor only changes then (and when
// first set), so an ordinary commit's journal record does not carry it. It
// belongs to the boot of the state's BootID: an earlier boot's is never
// compared with.
type ClockAnchor struct {
	Wall time.Time     `json:"wall"`
	Boot time.Duration `json:"boot_ns"`
}

// IsZero reports whether there is no anchor (omitzero asks it).
func (a ClockAnchor) IsZero() bool { return a.Wall.IsZero() && a.Boot == 0 }

// Holding is what reconcile learns about one live container: its identity and
// the devices it reaches.
type Holding struct {
	Owner   Owner
	Devices []devices.Device
	Source  string
}

// ReconcileResult reports what Reconcile changed.
type ReconcileResult struct {
	Released  []Claim    // claims of containers the runtime no longer lists
	Adopted   []Claim    // listed containers' devices that had no claim
	Conflicts []Conflict // listed containers on a device another one holds
	// Lineage is the lineage of the reconciled state; within Update it is
	// the one committed (Reconcile persists a new lineage at once).
	Lineage string
}

// Options tune a Ledger. Zero values take the documented defaults.
type Options struct {
	LockTimeout    time.Duration // default 1s; also bounded by the context deadline
	AuditMaxBytes  int64         // default 10 MiB
	ReservationTTL time.Duration // default 6m
	QueueTTL       time.Duration // default 15m
	// DrainGrace bounds how long a claim stays draining (Owner.
	// DrainingSince): at every Update (and View) a draining claim older
	// than this is released, audited and logged. 0 = never kept draining
	// past the update that finds it (release_requires_idle off).
	DrainGrace time.Duration
	Now        func() time.Time // default time.Now (tests inject a clock)
	// BootClock reads the time since boot that tells a step of the wall
	// clock from time passing (see ClockAnchor); a negative reading is
	// none. Default: CLOCK_BOOTTIME (SinceBoot) when Now is left to its
	// default; when Now is set and BootClock is not, none: no step is told
	// and no anchor stored (an injected clock and the host's boot clock
	// disagree from the start; a test that steps its clock injects both).
	BootClock func() time.Duration
	BootID    string // default: /proc/sys/kernel/random/boot_id
	// Logger receives what cannot be returned: an audit append that failed
	// after the state was committed, stray temp files removed, a state from
	// an earlier boot discarded. Default: discard.
	Logger *slog.Logger
	// RuntimeDir holds the per-boot markers (default DefaultRuntimeDir, a
	// tmpfs emptied at every boot): one per state dir, recording that a
	// ledger of lineage L at generation G exists there in this boot. It is
	// how a vanished, replaced or rolled-back state is told from a fresh
	// host. Created 0700 by a writable ledger; a process that cannot read
	// it (not root, for the default) cannot use the ledger either.
	RuntimeDir string
	// BeforeLockWait, if set, is called before a lock acquisition first
	// waits for a lock another process holds (once per acquisition, from
	// the goroutine acquiring it). A short-lived process (an OCI hook) sets
	// up its interrupt handling there, so that it pays for it only when it
	// may block.
	BeforeLockWait func()
}

// Errors, wrapped with details by the concrete error types.
var (
	// ErrBusy: a device is held or reserved for someone else (see BusyError).
	ErrBusy = errors.New("device busy")
	// ErrLockTimeout: the ledger lock was not obtained in time (see LockError).
	ErrLockTimeout = errors.New("ledger lock not acquired in time")
	// ErrCorrupt: a state file did not parse or verify (see CorruptError).
	// It is left in place and every Update refuses until Ledger.Recover.
	ErrCorrupt = errors.New("ledger state is corrupt")
	// ErrNeedsRecovery: the state is damaged, missing, moved, replaced or
	// rolled back (see NeedsRecoveryError and CorruptError): nothing is
	// decided against it until Ledger.Recover or Ledger.Reset.
	ErrNeedsRecovery = errors.New("ledger needs recovery")
	// ErrHealthy: a reset asked to start only a ledger that needs recovery
	// afresh (ResetOptions.RefuseHealthy) found it healthy under the lock;
	// nothing was written.
	ErrHealthy = errors.New("refusing to reset a healthy ledger")
	// ErrUnsafeDir: the state dir or a file in it is a symlink, world-writable
	// or owned by another user.
	ErrUnsafeDir = errors.New("unsafe ledger directory")
	// ErrNotFound: no claim, waiter or device matched.
	ErrNotFound = errors.New("not found")
	// ErrMaybeCommitted: an Update failed after its commit was written to
	// the state files (the journal record appended, its fdatasync failed; a
	// new lineage's journal renamed into place, the fsync of the state dir
	// failed). The commit is not cut back: every later reader may see it,
	// this process's included, and whether it would survive a crash is not
	// known. The caller must take what fn did for done (a claim made, a
	// waiter queued) and undo it, or let it end, as it would a success:
	// taking it for "nothing written" leaves it behind. Every other error
	// of Update means that nothing of fn's was written.
	ErrMaybeCommitted = errors.New("ledger commit failed after it was written, and may stand")
)

// BusyError lists every device of a request that is not free.
type BusyError struct {
	Busy []BusyDevice
}

// BusyDevice is one device that is held, reserved for another waiter, or
// kept for the head of the queue.
type BusyDevice struct {
	Wanted devices.Device // the device asked for
	Holder *Claim         // the conflicting claim, if held
	// Conflict says Holder is not a claim but a conflict record: a
	// container found running on the device at reconcile without a claim
	// (Holder.Source is ConflictSource, for messages). It holds nothing
	// another container could take over.
	Conflict    bool
	Reservation *Reservation // the conflicting reservation, if reserved
	// KeptFor is the head of the queue, when nothing holds or reserves the
	// device but the head asks for a device conflicting with it (Through)
	// that it cannot have reserved yet: a whole GPU another MIG instance of
	// which is in use. Set only when Holder and Reservation are not.
	KeptFor *Waiter
	Through devices.Device // the device the head asks for, when KeptFor is set
}

// Error names every busy device (index and UUID) and who holds or reserved it.
func (e *BusyError) Error() string { return busyMessage(e.Busy) }

// Unwrap makes errors.Is(err, ErrBusy) hold.
func (e *BusyError) Unwrap() error { return ErrBusy }
