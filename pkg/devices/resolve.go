// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"errors"
	"fmt"
	"path"
	"sort"
	"strconv"
	"strings"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/gpuid"
)

// Names the resolver reads from a container.
const (
	// EnvVisibleDevices is the NVIDIA runtime's device list variable.
	EnvVisibleDevices = "NVIDIA_VISIBLE_DEVICES"
	// EnvDockerResourceGPU carries the same list on some Docker setups; both
	// variables are read and the union is claimed.
	EnvDockerResourceGPU = "DOCKER_RESOURCE_GPU"

	// envCUDAVersion set and envRequireCUDA unset or empty mark a legacy
	// CUDA image (see builder.env).
	envCUDAVersion = "CUDA_VERSION"
	envRequireCUDA = "NVIDIA_REQUIRE_CUDA"
	// MountRoot is where the device plugin's volume-mount strategy mounts one
	// file per device: MountRoot/<id> or MountRoot/cdi/<qualified CDI name>.
	MountRoot = "/var/run/nvidia-container-devices"
	// CDIAnnotationPrefix starts the annotations that carry CDI device names.
	CDIAnnotationPrefix = "cdi.k8s.io/"
	// NvidiaCDIAnnotationPrefix starts the annotations that NVIDIA's own
	// injectors read: the container toolkit's NRI plugin (pod annotation
	// nvidia.cdi.k8s.io/container.<name>) and the NVIDIA runtime in CDI mode.
	// The devices they inject reach no other NRI plugin, so the annotation is
	// the only trace of the request. Values are qualified CDI names.
	NvidiaCDIAnnotationPrefix = "nvidia.cdi.k8s.io/"
)

// Bounds on untrusted input: a request past them fails with ErrTooLarge
// naming the source, instead of costing the node memory and time.
const (
	// MaxValueBytes bounds one env value, annotation value, mount
	// destination or CDI device name.
	MaxValueBytes = 4096
	// MaxValueTokens bounds the ids in one value.
	MaxValueTokens = 256
	// MaxRequestTokens bounds the ids, mounts and device nodes one request
	// names in all.
	MaxRequestTokens = 1024
)

// maxReported bounds how many problems (errors, notes) one resolution lists.
const maxReported = 16

// Resolve turns a container description into the set of devices it can reach,
// following DESIGN.md §3: every source is read and the union is returned,
// sorted by UUID, each device with every source that named it.
//
// The sources and their rules:
//   - env NVIDIA_VISIBLE_DEVICES and DOCKER_RESOURCE_GPU, each on its own
//     (last occurrence wins): comma split, trimmed, empties dropped; "void"
//     anywhere or no id → nothing; else the first "all"/"none" decides
//     ("0,all" is all); else ids: index "0", "<gpu>:<mig>", GPU-<uuid> (or a
//     unique prefix, as the runtime matches), MIG-<uuid>,
//     MIG-GPU-<uuid>/<gi>/<ci>, PCI bus id. MountRoot itself (what the
//     device plugin's volume-mount strategy sets) names no id: the mounts
//     carry the list. NVIDIA_VISIBLE_DEVICES unset on a legacy CUDA image
//     is all, whatever DOCKER_RESOURCE_GPU says.
//   - mounts MountRoot/<id>, <id> a comma-separated list as the runtime
//     hands it on: "all" (any case) anywhere is all, every other id is
//     resolved ("void" and "none" are no keywords there); and
//     MountRoot/cdi/<CDI name>. Any other path under MountRoot is refused.
//   - cdi.k8s.io/* and nvidia.cdi.k8s.io/* annotations, Request.CDIDevices
//     and Request.LateCDIDevices: qualified CDI names; nvidia.com/gpu and
//     nvidia.com/mig devices (and the same classes of the device plugin's
//     k8s.device-plugin.nvidia.com) are GPUs, named by index, gpu<N>,
//     mig<G>:<M>, UUID or all; any management.nvidia.com device is all (it
//     injects every GPU node); other devices are ignored, except another
//     NVIDIA device injected after the check (nvidia.cdi.k8s.io/*,
//     LateCDIDevices, and cdi.k8s.io/* when the spec lists no GPU node),
//     which is refused: its GPUs cannot be told (see cdiName).
//   - linux devices, by the numbers of the node the runtime makes of each
//     (MadeNumbers): 195:0-253 is the GPU with that NVML minor number;
//     195:254/255 are not GPUs; /dev/nvidia-caps nodes are MIG instances
//     where Inventory.MIGCaps maps them (see finish for the parent node),
//     and so is any node of a dynamic major while the inventory lists MIG
//     instances but not the nvidia-caps major (unmapped: see linuxDevices).
//   - privileged: policy.privileged declared (claim what it names), all
//     (claim every GPU) or reject.
//   - "all" anywhere: policy.all_devices claim (every full GPU), reject, or
//     ignore; unknown ids: policy.unknown_device reject or ignore; malformed
//     or ambiguous ids, and PCI bus ids of no GPU (the runtime reads them as
//     <gpu>:<mig>), are refused under every policy. On an inventory that
//     cannot list MIG instances (source proc) a MIG id is no unknown id:
//     <gpu>:<mig> (and the legacy form) claims that GPU whole, a MIG UUID is
//     refused under every policy.
//
// It reads only the in-memory inventory: no NVML call, no file I/O, so it is
// cheap enough for the NRI CreateContainer deadline and gives the same answer
// for the same request and inventory.
//
// Errors wrap ErrUnknownDevice, ErrInvalidID, ErrAllRejected,
// ErrPrivilegedRejected or ErrTooLarge (several at once through errors.Join),
// and each names the offending token (quoted) and its source. On error the
// Resolution is empty: nothing may be claimed for an unresolved request.
func (r *Resolver) Resolve(req Request) (Resolution, error) {
	b := r.newBuilder()
	if req.Privileged || req.GPUNodesAllowed {
		what := "privileged container (CAP_SYS_ADMIN)"
		fix := "run it unprivileged and name its GPUs"
		// What claims every GPU of an unprivileged container, and how not to.
		allSrc, allFix := srcGPURule, "name the GPUs the container needs and let its device cgroup allow only their nodes"
		// nodes: what a container reaches through the device nodes of
		// directories it is given ("" for another cause).
		nodes := ""
		if req.NoDeviceCgroup {
			allSrc = srcNoDeviceCgroup
			allFix = "run it in a device cgroup of its own (cgroups enabled), or without the host's /dev bound in and without CAP_MKNOD and CAP_SYS_ADMIN, and name its GPUs"
			if req.ImageNodes || len(req.NodeDirs) > 0 {
				nodes, allSrc, allFix = nodesCause(req)
			}
		}
		switch {
		case req.Privileged:
		case nodes != "":
			what = nodes
			fix = allFix
		case req.NoDeviceCgroup:
			what = "container without a device cgroup (the host's /dev bound in, or CAP_MKNOD or CAP_SYS_ADMIN, opens every GPU node)"
			fix = allFix
		default:
			what = "container whose device cgroup lets it open every GPU node (c 195:*)"
			fix = "name its GPUs and let its device cgroup allow only their nodes"
		}
		switch r.policy.Privileged {
		case config.PrivilegedReject:
			err := fmt.Errorf("%s: %w (policy.privileged = %q): it can open every GPU; %s",
				what, ErrPrivilegedRejected, config.PrivilegedReject, fix)
			if !req.Privileged {
				// The generic advice (drop privileged) does not apply.
				err = advised(err)
			}
			return Resolution{}, err
		case config.PrivilegedAll:
			b.claimAll(srcPrivileged)
		default: // declared
			if req.GPUNodesAllowed && (!req.Privileged || !req.AllDevicesAllowed) {
				// The wildcard was asked for: engines open every device
				// of a privileged container (CAP_SYS_ADMIN and a device
				// cgroup allowing everything), and nothing else
				// wholesale; `--cap-add SYS_ADMIN` does not make a
				// `--device-cgroup-rule 'c 195:* rw'` the engine's. With
				// CAP_MKNOD (in docker's and containerd's default set, not
				// podman's or CRI-O's), CAP_SYS_ADMIN or a bind-mounted
				// /dev and no device cgroup the container reaches every
				// GPU: it declared them all, under policy.all_devices.
				b.claimAllOr(allSrc, allFix)
				break
			}
			b.note(what + ": claims only the GPUs it names (policy.privileged = \"declared\"), though it can open every GPU")
			// Engines add every host device node to a privileged container
			// (podman, containerd's CRI): the nodes say nothing about what it
			// asked for, so only the other sources name its GPUs. Only when
			// it is privileged and its device cgroup really allows every
			// device: CAP_SYS_ADMIN alone does not open a node the cgroup
			// denies, and the nodes of an unprivileged container (whatever
			// rule opens its device cgroup: `--device-cgroup-rule 'a 1:3 r'`)
			// were asked for one by one.
			b.privilegedNodes = req.Privileged && req.AllDevicesAllowed
		}
	}
	b.env(req.Env)
	b.mounts(req.Mounts)
	b.specDevices = req.Devices
	b.annotations(req.Annotations)
	b.cdiList(req.CDIDevices, cdiByEngine)
	b.cdiList(req.LateCDIDevices, cdiByPlugin)
	b.linuxDevices(req.Devices)
	b.capsRules(req)
	b.finish(req.Privileged, req.SysAdmin)
	if len(b.errs) > 0 {
		if b.dropped > 0 {
			b.errs = append(b.errs, fmt.Errorf("… and %d more problems", b.dropped))
		}
		return Resolution{}, errors.Join(b.errs...)
	}
	sort.Slice(b.found, func(i, j int) bool { return b.found[i].UUID < b.found[j].UUID })
	return Resolution{Devices: b.found, All: b.all, Privileged: req.Privileged || req.GPUNodesAllowed, Notes: b.notes}, nil
}

const srcPrivileged = "privileged"

// srcGPURule is the source of the GPUs an unprivileged container's device
// cgroup lets it open all at once (c 195:*, or a rule for every device).
const srcGPURule = "device cgroup rule opening every GPU node"

// srcNoDeviceCgroup is the source of the GPUs a container reaches because no
// device cgroup stops it (Request.NoDeviceCgroup).
const srcNoDeviceCgroup = "no device cgroup (host /dev bound in, or CAP_MKNOD or CAP_SYS_ADMIN)"

// nodesCause says, of a container without a device cgroup that opens every
// GPU only through device nodes its root filesystem (Request.ImageNodes)
// and the directories bound in (Request.NodeDirs) may hold, what it is, the
// source of its claims and what to do. The first directory is named (each
// path bounded, quoted where it is not plain), the others counted.
//
// The remedy is what stops the nodes under the runtime that mounts them:
// container storage mounted nodev where the runtime keeps that nodev
// (runc, a read-write root; runc or crun, a container with a user
// namespace of its own); a read-write root under runc, which drops a
// read-only root's nodev; under crun, which drops it for every root
// outside a user namespace, a device cgroup, runc, or a user namespace. A
// bind source on a nodev mount whose nodev the runtime drops
// (NodeDir.NodevDropped) needs the bind's own nodev option, not a nodev
// mount it already has; a mount below a recursive bind (NodeDir.Below) its
// own nodev or the bind's rnodev, not the bind's nodev, which makes only
// the top mount nodev; and where the bind says dev or rdev
// (NodeDir.Clears), those must go first.
func nodesCause(req Request) (what, src, fix string) {
	var whats, srcs, fixes []string
	if req.ImageNodes {
		w, s, f := rootCause(req)
		whats, srcs, fixes = append(whats, w), append(srcs, s), append(fixes, f)
	}
	if len(req.NodeDirs) > 0 {
		more := ""
		switch n := len(req.NodeDirs) - 1; {
		case n == 1:
			more = " (and 1 more directory)"
		case n > 1:
			more = fmt.Sprintf(" (and %d more directories)", n)
		}
		w, s, f := dirCause(req.NodeDirs[0], more)
		whats, srcs, fixes = append(whats, w), append(srcs, s), append(fixes, f)
	}
	return "container without a device cgroup " + strings.Join(whats, " and "),
		"no device cgroup (" + strings.Join(srcs, "; ") + ")",
		"run it in a device cgroup of its own (cgroups enabled), or " + strings.Join(fixes, ", and ") + ", and name its GPUs"
}

// dirOpens is what a directory whose nodes open lets through.
const dirOpens = " (a device node in it, a GPU's among them, opens)"

// dirCause is nodesCause's what, source and remedy for the directory d,
// more counting the others.
func dirCause(d NodeDir, more string) (what, src, fix string) {
	path, at := plainText(d.Path), plainText(d.BoundAt)
	switch {
	case d.Overlay:
		return "whose overlay at " + at + " is not mounted nodev (a device node in its layer " + path + more +
				", a GPU's among them, opens)",
			"overlay at " + at + " not mounted nodev: the device nodes of its layer " + path + more + " open",
			"give the overlay at " + at + " the nodev option"
	case d.Below != "":
		return belowCause(d, path, at, more)
	}
	// The bind's own nodev option helps once what clears it is gone.
	nodevOption := "give the bind of " + path + " the nodev option"
	if len(d.Clears) > 0 {
		nodevOption = "drop " + strings.Join(d.Clears, " and ") + " from the bind of " + path + " and give it the nodev option"
	}
	switch {
	case d.NodevDropped:
		what = "whose bind source " + path + " (at " + at + ")" + more + " is on a nodev mount whose nodev its bind does not keep " +
			"(crun remounts every bind without it, runc a bind with flag options such as ro or dev), bound without nodev" + dirOpens
		src = "bind source " + path + more + " bound without nodev: its mount's nodev not kept, its device nodes open"
		fix = nodevOption + " (the nodev of its mount does not carry over)"
	case len(d.Clears) > 0:
		what = "whose bind source " + path + " (at " + at + ")" + more + " is on a mount that is not nodev, bound with " +
			strings.Join(d.Clears, " and ") + dirOpens
		src = "bind source " + path + more + " not mounted nodev: its device nodes open"
		fix = nodevOption + " (while its bind says " + strings.Join(d.Clears, " or ") + ", mounting " + path + " nodev does not help)"
	default:
		what = "whose bind source " + path + " (at " + at + ")" + more + " is on a mount that is not nodev, bound without nodev" + dirOpens
		src = "bind source " + path + more + " not mounted nodev: its device nodes open"
		fix = "mount " + path + " nodev or give its bind the nodev option"
	}
	return what, src, fix
}

// belowCause is dirCause for a mount below a recursive bind (d.Below): it
// keeps its own flags there, but for the bind's rnodev and rdev, which
// reach it; the bind's nodev and dev make only the bind's top mount nodev,
// or not. Its Clears can only be rdev.
func belowCause(d NodeDir, path, at, more string) (what, src, fix string) {
	bind := plainText(d.Below)
	if d.NodevDropped {
		return "whose mount " + path + " (at " + at + ")" + more + ", below the bind source " + bind +
				", is nodev, but the bind's rdev clears that" + dirOpens,
			"mount " + path + more + " below bind source " + bind + ": its nodev cleared by the bind's rdev, its device nodes open",
			"drop rdev from the bind of " + bind
	}
	what = "whose mount " + path + " (at " + at + ")" + more + ", below the bind source " + bind + ", is not nodev" + dirOpens
	src = "mount " + path + more + " below bind source " + bind + " not mounted nodev: its device nodes open"
	fix = "mount " + path + " nodev or give the bind of " + bind + " the rnodev option (its nodev makes only its top mount nodev)"
	if len(d.Clears) > 0 {
		fix = "drop rdev from the bind of " + bind + ", then mount " + path + " nodev or give that bind the rnodev option"
	}
	return what, src, fix
}

// storageNodev is container storage mounted nodev, and how.
const storageNodev = "container storage mounted nodev (containers/storage: mountopt = \"nodev\" in storage.conf)"

// userNSKeeps is the remedy of a root whose runtime drops the nodev of its
// storage outside a user namespace of the container's own: runc and crun
// keep it inside one, where the kernel locks it.
const userNSKeeps = "a user namespace of its own under runc or crun (podman --userns=auto or --uidmap: " +
	"the kernel then locks the nodev of its storage)"

// rootCause is nodesCause's what, source and remedy for the root
// filesystem (Request.ImageNodes), by what the runtime makes of the nodev
// of its mount (Request.RootNodev) and whether that mount is nodev
// (Request.RootStorageNodev).
func rootCause(req Request) (what, src, fix string) {
	const opens = " (a device node its image carries, a GPU's among them, opens)"
	what = "whose root filesystem is not mounted nodev"
	src = "root filesystem not mounted nodev: its image's device nodes open"
	switch req.RootNodev {
	case RootNodevDroppedByRuntime:
		if req.RootStorageNodev {
			what = "whose root filesystem, on container storage mounted nodev, its runtime mounts without nodev " +
				"(crun does so for every root and runc for a read-only one, except in a user namespace of the container's own; " +
				"the runtime is not known to be runc)"
			src = "root filesystem's nodev dropped by a runtime not known to be runc: its image's device nodes open"
			fix = "run it under runc with a read-write root, or give it " + userNSKeeps
		} else {
			what += ", nor would its runtime keep it so (crun does only in a user namespace of the container's own, " +
				"runc also for a read-write root; the runtime is not known to be runc)"
			fix = "run it under runc with a read-write root on " + storageNodev + ", or on such storage give it " + userNSKeeps
		}
	case RootNodevDroppedReadOnly:
		if req.RootStorageNodev {
			what = "whose read-only root filesystem runc remounts without the nodev of its storage"
			src = "read-only root filesystem remounted without nodev by runc: its image's device nodes open"
			fix = "give it a read-write root (runc keeps the nodev of its storage there), or " + userNSKeeps
		} else {
			what += " (and is read-only, which runc remounts without nodev)"
			fix = "give it a read-write root on " + storageNodev + ", or on such storage " + userNSKeeps
		}
	default:
		fix = "mount the container storage nodev (containers/storage: mountopt = \"nodev\" in storage.conf)"
	}
	return what + opens, src, fix
}

// builder accumulates one resolution.
type builder struct {
	ix     *index
	policy config.PolicyConfig
	capsMj int64
	// capsUnknown: the inventory lists MIG instances but not the
	// nvidia-caps major, so any node or rule of a dynamic major may open a
	// MIG capability (see linuxDevices, capsRules).
	capsUnknown bool
	found       []Resolved
	// slot maps an entry position to its index in found, plus one; it is
	// allocated on first use so requests that name nothing cost nothing.
	slot    []int
	all     bool
	notes   []string
	errs    []error
	dropped int
	tokens  int
	full    bool // MaxRequestTokens reached: stop reading
	// nodes are GPUs reached through /dev/nvidia<N>; giCaps are GPU-instance
	// capability nodes. Both are settled in finish, once every MIG instance
	// the request names is known.
	nodes        []pending
	giCaps       []pending
	unmappedCaps bool
	// specDevices are the request's device nodes, read by cdiName only
	// (hasGPUNode: an engine's CDI injection adds GPU nodes) for the rare
	// request that needs it, not for every request.
	specDevices []LinuxDevice
	// privilegedNodes: the request is privileged under "declared", so its
	// GPU and MIG capability device nodes are not a request (skipped counts
	// them for the note).
	privilegedNodes bool
	skipped         int
	// incomplete says why the inventory may lack GPUs the host has, or
	// name them by other UUIDs (see Inventory.Undiscovered, UnlistedGPUs
	// and Unchecked); empty when it lists them.
	incomplete string
	// noMIGs says why the inventory lists no MIG instance though the host
	// may have some ("" when it may list them): /proc has no MIG UUIDs, and
	// a static list that names none may simply leave them out. A MIG id it
	// lacks may then still name one the runtime selects (see missing).
	noMIGs string
}

type pending struct {
	pos int // GPU entry for nodes; any MIG entry of the GPU instance for giCaps
	src string
}

// emptyIndex backs resolvers over a nil or zero inventory: they resolve
// every id as unknown.
var emptyIndex = func() *index {
	ix, err := buildIndex(&Inventory{Source: "none"})
	if err != nil {
		panic(err) // an empty inventory is always valid
	}
	return ix
}()

func (r *Resolver) newBuilder() *builder {
	b := &builder{ix: emptyIndex, policy: r.policy}
	if r.inv != nil && r.inv.idx != nil {
		b.ix = r.inv.idx
		b.capsMj = r.inv.CapsMajor
		b.capsUnknown = b.capsMj == 0 && listsMIG(r.inv)
		switch {
		case r.inv.Undiscovered:
			b.incomplete = "no GPU discovery source works yet"
		case r.inv.UnlistedGPUs > 0:
			b.incomplete = fmt.Sprintf("it lists none of the %d NVIDIA GPU(s) on the PCI bus", r.inv.UnlistedGPUs)
		case r.inv.Unchecked == UncheckedUUIDs:
			// The list matched the driver by minor and index: a GPU
			// the list names by a wrong UUID (a card replaced) would
			// otherwise be ignored by its real one, and reached
			// unclaimed.
			b.incomplete = "it is [[devices.static]], whose UUIDs are not checked yet: the driver does not show every GPU's UUID " +
				"(enable persistence mode, nvidia-smi -pm 1)"
		}
		switch {
		case r.inv.Source == string(config.SourceProc):
			b.noMIGs = "the GPU inventory (devices.source = \"proc\") cannot list MIG instances"
		case r.inv.Source == string(config.SourceStatic) && !listsMIG(r.inv):
			b.noMIGs = "the GPU inventory ([[devices.static]]) lists no MIG instance"
		case r.inv.Source == string(config.SourceStatic):
			// The MIG instances a list names are never checked against
			// the driver (its /proc tree shows none), and one created
			// since is not in it.
			b.noMIGs = "the GPU inventory ([[devices.static]]) lists MIG instances unchecked against the driver"
		}
	}
	return b
}

// listsMIG reports whether inv lists a MIG instance of any GPU.
func listsMIG(inv *Inventory) bool {
	for _, g := range inv.GPUs {
		if len(g.MIG) > 0 {
			return true
		}
	}
	return false
}

// missing handles an id the inventory lacks, as unresolved does, except a
// MIG id on an inventory that cannot list MIG instances: the instance may
// well exist, and NVIDIA's runtime selects it, so the id is no unknown one
// a policy may ignore. Where it names its parent GPU (<gpu>:<mig>, the
// legacy MIG-GPU-<uuid>/<gi>/<ci>), that GPU is claimed whole, which
// covers any of its instances; a MIG UUID names no parent, and is refused
// under every policy.
func (b *builder) missing(where, src string, e *idError) {
	if b.noMIGs == "" || !e.mig || e.strict {
		b.unresolved(where, e)
		return
	}
	why := b.noMIGs
	if e.migParent > 0 {
		gpu := b.ix.ents[e.migParent-1].dev
		b.note(fmt.Sprintf("%s: %s: GPU %s (%s) is claimed whole for MIG instance %s", src, why, gpu.Index, gpu.UUID, quoteToken(e.token)))
		b.add(e.migParent-1, src)
		return
	}
	b.fail(advised(fmt.Errorf("%s: %w: %s, so which GPU it belongs to is not known (policy.unknown_device does not apply); "+
		"use devices.source = \"nvml\", list the MIG instances under [[devices.static]], or name the MIG instance as <gpu>:<mig>", where, e, why)))
}

func (b *builder) fail(err error) {
	if len(b.errs) >= maxReported {
		b.dropped++
		return
	}
	b.errs = append(b.errs, err)
}

func (b *builder) note(s string) {
	switch {
	case len(b.notes) < maxReported:
		b.notes = append(b.notes, s)
	case len(b.notes) == maxReported:
		b.notes = append(b.notes, "… more notes omitted")
	}
}

// spend counts one token against MaxRequestTokens; false once exhausted.
func (b *builder) spend(where string) bool {
	if b.full {
		return false
	}
	b.tokens++
	if b.tokens > MaxRequestTokens {
		b.full = true
		b.fail(fmt.Errorf("%s: %w: the request names more than %d devices, ids, mounts and device nodes in all", where, ErrTooLarge, MaxRequestTokens))
		return false
	}
	return true
}

// add records that src names the device at entry position pos.
func (b *builder) add(pos int, src string) {
	if b.slot == nil {
		b.slot = make([]int, len(b.ix.ents))
	}
	if s := b.slot[pos]; s > 0 {
		r := &b.found[s-1]
		for _, have := range r.Sources {
			if have == src {
				return
			}
		}
		r.Sources = append(r.Sources, src)
		return
	}
	b.found = append(b.found, Resolved{Device: b.ix.ents[pos].dev, Sources: []string{src}})
	b.slot[pos] = len(b.found)
}

func (b *builder) has(pos int) bool { return b.slot != nil && b.slot[pos] > 0 }

// unresolved applies policy.unknown_device to an id the inventory lacks; a
// strict error (malformed or ambiguous id) is refused under every policy,
// and so is any unknown id while the inventory is incomplete: the id may
// name a GPU it does not list, which NVIDIA's runtime selects once the
// driver is up.
func (b *builder) unresolved(where string, e *idError) {
	if e.strict {
		err := fmt.Errorf("%s: %w; fix the id (policy.unknown_device = \"ignore\" does not apply: NVIDIA's runtime may read it as a GPU)", where, e)
		if e.advises {
			err = advised(err)
		}
		b.fail(err)
		return
	}
	if b.incomplete != "" && b.policy.UnknownDevice == config.UnknownIgnore {
		b.fail(fmt.Errorf("%s: %w (policy.unknown_device = \"ignore\" does not apply: the GPU inventory is incomplete, %s; "+
			"nri-gpu-guard retries the discovery by itself)", where, e, b.incomplete))
		return
	}
	if b.policy.UnknownDevice == config.UnknownIgnore {
		b.note(where + ": ignored " + e.Error() + " (policy.unknown_device = \"ignore\")")
		return
	}
	b.fail(advised(fmt.Errorf("%s: %w; name a GPU of this host or set policy.unknown_device = \"ignore\"", where, e)))
}

// fixByUUID is what claimAll's refusal tells the user to do.
const fixByUUID = "name the GPUs the container needs by UUID instead"

// claimAll handles a request for every GPU under policy.all_devices.
func (b *builder) claimAll(src string) { b.claimAllOr(src, fixByUUID) }

// claimAllOr is claimAll with what the refusal under all_devices = "reject"
// tells the user to do.
func (b *builder) claimAllOr(src, fix string) {
	if src != srcPrivileged {
		switch b.policy.AllDevices {
		case config.AllReject:
			b.fail(advised(fmt.Errorf("%s: %w (policy.all_devices = \"reject\"); %s", src, ErrAllRejected, fix)))
			return
		case config.AllIgnore:
			b.note(src + ": ignored (policy.all_devices = \"ignore\")")
			return
		}
	}
	b.all = true
	for _, pos := range b.ix.gpuEnts {
		b.add(pos, src)
	}
}

// item is one id with where it came from: where prefixes errors, src is the
// source recorded on the device.
type item struct {
	tok, where, src string
}

// list applies the NVIDIA_VISIBLE_DEVICES rules to one list of ids: "void"
// anywhere or no id at all means no GPU; otherwise the first "all" or "none"
// decides ("0,all" is all); otherwise each id is resolved. "all" is matched
// case-insensitively because the NVIDIA runtime's device selection does so.
//
// fromMounts applies the volume-mount rules instead: NVIDIA's runtime hands
// the mounted ids on as they are, with no "void" or "none" keyword, and its
// device selection takes every GPU at an "all" (any case) wherever it
// stands; so "all" anywhere is all, and every other id is resolved.
func (b *builder) list(where string, items []item, fromMounts bool) {
	if fromMounts {
		for _, it := range items {
			if strings.EqualFold(it.tok, "all") {
				b.claimAll(it.src)
				return
			}
		}
		b.resolveItems(items, true)
		return
	}
	if len(items) == 0 {
		b.note(where + ": empty: no GPU")
		return
	}
	for _, it := range items {
		if it.tok == "void" {
			b.note(it.where + ": \"void\": no GPU")
			return
		}
	}
	for _, it := range items {
		if strings.EqualFold(it.tok, "all") {
			b.claimAll(it.src)
			return
		}
		if it.tok == "none" {
			b.note(it.where + ": \"none\": no GPU")
			return
		}
	}
	b.resolveItems(items, false)
}

// resolveItems resolves each id of a list.
func (b *builder) resolveItems(items []item, fromMounts bool) {
	for _, it := range items {
		switch {
		case !fromMounts && it.tok == MountRoot:
			// The device plugin's volume-mount strategy sets
			// NVIDIA_VISIBLE_DEVICES to MountRoot: the ids are the
			// mounts, read on their own. NVIDIA's runtime selects no GPU
			// by this value (it is no id of any form).
			b.note(it.where + ": " + quoteToken(it.tok) + ": the device list is in the volume mounts")
			continue
		case fromMounts && (it.tok == "void" || it.tok == "none"):
			b.unresolved(it.where, invalid(it.tok, "\"void\" and \"none\" are no keywords in a volume mount: NVIDIA's runtime takes them for device ids and fails"))
			continue
		}
		if strings.Contains(it.tok, "/") && strings.Contains(it.tok, "=") {
			// A qualified CDI name (nvidia.com/gpu=1): in its CDI mode
			// NVIDIA's runtime takes it from NVIDIA_VISIBLE_DEVICES (and
			// from a volume mount) as it would from an annotation.
			b.cdiName(it.where, it.src, it.tok, cdiByRuntime)
			continue
		}
		pos, err := b.ix.resolveID(it.tok)
		if err != nil {
			b.missing(it.where, it.src, err)
			continue
		}
		b.add(pos, it.src)
	}
}

// splitValue splits a comma-separated value into trimmed, non-empty ids,
// enforcing the size bounds.
func (b *builder) splitValue(where, value string, buf []item, mk func(tok string) item) ([]item, bool) {
	if len(value) > MaxValueBytes {
		b.fail(fmt.Errorf("%s: %w: value is %d bytes, more than %d", where, ErrTooLarge, len(value), MaxValueBytes))
		return nil, false
	}
	out := buf[:0]
	for rest := value; ; {
		tok, after, more := strings.Cut(rest, ",")
		if tok = strings.TrimSpace(tok); tok != "" {
			if len(out) == MaxValueTokens {
				b.fail(fmt.Errorf("%s: %w: more than %d ids", where, ErrTooLarge, MaxValueTokens))
				return nil, false
			}
			if !b.spend(where) {
				return nil, false
			}
			out = append(out, mk(tok))
		}
		if !more {
			return out, true
		}
		rest = after
	}
}

// env reads NVIDIA_VISIBLE_DEVICES and DOCKER_RESOURCE_GPU; for each the last
// occurrence wins, as it does for the runtime. NVIDIA_VISIBLE_DEVICES unset
// on a legacy CUDA image (CUDA_VERSION set, NVIDIA_REQUIRE_CUDA unset or
// empty: built before CUDA 9) means every GPU to NVIDIA's runtime, and so it
// does here (under policy all_devices), whatever DOCKER_RESOURCE_GPU says:
// the runtime reads that variable only when configured to (swarm-resource,
// unset by default), and then in place of NVIDIA_VISIBLE_DEVICES; which of
// the two it reads is not known here, so the union is claimed.
//
// The further names of policy.swarm_resource_envvars (the runtime's
// swarm-resource setting) are read the same way, and claimed in the union
// too.
func (b *builder) env(env []string) {
	var nvd, drg, cudaVersion, requireCUDA string
	var hasNVD, hasDRG bool
	swarm := b.policy.SwarmResourceEnvvars
	var swarmVals []string // by position in swarm; "" with swarmSet false: unset
	var swarmSet []bool
	for _, kv := range env {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			continue
		}
		switch k {
		case EnvVisibleDevices:
			nvd, hasNVD = v, true
		case EnvDockerResourceGPU:
			drg, hasDRG = v, true
		case envCUDAVersion:
			cudaVersion = v
		case envRequireCUDA:
			requireCUDA = v
		default:
			for i, name := range swarm {
				if k == name {
					if swarmVals == nil {
						swarmVals, swarmSet = make([]string, len(swarm)), make([]bool, len(swarm))
					}
					swarmVals[i], swarmSet[i] = v, true
				}
			}
		}
	}
	var buf [8]item
	if hasNVD {
		b.envVar(EnvVisibleDevices, nvd, buf[:])
	} else if cudaVersion != "" && requireCUDA == "" {
		b.claimAll("env " + EnvVisibleDevices + " unset on a legacy CUDA image (CUDA_VERSION=" + quoteToken(cudaVersion) + ", no NVIDIA_REQUIRE_CUDA)")
	}
	if hasDRG {
		b.envVar(EnvDockerResourceGPU, drg, buf[:])
	}
	for i, set := range swarmSet {
		if set {
			b.envVar(plainText(swarm[i]), swarmVals[i], buf[:])
		}
	}
}

func (b *builder) envVar(name, value string, buf []item) {
	where := "env " + name
	items, ok := b.splitValue(where, value, buf, func(tok string) item {
		return item{tok: tok, where: where, src: where + "=" + quoteToken(tok)}
	})
	if ok {
		b.list(where, items, false)
	}
}

// mounts reads the volume-mount strategy: MountRoot/<id> (the mount rules of
// list over all such mounts) and MountRoot/cdi/<qualified CDI name>. NVIDIA's
// runtime joins the mounted ids with commas into one device list, and its
// device selection skips blanks before an index: so an id is split at
// commas and trimmed ("0,1" is GPUs 0 and 1, " 3" is GPU 3).
func (b *builder) mounts(dests []string) {
	var items []item
	seen := false
	for _, d := range dests {
		if !strings.Contains(d, "nvidia-container-devices") {
			continue // fast path: nothing else is a device request
		}
		where := "mount " + plainText(d)
		if len(d) > MaxValueBytes {
			b.fail(fmt.Errorf("mount %s: %w: destination is %d bytes, more than %d", quoteToken(d), ErrTooLarge, len(d), MaxValueBytes))
			continue
		}
		id, cdi, relevant, why := mountID(d)
		if !relevant {
			continue
		}
		if why != "" || cdi {
			if !b.spend(where) {
				return
			}
		}
		if why != "" {
			// Not subject to policy.unknown_device: a mangled path is
			// evasion, not a stale id.
			b.fail(fmt.Errorf("%s: %w %s: %s", where, ErrInvalidID, quoteToken(d), why))
			continue
		}
		if cdi {
			b.cdiName(where, where, id, cdiByRuntime)
			continue
		}
		toks, ok := b.splitValue(where, id, nil, func(tok string) item {
			return item{tok: tok, where: where, src: where}
		})
		if b.full {
			return
		}
		if ok {
			seen = true
			items = append(items, toks...)
		}
	}
	if seen {
		b.list("mounts "+MountRoot, items, true)
	}
}

// mountID extracts the device id from a volume-mount destination. NVIDIA's
// runtime reads every destination that starts with MountRoot (no "/"
// needed after it) as a request for what follows, with slashes trimmed; so
// every such destination is relevant here. One of the form MountRoot/<id>
// (the id may hold slashes: the legacy MIG-GPU-<uuid>/<gi>/<ci>), or
// MountRoot/cdi/<vendor>/<class>/<device> (the runtime's form) or
// MountRoot/cdi/<vendor>/<class>=<device>, is read; any other (a neighbour
// such as MountRoot+"0", "..", ".", empty components, a trailing slash)
// could make the guard and the runtime read different ids and is refused
// (why). IMEX channels (MountRoot/imex/...) are no GPU request.
func mountID(dest string) (id string, cdi, relevant bool, why string) {
	clean := path.Clean(dest)
	if !strings.HasPrefix(dest, MountRoot) && !strings.HasPrefix(clean, MountRoot) {
		return "", false, false, ""
	}
	if dest != clean || !strings.HasPrefix(dest, MountRoot+"/") {
		return "", false, true, "not a clean path of the form " + MountRoot + "/<id> (no \"..\", \".\", \"//\" or trailing \"/\")"
	}
	rest := dest[len(MountRoot)+1:]
	if strings.HasPrefix(rest, "imex/") {
		return "", false, false, ""
	}
	if name, ok := strings.CutPrefix(rest, "cdi/"); ok {
		parts := strings.SplitN(name, "/", 3)
		switch {
		case len(parts) == 2 && strings.Contains(parts[1], "="):
			return name, true, true, ""
		case len(parts) == 3 && !strings.Contains(parts[1], "=") && parts[2] != "":
			return parts[0] + "/" + parts[1] + "=" + parts[2], true, true, ""
		}
		return "", false, true, "want " + MountRoot + "/cdi/<vendor>/<class>/<device> or " + MountRoot + "/cdi/<vendor>/<class>=<device>"
	}
	return rest, false, true, ""
}

// annotations reads cdi.k8s.io/* and nvidia.cdi.k8s.io/* annotations, in key
// order so that sources and errors are deterministic.
func (b *builder) annotations(ann map[string]string) {
	var keys []string
	for k := range ann {
		if strings.HasPrefix(k, CDIAnnotationPrefix) || strings.HasPrefix(k, NvidiaCDIAnnotationPrefix) {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	var buf [8]item
	for _, k := range keys {
		where := "annotation " + plainText(k)
		items, ok := b.splitValue(where, ann[k], buf[:], func(tok string) item {
			return item{tok: tok, where: where, src: where + "=" + quoteToken(tok)}
		})
		if !ok {
			continue
		}
		// The engine injects what cdi.k8s.io/* names before the check,
		// where it has CDI enabled, and NVIDIA's runtime in CDI mode after
		// it otherwise; NVIDIA's NRI plugin and its runtime in CDI mode
		// inject what nvidia.cdi.k8s.io/* names after it, where its nodes
		// are never seen.
		by := cdiByAnnotation
		if strings.HasPrefix(k, NvidiaCDIAnnotationPrefix) {
			by = cdiByNvidia
		}
		for _, it := range items {
			b.cdiName(it.where, it.src, it.tok, by)
		}
	}
}

// cdiList reads the container's CDI device list (containerd ≥ 2.3), or
// (cdiByPlugin) the CDI devices another NRI plugin adds, which containerd
// injects after every plugin has answered.
func (b *builder) cdiList(names []string, by cdiInjector) {
	for _, n := range names {
		where := "CDI device " + quoteToken(n)
		if len(n) > MaxValueBytes {
			b.fail(fmt.Errorf("CDI device %s: %w: name is %d bytes, more than %d", quoteToken(n), ErrTooLarge, len(n), MaxValueBytes))
			continue
		}
		if !b.spend(where) {
			return
		}
		b.cdiName("CDI device", "cdi "+quoteToken(n), strings.TrimSpace(n), by)
	}
}

// cdiInjector is who injects the devices of a CDI name, which decides what
// the guard can see of them.
type cdiInjector int

const (
	// cdiByEngine: the engine injects them before the check (annotations,
	// the CRI's CDI device list): their device nodes are in the spec the
	// guard checks, and a GPU node among them is caught by its numbers.
	cdiByEngine cdiInjector = iota
	// cdiByRuntime: NVIDIA's runtime in its CDI mode injects them after
	// the check, from a name in NVIDIA_VISIBLE_DEVICES or a volume mount,
	// which the container's creator writes.
	cdiByRuntime
	// cdiByPlugin: containerd injects them after every NRI plugin has
	// answered, from another plugin's adjustment (devices.Request.
	// LateCDIDevices), an operator-installed plugin's choice.
	cdiByPlugin
	// cdiByNvidia: NVIDIA's NRI plugin (the pod annotation
	// nvidia.cdi.k8s.io/container.<name>) or its runtime in CDI mode
	// injects them after the check, from a nvidia.cdi.k8s.io/* annotation,
	// which the pod's creator writes. Like cdiByPlugin, every name is
	// injected, whatever its vendor and class, and its nodes are never seen.
	cdiByNvidia
	// cdiByAnnotation: a cdi.k8s.io/* annotation. An engine with CDI
	// enabled injects its devices before the check (containerd with
	// enable_cdi, CRI-O); NVIDIA's runtime in CDI mode, whose
	// annotation-prefixes are cdi.k8s.io/ by default, injects them after
	// it where the engine does not (containerd before 2.0 by default).
	cdiByAnnotation
)

// cgroupRuleNode is the path of a GPU node a device cgroup rule opens
// without the spec listing it (see ApplyDeviceRules).
const cgroupRuleNode = "(device cgroup rule)"

// hasGPUNode reports whether devs holds a GPU device node of the spec's own
// (not one a device cgroup rule opens, nor a bind-mounted host node).
func hasGPUNode(devs []LinuxDevice) bool {
	for _, d := range devs {
		if d.Path == cgroupRuleNode || d.BoundAt != "" || (d.Type != "" && d.Type != "c" && d.Type != "u") {
			continue
		}
		if major, minor, _ := nodeNumbers(d); major == nvidiaMajor && minor >= 0 && minor <= gpuid.MaxGPUMinor {
			return true
		}
	}
	return false
}

// cdiName resolves one qualified CDI device name; only the gpu and mig
// classes of NVIDIA's vendors are GPUs (isGPUClass), and any device of the
// management spec is all of them.
//
// Another vendor's or class's device injected by the engine is no GPU: its
// nodes are seen. Injected later, its nodes are never seen, and the guard
// cannot tell its GPUs from the name (the DRA driver's
// k8s.gpu.nvidia.com/device=gpu-0 is GPU 0): a name the container's creator
// wrote for NVIDIA's runtime is refused under every policy (no other use of
// such a name is known); one another NRI plugin added is refused when its
// vendor is NVIDIA's (nvidia.com or a subdomain of it) and no GPU
// otherwise, since plugins add other vendors' devices (NICs, FPGAs) to
// ordinary containers and their specs are the operator's. A name in a
// nvidia.cdi.k8s.io annotation is read as one a plugin added: NVIDIA's NRI
// plugin injects it late as well, and another vendor's device there is no
// GPU for the same reason.
//
// A cdi.k8s.io annotation's name is injected by the engine or, late, by
// NVIDIA's runtime (cdiByAnnotation). Its engine adds a GPU's device nodes
// before the check, where they are claimed; so an NVIDIA name the guard
// cannot resolve that may denote GPUs (namesGPUs: the DRA driver's
// k8s.gpu.nvidia.com, a gpu or mig class) is refused when the spec lists no
// GPU device node, the case where it can only be injected late. Where the
// spec lists one, an engine may have injected the name's GPUs, or they came
// from elsewhere (a device plugin) and the name's are injected late: which
// GPUs it adds cannot be told, so it reaches every GPU (under
// policy.all_devices). NVIDIA's names for other devices (a NIC's VF, IMEX
// channels, GDRCopy) inject no GPU whoever injects them.
func (b *builder) cdiName(where, src, qualified string, by cdiInjector) {
	vendor, class, name, ok := parseQualifiedName(qualified)
	if !ok {
		b.unresolved(where, invalid(qualified, "want a qualified CDI device name <vendor>/<class>=<name>"))
		return
	}
	if vendor == cdiVendorManagement {
		const why = "a management.nvidia.com device injects every GPU device node: run GPU monitoring and management agents in a namespace listed in policy.exempt_namespaces (NRI only: a container the OCI hook checks is never exempt)"
		b.note(src + ": " + why)
		b.claimAllOr(src, why)
		return
	}
	if !isGPUClass(vendor, class) {
		switch {
		case by == cdiByRuntime:
			b.unresolved(where, invalid(qualified, "NVIDIA's runtime injects the CDI device a name here denotes after the guard's check, "+
				"and only nvidia.com/gpu and nvidia.com/mig names say which GPUs: name the GPUs as nvidia.com/gpu=<index|UUID|all>, "+
				"or request other CDI devices through the CRI's CDI devices (podman: --device VENDOR/CLASS=NAME), or CDI annotations where the engine has CDI enabled, "+
				"which the engine injects before the check").advising())
		case by == cdiByPlugin && nvidiaVendor(vendor):
			b.unresolved(where, invalid(qualified, "an NRI plugin added this NVIDIA CDI device, which containerd injects after the guard's check, "+
				"and only nvidia.com/gpu and nvidia.com/mig names say which GPUs: have the plugin name GPUs that way, "+
				"or request the device in the container's own spec").advising())
		case by == cdiByAnnotation && nvidiaVendor(vendor) && namesGPUs(vendor, class) && hasGPUNode(b.specDevices):
			why := "an NVIDIA CDI device whose GPUs the guard cannot tell: an engine with CDI enabled injected it, or NVIDIA's runtime in CDI mode " +
				"injects it after the check; name the GPUs as nvidia.com/gpu=<index|UUID|all>"
			b.note(src + ": " + why + "; it is read as reaching every GPU")
			b.claimAllOr(src, why)
		case by == cdiByAnnotation && nvidiaVendor(vendor) && namesGPUs(vendor, class):
			b.unresolved(where, invalid(qualified, "NVIDIA's runtime in CDI mode injects the CDI devices a "+CDIAnnotationPrefix+"* annotation names after the guard's check "+
				"where the engine does not (containerd before 2.0: enable_cdi = false by default); this container lists no GPU device node, so no engine injected it, "+
				"and only nvidia.com/gpu and nvidia.com/mig names say which GPUs: name the GPUs as nvidia.com/gpu=<index|UUID|all>, "+
				"or have the engine inject the device before the check (containerd: enable_cdi = true; the CRI's CDI devices, as DRA and the device plugin's cdi-cri strategy use)").advising())
		case by == cdiByNvidia && nvidiaVendor(vendor):
			b.unresolved(where, invalid(qualified, "NVIDIA's NRI plugin (or its runtime in CDI mode) injects the CDI devices a "+NvidiaCDIAnnotationPrefix+"* annotation names "+
				"after the guard's check, and only nvidia.com/gpu and nvidia.com/mig names say which GPUs: name the GPUs as nvidia.com/gpu=<index|UUID|all>, "+
				"or request other NVIDIA CDI devices through the CRI's CDI devices, or "+CDIAnnotationPrefix+"* annotations where the engine has CDI enabled, "+
				"which the engine injects before the check").advising())
		}
		return
	}
	pos, all, err := b.ix.resolveCDIName(name)
	switch {
	case err != nil:
		b.missing(where, src, reToken(err, qualified))
	case all:
		b.claimAll(src)
	default:
		b.add(pos, src)
	}
}

const capsPathPrefix = "/dev/nvidia-caps/nvidia-cap"

// capsMajorUnknown says why a node or rule of a dynamic major may be a MIG
// capability.
const capsMajorUnknown = "the GPU inventory lists MIG instances but not the nvidia-caps major: is /proc/devices readable under devices.proc_root?"

// Device numbers as the kernel keeps them: a 12-bit major and a 20-bit
// minor, packed into the 32-bit number mknod(2) takes.
const (
	kernelMajorBits = 12
	kernelMinorBits = 20
)

// MadeNumbers returns the numbers of the node a runtime makes for a
// linux.devices entry of major and minor. The spec's numbers are int64;
// runc (unix.Mkdev of their uint32 truncations) and crun (glibc's makedev,
// which takes unsigned ints) pack them as dev_t, and mknod(2) hands the
// kernel only its low 32 bits, where the major keeps 12 bits and the minor
// 20: runc makes c 4294967491:0, c -4294967101:0, c 4291:0 and
// c 195:1048576 all as 195:0, GPU 0. (glibc refuses a dev_t that does not
// fit 32 bits, so crun fails the last two: what it makes is still this.)
// Numbers the kernel can hold come back as they are, so this is the reading
// as written too wherever that denotes a node; a spec entry is read only
// this way, as the one node it can make.
func MadeNumbers(major, minor int64) (int64, int64) {
	return major & (1<<kernelMajorBits - 1), minor & (1<<kernelMinorBits - 1)
}

// nodeNumbers returns the major and minor of the node a device entry opens.
// When the caller gave none (0:0, as gpu-guard-ctl explain --device does),
// they come from the well-known path: /dev/nvidia<N> is 195:N. Numbers of a
// spec entry are read as the node the runtime makes of them (MadeNumbers);
// those of a bind-mounted host node are that node's own.
func nodeNumbers(d LinuxDevice) (major, minor int64, isCapPath bool) {
	major, minor = d.Major, d.Minor
	var capMinor int64
	if rest, ok := strings.CutPrefix(d.Path, capsPathPrefix); ok {
		if n, ok, big := decimal(rest); ok && !big {
			isCapPath, capMinor = true, int64(n)
		}
	}
	if major == 0 && minor == 0 {
		if rest, ok := strings.CutPrefix(d.Path, "/dev/nvidia"); ok {
			if n, ok, big := decimal(rest); ok && !big {
				major, minor = nvidiaMajor, int64(n)
			}
		}
		if isCapPath {
			minor = capMinor
		}
		return major, minor, isCapPath
	}
	if d.BoundAt == "" {
		major, minor = MadeNumbers(major, minor)
	}
	return major, minor, isCapPath
}

// nodeLabel is how a message shows the numbers of device entry d, which
// opens major:minor (nodeNumbers): the entry's numbers and the node's as
// well when the runtime makes the node of other numbers than the entry
// names.
func nodeLabel(d LinuxDevice, major, minor int64) string {
	if mj, mn := MadeNumbers(d.Major, d.Minor); d.BoundAt == "" && (mj != d.Major || mn != d.Minor) {
		return strconv.FormatInt(d.Major, 10) + ":" + strconv.FormatInt(d.Minor, 10) + ", made as " +
			strconv.FormatInt(mj, 10) + ":" + strconv.FormatInt(mn, 10)
	}
	return strconv.FormatInt(major, 10) + ":" + strconv.FormatInt(minor, 10)
}

// linuxDevices reads the spec's device nodes by the numbers of the node
// each makes (nodeNumbers): /dev/nvidia<minor> (195:0-253) names a GPU by
// its NVML minor number, and /dev/nvidia-caps/nvidia-cap<N> names a MIG
// instance where the capability mapping is known.
func (b *builder) linuxDevices(devs []LinuxDevice) {
	for _, d := range devs {
		if d.Type != "" && d.Type != "c" && d.Type != "u" {
			continue // only character devices can be GPUs
		}
		major, minor, isCapPath := nodeNumbers(d)
		if isCapPath && major == 0 && b.capsMj != 0 {
			major = b.capsMj // path only: show the numbers the node has
		}
		src := "device " + plainText(d.Path) + " (" + nodeLabel(d, major, minor) + ")"
		if d.BoundAt != "" {
			src = "bind mount " + plainText(d.BoundAt) + " from " + plainText(d.Path) + " (" + nodeLabel(d, major, minor) + ")"
		}
		// The numbers decide what a node opens, never its name inside the
		// container: `--device /dev/nvidia0:/dev/nvidia-caps/nvidia-cap1`
		// is GPU 0. The capability path counts only when the numbers cannot
		// say (none given, or the nvidia-caps major is unknown).
		isCap := (b.capsMj != 0 && major == b.capsMj) || (isCapPath && (major == 0 || b.capsMj == 0))
		// With the major unknown, a node of any dynamic major may be a
		// capability under another name (`--device
		// /dev/nvidia-caps/nvidia-cap40:/dev/x`): which one, and so which
		// MIG instance it opens, cannot be told.
		maybeCap := !isCap && b.capsUnknown && major >= firstDynamicMajor
		if b.privilegedNodes && ((major == nvidiaMajor && minor >= 0 && minor <= gpuid.MaxGPUMinor) || isCap || maybeCap) {
			b.skipped++
			continue
		}
		switch {
		case major == nvidiaMajor:
			if minor < 0 || minor > gpuid.MaxGPUMinor {
				continue
			}
			if !b.spend(src) {
				return
			}
			pos, ok := b.ix.byMinor[int(minor)]
			if !ok {
				tok := strconv.FormatInt(major, 10) + ":" + strconv.FormatInt(minor, 10)
				b.unresolved(src, &idError{sentinel: ErrUnknownDevice, token: tok,
					detail: fmt.Sprintf(" (no GPU has minor number %d; %s)", minor, b.ix.knownMinors)})
				continue
			}
			b.nodes = append(b.nodes, pending{pos: pos, src: src})
		case isCap:
			if !b.spend(src) {
				return
			}
			b.capNode(src, minor)
		case maybeCap:
			if !b.spend(src) {
				return
			}
			b.unmappedCaps = true
			b.note(src + ": may be a MIG capability node (" + capsMajorUnknown + "); the GPUs whose nodes the container has are claimed whole")
		}
		// 195:254 (nvidia-modeset), 195:255 (nvidiactl), nvidia-uvm and
		// everything else reach no particular GPU.
	}
	if b.skipped > 0 {
		b.note(fmt.Sprintf("privileged container: its %d GPU device node(s) are not counted as a request (an engine adds every host device to a privileged container); "+
			"name its GPUs with NVIDIA_VISIBLE_DEVICES or CDI", b.skipped))
	}
}

// capsRules reads the device cgroup rules on the host's nvidia-caps major:
// a container that may open every MIG capability node reaches every MIG
// instance of a GPU whose node it has (the capability nodes can be made
// with mknod, or come with a bind mount), so its parent GPUs are claimed
// whole; a rule for one capability minor is read as that node would be.
// When the inventory lists MIG instances but not the nvidia-caps major, a
// rule that opens a node of any dynamic major may open a capability, which
// one cannot be told: the parent GPUs are claimed whole. Without MIG
// instances there are no MIG capabilities to reach.
func (b *builder) capsRules(req Request) {
	if (b.capsMj == 0 && !b.capsUnknown) || (len(req.DynamicMajorRules) == 0 && !req.ManyDynamicMajorRules) {
		return
	}
	if b.privilegedNodes {
		// Its device cgroup allows every device: the rules say nothing
		// about what it asked for, as its nodes do not (see Resolve).
		return
	}
	if b.capsUnknown {
		if req.ManyDynamicMajorRules || dynamicMajorAccess(req.DynamicMajorRules) {
			b.unmappedCaps = true
			b.note("device cgroup rules open nodes of a dynamic major, which may be MIG capability nodes (" + capsMajorUnknown +
				"); the GPUs whose nodes the container has are claimed whole")
		}
		return
	}
	all, minors := ruleAccess(req.DynamicMajorRules, b.capsMj, maxCapsMinor)
	src := "device cgroup rule c " + strconv.FormatInt(b.capsMj, 10) + ":"
	if all || req.ManyDynamicMajorRules {
		b.unmappedCaps = true
		b.note(src + "* (nvidia-caps): every MIG capability node can be opened; the GPUs whose nodes the container has are claimed whole")
		return
	}
	for _, m := range minors {
		if !b.spend(src) {
			return
		}
		b.capNode(src+strconv.FormatInt(m, 10)+" (nvidia-caps)", m)
	}
}

func (b *builder) capNode(src string, minor int64) {
	c, ok := b.ix.caps[int(minor)]
	if !ok || minor < 0 || minor > 1<<20 {
		b.unmappedCaps = true
		b.note(src + ": MIG capability node with no known mapping to a MIG instance; the GPUs it belongs to are claimed whole")
		return
	}
	switch c.Kind {
	case CapCIAccess:
		gpu := b.ix.byMinor[c.GPUMinor]
		b.add(b.ix.byGICI[giciKey{parent: gpu, gi: c.GI, ci: c.CI}], src)
	case CapGIAccess:
		gpu := b.ix.byMinor[c.GPUMinor]
		b.giCaps = append(b.giCaps, pending{pos: b.ix.byGI[giKey{parent: gpu, gi: c.GI}][0], src: src})
	}
	// CapConfig and CapMonitor open no MIG instance.
}

// finish settles GPU-instance capability nodes and /dev/nvidia<N> nodes now
// that every MIG instance the request names is known.
//
// A GPU-instance capability opens every compute instance of that GPU
// instance; when the request also names some of them (the compute-instance
// capability or the MIG UUID, as the runtime always injects), only those are
// meant. A container of a MIG instance always gets its parent's
// /dev/nvidia<N> too, but with MIG enabled that node alone runs no work on
// the GPU: the capabilities decide. So the parent node counts as a claim on
// the named MIG instances, not on the whole GPU — unless some capability node
// could not be mapped, or the container holds CAP_SYS_ADMIN (sysAdmin,
// Request.Privileged) or may hold it (maySysAdmin, Request.SysAdmin: its
// spec gives no capabilities): the driver lets an administrator (its test
// is capable(CAP_SYS_ADMIN)) use every MIG instance of a GPU whose node it
// has, without any capability node. Either way the whole GPU is claimed.
func (b *builder) finish(sysAdmin, maySysAdmin bool) {
	for _, p := range b.giCaps {
		e := b.ix.ents[p.pos]
		gk := giKey{parent: e.parent, gi: e.gi}
		var named bool
		for _, m := range b.ix.byGI[gk] {
			if b.has(m) {
				named = true
				b.add(m, p.src)
			}
		}
		if !named {
			for _, m := range b.ix.byGI[gk] {
				b.add(m, p.src)
			}
		}
	}
	for _, p := range b.nodes {
		migs := b.ix.migsOf[p.pos]
		if len(migs) == 0 || b.unmappedCaps || b.has(p.pos) {
			b.add(p.pos, p.src)
			continue
		}
		if sysAdmin || maySysAdmin {
			gpu := b.ix.ents[p.pos].dev
			holds, fix := "holds CAP_SYS_ADMIN", "drop CAP_SYS_ADMIN"
			if !sysAdmin {
				holds = "may hold CAP_SYS_ADMIN (its spec gives no capabilities, and recent runc then leaves it root's)"
				fix = "give it a capability set without CAP_SYS_ADMIN"
			}
			b.note(fmt.Sprintf("%s: the container %s, with which NVIDIA's driver lets it use every MIG instance of GPU %s (%s) "+
				"through this node, whatever MIG capability nodes it has: the GPU is claimed whole; %s to share its MIG instances",
				p.src, holds, gpu.Index, gpu.UUID, fix))
			b.add(p.pos, p.src)
			continue
		}
		var named bool
		for _, m := range migs {
			if b.has(m) {
				named = true
				b.add(m, p.src)
			}
		}
		if !named {
			b.add(p.pos, p.src)
		}
	}
}
