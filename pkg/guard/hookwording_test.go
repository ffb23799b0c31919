// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// TestLedgerErrorWording: a lock timeout tells a kubelet-driven request that
// it is retried, and a hook request (nothing retries it) to try again.
func TestLedgerErrorWording(t *testing.T) {
	g := &Guard{}
	lock := fmt.Errorf("lock: %w", ledger.ErrLockTimeout)
	hook := g.ledgerError(ledger.Owner{ContainerID: "c1", FrontEnd: ledger.FrontEndHook}, lock)
	assert.ErrorIs(t, hook, ledger.ErrLockTimeout)
	assert.Contains(t, hook.Error(), "try again in a moment")
	assert.NotContains(t, hook.Error(), "Kubernetes")
	nri := g.ledgerError(ledger.Owner{ContainerID: "c1", FrontEnd: ledger.FrontEndNRI}, lock)
	assert.Contains(t, nri.Error(), "retrying is automatic under Kubernetes")
}

// TestLedgerNeedsRecoveryWording: a ledger that needs recovery refuses every
// container, saying which file is wrong, that no container gets a GPU and
// what the operator does on this kind of host.
func TestLedgerNeedsRecoveryWording(t *testing.T) {
	g := &Guard{}
	bad := &ledger.CorruptError{Path: "/var/lib/nri-gpu-guard/ledger.json", Reason: "checksum mismatch"}
	hook := g.ledgerError(ledger.Owner{ContainerID: "c1", FrontEnd: ledger.FrontEndHook}, bad)
	assert.ErrorIs(t, hook, ledger.ErrNeedsRecovery)
	for _, s := range []string{"/var/lib/nri-gpu-guard/ledger.json", "checksum mismatch", "NO container gets a GPU", "gpu-guard-ctl recover"} {
		assert.Contains(t, hook.Error(), s)
	}
	assert.NotContains(t, hook.Error(), "moved aside;")
	gone := &ledger.NeedsRecoveryError{Path: "/var/lib/nri-gpu-guard", Problem: "the state dir is missing"}
	nri := g.ledgerError(ledger.Owner{ContainerID: "c1", FrontEnd: ledger.FrontEndNRI}, gone)
	assert.ErrorIs(t, nri, ledger.ErrNeedsRecovery)
	for _, s := range []string{"the state dir is missing", "NO container gets a GPU", "at its next sync", "gpu-guard-ctl recover"} {
		assert.Contains(t, nri.Error(), s)
	}
}
