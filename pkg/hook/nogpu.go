// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
)

// neverClaims reports whether a container with this spec cannot hold a claim
// or a queue entry under any configuration (guard.NeverClaims): its poststop
// then has nothing to release and skips the ledger.
func neverClaims(spec *specs.Spec) bool {
	return guard.NeverClaims(devices.RequestFromSpec(spec))
}
