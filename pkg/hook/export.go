// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	specs "github.com/opencontainers/runtime-spec/specs-go"
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
