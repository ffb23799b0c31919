// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// CordonDeviceInForce tells its caller (the daemon, which logs what it did)
// which cordon is in force on the device once its request is decided, and
// whether that is another source's, kept instead of the request's: Cordon's
// "changed" is false both for a repeat of the cordon in force and for a
// request a higher-ranking cordon kept out.
func TestCordonDeviceInForceSaysWhetherTheCordonWasKept(t *testing.T) {
	const xid, pid = "critical Xid 79", "intruder: pid 4242 (host process) runs on it without a claim"
	for _, tc := range []struct {
		name     string
		inForce  string // the source of the cordon before ("" none)
		source   string
		reason   string
		kept     bool
		wantFrom string // the source of the cordon in force after
	}{
		{name: "a new cordon", source: ledger.CordonIntruder, reason: pid, wantFrom: ledger.CordonIntruder},
		{name: "a repeat", inForce: ledger.CordonUnhealthy, source: ledger.CordonUnhealthy, reason: xid, wantFrom: ledger.CordonUnhealthy},
		{name: "unhealthy over an intruder's", inForce: ledger.CordonIntruder, source: ledger.CordonUnhealthy, reason: xid,
			wantFrom: ledger.CordonUnhealthy},
		{name: "intruder under an unhealthy one", inForce: ledger.CordonUnhealthy, source: ledger.CordonIntruder, reason: pid,
			kept: true, wantFrom: ledger.CordonUnhealthy},
		{name: "unhealthy under an operator's", inForce: ledger.CordonOperator, source: ledger.CordonUnhealthy, reason: xid,
			kept: true, wantFrom: ledger.CordonOperator},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, _ := newStateEnv(t, nil)
			reasons := map[string]string{ledger.CordonUnhealthy: xid, ledger.CordonIntruder: pid, ledger.CordonOperator: "RMA 4711"}
			if tc.inForce != "" {
				require.NoError(t, e.g.CordonDevice(ctx, uuid(1), tc.inForce, reasons[tc.inForce]))
			}
			k, kept, err := e.g.CordonDeviceInForce(ctx, uuid(1), tc.source, tc.reason)
			require.NoError(t, err)
			assert.Equal(t, tc.kept, kept)
			st := e.state()
			require.Len(t, st.Cordons, 1)
			assert.Equal(t, st.Cordons[0], k, "the cordon in force")
			assert.Equal(t, tc.wantFrom, k.Source)
			if !tc.kept {
				assert.Equal(t, tc.reason, k.Reason, "the request's cordon")
				assert.Equal(t, guard.ObserverBy, k.By)
			}
		})
	}
}
