// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"context"
	"fmt"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// Unclaimed checks a container as it will be created against what it holds:
// it resolves r (the container with every change the runtime's other
// plugins made after the guard decided) and returns the devices it reaches
// that its container holds no claim for, neither on the device nor, for a
// MIG instance, on its parent GPU. Nothing is written.
//
// The NRI front end asks it when containerd validates the plugins' combined
// adjustments (NRI ≥ 0.10): a plugin with a higher index than the guard's
// can add a GPU device node, an env id or a CDI device after the guard's
// CreateContainer, and the container would reach that GPU without a claim.
// A container of an exempt namespace reaches what it reaches, as at
// admission. A request that resolves to nothing costs no ledger read; one
// that cannot be resolved, or whose holdings cannot be read, is an error:
// the caller refuses the container.
func (g *Guard) Unclaimed(ctx context.Context, r Request) ([]devices.Resolved, error) {
	if g.Exempt(r.Owner.Namespace) && TrustsIdentity(r.FrontEnd) {
		return nil, nil
	}
	res, err := g.Resolve(r.Spec)
	if err != nil {
		return nil, err
	}
	if len(res.Devices) == 0 {
		return nil, nil
	}
	st, err := g.ledger.Snapshot(ctx)
	if err != nil {
		return nil, fmt.Errorf("read the GPU ledger to check what container %s holds: %w", r.Owner.ContainerID, err)
	}
	held := make(map[string]bool)
	for _, c := range st.Claims {
		if c.Owner.ContainerID == r.Owner.ContainerID {
			held[c.Device.UUID] = true
		}
	}
	var out []devices.Resolved
	for _, d := range res.Devices {
		if held[d.UUID] || (d.Kind == devices.KindMIG && d.Parent != "" && held[d.Parent]) {
			continue
		}
		out = append(out, d)
	}
	return out, nil
}
