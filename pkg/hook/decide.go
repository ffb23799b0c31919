// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// ErrNotWaiting is wrapped (with guard.ErrQueued) by the refusal of a
// create-runtime hook that does not wait: a GPU it names is busy.
var ErrNotWaiting = errors.New("the hook does not wait inside the engine")

// decide is create-runtime without waiting: admit, or refuse at once with
// who holds each busy GPU and how many requests wait for it. The answer is
// first computed without the ledger lock (guard.Explain reads the committed
// state); only a request that can be admitted takes the lock for a
// transaction, so that a burst of refused creates changes no ledger state and
// leaves no queue entry. Each refusal still takes the lock once, to append its
// audit record (auditRefusal).
func (e env) decide(ctx context.Context, g guardAPI, cfg config.Config, req guard.Request, stderr io.Writer) error {
	id := req.Owner.ContainerID
	budget := withdrawTimeout(cfg)
	d, err := g.Explain(ctx, req)
	if err != nil {
		return fmt.Errorf("container %s: GPU admission failed, container refused: %w", id, err)
	}
	if d.Result == guard.Queue &&
		dropDeadWaiters(ctx, g, g.Ledger().Snapshot, e.procRoot, req.Key, devicesOf(d.Devices), budget) {
		if d, err = g.Explain(ctx, req); err != nil {
			return fmt.Errorf("container %s: GPU admission failed, container refused: %w", id, err)
		}
	}
	switch d.Result {
	case guard.Skip:
		return nil
	case guard.Queue:
		e.auditRefusal(ctx, g, cfg, req, d)
		return notWaiting(id, d)
	case guard.Admit:
	default:
		return fmt.Errorf("container %s: %w", id, decisionErr(d))
	}

	// Explain says free: claim it for real. A lock timeout is congestion:
	// retried within the budget, as long as the hook is not cancelled.
	deadline := time.Now().Add(budget)
	for {
		d, err = g.Admit(ctx, req)
		if err == nil || !errors.Is(err, ledger.ErrLockTimeout) || ctx.Err() != nil || time.Now().After(deadline) {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(retryPause):
		}
	}
	if err != nil {
		// The guard may have queued the request before failing, unless
		// the ledger lock was never taken (then nothing ran; and a hook
		// told to stop while another process holds the lock must not wait
		// for it again to withdraw what was never queued).
		if !neverRan(err) {
			_ = withdrawReliably(ctx, g, req.Key, "hook failed: "+firstLine(err.Error()), budget)
		}
		return fmt.Errorf("container %s: GPU admission failed, container refused: %w", id, err)
	}
	switch d.Result {
	case guard.Admit, guard.Skip:
		return nil
	case guard.Queue:
		// Taken meanwhile. The queue entry Admit made would outlive this
		// container (nothing retries it): take it out again.
		if err := withdrawReliably(ctx, g, req.Key, "refused at once: the hook does not wait", budget); err != nil {
			_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: container %s: could not leave the queue (policy.queue_ttl will drop the entry): %v\n",
				ledger.ShortID(id), err)
		}
		e.auditRefusal(ctx, g, cfg, req, d)
		return notWaiting(id, d)
	default:
		return fmt.Errorf("container %s: %w", id, decisionErr(d))
	}
}

// neverRan reports whether err says the ledger lock was never taken, so the
// transaction (and any queueing in it) never ran.
func neverRan(err error) bool {
	var le *ledger.LockError
	return errors.As(err, &le)
}

// auditRefusal records a busy refusal in the audit log: crun shows the user
// only the hook's exit code, so `gpu-guard-ctl audit` is where the reason can
// be read. Best effort, one bounded attempt: the refusal stands either way.
func (e env) auditRefusal(ctx context.Context, g guardAPI, cfg config.Config, req guard.Request, d guard.Decision) {
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.Ledger.LockTimeout.Duration)
	defer cancel()
	uuids := make([]string, len(d.Devices))
	for i, rd := range d.Devices {
		uuids[i] = rd.UUID
	}
	o := req.Owner
	_ = update(actx, g, func(tx *ledger.Tx) error {
		tx.Audit(guard.AuditRefuse, ledger.AuditRecord{
			Devices: uuids, ContainerID: o.ContainerID, Key: req.Key, Namespace: o.Namespace, Pod: o.Pod,
			Container: o.Container, FrontEnd: string(ledger.FrontEndHook), Reason: "busy, not waiting: " + d.Message,
		})
		return nil
	})
}

// Exit codes of a create-runtime hook, for runtimes that show the user only
// the code (crun: "error executing hook … (exit code: 75)").
const (
	ExitRefused = 1  // anything else: input, ledger, internal error
	ExitBusy    = 75 // a GPU is busy (EX_TEMPFAIL): try later or use gpu-guard-ctl run
	ExitPolicy  = 77 // refused by policy or an unknown device (EX_NOPERM)
)

// ExitCode is the exit code for an error returned by Run or RunWith.
func ExitCode(err error) int {
	switch {
	case err == nil:
		return 0
	case errors.Is(err, guard.ErrQueued), errors.Is(err, ErrWaitTimeout):
		return ExitBusy
	case errors.Is(err, guard.ErrRejected):
		return ExitPolicy
	default:
		return ExitRefused
	}
}

// notWaiting is the refusal of a busy request by a hook that does not wait:
// the guard's text (each busy GPU, its holder, since when, how many wait for
// it, which GPUs are free) and how to wait for a turn instead.
func notWaiting(id string, d guard.Decision) error {
	return fmt.Errorf("container %s refused: %w Not queued: %w (podman and CRI-O hold the container's lock while it runs, "+
		"so waiting here would freeze them). To wait for the GPU, start the container through "+
		"`gpu-guard-ctl run -- <your command>`: it waits its turn outside the engine, then runs the command",
		id, decisionErr(d), ErrNotWaiting)
}
