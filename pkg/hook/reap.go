// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// retryPause is the pause between two attempts of a write that hit a lock
// timeout. The ledger lock is polled, not queued for, so a process that
// gives up after one timeout can lose every round to luckier ones; retrying
// after a short pause is what makes a withdrawal certain.
const retryPause = 20 * time.Millisecond

// retryLocked runs fn until it returns anything but a lock timeout, or until
// budget has passed (then the last error is returned). The context of fn is
// not cancelled by ctx: a hook on its way out must still leave the queue.
func retryLocked(ctx context.Context, budget time.Duration, fn func(ctx context.Context) error) error {
	return retryLockedWhile(ctx, budget, nil, fn)
}

// retryLockedWhile is retryLocked that also stops, with the last error, once
// more (nil: never asked) reports false after a lock timeout: a deadline of
// the hook's, read on the hook's clock (env.ahead). budget alone is read on
// the system's clock, and a deadline placed from the hook's start must hold
// on the clock that placed it.
func retryLockedWhile(ctx context.Context, budget time.Duration, more func() bool, fn func(ctx context.Context) error) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), budget)
	defer cancel()
	for {
		err := fn(ctx)
		if err == nil || !errors.Is(err, ledger.ErrLockTimeout) || (more != nil && !more()) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(retryPause):
		}
	}
}

// withdrawReliably takes key out of the queue, retrying lock timeouts within
// budget. A waiter that is not queued any more is no error.
// A caller told to stop (ctx done) gets at most stopWithdrawBudget, so that
// SIGTERM ends it within a second even while another process holds the
// lock; what it cannot withdraw is dropped as a dead waiter by the next
// request for its GPUs once its process has exited, or by queue_ttl.
func withdrawReliably(ctx context.Context, g admitter, key, reason string, budget time.Duration) error {
	err := retryLocked(ctx, withdrawBudget(ctx, budget), func(ctx context.Context) error { return g.Withdraw(ctx, key, reason) })
	if errors.Is(err, ledger.ErrNotFound) {
		return nil
	}
	return err
}

// withdrawBudget is budget, or stopWithdrawBudget if shorter once ctx is
// done (the caller was told to stop).
func withdrawBudget(ctx context.Context, budget time.Duration) time.Duration {
	if ctx.Err() != nil {
		return min(budget, stopWithdrawBudget)
	}
	return budget
}

// stopWithdrawBudget bounds the withdrawal of a waiter told to stop.
const stopWithdrawBudget = 500 * time.Millisecond

// deadWaiters lists the hook waiters in st whose process is gone: the
// container process a create-runtime hook waited for, or the
// `gpu-guard-ctl run` process that waits for a ticket. Nobody will ever use
// what such a waiter would be given, but until queue_ttl drops it, it keeps
// its place and gets the reservation of a freed GPU, which then stays idle.
// Only waiters that stand in the way of want are checked (self excluded),
// and only hook waiters: an NRI waiter has no process while it waits (the
// kubelet retries it), so its pid says nothing.
func deadWaiters(st ledger.State, procRoot, self string, want []devices.Device) []ledger.Waiter {
	var out []ledger.Waiter
	checker := liveness.New("", procRoot)
	for _, w := range st.Waiters {
		if w.Key == self || w.Owner.FrontEnd != ledger.FrontEndHook || w.Owner.Pid <= 0 || w.Owner.PidStart == 0 {
			continue
		}
		if !anyConflicts(w.Devices, want) {
			continue
		}
		if gone, _ := checker.Exited(liveness.Process{Pid: w.Owner.Pid, PidStart: w.Owner.PidStart}); gone {
			out = append(out, w)
		}
	}
	return out
}

// deadWithdrawer is what dropDeadWaiters needs from *guard.Guard.
type deadWithdrawer interface {
	WithdrawExited(ctx context.Context, key, reason string, runs func(ledger.Owner) bool) (bool, error)
}

// withdrawDead takes the waiter of key out of the queue if, under the
// ledger lock, it is still the dead process found by a lock-free read: a
// container or ticket of the same key may have queued again since (a new
// process), and it keeps its place. Lock timeouts are retried within
// budget; a waiter gone meanwhile is no error.
func withdrawDead(ctx context.Context, g deadWithdrawer, dead ledger.Waiter, budget time.Duration) error {
	reason := "waiter gone: its process " + strconv.Itoa(dead.Owner.Pid) + " exited"
	queuedAgain := func(o ledger.Owner) bool {
		return o.Pid != dead.Owner.Pid || o.PidStart != dead.Owner.PidStart
	}
	return retryLocked(ctx, withdrawBudget(ctx, budget), func(ctx context.Context) error {
		_, err := g.WithdrawExited(ctx, dead.Key, reason, queuedAgain)
		return err
	})
}

// dropDeadWaiters withdraws the dead waiters that stand in the way of want
// (see deadWaiters) and reports whether it dropped any. budget bounds the
// whole pass, not each withdrawal: a --wait hook passes what is left before
// its deadline, which n dead waiters behind a contended ledger lock must not
// turn into n times that. Each withdrawal gets what is left of the budget,
// and the first one that fails ends the pass (a lock held past the budget
// would hold up the next one too); what is left is dropped by a later pass.
func dropDeadWaiters(ctx context.Context, g deadWithdrawer, snapshot func(context.Context) (ledger.State, error),
	procRoot, self string, want []devices.Device, budget time.Duration) bool {
	p := deadPass{
		snapshot: snapshot,
		procRoot: procRoot,
		self:     self,
		now:      time.Now,
		withdraw: func(ctx context.Context, dead ledger.Waiter, budget time.Duration) error {
			return withdrawDead(ctx, g, dead, budget)
		},
	}
	return p.run(ctx, want, budget)
}

// deadPass is one pass of dropDeadWaiters. now and withdraw are fields so
// that a test can check how the budget is shared out without real time
// passing: dropDeadWaiters sets time.Now and withdrawDead.
type deadPass struct {
	snapshot       func(context.Context) (ledger.State, error)
	procRoot, self string
	now            func() time.Time
	// withdraw withdraws one dead waiter within budget.
	withdraw func(ctx context.Context, dead ledger.Waiter, budget time.Duration) error
}

func (p deadPass) run(ctx context.Context, want []devices.Device, budget time.Duration) bool {
	if p.snapshot == nil || len(want) == 0 || budget <= 0 {
		return false
	}
	deadline := p.now().Add(budget)
	st, err := p.snapshot(ctx)
	if err != nil {
		return false
	}
	dropped := false
	for _, w := range deadWaiters(st, p.procRoot, p.self, want) {
		left := deadline.Sub(p.now())
		if left <= 0 {
			break
		}
		if p.withdraw(ctx, w, left) != nil {
			break
		}
		dropped = true
	}
	return dropped
}

func anyConflicts(a, b []devices.Device) bool {
	for _, x := range a {
		for _, y := range b {
			if devices.Conflicts(x, y) {
				return true
			}
		}
	}
	return false
}
