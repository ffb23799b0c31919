// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"strings"

	"github.com/containerd/nri/pkg/api"
	"google.golang.org/protobuf/proto"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// ownerOf is the ledger identity of a container. Pid and cgroup are filled
// only for a running container: a container that is created but not started
// has no process yet, and recording its (empty) cgroup would make the
// liveness check take it for exited. Names and the cgroup path are bounded
// as the hook bounds them (guard.BoundOwner): they reach logs, the ledger and
// refusal messages, and a pod's creator chooses them.
func ownerOf(pod *api.PodSandbox, ctr *api.Container) ledger.Owner {
	o := ledger.Owner{
		ContainerID:  ctr.GetId(),
		Container:    ctr.GetName(),
		PodSandboxID: ctr.GetPodSandboxId(),
		FrontEnd:     ledger.FrontEndNRI,
	}
	if pod != nil {
		o.Namespace = pod.GetNamespace()
		o.Pod = pod.GetName()
		o.PodUID = pod.GetUid()
		if o.PodSandboxID == "" {
			o.PodSandboxID = pod.GetId()
		}
	}
	if ctr.GetState() == api.ContainerState_CONTAINER_RUNNING && ctr.GetPid() > 0 {
		o.Pid = int(ctr.GetPid())
		o.Cgroup = ctr.GetLinux().GetCgroupsPath()
	}
	return guard.BoundOwner(o)
}

// guardRequest is the guard's view of an NRI container.
func guardRequest(pod *api.PodSandbox, ctr *api.Container) guard.Request {
	spec := specOf(ctr)
	spec.Annotations = withPodCDIRequest(spec.Annotations, pod, ctr.GetName())
	return guard.Request{
		FrontEnd: ledger.FrontEndNRI,
		Owner:    ownerOf(pod, ctr),
		Spec:     spec,
	}
}

// withPodCDIRequest adds to a container's annotations the pod annotations
// through which NVIDIA's NRI plugin names CDI devices for this container: it
// injects those devices, and devices another NRI plugin injects are never
// shown to this one, so the annotations are all there is to see. Every
// release reads nvidia.cdi.k8s.io/container.<name> first; failing that, some
// read nvidia.cdi.k8s.io/container.* and later ones (the NRI library's
// GetEffectiveAnnotation) nvidia.cdi.k8s.io/pod, then the bare
// nvidia.cdi.k8s.io. Which release runs is not known here, so without the
// container's own key all three count (a claim too many is refused, a GPU
// reached without one is not). The bare key is added as
// "nvidia.cdi.k8s.io/", under the prefix the resolver reads. Keys for other
// containers of the pod are left out. The container's own map is not
// modified.
func withPodCDIRequest(ann map[string]string, pod *api.PodSandbox, name string) map[string]string {
	podAnn := pod.GetAnnotations()
	if len(podAnn) == 0 {
		return ann
	}
	domain := strings.TrimSuffix(devices.NvidiaCDIAnnotationPrefix, "/")
	var keys []string
	if own := devices.NvidiaCDIAnnotationPrefix + "container." + name; name != "" {
		if _, ok := podAnn[own]; ok {
			keys = []string{own}
		}
	}
	if keys == nil {
		for _, k := range []string{devices.NvidiaCDIAnnotationPrefix + "container.*", devices.NvidiaCDIAnnotationPrefix + "pod", domain} {
			if _, ok := podAnn[k]; ok {
				keys = append(keys, k)
			}
		}
	}
	if len(keys) == 0 {
		return ann
	}
	out := make(map[string]string, len(ann)+len(keys))
	for k, val := range ann {
		out[k] = val
	}
	for _, k := range keys {
		dst := k
		if k == domain {
			dst = devices.NvidiaCDIAnnotationPrefix
		}
		if _, own := ann[dst]; !own {
			out[dst] = podAnn[k]
		}
	}
	return out
}

// specOf collects everything in an NRI container that can make a GPU
// reachable. containerd applies CDI before NRI runs, so CDI-injected
// /dev/nvidiaN nodes, env and mounts are already in Linux.Devices, Env and
// Mounts.
func specOf(ctr *api.Container) devices.Request {
	req := devices.Request{
		Env:         ctr.GetEnv(),
		Annotations: ctr.GetAnnotations(),
	}
	for _, m := range ctr.GetMounts() {
		req.Mounts = append(req.Mounts, m.GetDestination())
		req.AddMount(m.GetType(), m.GetSource(), m.GetDestination())
	}
	for _, d := range ctr.GetCDIDevices() {
		req.CDIDevices = append(req.CDIDevices, d.GetName())
	}
	linux := ctr.GetLinux()
	for _, d := range linux.GetDevices() {
		req.Devices = append(req.Devices, devices.LinuxDevice{
			Path: d.GetPath(), Type: d.GetType(), Major: d.GetMajor(), Minor: d.GetMinor(),
		})
	}
	// NRI does not carry the CRI "privileged" flag; what privileged means
	// for device access is exactly a device cgroup that allows everything.
	req.ApplyDeviceRules(deviceRules(linux.GetResources().GetDevices()))
	req.Privileged = req.AllDevicesAllowed
	return req
}

// deviceRules converts NRI's device cgroup rules.
func deviceRules(rules []*api.LinuxDeviceCgroup) []devices.DeviceRule {
	out := make([]devices.DeviceRule, 0, len(rules))
	for _, r := range rules {
		d := devices.DeviceRule{Allow: r.GetAllow(), Type: r.GetType(), Access: r.GetAccess()}
		if m := r.GetMajor(); m != nil {
			v := m.GetValue()
			d.Major = &v
		}
		if m := r.GetMinor(); m != nil {
			v := m.GetValue()
			d.Minor = &v
		}
		out = append(out, d)
	}
	return out
}

// adjusted is ctr as it will be created: its pristine state with the
// runtime's other plugins' combined adjustment applied as containerd applies
// it (NRI's runtime-tools generator): env, mounts and devices replaced or
// removed by key, one copy at a time (see createdEnv, without); annotations
// replaced or removed by key; device cgroup rules appended. The CDI devices
// of the adjustment are returned apart: containerd injects them only after
// every plugin has answered, so their device nodes are never seen, and they
// are resolved as such (devices.Request.LateCDIDevices).
//
// shown is non-nil when the adjustment sets or removes an env variable that
// ctr holds more than once (containerd appends the CRI env to the image's
// without removing duplicates: a CUDA image's NVIDIA_VISIBLE_DEVICES=all and
// the device plugin's value). containerd then keeps the last original value
// and drops the adjustment's, while NRI showed the plugins the adjustment's
// value alone. shown is ctr with the adjustment applied over every copy, as
// NRI showed it: a runtime whose NRI applies it so creates that one, and
// the guard checks both (a claim too many, never one too few). ctr is not
// modified.
func adjusted(ctr *api.Container, adj *api.ContainerAdjustment) (out *api.Container, late []string, shown *api.Container) {
	out = proto.Clone(ctr).(*api.Container)
	if adj == nil {
		return out, nil, nil
	}
	var asShown []string
	if env := adj.GetEnv(); len(env) > 0 {
		if duplicatesTouched(ctr.GetEnv(), env) {
			asShown = shownEnv(ctr.GetEnv(), env)
		}
		out.Env = createdEnv(ctr.GetEnv(), env)
	}
	if mounts := adj.GetMounts(); len(mounts) > 0 {
		out.Mounts = adjustMounts(out.Mounts, mounts)
	}
	// Removals first, then what is set: one plugin's removal and a later
	// plugin's setting of the same key are both in the adjustment, and the
	// runtime applies its map in no set order; the guard reads the key as
	// set (a claim too many, never one too few).
	for k := range adj.GetAnnotations() {
		if key, remove := api.IsMarkedForRemoval(k); remove {
			delete(out.Annotations, key)
		}
	}
	for k, v := range adj.GetAnnotations() {
		if _, remove := api.IsMarkedForRemoval(k); remove {
			continue
		}
		if out.Annotations == nil {
			out.Annotations = map[string]string{}
		}
		out.Annotations[k] = v
	}
	if la := adj.GetLinux(); la != nil {
		if out.Linux == nil {
			out.Linux = &api.LinuxContainer{}
		}
		for _, d := range la.GetDevices() {
			path, remove := d.IsMarkedForRemoval()
			out.Linux.Devices = without(out.Linux.Devices, func(have *api.LinuxDevice) bool { return have.GetPath() == path })
			if !remove {
				out.Linux.Devices = append(out.Linux.Devices, d)
			}
		}
		if rules := la.GetResources().GetDevices(); len(rules) > 0 {
			if out.Linux.Resources == nil {
				out.Linux.Resources = &api.LinuxResources{}
			}
			out.Linux.Resources.Devices = append(out.Linux.Resources.Devices, rules...)
		}
	}
	for _, d := range adj.GetCDIDevices() {
		late = append(late, d.GetName())
	}
	if asShown != nil {
		// The same container in all but its env.
		shown = proto.Clone(out).(*api.Container)
		shown.Env = asShown
	}
	return out, late, shown
}

// adjustMounts applies the adjustment's mounts as containerd does: each one
// set or marked for removal takes out the first mount at its destination
// only (a second one there stays), and one set is appended. What NRI showed
// the plugins has every mount at that destination gone; the mounts kept
// here are a superset of those, as a claim too many is safe.
func adjustMounts(mounts, adj []*api.Mount) []*api.Mount {
	for _, m := range adj {
		dest, remove := m.IsMarkedForRemoval()
		mounts = without(mounts, func(have *api.Mount) bool { return have.GetDestination() == dest })
		if !remove {
			mounts = append(mounts, m)
		}
	}
	return mounts
}

// without returns list less the first element match accepts, in a new
// slice. containerd removes a mount or device by key this way, the first
// copy only; for a device set over a duplicated path it then replaces the
// second copy, which is kept here (a claim too many, never one too few).
func without[T any](list []T, match func(T) bool) []T {
	out := make([]T, 0, len(list))
	removed := false
	for _, x := range list {
		if !removed && match(x) {
			removed = true
			continue
		}
		out = append(out, x)
	}
	return out
}

// createdEnv is env with the adjustment's env applied as containerd applies
// it (the generator's AdjustEnv): each key the adjustment names, its last
// entry deciding, replaces the first copy of the key in env, or removes it
// when marked for removal; every later copy is put back with its own value,
// and the runtime keeps the last (set by key, the last write wins), so a
// key env holds twice ends with its last original value. Keys env lacks
// are appended. Entries without "=" are dropped, as containerd drops them.
// The order of what is returned is not containerd's, but its last copy of
// each key holds containerd's value, which is all resolution reads.
func createdEnv(env []string, adj []*api.KeyValue) []string {
	last := make(map[string]*api.KeyValue, len(adj))
	for _, kv := range adj {
		key, _ := kv.IsMarkedForRemoval()
		last[key] = kv
	}
	out := make([]string, 0, len(env)+len(adj))
	for _, e := range env {
		key, _, ok := strings.Cut(e, "=")
		if !ok {
			continue
		}
		kv, named := last[key]
		if !named {
			out = append(out, e)
			continue
		}
		// Only the first copy takes the adjustment; later copies are
		// no longer named and go back in unchanged.
		delete(last, key)
		if _, remove := kv.IsMarkedForRemoval(); !remove {
			out = append(out, kv.ToOCI())
		}
	}
	for _, kv := range adj {
		if _, remove := kv.IsMarkedForRemoval(); remove {
			continue
		}
		if _, pending := last[kv.GetKey()]; pending {
			out = append(out, kv.ToOCI())
		}
	}
	return out
}

// shownEnv is env with the adjustment's env applied over every copy of each
// key: what NRI showed the plugins after the adjusting one.
func shownEnv(env []string, adj []*api.KeyValue) []string {
	out := env
	for _, kv := range adj {
		key, remove := kv.IsMarkedForRemoval()
		next := make([]string, 0, len(out)+1)
		for _, e := range out {
			if k, _, _ := strings.Cut(e, "="); k != key {
				next = append(next, e)
			}
		}
		if !remove {
			next = append(next, kv.ToOCI())
		}
		out = next
	}
	return out
}

// duplicatesTouched reports whether adj sets or removes a key that env holds
// more than once: only then can containerd create a value other than the one
// NRI showed.
func duplicatesTouched(env []string, adj []*api.KeyValue) bool {
	named := make(map[string]int, len(adj))
	for _, kv := range adj {
		key, _ := kv.IsMarkedForRemoval()
		named[key] = 0
	}
	for _, e := range env {
		key, _, ok := strings.Cut(e, "=")
		if !ok {
			continue // containerd drops it
		}
		if n, ok := named[key]; ok {
			if n == 1 {
				return true
			}
			named[key] = n + 1
		}
	}
	return false
}

// adjustsAccess reports whether an adjustment changes anything resolution
// reads (env, mounts, annotations, CDI devices, device nodes, device cgroup
// rules): without such a change the container is the one admission saw.
func adjustsAccess(adj *api.ContainerAdjustment) bool {
	if adj == nil {
		return false
	}
	la := adj.GetLinux()
	return len(adj.GetEnv()) > 0 || len(adj.GetMounts()) > 0 || len(adj.GetAnnotations()) > 0 ||
		len(adj.GetCDIDevices()) > 0 || len(la.GetDevices()) > 0 || len(la.GetResources().GetDevices()) > 0
}
