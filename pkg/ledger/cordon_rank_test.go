// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Cordon sources rank operator > unhealthy > intruder: a cordon of a lower
// rank than the one in force leaves that one as it is (source, reason, by,
// since), writes nothing but an audit record that names the cordon kept
// and the finding; one of equal or higher rank replaces it, keeping Since.
// An intruder found on a GPU cordoned unhealthy must not turn its cordon
// into an intruder's: lifted once the intruder is dealt with, it would put
// the broken GPU back into service.
func TestCordonPrecedenceBySource(t *testing.T) {
	const since = "2026-03-01T12:00:00Z" // newClock
	for _, tc := range []struct {
		old, new string
		kept     bool
	}{
		{old: CordonOperator, new: CordonOperator},
		{old: CordonOperator, new: CordonUnhealthy, kept: true},
		{old: CordonOperator, new: CordonIntruder, kept: true},
		{old: CordonUnhealthy, new: CordonOperator},
		{old: CordonUnhealthy, new: CordonUnhealthy},
		{old: CordonUnhealthy, new: CordonIntruder, kept: true},
		{old: CordonIntruder, new: CordonOperator},
		{old: CordonIntruder, new: CordonUnhealthy},
		{old: CordonIntruder, new: CordonIntruder},
	} {
		t.Run(tc.old+" then "+tc.new, func(t *testing.T) {
			c := newClock()
			l := openTest(t, c)
			var first Cordon
			update(t, l, func(tx *Tx) {
				var err error
				first, _, err = tx.Cordon(gpu(1), tc.old, "first reason", "first-by")
				require.NoError(t, err)
			})
			gen := snapshot(t, l).Generation
			before := len(auditRecords(t, l))

			c.Advance(time.Minute)
			update(t, l, func(tx *Tx) {
				k, isNew, err := tx.Cordon(gpu(1), tc.new, "second reason", "second-by")
				require.NoError(t, err)
				assert.False(t, isNew, "the device was cordoned already")
				if tc.kept {
					assert.Equal(t, first, k, "the cordon in force is returned")
				} else {
					assert.Equal(t, tc.new, k.Source)
				}
			})

			want := first
			wantReason := tc.old + " cordon kept, not replaced by the observer's finding: " +
				tc.old + " cordon by first-by since " + since + ": first reason (" + tc.new + ") by second-by: second reason"
			if !tc.kept {
				want = Cordon{Device: gpu(1), Source: tc.new, Reason: "second reason", By: "second-by", Since: first.Since}
				wantReason = "cordon updated (" + tc.new + ") by second-by: second reason (was " +
					tc.old + " cordon by first-by since " + since + ": first reason)"
			}
			st := snapshot(t, l)
			assert.Equal(t, []Cordon{want}, st.Cordons)
			assert.Equal(t, !tc.kept, st.Generation != gen, "committed iff replaced")

			recs := auditRecords(t, l)[before:]
			require.Len(t, recs, 1, "one audit record")
			assert.Equal(t, OpCordon, recs[0].Op)
			assert.Equal(t, []string{gpu(1).UUID}, recs[0].Devices)
			assert.Equal(t, wantReason, recs[0].Reason)
		})
	}
}
