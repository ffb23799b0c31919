// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"
)

// Audit operations of recovery.
const (
	OpRecover = "recover" // the state was rebuilt from the snapshots and journals
	OpReset   = "reset"   // the state was started afresh deliberately
)

// RecoverOptions tune Recover.
type RecoverOptions struct {
	// Reason is written to the audit log (who asked, and why).
	Reason string
	// Alive, when set, is asked about every recovered claim's holder: a
	// claim whose holder is known to be gone (false, nil) is released; an
	// error keeps the claim (never free a GPU on a guess). Hook hosts pass
	// a check of the runtime's own state; the NRI daemon reconciles with the
	// runtime's list right after instead.
	Alive func(Claim) (bool, error)
	// Running lists the containers the runtime runs, with the devices each
	// reaches: a hook host's gpu-guard-ctl recover reads them from the OCI
	// runtimes' own state dirs, the record that survives a damaged ledger.
	// They are applied to the recovered state before it is written: a
	// claim of a listed container is never released (Alive is not asked);
	// then every listed device without a claim is adopted by its container
	// (audit adopt), and a listed container on a device another container
	// holds, or that one listed earlier adopted, is recorded as a Conflict
	// (as Reconcile does; nobody wins silently). Claims of containers not
	// listed are left to Alive: nothing is released for not being listed.
	// A listed container without devices (its spec could not be read) only
	// keeps its claims.
	Running []Holding
	// RunningWhy words the reason of the audit records about Running[i]
	// (where it was found); nil: "recover: found running in the runtime's
	// state".
	RunningWhy func(i int) string
	// AllowEmpty starts from an empty state (with a new lineage) when no
	// snapshot or journal verifies, instead of failing. The NRI daemon sets
	// it: it rebuilds the claims from the runtime's containers next.
	AllowEmpty bool
	// DryRun reports what would be recovered and changes nothing (a
	// vanished state dir is not made again either).
	DryRun bool
}

// RecoverReport says exactly what Recover found and did. Its JSON is
// gpu-guard-ctl recover's (docs/ctl-json.md): every key is present, but
// Adopted, Conflicts and KeptClaims, which are omitted when empty.
type RecoverReport struct {
	// Problem is what was wrong; "" if the state was healthy and nothing
	// was done.
	Problem string `json:"problem"`
	// From lists the files the state was rebuilt from, in order of use.
	From []string `json:"from"`
	// Replayed is the number of journal records replayed onto the base.
	Replayed int `json:"replayed"`
	// RecoveredGeneration is the last commit recovered; Generation the
	// generation written (one more, or more if commits were lost).
	RecoveredGeneration uint64 `json:"recovered_generation"`
	Generation          uint64 `json:"generation"`
	// Complete: every commit this boot made is back (by the boot marker;
	// true when there is no marker to compare with).
	Complete bool `json:"complete"`
	// Lost describes what could not be recovered ("" if nothing).
	Lost string `json:"lost"`
	// Lineage of the written state; NewLineage when it had to change
	// (commits lost, or started empty), which makes the NRI daemon rebuild
	// from the runtime.
	Lineage    string `json:"lineage"`
	NewLineage bool   `json:"new_lineage"`
	Empty      bool   `json:"empty"` // nothing verified: started empty (AllowEmpty)
	// Claims and Waiters of the recovered state; Released the claims
	// freed because Alive said their holder is gone.
	Claims   []Claim  `json:"claims"`
	Waiters  []Waiter `json:"waiters"`
	Released []Claim  `json:"released"`
	// Adopted are the claims given to Running containers that held none;
	// Conflicts the Running containers found on a device another holds.
	Adopted   []Claim    `json:"adopted,omitempty"`
	Conflicts []Conflict `json:"conflicts,omitempty"`
	// Quarantined are the files moved aside (kept for a human, never
	// overwritten): damaged ones, and ones of another ledger.
	Quarantined []string `json:"quarantined"`
	// KeptCordons (Reset) are the operator's cordons carried into the
	// fresh state from the newest state that verified: a reset forgets
	// holders, not maintenance set on purpose. When no state verified to
	// read them from, Lost says so.
	KeptCordons []Cordon `json:"kept_cordons"`
	// KeptClaims (ResetWith, a healthy ledger) are the claims carried into
	// the fresh state because ResetOptions.Keep kept them (their holders
	// still run); omitted when empty.
	KeptClaims []Claim `json:"kept_claims,omitempty"`
}

// candidate file contents found by Recover.
type recSnapshot struct {
	path string
	st   State
}

type recJournal struct {
	path    string
	hdr     journalHeader
	recs    []journalRecord
	damaged string // why the records stop early, "" if whole
}

// Recover rebuilds a ledger that needs recovery (see ErrNeedsRecovery): it
// replays the journals onto the last snapshot that verifies (the current
// one, the previous one kept by compaction, or the empty base of a fresh
// start), preferring the chain that reaches the latest commit of this
// boot's lineage; moves every damaged or foreign file aside; optionally
// releases claims whose holder is gone (Alive); writes the result as a new
// snapshot and reports exactly what it recovered. On a healthy ledger it
// changes nothing (it appends the records the audit log lacks, as every
// writer does: see auditLog.catchUp) and returns a report with an empty
// Problem.
//
// A vanished state dir is made again to take the lock in it, and removed
// again when Recover writes nothing (nothing verifies, or an error): the
// error tells the operator to put a moved dir back, which a dir left in its
// place would turn into a nested one. A dry run does not make it at all.
func (l *Ledger) Recover(ctx context.Context, opts RecoverOptions) (rep RecoverReport, err error) {
	unlock, made := func() {}, ""
	gone := false
	if opts.DryRun {
		// A dry run changes nothing: a dir that is not there is not made
		// to lock it, and there is nothing in it to lock (what it reads,
		// nothing, is what a real run would find).
		_, serr := os.Lstat(l.dir)
		gone = errors.Is(serr, fs.ErrNotExist)
	}
	if !gone {
		if unlock, made, err = l.lockForWrite(ctx, "recover", !opts.DryRun); err != nil {
			return rep, err
		}
	}
	defer unlock()
	// Runs before the unlock, with the lock held. made is cleared once
	// Recover starts writing.
	defer func() {
		if made == "" {
			return
		}
		if uerr := l.unmakeDir(made); uerr != nil {
			l.log.Warn("ledger recover: could not remove the state dir it made and wrote nothing to; remove it before "+
				"putting a moved state dir back at its name", "dir", made, "error", uerr)
		}
	}()

	ld, err := l.current()
	if err == nil {
		if !opts.DryRun && ld.exists {
			// Nothing to recover; the audit log may still lack the
			// records of a commit whose writer was stopped.
			if a := l.openAuditCaughtUp(ld.st.Generation); a != nil {
				_ = a.close()
			}
		}
		rep.Lineage, rep.Generation, rep.Complete = ld.st.Lineage, ld.st.Generation, true
		rep.RecoveredGeneration = ld.st.Generation
		// As any read sees it: an earlier boot's holders are gone, and its
		// lineage ends with the first write of this boot.
		if ld.exists && ld.st.BootID != l.opts.BootID {
			rep.Lineage = ""
			return rep, nil
		}
		wall, boot := l.clock()
		cur := l.asOfClock(ld.st, wall, boot) // the times as the next writer moves them
		cur = cur.Clone()
		rep.Claims, rep.Waiters = cur.Claims, cur.Waiters
		return rep, nil
	}
	if !errors.Is(err, ErrNeedsRecovery) {
		return rep, err
	}
	rep.Problem = err.Error()
	m, mok, err := l.readMarker()
	if err != nil && !errors.Is(err, ErrNeedsRecovery) {
		return rep, err
	}
	// A damaged marker says nothing about how far this boot got: it cannot
	// vouch for the chain any more than a missing one.
	markerBad := err != nil

	snaps, journals, bad, badPaths, newer := l.gatherForRecovery()
	if len(newer) > 0 {
		// Not damage: moved aside, the newer build's commits would be
		// lost, and this build cannot replay them.
		return rep, fmt.Errorf("ledger recover: nothing was changed: %w; recovering with this build would move it aside "+
			"and lose the commits it holds. Recover with the newer build (upgrade every nri-gpu-guard binary on this "+
			"host), or, to go back to this build, start afresh deliberately with `gpu-guard-ctl recover --reset` "+
			"(it moves the files aside, kept; the NRI daemon rebuilds the claims from the runtime)", errors.Join(newer...))
	}
	best, from, replayed, ok := bestChain(snaps, journals, m, mok, l.opts.BootID)
	maxGen, nextSeq := highWater(snaps, journals)
	if mok {
		maxGen = max(maxGen, m.Generation)
	}
	if !ok {
		if !opts.AllowEmpty {
			what := describeBad(bad)
			if gone || made != "" {
				what = "the state dir does not exist"
			}
			if made != "" {
				// Removed now, not by the deferred call, so that the
				// message can say whether it is gone.
				if uerr := l.unmakeDir(made); uerr != nil {
					what = fmt.Sprintf("the state dir did not exist; this recover made %s to take the lock and could not remove it "+
						"again (%v): remove it before putting a moved state dir back", made, uerr)
				}
				made = ""
			}
			return rep, fmt.Errorf("%w: nothing in %s verifies to recover from (%s); if the state dir or its files were moved, "+
				"put them back and retry, or start empty deliberately with `gpu-guard-ctl recover --reset` (the NRI daemon "+
				"rebuilds from the runtime at its next sync)", ErrNeedsRecovery, l.dir, what)
		}
		best = l.emptyState(maxGen, nextSeq)
		rep.Empty = true
	}
	rep.From, rep.Replayed, rep.RecoveredGeneration = from, replayed, best.Generation
	// Complete only on evidence: the chain reaches the generation this
	// boot's marker recorded, or (no marker, as after a failed marker write)
	// nothing anywhere was damaged, so nothing can have been cut off. Short
	// of that the result gets a new lineage, which makes the NRI daemon
	// rebuild from the runtime instead of trusting a state that may have
	// lost commits.
	damaged := len(bad) > 0
	for _, j := range journals {
		damaged = damaged || j.damaged != ""
	}
	switch {
	case !ok:
	case mok:
		rep.Complete = best.Lineage == m.Lineage && best.Generation >= m.Generation
	default:
		// A file that names a later generation than the chain reaches
		// (a journal header, a snapshot of the same ledger) proves that
		// commits are missing.
		rep.Complete = !markerBad && !damaged && best.Generation >= maxGen
	}
	switch {
	case rep.Empty:
		rep.Lost = "everything: no snapshot or journal verified"
	case !rep.Complete && mok && best.Lineage != m.Lineage:
		rep.Lost = fmt.Sprintf("unknown: the state is of lineage %s, which a recovery or reset of this boot wrote past the marker's "+
			"generation %d of lineage %s without updating the marker", truncate(best.Lineage, 64), m.Generation, truncate(m.Lineage, 64))
	case !rep.Complete && mok:
		rep.Lost = fmt.Sprintf("commits %d to %d of lineage %s (the last this boot made)", best.Generation+1, m.Generation, truncate(m.Lineage, 64))
	case !rep.Complete && best.Generation < maxGen:
		rep.Lost = fmt.Sprintf("commits %d to %d (a file names generation %d, the chain reaches %d)", best.Generation+1, maxGen, maxGen, best.Generation)
	case !rep.Complete:
		rep.Lost = fmt.Sprintf("unknown: no intact boot marker vouches that generation %d was the last commit", best.Generation)
	}
	for _, j := range journals {
		if j.damaged != "" {
			rep.Lost = strings.TrimPrefix(rep.Lost+"; "+j.path+": "+j.damaged, "; ")
		}
	}

	now, boot := l.clock()
	st := best
	var discarded []AuditRecord
	earlierBoot := ok && best.BootID != "" && best.BootID != l.opts.BootID
	if earlierBoot {
		// What verified is an earlier boot's state: its claims and waiters
		// are of containers that died with that boot, so it is discarded
		// as any read of it would be (prepare), and only the operator's
		// cordons carry over (below, audited one by one).
		st, discarded, _ = l.prepare(&loaded{st: best, exists: true}, now)
	}
	st.BootID = l.opts.BootID
	st.NextSeq = max(st.NextSeq, nextSeq)
	rep.NewLineage = !rep.Complete || st.Lineage == "" || earlierBoot
	if rep.NewLineage && !earlierBoot {
		st.Lineage = newLineage() // prepare gave an earlier boot's a new one
	}
	// Above every generation a file names, and above the audit log's last
	// record: the log stays in generation order, and the next writer
	// catches it up through this one (see auditedThrough).
	st.Generation = max(st.Generation, maxGen, l.auditedThrough()) + 1
	st.UpdatedAt = now
	tx := newTx(l, st, now, boot) // moves the times by a step of the wall clock since the anchor
	if earlierBoot {
		tx.audit = append(tx.audit, discarded...)
		tx.keepCordonsAcrossBoot(best.Cordons)
	}
	listed := make(map[string]bool, len(opts.Running))
	for _, h := range opts.Running {
		listed[h.Owner.ContainerID] = true
	}
	if opts.Alive != nil {
		for _, c := range st.Claims {
			if listed[c.Owner.ContainerID] {
				continue // the runtime runs it: whatever a liveness check says
			}
			alive, err := opts.Alive(c)
			if err != nil {
				l.log.Warn("ledger recover: cannot tell whether a holder runs; its claim is kept", "device", DescribeDevice(c.Device),
					"holder", DescribeOwner(c.Owner), "error", err)
				continue
			}
			if !alive {
				rep.Released = append(rep.Released, tx.ReleaseIncarnation(c.Owner, "recover: the holder is no longer running")...)
			}
		}
	}
	if len(opts.Running) > 0 {
		why := opts.RunningWhy
		if why == nil {
			why = func(int) string { return "recover: found running in the runtime's state" }
		}
		rep.Adopted, rep.Conflicts = tx.adoptListed(FrontEndHook, opts.Running, why)
	}
	tx.maintain()
	st = tx.st
	st.Clock = tx.anchorToStore()
	step := tx.clockStep
	tx.close()
	st.sort(true)
	if err := validateState(&st); err != nil {
		return rep, fmt.Errorf("ledger recover: the recovered state breaks an invariant (nothing was written): %w", err)
	}
	rep.Generation, rep.Lineage = st.Generation, st.Lineage
	rep.Claims, rep.Waiters = st.Claims, st.Waiters
	if opts.DryRun {
		return rep, nil
	}
	if err := l.checkLockFile(); err != nil {
		return rep, err
	}
	made = "" // what follows writes to the dir: it stays
	// The records the audit log lacks of the commits before, from the
	// journals, before anything is moved aside or replaced.
	aud := l.openAuditCaughtUp(st.Generation - 1)
	defer func() {
		if aud != nil {
			_ = aud.close()
		}
	}()

	// Move aside what is damaged or of another ledger; the rest is
	// replaced by the write (writeBase), which supersedes it.
	for _, sn := range snaps {
		if sn.st.Lineage != best.Lineage || sn.st.BootID != l.opts.BootID {
			badPaths[sn.path] = true
		}
	}
	for _, j := range journals {
		if j.hdr.Lineage != best.Lineage || j.hdr.BootID != l.opts.BootID {
			badPaths[j.path] = true
		}
	}
	// What is moved aside is linked aside, and keeps its name until the
	// write replaces it: a crash in between leaves the files as they were
	// (read as needing recovery again), never an empty dir (read as a fresh
	// host, which would lose what was recovered: an earlier boot's operator
	// cordons, whose every file is "of another boot").
	for _, name := range []string{stateName, prevName, journalName, journalPrevName} {
		p := filepath.Join(l.dir, name)
		if _, err := os.Lstat(p); err != nil || !badPaths[p] {
			continue
		}
		dst, err := keepAside(l.dir, p, ".corrupt-", now)
		if err != nil {
			return rep, err
		}
		rep.Quarantined = append(rep.Quarantined, dst)
	}
	// The recovered state is no journal record: it is written as the base
	// of every later commit, .prev included, so that a second loss of
	// ledger.json finds it and the commits made after it.
	next, err := l.writeBase(&st)
	if err != nil {
		l.setCache(nil)
		return rep, fmt.Errorf("ledger recover: write the recovered state (generation %d) in %s: %w; fix the cause and run "+
			"`gpu-guard-ctl recover` again (the files moved aside are kept as *.corrupt-*)", st.Generation, l.dir, err)
	}
	next.st = st
	l.setCache(&next)
	if err := l.writeMarker(&st); err != nil {
		return rep, err
	}
	l.logClockStep(step, now, st.Generation)
	l.log.Warn("ledger recovered", "problem", rep.Problem, "from", rep.From, "replayed", rep.Replayed,
		"generation", rep.Generation, "complete", rep.Complete, "lost", rep.Lost, "claims", len(rep.Claims),
		"waiters", len(rep.Waiters), "released", len(rep.Released), "adopted", len(rep.Adopted), "conflicts", len(rep.Conflicts),
		"quarantined", rep.Quarantined)
	recs := append(tx.audit, AuditRecord{Time: now, Op: OpRecover, Reason: fmt.Sprintf(
		"%s; from %s, %d record(s) replayed, %d claim(s) (%d adopted from the runtime's state), %d waiter(s), complete=%t%s; problem: %s",
		orDash(opts.Reason), strings.Join(from, " + "), rep.Replayed, len(rep.Claims), len(rep.Adopted), len(rep.Waiters), rep.Complete,
		map[bool]string{true: "", false: "; lost: " + rep.Lost}[rep.Lost == ""], rep.Problem)})
	for i := range recs {
		recs[i].Generation, recs[i].Pid = st.Generation, os.Getpid()
	}
	aerr := l.finishAudit(aud, st.Generation-1, recs, nil)
	aud = nil // closed
	if aerr != nil {
		l.log.Error("ledger: recovered, but its audit records were not written", "error", aerr)
	}
	return rep, nil
}

// ResetOptions tune ResetWith.
type ResetOptions struct {
	// Reason is written to the audit log (who asked, and why).
	Reason string
	// Running lists the containers the runtime runs, with the devices each
	// reaches: in the same commit as the fresh state, every device of
	// Running is adopted by its container, and a device another holds (a
	// kept claim, or one a container listed earlier adopted) is a Conflict
	// of the later one (see RecoverOptions.Running). RunningWhy words the
	// audit reason of Running[i]; nil: "reset: found running in the
	// runtime's state".
	Running    []Holding
	RunningWhy func(i int) string
	// RefuseHealthy refuses the reset (ErrHealthy, nothing written) when
	// the ledger reads healthy under the lock. A caller that decided to
	// reset because the ledger needed recovery sets it: the ledger may have
	// been recovered since it looked (by an NRI daemon in place, or a
	// concurrent recover), and hooks admit again from then on, so what it
	// learned while the ledger was unhealthy (the runtimes' containers) no
	// longer covers every holder, and the recovered claims are no longer
	// its to forget.
	RefuseHealthy bool
	// Keep, when set and the ledger reads healthy under the lock (a reset
	// of a healthy ledger), is asked about each claim of its current state:
	// a claim it keeps is carried into the fresh state (audit adopt, with
	// why as the reason), the others are forgotten. Front ends admit
	// while the ledger is healthy, so only the state read under the lock
	// knows every holder: Running, read before, misses any admitted since.
	// The claims of an unhealthy ledger are never asked about (nothing
	// trusts them; Running stands for its holders, and nothing is admitted
	// while it is unhealthy).
	Keep func(Claim) (keep bool, why string)
}

// Reset starts the ledger afresh deliberately: every state file is moved
// aside (kept, never deleted), and an empty state with a new lineage is
// written, healthy ledger or not. Whoever calls it takes responsibility for
// the holders it forgets: the NRI daemon rebuilds them from the runtime; an
// operator uses it when nothing can be recovered.
func (l *Ledger) Reset(ctx context.Context, reason string) (RecoverReport, error) {
	return l.ResetWith(ctx, ResetOptions{Reason: reason})
}

// ResetWith is Reset tuned by opts: it starts from the containers the
// runtime runs instead of nothing (Running; a hook host, which has no
// daemon to rebuild its claims, resets this way when nothing can be
// recovered), refuses a ledger found healthy under the lock
// (RefuseHealthy), or carries the claims of a healthy ledger's holders that
// still run (Keep). Everything it decides on is read under the ledger's
// lock, in the one commit that writes the fresh state.
func (l *Ledger) ResetWith(ctx context.Context, opts ResetOptions) (RecoverReport, error) {
	var rep RecoverReport
	reason := opts.Reason
	unlock, _, err := l.lockForWrite(ctx, "reset", true)
	if err != nil {
		return rep, err
	}
	defer unlock()
	// Whether the ledger is healthy is decided here, under the lock, and not
	// by what the caller saw before taking it: front ends admit against a
	// healthy ledger up to the moment this lock is held.
	cur, cerr := l.current()
	healthy := cerr == nil
	if cerr != nil && !errors.Is(cerr, ErrNeedsRecovery) && (opts.RefuseHealthy || opts.Keep != nil) {
		// Not damage (a state of a newer format, an I/O error): a reset
		// that would keep what runs cannot read it, and one that refuses a
		// healthy ledger cannot tell.
		return rep, fmt.Errorf("reset: read the ledger: %w", cerr)
	}
	// An earlier boot's state reads as empty (see prepare): its holders
	// died with that boot, and none of its claims is kept. The claims that
	// are kept keep their times, moved by a step of the wall clock since
	// the state's anchor as any transaction moves them (the fresh state is
	// anchored anew).
	now, boot := l.clock()
	var holders State
	var step time.Duration
	moved := 0
	if healthy && cur.exists && cur.st.BootID == l.opts.BootID {
		holders = cur.st.Clone()
		if s, ok := l.clockStep(&cur.st, now, boot); ok && stepped(s) {
			step = s
			moved = moveTimes(&State{Claims: holders.Claims}, s, cur.st.Clock.Wall.Add(-cur.st.Clock.Boot))
		}
	}
	if healthy && opts.RefuseHealthy {
		return rep, fmt.Errorf("%w: the ledger in %s is healthy (generation %d: %d claim(s), %d waiter(s), %d cordon(s))",
			ErrHealthy, l.dir, cur.st.Generation, len(holders.Claims), len(holders.Waiters), len(cur.st.Cordons))
	}
	var carry []Claim
	if opts.Keep != nil {
		carry = holders.Claims
	}
	snaps, journals, bad, _, _ := l.gatherForRecovery()
	gen, seq := highWater(snaps, journals)
	if m, ok, err := l.readMarker(); err == nil && ok {
		gen = max(gen, m.Generation)
	}
	gen = max(gen, l.auditedThrough()) // see Recover
	st := l.emptyState(gen+1, seq)
	st.Lineage, st.UpdatedAt = newLineage(), now
	tx := newTx(l, st, now, boot)
	// The newest state that verifies, whatever its lineage or boot (the
	// marker is not asked: a reset trusts none of them for its holders):
	// its operator cordons are carried over, as across a reboot. Keeping a
	// cordon too many only blocks a GPU until uncordoned; dropping one
	// would hand a GPU under maintenance to the next container.
	if newest, _, _, ok := bestChain(snaps, journals, marker{}, false, l.opts.BootID); ok {
		rep.KeptCordons = tx.keepCordonsAcrossReset(newest.Cordons)
	} else if len(snaps)+len(journals)+len(bad) > 0 {
		rep.Lost = "the operator's cordons: no state verified to read them from (the files moved aside may hold some); " +
			"cordon again what is under maintenance (gpu-guard-ctl cordon)"
	}
	// The kept claims go in first: a container of Running on a device a
	// kept claim holds is then a Conflict, as at any reconcile, never a
	// second holder.
	for _, c := range carry {
		keep, why := opts.Keep(c)
		if !keep {
			continue
		}
		tx.insertClaim(c)
		tx.record(OpAdopt, &c.Owner, "", []string{c.Device.UUID}, "kept across the reset: "+why)
		rep.KeptClaims = append(rep.KeptClaims, c)
	}
	if step != 0 && len(rep.KeptClaims) > 0 {
		tx.Audit(OpClockStep, AuditRecord{Reason: clockStepReason(step, cur.st.Clock, now, boot, moved)})
	}
	if len(opts.Running) > 0 {
		why := opts.RunningWhy
		if why == nil {
			why = func(int) string { return "reset: found running in the runtime's state" }
		}
		rep.Adopted, rep.Conflicts = tx.adoptListed(FrontEndHook, opts.Running, why)
	}
	tx.maintain()
	st, adoptRecs := tx.st, tx.audit
	st.Clock = tx.anchorToStore()
	tx.close()
	st.sort(true)
	if err := validateState(&st); err != nil {
		return rep, fmt.Errorf("ledger reset: the reset state breaks an invariant (nothing was written): %w", err)
	}
	// Only once the new state is known to be valid are the old files kept
	// aside, and as Recover does: linked aside, each keeping its name until
	// the write of the new state replaces it. Renamed away first, a crash
	// before the write left a state dir without any ledger file: read as a
	// fresh host (after a reboot) or started empty by the next recovery,
	// either way without the operator's cordons this reset was carrying,
	// and a GPU under maintenance was claimable. Now a crash leaves the old
	// files (the reset did not happen), or the new state beside them (read
	// as needing recovery, which finds the cordons in either).
	if err := l.checkLockFile(); err != nil {
		return rep, err
	}
	// The records the audit log lacks of the commits before, from the
	// journals, before they are moved aside.
	aud := l.openAuditCaughtUp(st.Generation - 1)
	defer func() {
		if aud != nil {
			_ = aud.close()
		}
	}()
	for _, name := range []string{stateName, prevName, journalName, journalPrevName} {
		p := filepath.Join(l.dir, name)
		if _, err := os.Lstat(p); err != nil {
			continue
		}
		dst, err := keepAside(l.dir, p, ".reset-", now)
		if err != nil {
			return rep, err
		}
		rep.Quarantined = append(rep.Quarantined, dst)
	}
	// As Recover's, the reset state is written as the base of every later
	// commit, .prev included.
	next, err := l.writeBase(&st)
	if err != nil {
		l.setCache(nil)
		return rep, fmt.Errorf("ledger reset: write the fresh state (generation %d) in %s: %w; fix the cause and reset again "+
			"(the old files are kept aside as *.reset-*)", st.Generation, l.dir, err)
	}
	next.st = st
	l.setCache(&next)
	if err := l.writeMarker(&st); err != nil {
		return rep, err
	}
	if len(rep.KeptClaims) > 0 {
		l.logClockStep(step, now, st.Generation)
	}
	rep.Problem, rep.Generation, rep.Lineage, rep.NewLineage, rep.Empty = "reset: "+reason, st.Generation, st.Lineage, true, len(st.Claims) == 0
	rep.Claims, rep.Waiters = st.Claims, st.Waiters
	l.log.Warn("ledger reset: started afresh", "reason", reason, "moved_aside", rep.Quarantined, "adopted", len(rep.Adopted),
		"conflicts", len(rep.Conflicts), "kept_cordons", len(rep.KeptCordons), "lost", rep.Lost)
	lost := ""
	if rep.Lost != "" {
		lost = "; lost: " + rep.Lost
	}
	recs := append(adoptRecs, AuditRecord{Time: now, Op: OpReset, Reason: fmt.Sprintf(
		"%s; old files moved to %s; %d claim(s) of running holders kept; %d claim(s) adopted from the runtime's state; "+
			"%d operator cordon(s) kept%s",
		orDash(reason), strings.Join(rep.Quarantined, ", "), len(rep.KeptClaims), len(rep.Adopted), len(rep.KeptCordons), lost)})
	for i := range recs {
		recs[i].Generation, recs[i].Pid = st.Generation, os.Getpid()
	}
	aerr := l.finishAudit(aud, st.Generation-1, recs, nil)
	aud = nil // closed
	if aerr != nil {
		l.log.Error("ledger: reset, but its audit record was not written", "error", aerr)
	}
	return rep, nil
}

// keepCordonsAcrossReset puts the operator's cordons of old (the newest
// state that verified) into the reset state and audits every cordon of old,
// kept or dropped, so that none ends silently; it returns the kept ones. As
// across a reboot (keepCordonsAcrossBoot), an operator's cordon is
// maintenance set on purpose and lasts until uncordoned, while the
// observer's are dropped: the daemon's observer cordons a device again
// while it still sees the reason, and writes again a cordon the ledger lost.
func (tx *Tx) keepCordonsAcrossReset(old []Cordon) []Cordon {
	tx.st.Cordons = bootKeptCordons(old)
	if len(tx.st.Cordons) > 0 {
		tx.touch()
	}
	for _, k := range old {
		was := cordonText(&k)
		if k.Source == CordonOperator {
			tx.Audit(OpCordon, AuditRecord{Devices: []string{k.Device.UUID},
				Reason: "kept across the reset (an operator's cordon lasts until uncordoned): " + was})
			continue
		}
		tx.Audit(OpUncordon, AuditRecord{Devices: []string{k.Device.UUID},
			Reason: "dropped at the reset (the daemon's observer cordons it again while it sees the reason): was " + was})
	}
	return slices.Clone(tx.st.Cordons)
}

// ensureDir creates a missing state dir for Recover and Reset: they are
// how an operator deliberately resumes after the dir vanished. made is the
// topmost dir it created (the state dir, or a missing parent of it), ""
// when the dir was there.
func (l *Ledger) ensureDir() (made string, err error) {
	top := firstMissing(l.dir)
	_, created, err := checkDir(l.dir, true, false)
	if created {
		made = top
		if err == nil {
			err = CheckDirChain(l.dir)
		}
	}
	return made, err
}

// firstMissing is the topmost of dir and its parents that does not exist
// ("" when dir exists): what MkdirAll(dir) would create.
func firstMissing(dir string) string {
	top := ""
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); !errors.Is(err, fs.ErrNotExist) { //nolint:gosec // the state dir and its parents, the operator's choice
			return top
		}
		top = d
		if filepath.Dir(d) == d {
			return top
		}
	}
}

// unmakeDir removes what lockForWrite made for a writer that wrote
// nothing: the lock file it created (the flock this process holds on it
// dies with its name; a process waiting on that file finds it replaced and
// locks none, the dir being gone) and each dir from the state dir up to
// made. Only empty dirs are removed (rmdir): anything another process put
// there meanwhile stays, and so does its dir.
func (l *Ledger) unmakeDir(made string) error {
	// The gate too, which a writer that waited for the lock left.
	for _, p := range []string{l.LockPath(), l.gatePath()} {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) { //nolint:gosec // fixed names in the operator's state dir
			return fmt.Errorf("remove %s: %w", p, err)
		}
	}
	for d := filepath.Clean(l.dir); ; d = filepath.Dir(d) {
		if err := syscall.Rmdir(d); err != nil {
			return fmt.Errorf("remove the dir %s: %w", d, err)
		}
		if d == made || filepath.Dir(d) == d {
			return nil
		}
	}
}

// gatherForRecovery reads every snapshot and journal there is, keeping
// what verifies: each journal's records up to its first damaged line.
// newer has the *FormatError (with its path) of each file a newer build
// wrote, which is in bad too (a reset moves it aside with the rest; a
// recovery refuses).
func (l *Ledger) gatherForRecovery() (snaps []recSnapshot, journals []recJournal, bad []string, badPaths map[string]bool, newer []error) {
	badPaths = map[string]bool{}
	noteNewer := func(p string, err error) {
		var fe *FormatError
		if errors.As(err, &fe) {
			newer = append(newer, l.corrupt(p, err))
		}
	}
	for _, name := range []string{stateName, prevName} {
		p := filepath.Join(l.dir, name)
		data, exists, err := l.readForRecovery(p)
		if !exists {
			continue
		}
		if err == nil {
			var st State
			if st, err = DecodeState(data); err == nil {
				snaps = append(snaps, recSnapshot{path: p, st: st})
				continue
			}
		}
		noteNewer(p, err)
		bad = append(bad, fmt.Sprintf("%s: %v", p, err))
		badPaths[p] = true
	}
	for _, name := range []string{journalPrevName, journalName} {
		p := filepath.Join(l.dir, name)
		data, exists, err := l.readForRecovery(p)
		if !exists {
			continue
		}
		if err != nil {
			bad = append(bad, fmt.Sprintf("%s: %v", p, err))
			badPaths[p] = true
			continue
		}
		j := recJournal{path: p}
		// On damage, the lines before it still count.
		lines, ends, _, lerr := journalLines(data, 0)
		if lerr != nil {
			j.damaged = lerr.Error()
		}
		if len(lines) == 0 {
			bad = append(bad, fmt.Sprintf("%s: no header that verifies", p))
			badPaths[p] = true
			continue
		}
		if j.hdr, err = decodeHeader(lines[0]); err != nil {
			noteNewer(p, err)
			bad = append(bad, fmt.Sprintf("%s: %v", p, err))
			badPaths[p] = true
			continue
		}
		for k := 1; k < len(lines); k++ {
			r, err := decodeRecord(lines[k], ends[k])
			if err != nil {
				j.damaged = err.Error()
				break
			}
			j.recs = append(j.recs, r)
		}
		if j.damaged != "" {
			badPaths[p] = true
		}
		journals = append(journals, j)
	}
	return snaps, journals, bad, badPaths, newer
}

func (l *Ledger) readForRecovery(p string) ([]byte, bool, error) {
	f, fi, exists, err := openRegular(p, false)
	if !exists || err != nil {
		return nil, exists, err
	}
	defer func() { _ = f.Close() }()
	data, err := readFrom(f, 0, fi.Size(), maxStateBytes, nil)
	return data, true, err
}

// highWater is the highest generation and next waiter sequence number any
// verified snapshot or journal record reached: a recovered or reset state
// continues above both, so no generation or seq is ever handed out twice.
func highWater(snaps []recSnapshot, journals []recJournal) (gen, seq uint64) {
	for _, s := range snaps {
		gen, seq = max(gen, s.st.Generation), max(seq, s.st.NextSeq)
	}
	for _, j := range journals {
		gen = max(gen, j.hdr.Base)
		for _, r := range j.recs {
			gen, seq = max(gen, r.Gen), max(seq, r.NextSeq)
		}
	}
	return gen, seq
}

// bestChain replays the journals onto every base (each snapshot, and the
// empty base of a fresh-start journal) and returns the state that reaches
// the highest generation, preferring the marker's lineage, with the files
// used and the number of records replayed.
func bestChain(snaps []recSnapshot, journals []recJournal, m marker, mok bool, boot string) (best State, from []string, replayed int, ok bool) {
	bases := slices.Clone(snaps)
	for _, j := range journals {
		if j.hdr.Genesis {
			bases = append(bases, recSnapshot{j.path + " (its empty base)", j.hdr.genesisBase()})
		}
	}
	better := func(a State, b State) bool { return a.Generation > b.Generation }
	for _, b := range bases {
		// Another ledger's state: its claims are not ours to adopt. But a
		// state of this boot past the marker's generation is what a recovery
		// or reset of this boot wrote (every other commit keeps the lineage)
		// before it could update the marker: it supersedes the marker's.
		if mok && b.st.Lineage != m.Lineage && (b.st.BootID != boot || b.st.Generation <= m.Generation) {
			continue
		}
		st := b.st
		used := []string{b.path}
		n := 0
		for _, j := range journals {
			if j.hdr.Lineage != st.Lineage {
				continue
			}
			applied := false
			for i := range j.recs {
				r := j.recs[i]
				if r.Gen <= st.Generation {
					continue
				}
				if r.Gen != st.Generation+1 {
					break
				}
				next := st
				if err := applyRecords(&next, []journalRecord{r}); err != nil {
					break
				}
				st = next
				n++
				applied = true
			}
			if applied {
				used = append(used, j.path)
			}
		}
		if !ok || better(st, best) {
			best, from, replayed, ok = st, used, n, true
		}
	}
	// The base of a genesis journal is the journal itself.
	var out []string
	for _, f := range from {
		f = strings.TrimSuffix(f, " (its empty base)")
		if !slices.Contains(out, f) {
			out = append(out, f)
		}
	}
	return best, out, replayed, ok
}

func describeBad(bad []string) string {
	if len(bad) == 0 {
		return "no state files at all"
	}
	return strings.Join(bad, "; ")
}

// quarantineAs moves a state file aside to <path><infix><UTC time> (with a
// counter if taken): kept for a human, never overwritten.
func quarantineAs(dir, path, infix string, now time.Time) (string, error) {
	base := path + infix + now.UTC().Format(quarantineStamp)
	for i := 0; i < 100; i++ {
		dst := base
		if i > 0 {
			dst = fmt.Sprintf("%s.%d", base, i)
		}
		if _, err := os.Lstat(dst); !errors.Is(err, fs.ErrNotExist) { //nolint:gosec // a fixed name in the operator's state dir, suffixed
			continue
		}
		if err := os.Rename(path, dst); err != nil { //nolint:gosec // a fixed name in the operator's state dir, and that name suffixed
			return "", fmt.Errorf("move %s aside: %w", path, err)
		}
		return dst, syncDir(dir)
	}
	return "", fmt.Errorf("move %s aside: too many files named %s*; clean them up", path, base)
}

// keepAside keeps path under a new name as quarantineAs does, by a hard link
// when it can (path then still names the file, until the write of the
// recovered or reset state replaces it), else by renaming it.
func keepAside(dir, path, infix string, now time.Time) (string, error) {
	base := path + infix + now.UTC().Format(quarantineStamp)
	for i := 0; i < 100; i++ {
		dst := base
		if i > 0 {
			dst = fmt.Sprintf("%s.%d", base, i)
		}
		if _, err := os.Lstat(dst); !errors.Is(err, fs.ErrNotExist) { //nolint:gosec // a fixed name in the operator's state dir, suffixed
			continue
		}
		if err := os.Link(path, dst); err != nil {
			// Not a file a link can keep (a directory planted there):
			// moved aside at once, as before.
			return quarantineAs(dir, path, infix, now)
		}
		return dst, syncDir(dir)
	}
	return "", fmt.Errorf("move %s aside: too many files named %s*; clean them up", path, base)
}

// orDash is s, or "-" when s is empty, for audit reasons.
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
