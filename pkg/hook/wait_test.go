// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

var t0 = time.Date(2026, 1, 2, 15, 4, 5, 0, time.UTC)

// fakeClock is advanced by the fake guard: each Admit stands for one poll.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// readyTicker always has a tick: the wait loop runs one poll per Admit
// without real time passing; the fake clock says how much time did.
type readyTicker struct {
	c       chan time.Time
	stopped bool
}

func newReadyTicker(time.Duration) ticker {
	c := make(chan time.Time)
	close(c)
	return &readyTicker{c: c}
}

func (r *readyTicker) C() <-chan time.Time { return r.c }
func (r *readyTicker) Stop()               { r.stopped = true }

// handTimer is a deadline timer under the test's control: it fires when the
// test sends on c (a nil c never fires). Real time never reaches a deadline
// on the fake clock.
type handTimer struct{ c chan time.Time }

func (h handTimer) C() <-chan time.Time { return h.c }
func (handTimer) Stop()                 {}

// newIdleTimer is a deadline timer that never fires: the waits that use it
// reach their deadline through the ticker and the fake clock.
func newIdleTimer(time.Duration) timer { return handTimer{} }

// silentTicker never ticks.
type silentTicker struct{}

func (silentTicker) C() <-chan time.Time { return nil }
func (silentTicker) Stop()               {}

type answer struct {
	d   guard.Decision
	err error
}

// fakeGuard answers Admit from a script (the last answer repeats) and
// records every call.
type fakeGuard struct {
	clock   *fakeClock
	step    time.Duration
	script  []answer
	admits  int
	onAdmit func(n int) // called before answering the n-th Admit (1-based)

	// held reports whether the n-th Admit finds the ledger lock held by
	// another process until its context ends (nil: never).
	held func(n int) bool
	// admitBounds and withdrawBounds are the deadline of each Admit's and
	// Withdraw's context, as it was when the call began.
	admitBounds, withdrawBounds []ctxBound

	withdrawn    []string
	reasons      []string
	withdrawCtxs []error // ctx.Err() seen by each Withdraw
	withdrawErr  error
}

// ctxBound is whether a context had a deadline (set) and how much real time
// was left before it.
type ctxBound struct {
	set  bool
	left time.Duration
}

func boundOf(ctx context.Context) ctxBound {
	dl, ok := ctx.Deadline()
	if !ok {
		return ctxBound{}
	}
	return ctxBound{set: true, left: time.Until(dl)}
}

func (f *fakeGuard) Admit(ctx context.Context, r guard.Request) (guard.Decision, error) {
	f.admits++
	f.admitBounds = append(f.admitBounds, boundOf(ctx))
	if f.onAdmit != nil {
		f.onAdmit(f.admits)
	}
	if f.admits > 1 {
		f.clock.advance(f.step)
	}
	if f.held != nil && f.held(f.admits) {
		<-ctx.Done()
		return guard.Decision{}, &ledger.LockError{Path: "ledger.lock", Cause: ctx.Err()}
	}
	i := min(f.admits-1, len(f.script)-1)
	a := f.script[i]
	if r.Key == "" {
		return guard.Decision{}, errors.New("request without key")
	}
	return a.d, a.err
}

func (f *fakeGuard) Withdraw(ctx context.Context, key, reason string) error {
	f.withdrawBounds = append(f.withdrawBounds, boundOf(ctx))
	f.withdrawn = append(f.withdrawn, key)
	f.reasons = append(f.reasons, reason)
	f.withdrawCtxs = append(f.withdrawCtxs, ctx.Err())
	return f.withdrawErr
}

var (
	gpu1   = devices.Device{UUID: "GPU-11111111-0000-4000-8000-000000000001", Index: "1", Kind: devices.KindGPU}
	holder = &ledger.Claim{
		Device: gpu1,
		Owner:  ledger.Owner{ContainerID: "0123456789abcdef", Namespace: "ns", Pod: "pod", Container: "ctr", FrontEnd: ledger.FrontEndNRI},
		Since:  t0.Add(-time.Hour),
	}
)

func admitted() answer { return answer{d: guard.Decision{Result: guard.Admit, Reason: "free"}} }

func queued(pos, total int) answer {
	return answer{d: guard.Decision{
		Result: guard.Queue, Reason: "busy", Position: pos, QueueLength: total,
		Busy:    []ledger.BusyDevice{{Wanted: gpu1, Holder: holder}},
		Message: fmt.Sprintf("GPU 1 (%s) is held by ns/pod/ctr (id 0123456789ab); queued at position %d of %d", gpu1.UUID, pos, total),
	}}
}

func rejected() answer {
	return answer{d: guard.Decision{Result: guard.Reject, Reason: "unknown-device", Message: "unknown GPU \"7\" in env NVIDIA_VISIBLE_DEVICES"}}
}

func failed(err error) answer { return answer{err: err} }

func newTestWaiter(f *fakeGuard, stderr *bytes.Buffer) *queueWait {
	return &queueWait{
		g:               f,
		req:             guard.Request{FrontEnd: ledger.FrontEndHook, Owner: ledger.Owner{ContainerID: "c0ffee0123456789"}, Key: "c0ffee0123456789"},
		stderr:          stderr,
		pollInterval:    time.Second,
		waitTimeout:     time.Minute,
		withdrawTimeout: time.Second,
		now:             f.clock.now,
		newTicker:       newReadyTicker,
		newTimer:        newIdleTimer,
	}
}

func TestWaiterOutcomes(t *testing.T) {
	lockTimeout := fmt.Errorf("GPU ledger busy: %w", ledger.ErrLockTimeout)
	corrupt := fmt.Errorf("GPU ledger is corrupt: %w", ledger.ErrCorrupt)
	for _, tc := range []struct {
		name         string
		script       []answer
		goneAfter    int // gone() reports true from this Admit on (0 = never)
		wantErrIs    []error
		wantErrText  []string
		wantAdmits   int
		wantWithdraw int
		wantReason   string // of the Withdraw, for the audit trail
		wantStderr   []string
	}{
		{
			name:       "free at once",
			script:     []answer{admitted()},
			wantAdmits: 1,
		},
		{
			name:       "skip (no GPU) at once",
			script:     []answer{{d: guard.Decision{Result: guard.Skip, Reason: "no-gpu"}}},
			wantAdmits: 1,
		},
		{
			name:       "queued twice then admitted",
			script:     []answer{queued(2, 2), queued(1, 1), admitted()},
			wantAdmits: 3,
			wantStderr: []string{"waiting 0s, position 2 of 2: GPU 1 (" + gpu1.UUID + ") is held by ns/pod/ctr (id 0123456789ab)", "position 1 of 1", "admitted after waiting 2s"},
		},
		{
			name:        "rejected at once: not queued, nothing to withdraw",
			script:      []answer{rejected()},
			wantErrIs:   []error{guard.ErrRejected},
			wantErrText: []string{"c0ffee0123456789", `unknown GPU "7"`},
			wantAdmits:  1,
		},
		{
			name:         "queued then rejected: leaves the queue",
			script:       []answer{queued(1, 1), rejected()},
			wantErrIs:    []error{guard.ErrRejected},
			wantAdmits:   2,
			wantWithdraw: 1,
			wantReason:   "refused: unknown-device",
		},
		{
			name:         "still queued at wait_timeout",
			script:       []answer{queued(1, 1)},
			wantErrIs:    []error{ErrWaitTimeout},
			wantErrText:  []string{"hook.wait_timeout", "1m0s", "not queued any more and holds no GPU", "held by ns/pod/ctr"},
			wantAdmits:   61, // the fake clock moves in Admit: t=0..60s, then the tick finds the deadline passed
			wantWithdraw: 1,
			wantReason:   "hook.wait_timeout 1m0s reached",
		},
		{
			name:       "ledger lock timeout is congestion: retried",
			script:     []answer{failed(lockTimeout), failed(lockTimeout), admitted()},
			wantAdmits: 3,
		},
		{
			name:         "ledger lock never obtained: times out naming the lock",
			script:       []answer{failed(lockTimeout)},
			wantErrIs:    []error{ErrWaitTimeout, ledger.ErrLockTimeout},
			wantAdmits:   61,
			wantWithdraw: 1,
		},
		{
			name:         "corrupt ledger: refused at once, withdraw attempted",
			script:       []answer{failed(corrupt)},
			wantErrIs:    []error{ledger.ErrCorrupt},
			wantErrText:  []string{"GPU admission failed, container refused"},
			wantAdmits:   1,
			wantWithdraw: 1,
		},
		{
			name:         "own container gone while queued",
			script:       []answer{queued(1, 1)},
			goneAfter:    3,
			wantErrIs:    []error{ErrContainerGone},
			wantErrText:  []string{"pid 42 is gone", "after waiting 2s", "holds no GPU: GPU 1 ("},
			wantAdmits:   3,
			wantWithdraw: 1,
			wantReason:   "container gone: its process: pid 42 is gone",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeGuard{clock: &fakeClock{t: t0}, step: time.Second, script: tc.script}
			var stderr bytes.Buffer
			w := newTestWaiter(f, &stderr)
			if tc.goneAfter > 0 {
				w.gone = func() (bool, string) { return f.admits >= tc.goneAfter, "its process: pid 42 is gone" }
			}
			err := w.run(context.Background())
			if len(tc.wantErrIs) == 0 {
				require.NoError(t, err)
			} else {
				require.Error(t, err)
				for _, target := range tc.wantErrIs {
					require.ErrorIs(t, err, target)
				}
				require.Contains(t, err.Error(), "c0ffee0123456789", "the error names the container")
			}
			for _, s := range tc.wantErrText {
				require.Contains(t, err.Error(), s)
			}
			require.Equal(t, tc.wantAdmits, f.admits, "Admit calls")
			require.Len(t, f.withdrawn, tc.wantWithdraw, "Withdraw calls")
			for _, k := range f.withdrawn {
				require.Equal(t, "c0ffee0123456789", k)
			}
			if tc.wantReason != "" {
				require.Equal(t, []string{tc.wantReason}, f.reasons)
			}
			for _, s := range tc.wantStderr {
				require.Contains(t, stderr.String(), s)
			}
		})
	}
}

// A --wait hook whose runtime kills it at its own timeout (killAt) waits
// until that timeout less the answer margin, counted from the hook's start,
// not from the start of the wait; no Admit may wait for the turnstile or the
// ledger lock past that, and the withdrawal on the way out ends 0.5 s
// before the kill.
func TestWaiterBoundedByOwnHookTimeout(t *testing.T) {
	const timeoutKey = "the timeout of this hook in the container's config.json (30s, less 2s to answer)"
	for _, tc := range []struct {
		name string
		// before is how long the hook ran before its wait began.
		before       time.Duration
		step         time.Duration
		script       []answer
		held         func(n int) bool
		wantAdmits   int
		wantWithdraw int
		wantErrText  string
	}{
		{
			name:   "the wait counts from the hook's start",
			before: 20 * time.Second, step: time.Second, script: []answer{queued(1, 1)},
			wantAdmits: 9, wantWithdraw: 1, // t=0..8s of the 28s the hook may wait
			wantErrText: "gave up waiting for the GPU after 28s (" + timeoutKey + ")",
		},
		{
			name:   "an Admit held up by the lock is cut at the deadline: nothing ran, nothing to withdraw",
			before: 28*time.Second - 50*time.Millisecond, script: []answer{queued(1, 1)},
			held:       func(int) bool { return true },
			wantAdmits: 1, wantErrText: timeoutKey,
		},
		{
			name:   "queued, then an Admit held up by the lock: cut, and the withdrawal bounded",
			before: 28*time.Second - 50*time.Millisecond, script: []answer{queued(1, 1)},
			held:       func(n int) bool { return n == 2 },
			wantAdmits: 2, wantWithdraw: 1, wantErrText: timeoutKey,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeGuard{clock: &fakeClock{t: t0}, step: tc.step, script: tc.script, held: tc.held}
			var stderr bytes.Buffer
			w := newTestWaiter(f, &stderr)
			w.started = t0.Add(-tc.before)
			w.killAt = w.started.Add(30 * time.Second)
			w.waitTimeout = 28 * time.Second
			w.timeoutKey = timeoutKey
			w.withdrawTimeout = 10 * time.Second
			deadline := w.started.Add(w.waitTimeout)

			err := w.run(context.Background())
			require.ErrorIs(t, err, ErrWaitTimeout)
			require.Contains(t, err.Error(), tc.wantErrText)
			require.NotContains(t, err.Error(), "the last attempt failed", "a cut Admit is the timeout, not ledger trouble")
			require.Equal(t, tc.wantAdmits, f.admits)
			// One-sided: real time passing meanwhile only shrinks what is
			// left, so a slow machine cannot fail these.
			for i, b := range f.admitBounds {
				require.True(t, b.set, "Admit %d waits no longer than the deadline", i+1)
				require.LessOrEqual(t, b.left, deadline.Sub(t0), "Admit %d", i+1)
			}
			require.Len(t, f.withdrawn, tc.wantWithdraw)
			for _, b := range f.withdrawBounds {
				require.True(t, b.set, "the withdrawal is bounded")
				require.LessOrEqual(t, b.left, w.killAt.Sub(f.clock.now())-hookExitReserve, "the withdrawal ends before the kill")
			}
		})
	}
}

// The refusal a --wait hook ends with is recorded within its share of what
// is left before the kill: the record and the withdrawal after it together
// end hookExitReserve before the kill, however long the ledger lock keeps
// the record out (a record cut there is dropped, never the answer delayed).
func TestWaiterRefusalRecordSharesTheAnswerMargin(t *testing.T) {
	for _, tc := range []struct {
		name   string
		script []answer
		held   func(n int) bool
	}{
		{"deadline reached while queued", []answer{queued(1, 1)}, nil},
		{"refused by policy after queueing", []answer{queued(1, 1), rejected()}, nil},
		{"the last Admit cut at the deadline", []answer{queued(1, 1)}, func(n int) bool { return n == 2 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeGuard{clock: &fakeClock{t: t0}, step: time.Second, script: tc.script, held: tc.held}
			var stderr bytes.Buffer
			w := newTestWaiter(f, &stderr)
			w.started = t0.Add(-(28*time.Second - time.Second))
			w.killAt = w.started.Add(30 * time.Second)
			w.waitTimeout = 28 * time.Second
			w.withdrawTimeout = 10 * time.Second
			var record ctxBound
			var recordAt time.Time
			w.onRefuse = func(ctx context.Context, _ guard.Decision, _ string) {
				recordAt = f.clock.now()
				record = boundOf(ctx)
				// The ledger lock keeps the record out for as long as it
				// may wait.
				f.clock.advance(record.left)
			}

			require.Error(t, w.run(context.Background()))
			require.True(t, record.set, "the refusal's record is bounded by the kill")
			left := w.killAt.Add(-hookExitReserve).Sub(recordAt)
			require.LessOrEqual(t, record.left, left/2, "half of what is left is the record's")
			require.Len(t, f.withdrawBounds, 1, "it leaves the queue")
			require.True(t, f.withdrawBounds[0].set)
			require.LessOrEqual(t, record.left+f.withdrawBounds[0].left, left, "record and withdrawal end before the kill")
		})
	}
}

// hook.poll_interval may be as long as a minute, longer than the margin
// between the deadline of a --wait hook and the runtime's kill: the wait
// wakes at its deadline, not at the next poll, and gives up (leaving the
// queue) before the kill.
func TestWaiterWakesAtDeadlineNotNextPoll(t *testing.T) {
	f := &fakeGuard{clock: &fakeClock{t: t0}, script: []answer{queued(1, 1)}}
	var stderr bytes.Buffer
	w := newTestWaiter(f, &stderr)
	w.pollInterval = time.Minute
	w.started = t0
	// A hook timeout of 2.5 s: the wait may take 0.5 s of it.
	w.killAt = w.started.Add(2500 * time.Millisecond)
	w.waitTimeout = w.killAt.Sub(w.started) - hookAnswerMargin
	// The next poll never comes: only the deadline timer can end the wait.
	var polls []time.Duration
	w.newTicker = func(d time.Duration) ticker { polls = append(polls, d); return silentTicker{} }
	armed := make(chan time.Duration, 1)
	fire := make(chan time.Time)
	w.newTimer = func(d time.Duration) timer { armed <- d; return handTimer{c: fire} }

	done := make(chan error, 1)
	go func() { done <- w.run(context.Background()) }()
	require.Equal(t, 500*time.Millisecond, testwait.Receive(t, armed, "deadline timer"), "armed for the time left, not the poll interval")
	// The deadline comes: the clock reaches it and the timer fires.
	f.clock.advance(500 * time.Millisecond)
	select {
	case fire <- t0.Add(500 * time.Millisecond):
	case <-time.After(time.Minute):
		t.Fatal("the wait does not listen to its deadline timer")
	}
	err := testwait.Receive(t, done, "end of the wait")
	require.ErrorIs(t, err, ErrWaitTimeout)
	require.Equal(t, []time.Duration{time.Minute}, polls)
	require.Equal(t, 1, f.admits, "woken by the deadline, not by a poll")
	require.Equal(t, []string{"c0ffee0123456789"}, f.withdrawn, "it leaves the queue")
}

// The withdrawal on the way out is withdrawTimeout, or, with the runtime's
// kill ahead, what is left before it less hookExitReserve (at least
// minWithdraw).
func TestWithdrawBudget(t *testing.T) {
	for _, tc := range []struct {
		name   string
		killAt time.Time
		want   time.Duration
	}{
		{"no kill ahead", time.Time{}, 10 * time.Second},
		{"kill far ahead", t0.Add(time.Minute), 10 * time.Second},
		{"at the deadline: the answer margin less the exit reserve", t0.Add(hookAnswerMargin), hookAnswerMargin - hookExitReserve},
		{"kill passed", t0.Add(-time.Second), minWithdraw},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := &queueWait{withdrawTimeout: 10 * time.Second, killAt: tc.killAt}
			require.Equal(t, tc.want, w.withdrawBudget(t0))
		})
	}
}

func TestWaiterCancelledLeavesQueueWithLiveContext(t *testing.T) {
	f := &fakeGuard{clock: &fakeClock{t: t0}, step: time.Second, script: []answer{queued(2, 3)}}
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	f.onAdmit = func(n int) {
		if n == 4 {
			cancel(errors.New("received terminated"))
		}
	}
	var stderr bytes.Buffer
	err := newTestWaiter(f, &stderr).run(ctx)
	require.ErrorIs(t, err, ErrCancelled)
	require.Contains(t, err.Error(), "received terminated")
	require.Contains(t, err.Error(), "not queued any more")
	require.Equal(t, 4, f.admits, "no Admit after the cancellation")
	require.Equal(t, []string{"c0ffee0123456789"}, f.withdrawn)
	require.Equal(t, []error{nil}, f.withdrawCtxs, "Withdraw must run under a context that is not cancelled")
	require.Equal(t, []string{"hook cancelled: received terminated"}, f.reasons)
}

func TestWaiterWithdrawFailureIsReportedNotMasking(t *testing.T) {
	f := &fakeGuard{clock: &fakeClock{t: t0}, step: time.Second, script: []answer{queued(1, 1)},
		withdrawErr: errors.New("ledger lock held by pid 7")}
	var stderr bytes.Buffer
	w := newTestWaiter(f, &stderr)
	w.waitTimeout = 3 * time.Second
	err := w.run(context.Background())
	require.ErrorIs(t, err, ErrWaitTimeout, "the reason for giving up stays the error")
	require.Contains(t, stderr.String(), "could not leave the queue")
	require.Contains(t, stderr.String(), "queue_ttl")
}

func TestWaiterProgressThrottled(t *testing.T) {
	// 25 polls one second apart: position 3 until the 13th, then 2.
	script := make([]answer, 0, 26)
	for i := range 25 {
		if i < 12 {
			script = append(script, queued(3, 3))
		} else {
			script = append(script, queued(2, 2))
		}
	}
	script = append(script, admitted())
	f := &fakeGuard{clock: &fakeClock{t: t0}, step: time.Second, script: script}
	var stderr bytes.Buffer
	require.NoError(t, newTestWaiter(f, &stderr).run(context.Background()))

	lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
	var got []string
	for _, l := range lines {
		require.True(t, strings.HasPrefix(l, "nri-gpu-guard: container c0ffee012345 "), l)
		got = append(got, strings.SplitN(strings.TrimPrefix(l, "nri-gpu-guard: container c0ffee012345 "), ": ", 2)[0])
	}
	require.Equal(t, []string{
		"waiting 0s, position 3 of 3",  // first answer
		"waiting 10s, position 3 of 3", // unchanged for 10s
		"waiting 12s, position 2 of 2", // position changed
		"waiting 22s, position 2 of 2", // unchanged for 10s again
		"admitted after waiting 25s",
	}, got)
}

func TestProgressLine(t *testing.T) {
	gpu2 := devices.Device{UUID: "GPU-22222222-0000-4000-8000-000000000002", Index: "2", Kind: devices.KindGPU}
	mig := devices.Device{UUID: "MIG-22222222-0000-4000-9000-000000000000", Index: "2:0", Kind: devices.KindMIG, Parent: gpu2.UUID}
	head := ledger.Waiter{Key: "ml/uid-other/app", Seq: 1, Devices: []devices.Device{gpu2},
		Owner: ledger.Owner{ContainerID: "0ther00000000001", Namespace: "ml", Pod: "other", Container: "app", FrontEnd: ledger.FrontEndNRI}}
	migHolder := &ledger.Claim{Device: mig, Owner: holder.Owner, Since: holder.Since}
	for _, tc := range []struct {
		name string
		d    guard.Decision
		want string
	}{
		{
			name: "held",
			d:    queued(2, 3).d,
			want: "nri-gpu-guard: container c0ffee012345 waiting 30s, position 2 of 3: GPU 1 (" + gpu1.UUID +
				") is held by ns/pod/ctr (id 0123456789ab) since 2026-01-02T14:04:05Z (1h0m0s ago)",
		},
		{
			name: "held through a MIG instance",
			d: guard.Decision{Result: guard.Queue, Position: 1, QueueLength: 1, Busy: []ledger.BusyDevice{{
				Wanted: gpu2, Holder: migHolder,
			}}},
			want: "nri-gpu-guard: container c0ffee012345 waiting 30s, position 1 of 1: GPU 2 (" + gpu2.UUID +
				") is held by ns/pod/ctr (id 0123456789ab) through MIG 2:0 (" + mig.UUID + ") since 2026-01-02T14:04:05Z (1h0m0s ago)",
		},
		{
			name: "reserved through the GPU",
			d: guard.Decision{Result: guard.Queue, Position: 2, QueueLength: 2, Busy: []ledger.BusyDevice{{
				Wanted:      mig,
				Reservation: &ledger.Reservation{Device: gpu2, For: "abc", Until: t0.Add(time.Minute)},
			}}},
			want: "nri-gpu-guard: container c0ffee012345 waiting 30s, position 2 of 2: MIG 2:0 (" + mig.UUID +
				") is reserved for abc through GPU 2 (" + gpu2.UUID + ") (earlier in the queue) until 2026-01-02T15:05:05Z (1m0s left)",
		},
		{
			name: "kept for the head of the queue",
			d: guard.Decision{Result: guard.Queue, Position: 2, QueueLength: 2, Busy: []ledger.BusyDevice{{
				Wanted: mig, KeptFor: &head, Through: gpu2,
			}}},
			want: "nri-gpu-guard: container c0ffee012345 waiting 30s, position 2 of 2: MIG 2:0 (" + mig.UUID +
				") is kept for ml/other/app (id 0ther0000000) (earlier in the queue, first in line for GPU 2 (" + gpu2.UUID +
				"), which waits until the rest of it is free)",
		},
		{
			name: "no busy detail: the message",
			d:    guard.Decision{Result: guard.Queue, Position: 1, QueueLength: 1, Message: "busy somehow"},
			want: "nri-gpu-guard: container c0ffee012345 waiting 30s, position 1 of 1: busy somehow",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			line := progressLine("container c0ffee012345", tc.d, t0, 30*time.Second)
			require.Equal(t, tc.want, line)
			if len(tc.d.Busy) > 0 {
				// One wording: what the give-up errors say too, and the
				// guard's own.
				require.Equal(t, ": "+tc.d.BusyText(t0), busyNow(tc.d, t0))
				require.True(t, strings.HasSuffix(line, busyNow(tc.d, t0)), line)
			}
		})
	}
}
