// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"io"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
)

// Input is the runtime's input to one hook run, read once: the OCI state
// from stdin and the bundle's spec it names, with what could not be read.
type Input struct {
	state    specs.State
	stateErr error
	spec     *specs.Spec
	specErr  error
	// request is what the spec makes reachable; set when spec is.
	request devices.Request
	// never is guard.NeverClaims(request), decided once: a hook binary asks
	// before loading the configuration and create-runtime asks again.
	never bool
}

// ReadInput reads the OCI state from stdin and the spec of its bundle. It
// never fails: what it could not read is kept and reported by the phase,
// which refuses the container (create-runtime) or reads the ledger anyway
// (poststop).
func ReadInput(stdin io.Reader) *Input {
	in := &Input{}
	in.state, in.stateErr = readState(stdin)
	if in.stateErr != nil {
		return in
	}
	in.spec, in.specErr = readSpec(in.state)
	if in.specErr == nil {
		in.request = devices.RequestFromSpec(in.spec)
		in.never = guard.NeverClaims(in.request)
	}
	return in
}

// NeverClaims reports whether both the state and the spec were read and the
// container can reach no GPU under any configuration or inventory
// (guard.NeverClaims): create-runtime admits it and poststop has nothing to
// release, whatever the configuration says, so a hook binary answers it
// before loading the configuration.
func (in *Input) NeverClaims() bool {
	return in.stateErr == nil && in.specErr == nil && in.never
}
