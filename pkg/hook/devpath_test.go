// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// hostGPUNode makes a character device of GPU minor on this host, outside
// /dev (mknod needs root: the test is skipped without it), and returns its
// path: a host node whose name says nothing of what it is.
func hostGPUNode(t *testing.T, minor uint32) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mknod of a GPU node needs root")
	}
	node := filepath.Join(t.TempDir(), "g")
	require.NoError(t, syscall.Mknod(node, syscall.S_IFCHR|0o600, int(unix.Mkdev(195, minor))))
	return node
}

// withDevice lists d in the spec's linux.devices, as `--device` does.
func withDevice(d specs.LinuxDevice) func(*specs.Spec) {
	return func(s *specs.Spec) { s.Linux.Devices = append(s.Linux.Devices, d) }
}

// A runtime that cannot mknod binds the host's node at a linux.devices
// entry's path, whatever the entry's numbers say: runc 1.1 in a user
// namespace (rootless, or the container's own) and crun 1.8 rootless give
// {path P, c 1:3} the host's node at P. Where no device cgroup stops the
// open, the container reaches the GPU at P, and claims it: under a
// rootless runtime, one whose user namespace cannot be told, and a rootful
// one that applies no device cgroup (with a user namespace of the
// container's own, runc binds; without, runc binds when mknod is refused,
// which the hook cannot tell). A device cgroup of the container's own
// allows 1:3 and not the GPU: nothing is claimed there. Poststop releases
// the claim, through the path it reads (rootless) or the marker.
func TestDevicePathBoundWithoutDeviceCgroup(t *testing.T) {
	const (
		session = "0::/user.slice/user-0.slice/session-1.scope\n"
		own     = "0::/machine.slice/libpod-train.scope\n"
	)
	node := hostGPUNode(t, 2)
	link := filepath.Join(t.TempDir(), "link")
	require.NoError(t, os.Symlink(node, link))
	for _, tc := range []struct {
		name   string
		userNS RuntimeUserNS
		cgroup string
		edits  []func(*specs.Spec)
		claims bool
	}{
		{name: "rootless", userNS: Rootless, cgroup: own, claims: true},
		{name: "unknown user namespace", userNS: UnknownUserNS, cgroup: own, claims: true},
		{name: "rootful, user namespace, no device cgroup", userNS: Rootful, cgroup: session, edits: []func(*specs.Spec){withUserNS}, claims: true},
		{name: "rootful, no device cgroup", userNS: Rootful, cgroup: session, claims: true},
		{name: "rootful, user namespace, own device cgroup", userNS: Rootful, cgroup: own, edits: []func(*specs.Spec){withUserNS}},
		{name: "rootful, own device cgroup", userNS: Rootful, cgroup: own},
	} {
		for _, path := range []string{node, link} {
			name := tc.name
			if path == link {
				name += ", a symlink to the node"
			}
			t.Run(name, func(t *testing.T) {
				cfg := staticConfig(t)
				opened := 0
				e := cgroupProc(t, tc.cgroup, session, &opened)
				e.userNS = func() RuntimeUserNS { return tc.userNS }
				e.markerDir = t.TempDir()
				edits := append([]func(*specs.Spec){withDevice(specs.LinuxDevice{Path: path, Type: "c", Major: 1, Minor: 3})}, tc.edits...)
				create := bindState(t, "train", 4242, specs.StateCreating, "/srv/data", "/data", edits...)
				require.NoError(t, e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(create), io.Discard))
				if !tc.claims {
					require.Zero(t, opened, "the device cgroup allows 1:3 only: nothing to claim")
					return
				}
				claims := ledgerState(t, cfg).Claims
				require.Len(t, claims, 1, "the host's node at the path, not the entry's numbers")
				require.Equal(t, gpuUUIDs[2], claims[0].Device.UUID)
				require.Contains(t, claims[0].Source, path)

				require.NoError(t, os.RemoveAll(filepath.Join(e.procRoot, "4242"))) // the process is gone
				var st specs.State
				require.NoError(t, json.Unmarshal([]byte(create), &st))
				st.Status, st.Pid = specs.StateStopped, 0
				stop, err := json.Marshal(st)
				require.NoError(t, err)
				require.NoError(t, e.run(t.Context(), PhasePoststop, cfg, strings.NewReader(string(stop)), io.Discard))
				require.Empty(t, ledgerState(t, cfg).Claims, "poststop released it")
			})
		}
	}
}

// A claim that only the marker leads poststop to must not be made when the
// marker cannot be written: a rootful runtime's poststop (and one whose user
// namespace cannot be told) cannot read the cgroup and does not read a
// linux.devices path spelled like no GPU. A rootless runtime's poststop
// reads the path itself, so that container is admitted with a warning.
func TestDevicePathUnmarkableClaim(t *testing.T) {
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	node := hostGPUNode(t, 1)
	blocker := filepath.Join(t.TempDir(), "file")
	require.NoError(t, os.WriteFile(blocker, nil, 0o600))
	for _, tc := range []struct {
		userNS  RuntimeUserNS
		refused bool
	}{
		{Rootful, true},
		{UnknownUserNS, true},
		{Rootless, false},
	} {
		cfg := staticConfig(t)
		opened := 0
		e := cgroupProc(t, session, session, &opened)
		e.userNS = func() RuntimeUserNS { return tc.userNS }
		e.markerDir = filepath.Join(blocker, "markers") // below a file: never written
		create := bindState(t, "train", 4242, specs.StateCreating, "/srv/data", "/data", withUserNS,
			withDevice(specs.LinuxDevice{Path: node, Type: "c", Major: 1, Minor: 3}))
		var warned strings.Builder
		err := e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(create), &warned)
		if tc.refused {
			require.ErrorContains(t, err, "its poststop needs the marker", "user namespace %d", tc.userNS)
			require.Empty(t, ledgerState(t, cfg).Claims)
			continue
		}
		require.NoError(t, err)
		require.Contains(t, warned.String(), "its poststop will go by its config.json alone")
		require.Len(t, ledgerState(t, cfg).Claims, 1)
	}
}

// The no-GPU path stays as it was: a linux.devices entry whose host node is
// the one its numbers make, or none that may be a GPU, costs a stat and no
// cgroup read under a rootful runtime. One whose host node may be a GPU
// does read the cgroup (the test above is no test without this).
func TestDevicePathReadsNoCgroupUnlessItMayBeAGPU(t *testing.T) {
	e := defaultEnv()
	e.procRoot = filepath.Join(t.TempDir(), "no-proc")
	e.userNS = func() RuntimeUserNS { return Rootful }
	e.getppid = func() int { return 1 }
	reads := 0
	e.readCgroup = func(string) ([]byte, error) { reads++; return nil, os.ErrNotExist }
	for _, d := range []specs.LinuxDevice{
		{Path: "/dev/null", Type: "c", Major: 1, Minor: 3},
		{Path: "/dev/null", Type: "c", Major: 1, Minor: 5}, // host's 1:3: no GPU either way
		{Path: "/nonexistent/dev/x", Type: "c", Major: 1, Minor: 3},
	} {
		in := e.readInput(strings.NewReader(bindState(t, "plain", 4242, specs.StateCreating, "/srv/data", "/data", withUserNS, withDevice(d))))
		require.NoError(t, in.specErr)
		require.True(t, in.NeverClaims(), d.Path)
		require.Zero(t, reads, d.Path)
	}
	if os.Geteuid() == 0 {
		node := hostGPUNode(t, 0)
		in := e.readInput(strings.NewReader(bindState(t, "gpu", 4242, specs.StateCreating, "/srv/data", "/data", withUserNS,
			withDevice(specs.LinuxDevice{Path: node, Type: "c", Major: 1, Minor: 3}))))
		require.False(t, in.NeverClaims())
		require.Equal(t, 1, reads)
	}
}

// A relative linux.devices path is bound by runc from the container's root
// filesystem, whose symlinks lead anywhere on the host: where no device
// cgroup applies it counts as the host's /dev.
func TestRelativeDevicePathIsTheHostsDev(t *testing.T) {
	spec := &specs.Spec{Linux: &specs.Linux{Devices: []specs.LinuxDevice{{Path: "dev/x", Type: "c", Major: 1, Minor: 3}}}}
	req := devices.RequestFromSpec(spec)
	unfence(&req, spec, "", func() RuntimeUserNS { return Rootless }, false, func() bool { return false }, bindRuntime{})
	require.True(t, req.HostDevMounted)
	require.True(t, req.GPUNodesAllowed)
}

// A linux.devices entry is the node the runtime makes of its numbers, as
// the resolver reads it (devices.MadeNumbers): one whose numbers make the
// host's node at its path (mknod keeps 12 bits of the major, 20 of the
// minor) brings no other node by its path, and is read once, as the entry.
func TestDevicePathReadAsMade(t *testing.T) {
	paths := map[string]struct{ major, minor int64 }{"/dev/null": {1<<12 + 1, 3}}
	if os.Geteuid() == 0 {
		paths[hostGPUNode(t, 2)] = struct{ major, minor int64 }{1<<32 + 195, 2}
	}
	for path, n := range paths {
		entry := specs.LinuxDevice{Path: path, Type: "c", Major: n.major, Minor: n.minor}
		spec := &specs.Spec{Linux: &specs.Linux{Devices: []specs.LinuxDevice{entry}}, Process: &specs.Process{Capabilities: podmanCaps()}}
		req := devices.RequestFromSpec(spec)
		UnfencedRequest(&req, spec, "")
		require.Equal(t, []devices.LinuxDevice{{Path: path, Type: "c", Major: n.major, Minor: n.minor}}, req.Devices, path)
	}
}
