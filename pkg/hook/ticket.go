// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
)

// TicketEnv is the environment variable that carries a ticket of
// `gpu-guard-ctl run` into the container it starts.
const TicketEnv = "NRI_GPU_GUARD_TICKET"

// A ticket (guard.NewTicketID: its format is the guard's, whose release
// rule must recognise it) is the requester, and once admitted the claim
// owner, of a `gpu-guard-ctl run`. While the ctl waits, the ticket queues
// like any container; once admitted, the ticket holds the GPUs, with the
// ctl's pid as its process (a killed ctl is a holder that exited, released by
// the next liveness check whatever release_on says). The container's
// create-runtime hook finds the ticket in the container's environment and
// takes the claims over.

// ticketOf returns the ticket named by the last TicketEnv entry of env, or ""
// when there is none or it is malformed (container-supplied: never trusted
// beyond its format; a malformed one is simply no ticket).
func ticketOf(env []string) string {
	t := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, TicketEnv+"="); ok {
			t = v
		}
	}
	if !guard.ValidTicket(t) {
		return ""
	}
	return t
}

// reasonTicketMismatch is the reason of a ticket hand-over refused because
// the container asks for a GPU its ticket does not hold.
const reasonTicketMismatch = "ticket-mismatch"

// reasonHandoverFailed is the reason of a ticket hand-over that could not
// be written: the ledger failed, or stayed locked until the hook's deadline.
const reasonHandoverFailed = "handover-failed"

// ctxBudget is budget, or less: what is left before ctx's deadline, if any
// (zero once it passed).
func ctxBudget(ctx context.Context, budget time.Duration) time.Duration {
	if dl, ok := ctx.Deadline(); ok {
		budget = min(budget, max(time.Until(dl), 0))
	}
	return budget
}

// releaseUnusedTicket is create-runtime for a container that asks for no
// GPU but carries ticket t: the ledger is opened only to release the
// ticket's GPUs (dropTicket), by dl.decideBy. The container is admitted
// whatever comes of it: it claims nothing.
func (e env) releaseUnusedTicket(ctx context.Context, cfg config.Config, t, id string, dl hookDeadlines, stderr io.Writer) {
	dctx, cancel := e.until(ctx, dl.decideBy)
	defer cancel()
	// Releasing needs no inventory (poststop releases without one too).
	g, closeGuard, err := e.openGuard(cfg, emptyInventory())
	if err != nil {
		_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: container %s carries ticket %s but asks for no GPU; the ticket's GPUs are not released "+
			"(its gpu-guard-ctl run releases them when it ends): %v\n", ledger.ShortID(id), t, err)
		return
	}
	defer closeGuard()
	e.dropTicket(dctx, g, cfg, t, id, stderr)
}

// dropTicket releases what ticket t holds, for container id, which carries
// it but asks for no GPU: kept, the ticket's GPUs would stay idle for the
// container's life, since its gpu-guard-ctl run releases them only when the
// command ends (podman run -d ends at once, podman run with the container).
// The release records say so; a note goes to stderr. Best effort within
// ctx's deadline: what is not released is released when the ctl ends.
func (e env) dropTicket(ctx context.Context, g guardAPI, cfg config.Config, t, id string, stderr io.Writer) {
	var rel []devices.Device
	err := retryLocked(ctx, ctxBudget(ctx, withdrawTimeout(cfg)), func(ctx context.Context) error {
		rel = nil
		return update(ctx, g, func(tx *ledger.Tx) error {
			for _, c := range tx.Release(t, fmt.Sprintf("ticket %s of gpu-guard-ctl run carried by container %s, which asks for no GPU",
				t, ledger.ShortID(id))) {
				rel = append(rel, c.Device)
			}
			return nil
		})
	})
	switch {
	case err != nil:
		_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: container %s carries ticket %s but asks for no GPU; the ticket's GPUs are not released "+
			"(its gpu-guard-ctl run releases them when it ends): %v\n", ledger.ShortID(id), t, err)
	case len(rel) > 0:
		_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: container %s carries ticket %s but asks for no GPU; released %s of the ticket\n",
			ledger.ShortID(id), t, naming.Devices(rel))
	}
}

// useTicket hands the GPUs claimed for ticket t over to the container of
// owner. done is true when the hook's answer is settled (admitted: nil error;
// or refused: the error); false when the ticket holds nothing (its ctl is
// gone, or it was used already) and the container is decided as usual.
//
// In one transaction under the ledger lock: the container must ask only for
// GPUs the ticket holds, and none of them may be cordoned (a cordon laid
// after the ticket was admitted, by an operator or by the observer finding
// the GPU unhealthy, stops the hand-over as it stops any new claim). Then
// the container takes over the ticket's claims on the GPUs it asks for, and
// the ticket's other GPUs are released (audited), rather than kept idle for
// the container's life; a container that asks for none releases them all
// (releaseUnusedTicket). A refusal (exit 77) changes no claim: the ticket
// keeps its GPUs until its gpu-guard-ctl run ends (the command fails with the
// container and the ctl releases them, or, if the ctl was killed, the next
// request for them finds its process gone), and leaves a refuse record whose
// key is the ticket, which gpu-guard-ctl run quotes (TicketRefusal).
//
// A busy ledger lock is retried within withdrawTimeout, and no longer than
// ctx's deadline (the hook's own, see hookDeadlines): a hand-over cut there
// refuses the container in the guard's words, its record written by
// dl.answerBy if it can be, rather than leaving the runtime to kill the hook.
func (e env) useTicket(ctx context.Context, g guardAPI, cfg config.Config, t string, owner ledger.Owner,
	req devices.Request, dl hookDeadlines, stderr io.Writer) (done bool, err error) {
	res, err := g.Resolve(req)
	if err != nil {
		return false, nil // the guard words that refusal
	}
	if len(res.Devices) == 0 {
		e.dropTicket(ctx, g, cfg, t, owner.ContainerID, stderr)
		return false, nil // admitted as usual: it claims nothing
	}
	want := devicesOf(res.Devices)
	id := owner.ContainerID
	var (
		held, extra []devices.Device
		refusal     *guard.Decision
	)
	// Retried until dl.decideBy on the hook's clock too, the clock that
	// placed it (ctx's deadline is the same moment on the system's).
	err = retryLockedWhile(ctx, ctxBudget(ctx, withdrawTimeout(cfg)), e.ahead(dl.decideBy), func(ctx context.Context) error {
		held, extra, refusal = nil, nil, nil
		return update(ctx, g, func(tx *ledger.Tx) error {
			for _, c := range tx.State().Claims {
				if c.Owner.ContainerID == t {
					held = append(held, c.Device)
				}
			}
			if len(held) == 0 {
				return nil
			}
			var missing []devices.Device
			for _, d := range want {
				if !containsUUID(held, d.UUID) {
					missing = append(missing, d)
				}
			}
			switch cordoned := tx.CordonsOn(id, want); {
			case len(missing) > 0:
				refusal = &guard.Decision{Result: guard.Reject, Reason: reasonTicketMismatch, Devices: res.Devices,
					Message: fmt.Sprintf("its ticket %s (gpu-guard-ctl run) holds %s, but the container also asks for %s, which the ticket does not hold; "+
						"name the same GPUs to gpu-guard-ctl run (--gpus) and to the container. The ticket keeps its GPUs until its gpu-guard-ctl run ends",
						t, naming.Devices(held), naming.Devices(missing))}
			case len(cordoned) > 0:
				d := g.CordonRefusal(tx, id, res.Devices, cordoned)
				d.Message = fmt.Sprintf("its ticket %s (gpu-guard-ctl run) is not handed over: %s The ticket keeps its GPUs until its gpu-guard-ctl run ends.",
					t, d.Message)
				refusal = &d
			}
			if refusal != nil {
				tx.Audit(guard.AuditRefuse, refuseRecord(guard.Request{Owner: owner, Key: t}, *refusal,
					"refused ("+refusal.Reason+"): "+refusal.Message))
				return nil
			}
			for _, d := range held {
				if !containsUUID(want, d.UUID) {
					extra = append(extra, d)
				}
			}
			for _, d := range extra {
				if _, err := tx.ReleaseDevice(d.UUID, fmt.Sprintf("ticket %s of gpu-guard-ctl run handed over to container %s, which does not ask for this GPU",
					t, ledger.ShortID(id))); err != nil {
					return fmt.Errorf("release %s of ticket %s: %w", ledger.DescribeDevice(d), t, err)
				}
			}
			// What is left of the ticket is all in want: all of it moves.
			tx.TakeOver(t, owner, want, "ticket of gpu-guard-ctl run")
			return nil
		})
	})
	switch {
	case err != nil:
		what := fmt.Sprintf("its ticket %s could not be handed over", t)
		if dl.kill > 0 && !e.now().Before(dl.decideBy) {
			what += fmt.Sprintf(" before the timeout of this hook in the container's config.json (%s, less %s to answer)",
				dl.kill, dl.killAt.Sub(dl.decideBy))
		}
		// Keyed by the ticket, so that gpu-guard-ctl run says why no
		// container took it over (TicketRefusal); dropped if the ledger is
		// as busy as it was.
		// ctx is done if the deadline cut the hand-over: the record has
		// until dl.answerBy.
		actx, cancel := e.until(context.WithoutCancel(ctx), dl.answerBy)
		defer cancel()
		e.auditRefusal(actx, g, cfg, guard.Request{FrontEnd: ledger.FrontEndHook, Owner: owner, Key: t},
			guard.Decision{Result: guard.Reject, Reason: reasonHandoverFailed, Devices: res.Devices},
			"refused ("+reasonHandoverFailed+"): "+what+": "+firstLine(err.Error()), stderr)
		return true, fmt.Errorf("container %s refused: %s (the ticket's GPUs are released "+
			"when its gpu-guard-ctl run ends; run it again once the ledger is reachable): %w", id, what, err)
	case len(held) == 0:
		_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: container %s: ticket %s holds no GPU (its gpu-guard-ctl run ended, or the ticket was used); deciding as usual\n",
			ledger.ShortID(id), t)
		return false, nil
	case refusal != nil:
		return true, fmt.Errorf("container %s refused: %w", id, decisionErr(*refusal))
	}
	if len(extra) > 0 {
		_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: container %s took ticket %s over for %s; released %s of the ticket, which the container does not ask for\n",
			ledger.ShortID(id), t, naming.Devices(want), naming.Devices(extra))
	}
	return true, nil
}

// TicketRefusal says why no container took ticket id over when the guard's
// hook refused one that carried it: "container C was refused (REASON):
// MESSAGE", from the last refuse record keyed by the ticket. ok is false
// when there is none: the command started no container that carried the
// ticket, or its create failed before the hook decided (or the audit log
// cannot be read).
func TicketRefusal(cfg config.Config, id string) (cause string, ok bool) {
	l, err := ledger.OpenReadOnly(cfg.Ledger.Dir, guard.LedgerOptions(cfg))
	if err != nil {
		return "", false
	}
	recs, _ := ledger.ReadAudit(l.AuditPath()) // the records that decode
	for i := len(recs) - 1; i >= 0; i-- {
		r := recs[i]
		if r.Op != guard.AuditRefuse || r.Key != id {
			continue
		}
		if rest, ok := strings.CutPrefix(r.Reason, "refused ("); ok {
			return fmt.Sprintf("container %s was refused (%s", ledger.ShortID(r.ContainerID), rest), true
		}
		return fmt.Sprintf("container %s was refused: %s", ledger.ShortID(r.ContainerID), r.Reason), true
	}
	return "", false
}

func containsUUID(ds []devices.Device, uuid string) bool {
	for _, d := range ds {
		if d.UUID == uuid {
			return true
		}
	}
	return false
}

// TicketOptions tune AcquireTicket.
type TicketOptions struct {
	// Timeout bounds the wait; 0 = until cancelled.
	Timeout time.Duration
	// Stderr receives the progress lines.
	Stderr io.Writer
}

// Ticket is a claim made by AcquireTicket for a command to hand over.
type Ticket struct {
	ID      string
	Devices []devices.Resolved
}

// AcquireTicket waits in the ledger's FIFO queue, as the requester of a new
// ticket, until every GPU spec names is claimed for it, with the calling
// process as the ticket's process. It is `gpu-guard-ctl run`: the wait
// happens outside any engine. Cancelling ctx leaves the queue. A request that
// names no GPU is an error (there is nothing to wait for).
func AcquireTicket(ctx context.Context, cfg config.Config, spec devices.Request, opts TicketOptions) (Ticket, error) {
	if opts.Stderr == nil {
		opts.Stderr = io.Discard
	}
	inv, err := loadInventory(cfg)
	if err != nil {
		return Ticket{}, err
	}
	g, closeGuard, err := openGuard(cfg, inv)
	if err != nil {
		return Ticket{}, err
	}
	defer closeGuard()
	res, err := g.Resolve(spec)
	if err != nil {
		return Ticket{}, fmt.Errorf("GPU request refused: %w", err)
	}
	if len(res.Devices) == 0 {
		return Ticket{}, fmt.Errorf("the request names no GPU: nothing to wait for (name GPUs as in NVIDIA_VISIBLE_DEVICES)")
	}
	id := guard.NewTicketID()
	pid := os.Getpid()
	start, err := liveness.PidStart(liveness.DefaultProcRoot, pid)
	if err != nil {
		return Ticket{}, fmt.Errorf("read this process's start time: %w", err)
	}
	owner := ledger.Owner{ContainerID: id, Container: "gpu-guard-ctl run", FrontEnd: ledger.FrontEndHook, Pid: pid, PidStart: start}
	timeout := opts.Timeout
	timeoutKey := "--timeout"
	if timeout <= 0 {
		timeout = 100 * 365 * 24 * time.Hour
	}
	e := defaultEnv()
	w := e.newQueueWait(g, cfg, guard.Request{FrontEnd: ledger.FrontEndHook, Owner: owner, Key: id, Spec: spec}, opts.Stderr)
	w.waitTimeout = timeout
	w.subject = "gpu-guard-ctl run (" + id + ")"
	w.timeoutKey = timeoutKey
	if err := w.run(ctx); err != nil {
		return Ticket{}, err
	}
	return Ticket{ID: id, Devices: res.Devices}, nil
}

// ReleaseTicket ends what ticket id still holds (nothing once a container
// took it over) and drops a queue entry it may have left; lock timeouts are
// retried. It returns the devices it released.
func ReleaseTicket(ctx context.Context, cfg config.Config, id string) ([]devices.Device, error) {
	g, closeGuard, err := openGuard(cfg, emptyInventory())
	if err != nil {
		return nil, err
	}
	defer closeGuard()
	var rel []devices.Device
	err = retryLocked(ctx, withdrawTimeout(cfg), func(ctx context.Context) error {
		rel = nil
		return update(ctx, g, func(tx *ledger.Tx) error {
			for _, c := range tx.Release(id, "gpu-guard-ctl run ended before a container took the ticket over") {
				rel = append(rel, c.Device)
			}
			tx.DropWaiter(id, "gpu-guard-ctl run ended")
			return nil
		})
	})
	return rel, err
}
