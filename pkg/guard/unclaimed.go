// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
)

// ReasonUnclaimed is the reason of a Validate refusal: the container, as it
// will be created, reaches a GPU it holds no claim for.
const ReasonUnclaimed = "unclaimed"

// ValidateOptions say how Validate may decide.
type ValidateOptions struct {
	// After names what changed the container since admission, for the
	// refusal's message ("an NRI plugin that runs after nri-gpu-guard
	// (95-injector)").
	After string
	// WithoutLedger: the ledger's holders are not to be trusted now (the
	// plugin is rebuilding them): a container that reaches a GPU returns
	// ErrNeedsClaims without reading the ledger.
	WithoutLedger bool
	// ExemptAtAdmission: admission granted (and audited) this container
	// an exemption already; it is not audited again.
	ExemptAtAdmission bool
}

// Validate checks a container as it will be created against what it holds:
// r is the container with every change the runtime's other plugins made
// after the guard decided. It returns Admit when every device it reaches is
// claimed by its container (on the device or, for a MIG instance, on its
// parent GPU); Skip when it reaches none, or its namespace is exempt; and
// Reject (ReasonUnclaimed, the devices it would reach unclaimed) otherwise,
// or with admission's own refusal of what is decided before the ledger (an
// unresolvable request, "all" while the inventory is incomplete). Nothing
// is claimed; refusals and exemptions are audited as at admission, an
// exemption granted only once its record is on disk. An error is a
// decision that could not be made: the caller refuses.
//
// The NRI front end asks it when containerd validates the plugins' combined
// adjustments (NRI ≥ 0.10): a plugin with a higher index than the guard's
// can add a GPU device node, an env id or a CDI device after the guard's
// CreateContainer, and the container would reach that GPU without a claim.
// A request that resolves to nothing costs no ledger read.
func (g *Guard) Validate(ctx context.Context, r Request, opts ValidateOptions) (Decision, error) {
	start := time.Now()
	owner, key := r.identity()
	d, res, done := g.preDecide(owner, r.Spec)
	if done {
		switch {
		case d.Reason == reasonExempt && !opts.ExemptAtAdmission:
			// Admission saw no GPU (no exemption then): the exemption is
			// granted here, and audited first.
			if err := g.auditExempt(ctx, owner, key, d, res); err != nil {
				return Decision{}, g.ledgerError(owner, fmt.Errorf("namespace %s is exempt (policy exempt_namespaces), but an exemption "+
					"is granted only once its audit record is on disk: %w", owner.Namespace, err))
			}
		case d.Result == Reject:
			d.Message = "as the NRI plugins' adjustments leave it: " + d.Message
			g.auditValidation(ctx, owner, key, d)
			g.finish(d, owner, key, start, false)
		}
		return d, nil
	}
	if opts.WithoutLedger {
		return Decision{}, ErrNeedsClaims
	}
	claims, err := g.ledger.ClaimsOf(ctx, owner.ContainerID)
	if err != nil {
		return Decision{}, g.ledgerError(owner, fmt.Errorf("read the GPU ledger to check what container %s holds: %w", naming.ShortID(owner.ContainerID), err))
	}
	held := make(map[string]bool)
	for _, c := range claims {
		if c.Owner.FrontEnd == owner.FrontEnd {
			held[c.Device.UUID] = true
		}
	}
	var unclaimed []devices.Resolved
	for _, rd := range res.Devices {
		if held[rd.UUID] || (rd.Kind == devices.KindMIG && rd.Parent != "" && held[rd.Parent]) {
			continue
		}
		unclaimed = append(unclaimed, rd)
	}
	if len(unclaimed) == 0 {
		return Decision{Result: Admit, Reason: "claimed", Devices: res.Devices}, nil
	}
	parts := make([]string, len(unclaimed))
	for i, rd := range unclaimed {
		parts[i] = naming.Device(rd.Device) + " (" + strings.Join(rd.Sources, ", ") + ")"
	}
	after := opts.After
	if after == "" {
		after = "a change after the guard's check"
	}
	d = Decision{Result: Reject, Reason: ReasonUnclaimed, Devices: unclaimed, Message: fmt.Sprintf(
		"%s gave it %s, which nri-gpu-guard did not check or claim (or its claim is gone since); request the GPU in the "+
			"container's spec (NVIDIA_VISIBLE_DEVICES, CDI), or give nri-gpu-guard a plugin index above every plugin that adds devices",
		after, strings.Join(parts, "; "))}
	g.auditValidation(ctx, owner, key, d)
	g.finish(d, owner, key, start, false)
	return d, nil
}

// auditValidation records a refusal at validation, best effort (the
// container is refused whether or not the record is written): the audit log
// says who was turned away and why, as for any refusal that is not queued.
func (g *Guard) auditValidation(ctx context.Context, owner ledger.Owner, key string, d Decision) {
	err := g.ledger.AppendAudit(ctx, ledger.AuditRecord{
		Op: AuditRefuse, Devices: resolvedUUIDs(d.Devices), ContainerID: owner.ContainerID, Key: key,
		Namespace: owner.Namespace, Pod: owner.Pod, Container: owner.Container,
		FrontEnd: string(owner.FrontEnd), Reason: "validation of the NRI plugins' adjustments: " + d.Message,
	})
	if err != nil && !errors.Is(err, context.Canceled) {
		g.log.Warn("a refusal at validation could not be audited", append(ownerAttrs(owner, key), "error", err)...)
	}
}
