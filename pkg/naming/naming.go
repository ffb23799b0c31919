// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package naming

import (
	"fmt"
	"strings"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// Device names a device for people: "GPU 1 (GPU-…)" or "MIG 1:0 (MIG-…)";
// without an index, "GPU GPU-…".
func Device(d devices.Device) string {
	kind := "GPU"
	if d.Kind == devices.KindMIG {
		kind = "MIG"
	}
	if d.Index == "" {
		return fmt.Sprintf("%s %s", kind, d.UUID)
	}
	return fmt.Sprintf("%s %s (%s)", kind, d.Index, d.UUID)
}

// Devices names devices for people, as Device does, comma-separated.
func Devices(ds []devices.Device) string {
	parts := make([]string, len(ds))
	for i, d := range ds {
		parts[i] = Device(d)
	}
	return strings.Join(parts, ", ")
}

// Container names a container for people: `ns/pod/container (id
// 0123456789ab)` for CRI containers, `name (id 0123456789ab)` or
// `container 0123456789ab` otherwise.
func Container(namespace, pod, container, id string) string {
	switch {
	case namespace != "" || pod != "":
		return fmt.Sprintf("%s/%s/%s (id %s)", orDash(namespace), orDash(pod), orDash(container), ShortID(id))
	case container != "":
		return fmt.Sprintf("%s (id %s)", container, ShortID(id))
	default:
		return "container " + ShortID(id)
	}
}

// ShortID is the 12-character prefix of a container id, as runtimes print it.
func ShortID(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// Holder names a container as Container does when its pod names are
// verified (the NRI front end's: containerd has them from the kubelet). Pod
// names its creator wrote itself (the OCI hook reads them from the spec's
// annotations, which `podman --annotation` sets) come after its id and are
// marked as such, so that a podman container naming itself
// prod/db/main is not taken for that Kubernetes pod by someone deciding
// which holder to release.
func Holder(namespace, pod, container, id string, verified bool) string {
	if verified || (namespace == "" && pod == "") {
		return Container(namespace, pod, container, id)
	}
	return fmt.Sprintf("container %s (%s/%s/%s by its own annotations, unverified)", ShortID(id), orDash(namespace), orDash(pod), orDash(container))
}
