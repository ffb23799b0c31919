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

// The observer found GPU 1 unhealthy (a double-bit ECC error) and cordoned
// it; it then finds a process the ledger does not explain on it. The
// unhealthy cordon stays in force as it was (source, reason, since), the
// intruder finding is logged and audited after it, and a request for GPU 1
// is refused naming the Xid. Rewritten as an intruder's, the cordon would
// be lifted once the intruder is dealt with, and the broken GPU would take
// claims again. The other way round, an unhealthy finding replaces an
// intruder's cordon.
func TestObserverCordonKeepsAnUnhealthyCordonOverAnIntruderFinding(t *testing.T) {
	const xid, pid = "critical Xid 48: double-bit ECC error", "intruder: pid 4242 (host process) runs on it without a claim"
	for _, tc := range []struct {
		name          string
		first, second string // the sources of the observer's findings, in order
		wantSource    string
		wantReason    string
		kept          bool
	}{
		{name: "intruder on an unhealthy GPU", first: ledger.CordonUnhealthy, second: ledger.CordonIntruder,
			wantSource: ledger.CordonUnhealthy, wantReason: xid, kept: true},
		{name: "unhealthy GPU under an intruder cordon", first: ledger.CordonIntruder, second: ledger.CordonUnhealthy,
			wantSource: ledger.CordonUnhealthy, wantReason: xid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, logs := newStateEnv(t, nil)
			reasons := map[string]string{ledger.CordonUnhealthy: xid, ledger.CordonIntruder: pid}
			require.NoError(t, e.g.CordonDevice(ctx, uuid(1), tc.first, reasons[tc.first]))
			first := e.state().Cordons
			require.Len(t, first, 1)

			e.clock.advance(time.Minute)
			require.NoError(t, e.g.CordonDevice(ctx, uuid(1), tc.second, reasons[tc.second]))
			st := e.state()
			require.Len(t, st.Cordons, 1)
			k := st.Cordons[0]
			assert.Equal(t, tc.wantSource, k.Source)
			assert.Equal(t, tc.wantReason, k.Reason)
			assert.Equal(t, guard.ObserverBy, k.By)
			assert.True(t, k.Since.Equal(first[0].Since), "since the first cordon")
			if tc.kept {
				assert.Equal(t, first[0], k, "the unhealthy cordon, unchanged")
			}

			var audited bool
			for _, r := range auditOf(t, e.l) {
				audited = audited || (r.Op == ledger.OpCordon &&
					strings.HasPrefix(r.Reason, "unhealthy cordon kept, not replaced by the observer's finding:") &&
					strings.Contains(r.Reason, xid) && strings.Contains(r.Reason, pid))
			}
			assert.Equal(t, tc.kept, audited, "the intruder finding audited after the unhealthy cordon")
			assert.Equal(t, tc.kept, strings.Contains(logs.String(), "device already cordoned by a source that ranks higher"))

			d, err := e.g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: ctr("ml", "b", "main", "req0000000000001"), Spec: visible("1")})
			require.NoError(t, err)
			assert.Equal(t, guard.Reject, d.Result, d.Message)
			assert.Equal(t, guard.ReasonCordoned, d.Reason)
			assert.Contains(t, d.Message, xid)
		})
	}
}
