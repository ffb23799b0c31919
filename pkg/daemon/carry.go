// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// A daemon that starts (an upgrade, a crash, a configuration change that
// restarts the process) finds the processes the daemon before it reported
// still running. Taken for new findings, they were logged and audited
// again and, under on_intruder = "cordon", their devices cordoned again
// although the operator had lifted the cordon (accepting the process). So
// the findings cross the restart as they cross a restart of the observer
// (carryLocked), through two sources, each the truth for its part:
//
//   - the carry file (observe.CarryFileName, written by writeCarry after
//     each pass that changed it, and before the pass's intruder cordons
//     too) for what only the daemon knew: the findings it reported, by
//     process (boot, pid, start time: a process that ended, or a pid
//     reused, is cleared or is a new finding at the first pass), the
//     ledger lineage it saw each of its intruder cordons in, the cordons
//     it still had to write, and its policy. observe.json
//     does not do: a clean stop removes it (gpu-guard-ctl status must not
//     show a stopped daemon's findings), and an upgrade stops cleanly.
//   - the ledger for the cordons: on the device of a carried finding whose
//     cordon the daemon before watched or still had to write, a cordon in
//     force, whatever its source (judgeCordons: an operator's or an
//     unhealthy one replaces the intruder's in the ledger, or is kept
//     instead of it), is the cordon,
//     seen in force in the ledger's lineage, whatever the file says (a
//     write the file missed, a retry that committed). One missing is
//     judged at the first pass as at any other (settleIntruders): lifted
//     by the operator if the ledger is still in the lineage the file saw
//     it in, lost with the state (and written again) if not.
//
// The devices found unhealthy cross it too, whatever cordon is in force on
// them: an operator's outranks an unhealthy cordon and is kept instead of
// it (ledger.CordonKept), NVML reports a critical Xid once, so neither the
// ledger nor the new observer would tell the daemon after that the device
// failed. They cross it whatever [observe] interval: the health watcher
// runs without accounting passes too ("0s"), so the daemon's first
// observer that watches health takes the file over (takeOverLocked),
// adopting the unhealthy devices at once; the findings wait, as the daemon
// before left them, for the first that accounts (held). The file holds
// each with the lineage its unhealthy cordon was written in or last seen
// in force in, and its cordon pending when still to write
// (writeUnhealthyCarry: written before the cordon, as the intruders' are);
// the daemon after lists them (observe.json, the gauge) and judges their
// cordons at its first pass as the daemon before would have
// (settleUnhealthy; with accounting off, which runs no pass, at once and
// then on settleLoop's schedule): one missing in another lineage, or
// pending and not in force, is written again as unhealthy. A file without them (an older
// daemon's) carries none: only the unhealthy cordons in force are adopted
// then (unhealthyOf), as before.
//
// A file that cannot be trusted (missing, of another boot or format,
// corrupt) carries nothing, logged: every process is then judged afresh, as
// before, which errs toward reporting and cordoning, never away from it.

// priorFindings is what the daemon's first observer that watches health
// (its unhealthy devices) and its first that accounts (the rest) take over
// from the daemon before it (readPrior, takeOverLocked).
type priorFindings struct {
	reported map[string]observe.FileFinding
	// lineages: by device, the lineage each intruder cordon was written in
	// or last seen in force in.
	lineages map[string]string
	retry    map[string]observe.FileFinding
	cordons  bool
	// unhealthy: the devices the daemon before found unhealthy, with the
	// lineage of each one's unhealthy cordon it knew (unhealthyLineages)
	// and the reason of each it still had to write (unhealthyRetry).
	unhealthy         []observe.Finding
	unhealthyLineages map[string]string
	unhealthyRetry    map[string]string
}

// priorToRead reports whether an observer that watches health, starting
// in dir (accounts: with accounting passes), reads the carry file of the
// daemon before (readPrior) for takeOverLocked: the first such observer
// does (the file is still the daemon before's), and the first that
// accounts after one that did not, unless the findings it took over are
// held for it (same dir).
func (w *Watch) priorToRead(dir string, accounts bool) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return !w.carryTaken || (accounts && !w.accounted && w.heldDir != dir)
}

// takeOverLocked takes over, for an observer that watches health and
// starts in dir, what the daemon before recorded (w.mu held); read tells
// whether prior was read for it (priorToRead), nil when the file carried
// nothing.
//
// The first such observer takes over the carry file: the unhealthy
// devices at once, whatever the interval (the health watcher runs at
// every interval, and the file is this daemon's to write from now on, so
// that the devices it finds unhealthy are carried to the daemon after:
// NVML reports an Xid once); the findings too when it accounts. One that
// does not account ([observe] interval = "0s") runs no pass to report or
// clear them: it holds them as the daemon before left them, and the
// carry file keeps them (writeCarryWith) for the first observer that
// accounts, of this daemon or of one after.
func (w *Watch) takeOverLocked(dir string, accounts, read bool, prior *priorFindings) {
	switch {
	case !w.carryTaken:
		w.carryTaken = true
		if accounts {
			w.accounted = true
			w.adoptPriorLocked(dir, prior)
			return
		}
		w.adoptUnhealthyLocked(prior)
		w.held, w.heldDir = findingsOf(prior), dir
	case accounts && !w.accounted:
		w.accounted = true
		if !read {
			prior = w.held // heldDir is dir (priorToRead)
		}
		w.held, w.heldDir = nil, ""
		w.adoptPriorLocked(dir, prior)
	}
}

// findingsOf returns p without its unhealthy devices (nil for nil).
func findingsOf(p *priorFindings) *priorFindings {
	if p == nil {
		return nil
	}
	return &priorFindings{reported: p.reported, lineages: p.lineages, retry: p.retry, cordons: p.cordons}
}

// readPrior reads the carry file of the daemon before from dir (nil when
// it carries nothing: each case logged) and settles it against the
// ledger's cordons in force, read in lineage (read: whether they could be
// read; if not, the first pass settles them); accounts tells whether the
// observer that reads it runs accounting passes (the log says what
// becomes of the findings).
func (w *Watch) readPrior(dir string, accounts bool, cordons []ledger.Cordon, lineage string, read bool) *priorFindings {
	log := w.log().With("file", filepath.Join(dir, observe.CarryFileName))
	var boot string
	if g := w.guard(); g != nil {
		boot = g.Ledger().BootID()
	}
	c, err := observe.ReadCarry(dir)
	switch {
	case errors.Is(err, observe.ErrNoFile):
		log.Info("GPU observer: no findings of an earlier daemon to carry over; every process found is a new finding")
		return nil
	case err != nil:
		log.Warn("GPU observer: the findings of the daemon before cannot be read, so none is carried over: a process still running is reported, audited and (on_intruder = \"cordon\") its device cordoned again, as a new finding (uncordon it again if you had accepted it); the file is rewritten at the next pass",
			"error", err)
		return nil
	case boot == "" || c.BootID != boot:
		log.Info("GPU observer: the findings of the daemon before were seen in an earlier boot: their processes are gone; none is carried over",
			"file_boot_id", c.BootID, "boot_id", boot)
		return nil
	}
	p := &priorFindings{reported: map[string]observe.FileFinding{}, cordons: c.Cordons}
	var unnamed int
	for _, f := range c.Findings {
		if (f.Kind != observe.KindIntruder && f.Kind != observe.KindOutOfBounds) || f.PID <= 0 || f.StartTicks == 0 || f.Device.UUID == "" {
			// Without its start time, nothing tells the process from
			// another that took its pid: judged afresh.
			unnamed++
			continue
		}
		p.reported[findingKey(f.Finding)] = f
	}
	for _, u := range c.Unhealthy {
		uuid := u.Device.UUID
		if uuid == "" || slices.ContainsFunc(p.unhealthy, func(f observe.Finding) bool { return f.Device.UUID == uuid }) {
			continue
		}
		f := u.Finding
		f.Kind = observe.KindUnhealthy
		p.unhealthy = append(p.unhealthy, f)
		if u.CordonLineage != nil {
			if p.unhealthyLineages == nil {
				p.unhealthyLineages = map[string]string{}
			}
			p.unhealthyLineages[uuid] = *u.CordonLineage
		}
		if u.CordonRetry != "" {
			if p.unhealthyRetry == nil {
				p.unhealthyRetry = map[string]string{}
			}
			p.unhealthyRetry[uuid] = u.CordonRetry
		}
	}
	on := findingsByDevice(p.reported)
	// The devices whose cordon the daemon before wrote, saw in force or
	// still had to write are judged by the ledger as at any pass
	// (judgeCordons): a cordon in force there (a write the file missed, a
	// retry that committed, or another's cordon that replaced the
	// daemon's) is seen in force in the lineage read now, whatever the
	// file says. A device the daemon watched no cordon on (its operator
	// lifted it, or the policy was "report") is not judged: a cordon on it
	// is not the observer's.
	retries := make(map[string]bool, len(c.CordonRetries))
	for _, uuid := range c.CordonRetries {
		retries[uuid] = true
	}
	watched := map[string]string{} // the lineage the file saw each in ("" if none)
	for uuid := range on {
		if seen, known := c.CordonLineages[uuid]; known || retries[uuid] {
			watched[uuid] = seen
		}
	}
	var fates map[string]cordonFate
	if read {
		fates = judgeCordons(cordons, lineage, watched)
	}
	for uuid := range watched {
		seen, known := c.CordonLineages[uuid]
		fate, judged := fates[uuid]
		switch {
		case judged && fate == cordonInForce:
			seen, known = lineage, true // the ledger's word, not the file's
		case retries[uuid]:
			if p.retry == nil {
				p.retry = map[string]observe.FileFinding{}
			}
			p.retry[uuid] = on[uuid]
		}
		if known {
			if p.lineages == nil {
				p.lineages = map[string]string{}
			}
			p.lineages[uuid] = seen
		}
	}
	attrs := []any{"findings", len(p.reported), "written_at", c.WrittenAt, "cordons_watched", len(p.lineages), "cordons_pending", len(p.retry),
		"unhealthy", len(p.unhealthy)}
	if unnamed > 0 {
		attrs = append(attrs, "not_carried", unnamed)
	}
	if c.Truncated > 0 {
		attrs = append(attrs, "truncated", c.Truncated)
	}
	if !accounts {
		log.Info("GPU observer: findings of the daemon before carried over: an unhealthy device stays unhealthy, cordoned again if no cordon is in force on it, until `gpu-guard-ctl uncordon`; with accounting off ([observe] interval = \"0s\") the other findings are kept as they were for an observer that accounts",
			attrs...)
		return p
	}
	log.Info("GPU observer: findings of the daemon before carried over: a process that still runs is not reported, audited or cordoned again; one that ended is cleared at the first pass; an unhealthy device stays unhealthy, cordoned again if no cordon is in force on it, until `gpu-guard-ctl uncordon`",
		attrs...)
	return p
}

// adoptPriorLocked makes p the state of the observer before the one that
// starts in dir (w.mu held), for carryLocked to carry as it carries an
// observer restart's; nil adopts nothing.
func (w *Watch) adoptPriorLocked(dir string, p *priorFindings) {
	if p == nil {
		return
	}
	w.reported, w.intruderRetry = p.reported, p.retry
	w.observing = observerRun{dir: dir, cordons: p.cordons}
	for uuid, seen := range p.lineages {
		if w.cordonLineage == nil {
			w.cordonLineage = map[cordonKey]string{}
		}
		w.cordonLineage[cordonKey{ledger.CordonIntruder, uuid}] = seen
	}
	w.adoptUnhealthyLocked(p)
}

// adoptUnhealthyLocked makes the unhealthy devices of p (nil: none) the
// observer before's, with their cordons' lineages and pending cordons
// (w.mu held). They join those an observer of this daemon found already,
// which are newer.
func (w *Watch) adoptUnhealthyLocked(p *priorFindings) {
	if p == nil {
		return
	}
	for _, f := range p.unhealthy {
		uuid := f.Device.UUID
		if slices.ContainsFunc(w.unhealthy, func(u observe.Finding) bool { return u.Device.UUID == uuid }) {
			continue
		}
		w.unhealthy = append(w.unhealthy, f)
		if seen, known := p.unhealthyLineages[uuid]; known {
			if w.cordonLineage == nil {
				w.cordonLineage = map[cordonKey]string{}
			}
			w.cordonLineage[cordonKey{ledger.CordonUnhealthy, uuid}] = seen
		}
		if reason, pending := p.unhealthyRetry[uuid]; pending {
			if w.cordonFailed == nil {
				w.cordonFailed = map[string]string{}
			}
			w.cordonFailed[uuid] = reason
		}
	}
}

// writeCarry writes the carry file for the daemon after this one from what
// the policy holds after a pass, unless it would say what it already says
// (the findings' pass times aside: the next daemon matches processes, not
// passes). A failure is logged and tried again after the next pass.
//
// A pass that cordons intruders writes it twice (onReport): after its
// audit records and before its cordon writes, with every cordon it is
// about to write named pending (CordonRetries), and after them, with what
// became of them. (One that only writes again cordons lost with the
// ledger's state names none pending, and writes it once, after: their
// lineage records already say they were lost.) A crash between the ledger's writes and the file's so
// fails closed. Once the first is written, the daemon after carries the
// pass's findings (not reported again) and writes each pending cordon
// unless the ledger shows a cordon in force on its device (the write
// landed): a cordon is never lost. (One that landed and that the operator
// lifted before the daemon after read the ledger is written again:
// nothing tells it from one never written.) A file
// written only after the cordons left the daemon after to report the new
// findings again; one naming their cordons written before they were would
// have it take a cordon never written for one the operator lifted. A crash
// between the audit records and the first write still has the daemon after
// report the pass's new findings once more (logged, audited, their devices
// cordoned): the audit log and the file are two writes, and the records
// come first so that none is ever missing.
func (w *Watch) writeCarry() { w.writeCarryWith(false, nil) }

// writeUnhealthyCarry writes the carry file for a device found unhealthy
// (onUnhealthy): pending names the devices whose unhealthy cordon is about
// to be written (device UUID → reason), written before that cordon as the
// intruders' are, so that a daemon after a crash between the two writes it
// unless the ledger shows a cordon in force on the device. Only once an
// observer that watches health has taken over the file of the daemon
// before (w.carryTaken, whatever the interval): until then that file is
// the daemon before's, and is left as it is.
func (w *Watch) writeUnhealthyCarry(pending map[string]string) { w.writeCarryWith(true, pending) }

func (w *Watch) writeCarryWith(owned bool, pending map[string]string) {
	g := w.guard()
	if g == nil {
		return
	}
	dir := g.Ledger().Dir()
	w.mu.Lock()
	if owned && !w.carryTaken {
		w.mu.Unlock()
		return
	}
	c := observe.Carry{BootID: g.Ledger().BootID(), Cordons: w.observing.cordons,
		Findings: slices.Collect(maps.Values(w.reported)), CordonRetries: slices.Sorted(maps.Keys(w.intruderRetry))}
	if !w.accounted && w.held != nil && w.heldDir == dir {
		// No observer of this daemon accounted: the findings are the
		// daemon before's, held as it left them (this daemon reported,
		// cleared and cordoned none), for an observer that accounts.
		h := w.held
		c.Cordons, c.Findings, c.CordonRetries = h.cordons, slices.Collect(maps.Values(h.reported)), slices.Sorted(maps.Keys(h.retry))
		c.CordonLineages = maps.Clone(h.lineages)
	}
	for _, f := range w.unhealthy {
		u := observe.UnhealthyDevice{Finding: f, CordonRetry: w.cordonFailed[f.Device.UUID]}
		if seen, known := w.cordonLineage[cordonKey{ledger.CordonUnhealthy, f.Device.UUID}]; known {
			u.CordonLineage = &seen
		}
		if reason, ok := pending[f.Device.UUID]; ok {
			u.CordonRetry = reason
		}
		c.Unhealthy = append(c.Unhealthy, u)
	}
	slices.SortFunc(c.Unhealthy, func(a, b observe.UnhealthyDevice) int { return strings.Compare(a.Device.UUID, b.Device.UUID) })
	for k, seen := range w.cordonLineage {
		if k.source != ledger.CordonIntruder {
			continue
		}
		if c.CordonLineages == nil {
			c.CordonLineages = map[string]string{}
		}
		c.CordonLineages[k.uuid] = seen
	}
	last := w.carried
	w.mu.Unlock()
	sortFindings(c.Findings)
	sig := carrySignature(dir, c)
	if sig == last {
		return
	}
	c.WrittenAt = w.now().UTC()
	if err := observe.WriteCarry(dir, c); err != nil {
		w.log().Warn("GPU observer: findings not recorded for the next daemon (retried after the next pass); should the daemon restart before, a process still running is reported, and its device cordoned, again",
			"error", err)
		return
	}
	w.mu.Lock()
	w.carried = sig
	w.mu.Unlock()
}

// carrySignature is what c says that the next daemon reads, written to dir.
func carrySignature(dir string, c observe.Carry) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s\n%s\n%t\n", dir, c.BootID, c.Cordons)
	for _, f := range c.Findings {
		fmt.Fprintf(&b, "f %s %s/%s/%s\n", findingKey(f.Finding), f.Namespace, f.Pod, f.Container)
	}
	for _, uuid := range slices.Sorted(maps.Keys(c.CordonLineages)) {
		fmt.Fprintf(&b, "l %s %s\n", uuid, c.CordonLineages[uuid])
	}
	for _, uuid := range c.CordonRetries {
		fmt.Fprintf(&b, "r %s\n", uuid)
	}
	for _, u := range c.Unhealthy {
		lineage := "-"
		if u.CordonLineage != nil {
			lineage = "=" + *u.CordonLineage
		}
		fmt.Fprintf(&b, "u %s %s %d %t %q %q %q\n", u.Device.UUID, u.Time.UTC().Format(time.RFC3339Nano), u.Xid, u.Vanished, u.Message, lineage, u.CordonRetry)
	}
	return b.String()
}
