// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"errors"
	"slices"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// GPU is one physical GPU of the inventory.
type GPU struct {
	Index     int    `json:"index"`
	UUID      string `json:"uuid"`
	Minor     int    `json:"minor"`
	Model     string `json:"model,omitempty"`
	MemoryMiB uint64 `json:"memory_mib,omitempty"`
	BusID     string `json:"bus_id,omitempty"`
	MIG       []MIG  `json:"mig,omitempty"`
}

// MIG is one MIG instance of a GPU.
type MIG struct {
	Index       int    `json:"index"` // MIG device index on the parent: "<parent index>:<Index>"
	UUID        string `json:"uuid"`
	GI          int    `json:"gi"`
	CI          int    `json:"ci"`
	ParentUUID  string `json:"parent_uuid"`
	ParentIndex int    `json:"parent_index"`
	Model       string `json:"model,omitempty"`
	MemoryMiB   uint64 `json:"memory_mib,omitempty"`
}

// Inventory is the host's GPUs, loaded once from one source. It is immutable
// after construction and safe for concurrent use; lookups are map reads.
// Build one with NewInventory, Discover, LoadCache or json.Unmarshal: each
// validates it and builds the lookup indexes.
type Inventory struct {
	// Source is the source that produced it: "nvml", "proc" or "static".
	Source string `json:"source"`
	GPUs   []GPU  `json:"gpus"`
	// Notes say why earlier sources were skipped and what could not be
	// mapped (for operators: gpu-guard-ctl devices shows them).
	Notes []string `json:"notes,omitempty"`
	// CapsMajor is the character-device major of /dev/nvidia-caps/* (from
	// /proc/devices, read whether or not MIGCaps could be); 0 when unknown.
	// It lets a renamed capability node still be recognised by its numbers.
	// Unknown while MIG instances are listed, any node or rule of a dynamic
	// major is read as an unmapped capability.
	CapsMajor int64 `json:"caps_major,omitempty"`
	// MIGCaps maps /dev/nvidia-caps/nvidia-cap<N> minors to MIG instances;
	// empty when the mapping is unknown.
	MIGCaps []MIGCap `json:"mig_caps,omitempty"`
	// UnlistedGPUs counts the NVIDIA GPUs on the PCI bus (not handed to
	// vfio-pci) that an inventory found empty by every source does not list:
	// the driver was not loaded yet, say. Such an inventory cannot tell
	// which GPUs "all" reaches, and a request for every GPU is refused
	// rather than taken for one that reaches none (see guard).
	UnlistedGPUs int `json:"unlisted_gpus,omitempty"`
	// Undiscovered marks the empty inventory a daemon starts with when no
	// discovery source works (the NVIDIA driver is not loaded yet) and no
	// cache exists: which GPUs the host has is not known, so every GPU
	// request is refused (see guard) until the daemon's own discovery,
	// retried in the background, lists them. It is never written to the
	// cache (SaveCache refuses it): the OCI hooks keep failing closed.
	Undiscovered bool `json:"undiscovered,omitempty"`
	// Unchecked says why a static list ([[devices.static]]) is the
	// inventory without having been checked against the GPUs the driver
	// lists in full (see staticLoader.verify); "" when it was, or when the
	// inventory is no static list. It is written to the cache, whose readers
	// then check it against the driver on every read, in the boot it was
	// written in too (checkCacheBoot), and the daemon checks it again in the
	// background until it is checked in full (pkg/daemon).
	Unchecked Unchecked `json:"unchecked,omitempty"`
	// Contradiction is set on the undiscovered inventory a daemon swaps in
	// when the driver, checked again, contradicts the static list it
	// decided with unchecked: the mismatch (ErrStaticMismatch's text), which
	// the guard's refusals of GPU requests carry. Never written to the
	// cache (an undiscovered inventory is not).
	Contradiction string `json:"-"`
	// Provisional marks an inventory the daemon decides with only until its
	// discovery, retried in the background, lists the GPUs (the cache a
	// failed discovery fell back to, an empty or undiscovered inventory): a
	// GPU observer that could not open NVML then tries again once an
	// inventory that is not provisional replaces it. Set by the daemon
	// before the inventory is used; never written to the cache.
	Provisional bool `json:"-"`

	// idx holds the lookup indexes built by NewInventory; nil for a zero
	// Inventory, which then behaves as an empty one.
	idx *index
}

// Unchecked says why a static list was not checked against the driver in
// full (Inventory.Unchecked).
type Unchecked string

const (
	// UncheckedNoDriver means there was no driver tree under proc_root to
	// compare with. The NVIDIA driver is not loaded (yet: a GPU Operator
	// loads it after the guard), so no container reaches a GPU; or
	// proc_root names a directory of fake GPUs (tests, demos), where it
	// never will be.
	UncheckedNoDriver Unchecked = "no-driver"
	// UncheckedUUIDs means the driver does not know the UUID of at least one
	// GPU yet (no persistence mode, right after a boot); the list matched
	// what it shows of that GPU (minor, index), not its UUID. Until the
	// UUIDs are checked, an unknown id is refused under
	// policy.unknown_device = "ignore" too (see the resolver): it may be
	// the real UUID of a GPU the list names wrongly.
	UncheckedUUIDs Unchecked = "uuids"
)

// MIGCapKind tells what a /dev/nvidia-caps node grants.
type MIGCapKind string

// Capability kinds of /proc/driver/nvidia-caps/mig-minors.
const (
	// CapGIAccess opens one GPU instance ("gpu<M>/gi<G>/access").
	CapGIAccess MIGCapKind = "gi"
	// CapCIAccess opens one compute instance ("gpu<M>/gi<G>/ci<C>/access").
	CapCIAccess MIGCapKind = "ci"
	// CapConfig and CapMonitor are host-wide MIG management capabilities;
	// they open no MIG instance and are never claims.
	CapConfig  MIGCapKind = "config"
	CapMonitor MIGCapKind = "monitor"
)

// MIGCap is one /dev/nvidia-caps/nvidia-cap<Minor> node and what it opens.
type MIGCap struct {
	Minor int        `json:"minor"`
	Kind  MIGCapKind `json:"kind"`
	// GPUMinor, GI and CI locate the instance for CapGIAccess/CapCIAccess:
	// GPUMinor is the parent GPU's minor number (/dev/nvidia<GPUMinor>).
	GPUMinor int `json:"gpu_minor,omitempty"`
	GI       int `json:"gi,omitempty"`
	CI       int `json:"ci,omitempty"`
}

// Loader is one inventory source.
type Loader interface {
	// Name is "nvml", "proc" or "static".
	Name() string
	// Load enumerates the GPUs. It returns an error wrapping ErrSourceUnavailable
	// when the source is absent on this host (no driver, no /proc tree).
	Load() ([]GPU, error)
}

// ErrSourceUnavailable means an inventory source does not exist on this host.
var ErrSourceUnavailable = errors.New("inventory source unavailable")

// Request is everything about a container that can make a GPU reachable. The
// NRI adapter and the hook fill it from api.Container or an OCI spec; ctl
// explain fills it from flags.
type Request struct {
	Env         []string          // KEY=VALUE, in spec order (the last occurrence wins)
	Mounts      []string          // mount destinations inside the container
	Annotations map[string]string // OCI/CRI annotations (cdi.k8s.io/*)
	CDIDevices  []string          // fully qualified CDI names (api.Container.CDIDevices)
	// LateCDIDevices are qualified CDI names injected after the guard's
	// check (another NRI plugin's adjustment, which containerd resolves
	// once every plugin has answered): their device nodes are never seen,
	// so only NVIDIA GPU names are accepted, as in NVIDIA_VISIBLE_DEVICES.
	LateCDIDevices []string
	Devices        []LinuxDevice // linux.devices of the spec
	Privileged     bool
	// SysAdmin: the container may hold CAP_SYS_ADMIN though its spec does
	// not say so: it has no capabilities object (or no process), and
	// recent runc then leaves it the runtime's own capabilities (root's
	// full set). Only the MIG parent node reads it (NVIDIA's driver lets
	// an administrator use every MIG instance through it); the container
	// is not privileged for it (policy.privileged does not apply), since
	// a device cgroup still fences what it opens. Only RequestFromSpec
	// (the OCI hook, recovery, ctl explain) sets it: an NRI request
	// carries no process capabilities (CRI always writes them into the
	// spec, so a CRI container never lacks them).
	SysAdmin bool
	// AllDevicesAllowed: the device cgroup lets the container open every
	// device, as engines set it up for a privileged container. Only then are
	// its GPU device nodes the engine's wholesale addition rather than a
	// request (policy.privileged = "declared"): a container with
	// CAP_SYS_ADMIN but a device cgroup that allows only /dev/nvidia0 can
	// open GPU 0 and nothing else, so that node is a request.
	AllDevicesAllowed bool
	// GPUNodesAllowed: the device cgroup lets the container read or write
	// every GPU node (NVIDIA's major with any minor), whether or not the
	// nodes are listed: it can open every GPU, and is resolved under
	// policy.privileged like a privileged container (see ApplyDeviceRules).
	GPUNodesAllowed bool
	// HostDevMounted: the host's /dev is bind-mounted into the container
	// (from /dev, /, or a /proc path that leads to a process's root).
	// Where a device cgroup applies (every rootful engine), it decides what
	// opens, and the rules are read as such; without one (a rootless
	// runtime) every node of it opens: the OCI hook then sets
	// GPUNodesAllowed (see BindMountedNodes).
	HostDevMounted bool
	// NoDeviceCgroup: no device cgroup enforces the container's device
	// rules (a rootless runtime, or a rootful one that set up no cgroup for
	// it), and it can open every GPU that way: through the host's /dev
	// bound in, or a node it makes itself (CAP_MKNOD, or a devtmpfs it
	// mounts with CAP_SYS_ADMIN). The OCI hook sets
	// it together with GPUNodesAllowed; messages then name the cause
	// instead of a device cgroup rule.
	NoDeviceCgroup bool
	// ImageNodes and NodeDirs: with NoDeviceCgroup, the only reasons the
	// container can open every GPU are device nodes that directories it is
	// given may hold, on mounts that are not nodev in the container, and
	// that are not read: its root filesystem (ImageNodes: a rootful engine
	// makes every device node an image carries as it unpacks the layers,
	// and the root's mount is nodev in the container only where the
	// storage is mounted nodev and the runtime keeps that: runc with a
	// read-write root, runc or crun with a user namespace of the
	// container's own, never crun without one), and the directories bound
	// in (NodeDirs: a
	// named volume an engine filled from an image, nodes and all, or any
	// host directory). The OCI hook sets them; messages then name these
	// causes and their remedies (a mount or a bind made nodev, a runtime
	// that keeps the nodev: RootNodev, NodeDir.NodevDropped).
	ImageNodes bool
	NodeDirs   []NodeDir
	// RootNodev, with ImageNodes, is what the runtime makes of the nodev
	// of the root filesystem's mount, and RootStorageNodev whether that
	// mount (container storage) is nodev on the host: the remedy depends
	// on both (a storage mounted nodev helps only under a runtime that
	// keeps it).
	RootNodev        RootNodev
	RootStorageNodev bool
	// DynamicMajorRules are the device cgroup rules that can reach a node
	// of a major of the kernel's dynamic range (where nvidia-caps gets one
	// at module load): type "c" for such a major or for no major, and type
	// "a". In order, at most maxDynamicMajorRules of them: the resolver
	// reads them for the host's nvidia-caps major, which only the inventory
	// knows (see ApplyDeviceRules). ManyDynamicMajorRules: there were more,
	// and they are read as opening every capability.
	DynamicMajorRules     []DeviceRule
	ManyDynamicMajorRules bool
}

// RootNodev is what the runtime makes of the nodev of a container's root
// filesystem's mount (Request.RootNodev), which tells what stops the
// device nodes its image may carry where no device cgroup does. Verified as
// root with a root on a nodev mount holding a node: runc 1.1.5 keeps the
// nodev for a read-write root and drops it for a read-only one (it
// remounts the root MS_RDONLY alone); crun 1.8.1 drops it for either. In
// a user namespace of the container's own both keep it for either, the
// kernel having locked it.
type RootNodev uint8

const (
	// RootNodevKept means the runtime keeps the mount's nodev (runc, a
	// read-write root; runc or crun, a container with a user namespace of
	// its own), so the root counts only because its mount is not nodev:
	// mounting container storage nodev is the remedy.
	RootNodevKept RootNodev = iota
	// RootNodevDroppedReadOnly means the runtime is runc and the root
	// read-only, which runc remounts without the nodev of its mount: a
	// read-write root, or a user namespace of the container's own (on
	// storage mounted nodev), is the remedy.
	RootNodevDroppedReadOnly
	// RootNodevDroppedByRuntime means the runtime is not known to keep
	// the nodev of any root (crun outside a user namespace of the
	// container's own, any other runtime but runc, or one that cannot be
	// told): storage mounted nodev does not help there; a device cgroup,
	// runc with a read-write root, or runc or crun with a user namespace
	// of the container's own (on storage mounted nodev), is the remedy.
	RootNodevDroppedByRuntime
)

// NodeDir is a host directory a container without a device cgroup is given
// on a mount that is not nodev (Request.NodeDirs): every device node in it
// opens there.
type NodeDir struct {
	// Path is the host directory: a bind source, or an overlay's layer.
	Path string
	// BoundAt is where the container sees it.
	BoundAt string
	// Overlay: Path is a layer of the overlay mounted at BoundAt, whose
	// own nodev option alone stops the layer's nodes (the kernel checks
	// the overlay's mount, not the layer's).
	Overlay bool
	// NodevDropped: Path is on a nodev mount whose nodev the container
	// does not get: a bind source whose nodev the runtime does not keep on
	// the bind (crun remounts every bind without it, runc a bind with flag
	// options of its own, such as ro), or a mount below a recursive bind
	// whose "rdev" clears it. Mounting Path nodev does not help, only the
	// bind's own options do.
	NodevDropped bool
	// Below, where set, is the source of the recursive bind that Path, a
	// mount of its own below that source, comes in with: it keeps its own
	// flags there, and the bind's nodev option makes only the bind's top
	// mount nodev. Only Path's own nodev, or the bind's "rnodev", stops its
	// nodes.
	Below string
	// Clears are the options of the bind that clear nodev where Path is
	// ("dev" and "rdev" for the bind of Path, "rdev" for one Path is
	// below), in the order given: while one is there neither a nodev mount
	// nor a nodev option helps, and the remedy says to drop it.
	Clears []string
}

// LinuxDevice is one entry of the spec's linux.devices.
type LinuxDevice struct {
	Path  string
	Type  string // "c", "b", ...
	Major int64
	Minor int64
	// BoundAt is set for a host node bind-mounted into the container
	// (Request.AddMount): Path is the host node, BoundAt where the
	// container sees it. Messages name both.
	BoundAt string
}

// Resolved is one device a container reaches, with every source that named it.
type Resolved struct {
	Device
	// Sources says where the device was named, for messages, in the order
	// read: `env NVIDIA_VISIBLE_DEVICES="1"` (the id as written; "all" when
	// it came from all), `mount /var/run/nvidia-container-devices/1`,
	// `annotation cdi.k8s.io/gpu="nvidia.com/gpu=1"`, `cdi "nvidia.com/gpu=1"`,
	// `device /dev/nvidia1 (195:1)`, `privileged`.
	Sources []string `json:"sources"`
}

// Resolution is the outcome of resolving a Request.
type Resolution struct {
	// Devices is sorted by UUID and de-duplicated.
	Devices []Resolved `json:"devices"`
	// All is true when some source asked for every GPU (after policy).
	All bool `json:"all,omitempty"`
	// Privileged is true when the request was resolved under
	// policy.privileged: the container is privileged, or it can open every
	// GPU node (GPUNodesAllowed: a device cgroup rule such as c 195:*, or
	// no device cgroup).
	Privileged bool `json:"privileged,omitempty"`
	// Notes are non-fatal observations (an ignored unknown id, `none`, `void`).
	Notes []string `json:"notes,omitempty"`
}

// UUIDs returns the resolved UUIDs in order.
func (r Resolution) UUIDs() []string {
	out := make([]string, len(r.Devices))
	for i, d := range r.Devices {
		out[i] = d.UUID
	}
	return out
}

// Errors the resolver wraps; each concrete error names the token and source.
var (
	ErrUnknownDevice      = errors.New("unknown GPU")
	ErrInvalidID          = errors.New("invalid device id")
	ErrAllRejected        = errors.New("requests for all GPUs are refused by policy")
	ErrPrivilegedRejected = errors.New("privileged containers are refused by policy")
	ErrTooLarge           = errors.New("input too large")
)

// advice is a resolution error whose text says what to do about it.
type advice struct{ error }

func (a advice) Unwrap() error { return a.error }

// advised marks err as saying what to do about it.
func advised(err error) error { return advice{err} }

// Advises reports whether an error of kind (ErrUnknownDevice, ErrInvalidID,
// ...) wrapped or joined into err says itself what to do instead, so that a
// message built on it adds no generic advice, which could repeat or
// contradict it.
func Advises(err error, kind error) bool {
	switch e := err.(type) { //nolint:errorlint // walks the tree itself, to look at every joined error
	case nil:
		return false
	case advice:
		return errors.Is(e.error, kind)
	case interface{ Unwrap() []error }:
		return slices.ContainsFunc(e.Unwrap(), func(x error) bool { return Advises(x, kind) })
	case interface{ Unwrap() error }:
		return Advises(e.Unwrap(), kind)
	}
	return false
}

// Resolver turns Requests into Resolutions against a fixed Inventory and the
// policy. It is safe for concurrent use.
type Resolver struct {
	inv    *Inventory
	policy config.PolicyConfig
}

// NewResolver returns a resolver over inv with the given policies.
func NewResolver(inv *Inventory, policy config.PolicyConfig) *Resolver {
	return &Resolver{inv: inv, policy: policy}
}
