// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// injector is another NRI plugin, with a higher index than the guard's (95
// against 90): it adjusts every container as adjust says, after the guard's
// CreateContainer, as containerd's device-injector sample does from a pod's
// annotations.
type injector struct {
	adjust func(*api.Container) *api.ContainerAdjustment
	synced chan struct{}
}

func (in *injector) Synchronize(context.Context, []*api.PodSandbox, []*api.Container) ([]*api.ContainerUpdate, error) {
	select {
	case in.synced <- struct{}{}:
	default:
	}
	return nil, nil
}

func (in *injector) CreateContainer(_ context.Context, _ *api.PodSandbox, c *api.Container) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	return in.adjust(c), nil, nil
}

// startInjector starts the injector and waits until the runtime has it
// registered.
func (rt *runtime) startInjector(adjust func(*api.Container) *api.ContainerAdjustment) {
	rt.t.Helper()
	rt.startInjectorAt("95", adjust)
}

// startInjectorAt is startInjector with another plugin index ("10": before
// the guard's 90).
func (rt *runtime) startInjectorAt(idx string, adjust func(*api.Container) *api.ContainerAdjustment) {
	rt.t.Helper()
	in := &injector{adjust: adjust, synced: make(chan struct{}, 1)}
	s, err := stub.New(in, stub.WithPluginName("device-injector"), stub.WithPluginIdx(idx), stub.WithSocketPath(rt.socket))
	require.NoError(rt.t, err)
	require.NoError(rt.t, s.Start(context.Background()))
	rt.t.Cleanup(s.Stop)
	testwait.Receive(rt.t, in.synced, "the injector's Synchronize")
	rt.registered()
}

// A plugin that runs after the guard can give a container a GPU the guard
// never saw: containerd (2.2 and later) asks the guard to validate the
// container as every plugin leaves it, and the guard refuses one that
// reaches a GPU it holds no claim for. Before, such a container was created
// with the GPU and no claim, also while another container held it. What a
// refused create claimed is released by containerd's undo.
func TestLaterPluginCannotAddAnUncheckedGPU(t *testing.T) {
	gpu1 := &api.LinuxDevice{Path: "/dev/nvidia1", Type: "c", Major: 195, Minor: 1}
	for _, tc := range []struct {
		name    string
		env     []string // the container's own request
		adjust  *api.ContainerAdjustment
		refused []string // in the refusal; nil: admitted
		holds   []string // the container's claims once created
	}{
		{name: "a GPU device node", adjust: &api.ContainerAdjustment{Linux: &api.LinuxContainerAdjustment{Devices: []*api.LinuxDevice{gpu1}}},
			refused: []string{"GPU 1 (" + gpuUUID(1) + ")", "device /dev/nvidia1 (195:1)", "95-device-injector"}},
		{name: "a GPU beside the one claimed", env: []string{"NVIDIA_VISIBLE_DEVICES=0"},
			adjust:  &api.ContainerAdjustment{Linux: &api.LinuxContainerAdjustment{Devices: []*api.LinuxDevice{gpu1}}},
			refused: []string{"GPU 1 (" + gpuUUID(1) + ")"}},
		{name: "the node of the GPU claimed", env: []string{"NVIDIA_VISIBLE_DEVICES=1"},
			adjust: &api.ContainerAdjustment{Linux: &api.LinuxContainerAdjustment{Devices: []*api.LinuxDevice{gpu1}}},
			holds:  []string{gpuUUID(1)}},
		{name: "an env id", adjust: &api.ContainerAdjustment{Env: []*api.KeyValue{{Key: "NVIDIA_VISIBLE_DEVICES", Value: "2"}}},
			refused: []string{"GPU 2 (" + gpuUUID(2) + ")", `env NVIDIA_VISIBLE_DEVICES="2"`}},
		{name: "an env id replacing the one claimed", env: []string{"NVIDIA_VISIBLE_DEVICES=0"},
			adjust:  &api.ContainerAdjustment{Env: []*api.KeyValue{{Key: "NVIDIA_VISIBLE_DEVICES", Value: "2"}}},
			refused: []string{"GPU 2 (" + gpuUUID(2) + ")"}},
		{name: "the env id removed", env: []string{"NVIDIA_VISIBLE_DEVICES=0"},
			adjust: &api.ContainerAdjustment{Env: []*api.KeyValue{{Key: api.MarkForRemoval("NVIDIA_VISIBLE_DEVICES")}}},
			holds:  []string{gpuUUID(0)}},
		{name: "an NVIDIA CDI device", adjust: &api.ContainerAdjustment{CDIDevices: []*api.CDIDevice{{Name: "nvidia.com/gpu=3"}}},
			refused: []string{"GPU 3 (" + gpuUUID(3) + ")", `cdi "nvidia.com/gpu=3"`}},
		// Injected after every plugin answered: its nodes are never seen.
		{name: "another vendor's CDI device", adjust: &api.ContainerAdjustment{CDIDevices: []*api.CDIDevice{{Name: "k8s.gpu.nvidia.com/device=gpu-0"}}},
			refused: []string{`"k8s.gpu.nvidia.com/device=gpu-0"`, "an NRI plugin added this NVIDIA CDI device"}},
		{name: "a rule opening every GPU node", adjust: &api.ContainerAdjustment{Linux: &api.LinuxContainerAdjustment{
			Resources: &api.LinuxResources{Devices: []*api.LinuxDeviceCgroup{{Allow: true, Type: "c", Major: api.Int64(195), Access: "rw"}}}}},
			refused: []string{"GPU 0 (" + gpuUUID(0) + ")"}},
		// A plugin's rule allowing every device does not make the
		// container privileged (whose engine-added nodes are no request):
		// it reaches every GPU.
		{name: "a rule allowing every device, and a GPU node", adjust: &api.ContainerAdjustment{Linux: &api.LinuxContainerAdjustment{
			Devices:   []*api.LinuxDevice{gpu1},
			Resources: &api.LinuxResources{Devices: []*api.LinuxDeviceCgroup{{Allow: true, Type: "a", Access: "rwm"}}}}},
			refused: []string{"GPU 0 (" + gpuUUID(0) + ")", "GPU 1 (" + gpuUUID(1) + ")"}},
		// Another vendor's device (a NIC's virtual function) added by a
		// plugin is no GPU; a device of NVIDIA's domain is refused, its
		// GPUs unknown.
		{name: "a NIC's CDI device", adjust: &api.ContainerAdjustment{CDIDevices: []*api.CDIDevice{{Name: "intel.com/sriov=vf0"}}}},
		{name: "nothing about GPUs", adjust: &api.ContainerAdjustment{Env: []*api.KeyValue{{Key: "FOO", Value: "bar"}},
			Annotations: map[string]string{"example.com/x": "y"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rt := newRuntime(t, nil)
			rt.startPlugin()
			rt.startInjector(func(*api.Container) *api.ContainerAdjustment { return tc.adjust })
			pod := rt.addPod("p")
			err := rt.create(pod, container(pod, "c", "ctr-1", tc.env...))
			if tc.refused != nil {
				require.Error(t, err)
				for _, s := range tc.refused {
					assert.ErrorContains(t, err, s)
				}
				assert.Empty(t, rt.state().Claims, "containerd's undo released what CreateContainer claimed")
				return
			}
			require.NoError(t, err)
			var held []string
			for _, c := range rt.state().Claims {
				require.Equal(t, "ctr-1", c.Owner.ContainerID)
				held = append(held, c.Device.UUID)
			}
			assert.ElementsMatch(t, tc.holds, held)
		})
	}
}

// A plugin that runs before the guard changes the request the guard sees in
// place, and NRI does not always hand that change to the runtime: an env
// removal is applied to what later plugins see but left out of the
// adjustment containerd applies, so the container keeps the variable the
// guard never saw. The validation resolves the pristine container with the
// adjustment whenever a plugin ran before the guard, and refuses what it
// reaches unclaimed, naming that plugin.
func TestEarlierPluginsInPlaceChangeIsValidated(t *testing.T) {
	err := createBehindEnvRemoval(t, newRuntime(t, nil))
	assert.ErrorContains(t, err, "before nri-gpu-guard: 10-device-injector")
}

// createBehindEnvRemoval starts the guard in rt and, before it (index 10),
// a plugin that removes NVIDIA_VISIBLE_DEVICES from container "b"; ctr-a
// then holds GPU 0, and the create of ctr-b asking for it must be refused
// (its error, which names the GPU, is returned for more checks).
func createBehindEnvRemoval(t *testing.T, rt *runtime) error {
	t.Helper()
	rt.startPlugin()
	rt.startInjectorAt("10", func(c *api.Container) *api.ContainerAdjustment {
		if c.GetName() != "b" {
			return nil
		}
		return &api.ContainerAdjustment{Env: []*api.KeyValue{{Key: api.MarkForRemoval("NVIDIA_VISIBLE_DEVICES")}}}
	})
	pa := rt.addPod("a")
	require.NoError(t, rt.create(pa, container(pa, "a", "ctr-a", "NVIDIA_VISIBLE_DEVICES=0")))
	pb := rt.addPod("b")
	err := rt.create(pb, container(pb, "b", "ctr-b", "NVIDIA_VISIBLE_DEVICES=0"))
	require.Error(t, err, "the runtime creates ctr-b with NVIDIA_VISIBLE_DEVICES=0 while ctr-a holds GPU 0")
	assert.ErrorContains(t, err, "GPU 0 ("+gpuUUID(0)+")")
	assert.Equal(t, map[string]string{"0": "ctr-a"}, rt.holders())
	return err
}

// containerd keeps duplicates when it appends the CRI env to the image's
// (a CUDA image's NVIDIA_VISIBLE_DEVICES=all and the device plugin's id),
// and it applies an env adjustment to the first copy only: the later copy
// overwrites it, so the container keeps its last original value. NRI shows
// the plugins after the adjusting one the adjusted value alone. A plugin
// before the guard that sets the variable must not get a container
// admitted on the value it set (before, it got GPU 0 with no claim while
// ctr-a held it); one after the guard is checked on both values, whichever
// the runtime creates.
func TestEnvSetOverDuplicatesIsValidated(t *testing.T) {
	for _, tc := range []struct {
		name    string
		idx     string   // the adjusting plugin's index (the guard's is 90)
		env     []string // ctr-b's own
		set     string   // the value the plugin sets
		refused []string // in the refusal; nil: admitted
		holds   []string // the indices of ctr-b's claims once created
	}{
		{name: "before the guard: its value is lost", idx: "10",
			env: []string{"NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_VISIBLE_DEVICES=0"}, set: "void",
			refused: []string{"GPU 0 (" + gpuUUID(0) + ")", "before nri-gpu-guard: 10-device-injector"}},
		{name: "before the guard: the last copy counts", idx: "10",
			env: []string{"NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=0"}, set: "2",
			refused: []string{"GPU 0 (" + gpuUUID(0) + ")", `env NVIDIA_VISIBLE_DEVICES="0"`}},
		{name: "after the guard: its value counts too", idx: "95",
			env: []string{"NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_VISIBLE_DEVICES=void"}, set: "0",
			refused: []string{"GPU 0 (" + gpuUUID(0) + ")", "runs after nri-gpu-guard (95-device-injector)"}},
		{name: "before the guard, one copy: its value is created", idx: "10",
			env: []string{"NVIDIA_VISIBLE_DEVICES=0"}, set: "1", holds: []string{"1"}},
		{name: "before the guard: a free GPU is not taken unclaimed", idx: "10",
			env: []string{"NVIDIA_VISIBLE_DEVICES=1", "NVIDIA_VISIBLE_DEVICES=1"}, set: "void",
			refused: []string{"GPU 1 (" + gpuUUID(1) + ")"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rt := newRuntime(t, nil)
			rt.startPlugin()
			rt.startInjectorAt(tc.idx, func(c *api.Container) *api.ContainerAdjustment {
				if c.GetName() != "b" {
					return nil
				}
				return &api.ContainerAdjustment{Env: []*api.KeyValue{{Key: "NVIDIA_VISIBLE_DEVICES", Value: tc.set}}}
			})
			pa := rt.addPod("a")
			require.NoError(t, rt.create(pa, container(pa, "a", "ctr-a", "NVIDIA_VISIBLE_DEVICES=0")))
			pb := rt.addPod("b")
			err := rt.create(pb, container(pb, "b", "ctr-b", tc.env...))
			if tc.refused != nil {
				require.Error(t, err, "the runtime creates ctr-b with a GPU it holds no claim for")
				for _, s := range tc.refused {
					assert.ErrorContains(t, err, s)
				}
				assert.Equal(t, map[string]string{"0": "ctr-a"}, rt.holders(), "containerd's undo released what CreateContainer claimed")
				return
			}
			require.NoError(t, err)
			want := map[string]string{"0": "ctr-a"}
			for _, i := range tc.holds {
				want[i] = "ctr-b"
			}
			assert.Equal(t, want, rt.holders())
		})
	}
}

// adjusted models what containerd creates: an env adjustment replaces the
// first copy of its key and the last copy decides; a mount (or device)
// removed or set takes out the first at its destination (path) only.
func TestAdjustedAsContainerdApplies(t *testing.T) {
	gpuDev := func(dest string) *api.Mount {
		return &api.Mount{Destination: dest, Source: "/dev/nvidia1", Type: "bind", Options: []string{"rbind"}}
	}
	for _, tc := range []struct {
		name      string
		ctr       *api.Container
		adj       *api.ContainerAdjustment
		lastEnv   map[string]string // the last copy of each key in the created env
		shownEnv  map[string]string // the same in the container as NRI showed it; nil: none returned
		mountsAt  map[string]int    // mounts per destination
		noEnvKeys []string          // keys absent from the created env
	}{
		{name: "set over one copy",
			ctr:     &api.Container{Env: []string{"A=1", "NVIDIA_VISIBLE_DEVICES=0"}},
			adj:     &api.ContainerAdjustment{Env: []*api.KeyValue{{Key: "NVIDIA_VISIBLE_DEVICES", Value: "1"}}},
			lastEnv: map[string]string{"A": "1", "NVIDIA_VISIBLE_DEVICES": "1"}},
		{name: "set over two copies",
			ctr:      &api.Container{Env: []string{"NVIDIA_VISIBLE_DEVICES=all", "A=1", "NVIDIA_VISIBLE_DEVICES=0"}},
			adj:      &api.ContainerAdjustment{Env: []*api.KeyValue{{Key: "NVIDIA_VISIBLE_DEVICES", Value: "void"}}},
			lastEnv:  map[string]string{"A": "1", "NVIDIA_VISIBLE_DEVICES": "0"},
			shownEnv: map[string]string{"A": "1", "NVIDIA_VISIBLE_DEVICES": "void"}},
		{name: "removed from two copies",
			ctr:      &api.Container{Env: []string{"NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_VISIBLE_DEVICES=1"}},
			adj:      &api.ContainerAdjustment{Env: []*api.KeyValue{{Key: api.MarkForRemoval("NVIDIA_VISIBLE_DEVICES")}}},
			lastEnv:  map[string]string{"NVIDIA_VISIBLE_DEVICES": "1"},
			shownEnv: map[string]string{}},
		{name: "removed from one copy",
			ctr:       &api.Container{Env: []string{"NVIDIA_VISIBLE_DEVICES=0", "A=1"}},
			adj:       &api.ContainerAdjustment{Env: []*api.KeyValue{{Key: api.MarkForRemoval("NVIDIA_VISIBLE_DEVICES")}}},
			lastEnv:   map[string]string{"A": "1"},
			noEnvKeys: []string{"NVIDIA_VISIBLE_DEVICES"}},
		{name: "a new key, the last entry deciding",
			ctr: &api.Container{Env: []string{"A=1"}},
			adj: &api.ContainerAdjustment{Env: []*api.KeyValue{
				{Key: "NVIDIA_VISIBLE_DEVICES", Value: "0"}, {Key: "NVIDIA_VISIBLE_DEVICES", Value: "2"}}},
			lastEnv: map[string]string{"A": "1", "NVIDIA_VISIBLE_DEVICES": "2"}},
		{name: "a mount removed from two at its destination",
			ctr:      &api.Container{Mounts: []*api.Mount{gpuDev("/gpu"), gpuDev("/other"), gpuDev("/gpu")}},
			adj:      &api.ContainerAdjustment{Mounts: []*api.Mount{{Destination: api.MarkForRemoval("/gpu")}}},
			mountsAt: map[string]int{"/gpu": 1, "/other": 1}},
		{name: "a mount set over two at its destination",
			ctr:      &api.Container{Mounts: []*api.Mount{gpuDev("/gpu"), gpuDev("/gpu")}},
			adj:      &api.ContainerAdjustment{Mounts: []*api.Mount{{Destination: "/gpu", Source: "/tmp", Type: "bind"}}},
			mountsAt: map[string]int{"/gpu": 2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pristine := proto.Clone(tc.ctr).(*api.Container)
			out, _, shown := adjusted(tc.ctr, tc.adj)
			assert.True(t, proto.Equal(pristine, tc.ctr), "the pristine container is not modified")
			if tc.lastEnv != nil {
				assert.Equal(t, tc.lastEnv, lastCopies(out.GetEnv()))
			}
			for _, k := range tc.noEnvKeys {
				assert.NotContains(t, lastCopies(out.GetEnv()), k)
			}
			if tc.shownEnv == nil {
				assert.Nil(t, shown, "the container as NRI showed it is what containerd creates")
			} else {
				require.NotNil(t, shown)
				assert.Equal(t, tc.shownEnv, lastCopies(shown.GetEnv()))
				assert.True(t, proto.Equal(&api.Container{Mounts: out.Mounts, Linux: out.Linux, Annotations: out.Annotations},
					&api.Container{Mounts: shown.Mounts, Linux: shown.Linux, Annotations: shown.Annotations}), "the two differ in their env alone")
			}
			if tc.mountsAt != nil {
				at := map[string]int{}
				for _, m := range out.GetMounts() {
					at[m.GetDestination()]++
				}
				assert.Equal(t, tc.mountsAt, at)
			}
		})
	}
}

// lastCopies maps each key of env to its last value.
func lastCopies(env []string) map[string]string {
	out := map[string]string{}
	for _, e := range env {
		if k, v, ok := strings.Cut(e, "="); ok {
			out[k] = v
		}
	}
	return out
}

// The same when the configuration's [nri] plugin_name is not the name the
// plugin registered under (a --name flag, or the name containerd gives a
// plugin it launches): the guard is found in the plugin list by the name it
// registered under, and one it cannot find never lets the validation
// assume that no plugin ran before it.
func TestEarlierPluginsChangeValidatedWhateverTheConfiguredName(t *testing.T) {
	_ = createBehindEnvRemoval(t, newRuntime(t, func(c *config.Config) { c.NRI.PluginName = "nri-gpu-guard" })) // asserted inside
}

// One plugin's removal of an annotation and a later plugin's setting of it
// are both in the adjustment, which the runtime applies in no set order: the
// guard reads the key as set, whatever the order.
func TestAdjustedAnnotationRemovedThenSet(t *testing.T) {
	ctr := &api.Container{Id: "c", Annotations: map[string]string{"cdi.k8s.io/x": "nvidia.com/gpu=1"}}
	adj := &api.ContainerAdjustment{Annotations: map[string]string{
		api.MarkForRemoval("cdi.k8s.io/x"): "", "cdi.k8s.io/x": "nvidia.com/gpu=0", api.MarkForRemoval("cdi.k8s.io/y"): ""}}
	for range 50 { // map order differs between runs of the loop
		out, _, _ := adjusted(ctr, adj)
		require.Equal(t, map[string]string{"cdi.k8s.io/x": "nvidia.com/gpu=0"}, out.Annotations)
	}
}

func TestCulpritText(t *testing.T) {
	plugins := []*api.PluginInstance{{Name: "device-injector", Index: "10"}, {Name: "gpu-guard", Index: "90"}, {Name: "cdi", Index: "95"}}
	before, after, found := pluginsAround(plugins, "gpu-guard")
	assert.True(t, found)
	assert.Equal(t, []string{"10-device-injector"}, before)
	assert.Equal(t, []string{"95-cdi"}, after)
	assert.Equal(t, "an NRI plugin's adjustment (before nri-gpu-guard: 10-device-injector; after it: 95-cdi)", culpritText(before, after))
	assert.Equal(t, "an NRI plugin that runs after nri-gpu-guard (none listed)", culpritText(nil, nil))
	_, after, found = pluginsAround(plugins, "not-listed")
	assert.Len(t, after, 3, "self not listed: all count as after")
	assert.False(t, found, "and the caller is told: it cannot take the no-plugin-before shortcut")
}

// An exempt namespace's containers reach what they reach, as at admission;
// one whose create named no GPU (no exemption then) is granted it at
// validation, audited there once.
func TestLaterPluginInExemptNamespace(t *testing.T) {
	rt := newRuntime(t, nil)
	rt.cfg.Policy.ExemptNamespaces = []string{"ml"}
	rt.startPlugin()
	rt.startInjector(func(*api.Container) *api.ContainerAdjustment {
		return &api.ContainerAdjustment{Linux: &api.LinuxContainerAdjustment{Devices: []*api.LinuxDevice{
			{Path: "/dev/nvidia1", Type: "c", Major: 195, Minor: 1}}}}
	})
	pod := rt.addPod("p")
	require.NoError(t, rt.create(pod, container(pod, "c", "ctr-1")))
	require.NoError(t, rt.create(pod, container(pod, "g", "ctr-2", "NVIDIA_VISIBLE_DEVICES=0")))
	assert.Empty(t, rt.state().Claims)
	var exempt []string
	for _, r := range rt.audited(guard.AuditExempt) {
		exempt = append(exempt, r.ContainerID)
	}
	assert.Equal(t, []string{"ctr-1", "ctr-2"}, exempt, "each exemption audited once, at validation or at admission")
}

// A refusal at validation is audited, as every refusal that is not queued.
func TestLaterPluginRefusalIsAudited(t *testing.T) {
	rt := newRuntime(t, nil)
	rt.startPlugin()
	rt.startInjector(func(*api.Container) *api.ContainerAdjustment {
		return &api.ContainerAdjustment{Linux: &api.LinuxContainerAdjustment{Devices: []*api.LinuxDevice{
			{Path: "/dev/nvidia1", Type: "c", Major: 195, Minor: 1}}}}
	})
	pod := rt.addPod("p")
	require.Error(t, rt.create(pod, container(pod, "c", "ctr-1", "NVIDIA_VISIBLE_DEVICES=0")))
	refusals := rt.audited(guard.AuditRefuse)
	require.Len(t, refusals, 1)
	assert.Equal(t, "ctr-1", refusals[0].ContainerID)
	assert.Equal(t, []string{gpuUUID(1)}, refusals[0].Devices)
	assert.Contains(t, refusals[0].Reason, "95-device-injector")
}

// An exemption admission granted because a plugin with a lower index than
// the guard's gave the container a GPU is audited once: the validation
// request carries the pristine container, without that GPU, and must not
// take the exemption for its own.
func TestEarlierPluginExemptionAuditedOnce(t *testing.T) {
	rt := newRuntime(t, nil)
	rt.cfg.Policy.ExemptNamespaces = []string{"ml"}
	rt.startPlugin()
	rt.startInjectorAt("10", func(*api.Container) *api.ContainerAdjustment {
		return &api.ContainerAdjustment{Linux: &api.LinuxContainerAdjustment{Devices: []*api.LinuxDevice{
			{Path: "/dev/nvidia1", Type: "c", Major: 195, Minor: 1}}}}
	})
	pod := rt.addPod("p")
	require.NoError(t, rt.create(pod, container(pod, "c", "ctr-1")))
	var exempt []string
	for _, r := range rt.audited(guard.AuditExempt) {
		exempt = append(exempt, r.ContainerID)
	}
	assert.Equal(t, []string{"ctr-1"}, exempt)
}

// audited returns the audit log's records of operation op, in order.
func (rt *runtime) audited(op string) []ledger.AuditRecord {
	rt.t.Helper()
	recs, err := ledger.ReadAudit(filepath.Join(rt.ledgerDir, "audit.log"))
	require.NoError(rt.t, err)
	var out []ledger.AuditRecord
	for _, r := range recs {
		if r.Op == op {
			out = append(out, r)
		}
	}
	return out
}

// Only an adjustment that changes what resolution reads sends validation
// down its slow path; anything else is the container admission decided on.
func TestAdjustsAccess(t *testing.T) {
	for _, tc := range []struct {
		name string
		adj  *api.ContainerAdjustment
		want bool
	}{
		{"none", nil, false},
		{"empty", &api.ContainerAdjustment{}, false},
		{"rlimits and hooks only", &api.ContainerAdjustment{Rlimits: []*api.POSIXRlimit{{Type: "RLIMIT_NOFILE", Hard: 1, Soft: 1}},
			Hooks: &api.Hooks{}, Linux: &api.LinuxContainerAdjustment{CgroupsPath: "/x"}}, false},
		{"env", &api.ContainerAdjustment{Env: []*api.KeyValue{{Key: "A", Value: "b"}}}, true},
		{"mount", &api.ContainerAdjustment{Mounts: []*api.Mount{{Destination: "/d"}}}, true},
		{"annotation", &api.ContainerAdjustment{Annotations: map[string]string{"a": "b"}}, true},
		{"CDI device", &api.ContainerAdjustment{CDIDevices: []*api.CDIDevice{{Name: "x.com/y=z"}}}, true},
		{"device node", &api.ContainerAdjustment{Linux: &api.LinuxContainerAdjustment{Devices: []*api.LinuxDevice{{Path: "/dev/x"}}}}, true},
		{"device rule", &api.ContainerAdjustment{Linux: &api.LinuxContainerAdjustment{
			Resources: &api.LinuxResources{Devices: []*api.LinuxDeviceCgroup{{Allow: true}}}}}, true},
	} {
		assert.Equal(t, tc.want, adjustsAccess(tc.adj), tc.name)
	}
}
