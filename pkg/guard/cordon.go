// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
)

// Device states kept in the ledger: cordons (a device out of new claims) and
// draining claims (release_requires_idle).
//
// A request for a cordoned device is refused outright, never queued, even
// under on_conflict = "queue": a cordon does not end by itself (an operator
// or a repair lifts it), so a queue position would promise a turn that comes
// at nobody's pace, and a waiting OCI hook would only block its engine until
// its timeout. Kubernetes retries the create anyway; once the cordon is
// lifted the next retry is decided like any other. A waiter queued before the
// cordon keeps its place (it is not refreshed by the refused retries, so it
// leaves after queue_ttl), and the ledger never reserves the device for it.

// ReasonCordoned is the Decision.Reason of a request refused because a device
// it asks for is cordoned.
const ReasonCordoned = "cordoned"

// AuditRefuseCordoned is the reason prefix of the audit record of a request
// refused because of a cordon (operation AuditRefuse).
const AuditRefuseCordoned = "cordoned: "

// ObserverBy is who cordoned a device when the observer did (sources
// intruder and unhealthy).
const ObserverBy = "nri-gpu-guard observer"

// maxCordonReasonLen bounds a cordon's reason: it is kept in the ledger and
// repeated in every refusal.
const maxCordonReasonLen = 512

// CordonDevice takes a GPU or MIG instance (by UUID) out of new claims.
// source is "operator", "intruder" or "unhealthy"; idempotent (a repeat
// updates reason, keeps Since). The holder keeps its claim. Cordons by the
// observer are recorded as by ObserverBy, an operator's as by "operator".
// A cordon never replaces one of a source that ranks higher on the same
// device (operator > unhealthy > intruder, ledger.CordonKept): an
// intruder finding on an unhealthy device, or any finding of the observer
// on an operator's cordon, leaves the cordon in force as it is, and the
// finding is audited and logged; an operator's replaces any, an unhealthy
// device's an intruder's. CordonDeviceInForce tells which happened.
func (g *Guard) CordonDevice(ctx context.Context, uuid, source, reason string) error {
	_, _, err := g.CordonDeviceInForce(ctx, uuid, source, reason)
	return err
}

// CordonDeviceInForce is CordonDevice returning the cordon in force on the
// device once the request is decided, and whether it is another source's
// cordon kept instead of this request's (kept: it ranks higher,
// ledger.CordonKept; the request is then only audited, with the cordon
// kept). With kept false the cordon in force is this request's: written,
// updated, or already there as it asks (a repeat).
//
// It is for a caller that says what it did (the daemon's observer
// policy): a request whose cordon was kept did not cordon the device for
// its finding, and lifting the cordon kept lifts the finding's with it.
func (g *Guard) CordonDeviceInForce(ctx context.Context, uuid, source, reason string) (inForce ledger.Cordon, kept bool, err error) {
	by := ObserverBy
	if source == ledger.CordonOperator {
		by = ledger.CordonOperator
	}
	k, _, kept, err := g.cordon(ctx, uuid, source, reason, by)
	return k, kept, err
}

// Cordon is CordonDevice naming who cordoned the device (gpu-guard-ctl
// records the operator's uid). It returns the cordon in force and whether
// this call changed the ledger: a new cordon, or another source, reason or
// by (never a finding of a source that ranks below the cordon in force,
// which stays: ledger.CordonKept). Unchanged (false) is either a repeat of
// the cordon in force or a request kept out by a higher-ranking one: the
// returned cordon's source tells them apart (CordonDeviceInForce says it).
// Both are decided in the transaction that writes it, so a concurrent
// cordon of the same device cannot make the answer wrong.
func (g *Guard) Cordon(ctx context.Context, uuid, source, reason, by string) (ledger.Cordon, bool, error) {
	k, changed, _, err := g.cordon(ctx, uuid, source, reason, by)
	return k, changed, err
}

// cordon is Cordon, also reporting whether the cordon in force was kept
// instead of this request's (kept: it ranks higher).
func (g *Guard) cordon(ctx context.Context, uuid, source, reason, by string) (k ledger.Cordon, changed, kept bool, err error) {
	dev, err := g.lookup(uuid)
	if err != nil {
		return ledger.Cordon{}, false, false, err
	}
	if !ledger.ValidCordonSource(source) {
		return ledger.Cordon{}, false, false, fmt.Errorf("cordon %s: source %q is not one of operator, intruder, unhealthy", naming.Device(dev), source)
	}
	reason = strings.TrimSpace(reason)
	if len(reason) > maxCordonReasonLen {
		reason = reason[:maxCordonReasonLen] + "…"
	}
	var cerr error
	err = g.update(ctx, "cordon", func(tx *ledger.Tx) bool {
		var prev *ledger.Cordon
		for _, c := range tx.Cordons() {
			if c.Device.UUID == dev.UUID {
				prev = &c
				break
			}
		}
		kept = prev != nil && ledger.CordonKept(prev, source)
		var isNew bool
		k, isNew, cerr = tx.Cordon(dev, source, reason, by)
		changed = isNew || (prev != nil && (prev.Source != k.Source || prev.Reason != k.Reason || prev.By != k.By))
		return cerr == nil
	})
	if err == nil {
		err = cerr
	}
	if err != nil {
		return ledger.Cordon{}, false, false, fmt.Errorf("cordon %s: %w", naming.Device(dev), err)
	}
	if kept {
		// The device is out of new claims already, for a reason that
		// weighs more: an operator's maintenance, or a failure of the
		// device itself. The finding is for whoever lifts the cordon to
		// see (audited with the cordon kept), and must not turn the
		// cordon into one a reboot drops, or into an intruder's whose
		// lifting puts a broken device back into service.
		g.log.Warn("device already cordoned by a source that ranks higher (operator > unhealthy > intruder): that cordon is kept; the observer's finding is audited, not recorded as a cordon",
			slog.String("device", naming.Device(dev)), slog.String("device_uuid", dev.UUID),
			slog.String("source", source), slog.String("reason", reason),
			slog.String("cordon_source", k.Source), slog.String("cordon_by", k.By), slog.String("cordon_reason", k.Reason))
		return k, false, true, nil
	}
	level := slog.LevelInfo
	if changed {
		level = slog.LevelWarn
	}
	g.log.Log(ctx, level, "device cordoned: no new claims until `gpu-guard-ctl uncordon`",
		slog.String("device", naming.Device(dev)), slog.String("device_uuid", dev.UUID),
		slog.String("source", source), slog.String("by", by), slog.String("reason", reason), slog.Bool("changed", changed))
	return k, changed, false, nil
}

// ErrCordonChanged is returned by Uncordon when the cordon in force is not
// the one the caller read: nothing was lifted.
var ErrCordonChanged = errors.New("the cordon changed since it was read")

// Uncordon lifts the cordon on a device and returns it, as the transaction
// that lifted it found it, and whether one was there; the earliest waiter
// whose devices are now all free gets them reserved at once. With seen set (the cordon the caller
// read, and showed or acted on), only that cordon is lifted: when the
// cordon in force differs (another source, reason, by or since: the
// observer cordoned the device again, or another operator did), nothing is
// lifted and the error (ErrCordonChanged) names both, so that a cordon
// nobody looked at is never lifted unseen. A device cordoned by nobody
// (lifted meanwhile) is no error: false.
func (g *Guard) Uncordon(ctx context.Context, uuid, by string, seen *ledger.Cordon) (ledger.Cordon, bool, error) {
	dev, err := g.lookup(uuid)
	if err != nil {
		// A cordon on a device that left the inventory can still be lifted.
		dev = devices.Device{UUID: uuid}
	}
	var (
		lifted  ledger.Cordon
		was     bool
		changed *ledger.Cordon // the cordon in force, when it is not seen
	)
	err = g.update(ctx, "uncordon", func(tx *ledger.Tx) bool {
		lifted, was, changed = ledger.Cordon{}, false, nil
		if seen != nil {
			for _, k := range tx.Cordons() {
				if k.Device.UUID == dev.UUID && !sameCordon(k, *seen) {
					changed = &k
					return false
				}
			}
		}
		lifted, was = tx.Uncordon(dev.UUID, by)
		return was
	})
	if err != nil {
		return ledger.Cordon{}, false, fmt.Errorf("uncordon %s: %w", naming.Device(dev), err)
	}
	if changed != nil {
		return ledger.Cordon{}, false, fmt.Errorf("uncordon %s: %w: it is now %s, not %s; nothing was lifted",
			naming.Device(dev), ErrCordonChanged, cordonWords(changed), cordonWords(seen))
	}
	if was {
		g.log.Info("device uncordoned", slog.String("device", naming.Device(dev)), slog.String("device_uuid", dev.UUID),
			slog.String("by", by), slog.String("source", lifted.Source), slog.String("reason", lifted.Reason))
	}
	return lifted, was, nil
}

// sameCordon reports whether a and b are the same cordon: on the same
// device, with the same source, reason, by and since.
func sameCordon(a, b ledger.Cordon) bool {
	return a.Device.UUID == b.Device.UUID && a.Source == b.Source && a.Reason == b.Reason && a.By == b.By && a.Since.Equal(b.Since)
}

// cordonWords describes a cordon in a sentence: `cordoned unhealthy by
// nri-gpu-guard observer since 2026-03-01T12:00:00Z: "Xid 79"`.
func cordonWords(k *ledger.Cordon) string {
	return fmt.Sprintf("cordoned %s by %s since %s: %q", k.Source, k.By, k.Since.UTC().Format(time.RFC3339), k.Reason)
}

// lookup finds a device of the inventory by UUID.
func (g *Guard) lookup(uuid string) (devices.Device, error) {
	inv := g.Inventory()
	if d, ok := inv.Lookup(uuid); ok {
		return d, nil
	}
	return devices.Device{}, fmt.Errorf("no GPU or MIG instance with UUID %q on this host (GPUs here: %s): %w",
		uuid, inventoryText(inv), ledger.ErrNotFound)
}

// Draining lists the claims kept draining (release_requires_idle).
func (g *Guard) Draining(ctx context.Context) ([]ledger.Claim, error) {
	var out []ledger.Claim
	err := g.ledger.View(ctx, func(tx *ledger.Tx) error {
		out = tx.Draining()
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list draining claims: %w", err)
	}
	return out, nil
}

// FinishDraining releases every draining claim of that container (reason
// goes to log/audit, e.g. "idle" or "idle grace over"). No-op if it has
// none.
func (g *Guard) FinishDraining(ctx context.Context, containerID, reason string) error {
	var rel []ledger.Claim
	err := g.update(ctx, "finish draining", func(tx *ledger.Tx) bool {
		rel = tx.FinishDraining(containerID, reason)
		return len(rel) > 0
	})
	if err != nil {
		return fmt.Errorf("finish draining of container %s: %w", naming.ShortID(containerID), err)
	}
	if len(rel) > 0 {
		g.log.Info("released: drained", append(ownerAttrs(rel[0].Owner, ""), slog.String("reason", reason),
			slog.Any("devices", claimUUIDs(rel)))...)
		g.obs.Released(ReasonDrained, rel)
	}
	return nil
}

// ReasonDrained is the Observer.Released reason of draining claims ended by
// FinishDraining.
const ReasonDrained = "drained"

// requiresIdle reports whether a stopped holder's claims are kept draining
// until its processes leave the GPU ([observe] release_requires_idle).
func (g *Guard) requiresIdle() bool { return g.cfg.Observe.ReleaseRequiresIdle }

// drain marks containerID's claims draining (release_requires_idle) instead
// of releasing them, and ends its conflict records as a release would
// (ledger.Tx.MarkDraining), and logs it.
func (g *Guard) drain(ctx context.Context, o ledger.Owner, reason string) error {
	var kept []ledger.Claim
	err := g.update(ctx, reason, func(tx *ledger.Tx) bool {
		kept = tx.MarkDraining(o.ContainerID, reason)
		return tx.Changed()
	})
	if err == nil && len(kept) > 0 {
		g.log.Info("holder "+reason+"; claim kept draining until its processes leave the GPU",
			append(ownerAttrs(o, ""), slog.Any("devices", claimUUIDs(kept)),
				slog.Duration("idle_grace", g.cfg.Observe.IdleGrace.Duration))...)
	}
	return err
}

// refuseCordoned completes a decision for a request that wants a cordoned
// device: refused, not queued (see above), audited, and the message names
// every cordoned device, its cordon and what to do.
func (g *Guard) refuseCordoned(tx *ledger.Tx, d *Decision, key string, owner ledger.Owner, want []devices.Device,
	cordoned []ledger.CordonedDevice, now time.Time) {
	d.Result, d.Reason, d.Cordoned, d.Audited = Reject, ReasonCordoned, cordoned, true
	tx.Audit(AuditRefuse, ledger.AuditRecord{
		Devices: deviceUUIDs(want), ContainerID: owner.ContainerID, Key: key,
		Namespace: owner.Namespace, Pod: owner.Pod, Container: owner.Container,
		FrontEnd: string(owner.FrontEnd), Reason: AuditRefuseCordoned + cordonAttrs(cordoned),
	})
	d.Message = g.cordonMessage(tx, key, cordoned, now)
}

// CordonRefusal is the decision Admit makes for requester key when the
// cordons in cordoned (from ledger.Tx.CordonsOn, inside tx) cover devices
// of its request res: Reject, reason ReasonCordoned, and Admit's message
// (every cordoned device, its cordon, how to lift it, the free GPUs). It
// writes nothing: it is for a front end that moves claims itself inside tx
// (the OCI hook's ticket hand-over) and audits its refusal with them.
func (g *Guard) CordonRefusal(tx *ledger.Tx, key string, res []devices.Resolved, cordoned []ledger.CordonedDevice) Decision {
	return Decision{Result: Reject, Reason: ReasonCordoned, Devices: res, Cordoned: cordoned,
		Message: g.cordonMessage(tx, key, cordoned, g.now())}
}

func (g *Guard) cordonMessage(tx *ledger.Tx, key string, cordoned []ledger.CordonedDevice, now time.Time) string {
	return cordonText(cordoned, now) + " " + freeText(freeGPUs(tx.State(), g.Inventory(), key))
}

// cordonText says which devices are cordoned, by whom, since when and why,
// and what to do.
func cordonText(cordoned []ledger.CordonedDevice, now time.Time) string {
	var b strings.Builder
	var lift []string
	for i, c := range cordoned {
		if i > 0 {
			b.WriteString("; ")
		}
		k := c.Cordon
		b.WriteString(naming.Device(c.Wanted))
		b.WriteString(" is cordoned")
		if k.Device.UUID != c.Wanted.UUID {
			fmt.Fprintf(&b, " through %s", naming.Device(k.Device))
		}
		fmt.Fprintf(&b, " (%s, by %s) since %s: %s", cordonSourceText(k.Source), k.By, stamp(k.Since, now), reasonOrNone(k.Reason))
		arg := k.Device.Index
		if arg == "" {
			arg = k.Device.UUID
		}
		if !slices.Contains(lift, arg) {
			lift = append(lift, arg)
		}
	}
	fmt.Fprintf(&b, ". Refused and not queued: a cordoned device takes no new claims until an operator lifts the cordon "+
		"(`sudo gpu-guard-ctl uncordon %s`) after checking the device; its holder, if any, keeps it.", strings.Join(lift, " "))
	return b.String()
}

func cordonSourceText(source string) string {
	switch source {
	case ledger.CordonOperator:
		return "by an operator"
	case ledger.CordonIntruder:
		return "a process the ledger does not explain was found on it"
	case ledger.CordonUnhealthy:
		return "unhealthy"
	default:
		return source
	}
}

func reasonOrNone(r string) string {
	if r == "" {
		return "no reason given"
	}
	return r
}

func cordonAttrs(cordoned []ledger.CordonedDevice) string {
	parts := make([]string, 0, len(cordoned))
	for _, c := range cordoned {
		parts = append(parts, fmt.Sprintf("%s cordoned on %s (%s by %s: %s)", c.Wanted.UUID, c.Cordon.Device.UUID,
			c.Cordon.Source, c.Cordon.By, c.Cordon.Reason))
	}
	return strings.Join(parts, "; ")
}

// drainingText is how a refusal describes a draining holder.
func drainingText(o ledger.Owner, now time.Time) string {
	return fmt.Sprintf(" (draining since %s, waiting for its processes to leave the GPU)", stamp(o.DrainingSince, now))
}

// drainPod marks draining the claims of every container of a gone pod
// sandbox (matched like Tx.ReleasePod: by sandbox id, so that the old
// sandbox of a pod the kubelet gave a new one drains nothing of the new
// one's), ends their conflict records as ReleasePod does (a container of
// the pod that holds nothing but is recorded in conflict included), and
// reports whether anything changed.
func (g *Guard) drainPod(tx *ledger.Tx, fe ledger.FrontEnd, podUID, sandboxID string) bool {
	if podUID == "" && sandboxID == "" {
		return false
	}
	st := tx.ReadState()
	var ids []string
	add := func(o ledger.Owner) {
		if ledger.PodMatches(&o, fe, podUID, sandboxID) && !slices.Contains(ids, o.ContainerID) {
			ids = append(ids, o.ContainerID)
		}
	}
	for _, c := range st.Claims {
		add(c.Owner)
	}
	for _, c := range st.Conflicts {
		add(c.Owner)
	}
	for _, id := range ids {
		tx.MarkDraining(id, "pod gone")
	}
	return tx.Changed()
}
