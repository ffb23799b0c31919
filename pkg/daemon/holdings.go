// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// Holdings is what the observer compares the GPU processes with: a holding
// per claim (HoldingOf) and one per exempt container (container id → the
// runtime's cgroupsPath: a container of a namespace in exempt_namespaces,
// which may use any GPU). The daemon's periodic accounting and
// gpu-guard-ctl ps both build theirs here, so that ps, "the accounting done
// on demand", judges a process as the daemon does.
func Holdings(claims []ledger.Claim, exempt map[string]string) []observe.Holding {
	out := make([]observe.Holding, 0, len(claims)+len(exempt))
	for id, cg := range exempt {
		// With its cgroup, so that a container nested in it is its own
		// too (see HoldingOf).
		out = append(out, observe.Holding{ContainerID: id, AnyDevice: true, CgroupPath: hostCgroup(cg)})
	}
	for _, c := range claims {
		out = append(out, HoldingOf(c))
	}
	return out
}

// HoldingOf is the observer's holding for one claim.
func HoldingOf(c ledger.Claim) observe.Holding {
	h := observe.Holding{DeviceUUID: c.Device.UUID, ContainerID: c.Owner.ContainerID}
	if c.Owner.Namespace != "" || c.Owner.Pod != "" || c.Owner.Container != "" {
		h.Name = guard.HolderName(c.Owner)
	}
	// The observer compares the holder's cgroup with /proc/PID/cgroup paths,
	// and a process below it is the holder's: a container nested in the
	// holder (docker-in-docker) names its own id in its path, and without
	// the holder's cgroup it would read as an intruder (cordoning the GPU
	// under on_intruder = "cordon") and leave Idle blind to it. Owner.Cgroup
	// is the runtime's cgroupsPath, which under the systemd cgroup driver is
	// "slice:prefix:name", not a path: it is turned into the path the host
	// shows, as the liveness check does. One that names no cgroup is left
	// out: the container id still matches the holder's own processes.
	h.CgroupPath = hostCgroup(c.Owner.Cgroup)
	return h
}

// hostCgroup is the path the host shows for a runtime's cgroupsPath (""
// for none, or one that cannot be read).
func hostCgroup(cgroupsPath string) string {
	if cgroupsPath == "" {
		return ""
	}
	p, err := liveness.CgroupPath(cgroupsPath)
	if err != nil {
		return ""
	}
	return p
}
