// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"strings"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// NeverClaims reports whether a container making this request cannot hold a
// claim or a queue entry under any configuration and any inventory: an OCI
// hook's poststop then has nothing to release and skips the ledger. It is
// policy (it reasons about every policy at once), so it lives here and not in
// the front end.
//
// It must not answer true for a container whose create-runtime hook could
// have claimed, even if the configuration or the GPU set changed since: a
// claim left behind would hold its GPUs until `gpu-guard-ctl gc`. So it
// resolves the request against no GPU with the strictest policy (every id is
// unknown and fails, "all" claims every GPU, a privileged container claims
// everything), and treats every device node that could be a GPU, a MIG
// capability or an NVIDIA control node as a GPU: the numbers of the
// nvidia-caps and nvidia-uvm majors are assigned at module load, from the
// kernel's dynamic ranges (234-254, 384-511).
func NeverClaims(req devices.Request) bool {
	if req.Privileged || req.GPUNodesAllowed {
		return false
	}
	for _, kv := range req.Env {
		// policy.swarm_resource_envvars names more variables the runtime
		// reads ids from; which ones is configuration, so every name they
		// may have (config.Validate requires the prefix) may claim.
		if strings.HasPrefix(kv, config.SwarmResourcePrefix) {
			return false
		}
	}
	for _, d := range req.Devices {
		if devices.MayBeGPUNode(d) {
			return false
		}
	}
	strict := config.PolicyConfig{
		AllDevices:    config.AllClaim,
		Privileged:    config.PrivilegedAll,
		UnknownDevice: config.UnknownReject,
	}
	res, err := devices.NewResolver(nil, strict).Resolve(req)
	return err == nil && !res.All && len(res.Devices) == 0
}
