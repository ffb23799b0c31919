// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"bufio"
	"cmp"
	"errors"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// boundDir is a directory bound into a container (or an overlay layer),
// read by boundNodes as neither the host's / nor /dev: what it is and what
// it brings is read by readDirs.
type boundDir struct {
	// src is the source as the runtime resolves it (from the bundle when
	// relative), dst where the container sees it.
	src, dst string
	// recursive: the mounts below src come along (recursiveBind).
	recursive bool
	// below: what the bind's options make of the nodev of the mounts
	// below src, for a recursive bind (nodevBelow).
	below belowNodev
	// dev and ino are src as stat'ed, following symlinks as the runtime
	// does.
	dev, ino uint64
	// nodev: the mount's options make it nodev (mountNodev), where the
	// runtime mounts it: the bind, or the overlay a layer is of.
	nodev bool
	// ownFlags: the runtime remounts the bind with its options' flags
	// alone (remountsBind), so a nodev of the source's mount does not
	// carry over. Without them only runc keeps it; crun remounts every
	// bind so (sourceFlagsKept).
	ownFlags bool
	// layer: src is an overlay's layer, whose nodes open through the
	// overlay whatever the layer's own mount is (the kernel checks the
	// mount a node is opened on).
	layer bool
	// clears are the bind's options that clear nodev (clearingOptions),
	// named in the remedy: they must go for a nodev to help.
	clears []string
	// bound is src as it was bound, for messages, where src is changed to
	// the path it leads to (a recursive bind's, read for its submounts).
	bound string
}

// belowNodev is what a recursive bind's options make of the nodev flag of
// the mounts below its source, which come along with their own flags (the
// kernel copies each mount's flags into the tree it binds). runc and crun
// apply "nodev" and "dev", and every flag of a bind remounted with flags
// of its own (remountsBind), by a remount of the bind (MS_REMOUNT|MS_BIND),
// which the kernel applies to the bind's top mount alone, MS_REC or not:
// not to the mounts below it. "rnodev" and "rdev" they apply to every
// mount of the tree (mount_setattr(2) with AT_RECURSIVE).
type belowNodev uint8

const (
	// belowOwn: each mount below keeps its own nodev flag, or its lack.
	belowOwn belowNodev = iota
	// belowSet: "rnodev" makes every mount below nodev.
	belowSet
	// belowCleared: "rdev" clears every mount's nodev below, nodev ones
	// too (where "rnodev" is given as well, which wins is not read).
	belowCleared
)

// clearingOptions are the options among a bind's that clear nodev, "dev"
// (its top mount) and "rdev" (every mount of the tree), in the order
// given, each once: while one is there, a nodev option or a nodev mount
// does not make the mounts it clears nodev (mountNodev, nodevBelow), and
// the remedy says to drop it. An option is read as one word, as
// mountNodev reads it.
func clearingOptions(options []string) []string {
	var clears []string
	for _, o := range options {
		if (o == "dev" || o == "rdev") && !slices.Contains(clears, o) {
			clears = append(clears, o)
		}
	}
	return clears
}

// nodevBelow reads what a bind's options make of the nodev flag of the
// mounts below its source (belowNodev). An option is read as one word, as
// mountNodev reads it.
func nodevBelow(options []string) belowNodev {
	below := belowOwn
	for _, o := range options {
		switch o {
		case "rnodev":
			below = belowSet
		case "rdev":
			return belowCleared
		}
	}
	return below
}

// The bounds of what readDirs reads. Past them, what a directory brings
// cannot be told, and it counts as the host's /dev (fail closed).
const (
	// maxMountinfoBytes bounds /proc/self/mountinfo: a line is some 150
	// bytes, so some 25,000 mounts.
	maxMountinfoBytes = 4 << 20
	// maxMountinfoLine bounds one line: two paths of PATH_MAX, escaped.
	maxMountinfoLine = 64 << 10
	// maxDevEntries and maxDevDepth bound the walk of a part of the
	// host's /dev (all of /dev holds a few hundred entries).
	maxDevEntries = 4096
	maxDevDepth   = 8
	// maxNodeDirs bounds the mounts below bind sources recorded as
	// directories whose nodes open (nodeDirs): past it, no more are
	// recorded, the container reaching every GPU node already (messages
	// name the first and count the others).
	maxNodeDirs = 1024
)

// noNodesOn are the file system types (mountinfo's) below a bind source
// that hold no device node whatever their flags: a namespace file, and the
// kernel's own file systems whose directories have no mknod(2) (sysfs and
// what is mounted below /sys, devpts, mqueue). A bind of /sys brings a
// dozen of them, none nodev.
var noNodesOn = map[string]bool{
	"nsfs": true, "sysfs": true, "cgroup": true, "cgroup2": true, "securityfs": true, "debugfs": true,
	"tracefs": true, "pstore": true, "bpf": true, "configfs": true, "fusectl": true, "efivarfs": true,
	"selinuxfs": true, "binfmt_misc": true, "devpts": true, "mqueue": true,
}

// mountinfoPath is the mount table of the hook's mount namespace, where the
// runtime resolves bind sources.
const mountinfoPath = "/proc/self/mountinfo"

// lstatPath stats what lies below a part of the host's /dev (walkDev);
// tests make it fail as a host may.
var lstatPath = unix.Lstat

// readDirs reads what the directories bound in bring, for a container no
// device cgroup fences; what cannot be told counts as the host's /dev:
//   - Where each leads: filepath.EvalSymlinks, then a stat of the path it
//     gives, must find the directory the runtime binds. A path that leads
//     elsewhere went through a link this mount namespace does not show
//     (a symlink to /proc/<pid>/root/dev: another container's /dev, or
//     the host's, whatever its device nodes), or changed meanwhile.
//   - What filesystem it is on (statfs, read here and not in boundNodes, so
//     that a container its cgroup fences pays no statfs per directory): a
//     directory of a procfs leads to process roots (/proc, /proc/<pid>, a
//     task's: /proc/<pid>/root/dev is the host's /dev, or another
//     container's), or is read as if it did, as AddMount reads a source
//     spelled /proc/.... A statfs that fails (where the stat before it did
//     not) cannot tell, and counts as one.
//   - A directory on the host's /dev (its filesystem, other than /dev
//     itself, which boundNodes took): the character devices in it and
//     below it, bounded (walkDev).
//   - Any other directory, under a runtime that may be rootful: one whose
//     mount (the statfs above: its flags) is not nodev, bound without the
//     nodev option, or an overlay's layer where the overlay is not given
//     nodev, may hold any device node, and its nodes open: an engine
//     copies image content, nodes and all, into a new named volume, and a
//     node made on the host outside /dev sits anywhere. So does one on a
//     nodev mount bound without the nodev option, unless the runtime is
//     known to keep the source's nodev on the bind's top mount: runc
//     1.1.5 does where the bind has no flag options (ro, nosuid, …) of its
//     own, crun 1.8.1 never, remounting every bind with the flags its
//     options make (both verified: remountsBind). The runtime is read
//     only then (sourceFlagsKept: the hook's parent's executable, once),
//     and every runtime but runc, or one that cannot be told, counts as
//     crun. Under runc a bind with flag options keeps it too where the
//     container's user namespace locks it (bindKeepsNodev: read only for
//     such a bind, once); crun's binds are not read as locked. Such a
//     directory is not listed (a volume may hold millions of files): it
//     counts as reaching every GPU node (nodeDirs), named with its remedy,
//     the bind's nodev option (its dev and rdev dropped: clearingOptions).
//     A rootless runtime's engine cannot make nodes, nor does one open on
//     its mounts.
//   - For a recursive bind, the mounts at or below it (mountinfo, read
//     once, bounded), which come along: a procfs (every process's root),
//     a devtmpfs, the host's /dev (its filesystem's root), or a part of it
//     (its nodes, as above). The chroot's /srv/chroot/dev, a bind of
//     /dev, makes -v /srv/chroot:/x the host's /dev at /x/dev. Under a
//     runtime that may be rootful, any other mount below it (the source's
//     own is read by its statfs, above) that is not nodev by its own
//     per-mount options (mountinfo's) opens its nodes as a directory
//     above does, whatever the source's mount is: the mounts below keep
//     their own flags, and the bind's "nodev" (or a remount with flags of
//     its own) makes the bind's top mount nodev, not those below (crun's
//     remount of every bind clears the top mount's nodev alone: a nodev
//     mount below stays nodev, verified with crun 1.8.1);
//     "rnodev" makes every mount below nodev, "rdev" none (belowNodev).
//     An ext4, xfs or tmpfs mounted without nodev anywhere below a source
//     on a nodev mount holds whatever node root made there or an engine
//     copied: it counts as reaching every GPU node (nodeDirs, named by its
//     mount point and the bind's source, with its remedy, its own nodev or
//     the bind's rnodev, not the bind's nodev: belowBind; at most
//     maxNodeDirs of them). A
//     namespace file (nsfs: ip netns' /run/netns/<name>) and the kernel's
//     own file systems that make no node on mknod(2) (noNodesOn: what a
//     bind of /sys or /dev/pts brings) are left out.
//
// Nothing below a directory but the host's /dev is listed, and nothing in
// the container's root filesystem is read.
func (b *boundSources) readDirs() {
	var trees []boundDir
	budget := maxDevEntries
	if len(b.dirs) > 0 && !b.host.devKnown() {
		// Which directory is part of the host's /dev (its nodes then
		// listed) cannot be told.
		b.hostDev = true
		return
	}
	for _, d := range b.dirs {
		canon, ok := resolveDir(d)
		if !ok {
			b.hostDev = true
			return
		}
		var fs unix.Statfs_t
		if unix.Statfs(canon, &fs) != nil || int64(fs.Type) == unix.PROC_SUPER_MAGIC { //nolint:unconvert // int32 on some platforms
			b.hostDev = true
			return
		}
		switch {
		case b.host.onDev(d.dev):
			if !b.walkDev(canon, d.dst, d.dev, &budget, 0) {
				b.hostDev = true
				return
			}
		case !b.rootless && !d.nodev && (d.layer || int64(fs.Flags)&unix.ST_NODEV == 0 || !b.bindKeepsNodev(d)): //nolint:unconvert // int32 on some platforms
			// On a nodev mount, the runtime dropped it: only the bind's
			// own nodev option helps (the message says so), once the
			// options that clear it are gone.
			dropped := !d.layer && int64(fs.Flags)&unix.ST_NODEV != 0 //nolint:unconvert // int32 on some platforms
			b.nodeDirs = append(b.nodeDirs, devices.NodeDir{Path: d.src, BoundAt: d.dst, Overlay: d.layer, NodevDropped: dropped, Clears: d.clears})
		}
		if d.recursive {
			d.bound, d.src = d.src, canon
			trees = append(trees, d)
		}
	}
	b.dirs = nil
	if len(trees) == 0 {
		return
	}
	f, err := os.Open(mountinfoPath)
	if err != nil {
		b.hostDev = true
		return
	}
	defer func() { _ = f.Close() }()
	if err := b.readSubmounts(f, trees, &budget); err != nil {
		b.hostDev = true
	}
}

// runtimeKind is the runtime that mounts the container's binds and root
// (b.runtime: runc, crun, or one that cannot be told), asked once: it
// decides whether a bind source's nodev (bindKeepsNodev) and the root's
// (readRoot) are kept, so one read serves both.
func (b *boundSources) runtimeKind() Runtime {
	if !b.kindRead {
		b.kind, b.kindRead = b.runtime.runtime(), true
	}
	return b.kind
}

// sourceFlagsKept reports whether the runtime keeps a bind source's mount
// flags on a bind without flag options of its own: runc does; crun, or a
// runtime that cannot be told, does not.
func (b *boundSources) sourceFlagsKept() bool {
	return b.runtimeKind() == RuntimeRunc
}

// userNSLocked reports whether the container's user namespace locks the
// flags of its mounts (b.runtime.locked: userNSLocksMounts), asked once,
// and only where it decides.
func (b *boundSources) userNSLocked() bool {
	if !b.lockedRead {
		b.locked, b.lockedRead = b.runtime.userNSLocked(), true
	}
	return b.locked
}

// bindKeepsNodev reports whether the bind d, of a directory on a nodev
// mount, is nodev in the container without a nodev option of its own:
// under runc, which mounts it inside the container's mount namespace,
// where it has no flag options of its own (remountsBind), or where the
// container's user namespace locks the source's nodev (userNSLocked),
// which no remount clears (runc fails the mount, and the container does
// not start). crun, which clones a bind outside the container's user
// namespace, or a runtime that cannot be told, keeps it for no bind (see
// userNSLocksMounts). For a bind with flag options the lock is asked
// first: most containers have no user namespace of their own, which the
// spec tells without a read, and the runtime is not asked for them.
func (b *boundSources) bindKeepsNodev(d boundDir) bool {
	if d.ownFlags && !b.userNSLocked() {
		return false
	}
	return b.sourceFlagsKept()
}

// resolveDir returns the path d's source leads to in this mount namespace
// (symlinks followed, as the runtime follows them), and whether it is the
// directory d was stat'ed as.
func resolveDir(d boundDir) (string, bool) {
	canon, err := filepath.EvalSymlinks(d.src)
	if err != nil || !filepath.IsAbs(canon) {
		return "", false
	}
	var st unix.Stat_t
	if unix.Stat(canon, &st) != nil || uint64(st.Dev) != d.dev || st.Ino != d.ino { //nolint:unconvert // uint32 on some platforms
		return "", false
	}
	return canon, true
}

// errUntold is what cannot be told of the mounts below a bind source.
var errUntold = errors.New("the mounts below a bind source cannot be told")

// readSubmounts reads the mount table r (the /proc/self/mountinfo format)
// for the mounts at or below each of trees (canonical sources) and records
// what each brings (submount). An error: what they bring cannot be told
// (a table past its bounds, a line that does not parse, a part of /dev
// past the walk's bounds).
func (b *boundSources) readSubmounts(r io.Reader, trees []boundDir, budget *int) error {
	sc := bufio.NewScanner(io.LimitReader(r, maxMountinfoBytes+1))
	sc.Buffer(make([]byte, 0, 4096), maxMountinfoLine)
	read := 0
	for sc.Scan() {
		line := sc.Text()
		if read += len(line) + 1; read > maxMountinfoBytes {
			return errUntold
		}
		m, ok := parseMountinfo(line)
		if !ok {
			return errUntold
		}
		// Every tree it is below brings it: each bind's options may make
		// it nodev, or not, where it appears.
		for _, t := range trees {
			rel, below := pathBelow(m.point, t.src)
			if !below {
				continue
			}
			if !b.submount(m, t, rel, budget) {
				return errUntold
			}
			if b.hostDev {
				return nil
			}
		}
	}
	if err := sc.Err(); err != nil {
		return errUntold
	}
	return nil
}

// submount records what the mount m, at rel below the source of the
// recursive bind t (at t.dst in the container), brings: a procfs or a
// devtmpfs is the host's /dev (/proc/<pid>/root/dev; the kernel's one
// devtmpfs), and so is the root of the host's /dev's filesystem; a part of
// that filesystem brings the nodes in it (a single node, or a directory:
// walkDev). Its nodes do not open on a mount that is nodev by its own
// options, unless the bind's "rdev" clears them; a procfs leads elsewhere
// whatever its own flags. Any other mount below the source (not the
// source's own, rel "": readDirs reads it by its statfs and the bind's
// options), under a runtime that may be rootful, is a directory whose
// nodes open (nodeDirs) unless it is nodev by its own options (and no
// "rdev" clears them) or by the bind's "rnodev", or a namespace file.
// False: a part of /dev past the walk's bounds, or one that cannot be
// stat'ed (other than gone: ENOENT).
func (b *boundSources) submount(m mountEntry, t boundDir, rel string, budget *int) bool {
	if m.fstype == "proc" {
		b.hostDev = true
		return true
	}
	dst := path.Join(t.dst, rel)
	nodev := m.nodev && t.below != belowCleared
	onDev := b.host.onDev(m.dev)
	if !onDev && m.fstype != "devtmpfs" {
		if rel != "" && !noNodesOn[m.fstype] && !b.rootless && !nodev && t.below != belowSet && len(b.nodeDirs) < maxNodeDirs {
			b.nodeDirs = append(b.nodeDirs, belowBind(m, t, dst))
		}
		return true
	}
	if nodev {
		return true
	}
	if m.root == "/" || !onDev {
		// The root of the host's /dev, or a devtmpfs that the host's /dev
		// is not (one kernel devtmpfs: every node of it).
		b.hostDev = true
		return true
	}
	var st unix.Stat_t
	if err := unix.Stat(m.point, &st); err != nil {
		// Gone: nothing the runtime binds either. Any other error
		// cannot tell what is there.
		return errors.Is(err, unix.ENOENT)
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFCHR:
		b.addNode(m.point, dst, &st)
	case unix.S_IFDIR:
		return b.walkDev(m.point, dst, uint64(st.Dev), budget, 0) //nolint:unconvert // uint32 on some platforms
	}
	return true
}

// belowBind is the mount m, below the source of the recursive bind t and
// seen in the container at dst, as a directory whose nodes open
// (nodeDirs), named with the bind it comes in with: only its own nodev, or
// the bind's "rnodev", stops its nodes, and the bind's "rdev" clears
// either (NodevDropped where m is nodev itself).
func belowBind(m mountEntry, t boundDir, dst string) devices.NodeDir {
	d := devices.NodeDir{Path: m.point, BoundAt: dst, Below: cmp.Or(t.bound, t.src)}
	if t.below == belowCleared {
		d.NodevDropped, d.Clears = m.nodev, []string{"rdev"}
	}
	return d
}

// walkDev adds the character devices in dir, a directory on the host's
// /dev's filesystem seen in the container at dst, and in its directories
// on the same filesystem (fsDev: another mount below it is not bound with
// it, or is read from the mount table), within budget entries and
// maxDevDepth levels. Symlinks are not followed: in the container they
// resolve from its root. False: past the bounds, or a directory or an
// entry that cannot be read (an entry gone meanwhile, ENOENT, is skipped).
func (b *boundSources) walkDev(dir, dst string, fsDev uint64, budget *int, depth int) bool {
	if depth > maxDevDepth {
		return false
	}
	f, err := os.Open(dir) //nolint:gosec // a directory of the host's /dev a bind source leads to
	if err != nil {
		return false
	}
	defer func() { _ = f.Close() }()
	for {
		ents, err := f.ReadDir(64)
		for _, e := range ents {
			if *budget--; *budget < 0 {
				return false
			}
			if e.Type()&(fs.ModeCharDevice|fs.ModeDir) == 0 {
				continue
			}
			p, at := dir+"/"+e.Name(), path.Join(dst, e.Name())
			var st unix.Stat_t
			if err := lstatPath(p, &st); err != nil {
				if errors.Is(err, unix.ENOENT) {
					continue // gone
				}
				return false // what it is cannot be told
			}
			switch st.Mode & unix.S_IFMT {
			case unix.S_IFCHR:
				b.addNode(p, at, &st)
			case unix.S_IFDIR:
				if uint64(st.Dev) == fsDev && !b.walkDev(p, at, fsDev, budget, depth+1) { //nolint:unconvert // uint32 on some platforms
					return false
				}
			}
		}
		if errors.Is(err, io.EOF) || (err == nil && len(ents) == 0) {
			return true
		}
		if err != nil {
			return false
		}
	}
}

// addNode records the character device st, the host's path, seen in the
// container at dst.
func (b *boundSources) addNode(path, dst string, st *unix.Stat_t) {
	b.nodes = append(b.nodes, devices.LinuxDevice{Path: path, Type: "c",
		Major: int64(unix.Major(st.Rdev)), Minor: int64(unix.Minor(st.Rdev)), BoundAt: dst})
}

// pathBelow reports whether p is dir or below it, and p relative to dir.
// Both are clean absolute paths.
func pathBelow(p, dir string) (string, bool) {
	switch {
	case p == dir:
		return "", true
	case dir == "/":
		return p[1:], true
	case strings.HasPrefix(p, dir) && p[len(dir)] == '/':
		return p[len(dir)+1:], true
	}
	return "", false
}

// mountEntry is what readSubmounts reads of a line of /proc/self/mountinfo:
// "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw".
type mountEntry struct {
	dev         uint64 // the filesystem's device (major:minor), as st_dev
	root, point string // the root of the mount in its filesystem; where it is mounted
	nodev       bool   // its per-mount options hold nodev
	fstype      string
}

// parseMountinfo parses one line of /proc/self/mountinfo (proc(5)).
func parseMountinfo(line string) (mountEntry, bool) {
	f := strings.Split(line, " ")
	if len(f) < 10 {
		return mountEntry{}, false
	}
	sep := -1
	for i := 6; i < len(f); i++ {
		if f[i] == "-" {
			sep = i
			break
		}
	}
	if sep < 0 || sep+1 >= len(f) {
		return mountEntry{}, false
	}
	majStr, minStr, ok := strings.Cut(f[2], ":")
	if !ok {
		return mountEntry{}, false
	}
	major, err1 := strconv.ParseUint(majStr, 10, 32)
	minor, err2 := strconv.ParseUint(minStr, 10, 32)
	root, ok1 := unescapeMountinfo(f[3])
	point, ok2 := unescapeMountinfo(f[4])
	if err1 != nil || err2 != nil || !ok1 || !ok2 || root == "" || point == "" || point[0] != '/' {
		return mountEntry{}, false
	}
	m := mountEntry{dev: unix.Mkdev(uint32(major), uint32(minor)), root: root, point: path.Clean(point), fstype: f[sep+1]}
	for _, o := range strings.Split(f[5], ",") {
		if o == "nodev" {
			m.nodev = true
		}
	}
	return m, true
}

// unescapeMountinfo undoes the kernel's escapes of a mountinfo path: a
// space, tab, newline or backslash is written as \ooo (octal).
func unescapeMountinfo(s string) (string, bool) {
	if !strings.Contains(s, `\`) {
		return s, true
	}
	var out strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '\\' {
			out.WriteByte(s[i])
			continue
		}
		if i+4 > len(s) {
			return "", false
		}
		n, err := strconv.ParseUint(s[i+1:i+4], 8, 8)
		if err != nil {
			return "", false
		}
		out.WriteByte(byte(n))
		i += 3
	}
	return out.String(), true
}
