// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// A container holding CAP_SYS_ADMIN is an administrator to NVIDIA's driver
// (capable(CAP_SYS_ADMIN)), which then needs no MIG capability node: the
// parent node of a MIG instance reaches every MIG instance of that GPU, so
// it claims the GPU whole instead of the instances the request names.
func TestResolveSysAdminMIGParent(t *testing.T) {
	parent := dev("/dev/nvidia3", 195, 3)
	caps10 := []LinuxDevice{parent, dev("/dev/nvidiactl", 195, 255),
		dev("/dev/nvidia-caps/nvidia-cap30", testCapsMajor, 30), dev("/dev/nvidia-caps/nvidia-cap31", testCapsMajor, 31)}
	all := func(p *config.PolicyConfig) { p.Privileged = config.PrivilegedAll }
	runResolveCases(t, []resolveCase{
		{name: "CAP_SYS_ADMIN, parent node and one instance's capabilities: the whole GPU",
			req:  Request{Privileged: true, Devices: caps10},
			want: []string{"1", "1:0"}, sources: map[string][]string{"1": {"device /dev/nvidia3 (195:3)"}},
			notes: []string{"device /dev/nvidia3 (195:3): the container holds CAP_SYS_ADMIN", "GPU 1 (" + gpuUUID(1) + ")", "claimed whole"}},
		{name: "CAP_SYS_ADMIN, parent node and a MIG UUID: the whole GPU",
			req:  Request{Privileged: true, Env: env("NVIDIA_VISIBLE_DEVICES=" + migUUID(1, 1)), Devices: []LinuxDevice{parent}},
			want: []string{"1", "1:1"}},
		{name: "may hold CAP_SYS_ADMIN (no capabilities in its spec): the whole GPU",
			req:  Request{SysAdmin: true, Devices: caps10},
			want: []string{"1", "1:0"}, notes: []string{"may hold CAP_SYS_ADMIN", "give it a capability set without CAP_SYS_ADMIN"}},
		{name: "without CAP_SYS_ADMIN the capabilities decide: that instance only",
			req: Request{Devices: caps10}, want: []string{"1:0"}},
		{name: "CAP_SYS_ADMIN and a GPU without MIG: that GPU",
			req: Request{Privileged: true, Devices: []LinuxDevice{dev("/dev/nvidia0", 195, 0)}}, want: []string{"0"}},
		// An engine's privileged container (its device cgroup allows every
		// device) under "declared": its nodes are the engine's addition,
		// not a request, so only what it names is claimed.
		{name: "engine-privileged under declared: what it names",
			req:  Request{Privileged: true, AllDevicesAllowed: true, Env: env("NVIDIA_VISIBLE_DEVICES=1:0"), Devices: caps10},
			want: []string{"1:0"}},
		{name: "CAP_SYS_ADMIN under privileged = all: every GPU", policy: all,
			req: Request{Privileged: true, Devices: caps10}, want: []string{"0", "1", "1:0", "2", "3"}, wantAll: true},
	})
}

// The same through the OCI spec, as the hook reads it: CAP_SYS_ADMIN in the
// bounding set and a device cgroup that opens only MIG 1:0's nodes.
func TestResolveSysAdminMIGParentFromSpec(t *testing.T) {
	n := func(v int64) *int64 { return &v }
	spec := &specs.Spec{
		Process: &specs.Process{
			Env:          []string{EnvVisibleDevices + "=" + migUUID(1, 0)},
			Capabilities: &specs.LinuxCapabilities{Bounding: []string{"CAP_CHOWN", "CAP_SYS_ADMIN"}},
		},
		Linux: &specs.Linux{
			Devices: []specs.LinuxDevice{
				{Path: "/dev/nvidia3", Type: "c", Major: 195, Minor: 3},
				{Path: "/dev/nvidia-caps/nvidia-cap30", Type: "c", Major: testCapsMajor, Minor: 30},
				{Path: "/dev/nvidia-caps/nvidia-cap31", Type: "c", Major: testCapsMajor, Minor: 31},
			},
			Resources: &specs.LinuxResources{Devices: []specs.LinuxDeviceCgroup{
				{Allow: false, Access: "rwm"},
				{Allow: true, Type: "c", Major: n(195), Minor: n(3), Access: "rw"},
				{Allow: true, Type: "c", Major: n(195), Minor: n(255), Access: "rw"},
				{Allow: true, Type: "c", Major: n(testCapsMajor), Minor: n(30), Access: "r"},
				{Allow: true, Type: "c", Major: n(testCapsMajor), Minor: n(31), Access: "r"},
			}},
		},
	}
	inv := testInventory(t)
	res, err := NewResolver(inv, defaultPolicy()).Resolve(RequestFromSpec(spec))
	require.NoError(t, err)
	assert.Equal(t, sorted(gpuUUID(1), migUUID(1, 0)), res.UUIDs())

	spec.Process.Capabilities.Bounding = []string{"CAP_CHOWN"}
	res, err = NewResolver(inv, defaultPolicy()).Resolve(RequestFromSpec(spec))
	require.NoError(t, err)
	assert.Equal(t, []string{migUUID(1, 0)}, res.UUIDs(), "without CAP_SYS_ADMIN only the named instance")
}

// A spec without a capabilities object (or without a process) may hold
// CAP_SYS_ADMIN: recent runc then leaves the container root's full set. The
// parent node of its MIG instance reaches every instance of that GPU, so the
// GPU is claimed whole, as for CAP_SYS_ADMIN written in the bounding set;
// the container is not privileged for that (policy.privileged does not
// apply to it).
func TestResolveMIGParentWithoutCapabilities(t *testing.T) {
	nodes := []specs.LinuxDevice{
		{Path: "/dev/nvidia3", Type: "c", Major: 195, Minor: 3},
		{Path: "/dev/nvidia-caps/nvidia-cap30", Type: "c", Major: testCapsMajor, Minor: 30},
		{Path: "/dev/nvidia-caps/nvidia-cap31", Type: "c", Major: testCapsMajor, Minor: 31},
	}
	reject := defaultPolicy()
	reject.Privileged = config.PrivilegedReject
	inv := testInventory(t)
	for _, tc := range []struct {
		name    string
		process *specs.Process
		want    []string
	}{
		{name: "no capabilities object", process: &specs.Process{}, want: sorted(gpuUUID(1), migUUID(1, 0))},
		{name: "no process", want: sorted(gpuUUID(1), migUUID(1, 0))},
		{name: "capabilities without CAP_SYS_ADMIN", process: &specs.Process{Capabilities: &specs.LinuxCapabilities{Bounding: []string{"CAP_MKNOD"}}},
			want: []string{migUUID(1, 0)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spec := &specs.Spec{Process: tc.process, Linux: &specs.Linux{Devices: nodes}}
			req := RequestFromSpec(spec)
			assert.False(t, req.Privileged, "no capability written: not privileged")
			res, err := NewResolver(inv, defaultPolicy()).Resolve(req)
			require.NoError(t, err)
			assert.Equal(t, tc.want, res.UUIDs())
			if len(tc.want) == 2 {
				require.NotEmpty(t, res.Notes)
				assert.Contains(t, res.Notes[0], "may hold CAP_SYS_ADMIN")
				assert.Contains(t, res.Notes[0], "GPU 1 ("+gpuUUID(1)+")")
			}
			// policy.privileged = "reject" refuses privileged containers;
			// this one is not, and is resolved as above.
			res, err = NewResolver(inv, reject).Resolve(req)
			require.NoError(t, err)
			assert.Equal(t, tc.want, res.UUIDs())
		})
	}
}

// A linux.devices entry is the node the runtime makes of it: mknod(2)
// keeps 12 bits of the major and 20 of the minor, so numbers past them
// (past 32 bits, negative, or just past the kernel's widths) may make a GPU
// node under other numbers.
func TestResolveEntryNumbersAsMade(t *testing.T) {
	ignore := func(p *config.PolicyConfig) { p.UnknownDevice = config.UnknownIgnore }
	runResolveCases(t, []resolveCase{
		{name: "major past 32 bits", req: Request{Devices: []LinuxDevice{dev("/dev/gpu", 1<<32+195, 0)}}, want: []string{"0"},
			sources: map[string][]string{"0": {"device /dev/gpu (4294967491:0, made as 195:0)"}}},
		{name: "minor past 32 bits", req: Request{Devices: []LinuxDevice{dev("/dev/gpu", 195, 1<<32)}}, want: []string{"0"}},
		{name: "negative major", req: Request{Devices: []LinuxDevice{dev("/dev/gpu", -(1<<32)+195, 0)}}, want: []string{"0"},
			sources: map[string][]string{"0": {"device /dev/gpu (-4294967101:0, made as 195:0)"}}},
		{name: "major past 12 bits (runc: 195)", req: Request{Devices: []LinuxDevice{dev("/dev/gpu", 1<<12+195, 0)}}, want: []string{"0"}},
		{name: "minor past 20 bits (runc: 1, GPU 3)", req: Request{Devices: []LinuxDevice{dev("/dev/gpu", 195, 1<<20+1)}}, want: []string{"3"}},
		{name: "capability node under a major past 12 bits", req: Request{Devices: []LinuxDevice{
			dev("/dev/nvidia3", 195, 3), dev("/dev/c", 1<<12+testCapsMajor, 31)}}, want: []string{"1:0"}},
		{name: "made as a GPU minor this host lacks", req: Request{Devices: []LinuxDevice{dev("/dev/gpu", 1<<32+195, 7)}}, err: ErrUnknownDevice,
			errHas: []string{`device /dev/gpu (4294967491:7, made as 195:7): unknown GPU "195:7"`}},
		{name: "made as a GPU minor this host lacks, ignored", policy: ignore,
			req: Request{Devices: []LinuxDevice{dev("/dev/gpu", 1<<32+195, 7)}}, want: nil},
		{name: "made as nvidiactl is no GPU", req: Request{Devices: []LinuxDevice{dev("/dev/gpu", 195, 1<<20+255)}}, want: nil},
		{name: "numbers the kernel holds are read as written", req: Request{Devices: []LinuxDevice{
			dev("/dev/a", 195, 256), dev("/dev/b", 1<<11+195, 0), dev("/dev/c", 196, 0)}}, want: nil},
		// An engine's CDI injection lists the GPU nodes: a node made as one
		// makes the name's GPUs impossible to tell, as a listed node does.
		{name: "CDI annotation with a node made as a GPU node", req: Request{
			Annotations: map[string]string{CDIAnnotationPrefix + "x": "k8s.gpu.nvidia.com/device=gpu-0"},
			Devices:     []LinuxDevice{dev("/dev/gpu", 1<<32+195, 0)}},
			want: []string{"0", "1", "2", "3"}, wantAll: true},
	})
}
