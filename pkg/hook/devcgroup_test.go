// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// bindState writes a bundle whose config.json binds the host path src at
// dst and denies every device but /dev/null in its device cgroup rules (an
// engine's default for an unprivileged container), with podman's default
// capabilities, a procfs at /proc and a PID namespace of its own (as every
// engine gives it), and returns the OCI state of container id with process
// pid in it.
//
// Each edit changes the spec before it is written.
func bindState(t *testing.T, id string, pid int, status specs.ContainerState, src, dst string, edits ...func(*specs.Spec)) string {
	t.Helper()
	one, three := int64(1), int64(3)
	spec := specs.Spec{Version: specs.Version, Process: &specs.Process{Env: []string{"PATH=/bin"}, Capabilities: podmanCaps()},
		Mounts: []specs.Mount{{Destination: "/proc", Type: "proc", Source: "proc"}, {Destination: dst, Source: src, Type: "bind", Options: []string{"rbind"}}},
		Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.PIDNamespace}}, Resources: &specs.LinuxResources{Devices: []specs.LinuxDeviceCgroup{
			{Allow: false, Access: "rwm"}, {Allow: true, Type: "c", Major: &one, Minor: &three, Access: "rwm"}}}}}
	for _, edit := range edits {
		edit(&spec)
	}
	data, err := json.Marshal(spec)
	require.NoError(t, err)
	bundle := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
	st, err := json.Marshal(specs.State{Version: specs.Version, ID: id, Status: status, Pid: pid, Bundle: bundle})
	require.NoError(t, err)
	return string(st)
}

// cgroupProc is a /proc tree with the container's process (pid 4242, its
// cgroup file container; none when "") and the runtime that runs the hook
// (pid 4000, runtime; none when ""), and an env that reads it as a rootful
// runtime's hook. The runtime is runc (its exe /usr/sbin/runc), which
// keeps a bind source's nodev on a bind without flag options: runtimeExe
// makes it another.
func cgroupProc(t *testing.T, container, runtime string, opened *int) env {
	t.Helper()
	root := t.TempDir()
	fakeProc(t, root, 4242, 4000, "app")
	fakeProc(t, root, 4000, 1, "runc")
	runtimeExe(t, root, 4000, "/usr/sbin/runc")
	if container != "" {
		require.NoError(t, os.WriteFile(filepath.Join(root, "4242", "cgroup"), []byte(container), 0o644))
	}
	if runtime != "" {
		require.NoError(t, os.WriteFile(filepath.Join(root, "4000", "cgroup"), []byte(runtime), 0o644))
	}
	e := testEnv(opened)
	e.procRoot = root
	e.getppid = func() int { return 4000 }
	e.userNS = func() RuntimeUserNS { return Rootful }
	return e
}

// runtimeExe makes the exe link of pid in the /proc tree root name exe
// (what the kernel's reads, "/usr/bin/crun"), or removes it where exe is
// "" (an exe that cannot be read).
func runtimeExe(t *testing.T, root string, pid int, exe string) {
	t.Helper()
	link := filepath.Join(root, strconv.Itoa(pid), "exe")
	require.NoError(t, os.RemoveAll(link))
	if exe != "" {
		require.NoError(t, os.Symlink(exe, link))
	}
}

// A rootful runtime that leaves the container's process in its caller's
// cgroup (crun --cgroup-manager=disabled, podman --cgroups=disabled) applies
// no device cgroup: the spec's deny rules stop nothing, and a bind of the
// host's /dev (or of what holds it) opens every GPU. Such a container claims
// every GPU (policy.privileged "declared", all_devices "claim"), or is
// refused under privileged = "reject". One in a cgroup of its own has its
// deny rules enforced and claims nothing, as before. Whatever cannot be told
// (a cgroup unreadable, v1 without a devices line) counts as no device
// cgroup.
func TestBindWithoutDeviceCgroup(t *testing.T) {
	const session = "/user.slice/user-0.slice/session-1.scope"
	// A symlink to /dev is bound as /dev: the runtime follows it.
	devLink := filepath.Join(t.TempDir(), "devlink")
	require.NoError(t, os.Symlink("/dev", devLink))
	for _, tc := range []struct {
		name               string
		container, runtime string // cgroup files; "" = unreadable
		enforced           bool
	}{
		{"v2 own cgroup (systemd)", "0::/machine.slice/libpod-train.scope\n", "0::" + session + "\n", true},
		{"v2 own cgroup (cgroupfs)", "0::/train\n", "0::" + session + "\n", true},
		// crun's systemd driver (podman, CRI-O) runs the process in a
		// "container" cgroup below the scope whose rules apply to it.
		{"v2 crun's sub-cgroup of its own scope", "0::/machine.slice/libpod-train.scope/container\n", "0::/machine.slice/libpod-conmon-train.scope\n", true},
		// podman --cgroups=split (quadlet's default): the container below
		// the service's cgroup, where conmon and the runtime run.
		{"v2 podman --cgroups=split", "0::/system.slice/web.service/libpod-payload-train\n", "0::/system.slice/web.service\n", true},
		// A systemd cgroupsPath "<slice>::<id>": runc and crun name the
		// unit "-<id>.scope".
		{"v2 systemd unit of an empty prefix", "0::/system.slice/-train.scope\n", "0::" + session + "\n", true},
		{"v2 a sub-cgroup of the caller's", "0::" + session + "/container\n", "0::" + session + "\n", false},
		{"v2 caller's cgroup (crun --cgroup-manager=disabled)", "0::" + session + "\n", "0::" + session + "\n", false},
		{"v2 the runtime's cgroup though named after the container", "0::/x/train\n", "0::/x/train\n", false},
		{"v2 above the runtime's cgroup", "0::/x/train\n", "0::/x/train/crun.scope\n", false},
		{"v1 own devices cgroup", "12:pids:/train\n11:devices:/train\n1:name=systemd:/train\n", "12:pids:/\n11:devices:/\n1:name=systemd:" + session + "\n", true},
		// The devices line decides, not the pids one liveness.ProcessCgroup
		// would pick.
		{"v1 own pids cgroup, caller's devices cgroup", "12:pids:/train\n11:devices:" + session + "\n", "12:pids:/\n11:devices:" + session + "\n", false},
		{"hybrid: own devices cgroup, caller's unified one", "11:devices:/train\n0::" + session + "\n", "11:devices:/\n0::" + session + "\n", true},
		{"v1 without a devices line", "12:pids:/train\n", "12:pids:/\n", false},
		{"the container's cgroup unreadable", "", "0::" + session + "\n", false},
		{"the runtime's cgroup unreadable", "0::/train\n", "", false},
	} {
		for _, src := range []string{"/dev", "/", "/proc/self/root/dev", devLink} {
			name := tc.name + " " + src
			if src == devLink {
				name = tc.name + " a symlink to /dev"
			}
			t.Run(name, func(t *testing.T) {
				cfg := staticConfig(t)
				opened := 0
				e := cgroupProc(t, tc.container, tc.runtime, &opened)
				in := e.readInput(strings.NewReader(bindState(t, "train", 4242, specs.StateCreating, src, "/hostdev")))
				require.NoError(t, in.specErr)
				require.Equal(t, tc.enforced, in.NeverClaims())
				require.NoError(t, e.runInput(t.Context(), PhaseCreateRuntime, cfg, in, io.Discard))
				if tc.enforced {
					require.Zero(t, opened, "the deny rules hold: nothing to claim")
					return
				}
				snap := ledgerState(t, cfg)
				var got []string
				for _, c := range snap.Claims {
					require.Equal(t, "train", c.Owner.ContainerID)
					got = append(got, c.Device.UUID)
				}
				require.ElementsMatch(t, gpuUUIDs, got, "every GPU opens through the host's /dev")

				cfg = staticConfig(t)
				cfg.Policy.Privileged = config.PrivilegedReject
				err := e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(bindState(t, "train", 4242, specs.StateCreating, src, "/hostdev")), io.Discard)
				require.ErrorIs(t, err, guard.ErrRejected)
				require.ErrorContains(t, err, `policy.privileged = "reject"`)
			})
		}
	}
}

// Poststop's state has no live process to read (pid 0, or the pid of a
// process that has gone): it cannot tell whether create-runtime saw a device
// cgroup, so it reads the ledger, and releases what create-runtime claimed
// for a container in its caller's cgroup.
func TestPoststopReleasesWithoutDeviceCgroup(t *testing.T) {
	const shared = "0::/user.slice/user-0.slice/session-1.scope\n"
	cfg := staticConfig(t)
	opened := 0
	e := cgroupProc(t, shared, shared, &opened)
	e.markerDir = "" // the ledger alone must lead poststop there
	require.NoError(t, e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(bindState(t, "train", 4242, specs.StateCreating, "/dev", "/dev")), io.Discard))
	snap := ledgerState(t, cfg)
	require.Len(t, snap.Claims, len(gpuUUIDs))

	// The container's processes are gone by poststop.
	require.NoError(t, os.RemoveAll(filepath.Join(e.procRoot, "4242")))
	for _, pid := range []int{0, 4242} {
		in := e.readInput(strings.NewReader(bindState(t, "train", pid, specs.StateStopped, "/dev", "/dev")))
		require.False(t, in.NeverClaims(), "pid %d: poststop cannot tell, so it reads the ledger", pid)
	}
	opened = 0
	require.NoError(t, e.run(t.Context(), PhasePoststop, cfg, strings.NewReader(bindState(t, "train", 0, specs.StateStopped, "/dev", "/dev")), io.Discard))
	require.Equal(t, 1, opened)
	require.Empty(t, ledgerState(t, cfg).Claims)

	// A stopped container's pid is not read even where it now names a
	// process in a cgroup of the id: that process is not the container's.
	own := cgroupProc(t, "0::/train\n", shared, new(int))
	in := own.readInput(strings.NewReader(bindState(t, "train", 4242, specs.StateStopped, "/dev", "/dev")))
	require.False(t, in.NeverClaims())
}

// The cgroup is read only for a container that binds something that may
// reach a GPU: an ordinary one (a bind of a missing path, /dev/null, a
// /dev entry that is not a node of a GPU) pays no read, and asks nothing of
// its runtime. A directory may hold the host's /dev below it or lead
// elsewhere, which is read only once no device cgroup is known to fence the
// container: a container that binds one pays the cgroup read.
func TestNoDeviceBindReadsNoCgroup(t *testing.T) {
	e := defaultEnv()
	e.procRoot = filepath.Join(t.TempDir(), "no-proc")
	e.userNS = func() RuntimeUserNS { return Rootful }
	e.getppid = func() int { t.Error("getppid called"); return 1 }
	e.readCgroup = func(path string) ([]byte, error) {
		t.Errorf("read %s", path)
		return nil, os.ErrNotExist
	}
	devNull := filepath.Join(t.TempDir(), "null")
	require.NoError(t, os.Symlink("/dev/null", devNull))
	for _, src := range []string{"/srv/data", "/dev/null", "/dev/fuse", "relative", devNull} {
		in := e.readInput(strings.NewReader(bindState(t, "plain", 4242, specs.StateCreating, src, "/data")))
		require.NoError(t, in.specErr)
		require.True(t, in.NeverClaims(), src)
	}
	// CAP_MKNOD in a user namespace of the container's own makes no device
	// node: nothing to read either.
	in := e.readInput(strings.NewReader(bindState(t, "userns", 4242, specs.StateCreating, "/srv/data", "/data", withMknod, withUserNS)))
	require.True(t, in.NeverClaims())

	// And one that does bind the host's /dev reads it, however the bind
	// source is spelled, and so does one that can make device nodes (the
	// test above is no test without this).
	devLink := filepath.Join(t.TempDir(), "devlink")
	require.NoError(t, os.Symlink("/dev", devLink))
	for name, st := range map[string]string{
		"/dev":      bindState(t, "dev", 4242, specs.StateCreating, "/dev", "/dev"),
		"symlink":   bindState(t, "dev", 4242, specs.StateCreating, devLink, "/dev"),
		"CAP_MKNOD": bindState(t, "dev", 4242, specs.StateCreating, "/srv/data", "/data", withMknod),
		"devtmpfs": bindState(t, "dev", 4242, specs.StateCreating, "/srv/data", "/data", func(s *specs.Spec) {
			s.Mounts = append(s.Mounts, specs.Mount{Destination: "/d", Type: "devtmpfs", Source: "devtmpfs"})
		}),
		"no mount": bindState(t, "dev", 4242, specs.StateCreating, "/srv/data", "/data", withMknod, func(s *specs.Spec) { s.Mounts = nil }),
	} {
		reads := 0
		e.readCgroup = func(string) ([]byte, error) { reads++; return nil, os.ErrNotExist }
		in := e.readInput(strings.NewReader(st))
		require.Equal(t, 1, reads, name)
		require.False(t, in.NeverClaims(), name)
	}

	// A directory bound in reads the cgroup, and (its device cgroup
	// unreadable here: none) what lies below it, which is nothing; bound
	// nodev, no node in it opens (TestBoundDirWithoutNodevReachesEveryGPU).
	reads := 0
	e.readCgroup = func(string) ([]byte, error) { reads++; return nil, os.ErrNotExist }
	in = e.readInput(strings.NewReader(bindState(t, "dir", 4242, specs.StateCreating, t.TempDir(), "/data",
		func(s *specs.Spec) { s.Mounts[1].Options = []string{"rbind", "nodev"} })))
	require.Equal(t, 1, reads)
	require.True(t, in.NeverClaims())
}

// withMknod grants the container CAP_MKNOD, as docker's and containerd's
// default capability sets do.
func withMknod(s *specs.Spec) {
	s.Process.Capabilities = &specs.LinuxCapabilities{Bounding: []string{"CAP_CHOWN", "CAP_MKNOD"}, Effective: []string{"CAP_MKNOD"}}
}

// withoutCaps drops the spec's capabilities object, as only a hand-written
// spec does: recent runc then leaves the process the capabilities runc
// runs with (root's full set), so it counts as holding every one.
func withoutCaps(s *specs.Spec) {
	s.Process.Capabilities = nil
}

// withUserNS gives the container a user namespace of its own.
func withUserNS(s *specs.Spec) {
	s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.UserNamespace})
}

// A container that can make device nodes (CAP_MKNOD, no user namespace of
// its own) opens every GPU through a node it makes when no device cgroup
// stops it: it claims every GPU, named for what it is, or is refused under
// privileged = "reject" with advice that fits. In a device cgroup of its
// own, or in a user namespace, it claims nothing. Its poststop, which
// cannot read the cgroup, finds the claim through the marker its
// create-runtime wrote.
//
// A spec without a capabilities object counts as holding every capability
// (whichever runtime runs it), not as privileged: it is refused under
// privileged = "reject" as a container without a device cgroup, and a
// device cgroup of its own fences it.
func TestMknodWithoutDeviceCgroup(t *testing.T) {
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	// CAP_SYS_ADMIN mounts a devtmpfs: every node of the host's /dev.
	withSysAdmin := func(s *specs.Spec) {
		s.Process.Capabilities = &specs.LinuxCapabilities{Bounding: []string{"CAP_CHOWN", "CAP_SYS_ADMIN"}}
	}
	for _, tc := range []struct {
		name       string
		container  string
		edits      []func(*specs.Spec)
		claims     bool
		privileged bool
		pid        int // 0: 4242
	}{
		{name: "caller's cgroup", container: session, edits: []func(*specs.Spec){withMknod}, claims: true},
		{name: "own cgroup", container: "0::/machine.slice/libpod-train.scope\n", edits: []func(*specs.Spec){withMknod}},
		{name: "caller's cgroup, user namespace", container: session, edits: []func(*specs.Spec){withMknod, withUserNS}},
		{name: "caller's cgroup, no CAP_MKNOD", container: session},
		{name: "caller's cgroup, CAP_SYS_ADMIN", container: session, edits: []func(*specs.Spec){withSysAdmin}, claims: true, privileged: true},
		{name: "own cgroup, CAP_SYS_ADMIN", container: "0::/machine.slice/libpod-train.scope\n", edits: []func(*specs.Spec){withSysAdmin}},
		{name: "caller's cgroup, no capabilities object", container: session, edits: []func(*specs.Spec){withoutCaps}, claims: true},
		{name: "own cgroup, no capabilities object", container: "0::/machine.slice/libpod-train.scope\n", edits: []func(*specs.Spec){withoutCaps}},
		{name: "caller's cgroup, no capabilities object, user namespace", container: session, edits: []func(*specs.Spec){withoutCaps, withUserNS}},
		// The OCI state of a container being created may lack its pid:
		// nothing tells that a device cgroup applies.
		{name: "no pid", container: "0::/machine.slice/libpod-train.scope\n", edits: []func(*specs.Spec){withMknod}, claims: true, pid: -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := staticConfig(t)
			opened := 0
			e := cgroupProc(t, tc.container, session, &opened)
			e.markerDir = t.TempDir()
			pid := 4242
			if tc.pid < 0 {
				pid = 0
			}
			create := bindState(t, "train", pid, specs.StateCreating, "/srv/data", "/data", tc.edits...)
			require.NoError(t, e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(create), io.Discard))
			if !tc.claims {
				require.Zero(t, opened, "nothing to claim")
				return
			}
			snap := ledgerState(t, cfg)
			var got []string
			for _, c := range snap.Claims {
				got = append(got, c.Device.UUID)
				require.Contains(t, c.Source, "no device cgroup (host /dev bound in, or CAP_MKNOD or CAP_SYS_ADMIN)")
			}
			require.ElementsMatch(t, gpuUUIDs, got, "a node it makes opens any GPU")

			// poststop: the process is gone, the cgroup unreadable; the
			// marker leads it to the ledger.
			require.NoError(t, os.RemoveAll(filepath.Join(e.procRoot, "4242")))
			var st specs.State
			require.NoError(t, json.Unmarshal([]byte(create), &st))
			st.Status, st.Pid = specs.StateStopped, 0
			data, err := json.Marshal(st)
			require.NoError(t, err)
			stop := string(data)
			in := e.readInput(strings.NewReader(stop))
			// (A privileged container's poststop always reads the ledger.)
			require.Equal(t, !tc.privileged, in.NeverClaims(), "poststop goes by its marker, not by a cgroup it cannot read")
			require.NoError(t, e.run(t.Context(), PhasePoststop, cfg, strings.NewReader(stop), io.Discard))
			require.Empty(t, ledgerState(t, cfg).Claims)

			cfg = staticConfig(t)
			cfg.Policy.Privileged = config.PrivilegedReject
			e = cgroupProc(t, tc.container, session, &opened)
			err = e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(create), io.Discard)
			require.ErrorIs(t, err, guard.ErrRejected)
			if tc.privileged {
				require.ErrorContains(t, err, "privileged container (CAP_SYS_ADMIN)")
				return
			}
			require.ErrorContains(t, err, "container without a device cgroup")
			require.ErrorContains(t, err, "run it in a device cgroup of its own")
			require.NotContains(t, err.Error(), "run it unprivileged")
		})
	}
}

// A spec without a capabilities object that names one GPU claims that GPU
// alone where its device cgroup of its own applies, and every GPU where no
// device cgroup can be told to apply (no pid in the state, as a runtime
// may give create-runtime).
func TestNoCapabilitiesObjectClaimsEveryGPUOnlyUnfenced(t *testing.T) {
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	named := func(s *specs.Spec) { s.Process.Env = append(s.Process.Env, "NVIDIA_VISIBLE_DEVICES=1") }
	for _, tc := range []struct {
		name string
		pid  int
		want []string
	}{
		{"own cgroup", 4242, gpuUUIDs[1:2]},
		{"no pid", 0, gpuUUIDs},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := staticConfig(t)
			opened := 0
			e := cgroupProc(t, "0::/machine.slice/libpod-train.scope\n", session, &opened)
			e.markerDir = t.TempDir()
			create := bindState(t, "train", tc.pid, specs.StateCreating, "/srv/data", "/data", withoutCaps, named)
			require.NoError(t, e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(create), io.Discard))
			var got []string
			for _, c := range ledgerState(t, cfg).Claims {
				got = append(got, c.Device.UUID)
			}
			require.ElementsMatch(t, tc.want, got)
		})
	}
}

// A devtmpfs the runtime mounts for the container is the kernel's one
// devtmpfs: every node of the host's /dev. Without a device cgroup it opens
// every GPU; in a cgroup of its own nothing opens.
//
// So does an overlay whose layer is the host's /dev (podman's
// `-v /dev:/x:O`, a link to it as well): device nodes in a layer open
// through the overlay.
func TestDevtmpfsMountWithoutDeviceCgroup(t *testing.T) {
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	devLink := filepath.Join(t.TempDir(), "devlink")
	require.NoError(t, os.Symlink("/dev", devLink))
	for name, mount := range map[string]specs.Mount{
		"devtmpfs":                    {Destination: "/mnt/dev", Type: "devtmpfs", Source: "devtmpfs"},
		"overlay of /dev":             {Destination: "/mnt/dev", Type: "overlay", Source: "overlay", Options: []string{"lowerdir=/dev", "upperdir=" + t.TempDir(), "workdir=" + t.TempDir()}},
		"overlay of a link":           {Destination: "/mnt/dev", Type: "overlay", Source: "overlay", Options: []string{"lowerdir=/srv:" + devLink + ",upperdir=/u,workdir=/w"}},
		"overlay, newer kernels' key": {Destination: "/mnt/dev", Type: "overlay", Source: "overlay", Options: []string{"lowerdir+=/dev", "upperdir=/u"}},
		"overlay, an escaped layer":   {Destination: "/mnt/dev", Type: "overlay", Source: "overlay", Options: []string{`lowerdir=/srv/a\,b:/dev`}},
		"overlay, a relative layer":   {Destination: "/mnt/dev", Type: "overlay", Source: "overlay", Options: []string{"lowerdir=../../../../../../../../../../dev"}},
		"bind of a relative source":   {Destination: "/mnt/dev", Type: "bind", Source: "../../../../../../../../../../dev", Options: []string{"rbind"}},
	} {
		for container, claims := range map[string]bool{session: true, "0::/machine.slice/libpod-train.scope\n": false} {
			cfg := staticConfig(t)
			opened := 0
			e := cgroupProc(t, container, session, &opened)
			require.NoError(t, e.run(t.Context(), PhaseCreateRuntime, cfg,
				strings.NewReader(bindState(t, "train", 4242, specs.StateCreating, "/srv/data", "/data", func(s *specs.Spec) {
					s.Mounts = append(s.Mounts, mount)
				})), io.Discard))
			if !claims {
				require.Zero(t, opened, "%s: the device cgroup stops what it shows", name)
				continue
			}
			snap := ledgerState(t, cfg)
			require.Len(t, snap.Claims, len(gpuUUIDs), "%s: every GPU opens through it", name)
		}
	}
}

// A claim that only the marker leads poststop to (CAP_MKNOD, or a bind
// through a symlink, without a device cgroup) is not made when the marker
// cannot be written: the container is refused, since its poststop would
// skip the ledger and the claim outlive it. One whose spec names its GPU
// is admitted with a warning, as before: poststop reads the ledger for it.
func TestUnmarkableUnfencedClaimRefused(t *testing.T) {
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	cfg := staticConfig(t)
	opened := 0
	e := cgroupProc(t, session, session, &opened)
	blocker := filepath.Join(t.TempDir(), "file")
	require.NoError(t, os.WriteFile(blocker, nil, 0o600))
	e.markerDir = filepath.Join(blocker, "markers") // below a file: never written
	err := e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(bindState(t, "train", 4242, specs.StateCreating, "/srv/data", "/data", withMknod)), io.Discard)
	require.ErrorContains(t, err, "its poststop needs the marker")
	require.Equal(t, 1, opened, "the ledger is opened before the marker is written")
	snap := ledgerState(t, cfg)
	require.Empty(t, snap.Claims, "nothing claimed for the refused container")

	var warned strings.Builder
	named := bindState(t, "named", 4242, specs.StateCreating, "/dev", "/dev", withMknod)
	require.NoError(t, e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(named), &warned))
	require.Contains(t, warned.String(), "its poststop will go by its config.json alone")
}

func TestDeviceCgroupOf(t *testing.T) {
	for _, tc := range []struct {
		name, doc, want string
	}{
		{"v2", "0::/a/b\n", "/a/b"},
		{"v1", "12:pids:/p\n11:cpu,devices:/d\n1:name=systemd:/s\n", "/d"},
		{"hybrid", "11:devices:/d\n1:name=systemd:/s\n0::/u\n", "/d"},
		{"a path with ':'", "0::/a:b\n", "/a:b"},
		{"v1 without devices", "12:pids:/p\n", ""},
		{"hybrid without devices", "12:pids:/p\n0::/u\n", ""},
		{"empty", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := defaultEnv()
			e.readCgroup = func(string) ([]byte, error) { return []byte(tc.doc), nil }
			got, err := e.deviceCgroupOf(7)
			if tc.want == "" {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

// An overlay a rootless runtime mounts is mounted in its user namespace,
// where the kernel opens no device node on it: an overlay of the host's
// /dev opens no GPU there, and claims nothing. A bind of /dev does open
// them (the nodes keep the host's devtmpfs).
func TestRootlessOverlayOfDevClaimsNothing(t *testing.T) {
	e := defaultEnv()
	e.userNS = func() RuntimeUserNS { return Rootless }
	overlay := bindState(t, "ov", 4242, specs.StateCreating, "/srv/data", "/data", func(s *specs.Spec) {
		s.Mounts = append(s.Mounts, specs.Mount{Destination: "/x", Type: "overlay", Source: "overlay", Options: []string{"lowerdir=/dev"}})
	})
	in := e.readInput(strings.NewReader(overlay))
	require.NoError(t, in.specErr)
	require.True(t, in.NeverClaims())
	in = e.readInput(strings.NewReader(bindState(t, "bd", 4242, specs.StateCreating, "/dev", "/x")))
	require.False(t, in.NeverClaims())
}

// A runtime whose user namespace cannot be told (its uid_map unreadable)
// may be rootful or rootless: the container is read both ways at once. No
// device cgroup applies, though the container's process is in a cgroup of
// its own (a rootless runtime sets up none), and CAP_MKNOD and an overlay
// of the host's /dev open every GPU (as under a rootful runtime without
// one), as does a bind of /dev, however spelled. Its poststop, where the
// uid_map may read no better, releases the claim: it reads every bind and
// overlay whatever its spelling, as a rootless runtime's poststop reads
// every bind (the marker leads it to the rest). A container with none of
// these claims nothing.
func TestUnknownUserNSReadsBothWays(t *testing.T) {
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	overlay := func(s *specs.Spec) {
		s.Mounts = append(s.Mounts, specs.Mount{Destination: "/x", Type: "overlay", Source: "overlay", Options: []string{"lowerdir=/dev"}})
	}
	devLink := filepath.Join(t.TempDir(), "devlink")
	require.NoError(t, os.Symlink("/dev", devLink))
	for _, tc := range []struct {
		name   string
		src    string
		edits  []func(*specs.Spec)
		claims bool
		// poststopReads: poststop finds the claim without the marker.
		poststopReads bool
	}{
		{"CAP_MKNOD", "/srv/data", []func(*specs.Spec){withMknod}, true, false},
		{"overlay of /dev", "/srv/data", []func(*specs.Spec){overlay}, true, true},
		{"bind of /dev", "/dev", nil, true, true},
		{"bind of /dev through a symlink", devLink, nil, true, true},
		{"none", "/srv/data", nil, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := staticConfig(t)
			opened := 0
			e := cgroupProc(t, "0::/machine.slice/libpod-train.scope\n", session, &opened)
			procRoot := e.procRoot // no self/uid_map in it
			e.userNS = func() RuntimeUserNS { return runtimeUserNS(procRoot) }
			e.markerDir = t.TempDir()
			create := bindState(t, "train", 4242, specs.StateCreating, tc.src, "/data", tc.edits...)
			require.NoError(t, e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(create), io.Discard))
			if !tc.claims {
				require.Zero(t, opened, "nothing to claim")
				return
			}
			requireUnfencedClaimReleased(t, e, cfg, create, "no device cgroup fences it", tc.poststopReads)
		})
	}
}

// requireUnfencedClaimReleased: the container of create (pid 4242 under
// e.procRoot) claimed every GPU as one that no device cgroup fences (why
// says how it reaches them); once its process is gone, its poststop finds
// the claim by the spec alone exactly when poststopReads, and releases it.
func requireUnfencedClaimReleased(t *testing.T, e env, cfg config.Config, create, why string, poststopReads bool) {
	t.Helper()
	var got []string
	for _, c := range ledgerState(t, cfg).Claims {
		got = append(got, c.Device.UUID)
		require.Contains(t, c.Source, "no device cgroup")
	}
	require.ElementsMatch(t, gpuUUIDs, got, why)

	require.NoError(t, os.RemoveAll(filepath.Join(e.procRoot, "4242"))) // the process is gone
	var st specs.State
	require.NoError(t, json.Unmarshal([]byte(create), &st))
	st.Status, st.Pid = specs.StateStopped, 0
	stop, err := json.Marshal(st)
	require.NoError(t, err)
	require.Equal(t, poststopReads, !e.readInput(strings.NewReader(string(stop))).reachesNoGPU(),
		"poststop finds the claim by the spec alone")
	require.NoError(t, e.run(t.Context(), PhasePoststop, cfg, strings.NewReader(string(stop)), io.Discard))
	require.Empty(t, ledgerState(t, cfg).Claims)
}

// A claim made where the runtime's user namespace cannot be told must show
// to poststop under whichever reading it takes by then, or create-runtime
// needs the marker: a bind of /dev through a symlink, which a rootful
// runtime's poststop does not read (its spelling says nothing), is refused
// when the marker cannot be written. A bind spelled /dev is not.
func TestUnknownUserNSUnmarkableClaimRefused(t *testing.T) {
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	devLink := filepath.Join(t.TempDir(), "devlink")
	require.NoError(t, os.Symlink("/dev", devLink))
	cfg := staticConfig(t)
	opened := 0
	e := cgroupProc(t, "0::/machine.slice/libpod-train.scope\n", session, &opened)
	procRoot := e.procRoot // no self/uid_map in it
	e.userNS = func() RuntimeUserNS { return runtimeUserNS(procRoot) }
	blocker := filepath.Join(t.TempDir(), "file")
	require.NoError(t, os.WriteFile(blocker, nil, 0o600))
	e.markerDir = filepath.Join(blocker, "markers") // below a file: never written

	err := e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(bindState(t, "train", 4242, specs.StateCreating, devLink, "/data")), io.Discard)
	require.ErrorContains(t, err, "its poststop needs the marker")
	require.Empty(t, ledgerState(t, cfg).Claims, "nothing claimed for the refused container")

	var warned strings.Builder
	named := bindState(t, "named", 4242, specs.StateCreating, "/dev", "/dev")
	require.NoError(t, e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(named), &warned))
	require.Contains(t, warned.String(), "its poststop will go by its config.json alone")
	require.Len(t, ledgerState(t, cfg).Claims, len(gpuUUIDs))
}

// A create-runtime that cannot write the marker asks whether poststop
// finds the claim without it, which depends on the runtime's user
// namespace: its uid_map is read once per run, for that question and for
// what the container reaches alike, so that both go by one answer.
func TestUnmarkableReadsUIDMapOnce(t *testing.T) {
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	devLink := filepath.Join(t.TempDir(), "devlink")
	require.NoError(t, os.Symlink("/dev", devLink))
	for _, tc := range []struct {
		name    string
		uidMap  string // "": unreadable
		src     string
		edits   []func(*specs.Spec)
		refused bool
	}{
		{"rootful, CAP_MKNOD", "         0          0 4294967295\n", "/srv/data", []func(*specs.Spec){withMknod}, true},
		{"rootful, a bind of /dev", "         0          0 4294967295\n", "/dev", nil, false},
		{"rootless, a bind of /dev through a symlink", "         0       1000          1\n", devLink, nil, false},
		{"unknown, a bind of /dev through a symlink", "", devLink, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := staticConfig(t)
			e := cgroupProc(t, session, session, new(int))
			procRoot := e.procRoot
			if tc.uidMap != "" {
				require.NoError(t, os.MkdirAll(filepath.Join(procRoot, "self"), 0o755))
				require.NoError(t, os.WriteFile(filepath.Join(procRoot, "self", "uid_map"), []byte(tc.uidMap), 0o644))
			}
			reads := 0
			e.userNS = func() RuntimeUserNS { reads++; return runtimeUserNS(procRoot) }
			blocker := filepath.Join(t.TempDir(), "file")
			require.NoError(t, os.WriteFile(blocker, nil, 0o600))
			e.markerDir = filepath.Join(blocker, "markers") // below a file: never written
			var stderr strings.Builder
			err := e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(bindState(t, "train", 4242, specs.StateCreating, tc.src, "/data", tc.edits...)), &stderr)
			if tc.refused {
				require.ErrorContains(t, err, "its poststop needs the marker")
			} else {
				require.NoError(t, err)
				require.Contains(t, stderr.String(), "its poststop will go by its config.json alone")
				require.Len(t, ledgerState(t, cfg).Claims, len(gpuUUIDs))
			}
			require.Equal(t, 1, reads, "uid_map read once")
		})
	}
}

// ledgerState is the state of cfg's ledger, read as gpu-guard-ctl reads it.
func ledgerState(t *testing.T, cfg config.Config) ledger.State {
	t.Helper()
	l, err := ledger.OpenReadOnly(cfg.Ledger.Dir, ledger.Options{})
	require.NoError(t, err)
	st, err := l.Snapshot(t.Context())
	require.NoError(t, err)
	return st
}
