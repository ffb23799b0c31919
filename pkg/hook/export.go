// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"fmt"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// ReadSpec loads the spec of the container st describes exactly as
// create-runtime does (bounded, regular file only, the fields
// devices.RequestFromSpec and the owner need), for a caller that learns a
// container from the runtime's own state instead of a hook's stdin
// (gpu-guard-ctl recover, pkg/runtimestate): its bundle's config.json, or,
// where st names the bundle "/" (crun 1.8's working directory, recorded
// instead of the bundle for a container with a user namespace and devices),
// crun's own copy in root, the runtime's state root (readRuntimeSpec):
// /config.json is never taken for its spec.
func ReadSpec(root string, st specs.State) (*specs.Spec, error) {
	if !cwdBundle(st.Bundle) {
		if err := checkID(st.ID); err != nil {
			return nil, err
		}
		return readSpec(st)
	}
	spec, err := readRuntimeSpec(root, st.ID)
	if err != nil {
		return nil, fmt.Errorf("the runtime records the bundle %q, which crun 1.8 records instead of the bundle for a container "+
			"with a user namespace and devices (its working directory): /config.json is not its spec, and crun's copy "+
			"in its state directory is read instead: %w", st.Bundle, err)
	}
	return spec, nil
}
