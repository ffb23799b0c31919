// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"maps"
	"slices"

	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
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
container is removed (use release to end it sooner); under [observe]
release_requires_idle = true an exited holder's claim is kept draining (until
the GPU shows its processes gone, or idle_grace) instead of released. When in
doubt (unreadable cgroup, unknown layout) a claim is kept.
Every release is audited with the finding.

--dry-run lists what would be released and changes nothing (no root needed).`,
		`  gpu-guard-ctl gc --dry-run
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
	// daemon is not kept waiting on that I/O.
	exited := map[string]ledger.Owner{}
	drain := map[string]bool{} // release_requires_idle: kept draining, not released
	why := map[string]string{}
	for _, c := range st.Claims {
		id := c.Owner.ContainerID
		if _, seen := why[id]; seen {
			continue
		}
		why[id] = ""
		// The rule the guard applies: a holder kept by policy (release_on
		// = "remove", or never started) is not a leak.
		if v := rule.Check(c.Owner); v.Release() || v.Action == guard.MarkDraining {
			exited[id] = c.Owner
			why[id] = "holder exited: " + v.Why
			drain[id] = v.Action == guard.MarkDraining
		}
	}
	if dryRun {
		var claims, draining []ledger.Claim
		for _, c := range st.Claims {
			if _, ok := exited[c.Owner.ContainerID]; ok && drain[c.Owner.ContainerID] {
				draining = append(draining, c)
			} else if ok {
				claims = append(claims, c)
			}
		}
		return renderReleasedDraining(a.env.Stdout, a.output, true, claims, draining, why, a.env.Now())
	}
	var released, draining []ledger.Claim
	if len(exited) > 0 {
		err = a.update(ctx, func(tx *ledger.Tx) error {
			released, draining = nil, nil // fn may be retried; start over each time
			for _, id := range slices.Sorted(maps.Keys(exited)) {
				if !sameIncarnation(tx.State(), id, exited[id]) {
					// It started again (new pid) or was released since the
					// check: the finding no longer applies.
					continue
				}
				if drain[id] {
					// What the guard does with the same finding: only the
					// GPU can tell that the processes left it.
					draining = append(draining, tx.MarkDrainingIncarnation(exited[id], why[id]+" (gc via "+programName+")")...)
					continue
				}
				released = append(released, tx.ReleaseIncarnation(exited[id], why[id]+" (gc via "+programName+")")...)
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	return renderReleasedDraining(a.env.Stdout, a.output, false, released, draining, why, a.env.Now())
}

// sameIncarnation reports whether container id still holds a claim with the
// process identity that was found exited.
func sameIncarnation(st *ledger.State, id string, checked ledger.Owner) bool {
	for _, c := range st.Claims {
		if c.Owner.ContainerID == id {
			return c.Owner.Pid == checked.Pid && c.Owner.PidStart == checked.PidStart && c.Owner.Cgroup == checked.Cgroup
		}
	}
	return false
}
