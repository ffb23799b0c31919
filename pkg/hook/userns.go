// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"path/filepath"
	"strconv"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// A mount namespace copied into a user namespace other than the one that
// owns the namespace it is copied from has the flags of every mount it
// holds locked (the kernel's MNT_LOCK_NODEV and its kin): no process there
// may clear them, the runtime's remounts included, and a bind made there of
// such a mount copies the lock. So where a rootful runtime makes a
// container's mount namespace inside the container's own user namespace (a
// "user" entry of linux.namespaces, new or joined by its path, and a
// "mount" entry without a path), the nodev of a mount of the host stays on
// whatever the runtime binds from it there.
//
// Verified as root with runc 1.1.5 and crun 1.8.1 (crun with
// --cgroup-manager=disabled, runc with device rules that allow every
// device), a root on a nodev tmpfs holding nodes c 1:3 and c 195:0, and a
// directory bound from another, read in the container's
// /proc/self/mountinfo and by opening the nodes (EACCES where nodev holds;
// ENXIO for 195:0, which no driver backs, where it does not), with a user
// namespace made for the container (mapped 0:0 or 0:100000) and with one
// joined by its path:
//   - The root: both keep its nodev, read-write or read-only (runc's
//     read-only remount fails and is redone with the mount's flags; crun's
//     remount of the root fails and is redone with nodev). Without the
//     user namespace runc drops it for a read-only root and crun for any.
//   - A bind under runc (made inside the container's mount namespace):
//     nodev for "rbind", "bind" and "bind,dev"; with "ro", "nosuid" or
//     "rdev" runc fails the mount (EPERM) and the container does not start.
//   - A bind under crun: crun clones each bind source outside the user
//     namespace (open_tree), where nothing is locked, and moves the clone
//     in. It stays nodev for "rbind", "bind", "rbind,nosuid" and
//     "rbind,dev" (crun applies none of those flags there), and loses it
//     for "ro" (crun remounts it with the flags its options make) and for
//     "rdev": the nodes open. So a lock is relied on for crun's root only,
//     and a crun bind is read as outside a user namespace.
//
// A path to the runtime's own user namespace is no new one: both runtimes
// refuse it (setns: EINVAL).

// userNSLocksMounts reports whether the container spec describes has a
// mount namespace its runtime makes inside a user namespace of the
// container's (a "user" entry, with or without a path, and a "mount" entry
// without a path, which the runtime copies from its own): where the
// container's process is in another user namespace than the runtime's
// (otherUserNS), that copy locks the flags of its mounts. A mount
// namespace joined by its path was not copied by the runtime: what it
// holds is not read as locked.
func userNSLocksMounts(spec *specs.Spec) bool {
	if spec.Linux == nil {
		return false
	}
	user, mount := false, false
	for _, ns := range spec.Linux.Namespaces {
		switch ns.Type {
		case specs.UserNamespace:
			user = true
		case specs.MountNamespace:
			if ns.Path != "" {
				return false
			}
			mount = true
		}
	}
	return user && mount
}

// otherUserNS reports whether process pid is in a user namespace other
// than ref's (a pid, or "self"), both read under procRoot: the stat of
// each one's ns/user link gives its namespace's device and inode. What
// cannot be read (no pid, a process gone, a proc root without them) is not
// another: the flags of its mounts are not known to be locked.
func otherUserNS(procRoot string, pid int, ref string) bool {
	if pid <= 0 {
		return false
	}
	var own, ctr unix.Stat_t
	if unix.Stat(filepath.Join(procRoot, ref, "ns", "user"), &own) != nil ||
		unix.Stat(filepath.Join(procRoot, strconv.Itoa(pid), "ns", "user"), &ctr) != nil {
		return false
	}
	return own.Dev != ctr.Dev || own.Ino != ctr.Ino
}

// lockedByUserNS returns the check bindRuntime.locked makes for the
// container spec describes, whose process is pid, read under procRoot
// against ref's user namespace (that of the runtime: the hook's own,
// "self", which the runtime runs it in): nothing is read unless the spec
// gives the container a user namespace and a mount namespace the runtime
// makes (userNSLocksMounts), and only when asked (readRoot, readDirs).
func lockedByUserNS(spec *specs.Spec, procRoot string, pid int, ref string) func() bool {
	return func() bool {
		return userNSLocksMounts(spec) && otherUserNS(procRoot, pid, ref)
	}
}
