// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"fmt"
	"path"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// capSysAdmin marks a privileged container: it is what the NVIDIA runtime
// itself checks, and a container holding it can create device nodes and open
// every GPU whatever its device list says.
const capSysAdmin = "CAP_SYS_ADMIN"

// RequestFromSpec extracts from an OCI runtime spec everything that can make
// a GPU reachable: process env, mount destinations, annotations, linux
// devices, and privileged (CAP_SYS_ADMIN in the bounding set). A spec
// without a capabilities object (or without a process) may hold
// CAP_SYS_ADMIN all the same (SysAdmin): recent runc leaves such a
// container the capabilities it runs with, root's, while runc 1.1 and crun
// drop them all, and which runs it cannot be told from the spec. A nil
// spec or nil sections yield an otherwise empty request. The request
// shares no memory with spec's device list.
func RequestFromSpec(spec *specs.Spec) Request {
	var req Request
	if spec == nil {
		return req
	}
	req.Annotations = spec.Annotations
	req.SysAdmin = true
	if p := spec.Process; p != nil {
		req.Env = p.Env
		if c := p.Capabilities; c != nil {
			req.SysAdmin = false
			for _, cp := range c.Bounding {
				if cp == capSysAdmin {
					req.Privileged = true
					break
				}
			}
		}
	}
	if l := spec.Linux; l != nil && len(l.Devices) > 0 {
		req.Devices = make([]LinuxDevice, len(l.Devices))
		for i, d := range l.Devices {
			req.Devices[i] = LinuxDevice{Path: d.Path, Type: d.Type, Major: d.Major, Minor: d.Minor}
		}
	}
	if len(spec.Mounts) > 0 {
		req.Mounts = make([]string, len(spec.Mounts))
		for i, m := range spec.Mounts {
			req.Mounts[i] = m.Destination
			req.AddMount(m.Type, m.Source, m.Destination)
		}
	}
	if l := spec.Linux; l != nil && l.Resources != nil {
		rules := make([]DeviceRule, len(l.Resources.Devices))
		for i, r := range l.Resources.Devices {
			rules[i] = DeviceRule{Allow: r.Allow, Type: r.Type, Major: r.Major, Minor: r.Minor, Access: r.Access}
		}
		req.ApplyDeviceRules(rules)
	}
	return req
}

// AddMount records what a mount of type mountType, from host path source,
// brings into the container. A bind of a host NVIDIA device node
// (/dev/nvidia<N>, a capability node) is a device of the container, as if
// listed in linux.devices, by the host node's name (rootless podman turns
// `--device /dev/nvidia0` into such a bind mount, and there is no device
// cgroup to stop it being opened); a bind of the host's whole /dev sets
// HostDevMounted, and so does a devtmpfs mounted afresh (type "devtmpfs",
// whatever its source: the kernel's one devtmpfs, which the runtime mounts
// before it drops its privileges). Other sources bring no device. Sources
// are read by their spelling. An overlay's layers (OverlayLayers) are not
// read here: their nodes open only where the overlay is mounted from the
// initial user namespace and no device cgroup applies, which the OCI hook
// tells and reads them for. Both front ends call it for every mount
// (RequestFromSpec does).
func (req *Request) AddMount(mountType, source, destination string) {
	if mountType == "devtmpfs" {
		req.HostDevMounted = true
		return
	}
	req.addSource(source, destination)
}

// maxOverlayLayers bounds the layers OverlayLayers returns: the kernel
// takes at most 500 lower layers.
const maxOverlayLayers = 512

// OverlayLayers returns the host directories an overlay mount's options name
// as its layers (lowerdir, a list joined by ':', lowerdir+ and datadir+ of
// newer kernels, and upperdir), each once: device nodes in a layer open
// through the overlay as they do through a bind. opaque is set when what
// the kernel will take cannot be told from them: an escaped character (the
// kernel reads "\," and "\:" as part of a path, and the runtime joins the
// options with ','), a relative layer (resolved from the runtime's working
// directory), or more layers than maxOverlayLayers.
func OverlayLayers(options []string) (layers []string, opaque bool) {
	seen := map[string]bool{}
	add := func(l string) {
		switch {
		case l == "" || l[0] != '/':
			opaque = true
		case !seen[l]:
			if len(layers) == maxOverlayLayers {
				opaque = true
				return
			}
			seen[l] = true
			layers = append(layers, l)
		}
	}
	for _, o := range options {
		if strings.Contains(o, "\\") {
			opaque = true
		}
		// The options of a spec mount are one each, or one string joined
		// by ',' (as mount(8) takes them).
		for _, kv := range strings.Split(o, ",") {
			k, v, ok := strings.Cut(kv, "=")
			if !ok {
				continue
			}
			switch k {
			case "lowerdir":
				for _, l := range strings.Split(v, ":") {
					add(l)
				}
			case "lowerdir+", "datadir+", "upperdir":
				add(v)
			}
		}
	}
	return layers, opaque
}

func (req *Request) addSource(source, destination string) {
	if source == "" || source[0] != '/' {
		return
	}
	src := path.Clean(source)
	switch {
	case src == "/dev" || src == "/":
		// The host's /dev, or a tree that holds it (`-v /:/host`).
		req.HostDevMounted = true
	case src == "/proc" || strings.HasPrefix(src, "/proc/"):
		// The runtime resolves /proc/self/root/dev (and any process's
		// root, cwd or fd link) to what that process sees: the host's
		// /dev among it. A bind of /proc itself shows every such link.
		req.HostDevMounted = true
	case strings.HasPrefix(src, "/dev/nvidia"):
		req.Devices = append(req.Devices, LinuxDevice{Path: src, BoundAt: destination})
	case strings.HasPrefix(src, "/dev/char/"):
		// udev's links by number (/dev/char/195:0), which the runtime
		// follows: the node of those numbers.
		var major, minor int64
		if n, err := fmt.Sscanf(strings.TrimPrefix(src, "/dev/char/"), "%d:%d", &major, &minor); err == nil && n == 2 {
			req.Devices = append(req.Devices, LinuxDevice{Path: src, Type: "c", Major: major, Minor: minor, BoundAt: destination})
		}
	}
}
