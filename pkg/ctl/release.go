// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
)

// maxReasonLen bounds --reason: it goes into every audit record of the
// release and is printed by `audit`.
const maxReasonLen = 512

func (a *app) releaseCommand() *cobra.Command {
	var (
		containerID, device, reason string
		dryRun                      bool
	)
	cmd := newCommand("release (--container ID | --device UUID) --reason TEXT",
		"Force-release a claim (root only, audited)",
		`Release the claims of one container (--container: the full id or a unique
prefix, as status and claims show it), or the claim on one device (--device:
its UUID or index). An index that names more than one claimed device (a claim
on a MIG instance or GPU gone from the inventory keeps an index another device
may have now) is refused, naming each: give the UUID. The reason is required
and is written to the audit log with the released claims and the operator's uid.

Use it when a holder is known to be gone but its claim stayed (the daemon was
down when it stopped), or to clear a claim on a GPU that was removed. A released
GPU is reserved for the head of its queue, if anyone waits for it.

Releasing a claim does not stop the container: if it still runs, it keeps using
the GPU and the next container will share it. Prefer `+"`gc`"+` for holders that exited.

--dry-run shows what would be released and changes nothing (no root needed).`,
		`  sudo gpu-guard-ctl release --container 4f2a9c1be0d3 --reason "node drained, pod force-deleted"
  sudo gpu-guard-ctl release --device GPU-6c1a2f2e-0000-4000-8000-000000000000 --reason "GPU removed"
  gpu-guard-ctl release --device 1 --reason "check" --dry-run`,
		noArgs,
		func(cmd *cobra.Command, _ []string) error {
			if (containerID == "") == (device == "") {
				return usagef("name exactly one of --container ID or --device UUID")
			}
			reason = strings.TrimSpace(reason)
			if reason == "" {
				return usagef("--reason is required: say why the claim is released; it is written to the audit log")
			}
			if len(reason) > maxReasonLen {
				return usagef("--reason is %d bytes long; keep it under %d", len(reason), maxReasonLen)
			}
			if !dryRun {
				if err := a.requireRoot("release"); err != nil {
					return err
				}
			}
			return a.release(cmd.Context(), releaseTarget{containerID: containerID, device: device}, reason, dryRun)
		})
	f := cmd.Flags()
	f.StringVar(&containerID, "container", "", "release every claim of this container (full id or unique prefix)")
	f.StringVar(&device, "device", "", "release the claim on this device (UUID or index)")
	f.StringVar(&reason, "reason", "", "why (required; written to the audit log)")
	f.BoolVar(&dryRun, "dry-run", false, "show what would be released; change nothing")
	return cmd
}

// releaseTarget is what the operator named: one of the two is set.
type releaseTarget struct {
	containerID string
	device      string
}

func (a *app) release(ctx context.Context, target releaseTarget, reason string, dryRun bool) error {
	st, err := a.snapshot(ctx)
	if err != nil {
		return err
	}
	var (
		claims []ledger.Claim
		id     string // the full container id, for --container
		dev    string // the device UUID, for --device
		holder string // the container holding dev when the operator looked
	)
	if target.containerID != "" {
		id, err = matchContainer(st, target.containerID)
		if err != nil {
			return err
		}
		claims = claimsOf(st, id)
	} else {
		c, err := matchDevice(st, target.device)
		if err != nil {
			return err
		}
		dev, holder, claims = c.Device.UUID, c.Owner.ContainerID, []ledger.Claim{c}
	}
	if dryRun {
		return renderReleaseOf(a.env.Stdout, a.output, true, id, claims, conflictsOf(&st, id), a.env.Now())
	}

	auditReason := a.operatorReason(reason)
	var (
		released []ledger.Claim
		cleared  []ledger.Conflict
	)
	err = a.update(ctx, func(tx *ledger.Tx) error {
		if id != "" {
			cleared = conflictsOf(tx.State(), id)
			released = tx.Release(id, auditReason)
			if len(released) == 0 && len(cleared) == 0 {
				return fmt.Errorf("container %s: %w (released by someone else meanwhile?)", id, ledger.ErrNotFound)
			}
			return nil
		}
		if err := sameHolder(tx.State(), dev, holder); err != nil {
			return err
		}
		c, err := tx.ReleaseDevice(dev, auditReason)
		if err != nil {
			return fmt.Errorf("release %s: %w", dev, err)
		}
		released = []ledger.Claim{c}
		return nil
	})
	if err != nil {
		return err
	}
	return renderReleaseOf(a.env.Stdout, a.output, false, id, released, cleared, a.env.Now())
}

// update applies fn in one ledger transaction.
func (a *app) update(ctx context.Context, fn func(tx *ledger.Tx) error) error {
	l, err := a.openLedger(false)
	if err != nil {
		return err
	}
	if err := l.Update(ctx, fn); err != nil {
		return fmt.Errorf("update ledger %s: %w", l.StatePath(), err)
	}
	return nil
}

// operatorReason is the reason recorded in the audit log: the operator's text
// and who ran the command.
func (a *app) operatorReason(reason string) string {
	who := fmt.Sprintf("uid %d", a.env.Getuid())
	if u := a.env.Getenv("SUDO_USER"); u != "" {
		who += ", sudo user " + u
	}
	return fmt.Sprintf("%s (%s via %s)", reason, who, programName)
}

// matchContainer resolves a full container id or a unique prefix of one
// against the containers that hold claims or are recorded in conflicts.
func matchContainer(st ledger.State, want string) (string, error) {
	ids := map[string]bool{}
	for _, c := range st.Claims {
		ids[c.Owner.ContainerID] = true
	}
	for _, c := range st.Conflicts {
		ids[c.Owner.ContainerID] = true
	}
	if ids[want] {
		return want, nil
	}
	var matches []string
	for id := range ids {
		if strings.HasPrefix(id, want) {
			matches = append(matches, id)
		}
	}
	sort.Strings(matches)
	switch len(matches) {
	case 1:
		return matches[0], nil
	case 0:
		return "", fmt.Errorf("no claim is held by container %q: %w (see `%s claims` for the holders)", want, ledger.ErrNotFound, programName)
	default:
		return "", fmt.Errorf("container id prefix %q is ambiguous: it matches %s; give more of the id", want, strings.Join(matches, ", "))
	}
}

// matchDevice finds the claim on a device named by UUID (case-insensitive, as
// the NVIDIA runtime compares them) or index. An index may name more than one
// claimed device: a claim on a MIG instance the inventory no longer has keeps
// its old index, which a new instance may have now (a MIG layout change), and
// a removed GPU's index may be another GPU's. A force-release must not guess
// between them (it could end a live container's claim): such an index is a
// usage error naming every device it matches, and the operator gives the
// UUID.
func matchDevice(st ledger.State, want string) (ledger.Claim, error) {
	var byIndex []ledger.Claim
	for _, c := range st.Claims {
		if strings.EqualFold(c.Device.UUID, want) {
			return c, nil // a UUID names one device, and a device has one claim
		}
		if c.Device.Index == want {
			byIndex = append(byIndex, c)
		}
	}
	switch len(byIndex) {
	case 0:
		return ledger.Claim{}, fmt.Errorf("no claim on device %q: %w (see `%s claims`)", want, ledger.ErrNotFound, programName)
	case 1:
		return byIndex[0], nil
	}
	held := make([]string, len(byIndex))
	for i, c := range byIndex {
		held[i] = fmt.Sprintf("%s held by %s", naming.Device(c.Device), guard.HolderName(c.Owner))
	}
	return ledger.Claim{}, usagef("device index %q names %d claimed devices: %s; give the UUID of the one to release (--device UUID)",
		want, len(byIndex), strings.Join(held, "; "))
}

// sameHolder refuses to release dev when it changed hands since the operator
// looked: a force-release must never end a claim nobody has seen.
func sameHolder(st *ledger.State, dev, holder string) error {
	for _, c := range st.Claims {
		if c.Device.UUID == dev && c.Owner.ContainerID != holder {
			return fmt.Errorf("%s changed hands: it is now held by %s, not %s; check `%s status` and run release again",
				naming.Device(c.Device), guard.HolderName(c.Owner), naming.ShortID(holder), programName)
		}
	}
	return nil
}

func claimsOf(st ledger.State, id string) []ledger.Claim {
	var out []ledger.Claim
	for _, c := range st.Claims {
		if c.Owner.ContainerID == id {
			out = append(out, c)
		}
	}
	return out
}

// conflictsOf lists the conflict records of container id ("" = none): what
// a release of the container clears besides its claims.
func conflictsOf(st *ledger.State, id string) []ledger.Conflict {
	var out []ledger.Conflict
	for _, c := range st.Conflicts {
		if id != "" && c.Owner.ContainerID == id {
			out = append(out, c)
		}
	}
	return out
}

// renderReleaseOf is the output of release: the claims released and the
// conflict records of the container cleared (or, for a dry run, that would
// be).
func renderReleaseOf(w io.Writer, output string, dryRun bool, id string, claims []ledger.Claim, cleared []ledger.Conflict, now time.Time) error {
	if output == outputJSON {
		v := releasedView{DryRun: dryRun, Released: make([]releasedJSON, 0, len(claims))}
		for _, c := range claims {
			v.Released = append(v.Released, releasedJSON{claimJSON: claimView(c)})
		}
		for _, c := range cleared {
			v.ConflictsCleared = append(v.ConflictsCleared, clearedJSON{Device: c.Device.UUID, Index: c.Device.Index, ContainerID: c.Owner.ContainerID})
		}
		return writeJSON(w, v)
	}
	if len(claims) > 0 || len(cleared) == 0 {
		if err := renderReleased(w, output, dryRun, claims, now); err != nil {
			return err
		}
	}
	if len(cleared) == 0 {
		return nil
	}
	verb := "cleared"
	if dryRun {
		verb = "would clear"
	}
	devs := make([]string, len(cleared))
	for i, c := range cleared {
		devs[i] = naming.Device(c.Device)
	}
	line := fmt.Sprintf("%s the conflict record(s) of container %s on %s (it was found using them while another container held them; "+
		"check that it no longer runs there)", verb, id, strings.Join(devs, ", "))
	if _, err := fmt.Fprintln(w, escapeLine(line)); err != nil {
		return fmt.Errorf("write output: %w", err)
	}
	return nil
}

// releasedView is the output of release and gc; its JSON is a public interface.
type releasedView struct {
	DryRun   bool           `json:"dry_run"`
	Released []releasedJSON `json:"released"`
	// Draining (gc under release_requires_idle): claims of exited holders
	// kept draining instead of released.
	Draining []releasedJSON `json:"draining,omitempty"`
	// ConflictsCleared (release --container): the container's conflict
	// records cleared with its claims.
	ConflictsCleared []clearedJSON `json:"conflicts_cleared,omitempty"`
}

// clearedJSON is one conflict record a release cleared.
type clearedJSON struct {
	Device      string `json:"device"`
	Index       string `json:"index"`
	ContainerID string `json:"container_id"`
}

type releasedJSON struct {
	claimJSON
	// Why is set by gc: the liveness finding that the holder exited.
	Why string `json:"why,omitempty"`
}

// renderReleased prints the claims released (or, for a dry run, that would
// be).
func renderReleased(w io.Writer, output string, dryRun bool, claims []ledger.Claim, now time.Time) error {
	return renderReleasedDraining(w, output, dryRun, claims, nil, nil, now)
}

// renderReleasedDraining is renderReleased, with the claims kept draining
// (or, for a dry run, that would be); why, when set, gives gc's finding for
// each claim.
func renderReleasedDraining(w io.Writer, output string, dryRun bool, claims, draining []ledger.Claim, why func(ledger.Claim) string, now time.Time) error {
	if why == nil {
		why = func(ledger.Claim) string { return "" }
	}
	if output == outputJSON {
		v := releasedView{DryRun: dryRun, Released: make([]releasedJSON, 0, len(claims))}
		for _, c := range claims {
			v.Released = append(v.Released, releasedJSON{claimJSON: claimView(c), Why: why(c)})
		}
		for _, c := range draining {
			v.Draining = append(v.Draining, releasedJSON{claimJSON: claimView(c), Why: why(c)})
		}
		return writeJSON(w, v)
	}
	for _, c := range draining {
		verb := "kept draining"
		if dryRun {
			verb = "would keep draining"
		}
		line := fmt.Sprintf("%s %s held by %s: %s; released once its processes leave the GPU (release_requires_idle)",
			verb, naming.Device(c.Device), guard.HolderName(c.Owner), why(c))
		if _, err := fmt.Fprintln(w, escapeLine(line)); err != nil {
			return fmt.Errorf("write output: %w", err)
		}
	}
	verb := "released"
	if dryRun {
		verb = "would release"
	}
	if len(claims) == 0 && len(draining) > 0 {
		return nil
	}
	if len(claims) == 0 {
		if _, err := fmt.Fprintf(w, "nothing to release\n"); err != nil {
			return fmt.Errorf("write output: %w", err)
		}
		return nil
	}
	for _, c := range claims {
		line := fmt.Sprintf("%s %s held by %s for %s", verb, naming.Device(c.Device), guard.HolderName(c.Owner), since(now, c.Since))
		if r := why(c); r != "" {
			line += ": " + r
		}
		if _, err := fmt.Fprintln(w, escapeLine(line)); err != nil {
			return fmt.Errorf("write output: %w", err)
		}
	}
	return nil
}
