// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"io"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// A procfs mounted in a container without a PID namespace of its own
// (podman --pid=host: no "pid" entry; one joined by path: another
// container's, or the host's) lists other processes, and
// /proc/<pid>/root/dev is their /dev: another container's, with the nodes
// of its GPUs, or the host's. Where no device cgroup fences the container,
// that opens every GPU: it claims them all, and its poststop finds the
// claim by its spec alone. A procfs of its own PID namespace lists only its
// own processes; a device cgroup of its own fences the rest, as does the
// lack of a proc mount.
func TestProcMountWithoutOwnPIDNamespace(t *testing.T) {
	const (
		session = "0::/user.slice/user-0.slice/session-1.scope\n"
		own     = "0::/machine.slice/libpod-train.scope\n"
	)
	hostPID := func(s *specs.Spec) { s.Linux.Namespaces = nil }
	joinedPID := func(s *specs.Spec) {
		s.Linux.Namespaces = []specs.LinuxNamespace{{Type: specs.PIDNamespace, Path: "/proc/4100/ns/pid"}}
	}
	// Two entries, one of them joined: whichever the runtime takes, the
	// hook takes the one that shows more.
	twoPID := func(s *specs.Spec) {
		s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.PIDNamespace, Path: "/proc/1/ns/pid"})
	}
	noProc := func(s *specs.Spec) {
		s.Mounts = withoutMountType(s.Mounts, "proc")
	}
	// A proc mounted somewhere other than /proc lists the same processes.
	procElsewhere := func(s *specs.Spec) {
		s.Mounts = append(withoutMountType(s.Mounts, "proc"), specs.Mount{Destination: "/host/proc", Type: "proc", Source: "none"})
	}
	for _, tc := range []struct {
		name   string
		userNS RuntimeUserNS
		cgroup string
		edits  []func(*specs.Spec)
		claims bool
	}{
		{name: "own PID namespace", userNS: Rootful, cgroup: session},
		{name: "the host's PID namespace", userNS: Rootful, cgroup: session, edits: []func(*specs.Spec){hostPID}, claims: true},
		{name: "a PID namespace joined by path", userNS: Rootful, cgroup: session, edits: []func(*specs.Spec){joinedPID}, claims: true},
		{name: "two PID namespace entries", userNS: Rootful, cgroup: session, edits: []func(*specs.Spec){twoPID}, claims: true},
		{name: "the host's PID namespace, proc elsewhere", userNS: Rootful, cgroup: session, edits: []func(*specs.Spec){hostPID, procElsewhere}, claims: true},
		{name: "the host's PID namespace, no proc mount", userNS: Rootful, cgroup: session, edits: []func(*specs.Spec){hostPID, noProc}},
		{name: "the host's PID namespace, own device cgroup", userNS: Rootful, cgroup: own, edits: []func(*specs.Spec){hostPID}},
		{name: "rootless, the host's PID namespace", userNS: Rootless, cgroup: own, edits: []func(*specs.Spec){hostPID}, claims: true},
		{name: "rootless, own PID namespace", userNS: Rootless, cgroup: session},
		{name: "unknown user namespace, the host's PID namespace", userNS: UnknownUserNS, cgroup: own, edits: []func(*specs.Spec){hostPID}, claims: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := staticConfig(t)
			opened := 0
			e := cgroupProc(t, tc.cgroup, session, &opened)
			e.userNS = func() RuntimeUserNS { return tc.userNS }
			e.markerDir = "" // the spec alone must lead poststop to the claim
			create := bindState(t, "train", 4242, specs.StateCreating, "/srv/data", "/data", tc.edits...)
			require.NoError(t, e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(create), io.Discard))
			if !tc.claims {
				require.Zero(t, opened, "nothing to claim")
				return
			}
			requireUnfencedClaimReleased(t, e, cfg, create, "every GPU opens through /proc/<pid>/root/dev", true)
		})
	}

	// gpu-guard-ctl explain --no-device-cgroup reads it so too.
	spec := specs.Spec{Mounts: []specs.Mount{{Destination: "/proc", Type: "proc", Source: "proc"}}, Linux: &specs.Linux{}}
	spec.Process = &specs.Process{Capabilities: podmanCaps()}
	req := devices.RequestFromSpec(&spec)
	UnfencedRequest(&req, &spec, t.TempDir())
	require.True(t, req.GPUNodesAllowed)
	spec.Linux.Namespaces = []specs.LinuxNamespace{{Type: specs.PIDNamespace}}
	req = devices.RequestFromSpec(&spec)
	UnfencedRequest(&req, &spec, t.TempDir())
	require.False(t, req.GPUNodesAllowed)
}

// withoutMountType is mounts without those of type fstype.
func withoutMountType(mounts []specs.Mount, fstype string) []specs.Mount {
	var out []specs.Mount
	for _, m := range mounts {
		if m.Type != fstype {
			out = append(out, m)
		}
	}
	return out
}
