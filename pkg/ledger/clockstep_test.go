// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// tryClaim is one request of container id for d, as a front end makes it.
func tryClaim(l *Ledger, id string, d devices.Device) error {
	return l.Update(context.Background(), func(tx *Tx) error {
		_, err := tx.Claim("", owner(id), devs(d), "env")
		return err
	})
}

func recordsOf(recs []AuditRecord, op string) []AuditRecord {
	var out []AuditRecord
	for _, r := range recs {
		if r.Op == op {
			out = append(out, r)
		}
	}
	return out
}

// A step of the wall clock is no time passing: every TTL counts the time
// that passed, whichever way the clock was stepped.
func TestClockStepIsNoTimePassing(t *testing.T) {
	for _, tc := range []struct {
		name string
		run  func(t *testing.T, c *clock, l *Ledger)
	}{{
		// release_requires_idle: the holder's processes may still run
		// on the GPU one real second after it stopped.
		name: "a step forward does not end a drain",
		run: func(t *testing.T, c *clock, l *Ledger) {
			require.NoError(t, tryClaim(l, "x", gpu(0)))
			update(t, l, func(tx *Tx) { tx.MarkDraining("x", "stopped") })
			c.Advance(time.Second)
			c.Step(time.Hour)
			require.True(t, isBusy(tryClaim(l, "y", gpu(0))), "y must not get a GPU whose holder drains")
			c.Advance(2 * time.Minute) // the grace, passed
			require.NoError(t, tryClaim(l, "y", gpu(0)))
		},
	}, {
		name: "a step back does not stretch a drain",
		run: func(t *testing.T, c *clock, l *Ledger) {
			require.NoError(t, tryClaim(l, "x", gpu(0)))
			update(t, l, func(tx *Tx) { tx.MarkDraining("x", "stopped") })
			c.Step(-time.Hour)
			c.Advance(2 * time.Minute)
			require.NoError(t, tryClaim(l, "y", gpu(0)), "the grace passed")
		},
	}, {
		name: "a step forward past queue_ttl keeps the queue in order",
		run: func(t *testing.T, c *clock, l *Ledger) {
			update(t, l, func(tx *Tx) {
				_, err := tx.Claim("", owner("x"), devs(gpu(0)), "env")
				require.NoError(t, err)
				tx.Enqueue("a", owner("a"), devs(gpu(0)))
				tx.Enqueue("b", owner("b"), devs(gpu(0)))
			})
			c.Advance(10 * time.Second)
			update(t, l, func(tx *Tx) { tx.Enqueue("b", owner("b"), devs(gpu(0))) })
			c.Step(time.Hour)
			update(t, l, func(tx *Tx) { tx.Enqueue("b", owner("b"), devs(gpu(0))) })
			update(t, l, func(tx *Tx) { tx.Enqueue("a", owner("a"), devs(gpu(0))) })
			require.Equal(t, []string{"a", "b"}, waiterKeys(snapshot(t, l)))
			require.Empty(t, recordsOf(auditRecords(t, l), OpExpired))
		},
	}, {
		name: "a step back does not stretch queue_ttl",
		run: func(t *testing.T, c *clock, l *Ledger) {
			update(t, l, func(tx *Tx) {
				_, err := tx.Claim("", owner("x"), devs(gpu(0)), "env")
				require.NoError(t, err)
				tx.Enqueue("a", owner("a"), devs(gpu(0)))
			})
			c.Step(-time.Hour)
			c.Advance(DefaultQueueTTL + time.Second)
			update(t, l, func(*Tx) {})
			require.Empty(t, waiterKeys(snapshot(t, l)))
			require.Len(t, recordsOf(auditRecords(t, l), OpExpired), 1)
		},
	}, {
		// A GPU idle, reserved for a head that is gone, for as long as
		// the step.
		name: "a step back does not keep a reservation for a head that is gone",
		run: func(t *testing.T, c *clock, l *Ledger) {
			reserveForTheHead(t, l)
			require.Equal(t, "head", reservedFor(snapshot(t, l))[gpu(0).UUID])
			c.Step(-24 * time.Hour)
			c.Advance(20 * time.Minute) // the head never returns
			require.NoError(t, tryClaim(l, "z", gpu(0)))
		},
	}, {
		name: "a step forward does not end a reservation early",
		run: func(t *testing.T, c *clock, l *Ledger) {
			reserveForTheHead(t, l)
			c.Step(time.Hour)
			c.Advance(time.Minute)
			require.True(t, isBusy(tryClaim(l, "z", gpu(0))), "reserved for the head")
			require.NoError(t, l.Update(context.Background(), func(tx *Tx) error {
				_, err := tx.Claim("head", owner("head"), devs(gpu(0)), "env")
				return err
			}))
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			c := newClock()
			o := testOptions(c)
			o.DrainGrace = 2 * time.Minute
			l, err := Open(t.TempDir(), o)
			require.NoError(t, err)
			tc.run(t, c, l)
		})
	}
}

// The first transaction after a step moves every stored time of the boot
// by it, once: one commit, audited and logged, with the new anchor; the
// commits after it are ordinary ones, whose records carry no anchor.
func TestClockStepIsAppliedOnceAndAudited(t *testing.T) {
	c := newClock()
	var logs bytes.Buffer
	o := testOptions(c)
	o.DrainGrace = time.Hour
	o.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	l, err := Open(t.TempDir(), o)
	require.NoError(t, err)
	t0 := c.Now()
	update(t, l, func(tx *Tx) {
		for i, id := range []string{"x", "y"} {
			_, err := tx.Claim("", owner(id), devs(gpu(i)), "env")
			require.NoError(t, err)
		}
		tx.Enqueue("w", owner("w"), devs(gpu(0)))
		tx.MarkDraining("y", "stopped")
		_, _, err := tx.Cordon(gpu(5), CordonOperator, "rma", "root")
		require.NoError(t, err)
	})
	update(t, l, func(tx *Tx) { tx.Release("x", "stopped") }) // reserved for w
	before := snapshot(t, l)
	require.Equal(t, ClockAnchor{Wall: t0, Boot: c.Boot()}, before.Clock, "anchored at the first commit")

	c.Advance(10 * time.Second)
	c.Step(time.Hour)
	update(t, l, func(*Tx) {})
	after := snapshot(t, l)
	require.Equal(t, before.Generation+1, after.Generation, "the step is one commit")
	require.Equal(t, ClockAnchor{Wall: c.Now(), Boot: c.Boot()}, after.Clock)
	require.Len(t, after.Waiters, 1, "the waiter stays")
	require.Len(t, after.Reservations, 1, "its reservation stays")
	moved := func(a, b time.Time) { require.Equal(t, a.Add(time.Hour), b) }
	moved(before.Waiters[0].FirstSeen, after.Waiters[0].FirstSeen)
	moved(before.Waiters[0].LastSeen, after.Waiters[0].LastSeen)
	moved(before.Reservations[0].Since, after.Reservations[0].Since)
	moved(before.Reservations[0].Until, after.Reservations[0].Until)
	moved(before.Claims[0].Since, after.Claims[0].Since)
	moved(before.Claims[0].Owner.DrainingSince, after.Claims[0].Owner.DrainingSince)
	moved(before.Cordons[0].Since, after.Cordons[0].Since)

	steps := recordsOf(auditRecords(t, l), OpClockStep)
	require.Len(t, steps, 1)
	require.Contains(t, steps[0].Reason, "stepped forward by 1h0m0s")
	require.Contains(t, steps[0].Reason, "10s passed since 2026-03-01T12:00:00Z by the boot clock")
	require.Equal(t, after.Generation, steps[0].Generation)
	require.Contains(t, logs.String(), "the wall clock was stepped")
	require.Contains(t, logs.String(), "forward by 1h0m0s")

	// A cold reader replays the step's record to the same state.
	cold, err := Open(l.Dir(), o)
	require.NoError(t, err)
	require.Equal(t, after, snapshot(t, cold))

	// Nothing more to apply: no commit, no record.
	c.Advance(time.Second)
	update(t, l, func(*Tx) {})
	require.Equal(t, after.Generation, snapshot(t, l).Generation)
	// An ordinary commit's record carries no anchor.
	update(t, l, func(tx *Tx) { tx.Enqueue("v", owner("v"), devs(gpu(0))) })
	lines := bytes.Split(bytes.TrimSuffix(mustRead(t, l.JournalPath()), []byte("\n")), []byte("\n"))
	last := lines[len(lines)-1]
	require.Contains(t, string(last), `"w":[{"key":"v"`)
	require.NotContains(t, string(last), `"clk"`)
	require.Len(t, recordsOf(auditRecords(t, l), OpClockStep), 1)
}

// A reader without the lock (gpu-guard-ctl status, a hook's poll) and View
// (explain, the observer's drain pass) see the times moved by a step that no
// writer applied yet, and judge deadlines as the next writer will; nothing
// is written.
func TestReadersSeeTimesMovedByAStep(t *testing.T) {
	c := newClock()
	l := openTest(t, c)
	t0 := c.Now()
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("x"), devs(gpu(0)), "env")
		require.NoError(t, err)
		tx.Enqueue("w", owner("w"), devs(gpu(0)))
	})
	update(t, l, func(tx *Tx) { tx.Release("x", "stopped") })
	stored := snapshot(t, l)
	files := mustRead(t, l.JournalPath())

	c.Step(time.Hour)
	c.Advance(10 * time.Second)
	ro, err := OpenReadOnly(l.Dir(), testOptions(c))
	require.NoError(t, err)
	for name, h := range map[string]*Ledger{"writer's handle": l, "read-only handle": ro} {
		st := snapshot(t, h)
		require.Equal(t, stored.Generation, st.Generation, name)
		require.Equal(t, t0.Add(time.Hour), st.Waiters[0].FirstSeen, name)
		require.Equal(t, t0.Add(time.Hour+DefaultReservationTTL), st.Reservations[0].Until, name)
		claims, err := h.ClaimsOf(context.Background(), "x")
		require.NoError(t, err, name)
		require.Empty(t, claims, name)
	}
	require.NoError(t, l.View(context.Background(), func(tx *Tx) error {
		require.Equal(t, 10*time.Second, tx.Now().Sub(tx.ReadState().Waiters[0].FirstSeen))
		require.Equal(t, "w", tx.ReadState().Reservations[0].For, "the reservation stands")
		return nil
	}))
	require.Equal(t, files, mustRead(t, l.JournalPath()), "nothing written")
	require.Equal(t, t0, snapshot(t, l).Clock.Wall.Add(-time.Hour-10*time.Second), "a read anchors its copy anew")
}

// Steps within clockStepTolerance are not applied on their own (no commit
// of every waiter for a leap second), but neither are they lost: the
// anchor stays until a step is applied, so they add up.
func TestClockStepTolerance(t *testing.T) {
	for _, tc := range []struct {
		name  string
		steps []time.Duration
		want  string // the step applied; "" for none
	}{
		{name: "time passing", steps: nil},
		{name: "a leap second", steps: []time.Duration{-time.Second}},
		{name: "a small step", steps: []time.Duration{700 * time.Millisecond}},
		{name: "small steps add up", steps: []time.Duration{700 * time.Millisecond, 700 * time.Millisecond}, want: "forward by 1.4s"},
		{name: "back", steps: []time.Duration{-1500 * time.Millisecond}, want: "back by 1.5s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newClock()
			l := openTest(t, c)
			update(t, l, func(tx *Tx) { tx.Enqueue("w", owner("w"), devs(gpu(0))) })
			gen := snapshot(t, l).Generation
			for _, s := range tc.steps {
				c.Advance(time.Minute)
				c.Step(s)
				update(t, l, func(*Tx) {})
			}
			steps := recordsOf(auditRecords(t, l), OpClockStep)
			if tc.want == "" {
				require.Empty(t, steps)
				require.Equal(t, gen, snapshot(t, l).Generation, "nothing to commit")
				return
			}
			require.Len(t, steps, 1)
			require.Contains(t, steps[0].Reason, "stepped "+tc.want+":")
		})
	}
}

// reboot starts the boot clock again at up: a new boot.
func (c *clock) reboot(up time.Duration) {
	c.mu.Lock()
	c.boot = up
	c.mu.Unlock()
}

// An operator's cordon carried across a reboot dates from the earlier
// boot, which the boot clock does not reach: a step in this boot moves the
// times of this boot only.
func TestClockStepLeavesAnEarlierBootsTimes(t *testing.T) {
	c := newClock()
	dir := t.TempDir()
	first, err := Open(dir, testOptions(c))
	require.NoError(t, err)
	t0 := c.Now()
	update(t, first, func(tx *Tx) {
		_, _, err := tx.Cordon(gpu(1), CordonOperator, "rma", "root")
		require.NoError(t, err)
	})
	c.Advance(10 * time.Minute)
	c.reboot(time.Minute)
	o := testOptions(c)
	o.BootID = "99999999-2222-3333-4444-555555555555"
	l, err := Open(dir, o)
	require.NoError(t, err)
	t1 := c.Now()
	update(t, l, func(tx *Tx) {
		_, _, err := tx.Cordon(gpu(2), CordonOperator, "reseat", "root")
		require.NoError(t, err)
		_, err = tx.Claim("", owner("x"), devs(gpu(3)), "env")
		require.NoError(t, err)
	})
	c.Advance(time.Second)
	c.Step(time.Hour)
	update(t, l, func(*Tx) {})
	st := snapshot(t, l)
	require.Len(t, st.Cordons, 2)
	require.Equal(t, t0, st.Cordons[0].Since, "the earlier boot's cordon keeps its time")
	require.Equal(t, t1.Add(time.Hour), st.Cordons[1].Since)
	require.Equal(t, t1.Add(time.Hour), st.Claims[0].Since)
	require.Len(t, recordsOf(auditRecords(t, l), OpClockStep), 1)
}

// A state of format 3 (before the clock anchor) is read as it is: a step
// is not told (what older builds did), and its next commit writes format 4
// with an anchor, from which on a step is told.
func TestFormat3IsReadAndAnchored(t *testing.T) {
	c := newClock()
	l := openTest(t, c)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("x"), devs(gpu(0)), "env")
		require.NoError(t, err)
		tx.Enqueue("w", owner("w"), devs(gpu(0)))
	})
	// The same state as a format 3 build writes it: no anchor, a journal 3
	// with no record after the snapshot.
	st := snapshot(t, l)
	st.Clock = ClockAnchor{}
	data, err := encodeState(&st)
	require.NoError(t, err)
	data = append(formatPrefix(3), data[len(formatPrefix(FormatVersion)):]...)
	hdr, err := appendJournalLine(nil, journalHeader{Journal: 3, Lineage: st.Lineage, BootID: st.BootID, Base: st.Generation})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(l.StatePath(), data, 0o600))
	require.NoError(t, os.WriteFile(l.JournalPath(), hdr, 0o600))

	old, err := Open(l.Dir(), testOptions(c))
	require.NoError(t, err)
	require.Equal(t, st, snapshot(t, old), "read as it is")
	c.Advance(time.Second)
	c.Step(time.Minute)
	require.Equal(t, st.Waiters, snapshot(t, old).Waiters, "no anchor: the step is not told")

	update(t, old, func(tx *Tx) { tx.Enqueue("v", owner("v"), devs(gpu(0))) })
	format, _ := peekFormat(mustRead(t, l.StatePath()))
	require.Equal(t, FormatVersion, format, "converted at the commit")
	first, _, _ := strings.Cut(string(mustRead(t, l.JournalPath())), "\n")
	require.Contains(t, first, fmt.Sprintf(` {"journal":%d,`, journalFormat), "a journal of this build replaces it")
	anchored := snapshot(t, old)
	require.Equal(t, ClockAnchor{Wall: c.Now(), Boot: c.Boot()}, anchored.Clock)

	c.Advance(time.Second)
	c.Step(time.Hour)
	update(t, old, func(*Tx) {})
	require.Len(t, recordsOf(auditRecords(t, old), OpClockStep), 1)
	require.Equal(t, anchored.Waiters[1].FirstSeen.Add(time.Hour), snapshot(t, old).Waiters[1].FirstSeen)
}

// Recover and Reset move the times they carry by a step as any transaction
// does: a recovered drain is not ended by the step, nor a kept one.
func TestRecoverAndResetCountNoStep(t *testing.T) {
	for _, tc := range []struct {
		name string
		redo func(t *testing.T, l *Ledger)
	}{{
		name: "recover",
		redo: func(t *testing.T, l *Ledger) {
			require.NoError(t, os.Remove(l.StatePath()))
			_, err := l.Recover(context.Background(), RecoverOptions{Reason: "test"})
			require.NoError(t, err)
		},
	}, {
		name: "reset keeping what runs",
		redo: func(t *testing.T, l *Ledger) {
			_, err := l.ResetWith(context.Background(), ResetOptions{Reason: "test",
				Keep: func(Claim) (bool, string) { return true, "runs" }})
			require.NoError(t, err)
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			c := newClock()
			o := testOptions(c)
			o.DrainGrace = 2 * time.Minute
			l, err := Open(t.TempDir(), o)
			require.NoError(t, err)
			require.NoError(t, tryClaim(l, "x", gpu(0)))
			update(t, l, func(tx *Tx) { tx.MarkDraining("x", "stopped") })
			since := snapshot(t, l).Claims[0].Owner.DrainingSince
			c.Advance(time.Second)
			c.Step(time.Hour)
			tc.redo(t, l)
			st := snapshot(t, l)
			require.Len(t, st.Claims, 1)
			require.Equal(t, since.Add(time.Hour), st.Claims[0].Owner.DrainingSince)
			require.Equal(t, ClockAnchor{Wall: c.Now(), Boot: c.Boot()}, st.Clock)
			require.Len(t, recordsOf(auditRecords(t, l), OpClockStep), 1)
			require.True(t, isBusy(tryClaim(l, "y", gpu(0))), "still draining")
			c.Advance(2 * time.Minute)
			require.NoError(t, tryClaim(l, "y", gpu(0)))
		})
	}
}

// reserveForTheHead leaves GPU 0 reserved for the waiter "head": queued
// behind x's claim, which is then released.
func reserveForTheHead(t *testing.T, l *Ledger) {
	t.Helper()
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("x"), devs(gpu(0)), "env")
		require.NoError(t, err)
		tx.Enqueue("head", owner("head"), devs(gpu(0)))
	})
	update(t, l, func(tx *Tx) { tx.Release("x", "stopped") })
}
