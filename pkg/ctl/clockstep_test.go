// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// gpu-guard-ctl reads the ledger without writing it: where the wall clock
// was stepped since the ledger's last anchor, the times it shows are moved
// by the step as the next writer will move them, so that "waited" counts
// the time that passed, and nothing expires for the step.
func TestQueueCountsNoClockStep(t *testing.T) {
	f := newFixture(t)
	wall, boot := now.Add(-10*time.Minute), 3*time.Hour
	opts := f.ledgerOpts(0)
	opts.Now = func() time.Time { return wall }
	opts.BootClock = func() time.Duration { return boot }
	l, err := ledger.Open(f.dir, opts)
	require.NoError(t, err)
	require.NoError(t, l.Update(context.Background(), func(tx *ledger.Tx) error {
		claim(t, tx, ownTrainer, "env", f.dev(t, uuidGPU1))
		tx.Enqueue(key(ownW1), ownW1, []devices.Device{f.dev(t, uuidGPU1)})
		return nil
	}))

	// Ten minutes pass, and the wall clock is stepped an hour forward
	// (past queue_ttl).
	var stdout, stderr syncBuffer
	env := f.env(&stdout, &stderr)
	env.Now = func() time.Time { return now.Add(time.Hour) }
	env.BootClock = func() time.Duration { return boot + 10*time.Minute }
	code := Run(context.Background(), []string{"--config", f.config, "queue", "-o", "json"}, env)
	require.Equal(t, 0, code, stderr.String())
	var q struct {
		Waiters []struct {
			Requester     string    `json:"requester"`
			FirstSeen     time.Time `json:"first_seen"`
			WaitedSeconds int64     `json:"waited_seconds"`
		} `json:"waiters"`
	}
	require.NoError(t, json.Unmarshal([]byte(stdout.String()), &q), stdout.String())
	require.Len(t, q.Waiters, 1, "the step expires nobody")
	require.Equal(t, key(ownW1), q.Waiters[0].Requester)
	require.Equal(t, int64(600), q.Waiters[0].WaitedSeconds)
	require.True(t, now.Add(50*time.Minute).Equal(q.Waiters[0].FirstSeen), "as the stepped clock would have read it: %s", q.Waiters[0].FirstSeen)
}
