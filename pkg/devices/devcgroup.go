// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import "strings"

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

// AllowsAllDevices reports whether the rules end up allowing every device
// for reading, writing and mknod: what a privileged container gets
// (containerd and podman give it a single "allow all, rwm" rule, an
// unprivileged one "deny all" followed by specific allows). The last
// wildcard rule decides, as in the kernel's device cgroup.
func AllowsAllDevices(rules []DeviceRule) bool {
	all := false
	for _, r := range rules {
		wildcardType := r.Type == "" || r.Type == "a"
		anyMajor := r.Major == nil || *r.Major < 0
		anyMinor := r.Minor == nil || *r.Minor < 0
		if !wildcardType || !anyMajor || !anyMinor {
			continue
		}
		all = r.Allow && (r.Access == "" ||
			(strings.ContainsRune(r.Access, 'r') && strings.ContainsRune(r.Access, 'w') && strings.ContainsRune(r.Access, 'm')))
	}
	return all
}
