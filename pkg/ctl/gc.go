// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"slices"

	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

func (a *app) gcCommand() *cobra.Command {
	var dryRun bool
	cmd := newCommand("gc",
		"Release the claims of holders whose processes are gone (root only)",
		`Check every holder out of band and release the claims of those that have
exited: a started holder whose cgroup has no processes left, or whose pid is
gone (or reused) when no cgroup is known. This is the check the daemon runs
before refusing a request; gc runs it for every claim, e.g. after the daemon was
down while containers stopped.

This is the rule the daemon applies, with the configured release_on: a holder
that was created but never started has no process yet and keeps its claim, and
under release_on = "remove" an exited holder keeps its claim until its
container is removed (use release to end it sooner); an OCI hook holder
counts as removed once no runtime state root ([hook] runtime_roots) lists
its container (a create that failed after the hook admitted it gets no
poststop), and one whose removal cannot be told (a root that cannot be read)
is kept and reported on stderr; under [observe]
release_requires_idle = true an exited holder's claim is kept draining (until
the GPU shows its processes gone, or idle_grace) instead of released. A
gpu-guard-ctl run ticket whose process is gone is released whatever
release_on and release_requires_idle say. When in doubt (unreadable cgroup,
unknown layout) a claim is kept.
Every release is audited with the finding. gc also removes the OCI hook's
container markers (in `+hook.DefaultMarkerDir+`) of containers the ledger no
longer shows: those whose poststop never ran.

--dry-run lists what would be released and changes nothing (it does not
demand root, but reading the ledger needs it: run it with sudo).`,
		`  sudo gpu-guard-ctl gc --dry-run
  sudo gpu-guard-ctl gc
  sudo gpu-guard-ctl gc -o json`,
		noArgs,
		func(cmd *cobra.Command, _ []string) error {
			if !dryRun {
				if err := a.requireRoot("gc"); err != nil {
					return err
				}
			}
			return a.gc(cmd.Context(), dryRun)
		})
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "list the claims that would be released; change nothing")
	return cmd
}

func (a *app) gc(ctx context.Context, dryRun bool) error {
	cfg, err := a.config()
	if err != nil {
		return err
	}
	rule := guard.NewReleaseRule(cfg, a.env.Liveness)
	st, err := a.snapshot(ctx)
	if err != nil {
		return err
	}
	// Liveness reads cgroupfs and procfs: do it before taking the lock, so the
	// daemon is not kept waiting on that I/O. A container id names one
	// container only within one runtime root or namespace, so every
	// incarnation (every recorded process) of an id is checked on its own.
	var found []gcFinding
	var unsure []string
	seen := map[incarnation]bool{}
	for _, c := range st.Claims {
		k := incarnationOf(&c.Owner)
		if seen[k] {
			continue
		}
		seen[k] = true
		// The rule the guard applies: a holder kept by policy (release_on
		// = "remove", or never started) is not a leak.
		switch v := rule.Check(c.Owner); {
		case v.Release() || v.Action == guard.MarkDraining:
			found = append(found, gcFinding{owner: c.Owner, why: "holder exited: " + v.Why, drain: v.Action == guard.MarkDraining})
		case v.Unsure != "":
			// Kept on doubt, and nothing else will end it: say so, as
			// status does.
			unsure = append(unsure, fmt.Sprintf("%s: gc: kept the claims of %s: it exited and keeps them until its container "+
				"is removed (release_on = \"remove\"), but whether it was removed cannot be told: %s; if its engine no longer "+
				"lists it, run `sudo %s release --container %s --reason \"container removed\"`",
				programName, guard.HolderName(c.Owner), v.Unsure, programName, c.Owner.ContainerID))
		}
	}
	for _, line := range unsure {
		fmt.Fprintln(a.env.Stderr, escapeLine(line))
	}
	why := map[string]string{} // by device UUID: the finding of the claim's incarnation
	whyOf := func(c ledger.Claim) string { return why[c.Device.UUID] }
	if dryRun {
		// Exactly the claims that the real run's ReleaseIncarnation and
		// MarkDrainingIncarnation take for the findings, in that order.
		var claims, draining []ledger.Claim
		for _, c := range st.Claims {
			i := slices.IndexFunc(found, func(f gcFinding) bool { return ledger.SameRecordedProcess(&c.Owner, &f.owner) })
			if i < 0 {
				continue
			}
			why[c.Device.UUID] = found[i].why
			if found[i].drain {
				draining = append(draining, c)
			} else {
				claims = append(claims, c)
			}
		}
		return renderReleasedDraining(a.env.Stdout, a.output, true, claims, draining, whyOf, a.env.Now())
	}
	var released, draining []ledger.Claim
	if len(found) > 0 {
		err = a.update(ctx, func(tx *ledger.Tx) error {
			released, draining = nil, nil // fn may be retried; start over each time
			clear(why)
			for _, f := range found {
				if !sameIncarnation(tx.State(), f.owner) {
					// It started again (new pid) or was released since the
					// check: the finding no longer applies.
					continue
				}
				var got []ledger.Claim
				if f.drain {
					// What the guard does with the same finding: only the
					// GPU can tell that the processes left it.
					got = tx.MarkDrainingIncarnation(f.owner, f.why+" (gc via "+programName+")")
				} else {
					got = tx.ReleaseIncarnation(f.owner, f.why+" (gc via "+programName+")")
				}
				for _, c := range got {
					if _, dup := why[c.Device.UUID]; dup {
						continue // reported once, should two findings ever end the same claim
					}
					why[c.Device.UUID] = f.why
					if f.drain {
						draining = append(draining, c)
					} else {
						released = append(released, c)
					}
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	a.sweepHookMarkers(ctx)
	return renderReleasedDraining(a.env.Stdout, a.output, false, released, draining, whyOf, a.env.Now())
}

// sweepHookMarkers removes the container markers of the OCI hook (see
// hook.SweepMarkers) that this ledger does not explain: those of containers
// whose poststop never ran. They cost no more than a ledger read each, so a
// failure is a note on stderr, not gc's error.
func (a *app) sweepHookMarkers(ctx context.Context) {
	dir, err := a.stateDir()
	if err != nil {
		return
	}
	if _, err := hook.SweepMarkers(ctx, "", dir, a.snapshot); err != nil && !errors.Is(err, fs.ErrPermission) {
		fmt.Fprintf(a.env.Stderr, "%s: gc: the hook's container markers: %v\n", programName, err)
	}
}

// incarnation is the identity of one process of a container: a container id
// is unique only within one runtime root or namespace, and two containers of
// one id are told apart by the process recorded for each.
type incarnation struct {
	containerID string
	pid         int
	pidStart    uint64
	cgroup      string
}

func incarnationOf(o *ledger.Owner) incarnation {
	return incarnation{containerID: o.ContainerID, pid: o.Pid, pidStart: o.PidStart, cgroup: o.Cgroup}
}

// memoCheck is rule.Check asked once per incarnation: a holder of several
// devices is one process to look at, not one per device.
func memoCheck(rule guard.ReleaseRule) func(ledger.Owner) guard.Verdict {
	seen := map[incarnation]guard.Verdict{}
	return func(o ledger.Owner) guard.Verdict {
		k := incarnationOf(&o)
		v, ok := seen[k]
		if !ok {
			v = rule.Check(o)
			seen[k] = v
		}
		return v
	}
}

// gcFinding is gc's liveness finding for one incarnation found exited.
type gcFinding struct {
	owner ledger.Owner // as checked
	why   string
	drain bool // release_requires_idle: kept draining, not released
}

// sameIncarnation reports whether a claim is still held with the process
// identity that was found exited (container id, pid, pid start time and
// cgroup): not when that container started again (a new pid) or its claims
// were released since, whatever another incarnation of the same id holds.
func sameIncarnation(st *ledger.State, checked ledger.Owner) bool {
	want := incarnationOf(&checked)
	return slices.ContainsFunc(st.Claims, func(c ledger.Claim) bool { return incarnationOf(&c.Owner) == want })
}
