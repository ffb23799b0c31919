// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// Errors a create-runtime hook returns (wrapped, with the container, the
// devices and the guard's message) when it gives up waiting.
var (
	// ErrWaitTimeout: the container was still queued after hook.wait_timeout.
	ErrWaitTimeout = errors.New("gave up waiting for the GPU")
	// ErrCancelled: the hook was told to stop (SIGTERM/SIGINT) while waiting.
	ErrCancelled = errors.New("hook cancelled while waiting for the GPU")
	// ErrContainerGone: the container (or the runtime that ran the hook)
	// disappeared while its hook waited.
	ErrContainerGone = errors.New("container gone while waiting for the GPU")
	// ErrHandOver, as the cause of a run's cancelled context (MainAs),
	// stops a waiting run without withdrawing its queue entry: the hook
	// process it ran for takes the wait over (the hook server stopping
	// hands each wait still going back to its relay, which runs the hook
	// itself; the hook finds its entry and keeps its place).
	ErrHandOver = errors.New("the wait is handed over to the hook process")
)

// progressEvery is how often a waiting hook repeats its progress line when
// its queue position does not change. The line goes to the runtime's log (or
// into its error when the hook fails), so one every poll would drown it.
const progressEvery = 10 * time.Second

// admitter is the part of *guard.Guard that a create-runtime hook uses.
type admitter interface {
	Admit(ctx context.Context, r guard.Request) (guard.Decision, error)
	Withdraw(ctx context.Context, key, reason string) error
}

// ticker is the part of *time.Ticker (and timer of *time.Timer) the wait
// loop uses; tests drive it.
type ticker interface {
	C() <-chan time.Time
	Stop()
}

type realTicker struct{ t *time.Ticker }

func (r realTicker) C() <-chan time.Time { return r.t.C }
func (r realTicker) Stop()               { r.t.Stop() }

func newRealTicker(d time.Duration) ticker { return realTicker{time.NewTicker(d)} }

// timer is the part of *time.Timer the wait loop uses, the same as a
// ticker's; tests fire it.
type timer = ticker

type realTimer struct{ t *time.Timer }

func (r realTimer) C() <-chan time.Time { return r.t.C }
func (r realTimer) Stop()               { r.t.Stop() }

func newRealTimer(d time.Duration) timer { return realTimer{time.NewTimer(d)} }

// waiter runs the admission of one create-runtime hook: one Admit, then, while
// the guard answers Queue, one Admit per poll interval until admitted,
// refused, timed out, cancelled, or the container is gone.
type queueWait struct {
	g      admitter
	req    guard.Request
	stderr io.Writer

	pollInterval time.Duration
	// waitTimeout bounds the wait, counted from started (zero: from run).
	waitTimeout time.Duration
	started     time.Time
	// withdrawTimeout bounds the Withdraw done on the way out (with a context
	// that is no longer cancelled, since the hook's own may be).
	withdrawTimeout time.Duration
	// killAt, when set, is when the runtime kills this hook (its own
	// timeout): no Admit runs past the deadline of the wait, and the
	// withdrawal on the way out ends hookExitReserve before killAt.
	killAt time.Time

	now       func() time.Time
	newTicker func(time.Duration) ticker
	newTimer  func(time.Duration) timer
	// gone reports whether the container or the runtime that ran this hook
	// has disappeared, and why. nil = never.
	gone func() (bool, string)
	// watch, when set, skips the Admits that cannot change the answer;
	// nil = Admit at every poll.
	watch *watcher
	// dropDead, when set, withdraws the waiters ahead whose process is gone
	// (see dropDeadWaiters), all of them within budget; it runs before each
	// Admit after a Queue.
	dropDead func(ctx context.Context, want []devices.Device, budget time.Duration) bool

	// subject names the requester in messages ("container <id>" if empty);
	// timeoutKey names the setting that bounds the wait ("hook.wait_timeout"
	// if empty).
	subject, timeoutKey string
	// procRoot is where process liveness is read (/proc).
	procRoot string
	// onRefuse, when set, is told of a refusal the wait ends with (a
	// Reject, or the deadline reached while queued, with the last
	// decision) and the reason for the audit trail. With the runtime's
	// kill ahead (killAt), ctx's deadline is its share of what is left
	// (refuseContext).
	onRefuse func(ctx context.Context, d guard.Decision, reason string)
}

// refuseContext is the context onRefuse gets at now: ctx itself, or, with
// the runtime's kill ahead, ctx with a deadline at half of what is left
// before hookExitReserve ahead of the kill. The refusal's record and the
// withdrawal after it (withdrawBudget) share that time: neither can push
// the answer past the kill, and a record that the ledger lock keeps out
// for its whole share leaves the withdrawal, which frees the container's
// place in the queue, the other half.
func (w *queueWait) refuseContext(ctx context.Context, now time.Time) (context.Context, context.CancelFunc) {
	if w.killAt.IsZero() {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, w.killAt.Add(-hookExitReserve).Sub(now)/2)
}

// refused tells onRefuse, if set, of the refusal d (see refuseContext).
func (w *queueWait) refused(ctx context.Context, d guard.Decision, reason string) {
	if w.onRefuse == nil {
		return
	}
	rctx, cancel := w.refuseContext(ctx, w.now())
	defer cancel()
	w.onRefuse(rctx, d, reason)
}

// run returns nil when the container may start (admitted, or nothing to
// check) and a self-contained error otherwise. On every error return after
// the request was queued, the waiter entry has been withdrawn.
func (w *queueWait) run(ctx context.Context) error {
	who := w.who()
	start := w.started
	if start.IsZero() {
		start = w.now()
	}
	deadline := start.Add(w.waitTimeout)
	// With the runtime's kill ahead (killAt), no ledger write of the wait
	// runs past its deadline; otherwise each is bounded by its own lock
	// timeouts, and the last one may still admit.
	var bound time.Time
	if !w.killAt.IsZero() {
		bound = deadline
	}
	queued := false
	var last guard.Decision
	var lastErr error
	var lastPrinted time.Time
	lastPos := -1

	// fail leaves the queue (reason goes to the audit trail) and returns err.
	fail := func(err error, reason string) error {
		if queued && (ctx.Err() == nil || !errors.Is(context.Cause(ctx), ErrHandOver)) {
			w.withdraw(ctx, reason)
		}
		return err
	}
	// gaveUp is the error of a waiter that stops waiting: the real time it
	// waited and what stood in its way when it gave up, never a queue
	// position (it is not queued any more).
	gaveUp := func(sentinel error, why string) error {
		now := w.now()
		return fmt.Errorf("%s: %w (%s) after waiting %s; it is not queued any more and holds no GPU%s",
			who, sentinel, why, now.Sub(start).Round(time.Second), busyNow(last, now))
	}
	// timedOut leaves the queue with the refusal of a wait that reached its
	// deadline.
	timedOut := func(now time.Time) error {
		err := fmt.Errorf("%s refused: %w after %s (%s); it is not queued any more and holds no GPU; "+
			"free the GPU or raise %s%s", who, ErrWaitTimeout, now.Sub(start).Round(time.Second), w.timeoutName(), w.timeoutName(), busyNow(last, now))
		if lastErr != nil {
			err = fmt.Errorf("%w; the last attempt failed: %w", err, lastErr)
		}
		reason := fmt.Sprintf("%s %s reached", w.timeoutName(), w.waitTimeout)
		w.refused(ctx, last, "busy, gave up waiting ("+reason+"): "+last.Message)
		return fail(err, reason)
	}

	var tick ticker
	// expiry fires at the deadline: a poll interval may be longer than
	// what is left (up to a minute, and the runtime's kill may be 2 s past
	// the deadline), so the loop does not wait for the next tick to notice.
	var expiry timer
	defer func() {
		if tick != nil {
			tick.Stop()
		}
		if expiry != nil {
			expiry.Stop()
		}
	}()
	progress := func(d guard.Decision, now time.Time) {
		if d.Position != lastPos || now.Sub(lastPrinted) >= progressEvery {
			_, _ = fmt.Fprintln(w.stderr, progressLine(w.shortWho(), d, now, now.Sub(start)))
			lastPos = d.Position
			lastPrinted = now
		}
	}
	for {
		if w.watch != nil {
			w.watch.before(ctx, w.req.Key)
		}
		if last.Result == guard.Queue && w.dropDead != nil {
			// A waiter ahead whose process is gone would keep its place
			// (and a freed GPU's reservation) until queue_ttl.
			budget := w.withdrawTimeout
			if !bound.IsZero() {
				budget = min(budget, bound.Sub(w.now()))
			}
			if budget > 0 {
				w.dropDead(ctx, devicesOf(last.Devices), budget)
			}
		}
		d, late, err := w.admit(ctx, bound)
		if err == nil && w.watch != nil {
			w.watch.after(w.req.Key)
		}
		if err != nil && !neverRan(err) {
			// The outcome is unknown (the guard may have queued the request
			// before failing): leave the queue on the way out in any case.
			// Not when the lock was never taken: then nothing ran.
			queued = true
		}
		switch {
		case err != nil && ctx.Err() != nil:
			return fail(gaveUp(ErrCancelled, context.Cause(ctx).Error()), "hook cancelled: "+context.Cause(ctx).Error())
		case err != nil && late:
			// Cut at the deadline while it waited for the turnstile or
			// the ledger lock: the wait timed out (lastErr stays the
			// last ledger trouble, if any).
			return timedOut(w.now())
		case err != nil && errors.Is(err, ledger.ErrLockTimeout):
			// Another process holds the ledger lock for longer than
			// lock_timeout; that is congestion, not a decision. Try again
			// within the wait budget.
			lastErr = err
		case err != nil:
			return fail(fmt.Errorf("%s: GPU admission failed, container refused: %w", who, err), "hook failed: "+firstLine(err.Error()))
		default:
			lastErr = nil
			switch d.Result {
			case guard.Admit, guard.Skip:
				if queued {
					_, _ = fmt.Fprintf(w.stderr, "nri-gpu-guard: %s admitted after waiting %s\n",
						w.shortWho(), w.now().Sub(start).Round(time.Second))
				}
				return nil
			case guard.Queue:
				queued = true
				last = d
				progress(d, w.now())
			default: // Reject, or a result this build does not know: refuse.
				w.refused(ctx, d, "refused ("+d.Reason+"): "+d.Message)
				return fail(fmt.Errorf("%s: %w", who, decisionErr(d)), "refused: "+d.Reason)
			}
		}

		if tick == nil {
			tick = w.newTicker(w.pollInterval)
			expiry = w.newTimer(deadline.Sub(w.now()))
		}
		// Poll until another Admit is due (every poll without a watcher),
		// or until the deadline.
		for {
			select {
			case <-ctx.Done():
			case <-tick.C():
			case <-expiry.C():
			}
			// Checked after the select too: when both are ready, select
			// picks at random, and a cancelled hook must not claim.
			if ctx.Err() != nil {
				return fail(gaveUp(ErrCancelled, context.Cause(ctx).Error()), "hook cancelled: "+context.Cause(ctx).Error())
			}
			if w.gone != nil {
				if gone, why := w.gone(); gone {
					return fail(gaveUp(ErrContainerGone, why), "container gone: "+why)
				}
			}
			now := w.now()
			if !now.Before(deadline) {
				return timedOut(now)
			}
			if last.Result == guard.Queue {
				progress(last, now)
			}
			if w.watch == nil || lastErr != nil {
				break
			}
			if due, _ := w.watch.due(ctx, w.req.Key); due {
				break
			}
		}
	}
}

// admit is one Admit that waits for the turnstile and the ledger lock no
// longer than until bound (zero: no bound); late reports that it was cut
// there (ctx itself not done).
func (w *queueWait) admit(ctx context.Context, bound time.Time) (d guard.Decision, late bool, err error) {
	if bound.IsZero() {
		d, err = w.g.Admit(ctx, w.req)
		return d, false, err
	}
	actx, cancel := context.WithTimeout(ctx, bound.Sub(w.now()))
	defer cancel()
	d, err = w.g.Admit(actx, w.req)
	return d, err != nil && ctx.Err() == nil && actx.Err() != nil, err
}

// who names the requester in messages: "container <id>" unless set.
func (w *queueWait) who() string {
	if w.subject != "" {
		return w.subject
	}
	return "container " + w.req.Owner.ContainerID
}

func (w *queueWait) shortWho() string {
	if w.subject != "" {
		return w.subject
	}
	return "container " + ledger.ShortID(w.req.Owner.ContainerID)
}

func (w *queueWait) timeoutName() string {
	if w.timeoutKey != "" {
		return w.timeoutKey
	}
	return "hook.wait_timeout"
}

// withdraw removes the waiter entry on the way out. The hook's own context
// may be cancelled already, so it runs under a fresh, bounded one, and a lock
// timeout is retried within withdrawTimeout: a waiter that gave up must not
// stay queued because others held the lock at that moment. A failure is
// reported on stderr (queue_ttl, or the next waiter's liveness check, drops
// the entry in the end) and does not replace the error that made the hook
// give up.
func (w *queueWait) withdraw(ctx context.Context, reason string) {
	budget := w.withdrawBudget(w.now())
	if err := withdrawReliably(ctx, w.g, w.req.Key, reason, budget); err != nil {
		next := "policy.queue_ttl will drop the entry"
		if ctx.Err() != nil || budget < w.withdrawTimeout {
			next = "the next request for these GPUs drops the entry once this process has exited; policy.queue_ttl at the latest"
		}
		_, _ = fmt.Fprintf(w.stderr, "nri-gpu-guard: %s: could not leave the queue within %s (%s): %v\n",
			w.shortWho(), withdrawBudget(ctx, budget), next, err)
	}
}

// minWithdraw is the least a withdrawal is given, even past killAt.
const minWithdraw = 100 * time.Millisecond

// withdrawBudget is withdrawTimeout, or, for a hook the runtime kills at
// killAt, what is left until hookExitReserve before it (at least
// minWithdraw): a withdrawal cut short is dropped later (see deadWaiters),
// one killed in its transaction leaves no refusal line.
func (w *queueWait) withdrawBudget(now time.Time) time.Duration {
	if w.killAt.IsZero() {
		return w.withdrawTimeout
	}
	return min(w.withdrawTimeout, max(w.killAt.Sub(now)-hookExitReserve, minWithdraw))
}

// busyNow describes what stood in the way at the last answer, without a
// queue position, in the guard's words with ages counted at now (see
// guard.Decision.BusyText): ": GPU 1 (GPU-…) is held by ns/pod/ctr (id …)
// since … (… ago)".
func busyNow(d guard.Decision, now time.Time) string {
	if len(d.Busy) == 0 {
		return ""
	}
	return ": " + d.BusyText(now)
}

func devicesOf(rs []devices.Resolved) []devices.Device {
	out := make([]devices.Device, len(rs))
	for i, r := range rs {
		out[i] = r.Device
	}
	return out
}

// decisionErr is d.Err(), never nil for a refusal.
func decisionErr(d guard.Decision) error {
	if err := d.Err(); err != nil {
		return err
	}
	if d.Message != "" {
		return fmt.Errorf("%w: %s", guard.ErrRejected, d.Message)
	}
	return fmt.Errorf("%w (decision %q, reason %q)", guard.ErrRejected, d.Result, d.Reason)
}

// progressLine is the line a waiting hook prints at now, e.g.
//
//	nri-gpu-guard: container 4f3a9c1b2d7e waiting 30s, position 2 of 3: GPU 1 (GPU-…) is held by ns/pod/ctr (id 0123456789ab) since 2026-01-02T15:04:05Z (5m0s ago)
//
// What stands in the way is said in the guard's words (busyNow), the ones
// its refusals use: the holder, the device it holds when that is another
// (a whole GPU against one of its MIG instances), the waiter a device is
// reserved or kept for.
func progressLine(who string, d guard.Decision, now time.Time, waited time.Duration) string {
	var b strings.Builder
	fmt.Fprintf(&b, "nri-gpu-guard: %s waiting %s", who, waited.Round(time.Second))
	if d.Position > 0 {
		fmt.Fprintf(&b, ", position %d of %d", d.Position, max(d.QueueLength, d.Position))
	}
	if len(d.Busy) == 0 {
		if d.Message != "" {
			b.WriteString(": " + d.Message)
		}
		return b.String()
	}
	b.WriteString(busyNow(d, now))
	return b.String()
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}
