// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// Liveness tells whether a started holder's processes are all gone. The
// default is liveness.Checker over the host's /sys/fs/cgroup and /proc. It is
// the one declaration every caller of the release rule (Releasable) uses.
type Liveness interface {
	// Exited reports whether a started holder's processes are all gone,
	// with a short reason ("cgroup /k8s.io/abc has no processes"). It must
	// answer false when in doubt: a claim is never released on doubt.
	Exited(p liveness.Process) (bool, string)
}

// PidStarter is implemented by a Liveness that can also read a process's
// start time, so that Started records it next to the pid (against pid
// reuse). liveness.Checker implements it.
type PidStarter interface {
	PidStart(pid int) (uint64, error)
}

// Observer receives what the guard decided and changed; pkg/metrics
// implements it. Calls are made after the ledger update committed, outside the
// ledger lock, from the goroutine that made the call; implementations must be
// safe for concurrent use and must not block.
type Observer interface {
	// Decided is called once per Admit with the decision and the time it
	// took, lock wait included.
	Decided(d Decision, latency time.Duration)
	// Released is called for claims the guard released without a stop event
	// for them: reason is "holder exited" (out-of-band liveness check) or
	// "stale" (the runtime no longer lists the holder at reconcile).
	Released(reason string, claims []ledger.Claim)
	// StateChanged is called with the ledger state after each committed
	// update the guard made.
	StateChanged(st ledger.State)
}

// Release reasons reported to Observer.Released and written to the audit log.
const (
	ReasonHolderExited = "holder exited"
	ReasonStale        = "stale"
)

// AuditRefuse is the audit operation of a request refused without queueing
// (on_conflict = "reject").
const AuditRefuse = "refuse"

// AuditExempt is the audit operation of a request admitted without a check
// or a claim because policy exempt_namespaces lists its namespace.
const AuditExempt = "exempt"

// nopObserver is the Observer used when none is configured.
type nopObserver struct{}

func (nopObserver) Decided(Decision, time.Duration) {}
func (nopObserver) Released(string, []ledger.Claim) {}
func (nopObserver) StateChanged(ledger.State)       {}
