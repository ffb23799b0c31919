// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// turnstileName is the file in the ledger directory that hook processes
// queue on before they write the ledger.
const turnstileName = "hook.turnstile"

// A turnstile lines hook processes up before they take the ledger lock. The
// ledger lock is polled (flock cannot time out), so forty hooks started at
// once all poll it and wake every few milliseconds; on a loaded host the
// holder then waits for a CPU while they spin, and the last ones reach
// lock_timeout although each write takes milliseconds. A blocking flock on
// the turnstile puts the others to sleep in the kernel instead, so that at
// most one hook at a time competes with the NRI daemon for the ledger lock.
//
// It is an optimisation, never a condition: a hook that cannot open the file
// or enter within the bound goes on to the ledger lock as before, which stays
// the only thing that makes a write safe.
type turnstile struct {
	path    string
	timeout time.Duration
	// beforeWait, if set, is called before enter blocks.
	beforeWait func()
}

// enter waits up to t.timeout (or ctx) for the turnstile and returns the
// function that leaves it. On a timeout the blocked flock is left to finish
// in the background, where it is released at once.
func (t turnstile) enter(ctx context.Context) func() {
	f, err := os.OpenFile(t.path, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return func() {}
	}
	// Free (the common case): taken at once, without a goroutine and the
	// thread its blocking flock would need.
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err == nil {
		return func() { _ = f.Close() }
	}
	if t.beforeWait != nil {
		t.beforeWait()
	}
	var (
		mu        sync.Mutex
		abandoned bool
	)
	got := make(chan error, 1)
	go func() {
		err := flockRetry(f, syscall.LOCK_EX)
		mu.Lock()
		defer mu.Unlock()
		if abandoned {
			_ = f.Close() // closing drops the lock, if it was taken
			return
		}
		got <- err
	}()
	timer := time.NewTimer(t.timeout)
	defer timer.Stop()
	select {
	case err := <-got:
		if err != nil {
			_ = f.Close()
			return func() {}
		}
		return func() { _ = f.Close() }
	case <-timer.C:
	case <-ctx.Done():
	}
	mu.Lock()
	defer mu.Unlock()
	select {
	case err := <-got: // taken just now
		if err != nil {
			_ = f.Close()
			return func() {}
		}
		return func() { _ = f.Close() }
	default:
		abandoned = true
		return func() {}
	}
}

func flockRetry(f *os.File, how int) error {
	for {
		err := syscall.Flock(int(f.Fd()), how)
		if !errors.Is(err, syscall.EINTR) {
			return err
		}
	}
}

// linedUp is a guardAPI whose ledger writes go through a turnstile.
type linedUp struct {
	guardAPI
	ts turnstile
}

func lineUp(g guardAPI, ts turnstile) guardAPI {
	return linedUp{guardAPI: g, ts: ts}
}

func (l linedUp) Admit(ctx context.Context, r guard.Request) (guard.Decision, error) {
	defer l.ts.enter(ctx)()
	return l.guardAPI.Admit(ctx, r)
}

func (l linedUp) AdmitIfFree(ctx context.Context, r guard.Request) (guard.Decision, error) {
	defer l.ts.enter(ctx)()
	return l.guardAPI.AdmitIfFree(ctx, r)
}

func (l linedUp) Withdraw(ctx context.Context, key, reason string) error {
	defer l.ts.enter(ctx)()
	return l.guardAPI.Withdraw(ctx, key, reason)
}

func (l linedUp) RemovedExited(ctx context.Context, o ledger.Owner, runs func(ledger.Owner) bool) ([]ledger.Claim, error) {
	defer l.ts.enter(ctx)()
	return l.guardAPI.RemovedExited(ctx, o, runs)
}

func (l linedUp) WithdrawExited(ctx context.Context, key, reason string, runs func(ledger.Owner) bool) (bool, error) {
	defer l.ts.enter(ctx)()
	return l.guardAPI.WithdrawExited(ctx, key, reason, runs)
}

// update runs a ledger transaction of the hook itself (ticket handover and
// release) through the turnstile when g has one.
func update(ctx context.Context, g guardAPI, fn func(tx *ledger.Tx) error) error {
	if l, ok := g.(linedUp); ok {
		defer l.ts.enter(ctx)()
	}
	if err := g.Ledger().Update(ctx, fn); err != nil {
		return fmt.Errorf("update the GPU ledger: %w", err)
	}
	return nil
}
