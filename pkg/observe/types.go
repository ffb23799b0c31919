// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package observe

import (
	"errors"
	"fmt"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// Device is one GPU or MIG instance the observer looks at.
type Device struct {
	// Index is how operators name it: "0" for a GPU, "1:3" for MIG
	// instance 3 of GPU 1.
	Index string `json:"index"`
	// UUID is the NVML UUID (GPU-… or MIG-…), the identity claims use.
	UUID string `json:"uuid"`
	// ParentUUID is the GPU of a MIG instance; empty for a GPU.
	ParentUUID string `json:"parent_uuid,omitempty"`

	gpuIndex int // NVML index of the GPU (of the parent for MIG)
	// busID (normalised, "" when the inventory lacks it) and minor are a
	// GPU's other identities in the inventory: an Xid event whose device
	// NVML cannot read the UUID of is matched to a GPU by them.
	busID    string
	minor    int
	migIndex int  // NVML MIG device index on the parent; -1 for a GPU
	gi, ci   int  // GPU and compute instance of a MIG instance
	hasMIG   bool // a GPU whose processes are listed on its MIG instances
	// unknownMIG: a MIG instance NVML reports on a GPU of the inventory
	// that the inventory lacks (created since discovery). It is listed
	// and judged like the inventory's instances (a claim on its GPU
	// covers it); nothing can claim it until the inventory is rebuilt.
	unknownMIG bool
}

// unidentifiedName names the device of an Xid event NVML could not tell the
// identity of (Device with an empty UUID: every device the inventory
// holds has one).
const unidentifiedName = "an unidentified GPU"

// unidentifiedDevice is the device of a critical Xid that could not be
// matched to any device: none of its identities could be read (see
// Report.Devices).
var unidentifiedDevice = Device{Index: "?", migIndex: -1}

// IsMIG reports whether d is a MIG instance.
func (d Device) IsMIG() bool { return d.ParentUUID != "" }

// String names the device the way every message does: index and UUID.
func (d Device) String() string {
	if d.UUID == "" {
		return unidentifiedName
	}
	if d.unknownMIG {
		return fmt.Sprintf("MIG %s (%s) of GPU %d (%s), an instance the inventory lacks", d.Index, d.UUID, d.gpuIndex, d.ParentUUID)
	}
	if d.IsMIG() {
		return fmt.Sprintf("MIG %s (%s)", d.Index, d.UUID)
	}
	return fmt.Sprintf("GPU %s (%s)", d.Index, d.UUID)
}

// DevicesOf lists the GPUs of an inventory and their MIG instances, GPUs
// first in index order, each followed by its MIG instances.
func DevicesOf(gpus []devices.GPU) []Device {
	var out []Device
	for _, g := range gpus {
		bus, _ := devices.NormaliseBusID(g.BusID) // "" when none
		out = append(out, Device{
			Index: fmt.Sprint(g.Index), UUID: g.UUID,
			gpuIndex: g.Index, migIndex: -1, hasMIG: len(g.MIG) > 0,
			busID: bus, minor: g.Minor,
		})
		for _, m := range g.MIG {
			out = append(out, Device{
				Index: fmt.Sprintf("%d:%d", g.Index, m.Index), UUID: m.UUID, ParentUUID: g.UUID,
				gpuIndex: g.Index, migIndex: m.Index, gi: m.GI, ci: m.CI,
			})
		}
	}
	return out
}

// Holding is one claim as the ledger records it: the observer's whole view of
// the ledger.
type Holding struct {
	// DeviceUUID is the claimed GPU or MIG instance. A claim on a GPU
	// covers its MIG instances.
	DeviceUUID string
	// ContainerID is the holder's full container id.
	ContainerID string
	// Name is how messages name the holder ("namespace/pod/container");
	// the container id is used when empty.
	Name string
	// CgroupPath, when known, is the holder's cgroup (as in
	// /proc/PID/cgroup); a process in it or below it belongs to the holder
	// even when no container id can be read from its path.
	CgroupPath string
	// AnyDevice: the container may use every GPU without a claim (its pod's
	// namespace is in exempt_namespaces, a monitoring agent, say):
	// DeviceUUID is empty, and its processes are no finding on any device.
	AnyDevice bool
}

func (h Holding) name() string {
	if h.Name != "" {
		return fmt.Sprintf("%s (container %s)", h.Name, shortID(h.ContainerID))
	}
	return "container " + shortID(h.ContainerID)
}

// Ledger is what the ledger says: every current claim. The daemon fills it
// from ledger state; it is read once per accounting pass.
type Ledger interface {
	Holdings() ([]Holding, error)
}

// LedgerFunc adapts a function to Ledger.
type LedgerFunc func() ([]Holding, error)

// Holdings calls f.
func (f LedgerFunc) Holdings() ([]Holding, error) { return f() }

// ErrLedgerNotReady is wrapped by a Ledger's error to say that the ledger is
// not to be compared with what runs yet (the daemon: the NRI plugin has not
// synchronized with the runtime, so the containers created meanwhile are not
// adopted and would read as intruders). The pass is skipped without a
// report, and logged at debug level only: it is expected, not a failure.
var ErrLedgerNotReady = errors.New("the ledger is not ready to be compared with the GPUs")

// EpochLedger is a Ledger whose reads carry an epoch, which the report of
// the pass that made the read carries on (Report.LedgerEpoch). A pass takes
// up to its interval in NVML after reading the ledger; the epoch lets the
// consumer of its report tell that the ledger's meaning changed meanwhile
// (the daemon: the plugin synchronized with the runtime again) and that the
// report is judged against a view that no longer holds.
type EpochLedger interface {
	Ledger
	// HoldingsAt is Holdings and the epoch the view was read in.
	HoldingsAt() ([]Holding, uint64, error)
}

// EpochLedgerFunc adapts a function to EpochLedger.
type EpochLedgerFunc func() ([]Holding, uint64, error)

// Holdings calls f and drops the epoch.
func (f EpochLedgerFunc) Holdings() ([]Holding, error) {
	hs, _, err := f()
	return hs, err
}

// HoldingsAt calls f.
func (f EpochLedgerFunc) HoldingsAt() ([]Holding, uint64, error) { return f() }

// Process is one process NVML reports on a device, mapped to its container.
type Process struct {
	PID int `json:"pid"`
	// Type is "C" (compute), "G" (graphics) or "C+G", as nvidia-smi says.
	Type string `json:"type"`
	// UsedMemoryBytes is the GPU memory NVML attributes to the process
	// (0 when NVML does not say, e.g. without permission).
	UsedMemoryBytes uint64 `json:"used_memory_bytes"`
	// ContainerID is the container the process runs in; empty for a host
	// process (and for a gone one).
	ContainerID string `json:"container_id,omitempty"`
	// Cgroup is the process's cgroup path.
	Cgroup string `json:"cgroup,omitempty"`
	// Gone is set when the process could not be attributed: its /proc entry
	// vanished, its pid was reused after NVML listed it, or its /proc entry
	// could not be read (unattributed says why).
	Gone bool `json:"gone,omitempty"`
	// startTicks is the process start time in clock ticks since boot.
	startTicks uint64
	// unattributed is why a process whose /proc entry exists could not be
	// read (Gone is set too). Accounting does not blame such a process, but
	// it may be anyone's, the holder's included: Idle must not read it as
	// gone, or a draining claim would be released on doubt.
	unattributed error
}

func (p Process) owner() string {
	switch {
	case p.Gone:
		return "an exited process"
	case p.ContainerID == "":
		return "host process"
	default:
		return "container " + shortID(p.ContainerID)
	}
}

// Kind classifies a finding.
type Kind string

// Finding kinds. Intruder, out-of-bounds and unhealthy are problems; gone is
// informational (NVML listed a pid that could not be attributed).
const (
	// KindIntruder: a process of a container that holds nothing (or of the
	// host) runs on a device held by another container or on a free one.
	KindIntruder Kind = "intruder"
	// KindOutOfBounds: a holder's process runs on a device it did not claim.
	KindOutOfBounds Kind = "out_of_bounds"
	// KindUnhealthy: a critical Xid, or the device vanished or needs a reset.
	KindUnhealthy Kind = "unhealthy"
	// KindGone: NVML listed a pid whose /proc entry vanished or was reused.
	KindGone Kind = "gone"
)

// ErrVanished is wrapped by the error of a device NVML no longer knows.
var ErrVanished = errors.New("vanished from NVML")

// Finding is one thing the observer saw that the ledger does not explain.
type Finding struct {
	Kind   Kind      `json:"kind"`
	Device Device    `json:"device"`
	Time   time.Time `json:"time"`
	// PID and ContainerID name the process (intruder, out_of_bounds, gone);
	// ContainerID is empty for a host process.
	PID         int    `json:"pid,omitempty"`
	ContainerID string `json:"container_id,omitempty"`
	// StartTicks is when the process started, in clock ticks since boot
	// (/proc/PID/stat), for intruder and out_of_bounds: with the pid and
	// the boot, it names one process, so a pid reused by another is another
	// finding (the daemon carries its findings across its restart by it).
	StartTicks uint64 `json:"start_ticks,omitempty"`
	// Holder is the container id holding Device, empty when it is free.
	Holder string `json:"holder,omitempty"`
	// Instance is set on an intruder or out-of-bounds finding whose process
	// runs on a MIG instance the inventory lacks (created since discovery;
	// see DeviceReport.NotInInventory): it is that instance, and Device is
	// its GPU. The instance is judged against the claims on its GPU, and
	// nothing can claim or cordon it (the guard knows only the inventory's
	// devices), so the finding is the GPU's: a cordon for it (on_intruder
	// = "cordon") keeps new claims off the GPU, which another container
	// could otherwise take whole while the process runs on it, and what
	// is kept of the finding across passes and restarts (its key, its
	// cordon's lineage) names the device that cordon names. Message names
	// both, and says to restart nri-gpu-guard so that its discovery lists
	// the instance. Nil otherwise: a finding on a device of the inventory
	// is on that device. A gone finding is on the instance NVML listed
	// its pid on (it is no problem, nothing acts on it).
	Instance *Device `json:"instance,omitempty"`
	// Xid is the Xid error of an unhealthy finding (0: the device vanished
	// or reported a fatal state).
	Xid uint64 `json:"xid,omitempty"`
	// Vanished: the unhealthy device is no longer in NVML at all (for a MIG
	// instance, most often a repartition of its GPU, not a fault).
	Vanished bool `json:"vanished,omitempty"`
	// Message names the process, its container, the device (index + UUID)
	// and what to do.
	Message string `json:"message"`
}

// DeviceReport is one device as an accounting pass saw it.
type DeviceReport struct {
	Device    Device    `json:"device"`
	Holder    string    `json:"holder,omitempty"`
	Processes []Process `json:"processes"`
	// Error is set when NVML could not list the device's processes, or the
	// device is lost: nothing is concluded about the device in this pass.
	// It is set for nothing else: a reader takes it for "not checked".
	Error string `json:"error,omitempty"`
	// NotInInventory is set on a device the inventory lacks: it says so
	// and what to do. A MIG instance created since discovery: its
	// processes are listed (Error is empty unless NVML could not list
	// them) and judged against the claims on its GPU, but it cannot be
	// claimed, and readers that match devices to the inventory miss it,
	// until the inventory is rebuilt (restart nri-gpu-guard). The
	// unidentified device (empty UUID) of a critical Xid NVML could not
	// tell the device of (see Report): the Xid, and how to find and
	// cordon the GPU by hand; it has no processes to list.
	NotInInventory string `json:"not_in_inventory,omitempty"`
}

// Report is the result of one accounting pass. Besides the devices listed,
// it names every critical Xid the health watcher could not match to a
// device since the Observer started (its device's UUID NVML could not
// read, nor any other identity the inventory could match): one device with
// an empty UUID and a NotInInventory notice per Xid code, and an unhealthy
// finding on it.
// No device is marked unhealthy for it (Unhealthy, Health, OnUnhealthy):
// the report, the log and Options.OnUnidentified (the daemon's audit log)
// are where the operator learns of it.
type Report struct {
	Time     time.Time      `json:"time"`
	Devices  []DeviceReport `json:"devices"`
	Findings []Finding      `json:"findings"`
	// LedgerEpoch is the epoch of the ledger view the pass judged against
	// (EpochLedger; 0 for a plain Ledger).
	LedgerEpoch uint64 `json:"-"`
	// Skipped: the pass read no ledger view (ErrLedgerNotReady) and judged
	// nothing; OnReport still hears of it, for the work that needs no
	// view (putting back a device's unhealthy cordon). Nothing else in
	// the report is set.
	Skipped bool `json:"-"`
}

// Problems returns the findings that are problems (all but gone).
func (r Report) Problems() []Finding {
	var out []Finding
	for _, f := range r.Findings {
		if f.Kind != KindGone {
			out = append(out, f)
		}
	}
	return out
}

func shortID(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}
