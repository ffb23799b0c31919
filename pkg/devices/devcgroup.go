// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"slices"
	"strings"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/gpuid"
)

// DeviceRule is one device cgroup rule of a container (the OCI spec's
// linux.resources.devices, NRI's LinuxDeviceCgroup). A nil Major or Minor,
// or a negative one, is the wildcard.
type DeviceRule struct {
	Allow  bool
	Type   string // "a", "c", "b" or "" (all)
	Major  *int64
	Minor  *int64
	Access string // "r", "w", "m" combined; "" means rwm
}

// wildcardType reports whether a rule is of type "a" (all devices), which
// runc also makes of a rule without a type. The kernel's device cgroup (and
// runc's emulation of it for cgroup v2) reads nothing else of such a rule:
// "a 1:3 r" allows every device for reading, writing and mknod exactly as
// "a *:* rwm" does (and denies it all, as a deny). Its major, minor and
// access must not be read as narrowing it.
func wildcardType(r DeviceRule) bool { return r.Type == "" || r.Type == "a" }

// AllowsAllDevices reports whether the rules end up allowing every device
// for reading, writing and mknod: what a privileged container gets
// (containerd and podman give it a single "allow all, rwm" rule, an
// unprivileged one "deny all" followed by specific allows). The last rule of
// type "a" decides, as in the kernel's device cgroup, whatever major, minor
// or access it names.
func AllowsAllDevices(rules []DeviceRule) bool {
	all := false
	for _, r := range rules {
		if wildcardType(r) {
			all = r.Allow
		}
	}
	return all
}

// ApplyDeviceRules records on req what the container's device cgroup rules
// let it open, beyond the device nodes its spec lists. A node can reach a
// container other ways than linux.devices (mknod with CAP_MKNOD, a bind
// mount of the host's /dev), and then the device cgroup is what decides
// whether the container can open it. So a rule that lets the container read
// or write a GPU node is a request for that GPU, whether or not the node is
// listed: one for NVIDIA's major with any minor (or for any major) sets
// GPUNodesAllowed, which the resolver treats as privileged device access;
// one for a single GPU minor adds that node to Devices, as if listed.
// Call it after Devices is filled.
//
// Rules for a major of the kernel's dynamic range are kept on req
// (DynamicMajorRules) for the resolver: one of them may be the host's
// nvidia-caps major, and a rule that lets the container open every MIG
// capability node makes its parent GPU nodes reach every MIG instance.
func (req *Request) ApplyDeviceRules(rules []DeviceRule) {
	req.AllDevicesAllowed = AllowsAllDevices(rules)
	all, minors := gpuNodeAccess(rules)
	req.GPUNodesAllowed = all
	req.DynamicMajorRules, req.ManyDynamicMajorRules = nil, false
	for _, r := range rules {
		if r.Type != "c" || r.Major == nil || *r.Major < firstDynamicMajor {
			continue
		}
		if len(req.DynamicMajorRules) == maxDynamicMajorRules {
			req.ManyDynamicMajorRules = true
			break
		}
		req.DynamicMajorRules = append(req.DynamicMajorRules, r)
	}
	for _, m := range minors {
		listed := false
		for _, d := range req.Devices {
			if maj, min, _ := nodeNumbers(d); maj == nvidiaMajor && min == m {
				listed = true
				break
			}
		}
		if !listed {
			req.Devices = append(req.Devices, LinuxDevice{Path: "(device cgroup rule)", Type: "c", Major: nvidiaMajor, Minor: m})
		}
	}
}

// gpuNodeAccess reports whether the rules let the container read or write
// every GPU node (all) or which GPU minors (see ruleAccess).
func gpuNodeAccess(rules []DeviceRule) (all bool, minors []int64) {
	return ruleAccess(rules, nvidiaMajor, gpuid.MaxGPUMinor)
}

// ruleAccess walks the rules in order, the later rule deciding for what it
// covers as in the kernel's device cgroup, and reports whether they let the
// container read or write every character node of major (all) or which of
// its minors up to maxMinor. A rule of type "a" covers every device with
// every access (see wildcardType); one of type "c" covers major when it
// names it or no major. A rule that grants only mknod ("m") opens nothing
// and is no grant; a deny that takes away reading or writing takes the
// grant back.
func ruleAccess(rules []DeviceRule, major, maxMinor int64) (all bool, minors []int64) {
	allowed := map[int64]bool{}
	for _, r := range rules {
		if wildcardType(r) {
			all = r.Allow
			clear(allowed)
			continue
		}
		if r.Type != "c" || (r.Major != nil && *r.Major >= 0 && *r.Major != major) {
			continue
		}
		if r.Access != "" && !strings.ContainsAny(r.Access, "rw") {
			continue
		}
		if r.Minor == nil || *r.Minor < 0 {
			all = r.Allow
			clear(allowed)
			continue
		}
		if m := *r.Minor; m <= maxMinor {
			allowed[m] = r.Allow
		}
	}
	if all {
		return true, nil
	}
	for m, ok := range allowed {
		if ok {
			minors = append(minors, m)
		}
	}
	slices.Sort(minors)
	return false, minors
}

const (
	// firstDynamicMajor is the lowest character major Linux hands out at
	// module load (nvidia-caps and nvidia-uvm get theirs from 234-254 and
	// 384-511).
	firstDynamicMajor = 234
	// maxDynamicMajorRules bounds the rules kept per request.
	maxDynamicMajorRules = 64
)

// maxCapsMinor bounds the capability minors read from rules.
const maxCapsMinor = 1 << 20
