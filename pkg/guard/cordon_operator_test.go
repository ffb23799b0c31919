// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// An operator cordoned GPU 1 for an RMA; the daemon's observer then finds
// it unhealthy and cordons it (CordonDevice). The operator's cordon stays
// (its source, reason and author), the finding is logged and audited, and
// after a reboot GPU 1 is still refused.
func TestObserverFindingKeepsTheOperatorsCordon(t *testing.T) {
	e, logs := newStateEnv(t, nil)
	op, changed, err := e.g.Cordon(ctx, uuid(1), ledger.CordonOperator, "RMA 4711", "uid 0 via gpu-guard-ctl")
	require.NoError(t, err)
	require.True(t, changed)

	e.clock.advance(time.Minute)
	require.NoError(t, e.g.CordonDevice(ctx, uuid(1), ledger.CordonUnhealthy, "critical Xid 79"))
	st := e.state()
	require.Len(t, st.Cordons, 1)
	assert.Equal(t, op, st.Cordons[0], "the operator's cordon, unchanged")
	assert.Contains(t, logs.String(), "device already cordoned by a source that ranks higher")
	assert.Contains(t, logs.String(), "critical Xid 79")
	var audited bool
	for _, r := range auditOf(t, e.l) {
		audited = audited || (r.Op == ledger.OpCordon && strings.HasPrefix(r.Reason, ledger.CordonKeptPrefix(ledger.CordonOperator)) &&
			strings.Contains(r.Reason, "critical Xid 79"))
	}
	assert.True(t, audited, "the finding is audited")

	// The same host after a reboot.
	opts := guard.LedgerOptions(e.cfg)
	opts.Now, opts.BootID, opts.RuntimeDir = e.clock.Now, "boot-2", t.TempDir()
	l2, err := ledger.Open(e.cfg.Ledger.Dir, opts)
	require.NoError(t, err)
	g2, err := guard.New(guard.Options{Config: e.cfg, Inventory: inventory(t), Ledger: l2, Liveness: e.live, Now: e.clock.Now})
	require.NoError(t, err)
	d, err := g2.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: ctr("ml", "b", "main", "req0000000000001"), Spec: visible("1")})
	require.NoError(t, err)
	assert.Equal(t, guard.Reject, d.Result, d.Message)
	assert.Equal(t, guard.ReasonCordoned, d.Reason)
	assert.Contains(t, d.Message, "RMA 4711")
}
