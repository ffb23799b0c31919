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
// state); only a request that can be admitted takes the lock, so that a burst
// of refused creates costs no ledger writes and leaves no queue entry.
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
		// The guard may have queued the request before failing.
		_ = withdrawReliably(ctx, g, req.Key, "hook failed: "+firstLine(err.Error()), budget)
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
		return notWaiting(id, d)
	default:
		return fmt.Errorf("container %s: %w", id, decisionErr(d))
	}
}

// notWaiting is the refusal of a busy request by a hook that does not wait:
// the guard's text (each busy GPU, its holder, since when, how many wait for
// it, which GPUs are free) and how to wait for a turn instead.
func notWaiting(id string, d guard.Decision) error {
	return fmt.Errorf("container %s refused: %w; it is not queued (%w): engines such as podman hold the container's lock "+
		"while the hook runs, so waiting here would freeze them. To wait for the GPU, start the container through "+
		"`gpu-guard-ctl run -- <your command>`, which waits its turn outside the engine and then runs the command",
		id, decisionErr(d), ErrNotWaiting)
}
