// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// rootState writes a bundle whose config.json has root.path root, the
// mounts of mounts (nothing over /dev unless one is at /dev), a deny-all
// device cgroup, a PID namespace of its own (so that a procfs among the
// mounts shows only its processes) and podman's capabilities, and returns
// the OCI state of container id with process pid in it, and the bundle.
func rootState(t *testing.T, id string, pid int, status specs.ContainerState, root string, mounts ...specs.Mount) (string, string) {
	t.Helper()
	spec := specs.Spec{Version: specs.Version, Root: &specs.Root{Path: root},
		Process: &specs.Process{Env: []string{"PATH=/bin"}, Capabilities: podmanCaps()},
		Mounts:  mounts,
		Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.PIDNamespace}}, Resources: &specs.LinuxResources{Devices: []specs.LinuxDeviceCgroup{
			{Allow: false, Access: "rwm"}}}}}
	data, err := json.Marshal(spec)
	require.NoError(t, err)
	bundle := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
	st, err := json.Marshal(specs.State{Version: specs.Version, ID: id, Status: status, Pid: pid, Bundle: bundle})
	require.NoError(t, err)
	return string(st), bundle
}

var (
	procMount  = specs.Mount{Destination: "/proc", Type: "proc", Source: "proc"}
	devTmpfs   = specs.Mount{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "mode=755"}}
	devTmpfsRe = specs.Mount{Destination: "dev/", Type: "tmpfs", Source: "tmpfs"} // relative, as runc and crun read it
)

// A hand-written spec whose root.path is the host's "/" (however it is
// spelled) gives its container the host's /dev: run by a rootful runtime
// that applies no device cgroup (the process left in its caller's cgroup)
// it reaches every GPU node, and claims every GPU. A mount at /dev does not
// change that: the root is bound recursively, the host's /proc with it
// unless a proc is mounted over it (/proc/<pid>/root/dev is the host's
// /dev), and every other mount of the host. The host's /dev as the root
// puts every node at the container's root, which a mount at /dev does not
// cover. A device cgroup of the container's own fences them all.
func TestRootFilesystemWithoutDeviceCgroup(t *testing.T) {
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	rootLink := filepath.Join(t.TempDir(), "rootlink")
	require.NoError(t, os.Symlink("/", rootLink))
	devLink := filepath.Join(t.TempDir(), "devlink")
	require.NoError(t, os.Symlink("/dev", devLink))
	for _, tc := range []struct {
		name    string
		root    string // "" with rel: the bundle's "rootfs", a symlink to rel
		rel     string
		mounts  []specs.Mount
		reaches bool
	}{
		{"host / without mounts", "/", "", nil, true},
		{"host / with /proc only", "/", "", []specs.Mount{procMount}, true},
		{"host / through a symlink", rootLink, "", []specs.Mount{procMount}, true},
		{"host / as a relative root", "", "/", []specs.Mount{procMount}, true},
		{"host / spelled /proc/self/root", "/proc/self/root", "", nil, true},
		{"host /dev", "/dev", "", []specs.Mount{procMount}, true},
		{"host /dev under a /dev mount", "/dev", "", []specs.Mount{procMount, devTmpfs}, true},
		{"host /dev through a symlink under a /dev mount", devLink, "", []specs.Mount{devTmpfs}, true},
		{"host / under a /dev mount", "/", "", []specs.Mount{procMount, devTmpfs}, true},
		{"host / under a /dev mount, its /proc kept", "/", "", []specs.Mount{devTmpfs}, true},
		{"host / under a relative /dev mount", "/", "", []specs.Mount{devTmpfsRe}, true},
		{"host / through a symlink under a /dev mount", rootLink, "", []specs.Mount{devTmpfs}, true},
		// On nodev storage: a root filesystem not mounted nodev may carry
		// a GPU's node (TestRootWithoutNodevReachesEveryGPU).
		{"an ordinary root filesystem", "nodev", "", []specs.Mount{procMount}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.root == "nodev" {
				tc.root = filepath.Join(nodevDir(t), "rootfs")
				require.NoError(t, os.MkdirAll(filepath.Join(tc.root, "dev"), 0o755))
			}
			write := func(pid int, status specs.ContainerState) string {
				root := tc.root
				if root == "" {
					root = "rootfs"
				}
				st, bundle := rootState(t, "train", pid, status, root, tc.mounts...)
				if tc.root == "" {
					if tc.rel != "" {
						require.NoError(t, os.Symlink(tc.rel, filepath.Join(bundle, "rootfs")))
					} else {
						require.NoError(t, os.MkdirAll(filepath.Join(bundle, "rootfs", "dev"), 0o755))
					}
				}
				return st
			}
			cfg := staticConfig(t)
			opened := 0
			e := cgroupProc(t, session, session, &opened)
			in := e.readInput(strings.NewReader(write(4242, specs.StateCreating)))
			require.NoError(t, in.specErr)
			require.Equal(t, !tc.reaches, in.NeverClaims())
			require.NoError(t, e.runInput(t.Context(), PhaseCreateRuntime, cfg, in, io.Discard))
			if !tc.reaches {
				require.Zero(t, opened, "nothing to claim")
				return
			}
			require.ElementsMatch(t, gpuUUIDs, claimedGPUs(t, ledgerState(t, cfg).Claims, "train"), "every GPU opens through the host's /dev")

			// In a device cgroup of its own the deny rules hold.
			own := cgroupProc(t, "0::/train\n", session, new(int))
			in = own.readInput(strings.NewReader(write(4242, specs.StateCreating)))
			require.True(t, in.NeverClaims(), "its device cgroup fences it")

			// A rootless runtime applies no device cgroup at all.
			rootless := cgroupProc(t, "0::/train\n", session, new(int))
			rootless.userNS = func() RuntimeUserNS { return Rootless }
			in = rootless.readInput(strings.NewReader(write(4242, specs.StateCreating)))
			require.False(t, in.NeverClaims(), "rootless: no device cgroup")
			require.True(t, in.request.HostDevMounted)
		})
	}
}

// claimedGPUs lists the UUIDs of claims, each of which must be id's.
func claimedGPUs(t *testing.T, claims []ledger.Claim, id string) []string {
	t.Helper()
	var got []string
	for _, c := range claims {
		require.Equal(t, id, c.Owner.ContainerID)
		got = append(got, c.Device.UUID)
	}
	return got
}

// poststop goes by spellings: a root.path of "/" (whatever is mounted at
// /dev) or "/dev" makes it read the ledger and release what create-runtime
// claimed, without a marker; so create-runtime does not need one for it.
func TestPoststopReleasesRootFilesystem(t *testing.T) {
	const shared = "0::/user.slice/user-0.slice/session-1.scope\n"
	for _, tc := range []struct {
		root   string
		mounts []specs.Mount
	}{
		{"/", []specs.Mount{procMount}},
		{"/", []specs.Mount{devTmpfs}},
		{"/dev", []specs.Mount{procMount}},
	} {
		t.Run(tc.root, func(t *testing.T) {
			cfg := staticConfig(t)
			opened := 0
			e := cgroupProc(t, shared, shared, &opened)
			e.markerDir = "" // the ledger alone must lead poststop there
			st, bundle := rootState(t, "train", 4242, specs.StateCreating, tc.root, tc.mounts...)
			in := e.readInput(strings.NewReader(st))
			require.True(t, e.poststopFindsClaim(in))
			require.NoError(t, e.runInput(t.Context(), PhaseCreateRuntime, cfg, in, io.Discard))
			require.Len(t, ledgerState(t, cfg).Claims, len(gpuUUIDs))

			require.NoError(t, os.RemoveAll(filepath.Join(e.procRoot, "4242")))
			stop, err := json.Marshal(specs.State{Version: specs.Version, ID: "train", Status: specs.StateStopped, Bundle: bundle})
			require.NoError(t, err)
			in = e.readInput(strings.NewReader(string(stop)))
			require.False(t, in.NeverClaims(), "poststop reads the ledger")
			opened = 0
			require.NoError(t, e.runInput(t.Context(), PhasePoststop, cfg, in, io.Discard))
			require.Equal(t, 1, opened)
			require.Empty(t, ledgerState(t, cfg).Claims)
		})
	}
}

// A root filesystem that holds the host's /dev at its dev (a bind of it
// there) is the host's /dev at the container's /dev, unless a mount covers
// it. Needs root: it bind-mounts /dev.
func TestRootFilesystemHoldsHostDev(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("bind-mounting /dev needs root")
	}
	rootfs := t.TempDir()
	dev := filepath.Join(rootfs, "dev")
	require.NoError(t, os.Mkdir(dev, 0o755))
	require.NoError(t, unix.Mount("/dev", dev, "", unix.MS_BIND, ""))
	t.Cleanup(func() { _ = unix.Unmount(dev, unix.MNT_DETACH) })

	req := devices.Request{}
	UnfencedRequest(&req, &specs.Spec{Root: &specs.Root{Path: rootfs}, Process: &specs.Process{Capabilities: podmanCaps()}}, "")
	require.True(t, req.HostDevMounted)
	require.True(t, req.GPUNodesAllowed)

	req = devices.Request{}
	UnfencedRequest(&req, &specs.Spec{Root: &specs.Root{Path: rootfs}, Mounts: []specs.Mount{devTmpfs},
		Process: &specs.Process{Capabilities: podmanCaps()}}, "")
	require.False(t, req.HostDevMounted, "the mount at /dev covers it")
}

// An engine's container (an ordinary root filesystem, a mount at /dev)
// reads one stat and one statfs of its root, and its cgroup (once),
// whatever its storage: on storage not mounted nodev only a device cgroup
// stops a node its image may carry, and on nodev storage that nodev holds
// only under a runtime that keeps it (runc, a read-write root), which is
// asked (the runtime's exe, through getppid) only where no device cgroup
// fences the container: not here, where its own does.
func TestOrdinaryRootReadsCgroupNotRuntime(t *testing.T) {
	for _, nodev := range []bool{true, false} {
		reads, ppids := 0, 0
		e := defaultEnv()
		e.procRoot = filepath.Join(t.TempDir(), "no-proc")
		e.userNS = func() RuntimeUserNS { return Rootful }
		// Once for the runtime's cgroup; a read of its exe would be one
		// more.
		e.getppid = func() int { ppids++; return 1 }
		e.readCgroup = func(path string) ([]byte, error) {
			reads++
			if strings.Contains(path, "/4242/") {
				return []byte("0::/machine.slice/libpod-plain.scope\n"), nil
			}
			return []byte("0::/machine.slice/libpod-conmon-plain.scope\n"), nil // the runtime's
		}
		base := nodevDir
		if !nodev {
			base = devDir
		}
		root := filepath.Join(base(t), "rootfs")
		require.NoError(t, os.MkdirAll(filepath.Join(root, "dev"), 0o755))
		st, _ := rootState(t, "plain", 4242, specs.StateCreating, root, procMount, devTmpfs)
		in := e.readInput(strings.NewReader(st))
		require.NoError(t, in.specErr)
		require.True(t, in.NeverClaims(), "nodev %v: its device cgroup fences it", nodev)
		require.Equal(t, 2, reads, "nodev %v: the cgroups decide (the container's and the runtime's)", nodev)
		require.Equal(t, 1, ppids, "nodev %v: the runtime is not asked", nodev)
	}
}

// The host's "/" as the root is the host's /dev whatever is mounted at
// /dev, read by explain --no-device-cgroup as by the hook: with no proc
// mounted, the host's /proc stays, and /proc/<pid>/root/dev is the host's
// /dev.
func TestUnfencedRequestHostRootUnderDevMount(t *testing.T) {
	for _, mounts := range [][]specs.Mount{{devTmpfs}, {procMount, devTmpfs}} {
		req := devices.Request{}
		UnfencedRequest(&req, &specs.Spec{Root: &specs.Root{Path: "/"}, Mounts: mounts, Process: &specs.Process{Capabilities: podmanCaps()}}, "")
		require.True(t, req.HostDevMounted, "%v", mounts)
		require.True(t, req.GPUNodesAllowed, "%v", mounts)
	}
}

// root.path and root.readonly (runc drops a read-only root's nodev) are
// read like the other fields: both decoders agree, and a key that differs
// from "root", "path" or "readonly" only in case is refused (crun would
// not read it).
func TestRootPathDecoded(t *testing.T) {
	for _, doc := range []string{`{"root":{"path":"/"}}`, `{"root":{"path":null}}`, `{"root":null}`, `{"root":{"path":"rootfs","readonly":true}}`,
		`{"root":{"path":"rootfs","readonly":false}}`, `{"root":{"path":"rootfs","readonly":null}}`} {
		_, ok := agree(t, []byte(doc))
		require.True(t, ok, doc)
	}
	h, ok := fastSpec([]byte(`{"root":{"path":"/"}}`))
	require.True(t, ok)
	require.Equal(t, "/", h.spec().Root.Path)
	require.False(t, h.spec().Root.Readonly)
	h, ok = fastSpec([]byte(`{"root":{"path":"rootfs","readonly":true}}`))
	require.True(t, ok)
	require.True(t, h.spec().Root.Readonly)
	for _, doc := range []string{`{"root":{"path":"rootfs"},"Root":{"path":"/"}}`, `{"root":{"path":"rootfs","Path":"/"}}`,
		`{"root":{"path":"rootfs","readonly":false,"readOnly":true}}`} {
		require.ErrorIs(t, checkKeys([]byte(doc), specKeys), errAmbiguousKey, doc)
	}
}
