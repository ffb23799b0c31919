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
