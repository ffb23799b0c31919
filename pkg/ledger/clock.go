// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Steps of the wall clock. Every TTL counts from a stored wall-clock time
// (a reservation's Until, a waiter's LastSeen + queue_ttl, a claim's
// DrainingSince + DrainGrace), and the wall clock is stepped now and then:
// chronyc makestep, NTP's first sync after boot, date -s, a VM resumed or
// migrated. Read as time passing, a step forward expired every waiter and
// ended every drain at once (a GPU handed to the next container while its
// holder's processes may still run on it), and a step back kept a
// reservation for a waiter that is gone for as long as the step.
//
// CLOCK_BOOTTIME is the time since boot, suspend included: one clock every
// process of the boot shares, which nobody steps. NTP slews it as it slews
// the wall clock, so the two advance alike and differ by a constant until
// the wall clock is stepped. The state records one reading of both
// (State.Clock); a transaction that reads them apart by more than
// clockStepTolerance from that anchor moves every stored time of this boot
// by the step before any expiry is judged (Tx.checkClock), anchors anew, and
// commits both with an audit record (OpClockStep). A reader without the lock
// moves the times of its copy alike (Ledger.read), so `gpu-guard-ctl
// status` and a hook's poll judge deadlines as the next writer will. The
// times stay wall-clock times, as operators read them: a time moved by the
// step is what the stepped clock would have read at that moment.

// OpClockStep records that the wall clock was found stepped and every stored
// time of this boot moved with it (Reason: by how much).
const OpClockStep = "clock-step"

// clockStepTolerance is how far the wall clock may be from where the anchor
// puts it before it counts as stepped. NTP's slewing changes the rate of
// the kernel's one timekeeper, which both clocks read, so a slew never
// moves them apart, however long it runs; only a step does (and, in the
// readings, the moment between them, which clock keeps to a millisecond:
// see clockReadGap). A second leaves out what is not worth rewriting every
// waiter for: a leap second, and the small steps of ntpd (which steps
// offsets over 128 ms) or of systemd-timesyncd, each of which shifts no TTL
// by more than a tenth of the shortest one the configuration allows (10 s).
// They are not lost: the anchor moves only when a step is applied, so
// small steps add up until they pass the tolerance and are applied
// together.
const clockStepTolerance = time.Second

// clockReadGap is the longest the two readings of the boot clock around a
// reading of the wall clock may be apart for the pair to count as taken
// together: a process preempted in between would otherwise see a step of
// the time it was off the CPU.
const clockReadGap = time.Millisecond

// SinceBoot reads CLOCK_BOOTTIME: the time since boot, suspend included. It
// is the default Options.BootClock. It returns -1 when the clock cannot be
// read: no step of the wall clock is then told.
func SinceBoot() time.Duration {
	offset, ok := bootOffset()
	if !ok {
		return -1
	}
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return -1
	}
	return time.Duration(ts.Nano()) - offset
}

// bootOffset is the boot clock's offset in this process's time namespace
// (/proc/self/timens_offsets, Linux 5.6 and later): CLOCK_BOOTTIME is
// shifted per time namespace while the wall clock and the boot ID are not,
// so a process in one (unshare --time, a runtime's linux.timeOffsets, a
// restored checkpoint) would read the shift as a step of the wall clock and
// move every TTL of the ledger by it at each turn with a process outside.
// Subtracting it gives the host's boot clock. 0 where the kernel has no
// time namespaces (no such file); unknown (no boot reading: no step told)
// where the file cannot be read or parsed (ok false). Read once per process.
var bootOffset = sync.OnceValues(func() (time.Duration, bool) {
	data, err := os.ReadFile("/proc/self/timens_offsets")
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return 0, true
	case err != nil:
		return 0, false
	}
	return parseBootOffset(data)
})

// parseBootOffset reads the boottime line of a timens_offsets file
// ("boottime <seconds> <nanoseconds>"): its offset, 0 when the file has no
// such line; ok false when the line does not parse.
func parseBootOffset(data []byte) (offset time.Duration, ok bool) {
	for line := range strings.Lines(string(data)) {
		f := strings.Fields(line)
		if len(f) == 0 || (f[0] != "boottime" && f[0] != "7") { // CLOCK_BOOTTIME's id, as older kernels print it
			continue
		}
		if len(f) != 3 {
			return 0, false
		}
		sec, err1 := strconv.ParseInt(f[1], 10, 64)
		nsec, err2 := strconv.ParseInt(f[2], 10, 64)
		if err1 != nil || err2 != nil || nsec < 0 || nsec >= int64(time.Second) ||
			sec > math.MaxInt64/int64(time.Second)-1 || sec < math.MinInt64/int64(time.Second)+1 {
			return 0, false
		}
		return time.Duration(sec)*time.Second + time.Duration(nsec), true
	}
	return 0, true
}

// noBootClock is Options.BootClock for an injected Now without one: no
// reading (and so no step told, and no anchor stored). A test's clock and
// the host's boot clock would disagree from the start.
func noBootClock() time.Duration { return -1 }

// clock reads the wall clock (as now does) and the boot clock at the same
// moment: the boot clock before and after the wall clock, the midpoint
// taken, again (three tries at most, the closest pair kept) while the two
// boot readings are more than clockReadGap apart. boot < 0: unknown.
func (l *Ledger) clock() (wall time.Time, boot time.Duration) {
	gap := time.Duration(-1)
	for range 3 {
		b1 := l.opts.BootClock()
		w := l.now()
		b2 := l.opts.BootClock()
		if b1 < 0 || b2 < b1 {
			return w, -1
		}
		if gap < 0 || b2-b1 < gap {
			gap, wall, boot = b2-b1, w, b1+(b2-b1)/2
		}
		if gap <= clockReadGap {
			break
		}
	}
	if gap > clockStepTolerance/2 {
		// Off the CPU for that long in every try (a frozen cgroup, a
		// stopped process): the midpoint may be a tolerance away from
		// the wall reading. No reading: no step told.
		return wall, -1
	}
	return wall, boot
}

// clockStep is how far the wall clock reading wall is from where the anchor
// of st puts it at the boot clock reading boot: the sum of the steps since
// the anchor (positive: forward). ok is false when there is nothing to
// compare with: no anchor (a state of an older format, or never committed),
// an anchor of another boot (st is an earlier boot's), no boot clock reading,
// or one from before the anchor's (which the boot clock of this boot never
// gives).
func (l *Ledger) clockStep(st *State, wall time.Time, boot time.Duration) (step time.Duration, ok bool) {
	a := st.Clock
	if a.Wall.IsZero() || a.Boot < 0 || boot < a.Boot || st.BootID != l.opts.BootID {
		return 0, false
	}
	return wall.Sub(a.Wall.Add(boot - a.Boot)), true
}

// stepped reports whether a clockStep is a step to apply.
func stepped(step time.Duration) bool {
	return step > clockStepTolerance || step < -clockStepTolerance
}

// moveTimes moves every time of st from (the boot's start, as the anchor
// reckoned it) on by step: what the state records of this boot. A time
// before it is an earlier boot's (an operator's cordon carried across a
// reboot): the boot clock does not reach it, and it stays. The caller owns
// every slice of st (they are written in place). It returns how many times
// moved.
func moveTimes(st *State, step time.Duration, from time.Time) int {
	n := 0
	move := func(t *time.Time) {
		if !t.IsZero() && !t.Before(from) {
			*t = t.Add(step)
			n++
		}
	}
	owner := func(o *Owner) {
		move(&o.StartedAt)
		move(&o.StoppedAt)
		move(&o.DrainingSince)
	}
	for i := range st.Claims {
		move(&st.Claims[i].Since)
		owner(&st.Claims[i].Owner)
	}
	for i := range st.Waiters {
		w := &st.Waiters[i]
		move(&w.FirstSeen)
		move(&w.LastSeen)
		owner(&w.Owner)
	}
	for i := range st.Reservations {
		move(&st.Reservations[i].Since)
		move(&st.Reservations[i].Until)
	}
	for i := range st.Conflicts {
		move(&st.Conflicts[i].Since)
		owner(&st.Conflicts[i].Owner)
	}
	for i := range st.Cordons {
		move(&st.Cordons[i].Since)
	}
	move(&st.UpdatedAt)
	return n
}

// asOfClock is st as the next writer will see it at the clock readings wall
// and boot: where the wall clock was stepped since st's anchor, a copy with
// every time moved by the step and the anchor taken anew; st itself
// otherwise. For a reader without the lock, whose st may share storage with
// the cache.
func (l *Ledger) asOfClock(st State, wall time.Time, boot time.Duration) State {
	step, ok := l.clockStep(&st, wall, boot)
	if !ok || !stepped(step) {
		return st
	}
	from := st.Clock.Wall.Add(-st.Clock.Boot)
	c := st.Clone()
	moveTimes(&c, step, from)
	c.Clock = ClockAnchor{Wall: wall, Boot: boot}
	return c
}

// checkClock runs first in every transaction (Update, View, Recover), before
// anything expires: where the wall clock was stepped since the state's
// anchor, every stored time of this boot moves by the step (all of them, so
// that the journal record of this rare commit is the one that grows), the
// state is anchored anew, and the step is audited; the commit logs it. It
// also notes whether the state has an anchor to keep (anchorToStore).
func (tx *Tx) checkClock() {
	step, ok := tx.l.clockStep(&tx.st, tx.now, tx.boot)
	tx.anchored = ok
	if !ok || !stepped(step) {
		return
	}
	a := tx.st.Clock
	from := a.Wall.Add(-a.Boot)
	// newTx copied the claims, reservations and conflicts; the queue and
	// the cordons may share storage with the cache.
	tx.ownWaiters()
	tx.st.Cordons = slices.Clone(tx.st.Cordons)
	moved := moveTimes(&tx.st, step, from)
	for i := range tx.st.Waiters {
		tx.touchedWaiters = append(tx.touchedWaiters, tx.st.Waiters[i].Key)
	}
	tx.st.Clock = ClockAnchor{Wall: tx.now, Boot: tx.boot}
	tx.clockStep = step
	// The earliest LastSeen moved: scan the queue again.
	tx.minKnown = false
	tx.touch()
	tx.record(OpClockStep, nil, "", nil, clockStepReason(step, a, tx.now, tx.boot, moved))
}

// clockStepReason words the audit record of a step found at the readings
// wall and boot against the anchor a, which moved n stored times.
func clockStepReason(step time.Duration, a ClockAnchor, wall time.Time, boot time.Duration, n int) string {
	return fmt.Sprintf("the wall clock was stepped %s: it reads %s where %s passed since %s by the boot clock "+
		"(it would read %s); %d stored time(s) of this boot moved with it, so that no TTL, drain grace or age counts the step",
		describeStep(step), wall.Format(time.RFC3339Nano), (boot - a.Boot).String(), a.Wall.Format(time.RFC3339Nano),
		wall.Add(-step).Format(time.RFC3339Nano), n)
}

// describeStep words a step: "forward by 1h0m0s", "back by 24h0m0s".
func describeStep(step time.Duration) string {
	if step < 0 {
		return "back by " + (-step).String()
	}
	return "forward by " + step.String()
}

// anchorToStore is the anchor a commit of the transaction stores: the
// state's, when it has one to compare with (checkClock took a new one after
// a step); otherwise one taken at the transaction's clock readings, unless
// the boot clock could not be read (then whatever the state had).
func (tx *Tx) anchorToStore() ClockAnchor {
	a := tx.st.Clock
	if tx.anchored || tx.boot < 0 || (!a.Wall.IsZero() && tx.st.BootID == tx.l.opts.BootID) {
		// The state's anchor of this boot stays unless a step moved it:
		// a boot reading behind it (which this boot's clock never
		// gives) is no reason to take another.
		return a
	}
	return ClockAnchor{Wall: tx.now, Boot: tx.boot}
}

// logClockStep logs a step a commit applied (see Tx.clockStep), where the
// front end logs.
func (l *Ledger) logClockStep(step time.Duration, wall time.Time, generation uint64) {
	if step == 0 {
		return
	}
	l.log.Warn("ledger: the wall clock was stepped; the stored times moved with it, so that no TTL counts the step",
		"step", describeStep(step), "wall", wall.Format(time.RFC3339Nano), "generation", generation)
}
