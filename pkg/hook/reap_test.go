// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// underLockWithdrawer's WithdrawExited sees underLock as each waiter's
// owner as the ledger holds it under the lock, and records what it withdrew
// and what it kept.
type underLockWithdrawer struct {
	underLock map[string]ledger.Owner

	withdrawn []string
	kept      []string
}

func (a *underLockWithdrawer) WithdrawExited(_ context.Context, key, _ string, runs func(ledger.Owner) bool) (bool, error) {
	if o, ok := a.underLock[key]; ok && runs(o) {
		a.kept = append(a.kept, key)
		return true, nil
	}
	a.withdrawn = append(a.withdrawn, key)
	return false, nil
}

// A dead waiter found by the lock-free read is withdrawn only if, under the
// lock, its entry still records that process: a container of the same key
// that queued again meanwhile (a new process) keeps its place.
func TestDropDeadWaitersSparesAWaiterQueuedAgain(t *testing.T) {
	gpu := devices.Device{UUID: "GPU-11111111-2222-3333-4444-555555555555", Kind: devices.KindGPU, Index: "0"}
	dead := ledger.Owner{ContainerID: "train", FrontEnd: ledger.FrontEndHook, Pid: 999990, PidStart: 42}
	st := ledger.State{Waiters: []ledger.Waiter{
		{Key: "train", Seq: 1, Devices: []devices.Device{gpu}, Owner: dead},
		{Key: "other", Seq: 2, Devices: []devices.Device{gpu}, Owner: ledger.Owner{ContainerID: "other", FrontEnd: ledger.FrontEndHook, Pid: 999991, PidStart: 43}},
	}}
	again := dead
	again.Pid, again.PidStart = 999992, 44
	a := &underLockWithdrawer{underLock: map[string]ledger.Owner{"train": again, "other": st.Waiters[1].Owner}}
	snap := func(context.Context) (ledger.State, error) { return st, nil }
	require.True(t, dropDeadWaiters(context.Background(), a, snap, t.TempDir(), "me", []devices.Device{gpu}, time.Second))
	require.Equal(t, []string{"train"}, a.kept, "train queued again from a new process: it keeps its place")
	require.Equal(t, []string{"other"}, a.withdrawn)
}

// dropDeadWaiters' budget bounds the whole pass, not each withdrawal: a
// --wait hook passes what is left before its deadline, and n dead waiters
// behind a contended ledger lock must not take n budgets (and run past the
// runtime's kill). Each withdrawal gets what is left of the budget; the
// first one that fails ends the pass; one that used up the budget leaves
// none for the next. The fake withdrawal advances a fake clock by what it
// "took", so the sharing out is checked without real time passing.
func TestDropDeadWaitersBudgetBoundsThePass(t *testing.T) {
	gpu := devices.Device{UUID: "GPU-11111111-2222-3333-4444-555555555555", Kind: devices.KindGPU, Index: "0"}
	keys := []string{"dead1", "dead2", "dead3", "dead4", "dead5"}
	var st ledger.State
	for i, k := range keys {
		// No such process under the empty proc root: every waiter is dead.
		st.Waiters = append(st.Waiters, ledger.Waiter{Key: k, Seq: uint64(i + 1), Devices: []devices.Device{gpu},
			Owner: ledger.Owner{ContainerID: k, FrontEnd: ledger.FrontEndHook, Pid: 999990 + i, PidStart: 42}})
	}
	snap := func(context.Context) (ledger.State, error) { return st, nil }
	const budget = 200 * time.Millisecond
	// takesAll: the withdrawal runs until its budget ends (the lock held by
	// another process all along, or won just then).
	const takesAll = time.Hour
	for _, tc := range []struct {
		name   string
		budget time.Duration
		// takes is how long each withdrawal takes, cut at its budget as a
		// real one is; fails, whether it then fails (lock timeout).
		takes         time.Duration
		fails         bool
		wantDropped   bool
		wantWithdrawn []string
		wantBudgets   []time.Duration
	}{
		{"lock held: the first failure ends the pass", budget, takesAll, true, false,
			keys[:1], []time.Duration{budget}},
		{"a withdrawal that takes the budget leaves none for the next", budget, takesAll, false, true,
			keys[:1], []time.Duration{budget}},
		{"each withdrawal gets what is left, none once it is spent", budget, 60 * time.Millisecond, false, true,
			keys[:4], []time.Duration{budget, 140 * time.Millisecond, 80 * time.Millisecond, 20 * time.Millisecond}},
		{"lock free: all dropped, each with the whole budget", budget, 0, false, true,
			keys, []time.Duration{budget, budget, budget, budget, budget}},
		{"no budget: nothing tried", 0, 0, false, false, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clock := &fakeClock{t: t0}
			var withdrawn []string
			var budgets []time.Duration
			p := deadPass{snapshot: snap, procRoot: t.TempDir(), self: "me", now: clock.now,
				withdraw: func(_ context.Context, dead ledger.Waiter, left time.Duration) error {
					withdrawn = append(withdrawn, dead.Key)
					budgets = append(budgets, left)
					clock.advance(min(tc.takes, left))
					if tc.fails {
						return ledger.ErrLockTimeout
					}
					return nil
				}}
			require.Equal(t, tc.wantDropped, p.run(context.Background(), []devices.Device{gpu}, tc.budget))
			require.Equal(t, tc.wantWithdrawn, withdrawn)
			require.Equal(t, tc.wantBudgets, budgets, "the budget each withdrawal was given")
			require.False(t, clock.now().After(t0.Add(tc.budget)), "the pass ends within its budget")
		})
	}
}
