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
