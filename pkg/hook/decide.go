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
// who holds each busy GPU and how many requests wait for it. One transaction
// under the ledger lock decides and records only an admission
// (guard.AdmitIfFree): the ledger is read once, and a refused create changes
// no ledger state and leaves no queue entry. Every refusal then appends its
// audit record (auditRefusal): a busy one after the waiters ahead whose
// process is gone were dropped and the request asked again, one by policy
// (an unknown GPU, a cordon, on_conflict = "reject") as it is, since the
// record the guard writes for some of those goes with the transaction that
// admitted nothing.
//
// ctx's deadline, if any, bounds the decision; answerBy (zero: none) the
// refusal's record after it, so that the record cannot push the answer past
// the runtime's kill.
func (e env) decide(ctx context.Context, g guardAPI, cfg config.Config, req guard.Request, answerBy time.Time, stderr io.Writer) error {
	id := req.Owner.ContainerID
	// budget is what each step may take: withdrawTimeout, or less, what is
	// left before the deadline of a hook the runtime kills at its own
	// timeout (see createRuntime), taken again before each step, so that
	// the steps together end by that deadline.
	budget := func() time.Duration {
		b := withdrawTimeout(cfg)
		if dl, ok := ctx.Deadline(); ok {
			b = min(b, max(time.Until(dl), 0))
		}
		return b
	}
	d, err := e.admitIfFree(ctx, g, req, budget())
	if err == nil && d.Result == guard.Queue &&
		dropDeadWaiters(ctx, g, g.Ledger().Snapshot, e.procRoot, req.Key, devicesOf(d.Devices), budget()) {
		d, err = e.admitIfFree(ctx, g, req, budget())
	}
	if err != nil {
		return fmt.Errorf("container %s: GPU admission failed, container refused: %w", id, err)
	}
	// Not ctx's deadline, which ended the decision: the record has until
	// answerBy.
	actx, cancel := e.until(context.WithoutCancel(ctx), answerBy)
	defer cancel()
	switch d.Result {
	case guard.Admit, guard.Skip:
		return nil
	case guard.Queue:
		e.auditRefusal(actx, g, cfg, req, d, "busy, not waiting: "+d.Message, stderr)
		return notWaiting(id, d)
	default:
		e.auditRefusal(actx, g, cfg, req, d, "refused ("+d.Reason+"): "+d.Message, stderr)
		return fmt.Errorf("container %s: %w", id, decisionErr(d))
	}
}

// admitIfFree is guard.AdmitIfFree with a lock timeout taken as congestion:
// retried within budget, as long as the hook is not cancelled. Nothing is
// ever queued, so a failure leaves nothing to withdraw.
func (e env) admitIfFree(ctx context.Context, g guardAPI, req guard.Request, budget time.Duration) (guard.Decision, error) {
	deadline := time.Now().Add(budget)
	for {
		d, err := g.AdmitIfFree(ctx, req)
		if err == nil || !errors.Is(err, ledger.ErrLockTimeout) || ctx.Err() != nil || time.Now().After(deadline) {
			return d, err
		}
		select {
		case <-ctx.Done():
		case <-time.After(retryPause):
		}
	}
}

// neverRan reports whether err says the ledger lock was never taken, so the
// transaction (and any queueing in it) never ran.
func neverRan(err error) bool {
	var le *ledger.LockError
	return errors.As(err, &le)
}

// auditRefusal records a refusal in the audit log: crun shows the user only
// the hook's exit code, so `gpu-guard-ctl audit` is where the reason can be
// read. Best effort, one attempt bounded by lock_timeout and by the
// deadline of ctx, if any (the refusal must be answered before the runtime
// kills the hook): the refusal stands either way, and a record that cannot
// be written in time is dropped, with a line on stderr.
func (e env) auditRefusal(ctx context.Context, g guardAPI, cfg config.Config, req guard.Request, d guard.Decision, reason string, stderr io.Writer) {
	limit := cfg.Ledger.LockTimeout.Duration
	if dl, ok := ctx.Deadline(); ok {
		limit = min(limit, time.Until(dl))
	}
	var err error
	if limit <= 0 {
		err = errors.New("no time left before the runtime kills the hook")
	} else {
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), limit)
		defer cancel()
		err = update(actx, g, func(tx *ledger.Tx) error {
			tx.Audit(guard.AuditRefuse, refuseRecord(req, d, reason))
			return nil
		})
	}
	if err != nil {
		_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: container %s: the refusal is not in the audit log: %v\n",
			ledger.ShortID(req.Owner.ContainerID), err)
	}
}

// refuseRecord is the audit record (operation guard.AuditRefuse) of the
// hook's refusal of req, decided d, for reason.
func refuseRecord(req guard.Request, d guard.Decision, reason string) ledger.AuditRecord {
	uuids := make([]string, len(d.Devices))
	for i, rd := range d.Devices {
		uuids[i] = rd.UUID
	}
	o := req.Owner
	return ledger.AuditRecord{
		Devices: uuids, ContainerID: o.ContainerID, Key: req.Key, Namespace: o.Namespace, Pod: o.Pod,
		Container: o.Container, FrontEnd: string(ledger.FrontEndHook), Reason: reason,
	}
}

// Exit codes of a create-runtime hook, for runtimes that show the user only
// the code (crun: "error executing hook … (exit code: 75)").
const (
	ExitRefused = 1  // anything else: input, ledger, internal error
	ExitBusy    = 75 // a GPU is busy (EX_TEMPFAIL): try later or use gpu-guard-ctl run
	ExitPolicy  = 77 // refused by policy or an unknown device (EX_NOPERM)
)

// ExitCode is the exit code for an error returned by RunInput.
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
