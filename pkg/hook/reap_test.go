// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// slowAdmitter's WithdrawExited takes until its context ends: it finds the
// ledger lock held by another process (held), or it succeeds just then
// (slow), or at once (neither). underLock, when set, is each waiter's
// owner as the ledger holds it at that moment.
type slowAdmitter struct {
	held, slow bool
	underLock  map[string]ledger.Owner

	mu        sync.Mutex
	withdrawn []string
	kept      []string
}

func (a *slowAdmitter) WithdrawExited(ctx context.Context, key, _ string, runs func(ledger.Owner) bool) (bool, error) {
	if a.held || a.slow {
		<-ctx.Done()
	}
	if a.held {
		a.mu.Lock()
		a.withdrawn = append(a.withdrawn, key)
		a.mu.Unlock()
		return false, ledger.ErrLockTimeout
	}
	a.mu.Lock()
	defer a.mu.Unlock()
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
	a := &slowAdmitter{underLock: map[string]ledger.Owner{"train": again, "other": st.Waiters[1].Owner}}
	snap := func(context.Context) (ledger.State, error) { return st, nil }
	require.True(t, dropDeadWaiters(context.Background(), a, snap, t.TempDir(), "me", []devices.Device{gpu}, time.Second))
	require.Equal(t, []string{"train"}, a.kept, "train queued again from a new process: it keeps its place")
	require.Equal(t, []string{"other"}, a.withdrawn)
}

// dropDeadWaiters' budget bounds the whole pass, not each withdrawal: a
// --wait hook passes what is left before its deadline, and n dead waiters
// behind a contended ledger lock must not take n budgets (and run past the
// runtime's kill). The first withdrawal that fails ends the pass; one that
// used up the budget leaves none for the next.
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
	for _, tc := range []struct {
		name          string
		a             *slowAdmitter
		budget        time.Duration
		wantDropped   bool
		wantWithdrawn []string
	}{
		{"lock held: the first failure ends the pass", &slowAdmitter{held: true}, budget, false, keys[:1]},
		{"a withdrawal that takes the budget leaves none for the next", &slowAdmitter{slow: true}, budget, true, keys[:1]},
		{"lock free: all dropped", &slowAdmitter{}, budget, true, keys},
		{"no budget: nothing tried", &slowAdmitter{}, 0, false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			require.Equal(t, tc.wantDropped, dropDeadWaiters(context.Background(), tc.a, snap, t.TempDir(), "me", []devices.Device{gpu}, tc.budget))
			elapsed := time.Since(start)
			require.Equal(t, tc.wantWithdrawn, tc.a.withdrawn)
			// Generous: a budget per dead waiter is what the pass took when
			// each withdrawal had its own.
			require.Less(t, elapsed, time.Duration(len(keys)-2)*budget, "the pass overran its budget")
		})
	}
}
