// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"math"
	"testing"

	"github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/gpuid"
)

func rule(allow bool, typ string, major, minor int64, access string) DeviceRule {
	r := DeviceRule{Allow: allow, Type: typ, Access: access}
	if major >= 0 {
		r.Major = &major
	}
	if minor >= 0 {
		r.Minor = &minor
	}
	return r
}

// A device cgroup rule that lets a container read or write a GPU node is a
// request for that GPU, listed node or not: the later rule decides, mknod
// alone opens nothing.
func TestGPUNodeAccess(t *testing.T) {
	denyAll := rule(false, "a", -1, -1, "rwm")
	for _, tc := range []struct {
		name   string
		rules  []DeviceRule
		all    bool
		minors []int64
	}{
		{"no rules", nil, false, nil},
		{"deny all", []DeviceRule{denyAll}, false, nil},
		{"allow all (privileged)", []DeviceRule{rule(true, "a", -1, -1, "rwm")}, true, nil},
		{"every NVIDIA node", []DeviceRule{denyAll, rule(true, "c", 195, -1, "rw")}, true, nil},
		{"one GPU", []DeviceRule{denyAll, rule(true, "c", 195, 1, "rwm")}, false, []int64{1}},
		{"two GPUs and nvidiactl", []DeviceRule{denyAll, rule(true, "c", 195, 3, "rw"), rule(true, "c", 195, 255, "rw"), rule(true, "c", 195, 0, "r")}, false, []int64{0, 3}},
		{"mknod only (CRI default)", []DeviceRule{denyAll, rule(true, "c", -1, -1, "m"), rule(true, "b", -1, -1, "m")}, false, nil},
		{"other majors", []DeviceRule{denyAll, rule(true, "c", 1, 3, "rwm"), rule(true, "c", 136, -1, "rwm")}, false, nil},
		{"block device rule", []DeviceRule{denyAll, rule(true, "b", 195, 1, "rwm")}, false, nil},
		{"taken back by a later deny", []DeviceRule{rule(true, "c", 195, 1, "rw"), rule(false, "c", 195, 1, "rw")}, false, nil},
		{"taken back by a later deny all", []DeviceRule{rule(true, "c", 195, -1, "rw"), denyAll}, false, nil},
		// Type "a" (or none: runc makes it "a") is every device, rwm,
		// whatever else the rule says, in the kernel and in runc.
		{"type a with numbers", []DeviceRule{denyAll, rule(true, "a", 1, 3, "r")}, true, nil},
		{"type a, mknod only", []DeviceRule{denyAll, rule(true, "a", -1, -1, "m")}, true, nil},
		{"no type with numbers", []DeviceRule{denyAll, rule(true, "", 1, 3, "rw")}, true, nil},
		// The kernel reads a type-a deny as "deny all", but crun reads its
		// numbers: 5:5 is not 195:1, whose allow still decides there.
		{"numbered type a deny: crun keeps the earlier allow", []DeviceRule{rule(true, "c", 195, 1, "rw"), rule(false, "a", 5, 5, "r")}, false, []int64{1}},
		{"numbered type a deny of that node", []DeviceRule{rule(true, "c", 195, 1, "rw"), rule(false, "a", 195, 1, "rw")}, false, nil},
		// A deny takes its bits from the exception with exactly its type,
		// major and minor (the kernel's dev_exception_rm, runc's emulator).
		{"partial deny leaves write", []DeviceRule{denyAll, rule(true, "c", 195, -1, "rw"), rule(false, "c", 195, -1, "r")}, true, nil},
		{"deny of every minor leaves a one-minor exception (runc)", []DeviceRule{denyAll, rule(true, "c", 195, 0, "rw"), rule(false, "c", 195, -1, "rwm")}, false, []int64{0}},
		{"deny of one minor leaves the wildcard exception (kernel)", []DeviceRule{denyAll, rule(true, "c", 195, -1, "rw"), rule(false, "c", 195, 2, "rw")}, true, nil},
		// runc takes both bits away; under crun neither deny covers an
		// O_RDWR open (a rule applies only to opens whose every bit it
		// holds), so the allow decides it.
		{"deny of every bit a grant holds, one bit at a time", []DeviceRule{denyAll, rule(true, "c", 195, -1, "rw"), rule(false, "c", 195, -1, "r"), rule(false, "c", 195, -1, "w")}, true, nil},
		{"deny of every bit a grant holds, at once", []DeviceRule{denyAll, rule(true, "c", 195, -1, "rw"), rule(false, "c", 195, -1, "rw")}, false, nil},
		{"allow all, deny reading and writing one at a time", []DeviceRule{rule(true, "a", -1, -1, "rwm"), rule(false, "c", 195, -1, "r"), rule(false, "c", 195, -1, "w")}, true, nil},
		{"deny of mknod only takes nothing", []DeviceRule{denyAll, rule(true, "c", 195, 2, "rwm"), rule(false, "c", 195, 2, "m")}, false, []int64{2}},
		{"a rule for every major", []DeviceRule{denyAll, rule(true, "c", -1, 3, "rw")}, false, []int64{3}},
		{"a deny for every major does not touch c 195:3", []DeviceRule{denyAll, rule(true, "c", 195, 3, "rw"), rule(false, "c", -1, 3, "rwm")}, false, []int64{3}},
		// Allow default (privileged), then denies: the kernel denies an
		// access any matching exception holds.
		{"allow all, deny every NVIDIA node", []DeviceRule{rule(true, "a", -1, -1, "rwm"), rule(false, "c", 195, -1, "rw")}, false, nil},
		{"allow all, deny reading only", []DeviceRule{rule(true, "a", -1, -1, "rwm"), rule(false, "c", 195, -1, "r")}, true, nil},
		{"allow all, deny one node", []DeviceRule{rule(true, "a", -1, -1, "rwm"), rule(false, "c", 195, 0, "rwm")}, true, nil},
		// Under an allow default the kernel reads a later allow as taking
		// bits from that exact deny only; crun lets the last rule decide.
		{"allow all, deny all NVIDIA nodes, allow one (crun)", []DeviceRule{rule(true, "a", -1, -1, "rwm"), rule(false, "c", 195, -1, "rwm"), rule(true, "c", 195, 2, "rw")}, false, []int64{2}},
		// crun: the last rule sharing an access bit with the open decides.
		{"crun: a deny of reading leaves O_RDWR to an earlier allow", []DeviceRule{denyAll, rule(true, "c", 195, 1, "rw"), rule(false, "c", 195, 1, "r"), rule(false, "c", 195, 1, "w")}, false, []int64{1}},
		// An empty access: rwm in an allow, nothing in a deny.
		{"empty access allow", []DeviceRule{denyAll, rule(true, "c", 195, 3, "")}, false, []int64{3}},
		{"empty access deny takes nothing", []DeviceRule{denyAll, rule(true, "c", 195, -1, "rw"), rule(false, "c", 195, -1, "")}, true, nil},
		{"minors past the GPU range are no GPUs", []DeviceRule{denyAll, rule(true, "c", 195, 254, "rw"), rule(true, "c", -1, 291, "rw")}, false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			all, minors := gpuNodeAccess(tc.rules)
			assert.Equal(t, tc.all, all)
			assert.Equal(t, tc.minors, minors)
		})
	}
}

// A rule's major and minor are int64 in the spec; runtimes read them in
// narrower types. crun (cgroup v2) copies them into a C int, negative
// meaning any: c 4294967295:* is c *:*, c 4294967491:* is c 195:*; the
// kernel (cgroup v1, as crun writes the rule) reads 4294967295 as "*". A
// rule is read as every runtime would apply it (runc: as written).
func TestRuleNumbersAsRuntimesReadThem(t *testing.T) {
	denyAll := rule(false, "a", -1, -1, "rwm")
	allowAll := rule(true, "a", -1, -1, "rwm")
	n := func(v int64) *int64 { return &v }
	c := func(allow bool, major, minor *int64, access string) DeviceRule {
		return DeviceRule{Allow: allow, Type: "c", Major: major, Minor: minor, Access: access}
	}
	for _, tc := range []struct {
		name   string
		rules  []DeviceRule
		major  int64
		all    bool
		minors []int64
	}{
		{"c 4294967295:* (crun, kernel: c *:*)", []DeviceRule{denyAll, c(true, n(math.MaxUint32), nil, "rwm")}, nvidiaMajor, true, nil},
		{"c 2147483648:* (crun: c *:*)", []DeviceRule{denyAll, c(true, n(1<<31), nil, "rw")}, nvidiaMajor, true, nil},
		{"c 4294967491:* (crun: c 195:*)", []DeviceRule{denyAll, c(true, n(1<<32+nvidiaMajor), nil, "rw")}, nvidiaMajor, true, nil},
		{"c -4294967101:* (crun: c 195:*)", []DeviceRule{denyAll, c(true, n(-(1<<32)+nvidiaMajor), nil, "r")}, nvidiaMajor, true, nil},
		{"c 4294967296:* (crun: c 0:*) is no GPU", []DeviceRule{denyAll, c(true, n(1<<32), nil, "rw")}, nvidiaMajor, false, nil},
		{"c 195:4294967295 (crun, kernel: c 195:*)", []DeviceRule{denyAll, c(true, n(nvidiaMajor), n(math.MaxUint32), "rw")}, nvidiaMajor, true, nil},
		{"c 195:4294967296 (crun: c 195:0)", []DeviceRule{denyAll, c(true, n(nvidiaMajor), n(1<<32), "rw")}, nvidiaMajor, false, []int64{0}},
		{"c 195:4294967298 and c 195:2 are one minor", []DeviceRule{denyAll, c(true, n(nvidiaMajor), n(1<<32+2), "rw"), c(true, n(nvidiaMajor), n(2), "rw")}, nvidiaMajor, false, []int64{2}},
		{"c 4294967491:4294967299 (crun: c 195:3)", []DeviceRule{denyAll, c(true, n(1<<32+nvidiaMajor), n(1<<32+3), "w")}, nvidiaMajor, false, []int64{3}},
		// runc reads the deny as another major's, crun as c 195:*: both
		// readings count.
		{"allow all, deny c 4294967491:* (runc: no GPU node denied)", []DeviceRule{allowAll, c(false, n(1<<32+nvidiaMajor), nil, "rwm")}, nvidiaMajor, true, nil},
		{"deny c 4294967491:* after c 195:* (runc: another exception)", []DeviceRule{denyAll, c(true, n(nvidiaMajor), nil, "rw"), c(false, n(1<<32+nvidiaMajor), nil, "rwm")}, nvidiaMajor, true, nil},
		// The kernel keeps c 4294967295:* (its c *:*) apart from
		// c 2147483648:*, which crun reads as c *:* too.
		{"deny c 2147483648:* does not take back c 4294967295:* (kernel)", []DeviceRule{denyAll, c(true, n(math.MaxUint32), nil, "rw"), c(false, n(1<<31), nil, "rwm")}, nvidiaMajor, true, nil},
		// The caps major is read the same way.
		{"c 4294967804:* (crun: c 508:*)", []DeviceRule{denyAll, c(true, n(1<<32+testCapsMajor), nil, "rw")}, testCapsMajor, true, nil},
		{"c 508:4294967336 (crun: c 508:40)", []DeviceRule{denyAll, c(true, n(testCapsMajor), n(1<<32+40), "rw")}, testCapsMajor, false, []int64{40}},
		{"numbers that fit are read as written", []DeviceRule{denyAll, c(true, n(nvidiaMajor), n(7), "rw"), c(true, n(5), nil, "rw")}, nvidiaMajor, false, []int64{7}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			maxMinor := int64(gpuid.MaxGPUMinor)
			if tc.major != nvidiaMajor {
				maxMinor = maxCapsMinor
			}
			all, minors := ruleAccess(tc.rules, tc.major, maxMinor)
			assert.Equal(t, tc.all, all)
			assert.Equal(t, tc.minors, minors)
		})
	}
}

// Through the resolver: `--device-cgroup-rule 'c 4294967295:* rwm'` and the
// host's /dev bound in reach every GPU under crun; it is read as c *:*.
func TestTruncatedRuleThroughTheResolver(t *testing.T) {
	inv := testInventory(t)
	big := int64(math.MaxUint32)
	req := RequestFromSpec(&specs.Spec{
		Process: &specs.Process{},
		Mounts:  []specs.Mount{{Destination: "/hostdev", Type: "bind", Source: "/dev", Options: []string{"rbind"}}},
		Linux: &specs.Linux{Resources: &specs.LinuxResources{Devices: []specs.LinuxDeviceCgroup{
			{Allow: false, Access: "rwm"},
			{Allow: true, Type: "c", Major: &big, Access: "rwm"},
		}}},
	})
	assert.True(t, req.GPUNodesAllowed)
	strict := defaultPolicy()
	strict.Privileged = config.PrivilegedReject
	_, err := NewResolver(inv, strict).Resolve(req)
	require.ErrorIs(t, err, ErrPrivilegedRejected)
	res, err := NewResolver(inv, defaultPolicy()).Resolve(req)
	require.NoError(t, err)
	assert.Len(t, res.Devices, len(inv.GPUs), "every GPU is claimed")
}

// Through the resolver: a rule for one GPU claims it like its node would
// (once, even when the node is listed too); a rule for every GPU node is
// resolved under policy.privileged, without CAP_SYS_ADMIN.
func TestDeviceRulesAreRequests(t *testing.T) {
	inv := testInventory(t)
	c195 := int64(195)
	one := int64(1)
	spec := func(rules ...specs.LinuxDeviceCgroup) *specs.Spec {
		return &specs.Spec{Process: &specs.Process{}, Linux: &specs.Linux{Resources: &specs.LinuxResources{Devices: rules}}}
	}
	denyAll := specs.LinuxDeviceCgroup{Allow: false, Access: "rwm"}

	req := RequestFromSpec(spec(denyAll, specs.LinuxDeviceCgroup{Allow: true, Type: "c", Major: &c195, Minor: &one, Access: "rwm"}))
	assert.False(t, req.Privileged)
	res, err := NewResolver(inv, defaultPolicy()).Resolve(req)
	require.NoError(t, err)
	require.Len(t, res.Devices, 1)
	assert.Equal(t, "3", res.Devices[0].Index, "GPU 3 is /dev/nvidia1 here")

	listed := spec(denyAll, specs.LinuxDeviceCgroup{Allow: true, Type: "c", Major: &c195, Minor: &one, Access: "rwm"})
	listed.Linux.Devices = []specs.LinuxDevice{{Path: "/dev/nvidia1", Type: "c", Major: 195, Minor: 1}}
	req = RequestFromSpec(listed)
	assert.Len(t, req.Devices, 1, "the listed node is not added twice")

	every := RequestFromSpec(spec(denyAll, specs.LinuxDeviceCgroup{Allow: true, Type: "c", Major: &c195, Access: "rw"}))
	assert.True(t, every.GPUNodesAllowed)
	assert.False(t, every.AllDevicesAllowed)
	strict := defaultPolicy()
	strict.Privileged = config.PrivilegedReject
	_, err = NewResolver(inv, strict).Resolve(every)
	require.ErrorIs(t, err, ErrPrivilegedRejected)
	assert.Contains(t, err.Error(), "device cgroup lets it open every GPU node")
	all := defaultPolicy()
	all.Privileged = config.PrivilegedAll
	res, err = NewResolver(inv, all).Resolve(every)
	require.NoError(t, err)
	assert.Len(t, res.Devices, len(inv.GPUs))
}

// A device cgroup rule on the host's nvidia-caps major lets the container
// open MIG capability nodes it makes (mknod) or gets through a bind mount:
// one for every capability makes its parent GPU node reach every MIG
// instance of that GPU, claimed whole; one for a single capability minor is
// read as that node.
func TestCapsMajorRules(t *testing.T) {
	inv := testInventory(t)
	caps, other := int64(testCapsMajor), int64(testCapsMajor-1)
	capNode31 := int64(31)
	migContainer := func(rules ...specs.LinuxDeviceCgroup) Request {
		// A capability set without CAP_SYS_ADMIN: the rules decide.
		spec := &specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{}}, Linux: &specs.Linux{
			Devices: []specs.LinuxDevice{
				{Path: "/dev/nvidia3", Type: "c", Major: 195, Minor: 3},
				{Path: "/dev/nvidia-caps/nvidia-cap30", Type: "c", Major: testCapsMajor, Minor: 30},
				{Path: "/dev/nvidia-caps/nvidia-cap31", Type: "c", Major: testCapsMajor, Minor: 31},
			},
			Resources: &specs.LinuxResources{Devices: append([]specs.LinuxDeviceCgroup{{Allow: false, Access: "rwm"}}, rules...)}}}
		return RequestFromSpec(spec)
	}
	resolve := func(req Request) []string {
		t.Helper()
		res, err := NewResolver(inv, defaultPolicy()).Resolve(req)
		require.NoError(t, err)
		var idx []string
		for _, d := range res.Devices {
			idx = append(idx, d.Index)
		}
		return idx
	}
	assert.Equal(t, []string{"1:0"}, resolve(migContainer()), "the MIG instance its capabilities name")
	assert.Equal(t, []string{"1", "1:0"}, resolve(migContainer(specs.LinuxDeviceCgroup{Allow: true, Type: "c", Major: &caps, Access: "rw"})),
		"every capability: the whole parent GPU (and the instance named)")
	assert.Equal(t, []string{"1:0"}, resolve(migContainer(specs.LinuxDeviceCgroup{Allow: true, Type: "c", Major: &caps, Access: "m"})),
		"mknod alone opens nothing")
	assert.Equal(t, []string{"1:0"}, resolve(migContainer(specs.LinuxDeviceCgroup{Allow: true, Type: "c", Major: &other, Access: "rw"})),
		"another dynamic major")
	assert.Equal(t, []string{"1:0"}, resolve(migContainer(
		specs.LinuxDeviceCgroup{Allow: true, Type: "c", Major: &caps, Access: "rw"},
		specs.LinuxDeviceCgroup{Allow: false, Type: "c", Major: &caps, Access: "rwm"})), "taken back by a later deny")
	assert.Equal(t, []string{"1:0"}, resolve(migContainer(specs.LinuxDeviceCgroup{Allow: true, Type: "c", Major: &caps, Minor: &capNode31, Access: "rw"})),
		"one capability minor counts as its node")

	many := migContainer()
	many.ManyDynamicMajorRules = true
	assert.Equal(t, []string{"1", "1:0"}, resolve(many), "too many rules to read: the whole parent GPU")

	privileged := migContainer(specs.LinuxDeviceCgroup{Allow: true, Access: "rwm"})
	privileged.Privileged = true
	assert.True(t, privileged.AllDevicesAllowed)
	assert.Empty(t, resolve(privileged), "an engine's allow-all cgroup is no request, for capabilities as for nodes")
}

// The rules that can reach a node of the (unknown) nvidia-caps major are
// kept for the resolver: type "c" rules for a dynamic major or for no major,
// and type "a" rules, which reset what came before.
func TestDynamicMajorRules(t *testing.T) {
	denyAll := rule(false, "a", -1, -1, "rwm")
	for _, tc := range []struct {
		name  string
		rules []DeviceRule
		kept  []DeviceRule
		many  bool
	}{
		{"none", nil, nil, false},
		{"type a and no type", []DeviceRule{denyAll, rule(true, "", 1, 3, "rw")}, []DeviceRule{denyAll, rule(true, "", 1, 3, "rw")}, false},
		{"no major", []DeviceRule{rule(true, "c", -1, 291, "rw"), rule(true, "c", -1, -1, "m")}, []DeviceRule{rule(true, "c", -1, 291, "rw"), rule(true, "c", -1, -1, "m")}, false},
		{"dynamic majors only", []DeviceRule{rule(true, "c", 195, 0, "rw"), rule(true, "c", 233, 1, "rw"), rule(true, "c", 234, 1, "rw"), rule(true, "c", 508, -1, "rw")},
			[]DeviceRule{rule(true, "c", 234, 1, "rw"), rule(true, "c", 508, -1, "rw")}, false},
		{"block devices are never nvidia-caps", []DeviceRule{rule(true, "b", -1, -1, "rwm"), rule(true, "b", 508, 1, "rw")}, nil, false},
		{"too many", func() []DeviceRule {
			var rs []DeviceRule
			for i := 0; i <= maxDynamicMajorRules; i++ {
				rs = append(rs, rule(true, "c", -1, int64(i), "rw"))
			}
			return rs
		}(), nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var req Request
			req.ApplyDeviceRules(tc.rules)
			assert.Equal(t, tc.many, req.ManyDynamicMajorRules)
			if !tc.many {
				assert.Equal(t, tc.kept, req.DynamicMajorRules)
			}
		})
	}
}

// nvidia-caps minors go far past the GPU minors (up to thousands on an
// 8-GPU host): a rule for one of them, even with no major, opens that MIG
// instance's capability.
func TestCapsRulesPastGPUMinors(t *testing.T) {
	gpus := []GPU{{Index: 0, UUID: gpuUUID(0), Minor: 2, MIG: []MIG{
		{Index: 0, UUID: migUUID(0, 0), GI: 1, CI: 0},
		{Index: 1, UUID: migUUID(0, 1), GI: 2, CI: 0},
	}}}
	caps := []MIGCap{
		{Minor: 282, Kind: CapGIAccess, GPUMinor: 2, GI: 1}, {Minor: 283, Kind: CapCIAccess, GPUMinor: 2, GI: 1, CI: 0},
		{Minor: 291, Kind: CapGIAccess, GPUMinor: 2, GI: 2}, {Minor: 292, Kind: CapCIAccess, GPUMinor: 2, GI: 2, CI: 0},
	}
	inv, err := newInventory(Inventory{Source: "static", GPUs: gpus, CapsMajor: 508, MIGCaps: caps})
	require.NoError(t, err)
	denyAll := rule(false, "a", -1, -1, "rwm")
	for _, tc := range []struct {
		name  string
		rules []DeviceRule
		want  []string
	}{
		{"only its own instance", []DeviceRule{denyAll}, []string{migUUID(0, 0)}},
		{"c *:291/292 open MIG 0:1", []DeviceRule{denyAll, rule(true, "c", -1, 291, "rw"), rule(true, "c", -1, 292, "rw")}, []string{migUUID(0, 0), migUUID(0, 1)}},
		{"c 508:292 opens MIG 0:1", []DeviceRule{denyAll, rule(true, "c", 508, 292, "r")}, []string{migUUID(0, 0), migUUID(0, 1)}},
		{"c *:291 alone opens its GPU instance", []DeviceRule{denyAll, rule(true, "c", -1, 291, "rw")}, []string{migUUID(0, 0), migUUID(0, 1)}},
		{"taken back by type a", []DeviceRule{rule(true, "c", -1, 292, "rw"), denyAll}, []string{migUUID(0, 0)}},
		{"a deny of c 508:* does not take c *:292 back", []DeviceRule{denyAll, rule(true, "c", -1, 292, "rw"), rule(false, "c", 508, -1, "rwm")}, []string{migUUID(0, 0), migUUID(0, 1)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := Request{
				Env:     env("NVIDIA_VISIBLE_DEVICES=" + migUUID(0, 0)),
				Devices: []LinuxDevice{dev("/dev/nvidia2", 195, 2), dev("/dev/nvidia-caps/nvidia-cap282", 508, 282), dev("/dev/nvidia-caps/nvidia-cap283", 508, 283)},
			}
			req.ApplyDeviceRules(tc.rules)
			res, err := NewResolver(inv, defaultPolicy()).Resolve(req)
			require.NoError(t, err)
			assert.Equal(t, sorted(tc.want...), res.UUIDs())
		})
	}
}
