// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

func (a *app) recoverCommand() *cobra.Command {
	var reset, dryRun, noLiveness bool
	var reason string
	cmd := newCommand("recover",
		"Rebuild a damaged, missing or replaced ledger (root only)",
		`While the ledger is damaged, missing, moved, replaced or rolled back, no GPU
is admitted and status exits non-zero. recover rebuilds it: it replays the
journal onto the last snapshot that verifies (the current one, the previous one
kept at compaction, or the empty start of the journal), moves every damaged or
foreign file aside (kept for the bug report, never deleted), and reports
exactly what it recovered and what, if anything, was lost.

Before writing, every recovered holder is checked out of band, as gc does: a
claim whose holder has exited is released (--no-liveness keeps every claim).
When in doubt a claim is kept.

If the state dir or its files were moved, put them back first. When nothing
can be recovered, --reset starts the ledger empty deliberately (the old files
are moved aside): do that only once no container holds a GPU, or on an NRI
host, where the daemon rebuilds the claims from the runtime at its next sync.`,
		`  sudo gpu-guard-ctl recover --dry-run
  sudo gpu-guard-ctl recover
  sudo gpu-guard-ctl recover --reset --reason "all GPU jobs stopped"`,
		noArgs,
		func(cmd *cobra.Command, _ []string) error {
			if err := a.requireRoot("recover"); err != nil {
				return err
			}
			return a.recoverLedger(cmd.Context(), reset, dryRun, noLiveness, reason)
		})
	cmd.Flags().BoolVar(&reset, "reset", false, "start the ledger empty, moving the old files aside")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "report what would be recovered; change nothing")
	cmd.Flags().BoolVar(&noLiveness, "no-liveness", false, "keep every recovered claim, even of holders that exited")
	cmd.Flags().StringVar(&reason, "reason", "", "why, for the audit log")
	return cmd
}

func (a *app) recoverLedger(ctx context.Context, reset, dryRun, noLiveness bool, reason string) error {
	l, err := a.openLedger(false)
	if err != nil {
		return err
	}
	why := "gpu-guard-ctl recover"
	if reason != "" {
		why += ": " + reason
	}
	var rep ledger.RecoverReport
	if reset {
		if dryRun {
			return fmt.Errorf("--reset and --dry-run: a reset changes everything; run without --reset to see what recover would do")
		}
		rep, err = l.Reset(ctx, why)
	} else {
		opts := ledger.RecoverOptions{Reason: why, DryRun: dryRun}
		if !noLiveness {
			cfg, err := a.config()
			if err != nil {
				return err
			}
			// The one release rule decides, as for gc and status: a holder
			// that never started or is kept until removal stays.
			rule := guard.NewReleaseRule(cfg, a.env.Liveness)
			opts.Alive = func(c ledger.Claim) (bool, error) {
				return !rule.Check(c.Owner).Release(), nil
			}
		}
		rep, err = l.Recover(ctx, opts)
	}
	if err != nil {
		return err
	}
	if a.output == outputJSON {
		return writeJSON(a.env.Stdout, rep)
	}
	var b strings.Builder
	switch {
	case rep.Problem == "":
		fmt.Fprintf(&b, "the ledger is healthy (generation %d): nothing to recover\n", rep.Generation)
	case reset:
		fmt.Fprintf(&b, "the ledger was reset: empty, generation %d, new lineage %s\n", rep.Generation, rep.Lineage)
	default:
		verb := "recovered"
		if dryRun {
			verb = "would recover"
		}
		fmt.Fprintf(&b, "problem: %s\n%s generation %d from %s (%d journal record(s) replayed)\n",
			rep.Problem, verb, rep.RecoveredGeneration, strings.Join(rep.From, " + "), rep.Replayed)
		if rep.Lost != "" {
			fmt.Fprintf(&b, "LOST: %s\n", rep.Lost)
		}
		if rep.NewLineage {
			b.WriteString("the state got a new lineage: an NRI daemon rebuilds from the runtime at its next sync\n")
		}
	}
	for _, c := range rep.Claims {
		fmt.Fprintf(&b, "  holds: %s by %s\n", ledger.DescribeDevice(c.Device), ledger.DescribeOwner(c.Owner))
	}
	for _, c := range rep.Released {
		fmt.Fprintf(&b, "  released (holder exited): %s by %s\n", ledger.DescribeDevice(c.Device), ledger.DescribeOwner(c.Owner))
	}
	if len(rep.Waiters) > 0 {
		fmt.Fprintf(&b, "  %d waiter(s) queued\n", len(rep.Waiters))
	}
	for _, q := range rep.Quarantined {
		fmt.Fprintf(&b, "  moved aside (kept): %s\n", q)
	}
	_, err = fmt.Fprint(a.env.Stdout, b.String())
	return err
}
