package guard

// CONTRACT FILE: the exported surface both front ends (nriplugin, hook) and
// gpu-guard-ctl explain code against. The guard implementation must keep these
// names and meanings; it may add to them.

import (
	"errors"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// Result is the outcome of an admission decision.
type Result string

// Results.
const (
	// Admit: every device was free; the claim is recorded.
	Admit Result = "admit"
	// Queue: a device is busy; the requester is (still) queued. Retriable.
	Queue Result = "queue"
	// Reject: refused and not queued (policy, unknown device, on_conflict=reject).
	Reject Result = "reject"
	// Skip: nothing to check (no GPU requested, exempt namespace).
	Skip Result = "skip"
)

// Request is one container asking to be created.
type Request struct {
	FrontEnd ledger.FrontEnd
	// Owner carries the container and pod identity (and pid for hooks).
	Owner ledger.Owner
	// Key is the stable requester key (see RequesterKey); empty = computed.
	Key string
	// Spec is what the container reaches, unresolved.
	Spec devices.Request
}

// Decision is the answer to a Request.
type Decision struct {
	Result  Result              `json:"decision"`
	Reason  string              `json:"reason"` // machine-readable: free, busy, reserved, exempt, no-gpu, unknown-device, policy-all, policy-privileged, ...
	Devices []devices.Resolved  `json:"devices"`
	Busy    []ledger.BusyDevice `json:"-"`
	// Position and QueueLength are set for Queue ("position N of M").
	Position    int           `json:"position,omitempty"`
	QueueLength int           `json:"queue_length,omitempty"`
	Waited      time.Duration `json:"-"`
	// Message is the operator-facing text: for each busy device its index and
	// full UUID, the holder ns/pod/container and short id, since when, the queue
	// position, the time waited and what to do.
	Message string `json:"message"`
}

// Errors returned (wrapped) by Decision.Err.
var (
	ErrQueued   = errors.New("GPU busy, request queued")
	ErrRejected = errors.New("GPU request refused")
)

// RequesterKey is the stable key of a requester across retries:
// "namespace/pod-uid/container-name" for CRI containers, the container id
// otherwise.
func RequesterKey(o ledger.Owner) string {
	if o.PodUID != "" && o.Container != "" {
		return o.Namespace + "/" + o.PodUID + "/" + o.Container
	}
	return o.ContainerID
}

// The Guard type and its methods live in guard.go. Their contract:
//
//	type Options struct {
//		Config    config.Config
//		Inventory *devices.Inventory
//		Ledger    *ledger.Ledger
//		Liveness  Liveness          // nil = liveness.New(defaults)
//		Now       func() time.Time  // nil = time.Now
//		Logger    *slog.Logger      // nil = discard
//		Observer  Observer          // nil = none (metrics hook)
//	}
//	type Liveness interface {
//		// Exited reports whether a started holder's processes are all gone,
//		// with a short reason ("cgroup /k8s.io/abc has no processes").
//		Exited(o ledger.Owner) (bool, string)
//	}
//	func New(opts Options) (*Guard, error)
//	// Admit decides and records (claim or enqueue). A non-nil error means the
//	// decision could not be made (lock timeout, corrupt ledger): callers fail
//	// closed with that error. Otherwise d.Err() is nil only for Admit/Skip.
//	func (g *Guard) Admit(ctx context.Context, r Request) (Decision, error)
//	// Explain is Admit without any mutation (gpu-guard-ctl explain).
//	func (g *Guard) Explain(ctx context.Context, r Request) (Decision, error)
//	func (g *Guard) Started(ctx context.Context, containerID string, pid int, cgroup string) error
//	func (g *Guard) Stopped(ctx context.Context, o ledger.Owner) error  // per release_on
//	func (g *Guard) Removed(ctx context.Context, o ledger.Owner) error
//	func (g *Guard) PodGone(ctx context.Context, podUID, sandboxID string) error // release + drop waiters
//	func (g *Guard) Withdraw(ctx context.Context, key, reason string) error      // a waiter leaves the queue
//	func (g *Guard) Reconcile(ctx context.Context, fe ledger.FrontEnd, live []Request) (ledger.ReconcileResult, error)
//	func (d Decision) Err() error // nil for Admit/Skip; wraps ErrQueued or ErrRejected with Message
