// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
)

// Input is the runtime's input to one hook run, read once: the OCI state
// from stdin and the bundle's spec it names, with what could not be read.
type Input struct {
	state    specs.State
	stateErr error
	spec     *specs.Spec
	specErr  error
	// request is what the spec makes reachable; set when spec is.
	request devices.Request
	// never is guard.NeverClaims(request), decided once: a hook binary asks
	// before loading the configuration and create-runtime asks again.
	never bool
	// ticket is the ticket of gpu-guard-ctl run that a container that
	// reaches no GPU (never) carries, "" for none: its create-runtime
	// releases the ticket's GPUs (see releaseUnusedTicket).
	ticket string
	// userNS is the runtime's user namespace (env.userNS: its uid_map),
	// once userNSRead: read at most once per run, by unfence where the
	// spec calls for it, and by poststopFindsClaim (runtimeUserNS).
	userNS     RuntimeUserNS
	userNSRead bool
}

// runtimeUserNS returns e.userNS(), read once for in: both readers see the
// same answer.
func (in *Input) runtimeUserNS(e env) RuntimeUserNS {
	if !in.userNSRead {
		in.userNS, in.userNSRead = e.userNS(), true
	}
	return in.userNS
}

// ReadInput reads the OCI state from stdin and the spec of its bundle. It
// never fails: what it could not read is kept and reported by the phase,
// which refuses the container (create-runtime) or reads the ledger anyway
// (poststop).
func ReadInput(stdin io.Reader) *Input {
	return defaultEnv().readInput(stdin)
}

// readInput is ReadInput reading the host through e (procRoot, getppid,
// userNS, readCgroup).
func (e env) readInput(stdin io.Reader) *Input {
	in := &Input{}
	in.state, in.stateErr = readState(stdin)
	if in.stateErr != nil {
		return in
	}
	in.spec, in.specErr = e.readSpecOf(&in.state)
	if in.specErr == nil {
		in.request = devices.RequestFromSpec(in.spec)
		e.addUnfenced(in)
		in.never = guard.NeverClaims(in.request)
		if in.never {
			// A scan of the environment already decoded: the no-GPU path
			// most containers take stays as cheap as it was.
			in.ticket = ticketOf(in.request.Env)
		}
	}
	return in
}

// addUnfenced adds to in.request what the container in describes reaches
// past its device rules when no device cgroup enforces them: every node a
// bind mount or its root filesystem brings in (the host's /dev, or a
// devtmpfs mounted afresh, opens every GPU, as does, under a runtime that
// may be rootful, a directory bound in not mounted nodev, whose nodes are
// not listed: see boundRoot for the root, readDirs for the others), as
// does a procfs mounted without a PID namespace of its own
// (procShowsOtherRoots), the host's node at each linux.devices entry's
// path, which a runtime that cannot mknod binds whatever the entry's
// numbers say (boundDevicePaths), and, with CAP_MKNOD or CAP_SYS_ADMIN
// outside a user namespace (makesNodes), every GPU through a node it makes
// or mounts itself.
// Such a container is resolved like one whose device cgroup allows every
// GPU node (GPUNodesAllowed), named as having none (NoDeviceCgroup).
//
// No device cgroup applies when the runtime runs in a user namespace
// (rootless podman's runc and crun set up none there; a namespace that
// cannot be told is read as both rootless and rootful, see UnknownUserNS),
// or, for a rootful runtime, when the container's process is not in a
// device cgroup of its own (deviceCgroupApplies): crun
// --cgroup-manager=disabled (podman --cgroups=disabled), or a runtime
// without a cgroup it may write to,
// leaves the process in its caller's cgroup, whose device rules (if any)
// are not the spec's.
//
// The cgroup is read only when it could matter: a bind source or a
// linux.devices path that is a device node (other than the one the entry's
// numbers make), the host's / or /dev, whatever it is called (one stat per
// bind source and entry, a few microseconds: the runtime follows symlinks,
// so spellings do not tell), any other directory bound in (what it is, a
// directory of a procfs among them, and what lies below it is read only
// then: readDirs), a /proc path that leads to a root, a proc
// mount without a PID namespace of its own (docker's and podman's
// --pid=host), a root filesystem that brings in the host's /dev, or a
// rootful runtime's (one stat and statfs of root.path, and the host's
// /dev, wherever the binds are read: one not mounted nodev, and one on a
// nodev mount too, whose nodev holds only under a runtime that keeps it,
// asked only once no device cgroup fences the container: readRoot), a devtmpfs
// mount, or CAP_MKNOD (in docker's and containerd's default set, not
// podman's or CRI-O's) or CAP_SYS_ADMIN. A state without a pid (which runc
// and crun always give create-runtime) counts as no device cgroup.
// Poststop, whose process is gone, cannot read it: it goes by the spec
// alone, its spellings and its proc mount and namespaces (such a container
// then always reads the ledger), and by the marker its create-runtime
// wrote before any claim (marker.go), which a claim for a node made or
// mounted by the container, or a bind or linux.devices path spelled
// otherwise, relies on: create-runtime refuses such a container when the
// marker cannot be written (poststopFindsClaim).
func (e env) addUnfenced(in *Input) {
	st := in.state
	stopped := st.Status == specs.StateStopped
	rt := bindRuntime{procRoot: e.procRoot, ppid: e.getppid}
	if !stopped {
		// The hook runs in the runtime's user namespace: the container's
		// process, whose namespaces are made by create-runtime, is
		// compared with the hook's own. Poststop's pid may be another's
		// by now.
		rt.locked = lockedByUserNS(in.spec, e.procRoot, st.Pid, "self")
	}
	unfence(&in.request, in.spec, st.Bundle, func() RuntimeUserNS { return in.runtimeUserNS(e) },
		stopped, func() bool { return e.deviceCgroupApplies(st) }, rt)
}

// RuntimeUserNS is what is known of the user namespace of the OCI runtime
// that runs a container, which decides what its device rules and mounts
// let through (unfence).
type RuntimeUserNS uint8

const (
	// UnknownUserNS is a namespace that cannot be told (an unreadable
	// uid_map, a state root whose owner cannot be read). Either reading
	// may be the runtime's, so the container is read both ways at once:
	// no device cgroup applies (as rootless), binds and overlays open
	// nodes and CAP_MKNOD and CAP_SYS_ADMIN count (as rootful). The zero
	// value, so that a caller that says nothing fails closed.
	UnknownUserNS RuntimeUserNS = iota
	// Rootful is the host's initial user namespace. Its runtime applies the
	// container's device rules when it puts it in a cgroup of its own.
	Rootful
	// Rootless is another user namespace (rootless podman's runc and crun).
	// Its runtime sets up no device cgroup, and neither a node the
	// container makes nor one on an overlay it mounts opens there: only
	// binds bring nodes in, the runtime's own of the host's node at each
	// linux.devices path among them (it cannot mknod).
	Rootless
)

// Runtime is what is known of the OCI runtime that made a container, told
// by its state (runc's state.json, crun's status), for a recovery that
// reads the container as its hook did (RunningRequest): whether the
// runtime keeps a bind source's mount flags on a bind without flag options
// of its own, and the nodev of a read-write root's mount (bindRuntime).
type Runtime uint8

const (
	// RuntimeUnknown is a runtime that cannot be told: read as crun leaves
	// a container (both nodevs dropped), the reading that never claims
	// less. The zero value, so that a caller that says nothing fails
	// closed.
	RuntimeUnknown Runtime = iota
	// RuntimeRunc is runc, by its state file's format: it keeps a bind
	// source's flags on a bind without flag options of its own, and a
	// read-write root's nodev, as the hook read them where runc ran it
	// (keepsFlagsName).
	RuntimeRunc
	// RuntimeCrun is crun, by its state file's format: it drops both.
	RuntimeCrun
)

// RunningRequest is what a running container's spec reaches, read as the
// hook read it at its create-runtime (addUnfenced), for a recovery that
// rebuilds claims from the runtimes' state: req (devices.RequestFromSpec of
// spec, the config.json in bundle) gains what no device cgroup stops.
// userNS is the runtime's user namespace, told by its state root's owner
// (root's: Rootful; another user's: Rootless; unknown: read both ways).
// For a rootful runtime the device cgroup applies when the container's
// process (pid, read under procRoot) is in a cgroup named after it, or
// below one (the runtime that ran the hook is gone: that is all that can be
// checked now). Whatever cannot be read counts as no device cgroup, as at
// create-runtime.
//
// rt is the runtime that made the container, told by its state file's
// format (the runtime that ran its hook is gone, and nothing of the
// container's process names it). Under runc (RuntimeRunc) a directory bound
// in from a nodev mount without flag options of its own keeps that nodev,
// and so does a read-write root filesystem on a nodev mount, as the hook
// read them where runc ran it. Under crun, or a runtime that cannot be
// told (RuntimeUnknown), such a bind counts as reaching every GPU node, as
// crun leaves it (see remountsBind), and so does a root filesystem on a
// nodev mount (crun drops its nodev: boundRoot): the hook read a runtime
// it could not tell so too.
func RunningRequest(req *devices.Request, spec *specs.Spec, bundle, procRoot string, pid int, id string, userNS RuntimeUserNS, rt Runtime) {
	e := defaultEnv()
	e.procRoot = procRoot
	br := bindRuntime{told: rt}
	if userNS == Rootful {
		// The runtime's user namespace is the initial one, which this
		// process's is too where its uid_map says so: the container's is
		// compared with it. Otherwise nothing here is the runtime's.
		br.locked = func() bool {
			return userNSLocksMounts(spec) && runtimeUserNS(procRoot) == Rootful && otherUserNS(procRoot, pid, "self")
		}
	}
	unfence(req, spec, bundle, func() RuntimeUserNS { return userNS }, false, func() bool {
		cg, err := e.deviceCgroupOf(pid)
		return err == nil && ownedCgroup(cg, "", id)
	}, br)
}

// UnfencedRequest is what a container of spec reaches in a rootful runtime
// that applies no device cgroup to it, read as the hook reads it there:
// req (devices.RequestFromSpec of spec) gains the nodes its binds bring in
// (each bind source read on this host) and those at its linux.devices
// paths (a runtime that cannot mknod binds them), and every GPU node when
// it binds the host's /dev, has it in its root filesystem (boundRoot),
// mounts a procfs without a PID namespace of its own (procShowsOtherRoots),
// can make or mount a node itself (CAP_MKNOD, CAP_SYS_ADMIN, or no
// capabilities object: makesNodes), or has a root filesystem or a
// directory bound in not mounted nodev (readDirs), or a root filesystem
// on a nodev mount, or a directory bound from one without a nodev option
// of its own, under a runtime that may be crun (any: which runtime will
// run the spec is not told; crun drops both nodevs, see boundRoot and
// remountsBind). bundle is the directory relative bind sources and a
// relative root.path are read from (the config.json's). For
// `gpu-guard-ctl explain --no-device-cgroup`.
func UnfencedRequest(req *devices.Request, spec *specs.Spec, bundle string) {
	unfence(req, spec, bundle, func() RuntimeUserNS { return Rootful }, false, func() bool { return false }, bindRuntime{})
}

// unfence is addUnfenced for a runtime in the user namespace userNS tells
// (asked only for a spec with mounts, linux.devices entries, node-making
// capabilities or a root filesystem), a container that has stopped
// (poststop: its process is gone, so only spellings and the marker can
// tell) and the check of its device cgroup (applies, asked only when
// something could reach a GPU; a state without a pid has none that
// applies). bundle is the directory the runtime reads relative bind
// sources and a relative root.path from. rt tells whether the runtime
// keeps a bind source's mount flags on a bind without flag options, and
// the nodev of a read-write root's mount (bindRuntime), asked at most once
// and only for a container no device cgroup fences: where the answer
// decides (readDirs: a directory bound from a nodev mount without options
// of its own; readRoot: a root on a nodev mount) or names the remedy of a
// root counted already (readRoot).
//
// The root filesystem (root.path) is read as a bind of its directory at
// "/" (boundRoot), where the binds are read, for every container whose
// binds are read: one stat of it (of each path a relative one is read
// at), compared with the host's / and /dev (each stat'ed once), an lstat
// of its dev where no mount covers /dev, and, under a runtime that is not
// rootless, one statfs, whose flags tell whether the root is mounted nodev:
// one that is not counts as reaching every GPU node its image may carry,
// and so does one that is, unless the runtime keeps that nodev (runc, a
// read-write root; runc or crun, a container whose user namespace locks
// it: readRoot).
// Nothing in it is opened. A hand-written spec whose root is the host's
// "/" gives its container the host's /dev, every GPU node with it,
// whatever it mounts at /dev.
func unfence(req *devices.Request, spec *specs.Spec, bundle string, userNS func() RuntimeUserNS, stopped bool, applies func() bool,
	rt bindRuntime,
) {
	mknod := makesNodes(spec)
	if len(spec.Mounts) == 0 && !mknod && (spec.Linux == nil || len(spec.Linux.Devices) == 0) && rootPath(spec) == "" {
		return
	}
	ns := userNS()
	// unknown: what either reading lets through (see UnknownUserNS).
	unknown := ns != Rootful && ns != Rootless
	switch {
	case ns == Rootless:
		// No device node can be made in a user namespace, nor opened
		// through a filesystem mounted there (an overlay): only binds,
		// the runtime's own of each linux.devices entry among them.
		markUnfenced(req, unfencedSources(spec, bundle, true, rt), false)
		return
	case stopped:
		// Poststop goes by spellings: a rootful runtime's binds, overlays,
		// root and linux.devices paths are read when one is spelled like
		// a device or the host's /dev, or when a proc mount shows other
		// processes' roots (procShowsOtherRoots); the marker leads
		// poststop to the rest (CAP_MKNOD, CAP_SYS_ADMIN, a bind through
		// a symlink). Where the namespace is unknown they are read
		// whatever their spelling, as a rootless runtime's poststop reads
		// every bind and path (and a rootful one's overlays too).
		if unknown || bindsDeviceLike(req) || rootNamesHostDev(spec) || procShowsOtherRoots(spec) {
			markUnfenced(req, unfencedSources(spec, bundle, false, rt), false)
		}
		return
	case unknown:
		// A rootful runtime's container that no device cgroup fences,
		// since a rootless runtime sets up none.
		applies = func() bool { return false }
	}
	if mknod {
		// The cgroup decides alone: in one of its own (the common case
		// under docker's and containerd's defaults) the binds are not
		// read at all.
		if !applies() {
			markUnfenced(req, unfencedSources(spec, bundle, false, rt), true)
		}
		return
	}
	bound := unfencedSources(spec, bundle, false, rt)
	if !bindsDeviceLike(req) && bound.none() {
		return
	}
	if applies() {
		return
	}
	markUnfenced(req, bound, false)
}

// markUnfenced records in req, for a container no device cgroup fences,
// the nodes its binds bring in and whether it opens every GPU node (the
// host's /dev bound in, mknod: it can make any node, or a root filesystem
// or a directory bound in not nodev in the container, where any node in it
// opens). What the directories bound in are, and what lies below them, and
// whether the runtime keeps the nodev of the root's mount, are read here
// (readDirs, readRoot), once no device cgroup is known to fence the
// container, unless every GPU opens anyway. ImageNodes and NodeDirs tell
// the resolver that the root filesystem and those directories are the only
// causes, so that its messages name them and their remedies (RootNodev,
// RootStorageNodev: what the runtime makes of the root's nodev).
func markUnfenced(req *devices.Request, bound boundSources, mknod bool) {
	if !mknod && !bound.hostDev {
		bound.readDirs()
		bound.readRoot()
	}
	req.Devices = append(req.Devices, bound.nodes...)
	if bound.hostDev {
		req.HostDevMounted = true
	}
	if req.HostDevMounted || mknod || bound.imageNodes || len(bound.nodeDirs) > 0 {
		req.GPUNodesAllowed = true
		req.NoDeviceCgroup = true
		if !req.HostDevMounted && !mknod {
			req.ImageNodes, req.NodeDirs = bound.imageNodes, bound.nodeDirs
			if bound.imageNodes {
				req.RootNodev, req.RootStorageNodev = bound.rootDrop, bound.rootNodev
			}
		}
	}
}

// poststopFindsClaim reports whether the poststop of the container in
// would read the ledger without its marker: what its spec reaches read as
// poststop reads it (stopped: no cgroup, spellings only) can be claimed.
// Without that, a claim create-runtime makes stays when the container is
// deleted (poststop skips the ledger), so create-runtime must not make it
// without a marker.
//
// When the runtime's user namespace cannot be told now, poststop may tell
// it (or not) by then: the claim must show under each reading it may take.
func (e env) poststopFindsClaim(in *Input) bool {
	finds := func(userNS RuntimeUserNS) bool {
		req := devices.RequestFromSpec(in.spec)
		// A runtime that keeps a bind source's nodev and a read-write
		// root's (runc) is the reading under which poststop finds least:
		// the runtime that runs it (runc delete, crun delete, podman) is
		// not this one.
		unfence(&req, in.spec, in.state.Bundle, func() RuntimeUserNS { return userNS }, true, func() bool { return false }, bindRuntime{told: RuntimeRunc})
		return !guard.NeverClaims(req)
	}
	if userNS := in.runtimeUserNS(e); userNS != UnknownUserNS {
		return finds(userNS)
	}
	// An unknown reading at poststop finds whatever either of these does:
	// they are the least poststop may find.
	return finds(Rootful) && finds(Rootless)
}

// The capabilities that let a process make device nodes of its own:
// mknod, or mount a devtmpfs (every node of the host's /dev).
const (
	capMknod    = "CAP_MKNOD"
	capSysAdmin = "CAP_SYS_ADMIN"
)

// makesNodes reports whether the container spec describes can come by a
// device node of its own: CAP_MKNOD or CAP_SYS_ADMIN (a devtmpfs mount) in
// its bounding set (what a process of it may come to hold), and no user
// namespace of its own, since the kernel lets only the initial user
// namespace make device nodes or mount a devtmpfs. Without a device cgroup
// it opens every GPU through such a node.
//
// A spec without a capabilities object (or without a process) counts as
// holding every capability: recent runc (its libcontainer applies no
// capability set it was not given) then leaves its own capabilities in
// place (root's full set, CAP_MKNOD and CAP_SYS_ADMIN among them), while
// runc 1.1 and crun 1.8 drop them all. The hook cannot tell which runtime,
// or which release, runs it, so it takes the reading under which more
// opens.
// Every engine writes the object: only a hand-written spec lacks it. This
// is not privileged (devices.RequestFromSpec): a device cgroup, where one
// applies, still stops what CAP_SYS_ADMIN alone would open.
func makesNodes(spec *specs.Spec) bool {
	if p := spec.Process; p != nil && p.Capabilities != nil {
		if c := p.Capabilities; !slices.Contains(c.Bounding, capMknod) && !slices.Contains(c.Bounding, capSysAdmin) {
			return false
		}
	}
	if l := spec.Linux; l != nil {
		for _, ns := range l.Namespaces {
			if ns.Type == specs.UserNamespace {
				return false
			}
		}
	}
	return true
}

// bindsDeviceLike reports whether AddMount recorded, from the spec's
// mounts, the host's /dev (HostDevMounted) or a host device node (a device
// with BoundAt) by their spelling.
func bindsDeviceLike(req *devices.Request) bool {
	if req.HostDevMounted {
		return true
	}
	for _, d := range req.Devices {
		if d.BoundAt != "" {
			return true
		}
	}
	return false
}

// deviceCgroupApplies reports whether the spec's device rules are enforced
// on the container st describes: its process is in a device cgroup of its
// own (ownedCgroup: the leaf names the container, and it is neither the
// cgroup of the runtime that ran this hook, the hook's parent, nor one
// above it). A runtime that creates a cgroup for the container applies the
// spec's device rules to it before the createRuntime hooks run (runc and
// crun move the process in and set the rules, or attach the cgroup v2
// device program, in the same step); one that creates none leaves the
// process where its caller was.
//
// Whatever cannot be told is answered false, the conservative answer (more
// may open, so more is claimed): no pid (poststop's state, whose process is
// gone and whose pid may be another's by now), an unreadable cgroup file,
// or one without the line that holds the device controller. Poststop so
// always reads the ledger for such a container, and releases whatever its
// create-runtime claimed, whichever way create-runtime decided.
func (e env) deviceCgroupApplies(st specs.State) bool {
	if st.Pid <= 0 || st.Status == specs.StateStopped {
		return false
	}
	cg, err := e.deviceCgroupOf(st.Pid)
	if err != nil {
		return false
	}
	rt, err := e.deviceCgroupOf(e.getppid())
	if err != nil {
		return false
	}
	return ownedCgroup(cg, rt, st.ID)
}

// maxCgroupFileBytes bounds the read of /proc/<pid>/cgroup: a dozen
// hierarchies of a few hundred bytes each. A longer file is not guessed at.
const maxCgroupFileBytes = 16 << 10

// deviceCgroupOf returns the cgroup of pid that enforces device rules, from
// procRoot/<pid>/cgroup (each line hierarchy-ID:controllers:path):
//   - cgroup v1, and hybrid hosts (v1 controllers plus the unified "0::"
//     line): the line whose controllers include "devices". Device rules are
//     that controller's, and nothing else tells: the unified line of a
//     hybrid host carries no controller and stays at the caller's cgroup
//     under runc's cgroupfs driver, and liveness.ProcessCgroup's pick (pids
//     first) is a cgroup that says nothing of the devices controller.
//   - cgroup v2 (only "0::" lines): the unified cgroup, where runtimes
//     attach the device program of the container.
//
// A v1 file without a devices line is an error: the device controller is
// not where this can see it.
func (e env) deviceCgroupOf(pid int) (string, error) {
	if pid <= 0 {
		return "", fmt.Errorf("invalid pid %d", pid)
	}
	path := filepath.Join(e.procRoot, strconv.Itoa(pid), "cgroup")
	data, err := e.readCgroup(path)
	if err != nil {
		return "", err
	}
	unified, v1 := "", false
	for _, line := range strings.Split(string(data), "\n") {
		// The path may hold ':'.
		parts := strings.SplitN(strings.TrimSpace(line), ":", 3)
		if len(parts) != 3 || !strings.HasPrefix(parts[2], "/") {
			continue
		}
		if parts[0] == "0" && parts[1] == "" {
			unified = parts[2]
			continue
		}
		v1 = true
		if slices.Contains(strings.Split(parts[1], ","), "devices") {
			return parts[2], nil
		}
	}
	if v1 || unified == "" {
		return "", fmt.Errorf("pid %d: no device cgroup in %s", pid, path)
	}
	return unified, nil
}

// readCgroupFile reads a /proc/<pid>/cgroup file, bounded.
func readCgroupFile(path string) ([]byte, error) { return readBounded(path, maxCgroupFileBytes) }

// readBounded reads a /proc file whole, refusing one larger than limit
// bytes (what no runtime writes there: a truncated read would be a guess).
func readBounded(path string, limit int) ([]byte, error) {
	f, err := os.Open(path) //nolint:gosec // below the configured proc root
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	data, err := io.ReadAll(io.LimitReader(f, int64(limit)+1))
	if err != nil {
		return nil, err
	}
	if len(data) > limit {
		return nil, fmt.Errorf("%s is larger than %d bytes", path, limit)
	}
	return data, nil
}

// boundSources is what a container's bind sources are on the host.
type boundSources struct {
	// nodes are the character devices bound in, by their numbers.
	nodes []devices.LinuxDevice
	// hostDev: the host's / or /dev is bound in, or what reaches it.
	hostDev bool
	// imageNodes: the root filesystem of a rootful runtime's container is
	// not nodev in the container, so that any device node its image
	// carries opens (boundRoot, readRoot).
	imageNodes bool
	// rootNodev: the root filesystem of a rootful runtime's container is
	// on a nodev mount (container storage mounted nodev), which stays
	// nodev in the container only where the runtime keeps it (runc, a
	// read-write root: rootReadonly is root.readonly; runc or crun, a
	// container whose user namespace locks it), read by readRoot, only
	// for a container no device cgroup fences. rootDrop is what
	// readRoot found the runtime makes of the root's nodev.
	rootNodev, rootReadonly bool
	rootDrop                devices.RootNodev
	// nodeDirs are the directories bound in (and overlay layers) where a
	// device node opens and nothing is listed (readDirs): each opens
	// whatever node it holds.
	nodeDirs []devices.NodeDir
	// rootless: the runtime is rootless, whose engine makes no node and
	// on whose mounts none opens (nodeDirs are not read there).
	rootless bool
	// runtime tells which runtime mounts the binds and the root, asked
	// once by runtimeKind, which keeps its answer in kind (kindRead:
	// asked), and whether the container's user namespace locks their
	// flags, asked once by userNSLocked (locked, lockedRead).
	runtime            bindRuntime
	kind               Runtime
	kindRead           bool
	locked, lockedRead bool
	// dirs are the other directories bound in (and overlay layers): where
	// they lead, the part of the host's /dev they may be and the mounts
	// below them are read by readDirs, only for a container no device
	// cgroup fences.
	dirs []boundDir
	host *hostDirs
}

// none reports whether nothing bound in may reach a GPU: neither the host's
// /dev nor a node that may be one (devices.MayBeGPUNode: /dev/null or
// /dev/fuse bound in is no reason to read the container's cgroup), nor a
// root filesystem that may carry nodes (on nodev storage too: whether the
// runtime keeps that nodev is read only once no device cgroup fences the
// container, readRoot), nor a directory whose mounts and links are yet to
// be read.
func (b boundSources) none() bool {
	return !b.hostDev && !b.imageNodes && !b.rootNodev && len(b.dirs) == 0 && !slices.ContainsFunc(b.nodes, devices.MayBeGPUNode)
}

// boundNodes reads what each mount source is on the host, whatever it is
// called (the runtime follows symlinks, and numbers, not names, tell a GPU
// node): a character device is a node of the container, and the host's /
// or /dev is the host's /dev bound in (one stat). Any other directory is
// kept for readDirs, which reads what it is (a directory of a procfs is
// the host's /dev too) and what lies below it once no device cgroup is
// known to fence the container: a container its cgroup fences pays no
// more than the stat. A relative source is read from the bundle, as
// the runtime reads it. An overlay's layers are read so too
// (devices.OverlayLayers; a layer brings no mount below it), and one whose
// layers cannot be told counts as the host's /dev; not under a rootless
// runtime (rootless), whose overlay is mounted in its user namespace, where
// the kernel opens no device node on it. A devtmpfs mount is the host's
// /dev. AddMount reads sources by their spelling only; this reads them as
// the runtime mounts them.
func boundNodes(mounts []specs.Mount, bundle string, rootless bool, host *hostDirs) boundSources {
	b := boundSources{host: host, rootless: rootless}
	// read reads src, bound as d says (all of d but its source and what
	// its stat gives).
	var read func(src string, d boundDir)
	read = func(src string, d boundDir) {
		if src == "" {
			return
		}
		if src[0] != '/' {
			if bundle == "" {
				return
			}
			// runc joins a relative source to the bundle as text
			// (x/../dev is bundle/dev); crun hands it to the kernel from
			// the bundle, which follows a symlink x before the "..":
			// both are read.
			if raw := bundle + "/" + src; filepath.Clean(raw) != raw {
				read(raw, d)
			}
			src = filepath.Join(bundle, src)
		}
		var st unix.Stat_t
		if unix.Stat(src, &st) != nil {
			return // nothing the runtime can bind either
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFCHR:
			b.nodes = append(b.nodes, devices.LinuxDevice{Path: src, Type: "c",
				Major: int64(unix.Major(st.Rdev)), Minor: int64(unix.Minor(st.Rdev)), BoundAt: d.dst})
		case unix.S_IFDIR:
			switch {
			case host.isDev(&st) || host.isRoot(&st):
				b.hostDev = true
			default:
				d.src, d.dev, d.ino = src, uint64(st.Dev), st.Ino //nolint:unconvert // uint32 on some platforms
				b.dirs = append(b.dirs, d)
			}
		}
	}
	for _, m := range mounts {
		switch m.Type {
		case "devtmpfs":
			b.hostDev = true // the kernel's one devtmpfs (AddMount)
			continue
		case "overlay":
			if rootless {
				continue
			}
			layers, opaque := devices.OverlayLayers(m.Options)
			if opaque {
				b.hostDev = true
			}
			nodev := mountNodev(m.Options)
			for _, l := range layers {
				read(l, boundDir{dst: m.Destination, nodev: nodev, layer: true})
			}
			continue
		}
		if isBind(m) {
			read(m.Source, boundDir{dst: m.Destination, recursive: recursiveBind(m), below: nodevBelow(m.Options), nodev: mountNodev(m.Options),
				ownFlags: remountsBind(m.Options), clears: clearingOptions(m.Options)})
		}
	}
	return b
}

// mountNodev reports whether a spec mount's options make it nodev: "nodev",
// or "rnodev" (runc's and crun's recursive form, which covers the mount
// itself), and neither "dev" nor "rdev", which clear it (where both are
// given, which wins is not read: not nodev). An option is read as one word,
// as runc and crun read a bind's: "rw,nodev" is none of them.
func mountNodev(options []string) bool {
	nodev := false
	for _, o := range options {
		switch o {
		case "nodev", "rnodev":
			nodev = true
		case "dev", "rdev":
			return false
		}
	}
	return nodev
}

// remountsBind reports whether a bind's options hold a mount flag (ro, rw,
// nosuid, noexec, …) beside bind, rbind, nodev and propagation: runc and
// crun then remount the bind with exactly the flags asked for, which
// clears a nodev the source's mount had (outside a user namespace, where
// it is not locked). Such a bind is nodev only by its own options.
//
// Without such a flag only runc leaves the bind alone, so that its top
// mount keeps the source's flags: crun remounts every bind with the flags
// its options make, none for these. Verified as root with a directory on a
// nodev tmpfs bound at /x, read in the container's /proc/self/mountinfo and
// by opening a node in it: runc 1.1.5 keeps nodev on /x for "rbind",
// "bind", "bind,rprivate" and "rbind,rprivate"; crun 1.8.1 (with
// --cgroup-manager=disabled) makes /x not nodev for each of them, and the
// node opens. Both make it nodev for "rbind,nodev", "bind,nodev" and
// "rbind,rnodev", and neither for "rbind,ro". So the source's nodev is
// relied on only under a runtime known to be runc (sourceFlagsKept);
// every other counts as crun.
func remountsBind(options []string) bool {
	for _, o := range options {
		switch o {
		case "bind", "rbind", "nodev", "rnodev",
			"private", "rprivate", "shared", "rshared", "slave", "rslave", "unbindable", "runbindable":
		default:
			return true
		}
	}
	return false
}

// recursiveBind reports whether the runtime binds m's source with the
// mounts below it (MS_REC): runc and crun read it from the options alone,
// "rbind" recursive and "bind" not (either may come with the other, and
// "rbind" wins); with neither they refuse a bind (ENODEV), and a runtime
// that takes type "bind" alone may bind either way, so that reads as
// recursive too.
func recursiveBind(m specs.Mount) bool {
	return slices.Contains(m.Options, "rbind") || !slices.Contains(m.Options, "bind")
}

// hostDirs is the host's / and /dev, each stat'ed once, when a directory
// is first compared with it. A raw stat, not os.Stat: every rootful
// container's binds and root are read, and a FileInfo each is garbage the
// hook's no-GPU path need not make.
type hostDirs struct {
	root, dev         unix.Stat_t
	rootRead, devRead bool
}

// isRoot reports whether st is the host's "/" (by device and inode).
func (h *hostDirs) isRoot(st *unix.Stat_t) bool {
	return sameFile(h.stat("/", &h.root, &h.rootRead), st)
}

// isDev reports whether st is the host's /dev (by device and inode).
func (h *hostDirs) isDev(st *unix.Stat_t) bool {
	return sameFile(h.stat("/dev", &h.dev, &h.devRead), st)
}

// onDev reports whether fsDev, the st_dev of a file read on the host, is
// the host's /dev's filesystem (the devtmpfs on every systemd host), where
// the GPU nodes are. False where the host's /dev cannot be stat'ed: a
// caller that lists what is on /dev asks devKnown first.
func (h *hostDirs) onDev(fsDev uint64) bool {
	dev := h.stat("/dev", &h.dev, &h.devRead)
	return dev.Ino != 0 && uint64(dev.Dev) == fsDev //nolint:unconvert // uint32 on some platforms
}

// devKnown reports whether the host's /dev could be stat'ed: otherwise
// onDev cannot tell what is part of it.
func (h *hostDirs) devKnown() bool {
	return h.stat("/dev", &h.dev, &h.devRead).Ino != 0
}

func (h *hostDirs) stat(path string, st *unix.Stat_t, read *bool) *unix.Stat_t {
	if !*read {
		*read = true
		if unix.Stat(path, st) != nil {
			*st = unix.Stat_t{}
		}
	}
	return st
}

// sameFile reports whether host, a file read on the host (zero: not
// read), is st.
func sameFile(host, st *unix.Stat_t) bool {
	return host.Ino != 0 && host.Dev == st.Dev && host.Ino == st.Ino
}

// unfencedSources is what a container's binds bring in (boundNodes), its
// root filesystem (boundRoot) and what its runtime binds for its
// linux.devices entries (boundDevicePaths), read on the host.
func unfencedSources(spec *specs.Spec, bundle string, rootless bool, rt bindRuntime) boundSources {
	var host hostDirs
	b := boundNodes(spec.Mounts, bundle, rootless, &host)
	b.runtime = rt
	if procShowsOtherRoots(spec) {
		b.hostDev = true
	}
	b.boundRoot(spec, bundle)
	if l := spec.Linux; l != nil && len(l.Devices) > 0 {
		b.boundDevicePaths(l.Devices)
	}
	return b
}

// procShowsOtherRoots reports whether the spec mounts a procfs (type
// "proc", wherever) in a container without a PID namespace of its own: no
// "pid" entry in linux.namespaces (--pid=host), or one the runtime
// joins by its path (another container's, the host's; which it is cannot
// be told from here). Such a procfs lists the processes of that namespace,
// and /proc/<pid>/root/dev is each one's /dev: another container's, with
// the nodes of its GPUs, which only that container's device cgroup fences
// (an open is checked against the opener's), or the host's. Whether the
// kernel lets the container through /proc/<pid>/root depends on ptrace
// access (the same user and no capability the target holds beyond the
// opener's, or CAP_SYS_PTRACE), which the hook cannot tell for processes
// yet to come: it counts as the host's /dev bound in. A PID namespace of
// its own (a "pid" entry without a path: the runtime makes one) lists the
// container's processes alone, whose roots are its own.
//
// The spec alone tells it, so poststop, which goes by spellings, reads it
// too. Where two "pid" entries are given (runc refuses them), any with a
// path counts.
func procShowsOtherRoots(spec *specs.Spec) bool {
	if !slices.ContainsFunc(spec.Mounts, func(m specs.Mount) bool { return m.Type == "proc" }) {
		return false
	}
	own := false
	if l := spec.Linux; l != nil {
		for _, ns := range l.Namespaces {
			if ns.Type != specs.PIDNamespace {
				continue
			}
			if ns.Path != "" {
				return true
			}
			own = true
		}
	}
	return !own
}

// rootPath is the spec's root.path ("" for none).
func rootPath(spec *specs.Spec) string {
	if spec.Root == nil {
		return ""
	}
	return spec.Root.Path
}

// mountsDev reports whether a mount of the spec covers the container's
// /dev (any mount at /dev, however its destination is spelled: runc and
// crun read a relative one from the container's root).
func mountsDev(mounts []specs.Mount) bool {
	for _, m := range mounts {
		// Only a destination that holds "dev" is cleaned: an engine gives
		// every container a dozen mounts, and this runs for each.
		if d := m.Destination; d == "/dev" || (strings.Contains(d, "dev") && path.Clean("/"+d) == "/dev") {
			return true
		}
	}
	return false
}

// rootNamesHostDev reports whether the spec's root.path is, by its
// spelling, the host's /dev or the host's / (whatever is mounted at /dev:
// see boundRoot): what poststop, which goes by spellings (unfence), reads
// as a root that brings the host's /dev in.
func rootNamesHostDev(spec *specs.Spec) bool {
	p := rootPath(spec)
	if p == "" || p[0] != '/' {
		return false
	}
	switch filepath.Clean(p) {
	case "/dev", "/":
		return true
	}
	return false
}

// boundRoot adds to b what the container's root filesystem brings in:
// the runtime binds root.path (read from the bundle when relative) at the
// container's "/", following symlinks. The host's /dev there puts every
// device node at the container's root, which no mount at /dev covers. The
// host's "/" is the host's /dev too, whatever is mounted at /dev, as a
// bind of "/" is (boundNodes): bound recursively, it brings every mount of
// the host, the host's /proc among them unless one is mounted over it,
// where /proc/<pid>/root/dev is the host's /dev again, and the /dev of
// every other container. A directory whose dev is the host's /dev (bound
// there, or a devtmpfs) is the host's /dev at the container's /dev unless
// a mount covers it (mountsDev). Compared by device and inode, as boundNodes
// compares bind sources, whatever the path is called. A root dev that is a
// symlink is not followed: inside the container it resolves from the
// container's root.
//
// A rootful runtime's root filesystem is its image, unpacked by an engine
// running as root, which makes every device node a layer carries (a tar
// entry of type char): a node of NVIDIA's numbers anywhere in it opens the
// GPU where no device cgroup stops it. What the image holds cannot be told
// without walking it, so unless the root is nodev in the container, the
// container counts as reaching every GPU node (imageNodes). Nothing in the
// root is opened. A rootless runtime's engine cannot make device nodes,
// nor does one open on a mount of its user namespace: not read there.
//
// The root is nodev in the container only where its mount is (statfs of
// root.path: containers/storage's mountopt = "nodev", which podman's
// --storage-opt overlay.mountopt=nodev sets) and the runtime keeps that.
// Verified as root with a root on a nodev tmpfs holding a node c 1:3, read
// in the container's /proc/self/mountinfo and by opening the node, both
// raw and under podman 4.3.1 with its overlay mounted nodev: runc 1.1.5
// keeps it for a read-write root and drops it for a read-only one
// (root.readonly, podman --read-only: runc remounts the root MS_RDONLY
// alone); crun 1.8.1 drops it for either. Where it was dropped the node
// opened. A root whose mount is not nodev counts here; one on a nodev
// mount is left to readRoot (rootNodev), which asks the runtime only once
// no device cgroup is known to fence the container: under crun, a runtime
// that cannot be told, and runc with a read-only root, it counts too. So
// every rootful crun container without a device cgroup (podman
// --cgroups=disabled, crun --cgroup-manager=disabled) counts as reaching
// every GPU, whatever its storage: a deliberate, conservative reading, as
// for a root not mounted nodev. But for one with a user namespace of its
// own, in which both runtimes keep the nodev of either root: the kernel
// locks it when the runtime copies the container's mount namespace into
// that user namespace (userNSLocksMounts).
func (b *boundSources) boundRoot(spec *specs.Spec, bundle string) {
	p := rootPath(spec)
	if p == "" {
		return
	}
	paths := []string{p}
	if p[0] != '/' {
		if bundle == "" {
			return
		}
		// As for a relative bind source (boundNodes): runc joins it to
		// the bundle as text, crun hands it to the kernel from there.
		paths = []string{filepath.Join(bundle, p)}
		if raw := bundle + "/" + p; filepath.Clean(raw) != raw {
			paths = append(paths, raw)
		}
	}
	devCovered := mountsDev(spec.Mounts)
	for _, dir := range paths {
		var st unix.Stat_t
		if unix.Stat(dir, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR {
			continue // nothing the runtime can use as a root either
		}
		if b.host.isDev(&st) || b.host.isRoot(&st) {
			b.hostDev = true
			return
		}
		if !b.rootless && !b.imageNodes {
			var fs unix.Statfs_t
			// A statfs that fails tells nothing: counted as not nodev.
			b.imageNodes = unix.Statfs(dir, &fs) != nil || int64(fs.Flags)&unix.ST_NODEV == 0 //nolint:unconvert // int32 on some platforms
			b.rootNodev = !b.imageNodes
			b.rootReadonly = spec.Root.Readonly
		}
		if devCovered {
			continue
		}
		var dev unix.Stat_t
		if unix.Lstat(dir+"/dev", &dev) == nil && b.host.isDev(&dev) {
			b.hostDev = true
			return
		}
	}
}

// readRoot decides, for a container no device cgroup fences (markUnfenced),
// whether its root filesystem counts as reaching every GPU node
// (imageNodes), and what the runtime makes of the nodev of the root's mount
// (rootDrop, for the remedy). The runtime (runtimeKind: the hook's parent's
// executable, read at most once per run, shared with the binds) keeps it
// where it is runc with a read-write root, and where it is runc or crun
// and the container's user namespace locks the flags of its mounts
// (userNSLocked, read only then: see userNSLocksMounts); otherwise runc
// drops it for a read-only root, and crun, or a runtime that cannot be
// told, for any (see boundRoot). A root on a nodev mount (rootNodev) counts
// unless the runtime keeps it; one not mounted nodev counts already, and
// the runtime is asked only for its remedy (storage mounted nodev does not
// help where the runtime drops it). A rootless runtime's root is not read,
// nor is the runtime where the root was not.
func (b *boundSources) readRoot() {
	if b.rootless || b.hostDev || (!b.imageNodes && !b.rootNodev) {
		return
	}
	switch kind := b.runtimeKind(); {
	case kind == RuntimeRunc && !b.rootReadonly:
		return
	case kind != RuntimeRunc && kind != RuntimeCrun:
		b.rootDrop = devices.RootNodevDroppedByRuntime
	case b.userNSLocked():
		return
	case kind == RuntimeCrun:
		b.rootDrop = devices.RootNodevDroppedByRuntime
	default:
		b.rootDrop = devices.RootNodevDroppedReadOnly
	}
	b.imageNodes = true
}

// boundDevicePaths adds to b the host node each linux.devices entry's path
// names, where it is not the node the entry's numbers make. A runtime that
// cannot mknod binds the host's node at the entry's path instead, without
// looking at the numbers: runc when it runs in a user namespace, when the
// container has one of its own, or when mknod is refused (EPERM: a runtime
// without CAP_MKNOD); crun when it runs in a user namespace (rootless).
// A CDI device node whose hostPath differs from its path is such an entry
// (its numbers are hostPath's). {path /dev/nvidia0, c 1:3} then
// gives the container the host's GPU 0, not /dev/null, and only a device
// cgroup, which allows 1:3 and not 195:0, stops the open. So where none
// applies the path is read as a bind source (stat, following symlinks as
// the mount does) in addition to the numbers: which way the runtime went
// cannot be told from here, and reading both never opens less.
//
// A relative path is resolved by runc from its working directory, the
// container's root filesystem (crun refuses it), whose symlinks lead
// anywhere on the host: it cannot be told, and counts as the host's /dev.
func (b *boundSources) boundDevicePaths(devs []specs.LinuxDevice) {
	for _, d := range devs {
		switch {
		case d.Path == "":
			continue
		case d.Path[0] != '/':
			b.hostDev = true
			continue
		}
		var st unix.Stat_t
		if unix.Stat(d.Path, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR {
			// Nothing the runtime can bind, or no character device: only
			// those can be GPUs.
			continue
		}
		major, minor := int64(unix.Major(st.Rdev)), int64(unix.Minor(st.Rdev))
		// The numbers as the runtime makes the node of them, as the
		// resolver reads the entry: c 4294967491:0 is 195:0.
		if madeMajor, madeMinor := devices.MadeNumbers(d.Major, d.Minor); (d.Type == "c" || d.Type == "u" || d.Type == "") &&
			madeMajor == major && madeMinor == minor {
			continue // the node its numbers make: read as an entry already
		}
		b.nodes = append(b.nodes, devices.LinuxDevice{Path: d.Path, Type: "c", Major: major, Minor: minor, BoundAt: d.Path})
	}
}

// isBind reports whether m is a bind mount (its source a host path): type
// "bind" (or crun's "rbind"), or options that say bind (runc and crun read
// either), or an absolute source under another type name ("none").
func isBind(m specs.Mount) bool {
	if m.Type == "bind" || m.Type == "rbind" || slices.Contains(m.Options, "bind") || slices.Contains(m.Options, "rbind") {
		return true
	}
	return m.Source != "" && m.Source[0] == '/'
}

// runtimeUserNS tells, from procRoot/self/uid_map, the user namespace of
// the hook, and so of the runtime that runs it: the host's (Rootful), or
// another (Rootless), as rootless podman's runc and crun are: they set up
// no device cgroup there. An unreadable map tells neither (UnknownUserNS):
// the container is then read both ways at once, since either reading alone
// lets through what the other stops.
func runtimeUserNS(procRoot string) RuntimeUserNS {
	data, err := os.ReadFile(filepath.Join(procRoot, "self", "uid_map")) //nolint:gosec // a file of the configured proc root
	if err != nil {
		return UnknownUserNS
	}
	if inUserNamespace(data) {
		return Rootless
	}
	return Rootful
}

// bindRuntime tells which runtime mounts a container's binds and root
// (runc, crun or another), which decides whether a bind source's mount
// flags carry over to a bind without flag options of its own
// (remountsBind: runc keeps them, crun does not) and whether the nodev of
// the root's mount does (boundRoot: runc keeps it for a read-write root,
// crun for none), and whether the container's mounts have their flags
// locked by a user namespace of its own (userNSLocked), under which runc
// keeps both nodevs whatever the bind's options and the root's readonly,
// and crun keeps the root's. The zero value: a runtime not known to keep
// any (crun's way outside a user namespace), and no lock. A value, so that
// passing it costs the hook's every run nothing.
type bindRuntime struct {
	// told is the runtime known without reading anything: the one a
	// recovery's state file names (RunningRequest), or runc for the
	// reading under which poststop finds least (poststopFindsClaim).
	// RuntimeUnknown: read through ppid, where set.
	told Runtime
	// ppid, where set, gives the pid of the runtime (the hook's parent),
	// whose executable, procRoot/<ppid>/exe, tells (runtimeOf).
	procRoot string
	ppid     func() int
	// locked, where set, reports whether the container's mount namespace
	// was copied into a user namespace other than the runtime's, which
	// locks the flags of the mounts it holds (userNSLocksMounts); nil: not
	// known to be (poststop, whose process is gone, and explain, which
	// has none).
	locked func() bool
}

// runtime is the runtime r tells: told, or the hook's parent's.
func (r bindRuntime) runtime() Runtime {
	if r.told != RuntimeUnknown || r.ppid == nil {
		return r.told
	}
	return runtimeOf(r.procRoot, r.ppid())
}

// userNSLocked reports whether r knows the container's mounts to be locked
// by its user namespace.
func (r bindRuntime) userNSLocked() bool {
	return r.locked != nil && r.locked()
}

// runtimeOf tells the runtime of pid ppid, the hook's parent, by the name
// of its executable, the link procRoot/<ppid>/exe, which the kernel
// resolves to the file it runs, so that a symlink runc -> crun is read as
// crun (runtimeNamed). A link that reads "/" is a runtime that runs from a
// copy of its executable bind-mounted and detached, as crun 1.8 re-executes
// itself so that no container can overwrite the file: its first argument
// names it (detachedRuntime). What cannot be read (a parent gone, no
// /proc) is RuntimeUnknown, as is a parent that is not the runtime.
//
// It is read only for a container that no device cgroup fences and that
// binds a directory from a nodev mount without options of its own
// (readDirs), or whose root filesystem is rootful (readRoot: on a nodev
// mount, or counted already and named with its remedy), once per run:
// never on the path of a container a device cgroup fences.
func runtimeOf(procRoot string, ppid int) Runtime {
	dir := filepath.Join(procRoot, strconv.Itoa(ppid))
	exe, err := os.Readlink(filepath.Join(dir, "exe"))
	switch {
	case err != nil:
		return RuntimeUnknown
	case exe == "/":
		return detachedRuntime(dir)
	}
	return runtimeNamed(path.Base(exe))
}

// maxArgv0Bytes bounds the read of a runtime's command line for its first
// argument: a path.
const maxArgv0Bytes = 4 << 10

// detachedRuntime tells a runtime that runs from a detached copy of its
// executable (its exe link reads "/") by the base name of its first
// argument, dir/cmdline's, which the copy keeps: crun's ("crun", what
// podman and conmon pass, as a path), and none other: runc's parent runs
// its own file, so a "runc" there is not known to be runc.
func detachedRuntime(dir string) Runtime {
	f, err := os.Open(filepath.Join(dir, "cmdline")) //nolint:gosec // below the configured proc root
	if err != nil {
		return RuntimeUnknown
	}
	defer func() { _ = f.Close() }()
	buf := make([]byte, maxArgv0Bytes)
	n, _ := io.ReadFull(f, buf)
	// Each argument ends in a NUL: one not read whole names nothing.
	if argv0, _, whole := strings.Cut(string(buf[:n]), "\x00"); whole && path.Base(argv0) == "crun" {
		return RuntimeCrun
	}
	return RuntimeUnknown
}

// runtimeNamed tells a runtime by name, the base name of its executable:
// runc (keepsFlagsName), crun ("crun", or "crun (deleted)": replaced on
// disk while it runs, still the crun it was), or RuntimeUnknown for any
// other (youki, runsc, krun, a crun kept under its download name), read
// as crun leaves a container outside a user namespace, whose mounts were
// not verified for it.
func runtimeNamed(name string) Runtime {
	switch {
	case keepsFlagsName(name):
		return RuntimeRunc
	case strings.TrimSuffix(name, " (deleted)") == "crun":
		return RuntimeCrun
	}
	return RuntimeUnknown
}

// runcArchs are the architecture suffixes of runc's release binaries
// (runc.amd64, …), installed under that name by some hosts.
var runcArchs = map[string]bool{
	"386": true, "amd64": true, "arm64": true, "armel": true, "armhf": true,
	"ppc64le": true, "riscv64": true, "s390x": true,
}

// keepsFlagsName reports whether name, the base name of a runtime's
// executable, is runc's, whose binds without flag options keep their
// source's flags, as its read-write root keeps the nodev of its mount:
// "runc", or a release binary of runc kept under its download name
// ("runc.amd64": the same program). A binary replaced on disk while it
// runs (an upgrade) reads "runc (deleted)": the process is still the runc
// it was. Every other name is not known to keep them: crun, youki, runsc,
// and docker-runc too, a fork of runc's 1.0 candidates that Docker shipped
// until 18.09, whose mounts this was not verified for (a container of it
// on nodev storage, or binding a directory from a nodev mount, is counted
// as reaching every GPU where no device cgroup fences it).
func keepsFlagsName(name string) bool {
	name = strings.TrimSuffix(name, " (deleted)")
	if name == "runc" {
		return true
	}
	arch, ok := strings.CutPrefix(name, "runc.")
	return ok && runcArchs[arch]
}

// inUserNamespace reads a uid_map: only the initial namespace maps every id
// to itself ("0 0 4294967295").
func inUserNamespace(uidMap []byte) bool {
	f := strings.Fields(string(uidMap))
	return len(f) != 3 || f[0] != "0" || f[1] != "0" || f[2] != "4294967295"
}

// NeverClaims reports whether both the state and the spec were read, the
// container can reach no GPU under any configuration or inventory
// (guard.NeverClaims) and it carries no ticket of gpu-guard-ctl run:
// create-runtime admits it and poststop has nothing to release, whatever
// the configuration says, so a hook binary answers it before loading the
// configuration. A container that carries a ticket is not answered so:
// its create-runtime releases the ticket's GPUs, which would otherwise stay
// idle for the container's life.
func (in *Input) NeverClaims() bool {
	return in.reachesNoGPU() && in.ticket == ""
}

// reachesNoGPU is NeverClaims whatever ticket the container carries: what
// poststop asks, since a released ticket leaves nothing of the container in
// the ledger.
func (in *Input) reachesNoGPU() bool {
	return in.stateErr == nil && in.specErr == nil && in.never
}
