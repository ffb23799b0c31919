// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"sync"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

const mr = MountRoot + "/"

func env(kv ...string) []string { return kv }

func dev(path string, major, minor int64) LinuxDevice {
	return LinuxDevice{Path: path, Type: "c", Major: major, Minor: minor}
}

type resolveCase struct {
	name   string
	req    Request
	policy func(*config.PolicyConfig)
	// want lists the expected devices by test-inventory index ("1", "1:0").
	want    []string
	wantAll bool
	// sources, by index, that must be recorded (in this order).
	sources map[string][]string
	notes   []string // substrings that must appear in some note
	err     error    // sentinel the error must wrap
	errHas  []string // substrings the error must contain
}

func runResolveCases(t *testing.T, cases []resolveCase) {
	t.Helper()
	runResolveCasesOn(t, testInventory(t), cases)
}

// runResolveCasesOn runs cases against inv instead of the test inventory.
func runResolveCasesOn(t *testing.T, inv *Inventory, cases []resolveCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pol := defaultPolicy()
			if tc.policy != nil {
				tc.policy(&pol)
			}
			res, err := NewResolver(inv, pol).Resolve(tc.req)
			if tc.err != nil {
				require.ErrorIs(t, err, tc.err)
				for _, s := range tc.errHas {
					assert.Contains(t, err.Error(), s)
				}
				assert.Empty(t, res.Devices, "nothing may be claimed for a failed resolution")
				return
			}
			require.NoError(t, err)
			want := make([]string, len(tc.want))
			for i, idx := range tc.want {
				want[i] = uuidOf(t, inv, idx)
			}
			sort.Strings(want)
			if len(want) == 0 {
				want = []string{}
			}
			assert.Equal(t, want, res.UUIDs())
			assert.Equal(t, tc.wantAll, res.All, "All")
			assert.Equal(t, tc.req.Privileged || tc.req.GPUNodesAllowed, res.Privileged, "Privileged")
			for idx, srcs := range tc.sources {
				u := uuidOf(t, inv, idx)
				var got []string
				for _, d := range res.Devices {
					if d.UUID == u {
						got = d.Sources
					}
				}
				assert.Equal(t, srcs, got, "sources of %s", idx)
			}
			for _, n := range tc.notes {
				assert.True(t, containsAny(res.Notes, n), "no note contains %q in %q", n, res.Notes)
			}
		})
	}
}

func containsAny(list []string, sub string) bool {
	for _, s := range list {
		if strings.Contains(s, sub) {
			return true
		}
	}
	return false
}

var allGPUs = []string{"0", "1", "2", "3"}

func TestResolveVisibleDevicesEnv(t *testing.T) {
	const nvd = "NVIDIA_VISIBLE_DEVICES="
	swarm := func(p *config.PolicyConfig) {
		p.SwarmResourceEnvvars = []string{"DOCKER_RESOURCE_NVIDIA-GPU", "DOCKER_RESOURCE_GPU"}
	}
	runResolveCases(t, []resolveCase{
		{name: "no variable, nothing", req: Request{Env: env("PATH=/bin")}, want: nil},
		{name: "one index", req: Request{Env: env(nvd + "0")}, want: []string{"0"},
			sources: map[string][]string{"0": {`env NVIDIA_VISIBLE_DEVICES="0"`}}},
		{name: "indices with spaces", req: Request{Env: env(nvd + " 1 , 2 ")}, want: []string{"1", "2"}},
		{name: "empty entries dropped", req: Request{Env: env(nvd + ",0,,2,")}, want: []string{"0", "2"}},
		{name: "0,all is all", req: Request{Env: env(nvd + "0,all")}, want: allGPUs, wantAll: true,
			sources: map[string][]string{"0": {`env NVIDIA_VISIBLE_DEVICES="all"`}}},
		{name: "all alone", req: Request{Env: env(nvd + "all")}, want: allGPUs, wantAll: true},
		{name: "ALL is all, as the runtime reads it", req: Request{Env: env(nvd + "ALL")}, want: allGPUs, wantAll: true},
		{name: "void,0 is nothing", req: Request{Env: env(nvd + "void,0")}, want: nil, notes: []string{`"void"`}},
		{name: "0,void is nothing", req: Request{Env: env(nvd + "0,void")}, want: nil},
		{name: "void beats all", req: Request{Env: env(nvd + "all,void")}, want: nil},
		{name: "none", req: Request{Env: env(nvd + "none")}, want: nil, notes: []string{`"none": no GPU`}},
		{name: "none then all: first wins", req: Request{Env: env(nvd + "none,all")}, want: nil},
		{name: "all then none: first wins", req: Request{Env: env(nvd + "all,none")}, want: allGPUs, wantAll: true},
		{name: "1,none is nothing", req: Request{Env: env(nvd + "1,none")}, want: nil},
		{name: "empty value", req: Request{Env: env(nvd)}, want: nil, notes: []string{"empty"}},
		{name: "only commas and blanks", req: Request{Env: env(nvd + " , ,")}, want: nil, notes: []string{"empty"}},
		{name: "last occurrence wins", req: Request{Env: env(nvd+"0", "A=b", nvd+"1")}, want: []string{"1"}},
		{name: "last occurrence wins even when void", req: Request{Env: env(nvd+"0", nvd+"void")}, want: nil},
		{name: "last occurrence wins even when empty", req: Request{Env: env(nvd+"0", nvd)}, want: nil},
		{name: "entries without = are ignored", req: Request{Env: env("NVIDIA_VISIBLE_DEVICES", nvd+"2")}, want: []string{"2"}},
		{name: "similar names are not read", req: Request{Env: env("NVIDIA_VISIBLE_DEVICES_X=0", "X_NVIDIA_VISIBLE_DEVICES=1")}, want: nil},
		{name: "GPU UUID", req: Request{Env: env(nvd + gpuUUID(2))}, want: []string{"2"}},
		{name: "GPU UUID in upper case", req: Request{Env: env(nvd + strings.ToUpper(gpuUUID(2)))}, want: []string{"2"}},
		{name: "unique GPU UUID prefix, as the runtime accepts", req: Request{Env: env(nvd + "GPU-d0000002")}, want: []string{"2"}},
		{name: "MIG UUID", req: Request{Env: env(nvd + migUUID(1, 1))}, want: []string{"1:1"}},
		{name: "legacy MIG-GPU-<uuid>/gi/ci", req: Request{Env: env(nvd + "MIG-" + gpuUUID(1) + "/1/0")}, want: []string{"1:0"}},
		{name: "legacy MIG second instance", req: Request{Env: env(nvd + "MIG-" + gpuUUID(1) + "/2/1")}, want: []string{"1:2"}},
		{name: "MIG by index", req: Request{Env: env(nvd + "1:0")}, want: []string{"1:0"}},
		{name: "GPU and one of its MIGs are both claimed", req: Request{Env: env(nvd + "1,1:1")}, want: []string{"1", "1:1"}},
		{name: "index with leading zero and plus, as strtoumax reads them", req: Request{Env: env(nvd + "01,+3")}, want: []string{"1", "3"}},
		{name: "PCI bus id", req: Request{Env: env(nvd + "0000:3b:00.0")}, want: []string{"1"}},
		{name: "PCI bus id, NVML spelling", req: Request{Env: env(nvd + "00000000:5B:00.0")}, want: []string{"2"}},
		{name: "duplicates are de-duplicated", req: Request{Env: env(nvd + "2," + gpuUUID(2) + ",2")}, want: []string{"2"},
			sources: map[string][]string{"2": {`env NVIDIA_VISIBLE_DEVICES="2"`, `env NVIDIA_VISIBLE_DEVICES="` + gpuUUID(2) + `"`}}},
		{name: "DOCKER_RESOURCE_GPU is read too", req: Request{Env: env("DOCKER_RESOURCE_GPU=3")}, want: []string{"3"},
			sources: map[string][]string{"3": {`env DOCKER_RESOURCE_GPU="3"`}}},
		{name: "both variables: union", req: Request{Env: env(nvd+"0", "DOCKER_RESOURCE_GPU=2")}, want: []string{"0", "2"}},
		{name: "void in one variable does not void the other", req: Request{Env: env(nvd+"0", "DOCKER_RESOURCE_GPU=void")}, want: []string{"0"}},
		// A swarm generic resource NVIDIA's runtime is configured to read
		// (swarm-resource) is read when listed, last occurrence winning,
		// and claimed in the union; unlisted, it is just a variable.
		{name: "listed swarm variable", policy: swarm, req: Request{Env: env("DOCKER_RESOURCE_NVIDIA-GPU=1", "DOCKER_RESOURCE_NVIDIA-GPU="+gpuUUID(3))},
			want: []string{"3"}, sources: map[string][]string{"3": {`env DOCKER_RESOURCE_NVIDIA-GPU="` + gpuUUID(3) + `"`}}},
		{name: "listed swarm variable beside NVIDIA_VISIBLE_DEVICES: union", policy: swarm,
			req: Request{Env: env(nvd+"0", "OTHER=2", "DOCKER_RESOURCE_NVIDIA-GPU=2")}, want: []string{"0", "2"}},
		{name: "listed swarm variable, malformed id", policy: swarm, req: Request{Env: env("DOCKER_RESOURCE_NVIDIA-GPU=-1")}, err: ErrInvalidID,
			errHas: []string{"env DOCKER_RESOURCE_NVIDIA-GPU"}},
		{name: "unlisted swarm variable is no request", req: Request{Env: env("DOCKER_RESOURCE_NVIDIA-GPU=1")}, want: nil},
		{name: "docker --gpus 2 is literally 0,1", req: Request{Env: env(nvd + "0,1")}, want: []string{"0", "1"}},
	})
}

func TestResolveUnknownAndInvalidIDs(t *testing.T) {
	const nvd = "NVIDIA_VISIBLE_DEVICES="
	ignore := func(p *config.PolicyConfig) { p.UnknownDevice = config.UnknownIgnore }
	unknownUUID := "GPU-00000000-0000-4000-8000-000000000000"
	runResolveCases(t, []resolveCase{
		{name: "unknown index rejected", req: Request{Env: env(nvd + "0,7")}, err: ErrUnknownDevice,
			errHas: []string{`env NVIDIA_VISIBLE_DEVICES: unknown GPU "7"`, "known: 0-3, 1:0, 1:1, 1:2 / GPU-c0000000…", "policy.unknown_device"}},
		{name: "unknown index ignored by policy", policy: ignore, req: Request{Env: env(nvd + "0,7")}, want: []string{"0"},
			notes: []string{`ignored unknown GPU "7"`}},
		{name: "unknown UUID rejected", req: Request{Env: env(nvd + unknownUUID)}, err: ErrUnknownDevice,
			errHas: []string{`unknown GPU "` + unknownUUID + `"`}},
		{name: "unknown UUID ignored by policy", policy: ignore, req: Request{Env: env(nvd + unknownUUID)}, want: nil,
			notes: []string{unknownUUID}},
		{name: "unknown MIG UUID", req: Request{Env: env(nvd + migUUID(3, 3))}, err: ErrUnknownDevice},
		{name: "unknown MIG index", req: Request{Env: env(nvd + "0:0")}, err: ErrUnknownDevice, errHas: []string{`"0:0"`}},
		{name: "legacy MIG with unknown instance", req: Request{Env: env(nvd + "MIG-" + gpuUUID(1) + "/5/0")}, err: ErrUnknownDevice},
		{name: "malformed legacy MIG", req: Request{Env: env(nvd + "MIG-" + gpuUUID(1) + "/x/0")}, err: ErrInvalidID},
		{name: "huge index", req: Request{Env: env(nvd + "99999999999999999999")}, err: ErrUnknownDevice},
		{name: "garbage id", req: Request{Env: env(nvd + "foo")}, err: ErrInvalidID,
			errHas: []string{`invalid device id "foo"`, "want an index"}},
		{name: "NONE is no keyword", req: Request{Env: env(nvd + "NONE")}, err: ErrInvalidID},
		{name: "negative index", req: Request{Env: env(nvd + "-1")}, err: ErrInvalidID},
		{name: "bare GPU- prefix is no id", req: Request{Env: env(nvd + "GPU-")}, err: ErrInvalidID, errHas: []string{`"GPU-"`}},
		{name: "UUID prefix matching nothing", req: Request{Env: env(nvd + "GPU-0")}, err: ErrUnknownDevice},
		{name: "every bad token is reported", req: Request{Env: env(nvd+"7,8", "DOCKER_RESOURCE_GPU=9")}, err: ErrUnknownDevice,
			errHas: []string{`"7"`, `"8"`, `env DOCKER_RESOURCE_GPU: unknown GPU "9"`}},
		{name: "tokens are quoted, control characters escaped", req: Request{Env: env(nvd + "0\x1b[31m")}, err: ErrInvalidID,
			errHas: []string{`"0\x1b[31m"`}},
		// A malformed id is refused under every policy: the runtime reads
		// ids more loosely than their forms (strtoumax, sscanf) and may
		// select a GPU by it. Only well-formed ids may be ignored.
		{name: "-0 (strtoumax reads GPU 0) under ignore", policy: ignore, req: Request{Env: env(nvd + "-0")}, err: ErrInvalidID,
			errHas: []string{`"-0"`, `policy.unknown_device = "ignore" does not apply`}},
		{name: "1:0abc (sscanf reads MIG 1:0) under ignore", policy: ignore, req: Request{Env: env(nvd + "1:0abc")}, err: ErrInvalidID},
		{name: "garbage under ignore", policy: ignore, req: Request{Env: env(nvd + "0,foo")}, err: ErrInvalidID, errHas: []string{`"foo"`}},
		{name: "malformed legacy MIG under ignore", policy: ignore, req: Request{Env: env(nvd + "MIG-" + gpuUUID(1) + "/x/0")}, err: ErrInvalidID},
		{name: "malformed CDI name under ignore", policy: ignore, req: Request{CDIDevices: []string{"nvidia.com/gpu=gpux"}}, err: ErrInvalidID},
		{name: "bus id of another function is that device's GPU", req: Request{Env: env(nvd + "0000:1b:00.1")}, want: []string{"0"},
			sources: map[string][]string{"0": {`env NVIDIA_VISIBLE_DEVICES="0000:1b:00.1"`}}},
		{name: "bus id of another function, under ignore", policy: ignore, req: Request{Env: env(nvd + "0000:1b:00.1")}, want: []string{"0"}},
		// A bus id of no GPU is read by the runtime as <gpu>:<mig>
		// (sscanf "%u:%u": 0001:02:00.0 is MIG 1:2), so it is refused
		// under every policy.
		{name: "bus id of no GPU (MIG 1:2 to the runtime) under ignore", policy: ignore, req: Request{Env: env(nvd + "0001:02:00.0,1")}, err: ErrUnknownDevice,
			errHas: []string{`"0001:02:00.0"`, "reads it as MIG 1:2", `policy.unknown_device = "ignore" does not apply`}},
		{name: "bus id of no GPU (MIG 0:1 to the runtime) under ignore", policy: ignore, req: Request{Env: env(nvd + "0000:1c:00.0")}, err: ErrUnknownDevice,
			errHas: []string{"reads it as MIG 0:1"}},
		{name: "bus id of no GPU with a hex bus under ignore", policy: ignore, req: Request{Env: env(nvd + "0000:ff:00.0")}, err: ErrUnknownDevice,
			errHas: []string{`"0000:ff:00.0"`, "no GPU of this host has this PCI bus id"}},
		{name: "bus id of no GPU in a mount under ignore", policy: ignore, req: Request{Mounts: []string{mr + "0001:02:00.0"}}, err: ErrUnknownDevice},
		{name: "bus id of no GPU, rejected", req: Request{Env: env(nvd + "0000:1c:00.0")}, err: ErrUnknownDevice,
			errHas: []string{"fix the id"}},
		// The device plugin's volume-mount strategy sets
		// NVIDIA_VISIBLE_DEVICES to the mount root; the ids are the mounts.
		{name: "the mount root in env names no id", req: Request{Env: env(nvd + MountRoot), Mounts: []string{mr + "2"}}, want: []string{"2"},
			notes: []string{"the device list is in the volume mounts"}},
		{name: "the mount root beside an id", req: Request{Env: env(nvd + "0," + MountRoot)}, want: []string{"0"}},
		{name: "a path under the mount root in env is no id", policy: ignore, req: Request{Env: env(nvd + mr + "0")}, err: ErrInvalidID},
	})
}

func TestResolveAmbiguousPrefix(t *testing.T) {
	gpus := []GPU{
		{Index: 0, UUID: "GPU-ab000000-0000-4000-8000-000000000000", Minor: 0},
		{Index: 1, UUID: "GPU-ab100000-0000-4000-8000-000000000001", Minor: 1},
	}
	inv, err := NewInventory("nvml", gpus)
	require.NoError(t, err)
	for _, pol := range []config.UnknownDevice{config.UnknownReject, config.UnknownIgnore} {
		p := defaultPolicy()
		p.UnknownDevice = pol
		_, err = NewResolver(inv, p).Resolve(Request{Env: env("NVIDIA_VISIBLE_DEVICES=GPU-ab")})
		require.ErrorIs(t, err, ErrInvalidID, pol)
		assert.Contains(t, err.Error(), "ambiguous")
		assert.Contains(t, err.Error(), gpus[0].UUID)
		assert.Contains(t, err.Error(), gpus[1].UUID)
	}
	res, err := NewResolver(inv, defaultPolicy()).Resolve(Request{Env: env("NVIDIA_VISIBLE_DEVICES=GPU-ab1")})
	require.NoError(t, err)
	assert.Equal(t, []string{gpus[1].UUID}, res.UUIDs())
}

func TestResolveAllPolicies(t *testing.T) {
	reject := func(p *config.PolicyConfig) { p.AllDevices = config.AllReject }
	ignore := func(p *config.PolicyConfig) { p.AllDevices = config.AllIgnore }
	envAll := Request{Env: env("NVIDIA_VISIBLE_DEVICES=all")}
	cdiAll := Request{Annotations: map[string]string{"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}}
	listAll := Request{CDIDevices: []string{"nvidia.com/gpu=all"}}
	mountAll := Request{Mounts: []string{mr + "all"}}
	runResolveCases(t, []resolveCase{
		{name: "env all, claim", req: envAll, want: allGPUs, wantAll: true},
		{name: "env all, reject", policy: reject, req: envAll, err: ErrAllRejected,
			errHas: []string{`env NVIDIA_VISIBLE_DEVICES="all"`, `policy.all_devices = "reject"`}},
		{name: "env all, ignore", policy: ignore, req: envAll, want: nil, notes: []string{"ignored"}},
		{name: "env all, ignore keeps the other sources", policy: ignore,
			req: Request{Env: env("NVIDIA_VISIBLE_DEVICES=all", "DOCKER_RESOURCE_GPU=2")}, want: []string{"2"}},
		{name: "nvidia.com/gpu=all, claim", req: cdiAll, want: allGPUs, wantAll: true,
			sources: map[string][]string{"3": {`annotation cdi.k8s.io/gpu="nvidia.com/gpu=all"`}}},
		{name: "nvidia.com/gpu=all, reject", policy: reject, req: cdiAll, err: ErrAllRejected, errHas: []string{"nvidia.com/gpu=all"}},
		{name: "nvidia.com/gpu=all, ignore", policy: ignore, req: cdiAll, want: nil},
		{name: "CDI list all, claim", req: listAll, want: allGPUs, wantAll: true},
		{name: "CDI list all, reject", policy: reject, req: listAll, err: ErrAllRejected},
		{name: "CDI list all, ignore", policy: ignore, req: listAll, want: nil},
		{name: "mount all, claim", req: mountAll, want: allGPUs, wantAll: true},
		{name: "mount all, reject", policy: reject, req: mountAll, err: ErrAllRejected},
		{name: "unset policy behaves as claim", policy: func(p *config.PolicyConfig) { p.AllDevices = "" }, req: envAll, want: allGPUs, wantAll: true},
	})
}

// NVIDIA's runtime gives every GPU to a legacy CUDA image (CUDA_VERSION set,
// no NVIDIA_REQUIRE_CUDA: built before CUDA 9) that leaves
// NVIDIA_VISIBLE_DEVICES unset; so does the resolver, under all_devices.
func TestResolveLegacyCUDAImage(t *testing.T) {
	legacy := Request{Env: env("PATH=/bin", "CUDA_VERSION=8.0.61")}
	runResolveCases(t, []resolveCase{
		{name: "legacy, unset: every GPU", req: legacy, want: allGPUs, wantAll: true,
			sources: map[string][]string{"0": {`env NVIDIA_VISIBLE_DEVICES unset on a legacy CUDA image (CUDA_VERSION="8.0.61", no NVIDIA_REQUIRE_CUDA)`}}},
		{name: "legacy, empty NVIDIA_REQUIRE_CUDA", req: Request{Env: env("CUDA_VERSION=8.0", "NVIDIA_REQUIRE_CUDA=")}, want: allGPUs, wantAll: true},
		{name: "legacy, all_devices reject", policy: func(p *config.PolicyConfig) { p.AllDevices = config.AllReject }, req: legacy,
			err: ErrAllRejected, errHas: []string{"legacy CUDA image"}},
		{name: "legacy, all_devices ignore", policy: func(p *config.PolicyConfig) { p.AllDevices = config.AllIgnore }, req: legacy, want: nil},
		{name: "modern image (NVIDIA_REQUIRE_CUDA set), unset: nothing", req: Request{Env: env("CUDA_VERSION=12.4.1", "NVIDIA_REQUIRE_CUDA=cuda>=12.4")}, want: nil},
		{name: "legacy, set: the list", req: Request{Env: env("CUDA_VERSION=8.0", "NVIDIA_VISIBLE_DEVICES=1")}, want: []string{"1"}},
		{name: "legacy, set but empty: nothing", req: Request{Env: env("CUDA_VERSION=8.0", "NVIDIA_VISIBLE_DEVICES=")}, want: nil},
		{name: "legacy, void", req: Request{Env: env("CUDA_VERSION=8.0", "NVIDIA_VISIBLE_DEVICES=void")}, want: nil},
		// The runtime reads DOCKER_RESOURCE_GPU only when configured to
		// (swarm-resource, unset by default); then NVIDIA_VISIBLE_DEVICES
		// unset is every GPU. The union is claimed.
		{name: "legacy, DOCKER_RESOURCE_GPU does not switch the rule off", req: Request{Env: env("CUDA_VERSION=8.0", "DOCKER_RESOURCE_GPU=2")}, want: allGPUs, wantAll: true,
			sources: map[string][]string{"2": {`env NVIDIA_VISIBLE_DEVICES unset on a legacy CUDA image (CUDA_VERSION="8.0", no NVIDIA_REQUIRE_CUDA)`, `env DOCKER_RESOURCE_GPU="2"`}}},
		{name: "legacy, DOCKER_RESOURCE_GPU=void", req: Request{Env: env("CUDA_VERSION=8.0", "DOCKER_RESOURCE_GPU=void")}, want: allGPUs, wantAll: true},
		{name: "legacy, NVIDIA_VISIBLE_DEVICES set beside DOCKER_RESOURCE_GPU: the union", req: Request{Env: env("CUDA_VERSION=8.0", "NVIDIA_VISIBLE_DEVICES=0", "DOCKER_RESOURCE_GPU=2")}, want: []string{"0", "2"}},
	})
}

func TestResolvePrivileged(t *testing.T) {
	pol := func(v config.Privileged) func(*config.PolicyConfig) {
		return func(p *config.PolicyConfig) { p.Privileged = v }
	}
	named := Request{Privileged: true, Env: env("NVIDIA_VISIBLE_DEVICES=2")}
	// What podman and containerd's CRI hand a privileged container: every
	// host device node, GPUs included.
	everyNode := []LinuxDevice{dev("/dev/nvidia0", 195, 0), dev("/dev/nvidia1", 195, 1), dev("/dev/nvidia2", 195, 2),
		dev("/dev/nvidia3", 195, 3), dev("/dev/nvidiactl", 195, 255)}
	runResolveCases(t, []resolveCase{
		{name: "declared: the nodes an engine adds are no request", policy: pol(config.PrivilegedDeclared),
			req: Request{Privileged: true, AllDevicesAllowed: true, Devices: everyNode}, want: nil, notes: []string{"4 GPU device node(s) are not counted"}},
		{name: "declared: nodes plus a named GPU claim only that GPU", policy: pol(config.PrivilegedDeclared),
			req: Request{Privileged: true, AllDevicesAllowed: true, Devices: everyNode, Env: env("NVIDIA_VISIBLE_DEVICES=2")}, want: []string{"2"},
			sources: map[string][]string{"2": {`env NVIDIA_VISIBLE_DEVICES="2"`}}},
		{name: "nodes of an unprivileged container are a request", policy: pol(config.PrivilegedDeclared),
			req: Request{Devices: everyNode[:1]}, want: []string{"0"}},
		// An unprivileged container's rule that opens every GPU node was
		// asked for (no engine sets one up wholesale), and with CAP_MKNOD
		// or a bind-mounted /dev the container reaches every GPU: it
		// claims them all (it claimed nothing but its listed nodes).
		{name: "declared: an unprivileged container whose device cgroup allows every device claims every GPU",
			policy: pol(config.PrivilegedDeclared),
			req:    Request{AllDevicesAllowed: true, GPUNodesAllowed: true, Devices: everyNode[:1]}, want: allGPUs, wantAll: true,
			sources: map[string][]string{"1": {srcGPURule}}},
		{name: "declared: an unprivileged c 195:* rule claims every GPU", policy: pol(config.PrivilegedDeclared),
			req: Request{GPUNodesAllowed: true}, want: allGPUs, wantAll: true},
		// CAP_SYS_ADMIN (--cap-add) does not make the rule the engine's:
		// only a device cgroup allowing everything is.
		{name: "declared: CAP_SYS_ADMIN with a c 195:* rule claims every GPU", policy: pol(config.PrivilegedDeclared),
			req: Request{Privileged: true, GPUNodesAllowed: true}, want: allGPUs, wantAll: true},
		{name: "declared: privileged with every device allowed claims what it names", policy: pol(config.PrivilegedDeclared),
			req: Request{Privileged: true, AllDevicesAllowed: true, GPUNodesAllowed: true, Env: env("NVIDIA_VISIBLE_DEVICES=2")}, want: []string{"2"}},
		{name: "declared: an unprivileged c 195:* rule under all_devices = reject", req: Request{GPUNodesAllowed: true},
			policy: func(p *config.PolicyConfig) { p.Privileged, p.AllDevices = config.PrivilegedDeclared, config.AllReject },
			err:    ErrAllRejected, errHas: []string{srcGPURule, "let its device cgroup allow only their nodes"}},
		{name: "reject: an unprivileged c 195:* rule", policy: pol(config.PrivilegedReject), req: Request{GPUNodesAllowed: true},
			err: ErrPrivilegedRejected, errHas: []string{"c 195:*"}},
		// No device cgroup: the claim and the refusal name the cause, and
		// a root filesystem not mounted nodev (the only cause) is named as
		// such, with its remedy: the host's /dev and CAP_MKNOD are not.
		{name: "declared: no device cgroup claims every GPU", policy: pol(config.PrivilegedDeclared),
			req: Request{GPUNodesAllowed: true, NoDeviceCgroup: true}, want: allGPUs, wantAll: true,
			sources: map[string][]string{"1": {srcNoDeviceCgroup}}},
		{name: "declared: no device cgroup, a root not nodev claims every GPU", policy: pol(config.PrivilegedDeclared),
			req: Request{GPUNodesAllowed: true, NoDeviceCgroup: true, ImageNodes: true}, want: allGPUs, wantAll: true,
			sources: map[string][]string{"1": {"no device cgroup (root filesystem not mounted nodev: its image's device nodes open)"}}},
		{name: "declared: no device cgroup, a root not nodev, under all_devices = reject",
			policy: func(p *config.PolicyConfig) { p.Privileged, p.AllDevices = config.PrivilegedDeclared, config.AllReject },
			req:    Request{GPUNodesAllowed: true, NoDeviceCgroup: true, ImageNodes: true},
			err:    ErrAllRejected, errHas: []string{"root filesystem not mounted nodev", `mountopt = "nodev"`, "cgroups enabled"}},
		{name: "reject: no device cgroup, a root not nodev", policy: pol(config.PrivilegedReject),
			req: Request{GPUNodesAllowed: true, NoDeviceCgroup: true, ImageNodes: true},
			err: ErrPrivilegedRejected, errHas: []string{"whose root filesystem is not mounted nodev", "its image carries", `mountopt = "nodev"`}},
		// A directory bound in whose nodes open is named, with its
		// remedy; the others are counted, and a path that is not plain
		// is quoted.
		{name: "declared: no device cgroup, a bind source not nodev claims every GPU", policy: pol(config.PrivilegedDeclared),
			req:  Request{GPUNodesAllowed: true, NoDeviceCgroup: true, NodeDirs: []NodeDir{{Path: "/srv/vol", BoundAt: "/data"}}},
			want: allGPUs, wantAll: true,
			sources: map[string][]string{"1": {"no device cgroup (bind source /srv/vol not mounted nodev: its device nodes open)"}}},
		{name: "declared: no device cgroup, a root and two bind sources not nodev, under all_devices = reject",
			policy: func(p *config.PolicyConfig) { p.Privileged, p.AllDevices = config.PrivilegedDeclared, config.AllReject },
			req: Request{GPUNodesAllowed: true, NoDeviceCgroup: true, ImageNodes: true,
				NodeDirs: []NodeDir{{Path: "/srv/a b", BoundAt: "/data"}, {Path: "/srv/c", BoundAt: "/c"}}},
			err: ErrAllRejected, errHas: []string{
				`no device cgroup (root filesystem not mounted nodev: its image's device nodes open; bind source "/srv/a b" (and 1 more directory) not mounted nodev`,
				`mountopt = "nodev"`, `mount "/srv/a b" nodev or give its bind the nodev option`, "cgroups enabled"}},
		{name: "reject: no device cgroup, an overlay not nodev", policy: pol(config.PrivilegedReject),
			req: Request{GPUNodesAllowed: true, NoDeviceCgroup: true, NodeDirs: []NodeDir{{Path: "/srv/l", BoundAt: "/x", Overlay: true}}},
			err: ErrPrivilegedRejected, errHas: []string{"whose overlay at /x is not mounted nodev (a device node in its layer /srv/l",
				"give the overlay at /x the nodev option"}},
		{name: "reject: no device cgroup", policy: pol(config.PrivilegedReject),
			req: Request{GPUNodesAllowed: true, NoDeviceCgroup: true},
			err: ErrPrivilegedRejected, errHas: []string{"the host's /dev bound in, or CAP_MKNOD", "without CAP_MKNOD and CAP_SYS_ADMIN"}},
		{name: "declared: CAP_SYS_ADMIN with a device cgroup that allows one node: the node is a request",
			policy: pol(config.PrivilegedDeclared),
			req:    Request{Privileged: true, Devices: everyNode[:1]}, want: []string{"0"}},
		{name: "all: the nodes change nothing", policy: pol(config.PrivilegedAll),
			req: Request{Privileged: true, Devices: everyNode}, want: allGPUs, wantAll: true},
		{name: "declared claims what it names", policy: pol(config.PrivilegedDeclared), req: named, want: []string{"2"},
			notes: []string{"privileged container"}},
		{name: "declared with nothing named", policy: pol(config.PrivilegedDeclared), req: Request{Privileged: true}, want: nil},
		{name: "all claims every GPU", policy: pol(config.PrivilegedAll), req: named, want: allGPUs, wantAll: true,
			sources: map[string][]string{"0": {"privileged"}, "2": {"privileged", `env NVIDIA_VISIBLE_DEVICES="2"`}}},
		{name: "all is not subject to all_devices", req: named, want: allGPUs, wantAll: true,
			policy: func(p *config.PolicyConfig) { p.Privileged, p.AllDevices = config.PrivilegedAll, config.AllReject }},
		{name: "reject", policy: pol(config.PrivilegedReject), req: named, err: ErrPrivilegedRejected,
			errHas: []string{"privileged container (CAP_SYS_ADMIN)", `policy.privileged = "reject"`}},
		{name: "reject leaves unprivileged containers alone", policy: pol(config.PrivilegedReject),
			req: Request{Env: env("NVIDIA_VISIBLE_DEVICES=2")}, want: []string{"2"}},
	})
}

func TestResolveMounts(t *testing.T) {
	ignore := func(p *config.PolicyConfig) { p.UnknownDevice = config.UnknownIgnore }
	var cases []resolveCase
	cases = append(cases,
		resolveCase{name: "one id", req: Request{Mounts: []string{"/proc", mr + "1"}}, want: []string{"1"},
			sources: map[string][]string{"1": {"mount " + mr + "1"}}},
		resolveCase{name: "several ids", req: Request{Mounts: []string{mr + "0", mr + gpuUUID(3)}}, want: []string{"0", "3"}},
		resolveCase{name: "MIG by index", req: Request{Mounts: []string{mr + "1:2"}}, want: []string{"1:2"}},
		// The runtime hands mounted ids on as they are: no void or none
		// keyword, and its device selection takes every GPU at "all".
		resolveCase{name: "all then void is all", req: Request{Mounts: []string{mr + "all", mr + "void"}}, want: allGPUs, wantAll: true,
			sources: map[string][]string{"0": {"mount " + mr + "all"}}},
		resolveCase{name: "void then all is all", req: Request{Mounts: []string{mr + "void", mr + "0", mr + "all"}}, want: allGPUs, wantAll: true},
		resolveCase{name: "none then all is all", req: Request{Mounts: []string{mr + "none", mr + "all"}}, want: allGPUs, wantAll: true},
		resolveCase{name: "ALL in any case", req: Request{Mounts: []string{mr + "1", mr + "All"}}, want: allGPUs, wantAll: true},
		resolveCase{name: "void is no keyword in a mount", req: Request{Mounts: []string{mr + "0", mr + "void"}}, err: ErrInvalidID,
			errHas: []string{"mount " + mr + "void", `"void"`, "no keywords in a volume mount"}},
		resolveCase{name: "none is no keyword in a mount, under ignore too", policy: ignore, req: Request{Mounts: []string{mr + "none"}}, err: ErrInvalidID,
			errHas: []string{`"none"`}},
		// The runtime joins mounted ids with commas, and its index
		// parsing skips leading blanks.
		resolveCase{name: "a comma in a mount names two ids", req: Request{Mounts: []string{mr + "0,1"}}, want: []string{"0", "1"},
			sources: map[string][]string{"1": {"mount " + mr + "0,1"}}},
		resolveCase{name: "a comma in a mount, under ignore", policy: ignore, req: Request{Mounts: []string{mr + "0,1"}}, want: []string{"0", "1"}},
		resolveCase{name: "all after a comma", req: Request{Mounts: []string{mr + "0,all"}}, want: allGPUs, wantAll: true},
		resolveCase{name: "blanks around a mounted id", policy: ignore, req: Request{Mounts: []string{mr + " 3"}}, want: []string{"3"}},
		resolveCase{name: "empty ids in a mount", req: Request{Mounts: []string{mr + ",2,"}}, want: []string{"2"}},
		resolveCase{name: "unknown id after a comma", req: Request{Mounts: []string{mr + "0,9"}}, err: ErrUnknownDevice, errHas: []string{`"9"`, "mount " + mr + "0,9"}},
		resolveCase{name: "unknown id after a comma, ignored", policy: ignore, req: Request{Mounts: []string{mr + "0,9"}}, want: []string{"0"}, notes: []string{`"9"`}},
		resolveCase{name: "CDI form", req: Request{Mounts: []string{mr + "cdi/nvidia.com/gpu=0"}}, want: []string{"0"},
			sources: map[string][]string{"0": {"mount " + mr + "cdi/nvidia.com/gpu=0"}}},
		resolveCase{name: "CDI form, MIG", req: Request{Mounts: []string{mr + "cdi/nvidia.com/mig=mig1:1"}}, want: []string{"1:1"}},
		// NVIDIA's runtime injects whatever the spec of another vendor's
		// name holds, after the check: the guard cannot tell its GPUs.
		resolveCase{name: "CDI form, other vendor", policy: ignore, req: Request{Mounts: []string{mr + "cdi/example.com/nic=0"}}, err: ErrInvalidID,
			errHas: []string{`"example.com/nic=0"`, "after the guard's check"}},
		resolveCase{name: "unknown id", req: Request{Mounts: []string{mr + "9"}}, err: ErrUnknownDevice, errHas: []string{`"9"`, "mount " + mr + "9"}},
		resolveCase{name: "another root is no request", req: Request{Mounts: []string{"/run/nvidia-container-devices/0", "/var/run/nvidia-container-devicez"}}, want: nil},
		// NVIDIA's runtime's own forms: cdi/<vendor>/<class>/<device>, and
		// ids with slashes (the legacy MIG-GPU-<uuid>/<gi>/<ci>).
		resolveCase{name: "CDI form of the runtime", req: Request{Mounts: []string{mr + "cdi/nvidia.com/gpu/2"}}, want: []string{"2"},
			sources: map[string][]string{"2": {"mount " + mr + "cdi/nvidia.com/gpu/2"}}},
		resolveCase{name: "legacy MIG with slashes", req: Request{Mounts: []string{mr + "MIG-" + gpuUUID(1) + "/1/0"}}, want: []string{"1:0"}},
		resolveCase{name: "an id with a slash that names nothing", req: Request{Mounts: []string{mr + "0/1"}}, err: ErrInvalidID},
		resolveCase{name: "IMEX channels are no GPU request", req: Request{Mounts: []string{mr + "imex/0"}}, want: nil},
	)
	for _, trick := range []string{
		mr + "../0",
		mr + "..",
		mr + "/0",
		mr + "0/",
		mr + "./0",
		mr + ".",
		MountRoot,
		MountRoot + "/",
		mr + "cdi/nvidia.com/gpu=0/x",
		mr + "cdi/nvidia.com/gpu",
		// The runtime reads what follows MountRoot even without a "/":
		// a neighbour of the root is refused, not overlooked.
		MountRoot + "0",
		MountRoot + "1,2",
		"/var/run/nvidia-container-devices-x/0",
		mr + "cdi/nvidia.com//gpu=0",
		"/var/./run/nvidia-container-devices/0",
		"/var/run//nvidia-container-devices/0",
		"/var/run/../run/nvidia-container-devices/0",
	} {
		cases = append(cases, resolveCase{name: "path trick " + trick, policy: ignore, req: Request{Mounts: []string{trick}},
			err: ErrInvalidID, errHas: []string{"mount ", quoteToken(trick)}})
	}
	runResolveCases(t, cases)
}

// NVIDIA's runtime in CDI mode takes qualified names from
// NVIDIA_VISIBLE_DEVICES too, and generates runtime.nvidia.com/gpu=<id|all>
// on the fly: both are requests for those GPUs.
func TestResolveQualifiedNamesInEnvAndRuntimeVendor(t *testing.T) {
	const nvd = "NVIDIA_VISIBLE_DEVICES="
	ignore := func(p *config.PolicyConfig) { p.UnknownDevice = config.UnknownIgnore }
	runResolveCases(t, []resolveCase{
		{name: "qualified name in env", req: Request{Env: env(nvd + "nvidia.com/gpu=1")}, want: []string{"1"},
			sources: map[string][]string{"1": {`env NVIDIA_VISIBLE_DEVICES="nvidia.com/gpu=1"`}}},
		{name: "qualified and plain in env", req: Request{Env: env(nvd + "0,nvidia.com/gpu=2")}, want: []string{"0", "2"}},
		{name: "qualified all in env", req: Request{Env: env(nvd + "nvidia.com/gpu=all")}, want: allGPUs, wantAll: true},
		{name: "runtime vendor in env", req: Request{Env: env(nvd + "runtime.nvidia.com/gpu=2")}, want: []string{"2"}},
		{name: "runtime vendor all in an annotation", req: Request{Annotations: map[string]string{"cdi.k8s.io/x": "runtime.nvidia.com/gpu=all"}},
			want: allGPUs, wantAll: true},
		// In NVIDIA_VISIBLE_DEVICES another vendor's or class's name is
		// injected by NVIDIA's runtime after the check, from whatever spec
		// defines it: the DRA driver's k8s.gpu.nvidia.com/device=gpu-0 is
		// GPU 0. Refused under every policy (it was ignored: a GPU with no
		// claim).
		{name: "other vendor in env", policy: ignore, req: Request{Env: env(nvd + "example.com/nic=0")}, err: ErrInvalidID,
			errHas: []string{`"example.com/nic=0"`, `env NVIDIA_VISIBLE_DEVICES`, "nvidia.com/gpu=<index|UUID|all>"}},
		{name: "DRA driver's name in env", req: Request{Env: env(nvd + "k8s.gpu.nvidia.com/device=gpu-0")}, err: ErrInvalidID,
			errHas: []string{`"k8s.gpu.nvidia.com/device=gpu-0"`}},
		{name: "another class of NVIDIA's vendor in env", req: Request{Env: env(nvd + "0,nvidia.com/imex-channel=0")}, err: ErrInvalidID},
		// In auto mode NVIDIA's runtime switches to CDI mode when every id
		// is a qualified name.
		{name: "management device in env", req: Request{Env: env(nvd + "management.nvidia.com/gpu=all")}, want: allGPUs, wantAll: true},
		{name: "management device in a mount", req: Request{Mounts: []string{mr + "cdi/management.nvidia.com/gpu/all"}}, want: allGPUs, wantAll: true},
		{name: "unknown qualified name in env", req: Request{Env: env(nvd + "nvidia.com/gpu=9")}, err: ErrUnknownDevice},
	})
}

func TestResolveCDI(t *testing.T) {
	ann := func(kv ...string) map[string]string {
		m := map[string]string{}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	runResolveCases(t, []resolveCase{
		{name: "by index", req: Request{Annotations: ann("cdi.k8s.io/gpu", "nvidia.com/gpu=1")}, want: []string{"1"},
			sources: map[string][]string{"1": {`annotation cdi.k8s.io/gpu="nvidia.com/gpu=1"`}}},
		{name: "gpu<N> and mig<g>:<m>", req: Request{Annotations: ann("cdi.k8s.io/gpu", "nvidia.com/gpu=gpu3, nvidia.com/mig=mig1:0")}, want: []string{"3", "1:0"}},
		{name: "MIG by index in class gpu", req: Request{Annotations: ann("cdi.k8s.io/gpu", "nvidia.com/gpu=1:2")}, want: []string{"1:2"}},
		{name: "UUIDs", req: Request{Annotations: ann("cdi.k8s.io/a", "nvidia.com/gpu="+gpuUUID(0), "cdi.k8s.io/b", "nvidia.com/gpu="+migUUID(1, 1))}, want: []string{"0", "1:1"}},
		{name: "other vendors and classes are ignored", req: Request{Annotations: ann(
			"cdi.k8s.io/nic", "example.com/nic=0", "cdi.k8s.io/imex", "nvidia.com/imex-channel=0",
			"cdi.k8s.io/gdr", "k8s.device-plugin.nvidia.com/gdrcopy=all", "cdi.k8s.io/other", "management.example.com/gpu=all")}, want: nil},
		// The device plugin's cdi-annotations strategy writes
		// cdi.k8s.io/nvidia-device-plugin_<id> = k8s.device-plugin.nvidia.com/gpu=<uuid>.
		{name: "device plugin vendor, by UUID", req: Request{Annotations: ann(
			"cdi.k8s.io/nvidia-device-plugin_x", "k8s.device-plugin.nvidia.com/gpu="+gpuUUID(2))}, want: []string{"2"},
			sources: map[string][]string{"2": {`annotation cdi.k8s.io/nvidia-device-plugin_x="k8s.device-plugin.nvidia.com/gpu=` + gpuUUID(2) + `"`}}},
		{name: "device plugin vendor, by index, CDI list", req: Request{CDIDevices: []string{"k8s.device-plugin.nvidia.com/gpu=3"}}, want: []string{"3"}},
		{name: "device plugin vendor, unknown UUID", req: Request{CDIDevices: []string{"k8s.device-plugin.nvidia.com/gpu=" + gpuUUID(9)}},
			err: ErrUnknownDevice, errHas: []string{`"k8s.device-plugin.nvidia.com/gpu=` + gpuUUID(9) + `"`}},
		// NVIDIA's NRI plugin and CDI-mode runtime read nvidia.cdi.k8s.io/*.
		{name: "nvidia.cdi.k8s.io annotation", req: Request{Annotations: ann(
			"nvidia.cdi.k8s.io/container.main", "nvidia.com/gpu=2")}, want: []string{"2"},
			sources: map[string][]string{"2": {`annotation nvidia.cdi.k8s.io/container.main="nvidia.com/gpu=2"`}}},
		// NVIDIA's NRI plugin injects every name of nvidia.cdi.k8s.io/*,
		// after the check: NVIDIA's names it cannot tell the GPUs of (the
		// DRA driver's gpu-0 is GPU 0) are refused, under every policy,
		// as when another plugin adds them; other vendors' are no GPU.
		{name: "nvidia.cdi.k8s.io annotation: NVIDIA's DRA name", req: Request{Annotations: ann(
			"nvidia.cdi.k8s.io/container.main", "k8s.gpu.nvidia.com/device=gpu-0")}, err: ErrInvalidID,
			errHas: []string{`annotation nvidia.cdi.k8s.io/container.main: invalid device id "k8s.gpu.nvidia.com/device=gpu-0"`, "NVIDIA's NRI plugin"}},
		{name: "nvidia.cdi.k8s.io annotation: NVIDIA's DRA name under ignore", policy: func(p *config.PolicyConfig) { p.UnknownDevice = config.UnknownIgnore },
			req: Request{Annotations: ann("nvidia.cdi.k8s.io/container.*", "nvidia.com/gpu=2, k8s.gpu.nvidia.com/device=gpu-0")}, err: ErrInvalidID},
		{name: "nvidia.cdi.k8s.io annotation: NVIDIA's other class", req: Request{Annotations: ann(
			"nvidia.cdi.k8s.io/", "nvidia.com/imex-channel=0")}, err: ErrInvalidID},
		{name: "nvidia.cdi.k8s.io annotation: another vendor's device", req: Request{Annotations: ann(
			"nvidia.cdi.k8s.io/container.main", "vendor.com/foo=bar, nvidia.com/gpu=1")}, want: []string{"1"}},
		// A cdi.k8s.io annotation is injected by the engine (CDI enabled)
		// before the check, or by NVIDIA's runtime in CDI mode after it:
		// an NVIDIA name the guard cannot resolve is refused when no GPU
		// node shows an engine injected it, under every policy; with the
		// nodes there, they are claimed.
		{name: "cdi.k8s.io annotation: NVIDIA's DRA name, no GPU node", req: Request{Annotations: ann(
			"cdi.k8s.io/dra", "k8s.gpu.nvidia.com/device=gpu-0")}, err: ErrInvalidID,
			errHas: []string{`annotation cdi.k8s.io/dra: invalid device id "k8s.gpu.nvidia.com/device=gpu-0"`, "after the guard's check", "enable_cdi = true", "nvidia.com/gpu=<index|UUID|all>"}},
		{name: "cdi.k8s.io annotation: NVIDIA's DRA name under ignore", policy: func(p *config.PolicyConfig) { p.UnknownDevice = config.UnknownIgnore },
			req: Request{Annotations: ann("cdi.k8s.io/dra", "k8s.gpu.nvidia.com/device=gpu-0")}, err: ErrInvalidID},
		{name: "cdi.k8s.io annotation: another GPU class of nvidia.com, no GPU node", req: Request{Annotations: ann(
			"cdi.k8s.io/x", "nvidia.com/vgpu=0")}, err: ErrInvalidID},
		// NVIDIA's names for devices that are no GPU are the engine's (or
		// name no GPU if NVIDIA's runtime injects them): the Network
		// Operator's SR-IOV device plugin names a NIC's VF nvidia.com/net-pci
		// (its resource prefix); its pod lists the VF's nodes, no GPU node.
		{name: "cdi.k8s.io annotation: NVIDIA NIC (SR-IOV net-pci)", req: Request{
			Annotations: ann("cdi.k8s.io/nvidia.com_net-pci", "nvidia.com/net-pci=0000:3b:00.2"),
			Devices:     []LinuxDevice{dev("/dev/vfio/vfio", 10, 196), dev("/dev/vfio/12", 243, 12)}}, want: nil},
		{name: "cdi.k8s.io annotation: NVSwitch, compute domain", req: Request{Annotations: ann(
			"cdi.k8s.io/x", "nvidia.com/nvswitch=0", "cdi.k8s.io/cd", "k8s.compute-domain.nvidia.com/channel=0")}, want: nil},
		// With a GPU node in the spec, an engine may have injected the
		// name's GPUs, or the node came from elsewhere (a device plugin)
		// and NVIDIA's runtime injects the name's later: it cannot be told
		// which GPUs it adds, so it reaches every GPU (policy.all_devices).
		{name: "cdi.k8s.io annotation: NVIDIA's DRA name beside a GPU node", req: Request{
			Annotations: ann("cdi.k8s.io/dra", "k8s.gpu.nvidia.com/device=gpu-1"),
			Devices:     []LinuxDevice{dev("/dev/nvidia0", 195, 0), dev("/dev/nvidiactl", 195, 255)}}, want: allGPUs, wantAll: true},
		{name: "cdi.k8s.io annotation: NVIDIA's DRA name beside a GPU node, all_devices = reject",
			policy: func(p *config.PolicyConfig) { p.AllDevices = config.AllReject }, req: Request{
				Annotations: ann("cdi.k8s.io/dra", "k8s.gpu.nvidia.com/device=gpu-1"),
				Devices:     []LinuxDevice{dev("/dev/nvidia0", 195, 0)}}, err: ErrAllRejected},
		{name: "cdi.k8s.io annotation: a node a device cgroup rule opens shows no injection", req: func() Request {
			req := Request{Annotations: ann("cdi.k8s.io/dra", "k8s.gpu.nvidia.com/device=gpu-0")}
			req.ApplyDeviceRules([]DeviceRule{rule(false, "a", -1, -1, "rwm"), rule(true, "c", 195, 0, "rw")})
			return req
		}(), err: ErrInvalidID},
		{name: "cdi.k8s.io annotation: a bound host node shows no injection", req: Request{
			Annotations: ann("cdi.k8s.io/dra", "k8s.gpu.nvidia.com/device=gpu-0"),
			Devices:     []LinuxDevice{{Path: "/dev/nvidia0", BoundAt: "/dev/nvidia0"}}}, err: ErrInvalidID},
		{name: "cdi.k8s.io annotation: NVIDIA's devices that are no GPU, no GPU node", req: Request{Annotations: ann(
			"cdi.k8s.io/nvidia-device-plugin_x", "k8s.device-plugin.nvidia.com/gpu="+gpuUUID(2)+", k8s.device-plugin.nvidia.com/imex-channel=0, "+
				"k8s.device-plugin.nvidia.com/gds=all, k8s.device-plugin.nvidia.com/mofed=all, k8s.device-plugin.nvidia.com/gdrcopy=all",
			"cdi.k8s.io/imex", "nvidia.com/imex-channel=1")}, want: []string{"2"}},
		// The CRI's CDI devices are the engine's alone.
		{name: "CDI list: NVIDIA's DRA name is the engine's", req: Request{CDIDevices: []string{"k8s.gpu.nvidia.com/claim=x-gpu-0"}}, want: nil},
		// The GPU Operator's management spec injects every /dev/nvidia*
		// node and every nvidia-caps node.
		{name: "management device is every GPU", req: Request{Annotations: ann(
			"nvidia.cdi.k8s.io/container.agent", "management.nvidia.com/gpu=all")}, want: allGPUs, wantAll: true,
			sources: map[string][]string{"3": {`annotation nvidia.cdi.k8s.io/container.agent="management.nvidia.com/gpu=all"`}},
			notes:   []string{"policy.exempt_namespaces"}},
		{name: "management device in cdi.k8s.io", req: Request{Annotations: ann("cdi.k8s.io/mgmt", "management.nvidia.com/gpu=all")}, want: allGPUs, wantAll: true},
		{name: "any management device name", req: Request{CDIDevices: []string{"management.nvidia.com/other=x"}}, want: allGPUs, wantAll: true},
		{name: "management device under all_devices reject", policy: func(p *config.PolicyConfig) { p.AllDevices = config.AllReject },
			req: Request{CDIDevices: []string{"management.nvidia.com/gpu=all"}}, err: ErrAllRejected,
			errHas: []string{`cdi "management.nvidia.com/gpu=all"`, "policy.exempt_namespaces"}},
		{name: "management device under all_devices ignore", policy: func(p *config.PolicyConfig) { p.AllDevices = config.AllIgnore },
			req: Request{CDIDevices: []string{"management.nvidia.com/gpu=all"}}, want: nil, notes: []string{"ignored"}},
		{name: "other annotations are ignored", req: Request{Annotations: ann("example.com/cdi", "nvidia.com/gpu=0", "cdi.k8s.io", "nvidia.com/gpu=0")}, want: nil},
		{name: "unknown name", req: Request{Annotations: ann("cdi.k8s.io/gpu", "nvidia.com/gpu=9")}, err: ErrUnknownDevice,
			errHas: []string{`annotation cdi.k8s.io/gpu: unknown GPU "nvidia.com/gpu=9"`}},
		{name: "invalid name", req: Request{Annotations: ann("cdi.k8s.io/gpu", "nvidia.com/gpu=gpux")}, err: ErrInvalidID, errHas: []string{`"nvidia.com/gpu=gpux"`}},
		{name: "prefix is no CDI name", req: Request{Annotations: ann("cdi.k8s.io/gpu", "nvidia.com/gpu=GPU-c")}, err: ErrInvalidID},
		{name: "unqualified name", req: Request{Annotations: ann("cdi.k8s.io/gpu", "gpu0")}, err: ErrInvalidID, errHas: []string{`"gpu0"`, "qualified"}},
		{name: "unqualified name refused under ignore too", policy: func(p *config.PolicyConfig) { p.UnknownDevice = config.UnknownIgnore },
			req: Request{Annotations: ann("cdi.k8s.io/gpu", "gpu0, nvidia.com/gpu=2")}, err: ErrInvalidID, errHas: []string{`"gpu0"`, "does not apply"}},
		{name: "unknown name ignored by policy", policy: func(p *config.PolicyConfig) { p.UnknownDevice = config.UnknownIgnore },
			req: Request{Annotations: ann("cdi.k8s.io/gpu", "nvidia.com/gpu=gpu9, nvidia.com/gpu=2")}, want: []string{"2"}},
		{name: "CDI device list", req: Request{CDIDevices: []string{"nvidia.com/gpu=0", "example.com/x=y"}}, want: []string{"0"},
			sources: map[string][]string{"0": {`cdi "nvidia.com/gpu=0"`}}},
		// CDI devices another NRI plugin adds, injected after the check:
		// NVIDIA GPU names are read, NVIDIA's other names refused (their
		// GPUs cannot be told), other vendors' devices are no GPU.
		{name: "late CDI: a GPU name", req: Request{LateCDIDevices: []string{"nvidia.com/gpu=2"}}, want: []string{"2"}},
		{name: "late CDI: another vendor's device", req: Request{LateCDIDevices: []string{"intel.com/sriov=vf0"}}, want: nil},
		{name: "late CDI: NVIDIA's DRA name", req: Request{LateCDIDevices: []string{"k8s.gpu.nvidia.com/device=gpu-0"}}, err: ErrInvalidID,
			errHas: []string{"an NRI plugin added this NVIDIA CDI device"}},
		{name: "late CDI: NVIDIA's other class", req: Request{LateCDIDevices: []string{"nvidia.com/imex-channel=0"}}, err: ErrInvalidID},
		{name: "CDI device list, unknown", req: Request{CDIDevices: []string{"nvidia.com/gpu=gpu7"}}, err: ErrUnknownDevice,
			errHas: []string{`CDI device: unknown GPU "nvidia.com/gpu=gpu7"`}},
		{name: "annotation keys are rendered safely", req: Request{Annotations: ann("cdi.k8s.io/a b\n", "nvidia.com/gpu=9")}, err: ErrUnknownDevice,
			errHas: []string{`annotation "cdi.k8s.io/a b\n"`}},
	})
}

func TestResolveLinuxDevices(t *testing.T) {
	ignore := func(p *config.PolicyConfig) { p.UnknownDevice = config.UnknownIgnore }
	runResolveCases(t, []resolveCase{
		{name: "minor, not index: /dev/nvidia3 is GPU 1", req: Request{Devices: []LinuxDevice{dev("/dev/nvidia3", 195, 3)}}, want: []string{"1"},
			sources: map[string][]string{"1": {"device /dev/nvidia3 (195:3)"}}},
		{name: "/dev/nvidia1 is GPU 3", req: Request{Devices: []LinuxDevice{dev("/dev/nvidia1", 195, 1)}}, want: []string{"3"}},
		{name: "control nodes are no GPU", req: Request{Devices: []LinuxDevice{
			dev("/dev/nvidiactl", 195, 255), dev("/dev/nvidia-modeset", 195, 254), dev("/dev/nvidia255", 195, 255),
			dev("/dev/nvidia-uvm", 511, 0), dev("/dev/nvidia-uvm-tools", 511, 1)}}, want: nil},
		{name: "renamed node counts by its numbers", req: Request{Devices: []LinuxDevice{dev("/dev/foo", 195, 2)}}, want: []string{"2"},
			sources: map[string][]string{"2": {"device /dev/foo (195:2)"}}},
		{name: "numbers beat the path", req: Request{Devices: []LinuxDevice{dev("/dev/nvidia0", 195, 2)}}, want: []string{"2"}},
		{name: "path only (ctl explain --device)", req: Request{Devices: []LinuxDevice{{Path: "/dev/nvidia3"}}}, want: []string{"1"},
			sources: map[string][]string{"1": {"device /dev/nvidia3 (195:3)"}}},
		{name: "path only /dev/nvidia255", req: Request{Devices: []LinuxDevice{{Path: "/dev/nvidia255"}}}, want: nil},
		{name: "block device 195:0 is no GPU", req: Request{Devices: []LinuxDevice{{Path: "/dev/sdx", Type: "b", Major: 195, Minor: 0}}}, want: nil},
		{name: "unknown minor rejected", req: Request{Devices: []LinuxDevice{dev("/dev/nvidia7", 195, 7)}}, err: ErrUnknownDevice,
			errHas: []string{`device /dev/nvidia7 (195:7): unknown GPU "195:7"`, "no GPU has minor number 7", "known minors: 0-3"}},
		{name: "unknown minor ignored", policy: ignore, req: Request{Devices: []LinuxDevice{dev("/dev/nvidia7", 195, 7)}}, want: nil},
		{name: "whole-GPU node of a MIG GPU, nothing else named: whole GPU", req: Request{Devices: []LinuxDevice{dev("/dev/nvidia3", 195, 3)}}, want: []string{"1"}},
		{name: "MIG container: parent node + caps = that MIG only", req: Request{Devices: []LinuxDevice{
			dev("/dev/nvidia3", 195, 3), dev("/dev/nvidiactl", 195, 255),
			dev("/dev/nvidia-caps/nvidia-cap30", testCapsMajor, 30), dev("/dev/nvidia-caps/nvidia-cap31", testCapsMajor, 31)}},
			want: []string{"1:0"},
			sources: map[string][]string{"1:0": {
				"device /dev/nvidia-caps/nvidia-cap31 (508:31)", "device /dev/nvidia-caps/nvidia-cap30 (508:30)", "device /dev/nvidia3 (195:3)"}}},
		{name: "GI cap with one of its CIs named: only that CI", req: Request{Devices: []LinuxDevice{
			dev("/dev/nvidia-caps/nvidia-cap39", testCapsMajor, 39), dev("/dev/nvidia-caps/nvidia-cap41", testCapsMajor, 41)}},
			want: []string{"1:2"}},
		{name: "GI cap alone: every CI of that GI", req: Request{Devices: []LinuxDevice{dev("/dev/nvidia-caps/nvidia-cap39", testCapsMajor, 39)}},
			want: []string{"1:1", "1:2"}},
		{name: "parent node + MIG named by env: that MIG only", req: Request{
			Env: env("NVIDIA_VISIBLE_DEVICES=" + migUUID(1, 1)), Devices: []LinuxDevice{dev("/dev/nvidia3", 195, 3)}},
			want: []string{"1:1"}, sources: map[string][]string{"1:1": {`env NVIDIA_VISIBLE_DEVICES="` + migUUID(1, 1) + `"`, "device /dev/nvidia3 (195:3)"}}},
		{name: "parent node + whole GPU named: whole GPU", req: Request{
			Env: env("NVIDIA_VISIBLE_DEVICES=1,1:1"), Devices: []LinuxDevice{dev("/dev/nvidia3", 195, 3)}},
			want: []string{"1", "1:1"}, sources: map[string][]string{"1": {`env NVIDIA_VISIBLE_DEVICES="1"`, "device /dev/nvidia3 (195:3)"}}},
		{name: "renamed cap node found by the caps major", req: Request{Devices: []LinuxDevice{
			dev("/dev/nvidia3", 195, 3), dev("/dev/x", testCapsMajor, 40)}}, want: []string{"1:1"}},
		{name: "path-only cap node", req: Request{Devices: []LinuxDevice{{Path: "/dev/nvidia-caps/nvidia-cap31"}}}, want: []string{"1:0"},
			sources: map[string][]string{"1:0": {"device /dev/nvidia-caps/nvidia-cap31 (508:31)"}}},
		// docker run --device /dev/nvidia0:/dev/nvidia-caps/nvidia-cap1: the
		// node opens GPU 0 whatever it is called inside the container.
		{name: "GPU node renamed to a cap path is the GPU", req: Request{Devices: []LinuxDevice{dev("/dev/nvidia-caps/nvidia-cap1", 195, 0)}},
			want: []string{"0"}, sources: map[string][]string{"0": {"device /dev/nvidia-caps/nvidia-cap1 (195:0)"}}},
		{name: "GPU node renamed to a mapped cap path is the GPU", req: Request{Devices: []LinuxDevice{dev("/dev/nvidia-caps/nvidia-cap31", 195, 2)}},
			want: []string{"2"}},
		{name: "cap path with a foreign major opens no MIG", req: Request{Devices: []LinuxDevice{dev("/dev/nvidia-caps/nvidia-cap31", 10, 31)}},
			want: nil},
		{name: "config and monitor caps claim nothing", req: Request{Devices: []LinuxDevice{
			dev("/dev/nvidia-caps/nvidia-cap1", testCapsMajor, 1), dev("/dev/nvidia-caps/nvidia-cap2", testCapsMajor, 2)}}, want: nil},
		{name: "unmapped cap: the parent GPU is claimed whole", req: Request{Devices: []LinuxDevice{
			dev("/dev/nvidia3", 195, 3), dev("/dev/nvidia-caps/nvidia-cap31", testCapsMajor, 31), dev("/dev/nvidia-caps/nvidia-cap99", testCapsMajor, 99)}},
			want: []string{"1", "1:0"}, notes: []string{"no known mapping"}},
	})
}

// An inventory that lists MIG instances but not the nvidia-caps major (nor
// the mapping) cannot tell a capability node by its numbers: any node of a
// dynamic major may be one under another name, and any rule that opens such
// a node may open one. Each claims whole the GPUs whose nodes the container
// has; a MIG container's nvidia-uvm node does so too.
func TestResolveCapsMajorUnknown(t *testing.T) {
	inv, err := NewInventory("nvml", testGPUs()) // MIG instances, no caps major, no mapping
	require.NoError(t, err)
	withRules := func(req Request, rules ...DeviceRule) Request {
		req.ApplyDeviceRules(append([]DeviceRule{rule(false, "a", -1, -1, "rwm"), rule(true, "c", 195, 3, "rw")}, rules...))
		return req
	}
	mig := Request{Env: env("NVIDIA_VISIBLE_DEVICES=1:0"), Devices: []LinuxDevice{dev("/dev/nvidia3", 195, 3)}}
	runResolveCasesOn(t, inv, []resolveCase{
		{name: "parent node and the MIG instance named: that instance", req: mig, want: []string{"1:0"}},
		{name: "renamed capability node", req: Request{Env: mig.Env, Devices: []LinuxDevice{dev("/dev/nvidia3", 195, 3), dev("/dev/x", 508, 40)}},
			want: []string{"1", "1:0"}, notes: []string{"device /dev/x (508:40): may be a MIG capability node", "nvidia-caps major"}},
		{name: "capability path, numbers given", req: Request{Env: mig.Env, Devices: []LinuxDevice{
			dev("/dev/nvidia3", 195, 3), dev("/dev/nvidia-caps/nvidia-cap30", 508, 30), dev("/dev/nvidia-caps/nvidia-cap31", 508, 31)}},
			want: []string{"1", "1:0"}, notes: []string{"no known mapping"}},
		{name: "nvidia-uvm may be a capability too", req: Request{Env: mig.Env, Devices: []LinuxDevice{dev("/dev/nvidia3", 195, 3), dev("/dev/nvidia-uvm", 510, 0)}},
			want: []string{"1", "1:0"}},
		{name: "a node below the dynamic majors is none", req: Request{Env: mig.Env, Devices: []LinuxDevice{dev("/dev/nvidia3", 195, 3), dev("/dev/null", 1, 3)}},
			want: []string{"1:0"}},
		{name: "rule for every node of a dynamic major", req: withRules(mig, rule(true, "c", 508, -1, "rwm")), want: []string{"1", "1:0"},
			notes: []string{"device cgroup rules open nodes of a dynamic major"}},
		{name: "rule for one node of a dynamic major", req: withRules(mig, rule(true, "c", 508, 40, "r")), want: []string{"1", "1:0"}},
		{name: "rule for a minor of every major", req: withRules(mig, rule(true, "c", -1, 300, "rw")), want: []string{"1", "1:0"}},
		{name: "rule for a truncated dynamic major (crun: c 508:*)", req: withRules(mig, rule(true, "c", 1<<32+508, -1, "rw")), want: []string{"1", "1:0"}},
		{name: "mknod only opens nothing", req: withRules(mig, rule(true, "c", -1, -1, "m")), want: []string{"1:0"}},
		{name: "rule taken back", req: withRules(mig, rule(true, "c", 508, -1, "rw"), rule(false, "c", 508, -1, "rw")), want: []string{"1:0"}},
		{name: "rules for majors below the dynamic range", req: withRules(mig, rule(true, "c", 10, 200, "rw")), want: []string{"1:0"}},
	})

	// Without MIG instances there is no capability to reach.
	plain, err := NewInventory("nvml", []GPU{{Index: 0, UUID: gpuUUID(0), Minor: 0}})
	require.NoError(t, err)
	runResolveCasesOn(t, plain, []resolveCase{
		{name: "no MIG: a dynamic major's node is nothing", req: Request{Devices: []LinuxDevice{dev("/dev/x", 508, 40)}}, want: nil},
		{name: "no MIG: a dynamic major's rule is nothing", req: func() Request {
			var req Request
			req.ApplyDeviceRules([]DeviceRule{rule(false, "a", -1, -1, "rwm"), rule(true, "c", 508, -1, "rw")})
			return req
		}(), want: nil},
	})
}

func sorted(s ...string) []string {
	sort.Strings(s)
	return s
}

func TestResolveUnionOfSources(t *testing.T) {
	inv := testInventory(t)
	req := Request{
		Env:         env("NVIDIA_VISIBLE_DEVICES=0", "DOCKER_RESOURCE_GPU=2"),
		Mounts:      []string{mr + "0"},
		Annotations: map[string]string{"cdi.k8s.io/gpu": "nvidia.com/gpu=gpu0", "cdi.k8s.io/mig": "nvidia.com/mig=mig1:1"},
		CDIDevices:  []string{"nvidia.com/gpu=" + gpuUUID(3)},
		Devices:     []LinuxDevice{dev("/dev/nvidia0", 195, 0), dev("/dev/nvidiactl", 195, 255)},
	}
	res, err := NewResolver(inv, defaultPolicy()).Resolve(req)
	require.NoError(t, err)
	assert.Equal(t, sorted(gpuUUID(0), gpuUUID(2), gpuUUID(3), migUUID(1, 1)), res.UUIDs())
	for i := 1; i < len(res.Devices); i++ {
		assert.Less(t, res.Devices[i-1].UUID, res.Devices[i].UUID, "sorted by UUID")
	}
	d0 := res.Devices[indexOf(res, gpuUUID(0))]
	assert.Equal(t, []string{
		`env NVIDIA_VISIBLE_DEVICES="0"`,
		"mount " + mr + "0",
		`annotation cdi.k8s.io/gpu="nvidia.com/gpu=gpu0"`,
		"device /dev/nvidia0 (195:0)",
	}, d0.Sources, "every source, in reading order")
	assert.Equal(t, Device{UUID: gpuUUID(0), Index: "0", Kind: KindGPU}, d0.Device)
	m := res.Devices[indexOf(res, migUUID(1, 1))]
	assert.Equal(t, Device{UUID: migUUID(1, 1), Index: "1:1", Kind: KindMIG, Parent: gpuUUID(1)}, m.Device)
	assert.False(t, res.All)
}

func indexOf(res Resolution, uuid string) int {
	for i, d := range res.Devices {
		if d.UUID == uuid {
			return i
		}
	}
	return -1
}

func TestResolveBounds(t *testing.T) {
	many := func(n int) string { return strings.TrimSuffix(strings.Repeat("0,", n), ",") }
	manyAnn := map[string]string{}
	for i := 0; i < 5; i++ {
		manyAnn[fmt.Sprintf("cdi.k8s.io/a%d", i)] = strings.TrimSuffix(strings.Repeat("x.io/y=0,", 250), ",")
	}
	runResolveCases(t, []resolveCase{
		{name: "env value at the limit", req: Request{Env: env("NVIDIA_VISIBLE_DEVICES=" + many(256))}, want: []string{"0"}},
		{name: "env value too long", req: Request{Env: env("NVIDIA_VISIBLE_DEVICES=0" + strings.Repeat(" ", MaxValueBytes))}, err: ErrTooLarge,
			errHas: []string{"env NVIDIA_VISIBLE_DEVICES", "4097 bytes"}},
		{name: "too many tokens", req: Request{Env: env("DOCKER_RESOURCE_GPU=" + many(257))}, err: ErrTooLarge,
			errHas: []string{"env DOCKER_RESOURCE_GPU", "more than 256 ids"}},
		{name: "annotation too long", req: Request{Annotations: map[string]string{"cdi.k8s.io/x": strings.Repeat("a", MaxValueBytes+1)}}, err: ErrTooLarge,
			errHas: []string{"annotation cdi.k8s.io/x"}},
		{name: "too many in all", req: Request{Annotations: manyAnn}, err: ErrTooLarge, errHas: []string{"more than 1024"}},
		{name: "mount too long", req: Request{Mounts: []string{mr + strings.Repeat("a", MaxValueBytes)}}, err: ErrTooLarge, errHas: []string{"mount"}},
		{name: "CDI name too long", req: Request{CDIDevices: []string{"nvidia.com/gpu=" + strings.Repeat("a", MaxValueBytes)}}, err: ErrTooLarge, errHas: []string{"CDI device"}},
	})
}

func TestResolveErrorsAreBounded(t *testing.T) {
	inv := testInventory(t)
	var ids []string
	for i := 10; i < 60; i++ {
		ids = append(ids, fmt.Sprint(i))
	}
	_, err := NewResolver(inv, defaultPolicy()).Resolve(Request{Env: env("NVIDIA_VISIBLE_DEVICES=" + strings.Join(ids, ","))})
	require.ErrorIs(t, err, ErrUnknownDevice)
	var joined interface{ Unwrap() []error }
	require.True(t, errors.As(err, &joined))
	assert.Len(t, joined.Unwrap(), maxReported+1)
	assert.Contains(t, err.Error(), "and 34 more problems")
	assert.NotContains(t, err.Error(), `"59"`)

	p := defaultPolicy()
	p.UnknownDevice = config.UnknownIgnore
	res, err := NewResolver(inv, p).Resolve(Request{Env: env("NVIDIA_VISIBLE_DEVICES=" + strings.Join(ids, ","))})
	require.NoError(t, err)
	assert.Len(t, res.Notes, maxReported+1)
}

func TestResolveOverEmptyInventory(t *testing.T) {
	for _, inv := range []*Inventory{nil, {}, mustInventory(t, "nvml", nil)} {
		r := NewResolver(inv, defaultPolicy())
		res, err := r.Resolve(Request{Env: env("NVIDIA_VISIBLE_DEVICES=all")})
		require.NoError(t, err)
		assert.Empty(t, res.Devices)
		assert.True(t, res.All)
		_, err = r.Resolve(Request{Env: env("NVIDIA_VISIBLE_DEVICES=0")})
		require.ErrorIs(t, err, ErrUnknownDevice)
		assert.Contains(t, err.Error(), "inventory is empty")
	}
}

func mustInventory(t testing.TB, source string, gpus []GPU) *Inventory {
	t.Helper()
	inv, err := NewInventory(source, gpus)
	require.NoError(t, err)
	return inv
}

func TestRequestFromSpec(t *testing.T) {
	spec := &specs.Spec{
		Process: &specs.Process{
			Env:          []string{"NVIDIA_VISIBLE_DEVICES=1"},
			Capabilities: &specs.LinuxCapabilities{Bounding: []string{"CAP_CHOWN", "CAP_SYS_ADMIN"}},
		},
		Mounts:      []specs.Mount{{Destination: "/proc"}, {Destination: mr + "2", Source: "/dev/null"}},
		Annotations: map[string]string{"cdi.k8s.io/x": "nvidia.com/gpu=3"},
		Linux: &specs.Linux{Devices: []specs.LinuxDevice{
			{Path: "/dev/nvidia3", Type: "c", Major: 195, Minor: 3},
		}},
	}
	req := RequestFromSpec(spec)
	assert.Equal(t, Request{
		Env:         []string{"NVIDIA_VISIBLE_DEVICES=1"},
		Mounts:      []string{"/proc", mr + "2"},
		Annotations: map[string]string{"cdi.k8s.io/x": "nvidia.com/gpu=3"},
		Devices:     []LinuxDevice{{Path: "/dev/nvidia3", Type: "c", Major: 195, Minor: 3}},
		Privileged:  true,
	}, req)

	// CAP_SYS_ADMIN only in the effective set is not privileged: the
	// bounding set is what the NVIDIA runtime checks.
	spec.Process.Capabilities = &specs.LinuxCapabilities{Effective: []string{"CAP_SYS_ADMIN"}}
	assert.False(t, RequestFromSpec(spec).Privileged)
	assert.Equal(t, Request{}, RequestFromSpec(nil))
	// No process, so no capabilities object: it may hold CAP_SYS_ADMIN.
	assert.Equal(t, Request{SysAdmin: true}, RequestFromSpec(&specs.Spec{}))

	inv := testInventory(t)
	spec.Process.Capabilities.Bounding = []string{"CAP_SYS_ADMIN"}
	p := defaultPolicy()
	p.Privileged = config.PrivilegedReject
	_, err := NewResolver(inv, p).Resolve(RequestFromSpec(spec))
	require.ErrorIs(t, err, ErrPrivilegedRejected)
	res, err := NewResolver(inv, defaultPolicy()).Resolve(RequestFromSpec(spec))
	require.NoError(t, err)
	assert.Equal(t, sorted(gpuUUID(1), gpuUUID(2), gpuUUID(3)), res.UUIDs())

	// CAP_SYS_ADMIN with a device cgroup that allows only /dev/nvidia3 (e.g.
	// podman --cap-add SYS_ADMIN --device /dev/nvidia3): the node is a
	// request under "declared"; only an engine's allow-all cgroup makes the
	// nodes its own addition.
	spec.Process.Env = nil
	spec.Annotations = nil
	spec.Mounts = nil
	major, minor := int64(195), int64(3)
	spec.Linux.Resources = &specs.LinuxResources{Devices: []specs.LinuxDeviceCgroup{
		{Allow: false, Access: "rwm"},
		{Allow: true, Type: "c", Major: &major, Minor: &minor, Access: "rw"},
	}}
	req = RequestFromSpec(spec)
	assert.True(t, req.Privileged)
	assert.False(t, req.AllDevicesAllowed)
	res, err = NewResolver(inv, defaultPolicy()).Resolve(req)
	require.NoError(t, err)
	plain, err := NewResolver(inv, defaultPolicy()).Resolve(Request{Devices: req.Devices})
	require.NoError(t, err)
	require.Len(t, plain.UUIDs(), 1)
	assert.Equal(t, plain.UUIDs(), res.UUIDs(), "the node it may open is claimed as for an unprivileged container")

	spec.Linux.Resources.Devices = []specs.LinuxDeviceCgroup{{Allow: true, Access: "rwm"}}
	req = RequestFromSpec(spec)
	assert.True(t, req.AllDevicesAllowed)
	res, err = NewResolver(inv, defaultPolicy()).Resolve(req)
	require.NoError(t, err)
	assert.Empty(t, res.UUIDs(), "a privileged engine container's nodes are not a request")
}

func TestConflicts(t *testing.T) {
	g0 := Device{UUID: gpuUUID(0), Index: "0", Kind: KindGPU}
	g1 := Device{UUID: gpuUUID(1), Index: "1", Kind: KindGPU}
	m10 := Device{UUID: migUUID(1, 0), Index: "1:0", Kind: KindMIG, Parent: g1.UUID}
	m11 := Device{UUID: migUUID(1, 1), Index: "1:1", Kind: KindMIG, Parent: g1.UUID}
	m20 := Device{UUID: migUUID(2, 0), Index: "2:0", Kind: KindMIG, Parent: gpuUUID(2)}
	for _, tc := range []struct {
		name string
		a, b Device
		want bool
	}{
		{"same GPU", g0, g0, true},
		{"different GPUs", g0, g1, false},
		{"GPU and its MIG", g1, m10, true},
		{"MIG and its GPU", m11, g1, true},
		{"same MIG", m10, m10, true},
		{"sibling MIGs", m10, m11, false},
		{"MIG of another GPU", g1, m20, false},
		{"MIGs of different GPUs", m10, m20, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, Conflicts(tc.a, tc.b))
			assert.Equal(t, tc.want, Conflicts(tc.b, tc.a), "symmetric")
		})
	}
}

func TestResolveLegacyMIGUUIDInventory(t *testing.T) {
	// Drivers before R470 report MIG-GPU-<uuid>/<gi>/<ci> as the MIG UUID.
	legacy := "MIG-" + gpuUUID(0) + "/1/0"
	inv := mustInventory(t, "nvml", []GPU{{Index: 0, UUID: gpuUUID(0), Minor: 0, MIG: []MIG{{Index: 0, UUID: legacy, GI: 1, CI: 0}}}})
	r := NewResolver(inv, defaultPolicy())
	for _, req := range []Request{
		{Env: env("NVIDIA_VISIBLE_DEVICES=" + legacy)},
		{Env: env("NVIDIA_VISIBLE_DEVICES=0:0")},
		{CDIDevices: []string{"nvidia.com/mig=mig0:0"}},
	} {
		res, err := r.Resolve(req)
		require.NoError(t, err)
		assert.Equal(t, []string{legacy}, res.UUIDs())
	}
}

func TestResolverIsSafeForConcurrentUse(t *testing.T) {
	r := NewResolver(testInventory(t), defaultPolicy())
	req := Request{
		Env:     env("NVIDIA_VISIBLE_DEVICES=0,1:1"),
		Devices: []LinuxDevice{dev("/dev/nvidia2", 195, 2)},
	}
	want, err := r.Resolve(req)
	require.NoError(t, err)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 200 {
				got, err := r.Resolve(req)
				if err != nil || !reflect.DeepEqual(got, want) {
					t.Errorf("concurrent resolution differs: %+v, %v", got, err)
					return
				}
			}
		})
	}
	wg.Wait()
}

func TestAllowsAllDevices(t *testing.T) {
	n := func(v int64) *int64 { return &v }
	for _, tc := range []struct {
		name  string
		rules []DeviceRule
		want  bool
	}{
		{name: "none", want: false},
		{name: "allow all rwm (privileged)", rules: []DeviceRule{{Allow: true, Access: "rwm"}}, want: true},
		{name: "allow all, empty access", rules: []DeviceRule{{Allow: true, Type: "a"}}, want: true},
		{name: "deny all then one GPU", rules: []DeviceRule{{Allow: false, Access: "rwm"}, {Allow: true, Type: "c", Major: n(195), Minor: n(0), Access: "rw"}}, want: false},
		// The kernel reads nothing but "a" of an "a" rule: "a *:* r" allows
		// every device, rwm.
		{name: "allow all read only", rules: []DeviceRule{{Allow: true, Access: "r"}}, want: true},
		{name: "type a with numbers", rules: []DeviceRule{{Allow: false, Access: "rwm"}, {Allow: true, Type: "a", Major: n(1), Minor: n(3), Access: "r"}}, want: true},
		{name: "allow all then deny all", rules: []DeviceRule{{Allow: true}, {Allow: false}}, want: false},
		{name: "negative numbers are wildcards", rules: []DeviceRule{{Allow: true, Major: n(-1), Minor: n(-1), Access: "rwm"}}, want: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := AllowsAllDevices(tc.rules); got != tc.want {
				t.Fatalf("AllowsAllDevices = %v, want %v", got, tc.want)
			}
		})
	}
}

// An inventory that lists none of the host's GPUs (the driver was not up
// when it was discovered, or no source worked) cannot tell a stale id from a
// GPU it does not list: policy.unknown_device = "ignore" must not admit an id
// the NVIDIA runtime may select once the driver is up.
func TestResolveIncompleteInventoryRefusesUnknownUnderIgnore(t *testing.T) {
	ignore := config.PolicyConfig{UnknownDevice: config.UnknownIgnore, AllDevices: config.AllClaim, Privileged: config.PrivilegedDeclared}
	for name, in := range map[string]Inventory{
		"unlisted":     {Source: "nvml", UnlistedGPUs: 2},
		"undiscovered": {Source: "none", Undiscovered: true},
	} {
		inv, err := newInventory(in)
		require.NoError(t, err, name)
		r := NewResolver(inv, ignore)
		for _, req := range []Request{
			{Env: []string{"NVIDIA_VISIBLE_DEVICES=0"}},
			{Env: []string{"NVIDIA_VISIBLE_DEVICES=GPU-00000000-0000-4000-8000-000000000000"}},
			{Mounts: []string{MountRoot + "/1"}},
			{CDIDevices: []string{"nvidia.com/gpu=0"}},
			{Devices: []LinuxDevice{{Path: "/dev/nvidia0", Type: "c", Major: 195, Minor: 0}}},
		} {
			_, err := r.Resolve(req)
			assert.ErrorIs(t, err, ErrUnknownDevice, "%s: %+v", name, req)
		}
	}
	// A complete inventory still ignores a stale id.
	inv, err := NewInventory("nvml", nil)
	require.NoError(t, err)
	res, err := NewResolver(inv, ignore).Resolve(Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=0"}})
	require.NoError(t, err)
	assert.Empty(t, res.Devices)
}

// A /proc inventory lists no MIG instance (/proc has no MIG UUIDs), yet
// NVIDIA's runtime selects the instance a MIG id names: such an id is no
// unknown one a policy may ignore. Naming its parent, it claims the parent
// whole; a MIG UUID names none, and is refused under every policy.
func TestResolveProcInventoryMIGIDs(t *testing.T) {
	gpus := testGPUs()
	for i := range gpus {
		gpus[i].MIG = nil
	}
	inv, err := newInventory(Inventory{Source: "proc", GPUs: gpus})
	require.NoError(t, err)
	const nvd = "NVIDIA_VISIBLE_DEVICES="
	ignore := func(p *config.PolicyConfig) { p.UnknownDevice = config.UnknownIgnore }
	legacy := "MIG-" + gpuUUID(1) + "/2/1"
	runResolveCasesOn(t, inv, []resolveCase{
		{name: "<gpu>:<mig> under ignore claims the parent", policy: ignore, req: Request{Env: env(nvd + "1:0")}, want: []string{"1"},
			sources: map[string][]string{"1": {`env NVIDIA_VISIBLE_DEVICES="1:0"`}},
			notes:   []string{`cannot list MIG instances: GPU 1 (` + gpuUUID(1) + `) is claimed whole for MIG instance "1:0"`}},
		{name: "<gpu>:<mig> under reject claims the parent", req: Request{Env: env(nvd + "1:2")}, want: []string{"1"}},
		{name: "CDI mig name claims the parent", policy: ignore, req: Request{CDIDevices: []string{"nvidia.com/mig=mig2:0"}}, want: []string{"2"},
			sources: map[string][]string{"2": {`cdi "nvidia.com/mig=mig2:0"`}}},
		{name: "legacy MIG id claims the parent", policy: ignore, req: Request{Mounts: []string{mr + legacy}}, want: []string{"1"}},
		{name: "MIG UUID under ignore", policy: ignore, req: Request{Env: env(nvd + migUUID(1, 0))}, err: ErrUnknownDevice,
			errHas: []string{`"` + migUUID(1, 0) + `"`, `devices.source = "proc"`, "cannot list MIG instances", `devices.source = "nvml"`}},
		{name: "MIG UUID as a CDI name under ignore", policy: ignore, req: Request{Annotations: map[string]string{"cdi.k8s.io/x": "nvidia.com/mig=" + migUUID(1, 0)}},
			err: ErrUnknownDevice, errHas: []string{"cannot list MIG instances"}},
		{name: "MIG UUID under reject", req: Request{Env: env(nvd + migUUID(1, 0))}, err: ErrUnknownDevice, errHas: []string{"cannot list MIG instances"}},
		// A GPU the inventory does not list has no MIG instance either.
		{name: "<gpu>:<mig> of no GPU is still ignorable", policy: ignore, req: Request{Env: env(nvd + "7:0, 0")}, want: []string{"0"},
			notes: []string{`ignored unknown GPU "7:0"`}},
		{name: "legacy MIG id of no GPU is still ignorable", policy: ignore, req: Request{Env: env(nvd + "MIG-" + gpuUUID(9) + "/1/0")}, want: nil},
	})

	// So does a static list that names no MIG instance: it may simply leave
	// them out. One that names some lists them.
	static, err := newInventory(Inventory{Source: "static", GPUs: gpus})
	require.NoError(t, err)
	runResolveCasesOn(t, static, []resolveCase{
		{name: "static: <gpu>:<mig> under ignore claims the parent", policy: ignore, req: Request{Env: env(nvd + "1:0")}, want: []string{"1"},
			notes: []string{`[[devices.static]]) lists no MIG instance: GPU 1 (` + gpuUUID(1) + `) is claimed whole for MIG instance "1:0"`}},
		{name: "static: MIG UUID under ignore", policy: ignore, req: Request{Env: env(nvd + migUUID(1, 0))}, err: ErrUnknownDevice,
			errHas: []string{`"` + migUUID(1, 0) + `"`, "lists no MIG instance", "list the MIG instances under [[devices.static]]"}},
	})

	// A static list that names some MIG instances is not checked for them
	// either (the driver's /proc tree shows none): an instance it does not
	// name claims its parent whole, a MIG UUID it does not name is refused;
	// one it names is claimed alone.
	listed, err := newInventory(Inventory{Source: "static", GPUs: testGPUs()})
	require.NoError(t, err)
	runResolveCasesOn(t, listed, []resolveCase{
		{name: "static with MIG: another GPU's instance claims it whole", policy: ignore, req: Request{Env: env(nvd + "0:0")}, want: []string{"0"}},
		{name: "static with MIG: an unlisted instance claims its GPU whole", policy: ignore, req: Request{Env: env(nvd + "1:5")}, want: []string{"1"}},
		{name: "static with MIG: an unlisted MIG UUID", policy: ignore, req: Request{Env: env(nvd + migUUID(3, 3))}, err: ErrUnknownDevice,
			errHas: []string{"lists MIG instances unchecked against the driver"}},
		{name: "static with MIG: a listed instance alone", req: Request{Env: env(nvd + "1:0")}, want: []string{"1:0"}},
	})

	// An NVML inventory (it lists every MIG instance there is) ignores an
	// unknown one.
	res, err := NewResolver(testInventory(t), config.PolicyConfig{UnknownDevice: config.UnknownIgnore, AllDevices: config.AllClaim, Privileged: config.PrivilegedDeclared}).
		Resolve(Request{Env: []string{nvd + "0:0," + migUUID(3, 3)}})
	require.NoError(t, err)
	assert.Empty(t, res.Devices)
}

// The remedy named for a container without a device cgroup whose root
// filesystem or a directory bound in may hold nodes is what stops them
// under the runtime that mounts them: container storage mounted nodev only
// where the runtime keeps that nodev (runc, a read-write root); a
// read-write root under runc, which drops a read-only root's nodev; under
// crun, which drops it for every root outside a user namespace of the
// container's own, a device cgroup, runc, or such a user namespace
// (storage mounted nodev helps nothing there alone); for a bind source on
// a nodev mount whose bind drops it (crun, or a bind with flag options of
// its own) the bind's own nodev option, not a nodev mount it has already;
// for a mount below a recursive bind its own nodev or the bind's rnodev,
// not the bind's nodev, which makes only the top mount nodev; and where
// the bind says dev or rdev, dropping those first.
func TestNodesCauseRemedy(t *testing.T) {
	const storage = `container storage mounted nodev (containers/storage: mountopt = "nodev" in storage.conf)`
	root := func(drop RootNodev, nodev bool) Request {
		return Request{GPUNodesAllowed: true, NoDeviceCgroup: true, ImageNodes: true, RootNodev: drop, RootStorageNodev: nodev}
	}
	dirs := func(d ...NodeDir) Request { return Request{GPUNodesAllowed: true, NoDeviceCgroup: true, NodeDirs: d} }
	for _, tc := range []struct {
		name            string
		req             Request
		what, src, fix  []string
		notFix, notWhat []string
	}{
		{name: "root not nodev, runc with a read-write root", req: root(RootNodevKept, false),
			what:   []string{"whose root filesystem is not mounted nodev (a device node its image carries"},
			src:    []string{"root filesystem not mounted nodev: its image's device nodes open"},
			fix:    []string{"cgroups enabled", `mount the container storage nodev (containers/storage: mountopt = "nodev" in storage.conf)`},
			notFix: []string{"runc", "read-write"}},
		{name: "root nodev, runc with a read-only root", req: root(RootNodevDroppedReadOnly, true),
			what:   []string{"whose read-only root filesystem runc remounts without the nodev of its storage"},
			src:    []string{"read-only root filesystem remounted without nodev by runc"},
			fix:    []string{"cgroups enabled", "give it a read-write root (runc keeps the nodev of its storage there)"},
			notFix: []string{"mount the container storage nodev", "mountopt"}, notWhat: []string{"not mounted nodev"}},
		{name: "root not nodev, runc with a read-only root", req: root(RootNodevDroppedReadOnly, false),
			what: []string{"whose root filesystem is not mounted nodev (and is read-only, which runc remounts without nodev)"},
			src:  []string{"root filesystem not mounted nodev"},
			fix:  []string{"cgroups enabled", "give it a read-write root on " + storage}},
		{name: "root nodev, crun", req: root(RootNodevDroppedByRuntime, true),
			what: []string{"whose root filesystem, on container storage mounted nodev, its runtime mounts without nodev",
				"crun does so for every root", "not known to be runc"},
			src: []string{"root filesystem's nodev dropped by a runtime not known to be runc"},
			fix: []string{"run it in a device cgroup of its own (cgroups enabled), or run it under runc with a read-write root, " +
				"or give it a user namespace of its own under runc or crun (podman --userns=auto or --uidmap: the kernel then locks the nodev of its storage)"},
			notFix: []string{"mountopt", "mount the container storage nodev"}, notWhat: []string{"not mounted nodev"}},
		{name: "root not nodev, crun", req: root(RootNodevDroppedByRuntime, false),
			what: []string{"whose root filesystem is not mounted nodev, nor would its runtime keep it so (crun does only in a user namespace of the container's own"},
			src:  []string{"root filesystem not mounted nodev"},
			fix: []string{"cgroups enabled", "run it under runc with a read-write root on " + storage +
				", or on such storage give it a user namespace of its own under runc or crun"}},
		{name: "a bind source on a nodev mount its bind drops", req: Request{GPUNodesAllowed: true, NoDeviceCgroup: true,
			NodeDirs: []NodeDir{{Path: "/srv/vol", BoundAt: "/data", NodevDropped: true}, {Path: "/srv/b", BoundAt: "/b"}}},
			what:   []string{"whose bind source /srv/vol (at /data) (and 1 more directory) is on a nodev mount whose nodev its bind does not keep (crun remounts every bind"},
			src:    []string{"bind source /srv/vol (and 1 more directory) bound without nodev: its mount's nodev not kept"},
			fix:    []string{"cgroups enabled", "give the bind of /srv/vol the nodev option"},
			notFix: []string{"mount /srv/vol nodev"}, notWhat: []string{"not mounted nodev", "not nodev,"}},
		{name: "a bind source not mounted nodev", req: Request{GPUNodesAllowed: true, NoDeviceCgroup: true,
			NodeDirs: []NodeDir{{Path: "/srv/vol", BoundAt: "/data"}}},
			what: []string{"whose bind source /srv/vol (at /data) is on a mount that is not nodev, bound without nodev"},
			src:  []string{"bind source /srv/vol not mounted nodev: its device nodes open"},
			fix:  []string{"mount /srv/vol nodev or give its bind the nodev option"}},
		// The bind's dev or rdev clears nodev: it must go first, and a
		// nodev mount does not help while it is there.
		{name: "a bind source on a nodev mount its bind's dev clears", req: dirs(NodeDir{Path: "/srv/vol", BoundAt: "/data", NodevDropped: true, Clears: []string{"dev"}}),
			src:    []string{"bind source /srv/vol bound without nodev: its mount's nodev not kept"},
			fix:    []string{"drop dev from the bind of /srv/vol and give it the nodev option (the nodev of its mount does not carry over)"},
			notFix: []string{"mount /srv/vol nodev", "give the bind of /srv/vol the nodev option"}},
		{name: "a bind source not mounted nodev, bound dev and rdev", req: dirs(NodeDir{Path: "/srv/vol", BoundAt: "/data", Clears: []string{"dev", "rdev"}}),
			what:   []string{"whose bind source /srv/vol (at /data) is on a mount that is not nodev, bound with dev and rdev"},
			src:    []string{"bind source /srv/vol not mounted nodev: its device nodes open"},
			fix:    []string{"drop dev and rdev from the bind of /srv/vol and give it the nodev option (while its bind says dev or rdev, mounting /srv/vol nodev does not help)"},
			notFix: []string{"or give its bind the nodev option"}},
		// A mount below a recursive bind keeps its own flags: the bind's
		// nodev does not reach it, its rnodev does, and its rdev clears
		// the mount's own nodev.
		{name: "a mount below a recursive bind, not nodev", req: dirs(NodeDir{Path: "/srv/vol/sub", BoundAt: "/data/sub", Below: "/srv/vol"}),
			what: []string{"whose mount /srv/vol/sub (at /data/sub), below the bind source /srv/vol, is not nodev (a device node in it"},
			src:  []string{"mount /srv/vol/sub below bind source /srv/vol not mounted nodev: its device nodes open"},
			fix: []string{"run it in a device cgroup of its own (cgroups enabled), or mount /srv/vol/sub nodev or give the bind of /srv/vol the rnodev option " +
				"(its nodev makes only its top mount nodev), and name its GPUs"},
			notFix: []string{"give its bind the nodev option", "the nodev option"}, notWhat: []string{"bind source /srv/vol/sub"}},
		{name: "a nodev mount below a recursive bind whose rdev clears it",
			req:  dirs(NodeDir{Path: "/srv/vol/sub", BoundAt: "/data/sub", Below: "/srv/vol", NodevDropped: true, Clears: []string{"rdev"}}, NodeDir{Path: "/srv/b", BoundAt: "/b"}),
			what: []string{"whose mount /srv/vol/sub (at /data/sub) (and 1 more directory), below the bind source /srv/vol, is nodev, but the bind's rdev clears that"},
			src:  []string{"mount /srv/vol/sub (and 1 more directory) below bind source /srv/vol: its nodev cleared by the bind's rdev, its device nodes open"},
			fix:  []string{"(cgroups enabled), or drop rdev from the bind of /srv/vol, and name its GPUs"}, notFix: []string{"mount /srv/vol/sub nodev", "rnodev"}},
		{name: "a mount below a recursive bind that says rdev, not nodev",
			req: dirs(NodeDir{Path: "/srv/vol/sub", BoundAt: "/data/sub", Below: "/srv/vol", Clears: []string{"rdev"}}),
			src: []string{"mount /srv/vol/sub below bind source /srv/vol not mounted nodev"},
			fix: []string{"drop rdev from the bind of /srv/vol, then mount /srv/vol/sub nodev or give that bind the rnodev option"}},
		// runc or crun with a user namespace of the container's own keep
		// the nodev of its storage.
		{name: "root nodev, runc with a read-only root: or a user namespace", req: root(RootNodevDroppedReadOnly, true),
			fix: []string{"give it a read-write root (runc keeps the nodev of its storage there), or a user namespace of its own under runc or crun " +
				"(podman --userns=auto or --uidmap: the kernel then locks the nodev of its storage)"}},
		{name: "root not nodev, runc with a read-only root: or a user namespace", req: root(RootNodevDroppedReadOnly, false),
			fix: []string{"give it a read-write root on " + storage + ", or on such storage a user namespace of its own under runc or crun"}},
		{name: "crun: the root and a bind source on nodev mounts", req: Request{GPUNodesAllowed: true, NoDeviceCgroup: true,
			ImageNodes: true, RootNodev: RootNodevDroppedByRuntime, RootStorageNodev: true,
			NodeDirs: []NodeDir{{Path: "/srv/vol", BoundAt: "/data", NodevDropped: true}}},
			src: []string{"no device cgroup (root filesystem's nodev dropped by a runtime not known to be runc: its image's device nodes open; " +
				"bind source /srv/vol bound without nodev"},
			fix: []string{"run it in a device cgroup of its own (cgroups enabled), or run it under runc with a read-write root, " +
				"or give it a user namespace of its own under runc or crun (podman --userns=auto or --uidmap: the kernel then locks the nodev of its storage), " +
				"and give the bind of /srv/vol the nodev option"},
			notFix: []string{"mountopt", "mount /srv/vol nodev"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			what, src, fix := nodesCause(tc.req)
			for _, s := range tc.what {
				require.Contains(t, what, s)
			}
			for _, s := range tc.notWhat {
				require.NotContains(t, what, s)
			}
			for _, s := range tc.src {
				require.Contains(t, src, s)
			}
			for _, s := range tc.fix {
				require.Contains(t, fix, s)
			}
			for _, s := range tc.notFix {
				require.NotContains(t, fix, s)
			}
			// And as the resolver says it, claimed and refused.
			inv := testInventory(t)
			resolver := func(edit func(p *config.PolicyConfig)) *Resolver {
				pol := defaultPolicy()
				edit(&pol)
				return NewResolver(inv, pol)
			}
			res, err := resolver(func(p *config.PolicyConfig) { p.Privileged = config.PrivilegedDeclared }).Resolve(tc.req)
			require.NoError(t, err)
			require.True(t, res.All)
			_, err = resolver(func(p *config.PolicyConfig) {
				p.Privileged, p.AllDevices = config.PrivilegedDeclared, config.AllReject
			}).Resolve(tc.req)
			require.ErrorIs(t, err, ErrAllRejected)
			require.ErrorContains(t, err, src)
			require.ErrorContains(t, err, fix)
			_, err = resolver(func(p *config.PolicyConfig) { p.Privileged = config.PrivilegedReject }).Resolve(tc.req)
			require.ErrorIs(t, err, ErrPrivilegedRejected)
			require.ErrorContains(t, err, what)
		})
	}
}
