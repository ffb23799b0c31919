// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// maxRefresh bounds the time between two Admits of a waiting hook even when
// nothing changes: each Admit refreshes the waiter's last_seen (queue_ttl
// drops waiters not seen for that long) and its queue position.
const maxRefresh = 30 * time.Second

// watcher decides, at each poll of a waiting hook, whether a new Admit can
// have another outcome than the last one. An Admit takes the ledger lock and
// commits a write (the waiter's last_seen) with its fsyncs and an audit line;
// a waiter polling every 250ms for ten minutes would write thousands of
// times and compete for the lock with the NRI daemon, whose answers have a
// deadline. Between Admits the watcher reads the ledger without the lock.
//
// An Admit is due when:
//   - the claims, reservations or the queue (who waits, in which order)
//     differ from what they were just before the last Admit;
//   - the guard's release rule finds a holder of a conflicting claim exited
//     (the same rule Admit applies, so that Admit releases it or marks it
//     stopped);
//   - a reservation or a waiter has outlived its TTL (the next write drops it);
//   - the last Admit is older than the refresh interval;
//   - the ledger cannot be read (Admit reports the problem).
//
// It never misses a change: the fingerprint is of the state the last Admit
// committed (its Update's view at the end of its lock hold; see committed),
// so any later commit shows up as a difference at the next poll. Without
// committed, the state is read before each Admit, so a change committed
// between that read and the Admit shows up as a difference at the next poll
// (at worst one Admit too many).
type watcher struct {
	snapshot func(ctx context.Context) (ledger.State, error)
	// committed, when set, returns without any I/O the state the last Admit
	// committed or decided on (ledger.Ledger.Committed): an Admit reads the
	// ledger under its lock anyway, and a second, lock-free read before it
	// costs a waiter (and every hook whose GPU is free) another read.
	committed func() (ledger.State, bool)
	// releasable is the guard's release rule (guard.Releasable) for a
	// holder: an Admit is due when it would release or mark stopped.
	releasable   func(o ledger.Owner) guard.Verdict
	now          func() time.Time
	queueTTL     time.Duration
	refreshEvery time.Duration

	last      string    // fingerprint read before the last Admit
	lastAdmit time.Time // when the last Admit was made
}

// before is called just before every Admit: it records when, and, without
// committed, what the ledger looked like.
func (w *watcher) before(ctx context.Context, key string) {
	w.lastAdmit = w.now()
	if w.committed != nil {
		w.last = "" // until after says what the Admit committed
		return
	}
	st, err := w.snapshot(ctx)
	if err != nil {
		w.last = ""
		return
	}
	w.last = fingerprint(st, key)
}

// after is called after every Admit that returned a decision (err == nil):
// with committed, it records what that Admit committed. Without a state of
// this boot the next poll Admits again.
func (w *watcher) after(key string) {
	if w.committed == nil {
		return
	}
	if st, ok := w.committed(); ok {
		w.last = fingerprint(st, key)
	}
}

// due reports whether the next poll should Admit again, and why (for tests
// and debugging).
func (w *watcher) due(ctx context.Context, key string) (bool, string) {
	now := w.now()
	if now.Sub(w.lastAdmit) >= w.refreshEvery {
		return true, "refresh"
	}
	st, err := w.snapshot(ctx)
	if err != nil {
		return true, "ledger unreadable: " + err.Error()
	}
	if w.last == "" || fingerprint(st, key) != w.last {
		return true, "ledger changed"
	}
	mine, queued := waiterOf(st, key)
	if !queued {
		return true, "not queued"
	}
	for _, r := range st.Reservations {
		if !r.Until.After(now) {
			return true, "reservation expired"
		}
	}
	for _, wt := range st.Waiters {
		if w.queueTTL > 0 && !wt.LastSeen.Add(w.queueTTL).After(now) && wt.Key != key {
			return true, "waiter expired"
		}
	}
	if w.releasable != nil {
		checked := map[string]bool{}
		for _, c := range st.Claims {
			o := c.Owner
			if checked[o.ContainerID] || !conflictsAny(c, mine.Devices) {
				continue
			}
			checked[o.ContainerID] = true
			if w.releasable(o).Exited() {
				return true, "holder exited"
			}
		}
	}
	return false, ""
}

// conflictsAny reports whether claim c excludes any of devs.
func conflictsAny(c ledger.Claim, devs []devices.Device) bool {
	for _, d := range devs {
		if devices.Conflicts(c.Device, d) {
			return true
		}
	}
	return false
}

func waiterOf(st ledger.State, key string) (ledger.Waiter, bool) {
	for _, wt := range st.Waiters {
		if wt.Key == key {
			return wt, true
		}
	}
	return ledger.Waiter{}, false
}

// fingerprint is the part of the state an admission depends on: who holds
// what, what is reserved for whom, and who waits in which order. What every
// refresh changes (a waiter's last_seen, its reservation's deadline, the
// generation) is left out: it would make each waiter's Admit trigger the
// others'. Deadlines are checked against the clock instead (see due). The
// waiter's own entry (key) is left out too: its first Admit adds it, and
// whether it is still there is checked on its own.
func fingerprint(st ledger.State, key string) string {
	var b strings.Builder
	for _, c := range st.Claims {
		fmt.Fprintf(&b, "c %s %s %d;", c.Device.UUID, c.Owner.ContainerID, c.Owner.StoppedAt.UnixNano())
	}
	for _, r := range st.Reservations {
		fmt.Fprintf(&b, "r %s %s;", r.Device.UUID, r.For)
	}
	// Only the waiters ahead count: one that joins behind changes neither
	// this waiter's position nor its turn, and counting it made every
	// arrival trigger an Admit of each waiter already queued (n² ledger
	// writes for a burst of n).
	mine, queued := waiterOf(st, key)
	for _, w := range st.Waiters {
		if w.Key != key && (!queued || w.Seq < mine.Seq) {
			fmt.Fprintf(&b, "w %d %s;", w.Seq, w.Key)
		}
	}
	for _, c := range st.Conflicts {
		fmt.Fprintf(&b, "x %s %s;", c.Device.UUID, c.Owner.ContainerID)
	}
	return b.String()
}
