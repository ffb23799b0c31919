// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"strings"
	"unicode"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// TrustsIdentity reports whether the pod identity that front end fe reports
// (namespace, pod name and uid, container name) may decide anything: an
// exemption (policy exempt_namespaces) or the takeover of a stopped
// container's claim by another container of its pod (release_on = "remove").
//
//   - NRI: containerd fills the pod sandbox and container metadata from the
//     kubelet's CRI requests; the container's creator cannot set them through
//     the spec (annotations, labels and env of the container are separate
//     fields the guard never reads identity from).
//   - ctl: gpu-guard-ctl is run by the host's operator, who names the pod on
//     the command line; it only explains (nothing is claimed).
//   - hook: the pod identity comes from annotations of the OCI spec, which
//     whoever creates the container writes (podman --annotation, a bundle's
//     config.json). The runtime that runs the hook has no record of its own
//     that names a pod, so nothing in a hook request is trusted beyond the
//     container id and pid of the runtime's state.
//
// An untrusted identity is still recorded and shown (it helps people find
// the container), but it never exempts, never takes over a claim and never
// forms the requester key.
func TrustsIdentity(fe ledger.FrontEnd) bool {
	return fe == ledger.FrontEndNRI || fe == ledger.FrontEndCtl
}

// Bounds on the container-controlled strings of an owner, applied
// identically to every front end's requests (BoundOwner) so that what a
// container's creator writes cannot bloat the ledger, messages or the
// audit log.
const (
	// MaxLabelLen bounds a pod namespace, name or uid, a container name and a
	// pod sandbox id: Kubernetes names are at most 253 bytes (a DNS
	// subdomain), and uids and sandbox ids are far shorter.
	MaxLabelLen = 253
	// MaxCgroupLen bounds a cgroup path: systemd paths of Kubernetes pods run
	// to about 200 bytes.
	MaxCgroupLen = 4096
)

// BoundLabel drops control characters from a container-controlled name and
// cuts it to MaxLabelLen bytes (on a rune boundary), so that it fits one
// line of a message and a ledger entry of bounded size.
func BoundLabel(v string) string {
	if len(v) <= MaxLabelLen && strings.IndexFunc(v, unicode.IsControl) < 0 {
		return v
	}
	v = strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return -1
		}
		return r
	}, v)
	if len(v) > MaxLabelLen {
		cut := MaxLabelLen
		for cut > 0 && !isRuneStart(v[cut]) {
			cut--
		}
		v = v[:cut]
	}
	return v
}

func isRuneStart(b byte) bool { return b&0xC0 != 0x80 }

// BoundCgroup returns a cgroup path when it is usable as a liveness hint. A
// path that is too long or holds control characters is dropped, not
// shortened: a shortened path would name another cgroup, and the pid still
// tells whether the container runs.
func BoundCgroup(p string) string {
	if len(p) > MaxCgroupLen || strings.IndexFunc(p, unicode.IsControl) >= 0 {
		return ""
	}
	return p
}

// BoundOwner applies BoundLabel and BoundCgroup to every
// container-controlled field of o. The container id is left alone: it is a
// ledger key, and the front ends check it where they read it.
func BoundOwner(o ledger.Owner) ledger.Owner {
	o.Namespace = BoundLabel(o.Namespace)
	o.Pod = BoundLabel(o.Pod)
	o.PodUID = BoundLabel(o.PodUID)
	o.Container = BoundLabel(o.Container)
	o.PodSandboxID = BoundLabel(o.PodSandboxID)
	o.Cgroup = BoundCgroup(o.Cgroup)
	return o
}
