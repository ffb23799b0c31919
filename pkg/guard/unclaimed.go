// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"context"
	"errors"
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
// that admission would refuse before reading the ledger (it cannot be
// resolved, or asks for GPUs while the inventory is incomplete), or whose
// holdings cannot be read, is an error: the caller refuses the container.
func (g *Guard) Unclaimed(ctx context.Context, r Request) ([]devices.Resolved, error) {
	// The checks before the ledger are admission's own (preDecide): an
	// exemption, a request that cannot be resolved, and "all" or any GPU
	// while the inventory is incomplete, which resolves to no device but
	// reaches every GPU there is.
	d, res, done := g.preDecide(r.Owner, r.Spec)
	if done {
		if d.Result == Reject {
			return nil, errors.New(d.Message)
		}
		return nil, nil // exempt, or no GPU
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
