// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// GPU 1 waits for an RMA under an operator's cordon. The observer then
// finds it unhealthy, or finds an intruder on it: the operator's cordon
// stays as it was (source, reason, author, since), the finding is audited
// after it, and after a reboot GPU 1 is still cordoned (an observer's
// cordon would have been dropped and the GPU taken claims again).
func TestObserverCordonNeverReplacesAnOperators(t *testing.T) {
	for _, source := range []string{CordonUnhealthy, CordonIntruder} {
		t.Run(source, func(t *testing.T) {
			c := newClock()
			dir := filepath.Join(t.TempDir(), "state")
			l, err := Open(dir, rebootOptions(t, c, testBoot))
			require.NoError(t, err)
			var op Cordon
			update(t, l, func(tx *Tx) {
				op, _, err = tx.Cordon(gpu(1), CordonOperator, "RMA 4711", "uid 0 via gpu-guard-ctl")
				require.NoError(t, err)
			})
			gen := snapshot(t, l).Generation
			c.Advance(time.Minute)
			update(t, l, func(tx *Tx) {
				k, isNew, err := tx.Cordon(gpu(1), source, "Xid 79: fallen off the bus", "observer")
				require.NoError(t, err)
				assert.False(t, isNew)
				assert.Equal(t, op, k, "the cordon in force is the operator's")
			})
			st := snapshot(t, l)
			assert.Equal(t, []Cordon{op}, st.Cordons, "unchanged")
			assert.Equal(t, gen, st.Generation, "no commit: the state did not change")
			var found bool
			for _, r := range auditRecords(t, l) {
				if r.Op == OpCordon && strings.HasPrefix(r.Reason, CordonKeptPrefix(CordonOperator)) {
					found = true
					assert.Equal(t, []string{gpu(1).UUID}, r.Devices)
					for _, s := range []string{"RMA 4711", "uid 0 via gpu-guard-ctl", source, "Xid 79: fallen off the bus", "observer"} {
						assert.Contains(t, r.Reason, s)
					}
				}
			}
			assert.True(t, found, "the finding is audited")

			c.Advance(time.Hour)
			l2, err := Open(dir, rebootOptions(t, c, "after-reboot"))
			require.NoError(t, err)
			assert.Equal(t, []Cordon{op}, snapshot(t, l2).Cordons, "kept across the reboot")
			err = l2.Update(context.Background(), func(tx *Tx) error {
				_, err := tx.Claim("", owner("n1"), devs(gpu(1)), "env")
				return err
			})
			require.ErrorIs(t, err, ErrCordoned, "GPU 1 takes no claim after the reboot")
		})
	}
}

// Cordons are per device: an observer's cordon on a MIG instance of a GPU
// an operator cordoned (or an operator's on a MIG instance of a GPU the
// observer cordoned) stands next to the other. Each is lifted on its own,
// and a reboot keeps exactly the operator's.
func TestCordonsOnAGPUAndItsMIGInstanceAreSeparate(t *testing.T) {
	c := newClock()
	dir := filepath.Join(t.TempDir(), "state")
	l, err := Open(dir, rebootOptions(t, c, testBoot))
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, _, err := tx.Cordon(gpu(2), CordonOperator, "riser", "uid 0")
		require.NoError(t, err)
		_, isNew, err := tx.Cordon(mig(2, 0), CordonUnhealthy, "Xid 79", "observer")
		require.NoError(t, err)
		assert.True(t, isNew, "a cordon of its own")
		_, _, err = tx.Cordon(gpu(3), CordonIntruder, "pid 4242", "observer")
		require.NoError(t, err)
		_, isNew, err = tx.Cordon(mig(3, 1), CordonOperator, "MIG layout change", "uid 0")
		require.NoError(t, err)
		assert.True(t, isNew)
	})
	assert.Equal(t, map[string]string{gpu(2).UUID: CordonOperator, mig(2, 0).UUID: CordonUnhealthy,
		gpu(3).UUID: CordonIntruder, mig(3, 1).UUID: CordonOperator}, cordonSources(snapshot(t, l).Cordons))

	// Lifting the operator's GPU cordon leaves the unhealthy MIG instance
	// cordoned, which still blocks its GPU.
	update(t, l, func(tx *Tx) {
		_, ok := tx.Uncordon(gpu(2).UUID, "uid 0")
		require.True(t, ok)
		assert.Len(t, tx.CordonsOn("", devs(gpu(2))), 1)
	})

	opts := rebootOptions(t, c, "after-reboot")
	l2, err := Open(dir, opts)
	require.NoError(t, err)
	assert.Equal(t, map[string]string{mig(3, 1).UUID: CordonOperator}, cordonSources(snapshot(t, l2).Cordons))
}
