// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/runtimescan"
)

func (a *app) recoverCommand() *cobra.Command {
	var reset, force, dryRun, noLiveness, noRuntime bool
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

The OCI runtimes' own state is checked too ([hook] runtime_roots: runc's and
crun's state dirs; podman uses runc's): a claim of a container a runtime
still runs is never released, a running container that reaches a GPU without
a claim (admitted in commits that were lost) adopts it back, and a running
container on a GPU another holds is recorded as a conflict, shown here and by
status. Its GPUs are resolved as the hook resolves them (its bundle's
config.json, the inventory, [policy]). --no-runtime skips this check.

If the state dir or its files were moved, put them back first. When nothing
can be recovered, --reset starts the ledger afresh deliberately (the old files
are moved aside) with only the claims of the containers the runtimes run
(read as above; none with --no-runtime): waiters and claims of anything else
(gpu-guard-ctl run tickets) are forgotten. On an NRI host the daemon rebuilds
the claims from containerd (an external plugin at its next sync, one launched
by containerd in place, from the containers it tracks). The operator's cordons of the
newest state that still verifies are kept (each is listed); the observer's
are dropped (the daemon sets them again). --reset refuses a healthy ledger,
which has nothing to recover, also one that turned healthy while recover
ran (another recover, or the NRI daemon, rebuilt it): add --force to start it
afresh anyway. Containers are admitted against a healthy ledger until the
reset holds its lock, so a forced reset also keeps, from the ledger as it
finds it under that lock, the claims of the holders still running, not yet
started or draining (as gc tells them: each is listed and audited; under
release_requires_idle one found exited is kept and marked draining, as gc
marks it); the claims of holders that exited, and every waiter, are
forgotten.`,
		`  sudo gpu-guard-ctl recover --dry-run
  sudo gpu-guard-ctl recover
  sudo gpu-guard-ctl recover --reset --reason "nothing verifies, all GPU jobs stopped"
  sudo gpu-guard-ctl recover --reset --force --reason "start afresh: all GPU jobs stopped"`,
		noArgs,
		func(cmd *cobra.Command, _ []string) error {
			if err := a.requireRoot("recover"); err != nil {
				return err
			}
			return a.recoverLedger(cmd.Context(), recoverFlags{reset: reset, force: force, dryRun: dryRun, noLiveness: noLiveness,
				noRuntime: noRuntime, reason: reason})
		})
	cmd.Flags().BoolVar(&reset, "reset", false, "start the ledger afresh, moving the old files aside (what it keeps: see above)")
	cmd.Flags().BoolVar(&force, "force", false, "with --reset: reset a healthy ledger too (keeping the claims of holders still running, not yet started or draining)")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "report what would be recovered; change nothing")
	cmd.Flags().BoolVar(&noLiveness, "no-liveness", false, "keep every recovered claim, even of holders that exited")
	cmd.Flags().BoolVar(&noRuntime, "no-runtime", false, "do not read the OCI runtimes' state dirs (no adoption of running containers)")
	cmd.Flags().StringVar(&reason, "reason", "", "why, for the audit log")
	return cmd
}

// recoverFlags are the flags of recover.
type recoverFlags struct {
	reset, force, dryRun, noLiveness, noRuntime bool
	reason                                      string
}

// recoverOutput is recover's JSON: the ledger's report and, when the
// runtimes were read, what was found there.
type recoverOutput struct {
	ledger.RecoverReport
	Runtime *runtimescan.Result `json:"runtime,omitempty"`
}

func (a *app) recoverLedger(ctx context.Context, fl recoverFlags) error {
	reset, dryRun, noLiveness := fl.reset, fl.dryRun, fl.noLiveness
	if reset && dryRun {
		return usagef("--reset and --dry-run: a reset starts the ledger afresh, forgetting every claim and waiter but those of " +
			"the containers the runtimes run; run without --reset to see what recover would do")
	}
	if fl.force && !reset {
		return usagef("--force applies to --reset only (resetting a healthy ledger); recover itself never changes a healthy one")
	}
	l, err := a.openLedger(false)
	if err != nil {
		return err
	}
	why := "gpu-guard-ctl recover"
	if fl.reason != "" {
		why += ": " + fl.reason
	}
	cfg, err := a.config()
	if err != nil {
		return err
	}
	var scan *runtimescan.Result
	// A healthy ledger is left alone (Recover changes nothing): no need to
	// read the runtimes, nor to fail for an inventory they would need.
	st, serr := l.Snapshot(ctx)
	healthy := serr == nil
	if serr != nil && !errors.Is(serr, ledger.ErrNeedsRecovery) {
		// Not damage (a state written by a newer nri-gpu-guard, an I/O
		// error): nothing here can recover it, and a reset would forget
		// the claims of containers that run.
		return serr
	}
	if reset && healthy && !fl.force {
		// Nothing to recover: a reset would only forget the claims of
		// containers that still run (on a hook host nothing rebuilds them)
		// and every waiter. A typo away from `recover`, it asks for --force.
		return fmt.Errorf("the ledger in %s is healthy (generation %d: %d claim(s), %d waiter(s), %d cordon(s)): nothing to recover, "+
			"and --reset would forget its claims and waiters; `%s recover` checks it, `%s recover --reset --force` starts it afresh anyway "+
			"(the operator's cordons are kept)", l.Dir(), st.Generation, len(st.Claims), len(st.Waiters), len(st.Cordons), programName, programName)
	}
	if !fl.noRuntime && len(cfg.Hook.RuntimeRoots) > 0 && (reset || !healthy) {
		// Read before the ledger's lock is taken (it resolves GPUs, which
		// may take the inventory from NVML). While the ledger needs
		// recovery no hook admits anything, so the list misses no
		// container admitted meanwhile; but the ledger may be healthy (a
		// forced reset) or become so before the lock (an NRI daemon
		// rebuilds it in place, a concurrent recover): the reset checks
		// that again under the lock (below).
		if scan, err = a.scanRuntimes(cfg, l); err != nil {
			return err
		}
	}
	if afterRecoverLook != nil {
		afterRecoverLook()
	}
	var (
		rep     ledger.RecoverReport
		markErr error // the reset was written, but its exited holders' claims were not marked draining
	)
	if reset {
		keeper := newResetKeeper(guard.NewReleaseRule(cfg, a.env.Liveness))
		opts := ledger.ResetOptions{
			Reason: why,
			// Without --force a healthy ledger is refused, as above, and
			// it is refused again if it turned healthy before the lock:
			// its claims then include ones admitted after the scan, which
			// a reset would forget (their GPUs claimable by a second
			// container).
			RefuseHealthy: !fl.force,
			// With --force a healthy ledger is reset under the front ends'
			// feet: the claims of holders the release rule (as gc applies
			// it) finds running, not yet started or draining are carried over, read
			// under the lock, so that one admitted after the scan keeps
			// its GPU (and those of holders found exited under
			// release_requires_idle, marked draining just after). Those of
			// holders gone, waiters and the rest are forgotten.
			Keep: keeper.keep,
		}
		if scan != nil {
			// A hook host has no daemon to rebuild the claims: the reset
			// starts from what the runtimes run.
			opts.Running = scan.Holdings
			opts.RunningWhy = func(i int) string { return strings.Replace(scan.Why[i], "recover:", "reset:", 1) }
		}
		rep, err = l.ResetWith(ctx, opts)
		if err == nil && len(keeper.drain) > 0 {
			markErr = markDraining(ctx, l, keeper.drain, &rep)
		}
		if errors.Is(err, ledger.ErrHealthy) {
			return fmt.Errorf("%w; it became healthy after this command looked (an NRI daemon rebuilt it in place, or another "+
				"`recover` ran), and a reset now would forget the claims admitted since; `%s recover` checks it, `%s recover --reset --force` "+
				"starts it afresh anyway (keeping the claims of holders still running, not yet started or draining, and the operator's cordons)", err, programName, programName)
		}
	} else {
		opts := ledger.RecoverOptions{Reason: why, DryRun: dryRun}
		if scan != nil {
			opts.Running = scan.Holdings
			opts.RunningWhy = func(i int) string { return scan.Why[i] }
		}
		if !noLiveness {
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
		// Lists are always present in the JSON, [] when empty
		// (docs/ctl-json.md); but adopted, conflicts and kept_claims,
		// absent when empty.
		rep.Claims = nonNilSlice(rep.Claims)
		rep.Waiters = nonNilSlice(rep.Waiters)
		rep.From = nonNilSlice(rep.From)
		rep.Released = nonNilSlice(rep.Released)
		rep.Quarantined = nonNilSlice(rep.Quarantined)
		rep.KeptCordons = nonNilSlice(rep.KeptCordons)
		if err := writeJSON(a.env.Stdout, recoverOutput{RecoverReport: rep, Runtime: scan}); err != nil {
			return err
		}
		return markErr
	}
	var b strings.Builder
	switch {
	case rep.Problem == "":
		fmt.Fprintf(&b, "the ledger is healthy (generation %d): nothing to recover\n", rep.Generation)
	case reset && len(rep.KeptClaims) > 0:
		adopting := ""
		if len(rep.Adopted) > 0 {
			adopting = " and the containers the runtimes run"
		}
		fmt.Fprintf(&b, "the ledger was reset to the claims of the holders still running, not yet started or draining%s: generation %d, new lineage %s\n",
			adopting, rep.Generation, rep.Lineage)
	case reset && len(rep.Adopted) > 0:
		fmt.Fprintf(&b, "the ledger was reset to the containers the runtimes run: generation %d, new lineage %s\n", rep.Generation, rep.Lineage)
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
			b.WriteString("the state got a new lineage: an NRI daemon rebuilds from the runtime (at its next sync, or in place when launched by containerd)\n")
		}
	}
	if reset && rep.Lost != "" {
		fmt.Fprintf(&b, "LOST: %s\n", rep.Lost)
	}
	for _, k := range rep.KeptCordons {
		// The reason and who are the operator's words: one line each.
		fmt.Fprintf(&b, "  kept (operator cordon, lasts until uncordoned): %s\n", escapeLine(fmt.Sprintf("%s, by %s since %s: %s",
			ledger.DescribeDevice(k.Device), k.By, k.Since.UTC().Format(time.RFC3339), k.Reason)))
	}
	if !reset {
		// A reset's claims are each kept or adopted, listed below as such.
		for _, c := range rep.Claims {
			fmt.Fprintf(&b, "  holds: %s by %s\n", ledger.DescribeDevice(c.Device), ledger.DescribeOwner(c.Owner))
		}
	}
	for _, c := range rep.KeptClaims {
		fmt.Fprintf(&b, "  kept (holder running, not yet started or draining): %s by %s\n", ledger.DescribeDevice(c.Device), ledger.DescribeOwner(c.Owner))
	}
	for _, c := range rep.Released {
		fmt.Fprintf(&b, "  released (holder exited): %s by %s\n", ledger.DescribeDevice(c.Device), ledger.DescribeOwner(c.Owner))
	}
	adopt := "adopted"
	if dryRun {
		adopt = "would adopt"
	}
	for _, c := range rep.Adopted {
		fmt.Fprintf(&b, "  %s (running without a claim): %s by %s\n", adopt, ledger.DescribeDevice(c.Device), ledger.DescribeOwner(c.Owner))
	}
	for _, c := range rep.Conflicts {
		holder := "another container"
		for _, h := range rep.Claims {
			if devices.Conflicts(h.Device, c.Device) && h.Owner.ContainerID != c.Owner.ContainerID {
				holder = ledger.DescribeOwner(h.Owner)
			}
		}
		fmt.Fprintf(&b, "  CONFLICT: %s runs on %s, held by %s: one of them was let onto it; stop the wrong one "+
			"(the record becomes its claim once the GPU is free)\n", ledger.DescribeOwner(c.Owner), ledger.DescribeDevice(c.Device), holder)
	}
	if scan != nil && rep.Problem != "" {
		writeRuntimeScan(&b, scan)
	}
	if len(rep.Waiters) > 0 {
		fmt.Fprintf(&b, "  %d waiter(s) queued\n", len(rep.Waiters))
	}
	for _, q := range rep.Quarantined {
		fmt.Fprintf(&b, "  moved aside (kept): %s\n", q)
	}
	if _, err := fmt.Fprint(a.env.Stdout, b.String()); err != nil {
		return err
	}
	return markErr
}

// afterRecoverLook, when set, is called by recover between its look at the
// ledger (and the runtimes) and the change it makes under the ledger's lock.
// Only tests set it, to change the ledger in that window.
var afterRecoverLook func()

// resetKeeper is the Keep of a forced reset: the claims of holders rule
// finds running, or created and not yet started, or draining (exited, but
// under release_requires_idle the GPU may still hold their processes; the
// drain grace still bounds them) are carried into the fresh state. Stopped
// holders (kept until removal) and exited ones are not.
//
// A holder found exited under release_requires_idle whose claim is not
// marked draining yet (MarkDraining) is in the same case as a draining one:
// its cgroup is empty, but only the GPU can say that its processes left.
// Its claim is kept too, and recorded in drain, for the reset to mark
// draining, so that idle_grace bounds it as it bounds any other.
type resetKeeper struct {
	check func(ledger.Owner) guard.Verdict
	drain []exitedHolder
}

// exitedHolder is a holder the release rule found exited, with its finding.
type exitedHolder struct {
	owner ledger.Owner
	why   string
}

func newResetKeeper(rule guard.ReleaseRule) *resetKeeper {
	return &resetKeeper{check: memoCheck(rule)} // under the ledger's lock: once per holder
}

// keep is ResetOptions.Keep.
func (k *resetKeeper) keep(c ledger.Claim) (bool, string) {
	v := k.check(c.Owner)
	switch v.Action {
	case guard.KeepRunning:
		// Running, or no evidence that it exited: kept on doubt.
		return true, "its holder is not known to have exited" + inParens(v.Why)
	case guard.KeepNotStarted:
		return true, "its holder was created and has not started yet"
	case guard.KeepDraining:
		return true, "its holder exited and the claim drains until its processes leave the GPU (release_requires_idle)"
	case guard.MarkDraining:
		if !slices.ContainsFunc(k.drain, func(e exitedHolder) bool { return incarnationOf(&e.owner) == incarnationOf(&c.Owner) }) {
			k.drain = append(k.drain, exitedHolder{owner: c.Owner, why: v.Why})
		}
		return true, "its holder exited" + inParens(v.Why) + ", but its processes may still be on the GPU (release_requires_idle): kept, marked draining"
	default:
		return false, ""
	}
}

// markDraining marks draining, in one transaction after a forced reset, the
// claims the reset kept for holders found exited (resetKeeper.drain), and
// updates rep to show them so. Until it commits they are plain claims,
// which nothing releases (gc would mark them): the GPU stays taken either
// way.
func markDraining(ctx context.Context, l *ledger.Ledger, drain []exitedHolder, rep *ledger.RecoverReport) error {
	var marked []ledger.Claim
	err := l.Update(ctx, func(tx *ledger.Tx) error {
		marked = nil // fn may be retried
		for _, e := range drain {
			reason := "recover --reset --force: holder exited"
			if e.why != "" {
				reason += " (" + e.why + ")"
			}
			marked = append(marked, tx.MarkDrainingIncarnation(e.owner, reason)...)
		}
		return nil
	})
	if err != nil {
		var names []string
		for _, e := range drain {
			names = append(names, guard.HolderName(e.owner))
		}
		return fmt.Errorf("the ledger was reset, keeping the claims of %s, whose holders exited, but they were not marked "+
			"draining (release_requires_idle): %w; run `sudo %s gc`, which marks them", strings.Join(names, ", "), err, programName)
	}
	// Copies: rep.Claims may share its array with the state the ledger
	// handle caches.
	rep.KeptClaims, rep.Claims = slices.Clone(rep.KeptClaims), slices.Clone(rep.Claims)
	for _, m := range marked {
		for _, list := range [][]ledger.Claim{rep.KeptClaims, rep.Claims} {
			for i := range list {
				if list[i].Device.UUID == m.Device.UUID {
					list[i] = m
				}
			}
		}
	}
	return nil
}

// nonNilSlice is s, or an empty slice for nil: a JSON list, never null.
func nonNilSlice[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

// writeRuntimeScan says which runtime roots were read and what could not be.
func writeRuntimeScan(b *strings.Builder, scan *runtimescan.Result) {
	roots := "none of the configured roots exists"
	if len(scan.Roots) > 0 {
		roots = strings.Join(scan.Roots, ", ")
	}
	fmt.Fprintf(b, "  runtime state read: %s: %d running or created container(s)\n", roots, scan.Live)
	for _, n := range scan.Unresolved {
		fmt.Fprintf(b, "  WARNING: %s container %s runs, but its GPUs cannot be told (%s): its claims are kept, nothing is adopted for it\n",
			n.Runtime, ledger.ShortID(n.ID), n.Error)
	}
	for _, c := range scan.Creating {
		fmt.Fprintf(b, "  being created (no state yet): %s\n", c)
	}
	for _, p := range scan.Problems {
		fmt.Fprintf(b, "  WARNING: unreadable runtime entry %s\n", p.Error())
	}
}
