// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"bufio"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
)

// mountT mounts src at dst (fstype "" for a bind) with flags, undone when
// the test ends; flags with MS_NODEV are applied by a remount, as a bind
// takes them.
func mountT(t testing.TB, src, dst, fstype string, flags uintptr) {
	t.Helper()
	bind := fstype == ""
	first := flags
	if bind {
		first = unix.MS_BIND
	}
	require.NoError(t, unix.Mount(src, dst, fstype, first, ""), "mount %s at %s", src, dst)
	t.Cleanup(func() { _ = unix.Unmount(dst, unix.MNT_DETACH) })
	if bind && flags&^unix.MS_BIND != 0 {
		require.NoError(t, unix.Mount("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|flags, ""))
	}
}

// gpuNodeDir makes a directory on the host's /dev holding a node of GPU 2
// (195:2), as /dev/nvidia-caps holds the capability nodes, removed when
// the test ends, and returns it.
func gpuNodeDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("/dev", "gg-test-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, unix.Mknod(filepath.Join(dir, "nv"), unix.S_IFCHR|0o600, int(unix.Mkdev(195, 2))))
	return dir
}

// otherNamespaceDir starts a process in a mount namespace of its own with
// a tmpfs at a directory of the host (empty here), as another container's
// /dev is, and returns that directory reached through the process's root
// link (/proc/<pid>/root/...).
func otherNamespaceDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c",
		`mount -t tmpfs gg "$0" && echo ready && exec sleep 3600`, dir)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err, "the process in its own mount namespace did not start")
	require.Equal(t, "ready\n", line)
	return filepath.Join("/proc", strconv.Itoa(cmd.Process.Pid), "root", dir)
}

// A bind source reaches the host's /dev (every GPU node) or a GPU's node
// under names a spelling or one stat does not tell, and only a device
// cgroup stops what it brings: a rootful runtime's container in its
// caller's cgroup (crun --cgroup-manager=disabled, podman --cgroups=disabled)
// claims what it reaches, one in a cgroup of its own nothing.
//   - A symlink to /proc, or a relative source that resolves to it:
//     /proc/<pid>/root/dev is the host's /dev (statfs tells a procfs).
//   - A directory that holds, below it, a bind of /dev, a procfs or a
//     devtmpfs (a chroot's or a build root's): a recursive bind (rbind, or
//     neither bind nor rbind, which runc and crun refuse and another
//     runtime may take either way) brings it along; a bind alone does not,
//     nor does a nodev mount open the nodes on it.
//   - A part of the host's /dev (a directory of it, a bind of one, a bind
//     of a single node): the GPU nodes in it.
//   - A symlink into another mount namespace (/proc/<pid>/root/...: another
//     container's /dev, with the nodes of its GPUs): what it is cannot be
//     told from this one, and counts as the host's /dev.
//
// A directory whose nodes open counts as reaching every GPU whatever is
// below it (TestBoundDirWithoutNodevReachesEveryGPU): those that should
// reach less are on a nodev mount, or bound nodev.
func TestBindSourceReachesHostDevUnderAnotherName(t *testing.T) {
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	root := os.Geteuid() == 0
	all := []int{0, 1, 2, 3}
	for _, tc := range []struct {
		name     string
		needRoot bool
		// source returns the bind source and its options.
		source func(t *testing.T) (string, []string)
		want   []int // GPUs claimed without a device cgroup
	}{
		{"a symlink to /proc", false, func(t *testing.T) (string, []string) {
			link := filepath.Join(t.TempDir(), "p")
			require.NoError(t, os.Symlink("/proc", link))
			return link, []string{"rbind"}
		}, all},
		{"a symlink to /proc, bound alone", false, func(t *testing.T) (string, []string) {
			link := filepath.Join(t.TempDir(), "p")
			require.NoError(t, os.Symlink("/proc", link))
			return link, []string{"bind"}
		}, all},
		{"a relative source that resolves to /proc", false, func(*testing.T) (string, []string) {
			return "../../../../../../../../../../proc", []string{"rbind"}
		}, all},
		{"a directory holding a bind of /dev", true, func(t *testing.T) (string, []string) {
			dir := t.TempDir()
			require.NoError(t, os.Mkdir(filepath.Join(dir, "dev"), 0o755))
			mountT(t, "/dev", filepath.Join(dir, "dev"), "", unix.MS_BIND)
			return dir, []string{"rbind"}
		}, all},
		{"a directory holding a bind of /dev, bound neither way", true, func(t *testing.T) (string, []string) {
			dir := t.TempDir()
			require.NoError(t, os.Mkdir(filepath.Join(dir, "dev"), 0o755))
			mountT(t, "/dev", filepath.Join(dir, "dev"), "", unix.MS_BIND)
			return dir, nil
		}, all},
		{"a directory holding a bind of /dev, bound alone", true, func(t *testing.T) (string, []string) {
			dir := nodevDir(t)
			require.NoError(t, os.Mkdir(filepath.Join(dir, "dev"), 0o755))
			mountT(t, "/dev", filepath.Join(dir, "dev"), "", unix.MS_BIND)
			return dir, []string{"bind", "rprivate"}
		}, nil},
		{"a directory holding a nodev bind of /dev", true, func(t *testing.T) (string, []string) {
			dir := nodevDir(t)
			require.NoError(t, os.Mkdir(filepath.Join(dir, "dev"), 0o755))
			mountT(t, "/dev", filepath.Join(dir, "dev"), "", unix.MS_NODEV)
			return dir, []string{"rbind"}
		}, nil},
		{"a directory holding a procfs", true, func(t *testing.T) (string, []string) {
			dir := t.TempDir()
			require.NoError(t, os.MkdirAll(filepath.Join(dir, "a", "proc"), 0o755))
			mountT(t, "proc", filepath.Join(dir, "a", "proc"), "proc", unix.MS_NODEV|unix.MS_NOSUID)
			return dir, []string{"rbind"}
		}, all},
		{"a directory holding a devtmpfs", true, func(t *testing.T) (string, []string) {
			dir := t.TempDir()
			require.NoError(t, os.Mkdir(filepath.Join(dir, "dev"), 0o755))
			mountT(t, "devtmpfs", filepath.Join(dir, "dev"), "devtmpfs", 0)
			return dir, []string{"rbind"}
		}, all},
		{"a directory of the host's /dev holding a GPU node", true, func(t *testing.T) (string, []string) {
			return gpuNodeDir(t), []string{"bind"}
		}, []int{2}},
		{"a directory holding a bind of part of /dev", true, func(t *testing.T) (string, []string) {
			dir := nodevDir(t)
			require.NoError(t, os.Mkdir(filepath.Join(dir, "caps"), 0o755))
			mountT(t, gpuNodeDir(t), filepath.Join(dir, "caps"), "", unix.MS_BIND)
			return dir, []string{"rbind"}
		}, []int{2}},
		{"a directory holding a bind of a GPU node", true, func(t *testing.T) (string, []string) {
			dir := nodevDir(t)
			require.NoError(t, os.WriteFile(filepath.Join(dir, "gpu"), nil, 0o600))
			mountT(t, filepath.Join(gpuNodeDir(t), "nv"), filepath.Join(dir, "gpu"), "", unix.MS_BIND)
			return dir, []string{"rbind"}
		}, []int{2}},
		{"a symlink into another mount namespace", true, func(t *testing.T) (string, []string) {
			link := filepath.Join(t.TempDir(), "other")
			require.NoError(t, os.Symlink(otherNamespaceDir(t), link))
			return link, []string{"bind"}
		}, all},
		{"an ordinary directory, bound nodev", false, func(t *testing.T) (string, []string) {
			dir := t.TempDir()
			require.NoError(t, os.Mkdir(filepath.Join(dir, "dev"), 0o755))
			return dir, []string{"rbind", "nodev"}
		}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.needRoot && !root {
				t.Skip("mounts need root")
			}
			src, opts := tc.source(t)
			options := func(s *specs.Spec) { s.Mounts[1].Options = opts }
			for _, fenced := range []bool{false, true} {
				cfg := staticConfig(t)
				opened := 0
				container := session
				if fenced {
					container = "0::/machine.slice/libpod-train.scope\n"
				}
				e := cgroupProc(t, container, session, &opened)
				in := e.readInput(strings.NewReader(bindState(t, "train", 4242, specs.StateCreating, src, "/x", options)))
				require.NoError(t, in.specErr)
				require.NoError(t, e.runInput(t.Context(), PhaseCreateRuntime, cfg, in, io.Discard))
				if fenced || tc.want == nil {
					require.Empty(t, ledgerState(t, cfg).Claims, "fenced %v: nothing opens", fenced)
					continue
				}
				var want []string
				for _, i := range tc.want {
					want = append(want, gpuUUIDs[i])
				}
				require.ElementsMatch(t, want, claimedGPUs(t, ledgerState(t, cfg).Claims, "train"))
			}
		})
	}
}

// A rootless runtime sets up no device cgroup at all: a bind of /proc
// under another name reaches the host's /dev there too.
func TestRootlessBindOfProcUnderAnotherName(t *testing.T) {
	link := filepath.Join(t.TempDir(), "p")
	require.NoError(t, os.Symlink("/proc", link))
	e := testEnv(new(int))
	e.userNS = func() RuntimeUserNS { return Rootless }
	for _, src := range []string{link, "../../../../../../../../../../proc"} {
		in := e.readInput(strings.NewReader(bindState(t, "train", 4242, specs.StateCreating, src, "/x")))
		require.NoError(t, in.specErr)
		require.False(t, in.NeverClaims(), src)
		require.True(t, in.request.HostDevMounted, src)
	}
}

// nodevDir is a directory on a nodev mount (a tmpfs of the test's own),
// where container storage mounted with mountopt = "nodev" puts a root
// filesystem.
func nodevDir(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("a nodev mount needs root")
	}
	dir := t.TempDir()
	mountT(t, "gg", dir, "tmpfs", unix.MS_NODEV)
	return dir
}

// devDir is a directory on a mount that is not nodev, where a device node
// an image carries would open: a tmpfs of the test's own where the test
// may mount one, otherwise the test's temporary directory, and the test is
// skipped where that is nodev (systemd's tmp.mount mounts /tmp so).
func devDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if os.Geteuid() == 0 {
		mountT(t, "gg", dir, "tmpfs", 0)
		return dir
	}
	var fs unix.Statfs_t
	require.NoError(t, unix.Statfs(dir, &fs))
	if int64(fs.Flags)&unix.ST_NODEV != 0 { //nolint:unconvert // int32 on some platforms
		t.Skip("the temporary directory is on a nodev mount, and mounting one that is not needs root")
	}
	return dir
}

// A rootful engine unpacks an image as root and makes every device node a
// layer carries; a rootful runtime binds the root filesystem as it is
// mounted. Where no device cgroup applies, a node of a GPU's numbers
// anywhere in the image opens that GPU, and the hook cannot walk the
// image: unless the root is nodev in the container, the container counts as
// reaching every GPU, with a source and a refusal that say so and what to
// do. A rootless runtime's engine cannot make nodes: not read there. A
// device cgroup of the container's own fences it. A runtime whose user
// namespace cannot be told is read as rootful too.
//
// The root's mount being nodev (container storage mounted nodev) is not
// enough: only runc (runc.amd64 too) keeps that nodev, and only for a
// read-write root (runc 1.1.5 remounts a read-only root MS_RDONLY alone;
// crun 1.8.1 drops it for any root). Under crun, another runtime or one
// that cannot be told, and under runc with a read-only root, a root on
// nodev storage counts, each with the remedy that helps there: a device
// cgroup or runc with a read-write root; a read-write root. Where the
// storage is not nodev, its remedy says what else the runtime needs.
func TestRootWithoutNodevReachesEveryGPU(t *testing.T) {
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	own := "0::/machine.slice/libpod-train.scope\n"
	const (
		notNodev = "root filesystem not mounted nodev"
		dropped  = "root filesystem's nodev dropped by a runtime not known to be runc"
		readOnly = "read-only root filesystem remounted without nodev by runc"
		fixRunc  = "run it under runc with a read-write root, or give it a user namespace of its own under runc or crun"
		fixRW    = "give it a read-write root (runc keeps the nodev of its storage there)"
	)
	for _, tc := range []struct {
		name      string
		nodev     bool
		readonly  bool
		container string
		userNS    RuntimeUserNS
		// exe is the runtime's executable: runc's where "", none
		// (unreadable) for "-".
		exe     string
		bindDev bool
		// src is in the source of every claim, fix in the refusal under
		// all_devices = "reject"; "" src for no claim.
		src, fix string
	}{
		{name: "rootful, no device cgroup", container: session, userNS: Rootful, src: notNodev, fix: `mount the container storage nodev (containers/storage: mountopt = "nodev"`},
		{name: "rootful, no device cgroup, root nodev", nodev: true, container: session, userNS: Rootful},
		{name: "rootful, no device cgroup, root nodev, runc.amd64", nodev: true, container: session, userNS: Rootful, exe: "/usr/local/bin/runc.amd64"},
		{name: "rootful, no device cgroup, root nodev, runc, read-only", nodev: true, readonly: true, container: session, userNS: Rootful,
			src: readOnly, fix: fixRW},
		{name: "rootful, no device cgroup, root nodev, crun", nodev: true, container: session, userNS: Rootful, exe: "/usr/bin/crun",
			src: dropped, fix: fixRunc},
		{name: "rootful, no device cgroup, root nodev, crun, read-only", nodev: true, readonly: true, container: session, userNS: Rootful,
			exe: "/usr/bin/crun", src: dropped, fix: fixRunc},
		{name: "rootful, no device cgroup, root nodev, youki", nodev: true, container: session, userNS: Rootful, exe: "/usr/bin/youki",
			src: dropped, fix: fixRunc},
		{name: "rootful, no device cgroup, root nodev, runtime unreadable", nodev: true, container: session, userNS: Rootful, exe: "-",
			src: dropped, fix: fixRunc},
		{name: "rootful, no device cgroup, crun", container: session, userNS: Rootful, exe: "/usr/bin/crun",
			src: notNodev, fix: `run it under runc with a read-write root on container storage mounted nodev (containers/storage: mountopt = "nodev" in storage.conf), ` +
				"or on such storage give it a user namespace of its own under runc or crun"},
		{name: "rootful, no device cgroup, runc, read-only", readonly: true, container: session, userNS: Rootful,
			src: notNodev, fix: `give it a read-write root on container storage mounted nodev (containers/storage: mountopt = "nodev"`},
		{name: "rootful, own device cgroup", container: own, userNS: Rootful},
		{name: "rootful, own device cgroup, root nodev, crun, read-only", nodev: true, readonly: true, container: own, userNS: Rootful, exe: "/usr/bin/crun"},
		{name: "rootless", container: session, userNS: Rootless},
		{name: "rootless, root nodev, crun, read-only", nodev: true, readonly: true, container: session, userNS: Rootless, exe: "/usr/bin/crun"},
		{name: "user namespace unknown", container: own, userNS: UnknownUserNS, src: "no device cgroup ("},
		// Another cause names the claim: its remedy is not nodev alone.
		{name: "rootful, no device cgroup, /dev bound too", container: session, userNS: Rootful, bindDev: true, src: "host /dev bound in"},
		{name: "rootful, no device cgroup, root nodev, crun, /dev bound too", nodev: true, container: session, userNS: Rootful,
			exe: "/usr/bin/crun", bindDev: true, src: "host /dev bound in"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := nodevDir
			if !tc.nodev {
				base = devDir
			}
			rootfs := filepath.Join(base(t), "rootfs")
			require.NoError(t, os.MkdirAll(filepath.Join(rootfs, "opt"), 0o755))
			if os.Geteuid() == 0 {
				// What an image may carry; whether or not it is there, the
				// hook reads nothing in the root.
				require.NoError(t, unix.Mknod(filepath.Join(rootfs, "opt", "gpu"), unix.S_IFCHR|0o666, int(unix.Mkdev(195, 0))))
			}
			src := "/srv/data"
			if tc.bindDev {
				src = "/dev"
			}
			state := func() string {
				return bindState(t, "train", 4242, specs.StateCreating, src, "/data", func(s *specs.Spec) {
					s.Root = &specs.Root{Path: rootfs, Readonly: tc.readonly}
					s.Mounts = append(s.Mounts, devTmpfs)
				})
			}
			cfg := staticConfig(t)
			opened := 0
			e := cgroupProc(t, tc.container, session, &opened)
			e.userNS = func() RuntimeUserNS { return tc.userNS }
			e.markerDir = t.TempDir()
			switch tc.exe {
			case "":
			case "-":
				runtimeExe(t, e.procRoot, 4000, "")
			default:
				runtimeExe(t, e.procRoot, 4000, tc.exe)
			}
			in := e.readInput(strings.NewReader(state()))
			require.NoError(t, in.specErr)
			require.Equal(t, tc.src == "", in.NeverClaims())
			require.NoError(t, e.runInput(t.Context(), PhaseCreateRuntime, cfg, in, io.Discard))
			if tc.src == "" {
				require.Zero(t, opened, "nothing to claim")
				return
			}
			claims := ledgerState(t, cfg).Claims
			require.ElementsMatch(t, gpuUUIDs, claimedGPUs(t, claims, "train"))
			for _, c := range claims {
				assert.Contains(t, c.Source, tc.src)
			}

			cfg = staticConfig(t)
			cfg.Policy.AllDevices = config.AllReject
			err := e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(state()), io.Discard)
			require.ErrorIs(t, err, guard.ErrRejected)
			if tc.fix != "" {
				require.ErrorContains(t, err, tc.fix)
				require.ErrorContains(t, err, "device cgroup of its own")
			}
			if tc.nodev {
				require.NotContains(t, err.Error(), "mount the container storage nodev", "it is: that is no remedy")
			}
		})
	}
}

// readRoot asks which runtime runs the hook only for a rootful root that
// may count, once for the root and the binds together: for a root on a
// nodev mount (whose nodev the runtime may drop) and for one counted
// already (for its remedy); not for a rootless runtime's, nor where the
// host's /dev is bound in (every GPU opens whatever the root is), nor
// where there is no root.
func TestReadRootAsksTheRuntimeOnce(t *testing.T) {
	for _, tc := range []struct {
		name  string
		b     boundSources
		dir   bool   // a directory on a nodev mount bound in too
		exe   string // the runtime's
		asked int
		want  bool // imageNodes
		drop  devices.RootNodev
	}{
		{name: "nodev, runc", b: boundSources{rootNodev: true}, exe: "/usr/sbin/runc", asked: 1},
		{name: "nodev, runc, a bind too", b: boundSources{rootNodev: true}, dir: true, exe: "/usr/sbin/runc", asked: 1},
		{name: "nodev, runc, read-only", b: boundSources{rootNodev: true, rootReadonly: true}, exe: "/usr/sbin/runc", asked: 1,
			want: true, drop: devices.RootNodevDroppedReadOnly},
		{name: "nodev, crun, a bind too", b: boundSources{rootNodev: true}, dir: true, exe: "/usr/bin/crun", asked: 1,
			want: true, drop: devices.RootNodevDroppedByRuntime},
		{name: "not nodev, runc", b: boundSources{imageNodes: true}, exe: "/usr/sbin/runc", asked: 1, want: true},
		{name: "not nodev, crun", b: boundSources{imageNodes: true}, exe: "/usr/bin/crun", asked: 1,
			want: true, drop: devices.RootNodevDroppedByRuntime},
		{name: "no root", exe: "/usr/bin/crun"},
		{name: "rootless", b: boundSources{rootless: true}, exe: "/usr/bin/crun"},
		{name: "host /dev bound in", b: boundSources{rootNodev: true, hostDev: true}, exe: "/usr/bin/crun"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.b
			b.host = &hostDirs{}
			if tc.dir {
				src := nodevDir(t)
				var st unix.Stat_t
				require.NoError(t, unix.Stat(src, &st))
				b.dirs = []boundDir{{src: src, dst: "/x", dev: uint64(st.Dev), ino: st.Ino}} //nolint:unconvert // uint32 on some platforms
			}
			proc := t.TempDir()
			fakeProc(t, proc, 4000, 1, path.Base(tc.exe))
			runtimeExe(t, proc, 4000, tc.exe)
			asked := 0
			b.runtime = bindRuntime{procRoot: proc, ppid: func() int { asked++; return 4000 }}
			b.readDirs()
			b.readRoot()
			require.Equal(t, tc.asked, asked)
			require.Equal(t, tc.want, b.imageNodes)
			require.Equal(t, tc.drop, b.rootDrop)
		})
	}
}

// The mount table is read as the kernel writes it: escaped paths, optional
// fields before the separator, the device as major:minor.
func TestParseMountinfo(t *testing.T) {
	for _, tc := range []struct {
		name, line string
		want       mountEntry
		ok         bool
	}{
		{"devtmpfs", "22 1 0:5 / /dev rw,nosuid,relatime shared:2 - devtmpfs devtmpfs rw,size=100k",
			mountEntry{dev: unix.Mkdev(0, 5), root: "/", point: "/dev", fstype: "devtmpfs"}, true},
		{"a bind of part of /dev, nodev", "40 22 0:5 /nvidia-caps /srv/c/caps rw,nodev - devtmpfs devtmpfs rw",
			mountEntry{dev: unix.Mkdev(0, 5), root: "/nvidia-caps", point: "/srv/c/caps", nodev: true, fstype: "devtmpfs"}, true},
		{"no optional field, escaped paths", `41 1 259:1 /a\040b /srv/x\134y\011z rw - ext4 /dev/vda rw`,
			mountEntry{dev: unix.Mkdev(259, 1), root: "/a b", point: "/srv/x\\y\tz", fstype: "ext4"}, true},
		{"several optional fields", "42 1 0:50 / /srv/p rw shared:7 master:3 propagate_from:2 - proc proc rw",
			mountEntry{dev: unix.Mkdev(0, 50), root: "/", point: "/srv/p", fstype: "proc"}, true},
		{"no separator", "42 1 0:50 / /srv/p rw shared:7 proc proc rw", mountEntry{}, false},
		{"no device", "42 1 x / /srv/p rw - proc proc rw", mountEntry{}, false},
		{"a cut escape", `42 1 0:50 / /srv/p\04 rw - proc proc rw`, mountEntry{}, false},
		{"a relative mount point", "42 1 0:50 / srv rw - proc proc rw", mountEntry{}, false},
		{"short", "42 1 0:50 /", mountEntry{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := parseMountinfo(tc.line)
			require.Equal(t, tc.ok, ok)
			require.Equal(t, tc.want, got)
		})
	}
}

// What cannot be read of the mount table counts as the host's /dev: a table
// past its bound, a line past its bound, a line that does not parse. Only
// mounts at or below a bind source count.
func TestReadSubmountsFailsClosed(t *testing.T) {
	line := "30 1 0:40 / /srv/other rw - proc proc rw\n"
	for _, tc := range []struct {
		name    string
		table   string
		wantErr bool
		hostDev bool
	}{
		{"a proc beside the source", line, false, false},
		{"a proc below the source", "31 1 0:40 / /srv/chroot/proc rw - proc proc rw\n", false, true},
		{"a proc at a sibling's prefix", "31 1 0:40 / /srv/chroot2/proc rw - proc proc rw\n", false, false},
		{"a table past its bound", strings.Repeat(line, maxMountinfoBytes/len(line)+1), true, false},
		{"a line past its bound", "31 1 0:40 / /srv/" + strings.Repeat("a", maxMountinfoLine) + " rw - proc proc rw\n", true, false},
		{"a line that does not parse", line + "garbage\n", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := boundSources{host: &hostDirs{}}
			budget := maxDevEntries
			err := b.readSubmounts(strings.NewReader(tc.table), []boundDir{{src: "/srv/chroot", dst: "/x", recursive: true}}, &budget)
			require.Equal(t, tc.wantErr, err != nil, "%v", err)
			require.Equal(t, tc.hostDev, b.hostDev)
		})
	}
}

// A recursive bind brings the mounts below its source with their own
// flags: one that is not nodev by its per-mount options (an ext4, xfs or
// tmpfs mounted below a source on a nodev mount) opens every device node
// on it, one root made or an engine copied, in a rootful runtime's
// container that no device cgroup fences. It counts as reaching every GPU
// (nodeDirs), named by its mount point and where the container sees it.
// The bind's "nodev", or a remount with flags of its own, makes the bind's
// top mount nodev, not those below (runc and crun remount the top alone);
// "rnodev" makes every mount below nodev, "rdev" none (AT_RECURSIVE). The
// source's own mount is read by its statfs (readDirs), not here, and one
// beside it is not bound; a namespace file holds no node; a rootless
// runtime's nodes do not open. At most maxNodeDirs are recorded.
func TestReadSubmountsNotNodev(t *testing.T) {
	const src = "/srv/vol"
	line := func(point, opts, fstype, super string) string {
		return "40 30 0:77 / " + point + " " + opts + " shared:9 - " + fstype + " /dev/vdb " + super + "\n"
	}
	data := line("/srv/vol/data", "rw,relatime", "ext4", "rw")
	nodevData := line("/srv/vol/data", "rw,nosuid,nodev,relatime", "ext4", "rw")
	atData := []devices.NodeDir{{Path: "/srv/vol/data", BoundAt: "/x/data", Below: src}}
	rbind := boundDir{src: src, dst: "/x", recursive: true}
	with := func(edit func(*boundDir)) []boundDir {
		d := rbind
		edit(&d)
		return []boundDir{d}
	}
	for _, tc := range []struct {
		name     string
		table    string
		trees    []boundDir // rbind where nil
		rootless bool
		want     []devices.NodeDir
		hostDev  bool
	}{
		{name: "a nodev submount", table: nodevData},
		{name: "a submount not nodev", table: data, want: atData},
		{name: "a tmpfs not nodev, deeper", table: line(`/srv/vol/a\040b/c`, "rw", "tmpfs", "rw,size=4k"),
			want: []devices.NodeDir{{Path: "/srv/vol/a b/c", BoundAt: "/x/a b/c", Below: src}}},
		// nodev is a per-mount flag: the superblock's options (after the
		// separator) do not make a mount nodev.
		{name: "a submount not nodev, its superblock's options nodev", table: line("/srv/vol/data", "rw", "ext4", "rw,nodev"), want: atData},
		{name: "several submounts, one nodev", table: line("/srv/vol/a", "rw,nodev", "xfs", "rw") + line("/srv/vol/b", "rw", "xfs", "rw"),
			want: []devices.NodeDir{{Path: "/srv/vol/b", BoundAt: "/x/b", Below: src}}},
		{name: "the source's own mount, not nodev", table: line(src, "rw", "ext4", "rw")},
		{name: "a mount beside the source", table: line("/srv/other/data", "rw", "ext4", "rw")},
		{name: "a mount at a sibling's prefix", table: line("/srv/vol2/data", "rw", "ext4", "rw")},
		{name: "a submount not nodev, the bind nodev", table: data,
			trees: with(func(d *boundDir) { d.nodev = true }), want: atData},
		{name: "a submount not nodev, the bind remounted with flags of its own", table: data,
			trees: with(func(d *boundDir) { d.ownFlags = true }), want: atData},
		{name: "a submount not nodev, the bind rnodev", table: data,
			trees: with(func(d *boundDir) { d.nodev, d.below = true, belowSet })},
		// Named with the rdev that clears its own nodev: dropping it is
		// the remedy.
		{name: "a nodev submount, the bind rdev", table: nodevData,
			trees: with(func(d *boundDir) { d.below = belowCleared }),
			want:  []devices.NodeDir{{Path: "/srv/vol/data", BoundAt: "/x/data", Below: src, NodevDropped: true, Clears: []string{"rdev"}}}},
		{name: "a submount not nodev, the bind rdev", table: data,
			trees: with(func(d *boundDir) { d.below = belowCleared }),
			want:  []devices.NodeDir{{Path: "/srv/vol/data", BoundAt: "/x/data", Below: src, Clears: []string{"rdev"}}}},
		// Named with the source as it was bound, before its symlinks were
		// resolved.
		{name: "a submount not nodev, the source bound through a link", table: data,
			trees: with(func(d *boundDir) { d.bound = "/srv/link" }),
			want:  []devices.NodeDir{{Path: "/srv/vol/data", BoundAt: "/x/data", Below: "/srv/link"}}},
		{name: "a submount not nodev, rootless", table: data, rootless: true},
		// A namespace file is neither a directory nor a node.
		{name: "a namespace file not nodev", table: "40 30 0:4 net:[4026532512] /srv/vol/netns/a rw - nsfs nsfs rw\n"},
		// What a bind of /sys brings: none of them makes a node.
		{name: "the kernel's file systems below a bind of /sys", table: "40 30 0:25 / /srv/vol/kernel/security rw,nosuid,relatime - securityfs securityfs rw\n" +
			"41 30 0:26 / /srv/vol/fs/cgroup rw,nosuid,relatime - cgroup2 cgroup2 rw\n" +
			"42 30 0:27 / /srv/vol/fs/bpf rw,nosuid,relatime - bpf bpf rw,mode=700\n" +
			"43 30 0:7 / /srv/vol/kernel/debug rw,nosuid,relatime - debugfs debugfs rw\n" +
			"44 30 0:28 / /srv/vol/pts rw,nosuid,relatime - devpts devpts rw,mode=600\n"},
		// hugetlbfs makes nodes: left to the rule.
		{name: "a hugetlbfs not nodev", table: line("/srv/vol/huge", "rw,relatime", "hugetlbfs", "rw"),
			want: []devices.NodeDir{{Path: "/srv/vol/huge", BoundAt: "/x/huge", Below: src}}},
		// Each bind brings it where it binds it, with its own options.
		{name: "a submount not nodev, the source bound twice, once rnodev", table: data,
			trees: []boundDir{{src: src, dst: "/y", recursive: true, below: belowSet}, rbind}, want: atData},
		{name: "a nodev devtmpfs, the bind rdev", table: "40 30 0:77 / /srv/vol/dev rw,nodev - devtmpfs devtmpfs rw\n",
			trees: with(func(d *boundDir) { d.below = belowCleared }), hostDev: true},
		{name: "a nodev devtmpfs", table: "40 30 0:77 / /srv/vol/dev rw,nodev - devtmpfs devtmpfs rw\n"},
		// Past maxNodeDirs the container reaches every GPU node already:
		// the others are not recorded.
		{name: "more submounts not nodev than are recorded", table: manySubmounts(maxNodeDirs + 8), want: manyNodeDirs(maxNodeDirs)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// The host's /dev read, its filesystem none of these.
			b := boundSources{host: &hostDirs{devRead: true}, rootless: tc.rootless}
			trees := tc.trees
			if trees == nil {
				trees = []boundDir{rbind}
			}
			budget := maxDevEntries
			require.NoError(t, b.readSubmounts(strings.NewReader(tc.table), trees, &budget))
			require.Equal(t, tc.want, b.nodeDirs)
			require.Equal(t, tc.hostDev, b.hostDev)
		})
	}
}

// manySubmounts is a mount table of n tmpfs mounts not nodev below
// /srv/vol, and manyNodeDirs the first n of them as TestReadSubmountsNotNodev
// reads them, bound at /x.
func manySubmounts(n int) string {
	var table strings.Builder
	for i := range n {
		table.WriteString("40 30 0:77 / /srv/vol/" + strconv.Itoa(i) + " rw - tmpfs tmpfs rw\n")
	}
	return table.String()
}

func manyNodeDirs(n int) []devices.NodeDir {
	dirs := make([]devices.NodeDir, 0, n)
	for i := range n {
		dirs = append(dirs, devices.NodeDir{Path: "/srv/vol/" + strconv.Itoa(i), BoundAt: "/x/" + strconv.Itoa(i), Below: "/srv/vol"})
	}
	return dirs
}

// The bind options runc and crun apply to the mounts below a recursive
// bind's source: "rnodev" and "rdev" (mount_setattr AT_RECURSIVE); "nodev"
// and "dev" go to the bind's top mount alone. Where both recursive ones are
// given, which wins is not read: "rdev".
func TestNodevBelow(t *testing.T) {
	for _, tc := range []struct {
		opts []string
		want belowNodev
	}{
		{[]string{"rbind"}, belowOwn},
		{[]string{"rbind", "nodev"}, belowOwn},
		{[]string{"rbind", "dev"}, belowOwn},
		{[]string{"rbind", "rnodev"}, belowSet},
		{[]string{"rbind", "rdev"}, belowCleared},
		{[]string{"rbind", "rnodev", "rdev"}, belowCleared},
		{[]string{"rbind", "rdev", "rnodev"}, belowCleared},
		{[]string{"rbind", "rw,rnodev"}, belowOwn},
	} {
		require.Equal(t, tc.want, nodevBelow(tc.opts), "%v", tc.opts)
	}
}

// A directory on a nodev mount, bound recursively, brings what is mounted
// below it: a filesystem mounted there without nodev (where root made a
// node, or an engine copied one) opens every node on it, in a rootful
// runtime's container that no device cgroup fences, whatever the
// directory's own mount is. It counts as reaching every GPU, with a source
// and a refusal that name the mount and what helps: its own nodev, or the
// bind's rnodev, not the bind's nodev, which makes its top mount nodev
// alone (runc and crun remount that one). A bind alone brings nothing
// below; a nodev mount, or a bind given rnodev, opens no node. The bind's
// rdev clears every nodev below and its own (its source then named first,
// with the rdev to drop), and its dev its own. A rootless runtime's nodes
// do not open; a device cgroup fences them.
func TestSubmountWithoutNodevReachesEveryGPU(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounts need root")
	}
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	own := "0::/machine.slice/libpod-train.scope\n"
	const (
		// The mount below (SUB) is named, with what helps for it.
		subSrc = "mount SUB below bind source SRC not mounted nodev: its device nodes open"
		subFix = "mount SUB nodev or give the bind of SRC the rnodev option (its nodev makes only its top mount nodev)"
	)
	for _, tc := range []struct {
		name      string
		subNodev  bool     // the mount below the source is nodev
		opts      []string // the bind's
		container string   // session where ""
		rootless  bool
		// src is in the source of every claim, fix in the refusal under
		// all_devices = "reject", notFix not (SRC the bind's source, SUB
		// the mount below it); "" src for no claim.
		src, fix, notFix string
	}{
		{name: "rbind", opts: []string{"rbind"}, src: subSrc, fix: subFix},
		{name: "neither bind nor rbind", src: subSrc, fix: subFix},
		{name: "rbind, the mount below nodev", subNodev: true, opts: []string{"rbind"}},
		{name: "bind", opts: []string{"bind"}},
		{name: "rbind nodev", opts: []string{"rbind", "nodev"}, src: subSrc, fix: subFix, notFix: "give its bind the nodev option"},
		{name: "rbind rnodev", opts: []string{"rbind", "rnodev"}},
		// The source is on a nodev mount the bind's rdev clears (and one
		// more: the mount below): only the bind's options help.
		{name: "rbind rdev, the mount below nodev", subNodev: true, opts: []string{"rbind", "rdev"},
			src: "bind source SRC (and 1 more directory) bound without nodev: its mount's nodev not kept",
			fix: "drop rdev from the bind of SRC and give it the nodev option"},
		// The bind's dev clears its own nodev, not the nodev below.
		{name: "rbind dev, the mount below nodev", subNodev: true, opts: []string{"rbind", "dev"},
			src: "bind source SRC bound without nodev: its mount's nodev not kept",
			fix: "drop dev from the bind of SRC and give it the nodev option"},
		{name: "rbind, rootless", opts: []string{"rbind"}, rootless: true},
		{name: "rbind, own device cgroup", opts: []string{"rbind"}, container: own},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := nodevDir(t)
			sub := filepath.Join(src, "data")
			require.NoError(t, os.Mkdir(sub, 0o755))
			var flags uintptr
			if tc.subNodev {
				flags = unix.MS_NODEV
			}
			mountT(t, "gg", sub, "tmpfs", flags)
			// What may be there; the hook reads nothing in it.
			require.NoError(t, unix.Mknod(filepath.Join(sub, "gpu"), unix.S_IFCHR|0o666, int(unix.Mkdev(195, 0))))
			named := strings.NewReplacer("SRC", src, "SUB", sub)
			container, userNS := tc.container, Rootful
			if container == "" {
				container = session
			}
			if tc.rootless {
				userNS = Rootless
			}
			state := func() string {
				return bindState(t, "train", 4242, specs.StateCreating, src, "/data", func(s *specs.Spec) { s.Mounts[1].Options = tc.opts })
			}
			cfg := staticConfig(t)
			opened := 0
			e := cgroupProc(t, container, session, &opened)
			e.userNS = func() RuntimeUserNS { return userNS }
			e.markerDir = t.TempDir()
			in := e.readInput(strings.NewReader(state()))
			require.NoError(t, in.specErr)
			require.Equal(t, tc.src == "", in.NeverClaims())
			require.NoError(t, e.runInput(t.Context(), PhaseCreateRuntime, cfg, in, io.Discard))
			if tc.src == "" {
				require.Zero(t, opened, "nothing to claim")
				return
			}
			claims := ledgerState(t, cfg).Claims
			require.ElementsMatch(t, gpuUUIDs, claimedGPUs(t, claims, "train"))
			for _, c := range claims {
				assert.Contains(t, c.Source, named.Replace(tc.src))
			}

			cfg = staticConfig(t)
			cfg.Policy.AllDevices = config.AllReject
			err := e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(state()), io.Discard)
			require.ErrorIs(t, err, guard.ErrRejected)
			require.ErrorContains(t, err, "device cgroup of its own")
			require.ErrorContains(t, err, named.Replace(tc.fix))
			if tc.notFix != "" {
				require.NotContains(t, err.Error(), tc.notFix, "its nodev makes only the bind's top mount nodev")
			}
		})
	}
}

// runc and crun bind recursively for "rbind", singly for "bind"; with
// neither they refuse the bind, and another runtime may bind either way.
func TestRecursiveBind(t *testing.T) {
	for _, tc := range []struct {
		opts []string
		want bool
	}{
		{[]string{"rbind", "rprivate"}, true},
		{[]string{"bind", "rprivate", "nodev"}, false},
		{[]string{"bind", "rbind"}, true},
		{nil, true},
		{[]string{"ro"}, true},
	} {
		require.Equal(t, tc.want, recursiveBind(specs.Mount{Type: "bind", Options: tc.opts}), "%v", tc.opts)
	}
}

// A directory bound in may hold device nodes nobody made under /dev: an
// engine copies image content, nodes and all, into a new named volume, and
// anyone may mknod in a host directory. Unless the directory's mount is
// nodev or its bind is given nodev, a rootful runtime's container without a
// device cgroup opens them, and the hook does not list the directory: it
// counts as reaching every GPU, with a source and a refusal that name the
// directory and what to do. An overlay's layer brings its nodes through the
// overlay, whose own nodev option alone stops them. A file bound in is no
// directory; a part of the host's /dev is listed (its nodes are known); a
// rootless runtime's nodes do not open; a device cgroup fences them.
//
// A directory on a nodev mount bound without options of its own stays
// nodev in the container under runc alone (runc.amd64, a release binary,
// and a runc replaced on disk while it runs, among its names): crun
// remounts every bind with the flags its options make (none), so there its
// nodes open, and any other runtime, or one that cannot be told, counts as
// crun. The bind's own nodev option makes it nodev under either.
func TestBoundDirWithoutNodevReachesEveryGPU(t *testing.T) {
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	own := "0::/machine.slice/libpod-train.scope\n"
	bound := func(opts ...string) func(string) func(*specs.Spec) {
		return func(string) func(*specs.Spec) { return func(s *specs.Spec) { s.Mounts[1].Options = opts } }
	}
	overlay := func(layer string, opts ...string) func(*specs.Spec) {
		return func(s *specs.Spec) {
			s.Mounts[1] = specs.Mount{Destination: "/data", Type: "overlay", Source: "overlay",
				Options: append([]string{"lowerdir=" + layer}, opts...)}
		}
	}
	for _, tc := range []struct {
		name      string
		dir       func(t *testing.T) string
		edit      func(src string) func(*specs.Spec)
		container string
		// userNS is the runtime's: Rootful where it is left zero, and
		// unknown where unknown says so.
		userNS  RuntimeUserNS
		unknown bool
		// exe is the runtime's executable (the hook's parent's exe link):
		// runc's where it is left "", none (unreadable) for "-".
		exe  string
		want string // a source of every claim; "" for none
		// fix, where set, is the remedy the refusal names (SRC the
		// directory), in place of the one its mount tells.
		fix string
	}{
		{name: "a directory not mounted nodev", dir: devDir, want: "bind source "},
		{name: "a directory not mounted nodev, runtime unknown", dir: devDir, container: own, unknown: true, want: "bind source "},
		{name: "a directory not mounted nodev, bound nodev", dir: devDir, edit: bound("rbind", "nodev")},
		{name: "a directory not mounted nodev, bound rnodev", dir: devDir, edit: bound("rbind", "rnodev")},
		// The bind's dev (or rdev) clears nodev, the bind's and the
		// mount's: it must go.
		{name: "a directory not mounted nodev, bound nodev and dev", dir: devDir, edit: bound("rbind", "nodev", "dev"), want: "bind source ",
			fix: "drop dev from the bind of SRC and give it the nodev option (while its bind says dev, mounting SRC nodev does not help)"},
		{name: "a directory not mounted nodev, bound rdev", dir: devDir, edit: bound("rbind", "rdev"), want: "bind source ",
			fix: "drop rdev from the bind of SRC and give it the nodev option"},
		{name: "a directory mounted nodev, bound dev", dir: nodevDir, edit: bound("rbind", "dev"), want: "bind source ",
			fix: "drop dev from the bind of SRC and give it the nodev option (the nodev of its mount does not carry over)"},
		{name: "a directory mounted nodev, runtime crun, bound dev and rdev", dir: nodevDir, exe: "/usr/bin/crun", edit: bound("rbind", "dev", "rdev"),
			want: "bind source ", fix: "drop dev and rdev from the bind of SRC and give it the nodev option"},
		{name: "a directory mounted nodev, runtime runc", dir: nodevDir},
		{name: "a directory mounted nodev, runtime crun", dir: nodevDir, exe: "/usr/bin/crun", want: "bind source "},
		{name: "a directory mounted nodev, runtime unreadable", dir: nodevDir, exe: "-", want: "bind source "},
		{name: "a directory mounted nodev, runtime youki", dir: nodevDir, exe: "/usr/local/bin/youki", want: "bind source "},
		{name: "a directory mounted nodev, runtime runc.amd64", dir: nodevDir, exe: "/usr/local/bin/runc.amd64"},
		{name: "a directory mounted nodev, runtime runc replaced on disk", dir: nodevDir, exe: "/usr/sbin/runc (deleted)"},
		{name: "a directory mounted nodev, runtime docker-runc", dir: nodevDir, exe: "/usr/bin/docker-runc", want: "bind source "},
		{name: "a directory mounted nodev, runtime crun, bound bind", dir: nodevDir, exe: "/usr/bin/crun", edit: bound("bind"), want: "bind source "},
		{name: "a directory mounted nodev, runtime crun, bound nodev", dir: nodevDir, exe: "/usr/bin/crun", edit: bound("rbind", "nodev")},
		{name: "a directory mounted nodev, runtime crun, bound bind,nodev", dir: nodevDir, exe: "/usr/bin/crun", edit: bound("bind", "nodev")},
		{name: "a directory mounted nodev, runtime crun, bound rnodev", dir: nodevDir, exe: "/usr/bin/crun", edit: bound("rbind", "rnodev")},
		{name: "a directory mounted nodev, runtime unreadable, bound nodev", dir: nodevDir, exe: "-", edit: bound("rbind", "nodev")},
		// runc and crun remount a bind with flags of its own (ro, nosuid,
		// …) with exactly those: the source's nodev does not carry over.
		{name: "a directory mounted nodev, bound ro", dir: nodevDir, edit: bound("rbind", "ro"), want: "bind source "},
		{name: "a directory mounted nodev, bound nosuid,nodev", dir: nodevDir, edit: bound("rbind", "nosuid", "nodev")},
		{name: "a directory mounted nodev, bound rprivate", dir: nodevDir, edit: bound("rbind", "rprivate")},
		{name: "a directory mounted nodev, runtime crun, bound rprivate", dir: nodevDir, exe: "/usr/bin/crun", edit: bound("rbind", "rprivate"), want: "bind source "},
		{name: "a directory mounted nodev, runtime crun, own device cgroup", dir: nodevDir, exe: "/usr/bin/crun", container: own},
		{name: "a directory mounted nodev, runtime crun, rootless", dir: nodevDir, exe: "/usr/bin/crun", userNS: Rootless},
		{name: "a directory not mounted nodev, own device cgroup", dir: devDir, container: own},
		{name: "a directory not mounted nodev, rootless", dir: devDir, userNS: Rootless},
		{name: "a file not mounted nodev", dir: func(t *testing.T) string {
			f := filepath.Join(devDir(t), "hosts")
			require.NoError(t, os.WriteFile(f, nil, 0o644))
			return f
		}},
		{name: "an overlay's layer mounted nodev, the overlay not", dir: nodevDir,
			edit: func(src string) func(*specs.Spec) { return overlay(src) }, want: "overlay at /data"},
		{name: "an overlay's layer not mounted nodev, the overlay nodev", dir: devDir,
			edit: func(src string) func(*specs.Spec) { return overlay(src, "nodev") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := tc.dir(t)
			if fi, err := os.Stat(src); err == nil && fi.IsDir() && os.Geteuid() == 0 {
				// What a volume filled from an image may hold; the hook
				// reads nothing in it.
				require.NoError(t, unix.Mknod(filepath.Join(src, "gpu"), unix.S_IFCHR|0o666, int(unix.Mkdev(195, 0))))
			}
			var edits []func(*specs.Spec)
			if tc.edit != nil {
				edits = append(edits, tc.edit(src))
			}
			container, userNS := tc.container, tc.userNS
			if container == "" {
				container = session
			}
			if userNS == UnknownUserNS && !tc.unknown {
				userNS = Rootful
			}
			state := func() string { return bindState(t, "train", 4242, specs.StateCreating, src, "/data", edits...) }
			cfg := staticConfig(t)
			opened := 0
			e := cgroupProc(t, container, session, &opened)
			e.userNS = func() RuntimeUserNS { return userNS }
			e.markerDir = t.TempDir()
			switch tc.exe {
			case "":
			case "-":
				runtimeExe(t, e.procRoot, 4000, "")
			default:
				runtimeExe(t, e.procRoot, 4000, tc.exe)
			}
			in := e.readInput(strings.NewReader(state()))
			require.NoError(t, in.specErr)
			require.Equal(t, tc.want == "", in.NeverClaims())
			require.NoError(t, e.runInput(t.Context(), PhaseCreateRuntime, cfg, in, io.Discard))
			if tc.want == "" {
				require.Zero(t, opened, "nothing to claim")
				return
			}
			// A bind source on a nodev mount counts only where its bind
			// drops that nodev: mounting it nodev is no remedy there.
			var fs unix.Statfs_t
			require.NoError(t, unix.Statfs(src, &fs))
			dropped := !strings.HasPrefix(tc.want, "overlay") && int64(fs.Flags)&unix.ST_NODEV != 0 //nolint:unconvert // int32 on some platforms
			claims := ledgerState(t, cfg).Claims
			require.ElementsMatch(t, gpuUUIDs, claimedGPUs(t, claims, "train"))
			for _, c := range claims {
				assert.Contains(t, c.Source, tc.want)
				if dropped {
					assert.Contains(t, c.Source, "bound without nodev: its mount's nodev not kept")
				} else {
					assert.Contains(t, c.Source, "not mounted nodev")
				}
				if !strings.HasPrefix(tc.want, "overlay") {
					assert.Contains(t, c.Source, src)
				}
			}

			cfg = staticConfig(t)
			cfg.Policy.AllDevices = config.AllReject
			err := e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(state()), io.Discard)
			require.ErrorIs(t, err, guard.ErrRejected)
			require.ErrorContains(t, err, "device cgroup of its own")
			switch {
			case tc.fix != "":
				require.ErrorContains(t, err, strings.ReplaceAll(tc.fix, "SRC", src))
				require.NotContains(t, err.Error(), "give its bind the nodev option", "it has one, or one would not help")
			case strings.HasPrefix(tc.want, "overlay"):
				require.ErrorContains(t, err, "give the overlay at /data the nodev option")
			case dropped:
				require.ErrorContains(t, err, "give the bind of "+src+" the nodev option")
				require.NotContains(t, err.Error(), "mount "+src+" nodev")
			default:
				require.ErrorContains(t, err, "mount "+src+" nodev or give its bind the nodev option")
			}
		})
	}
}

// What cannot be stat'ed below a bind source is not taken for gone: only a
// path that does not exist (ENOENT) is nothing the runtime binds; any other
// error cannot tell what is there, and the source counts as the host's
// /dev. A host /dev that cannot be stat'ed cannot tell which directories
// are part of it (whose nodes would be listed): the same.
func TestBoundTreeStatErrorsFailClosed(t *testing.T) {
	var dev unix.Stat_t
	require.NoError(t, unix.Stat("/dev", &dev))
	devNum := strconv.FormatUint(uint64(unix.Major(uint64(dev.Dev))), 10) + ":" + strconv.FormatUint(uint64(unix.Minor(uint64(dev.Dev))), 10) //nolint:unconvert // uint32 on some platforms
	src := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(src, "file"), nil, 0o600))
	for _, tc := range []struct {
		name    string
		point   string
		hostDev bool
	}{
		{"a part of /dev mounted below the source, gone", "caps", false},
		{"a part of /dev mounted below the source, its name too long to stat", strings.Repeat("a", 300), true},
		{"a part of /dev mounted below the source, below a file", "file/caps", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := boundSources{host: &hostDirs{}}
			budget := maxDevEntries
			table := "31 1 " + devNum + " /nvidia-caps " + filepath.Join(src, tc.point) + " rw - devtmpfs devtmpfs rw\n"
			err := b.readSubmounts(strings.NewReader(table), []boundDir{{src: src, dst: "/x", recursive: true}}, &budget)
			require.Equal(t, tc.hostDev, err != nil || b.hostDev, "%v", err)
		})
	}

	t.Run("the host's /dev cannot be stat'ed", func(t *testing.T) {
		dir := t.TempDir()
		var st unix.Stat_t
		require.NoError(t, unix.Stat(dir, &st))
		b := boundSources{host: &hostDirs{devRead: true}, // read, and found nothing
			dirs: []boundDir{{src: dir, dst: "/x", dev: uint64(st.Dev), ino: st.Ino, nodev: true}}} //nolint:unconvert // uint32 on some platforms
		b.readDirs()
		require.True(t, b.hostDev)
	})
}

// An entry of a part of the host's /dev that cannot be lstat'ed is not
// taken for gone: the bind source counts as the host's /dev. One gone
// meanwhile (ENOENT) is skipped.
func TestWalkDevLstatErrorFailsClosed(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("a directory on the host's /dev needs root")
	}
	dir := gpuNodeDir(t)
	var st unix.Stat_t
	require.NoError(t, unix.Stat(dir, &st))
	for _, tc := range []struct {
		err     error
		hostDev bool
	}{{unix.EIO, true}, {unix.ENOENT, false}} {
		t.Run(tc.err.Error(), func(t *testing.T) {
			lstatPath = func(p string, st *unix.Stat_t) error {
				if strings.HasSuffix(p, "/nv") {
					return tc.err
				}
				return unix.Lstat(p, st)
			}
			t.Cleanup(func() { lstatPath = unix.Lstat })
			b := boundSources{host: &hostDirs{}, dirs: []boundDir{{src: dir, dst: "/x", dev: uint64(st.Dev), ino: st.Ino}}} //nolint:unconvert // uint32 on some platforms
			b.readDirs()
			require.Equal(t, tc.hostDev, b.hostDev)
			require.Empty(t, b.nodes, "nothing read of the node")
		})
	}
}

// readDirs asks whether the runtime keeps a bind source's nodev only where
// the answer decides, a directory on a nodev mount bound without options
// of its own, and once for all of them: not for one on a mount that is not
// nodev, nor for one bound nodev or with flags of its own. The runtime is
// the hook's parent, told by its exe link; where nothing says, the source's
// nodev is not kept (crun's way).
func TestSourceFlagsKeptAskedOnceWhereItDecides(t *testing.T) {
	dir := func(t *testing.T, src string, d boundDir) boundDir {
		var st unix.Stat_t
		require.NoError(t, unix.Stat(src, &st))
		d.src, d.dst, d.dev, d.ino = src, "/x", uint64(st.Dev), st.Ino //nolint:unconvert // uint32 on some platforms
		return d
	}
	two := func(t *testing.T) []boundDir {
		return []boundDir{dir(t, nodevDir(t), boundDir{}), dir(t, nodevDir(t), boundDir{})}
	}
	for _, tc := range []struct {
		name  string
		dirs  func(t *testing.T) []boundDir
		exe   string // the runtime's; "" for no runtime to ask
		asked int    // reads of the runtime's pid
		want  int    // directories counted (nodeDirs)
	}{
		{name: "two on nodev mounts, runc", dirs: two, exe: "/usr/sbin/runc", asked: 1, want: 0},
		{name: "two on nodev mounts, crun", dirs: two, exe: "/usr/bin/crun", asked: 1, want: 2},
		{name: "on a nodev mount, no runtime to ask", want: 1,
			dirs: func(t *testing.T) []boundDir { return []boundDir{dir(t, nodevDir(t), boundDir{})} }},
		{name: "not on a nodev mount, bound nodev, bound ro", exe: "/usr/sbin/runc", want: 2,
			dirs: func(t *testing.T) []boundDir {
				return []boundDir{dir(t, devDir(t), boundDir{}), dir(t, nodevDir(t), boundDir{nodev: true}), dir(t, nodevDir(t), boundDir{ownFlags: true})}
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := boundSources{host: &hostDirs{}, dirs: tc.dirs(t)}
			asked := 0
			if tc.exe != "" {
				proc := t.TempDir()
				fakeProc(t, proc, 4000, 1, path.Base(tc.exe))
				runtimeExe(t, proc, 4000, tc.exe)
				b.runtime = bindRuntime{procRoot: proc, ppid: func() int { asked++; return 4000 }}
			}
			b.readDirs()
			require.False(t, b.hostDev)
			require.Equal(t, tc.asked, asked)
			require.Len(t, b.nodeDirs, tc.want)
		})
	}
}
