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
// runtime's other plugins' combined adjustment applied, as containerd
// applies it (env, mounts, devices and annotations replaced by key or
// removed where marked for removal, device cgroup rules appended). The CDI
// devices of the adjustment are returned apart: containerd injects them
// only after every plugin has answered, so their device nodes are never
// seen, and they are resolved as such (devices.Request.LateCDIDevices).
// ctr is not modified.
func adjusted(ctr *api.Container, adj *api.ContainerAdjustment) (*api.Container, []string) {
	out := proto.Clone(ctr).(*api.Container)
	if adj == nil {
		return out, nil
	}
	for _, kv := range adj.GetEnv() {
		key, remove := kv.IsMarkedForRemoval()
		env := out.Env[:0:0]
		for _, e := range out.Env {
			if k, _, _ := strings.Cut(e, "="); k != key {
				env = append(env, e)
			}
		}
		if !remove {
			env = append(env, kv.ToOCI())
		}
		out.Env = env
	}
	for _, m := range adj.GetMounts() {
		dest, remove := m.IsMarkedForRemoval()
		mounts := out.Mounts[:0:0]
		for _, have := range out.Mounts {
			if have.GetDestination() != dest {
				mounts = append(mounts, have)
			}
		}
		if !remove {
			mounts = append(mounts, m)
		}
		out.Mounts = mounts
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
			devs := out.Linux.Devices[:0:0]
			for _, have := range out.Linux.Devices {
				if have.GetPath() != path {
					devs = append(devs, have)
				}
			}
			if !remove {
				devs = append(devs, d)
			}
			out.Linux.Devices = devs
		}
		if rules := la.GetResources().GetDevices(); len(rules) > 0 {
			if out.Linux.Resources == nil {
				out.Linux.Resources = &api.LinuxResources{}
			}
			out.Linux.Resources.Devices = append(out.Linux.Resources.Devices, rules...)
		}
	}
	var late []string
	for _, d := range adj.GetCDIDevices() {
		late = append(late, d.GetName())
	}
	return out, late
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
