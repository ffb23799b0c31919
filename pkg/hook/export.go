// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// ReadSpec loads the bundle's config.json of the container st describes
// exactly as create-runtime does (bounded, regular file only, the fields
// devices.RequestFromSpec and the owner need), for a caller that learns a
// container from the runtime's own state instead of a hook's stdin
// (gpu-guard-ctl recover, pkg/runtimestate).
func ReadSpec(st specs.State) (*specs.Spec, error) {
	if err := checkID(st.ID); err != nil {
		return nil, err
	}
	return readSpec(st)
}

// OwnerFrom is the ledger identity create-runtime records for the container
// st and spec describe, pidStart being its pid's start time: what a claim
// adopted from the runtime's state must look like to be the same holder.
func OwnerFrom(st specs.State, spec *specs.Spec, pidStart uint64) ledger.Owner {
	return ownerFrom(st, spec, pidStart)
}
