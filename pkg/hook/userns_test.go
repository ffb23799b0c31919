// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
)

// The user namespace of a process of a /proc tree made by userNSTree, as
// its ns/user link leads.
const (
	hostNS  = "host"  // the runtime's (self's)
	otherNS = "other" // another
	noNS    = ""      // none: the link cannot be read
)

// userNSTree gives the /proc tree root a user namespace link (ns/user) for
// self (the hook, in the runtime's: hostNS) and for pid, which leads to
// hostNS, otherNS or nowhere (noNS). Each namespace is a file of its own,
// told by its device and inode as the kernel's nsfs links are.
func userNSTree(t *testing.T, root string, pid int, ns string) {
	t.Helper()
	for _, n := range []string{hostNS, otherNS} {
		f := filepath.Join(root, "userns-"+n)
		if _, err := os.Stat(f); err != nil {
			require.NoError(t, os.WriteFile(f, nil, 0o644))
		}
	}
	link := func(proc, ns string) {
		dir := filepath.Join(root, proc, "ns")
		require.NoError(t, os.MkdirAll(dir, 0o755))
		require.NoError(t, os.RemoveAll(filepath.Join(dir, "user")))
		if ns != noNS {
			require.NoError(t, os.Symlink(filepath.Join(root, "userns-"+ns), filepath.Join(dir, "user")))
		}
	}
	link("self", hostNS)
	link(strconv.Itoa(pid), ns)
}

// userNSMounts gives a spec a user namespace of the container's own and a
// mount namespace the runtime makes in it, mapped as crun and runc need.
func userNSMounts(s *specs.Spec) {
	s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.MountNamespace}, specs.LinuxNamespace{Type: specs.UserNamespace})
	s.Linux.UIDMappings = []specs.LinuxIDMapping{{ContainerID: 0, HostID: 100000, Size: 65536}}
	s.Linux.GIDMappings = []specs.LinuxIDMapping{{ContainerID: 0, HostID: 100000, Size: 65536}}
}

// A rootful container that no device cgroup fences and that has a user
// namespace of its own (its process in another than the runtime's, which
// the hook runs in), in a mount namespace the runtime makes there, has the
// flags of its mounts locked by the kernel. Its root's nodev then holds
// under runc and under crun, read-only or not: a root on nodev storage
// reaches nothing, and the container is admitted under all_devices =
// "reject" with nothing claimed. A bind from a nodev mount holds it under
// runc whatever the bind's options (runc fails a remount that would clear
// it), not under crun, which clones binds outside the user namespace (and
// drops that nodev for "ro"): counted there, as before. Where the lock
// cannot be told (another runtime, the container's namespace unreadable or
// the runtime's own, no user or no new mount namespace in the spec) the
// container is read as before: its root counts. A root not on nodev
// storage counts under any, named with the remedy that helps there:
// storage mounted nodev.
func TestUserNSKeepsNodev(t *testing.T) {
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	own := "0::/machine.slice/libpod-train.scope\n"
	const (
		crun, runc, youki = "/usr/bin/crun", "/usr/sbin/runc", "/usr/bin/youki"
		dropped           = "root filesystem's nodev dropped by a runtime not known to be runc"
		readOnly          = "read-only root filesystem remounted without nodev by runc"
	)
	noUserNS := func(s *specs.Spec) {
		s.Linux.UIDMappings, s.Linux.GIDMappings = nil, nil
		s.Linux.Namespaces = slicesDelete(s.Linux.Namespaces, specs.UserNamespace)
	}
	for _, tc := range []struct {
		name      string
		exe       string
		readonly  bool
		rootDev   bool   // the root is not on a nodev mount
		ns        string // the container's user namespace (userNSTree)
		container string // its cgroup; session where ""
		edit      func(s *specs.Spec)
		// argv is the runtime's command line, none where nil.
		argv []string
		// bind is the options of a bind of a directory on a nodev mount,
		// none where nil.
		bind []string
		// src is in the source of every claim, fix in the refusal under
		// all_devices = "reject"; "" src for no claim.
		src, fix string
	}{
		{name: "crun", exe: crun, ns: otherNS},
		{name: "crun, read-only", exe: crun, readonly: true, ns: otherNS},
		{name: "runc, read-only", exe: runc, readonly: true, ns: otherNS},
		{name: "runc", exe: runc, ns: otherNS},
		{name: "crun, crun replaced on disk", exe: crun + " (deleted)", ns: otherNS},
		// crun 1.8 runs from a detached copy of itself: its link reads
		// "/", its first argument names it.
		{name: "crun from its detached copy", exe: "/", argv: []string{"/usr/bin/crun", "create"}, ns: otherNS},
		{name: "crun from its detached copy, read-only", exe: "/", argv: []string{"crun", "create"}, readonly: true, ns: otherNS},
		{name: "crun, a user namespace joined by its path", exe: crun, ns: otherNS, edit: func(s *specs.Spec) {
			s.Linux.Namespaces[len(s.Linux.Namespaces)-1].Path = "/proc/4100/ns/user"
		}},
		{name: "runc, read-only, a bind ro from a nodev mount", exe: runc, readonly: true, ns: otherNS, bind: []string{"rbind", "ro"}},
		{name: "runc, a bind rdev from a nodev mount", exe: runc, ns: otherNS, bind: []string{"rbind", "rdev"}},
		{name: "crun, own device cgroup", exe: crun, ns: otherNS, container: own},
		// Not locked, or not known to be.
		{name: "crun, a bind from a nodev mount", exe: crun, ns: otherNS, bind: []string{"rbind"},
			src: "bind source SRC bound without nodev: its mount's nodev not kept", fix: "give the bind of SRC the nodev option"},
		{name: "crun, a bind ro from a nodev mount", exe: crun, ns: otherNS, bind: []string{"rbind", "ro"},
			src: "bind source SRC bound without nodev: its mount's nodev not kept", fix: "give the bind of SRC the nodev option"},
		{name: "youki", exe: youki, ns: otherNS, src: dropped, fix: "run it under runc with a read-write root, or give it a user namespace of its own under runc or crun"},
		{name: "runtime unreadable", exe: "-", ns: otherNS, src: dropped},
		{name: "a detached copy called runc", exe: "/", argv: []string{"/usr/sbin/runc", "create"}, ns: otherNS, src: dropped},
		{name: "a detached copy without a command line", exe: "/", ns: otherNS, src: dropped},
		{name: "crun, the runtime's user namespace", exe: crun, ns: hostNS, src: dropped},
		{name: "crun, its user namespace unreadable", exe: crun, ns: noNS, src: dropped},
		{name: "runc, read-only, its user namespace unreadable", exe: runc, readonly: true, ns: noNS, src: readOnly},
		{name: "crun, no user namespace in the spec", exe: crun, ns: otherNS, edit: noUserNS, src: dropped},
		{name: "crun, a mount namespace joined by its path", exe: crun, ns: otherNS, src: dropped, edit: func(s *specs.Spec) {
			for i := range s.Linux.Namespaces {
				if s.Linux.Namespaces[i].Type == specs.MountNamespace {
					s.Linux.Namespaces[i].Path = "/proc/4100/ns/mnt"
				}
			}
		}},
		{name: "crun, no mount namespace in the spec", exe: crun, ns: otherNS, src: dropped, edit: func(s *specs.Spec) {
			s.Linux.Namespaces = slicesDelete(s.Linux.Namespaces, specs.MountNamespace)
		}},
		{name: "crun, the root not on a nodev mount", exe: crun, rootDev: true, ns: otherNS,
			src: "root filesystem not mounted nodev", fix: `mount the container storage nodev (containers/storage: mountopt = "nodev"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := nodevDir
			if tc.rootDev {
				base = devDir
			}
			rootfs := filepath.Join(base(t), "rootfs")
			require.NoError(t, os.MkdirAll(filepath.Join(rootfs, "opt"), 0o755))
			if os.Geteuid() == 0 {
				// What an image may carry; the hook reads nothing in the
				// root.
				require.NoError(t, unix.Mknod(filepath.Join(rootfs, "opt", "gpu"), unix.S_IFCHR|0o666, int(unix.Mkdev(195, 0))))
			}
			src := "/srv/data"
			if tc.bind != nil {
				src = nodevDir(t)
			}
			state := func() string {
				return bindState(t, "train", 4242, specs.StateCreating, src, "/data", func(s *specs.Spec) {
					s.Root = &specs.Root{Path: rootfs, Readonly: tc.readonly}
					s.Mounts = append(s.Mounts, devTmpfs)
					if tc.bind != nil {
						s.Mounts[1].Options = tc.bind
					}
					userNSMounts(s)
					if tc.edit != nil {
						tc.edit(s)
					}
				})
			}
			container := tc.container
			if container == "" {
				container = session
			}
			opened := 0
			e := cgroupProc(t, container, session, &opened)
			e.markerDir = t.TempDir()
			if tc.exe == "-" {
				runtimeExe(t, e.procRoot, 4000, "")
			} else {
				runtimeExe(t, e.procRoot, 4000, tc.exe)
			}
			if tc.argv != nil {
				runtimeCmdline(t, e.procRoot, 4000, tc.argv...)
			}
			userNSTree(t, e.procRoot, 4242, tc.ns)
			cfg := staticConfig(t)
			cfg.Policy.AllDevices = config.AllReject
			err := e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(state()), io.Discard)
			named := strings.NewReplacer("SRC", src)
			if tc.src == "" {
				require.NoError(t, err, "its mounts' nodev holds: nothing reaches a GPU")
				require.Zero(t, opened, "nothing to claim")
				return
			}
			require.ErrorIs(t, err, guard.ErrRejected)
			require.ErrorContains(t, err, named.Replace(tc.src))
			if tc.fix != "" {
				require.ErrorContains(t, err, named.Replace(tc.fix))
			}

			cfg = staticConfig(t)
			require.NoError(t, e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(state()), io.Discard))
			claims := ledgerState(t, cfg).Claims
			require.ElementsMatch(t, gpuUUIDs, claimedGPUs(t, claims, "train"))
			for _, c := range claims {
				assert.Contains(t, c.Source, named.Replace(tc.src))
			}
		})
	}
}

// runtimeCmdline writes the command line of pid in the /proc tree root as
// the kernel shows it: each argument ended by a NUL.
func runtimeCmdline(t *testing.T, root string, pid int, argv ...string) {
	t.Helper()
	require.NoError(t, os.WriteFile(filepath.Join(root, strconv.Itoa(pid), "cmdline"), []byte(strings.Join(argv, "\x00")+"\x00"), 0o644))
}

// The runtime that runs the hook is told by its executable's name, the
// link the kernel resolves (a symlink runc -> crun is crun): runc under
// its names (keepsFlagsName), crun, or neither. One that runs from a
// detached copy of its executable, as crun 1.8 does (the link reads "/"),
// is told by its first argument, crun's alone, read whole: a runc there
// is not known to be runc.
func TestRuntimeOf(t *testing.T) {
	long := "/" + strings.Repeat("x", maxArgv0Bytes) + "/crun"
	for _, tc := range []struct {
		name string
		exe  string   // "" for none
		argv []string // none where nil
		want Runtime
	}{
		{"runc", "/usr/sbin/runc", nil, RuntimeRunc},
		{"runc.amd64", "/usr/local/bin/runc.amd64", nil, RuntimeRunc},
		{"crun", "/usr/bin/crun", nil, RuntimeCrun},
		{"crun replaced on disk", "/usr/bin/crun (deleted)", nil, RuntimeCrun},
		{"crun, argv runc", "/usr/bin/crun", []string{"runc"}, RuntimeCrun},
		{"youki", "/usr/bin/youki", nil, RuntimeUnknown},
		{"crun's download name", "/usr/local/bin/crun-1.8.1-linux-amd64", nil, RuntimeUnknown},
		{"no exe", "", nil, RuntimeUnknown},
		{"a detached copy, argv crun", "/", []string{"crun", "--root", "/run/crun", "create"}, RuntimeCrun},
		{"a detached copy, argv a path to crun", "/", []string{"/usr/bin/crun", "create"}, RuntimeCrun},
		{"a detached copy, argv runc", "/", []string{"/usr/sbin/runc", "create"}, RuntimeUnknown},
		{"a detached copy, argv youki", "/", []string{"youki"}, RuntimeUnknown},
		{"a detached copy, argv past the bound", "/", []string{long}, RuntimeUnknown},
		{"a detached copy, no command line", "/", nil, RuntimeUnknown},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			fakeProc(t, root, 4000, 1, "rt")
			runtimeExe(t, root, 4000, tc.exe)
			if tc.argv != nil {
				runtimeCmdline(t, root, 4000, tc.argv...)
			}
			require.Equal(t, tc.want, runtimeOf(root, 4000))
		})
	}
}

// slicesDelete returns nss without the entries of type typ.
func slicesDelete(nss []specs.LinuxNamespace, typ specs.LinuxNamespaceType) []specs.LinuxNamespace {
	var out []specs.LinuxNamespace
	for _, ns := range nss {
		if ns.Type != typ {
			out = append(out, ns)
		}
	}
	return out
}

// Whether the container's user namespace locks its mounts is read only
// where it decides, once for the root and the binds together: for a root
// on a nodev mount under crun, or under runc read-only; for a root counted
// already, for its remedy (under runc or crun); for a bind from a nodev
// mount with flag options of its own. Not where runc keeps the nodev
// anyway (a read-write root, a bind without flag options), nor under a
// runtime whose mounts are not read as locked (crun's binds, any other
// runtime's root), nor for a rootless runtime's container, nor where the
// host's /dev is bound in.
func TestUserNSLockAskedOnlyWhereItDecides(t *testing.T) {
	const crun, runc, youki = "/usr/bin/crun", "/usr/sbin/runc", "/usr/bin/youki"
	for _, tc := range []struct {
		name  string
		b     boundSources
		dir   *boundDir // a directory on a nodev mount bound in, as given
		exe   string    // the runtime's
		asked int
		want  bool // imageNodes
		dirs  int  // nodeDirs
	}{
		{name: "root nodev, runc", b: boundSources{rootNodev: true}, exe: runc},
		{name: "root nodev, runc, read-only", b: boundSources{rootNodev: true, rootReadonly: true}, exe: runc, asked: 1},
		{name: "root nodev, crun", b: boundSources{rootNodev: true}, exe: crun, asked: 1},
		{name: "root nodev, youki", b: boundSources{rootNodev: true}, exe: youki, want: true},
		{name: "root not nodev, crun", b: boundSources{imageNodes: true}, exe: crun, asked: 1, want: true},
		{name: "root not nodev, runc", b: boundSources{imageNodes: true}, exe: runc, want: true},
		{name: "a bind, crun", dir: &boundDir{}, exe: crun, dirs: 1},
		{name: "a bind, runc", dir: &boundDir{}, exe: runc},
		{name: "a bind with flag options, runc", dir: &boundDir{ownFlags: true}, exe: runc, asked: 1},
		{name: "a bind with flag options, crun", dir: &boundDir{ownFlags: true}, exe: crun, asked: 1, dirs: 1},
		{name: "root nodev and a bind with flag options, crun", b: boundSources{rootNodev: true}, dir: &boundDir{ownFlags: true}, exe: crun,
			asked: 1, dirs: 1},
		{name: "root nodev and a bind with flag options, runc, read-only", b: boundSources{rootNodev: true, rootReadonly: true},
			dir: &boundDir{ownFlags: true}, exe: runc, asked: 1},
		{name: "rootless", b: boundSources{rootless: true, rootNodev: true}, exe: crun},
		{name: "host /dev bound in", b: boundSources{rootNodev: true, hostDev: true}, exe: crun},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.b
			b.host = &hostDirs{}
			if tc.dir != nil {
				src := nodevDir(t)
				var st unix.Stat_t
				require.NoError(t, unix.Stat(src, &st))
				d := *tc.dir
				d.src, d.dst, d.dev, d.ino = src, "/x", uint64(st.Dev), st.Ino //nolint:unconvert // uint32 on some platforms
				b.dirs = []boundDir{d}
			}
			proc := t.TempDir()
			fakeProc(t, proc, 4000, 1, path.Base(tc.exe))
			runtimeExe(t, proc, 4000, tc.exe)
			asked := 0
			b.runtime = bindRuntime{procRoot: proc, ppid: func() int { return 4000 }, locked: func() bool { asked++; return true }}
			b.readDirs()
			b.readRoot()
			require.False(t, b.hostDev && !tc.b.hostDev)
			require.Equal(t, tc.asked, asked)
			require.Equal(t, tc.want, b.imageNodes)
			require.Len(t, b.nodeDirs, tc.dirs)
		})
	}
}

// The spec tells whether the runtime makes the container's mount namespace
// in a user namespace of the container's (new or joined): a "user" entry
// and a "mount" entry without a path. A mount namespace joined by its path
// is not one the runtime copied.
func TestUserNSLocksMounts(t *testing.T) {
	user, mnt := specs.LinuxNamespace{Type: specs.UserNamespace}, specs.LinuxNamespace{Type: specs.MountNamespace}
	joined := func(ns specs.LinuxNamespace) specs.LinuxNamespace {
		ns.Path = "/proc/4100/ns/" + string(ns.Type)
		return ns
	}
	for _, tc := range []struct {
		name string
		nss  []specs.LinuxNamespace
		want bool
	}{
		{"user and mount", []specs.LinuxNamespace{{Type: specs.PIDNamespace}, mnt, user}, true},
		{"a user namespace joined, mount", []specs.LinuxNamespace{joined(user), mnt}, true},
		{"mount alone", []specs.LinuxNamespace{mnt}, false},
		{"user alone", []specs.LinuxNamespace{user}, false},
		{"user, a mount namespace joined", []specs.LinuxNamespace{user, joined(mnt)}, false},
		{"user, mount and a mount namespace joined", []specs.LinuxNamespace{user, mnt, joined(mnt)}, false},
		{"none", nil, false},
	} {
		require.Equal(t, tc.want, userNSLocksMounts(&specs.Spec{Linux: &specs.Linux{Namespaces: tc.nss}}), tc.name)
	}
	require.False(t, userNSLocksMounts(&specs.Spec{}), "no linux object")
}

// otherUserNS compares the kernel's user namespace links: this process is
// in its own, a child cloned into a new one (CLONE_NEWUSER: in it from its
// first instruction) is in another. What cannot be read is not another.
func TestOtherUserNSOfRealProcesses(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("reading another process's namespaces needs root")
	}
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip("sleep not installed")
	}
	require.False(t, otherUserNS("/proc", os.Getpid(), "self"), "this process")
	cmd := exec.Command(sleep, "600")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER}
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	require.True(t, otherUserNS("/proc", cmd.Process.Pid, "self"), "a child in a user namespace of its own")
	require.False(t, otherUserNS("/proc", 0, "self"), "no pid")
	require.False(t, otherUserNS(t.TempDir(), cmd.Process.Pid, "self"), "no proc tree")
}

// Recovery (RunningRequest) reads a running container's user namespace as
// its hook did, against the initial one, which a rootful runtime (its
// state root root's) runs in and which the recovering process is in where
// its uid_map says so: a root on a nodev mount then reaches nothing under
// crun, or under runc read-only, for a container in another. Not where the
// runtime cannot be told, nor where the recovering process is not in the
// initial user namespace, nor for a runtime whose user namespace is
// unknown, nor for a container in the initial one.
func TestRunningRequestUserNS(t *testing.T) {
	root := filepath.Join(nodevDir(t), "rootfs")
	require.NoError(t, os.MkdirAll(root, 0o755))
	const identity, mapped = "         0          0 4294967295\n", "         0     100000      65536\n"
	for _, tc := range []struct {
		name     string
		rt       Runtime
		readonly bool
		userNS   RuntimeUserNS
		ns       string // the container's (userNSTree)
		uidMap   string // the recovering process's
		drop     devices.RootNodev
		counted  bool
	}{
		{name: "crun", rt: RuntimeCrun, userNS: Rootful, ns: otherNS, uidMap: identity},
		{name: "crun, read-only", rt: RuntimeCrun, readonly: true, userNS: Rootful, ns: otherNS, uidMap: identity},
		{name: "runc, read-only", rt: RuntimeRunc, readonly: true, userNS: Rootful, ns: otherNS, uidMap: identity},
		{name: "runtime unknown", rt: RuntimeUnknown, userNS: Rootful, ns: otherNS, uidMap: identity, counted: true, drop: devices.RootNodevDroppedByRuntime},
		{name: "crun, in the initial user namespace", rt: RuntimeCrun, userNS: Rootful, ns: hostNS, uidMap: identity, counted: true,
			drop: devices.RootNodevDroppedByRuntime},
		{name: "crun, its user namespace unreadable", rt: RuntimeCrun, userNS: Rootful, ns: noNS, uidMap: identity, counted: true,
			drop: devices.RootNodevDroppedByRuntime},
		{name: "crun, recovered from another user namespace", rt: RuntimeCrun, userNS: Rootful, ns: otherNS, uidMap: mapped, counted: true,
			drop: devices.RootNodevDroppedByRuntime},
		{name: "crun, recovered where the uid_map cannot be read", rt: RuntimeCrun, userNS: Rootful, ns: otherNS, counted: true,
			drop: devices.RootNodevDroppedByRuntime},
		{name: "crun, the runtime's user namespace unknown", rt: RuntimeCrun, userNS: UnknownUserNS, ns: otherNS, uidMap: identity, counted: true,
			drop: devices.RootNodevDroppedByRuntime},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spec := &specs.Spec{Process: &specs.Process{Capabilities: podmanCaps()}, Root: &specs.Root{Path: root, Readonly: tc.readonly},
				Mounts: []specs.Mount{devTmpfs}, Linux: &specs.Linux{}}
			userNSMounts(spec)
			proc := t.TempDir()
			userNSTree(t, proc, 4242, tc.ns)
			if tc.uidMap != "" {
				require.NoError(t, os.WriteFile(filepath.Join(proc, "self", "uid_map"), []byte(tc.uidMap), 0o644))
			}
			req := devices.RequestFromSpec(spec)
			RunningRequest(&req, spec, t.TempDir(), proc, 4242, "train", tc.userNS, tc.rt)
			require.Equal(t, tc.counted, req.GPUNodesAllowed)
			require.Equal(t, tc.counted, req.ImageNodes)
			require.Equal(t, tc.drop, req.RootNodev)
		})
	}
}
