// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

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
	// For a front end whose pod identity is not trusted (TrustsIdentity) it
	// must be empty or the container id.
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
	// Cordoned lists the cordoned devices of a request refused for them
	// (Reason "cordoned").
	Cordoned []ledger.CordonedDevice `json:"-"`
	// Position and QueueLength are set for Queue ("position N of M").
	Position    int           `json:"position,omitempty"`
	QueueLength int           `json:"queue_length,omitempty"`
	Waited      time.Duration `json:"-"`
	// Audited: the transaction that decided it wrote its refuse record
	// (a cordon; a busy device under on_conflict = "reject"); a front end
	// that records refusals itself does not write another.
	Audited bool `json:"-"`
	// Message is the operator-facing text: for each busy device its index and
	// full UUID, the holder ns/pod/container and short id, since when, the queue
	// position, the time waited and what to do.
	Message string `json:"message"`
	// tookOver: the claims the request took over from its stopped
	// predecessor (Reason "takeover"), as they were: those that stood in
	// the way of what it asks for (ledger.Tx.TakeOver).
	tookOver []ledger.Claim
	// words: what BusyText needs of the deciding transaction.
	words *busyWords
}

// Errors returned (wrapped) by Decision.Err.
var (
	ErrQueued   = errors.New("GPU busy, request queued")
	ErrRejected = errors.New("GPU request refused")
)

// RequesterKey is the stable key of a requester across retries:
// "namespace/pod-uid/container-name" for CRI containers of a front end whose
// pod identity is trusted (TrustsIdentity), the container id otherwise: a key
// made of names the container's creator wrote could be another requester's,
// and would take its place in the queue and its reservation.
func RequesterKey(o ledger.Owner) string {
	if TrustsIdentity(o.FrontEnd) && o.PodUID != "" && o.Container != "" {
		return o.Namespace + "/" + o.PodUID + "/" + o.Container
	}
	return o.ContainerID
}
