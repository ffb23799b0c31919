// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// A killed `gpu-guard-ctl run` under release_on = "remove": its ticket's
// claim used to be a holder "kept until removal" that nothing removes, so
// status showed no problem and gc left it. Both now see what the guard does:
// its process is gone, the claim is stale and gc releases it.
func TestKilledTicketIsStaleAndCollected(t *testing.T) {
	f := newFixture(t)
	cfg, err := os.ReadFile(f.config)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(f.config, append(cfg, []byte("[policy]\nrelease_on = \"remove\"\n")...), 0o600))
	id := guard.NewTicketID()
	ticket := ledger.Owner{ContainerID: id, Container: "gpu-guard-ctl run", FrontEnd: ledger.FrontEndHook}
	f.update(t, now.Add(-time.Minute), func(tx *ledger.Tx) {
		_, err := tx.Claim(id, ticket, []devices.Device{f.dev(t, uuidGPU1)}, "gpu-guard-ctl run --gpus 1")
		require.NoError(t, err)
		require.True(t, tx.SetStarted(id, 4242, 7, ""))
	})
	live := pidsExited{4242: "pid 4242 is gone"}

	r := runLive(f, live, "status", "-o", "json")
	require.Equal(t, ExitAttention, r.code, r.stderr)
	stale := staleOf(t, r.stdout, uuidGPU1)
	assert.Contains(t, stale, id, "status reports the dead ticket as stale")

	r = runLive(f, live, "gc")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, uuidGPU1)
	assert.Empty(t, claimedBy(f.state(t), id), "gc released the dead ticket's claim")
	assert.True(t, strings.Contains(r.stdout, id) || strings.Contains(r.stdout, ledger.ShortID(id)), r.stdout)
}

// A waiter has no claim: `release --container` used to answer "no claim is
// held" for it, and no command could remove a dead `gpu-guard-ctl run`'s
// ticket from the queue. It now removes the id's queue entry, with what
// was reserved for it, and says so.
func TestReleaseRemovesAQueueEntry(t *testing.T) {
	t.Run("a pod container's entry, by container id or requester", func(t *testing.T) {
		for _, name := range []string{ownW1.ContainerID[:12], key(ownW1)} {
			f := newFixture(t)
			f.populate(t)
			before := f.state(t)
			require.NotEmpty(t, waitersOf(before, ownW1.ContainerID))
			r := f.run(t, "release", "--container", name, "--reason", "gave up")
			require.Equal(t, ExitOK, r.code, r.stderr)
			assert.Contains(t, r.stdout, "removed the queue entry of team-f/w1/main (id 272727272727) (requester team-f/uid-w1/main, waiting for GPU 1 ("+uuidGPU1+")")
			// A pod's waiter records no process: the operator is told what
			// its next retry does.
			assert.Contains(t, r.stderr, "note: team-f/w1/main (id 272727272727) waits in the queue (requester team-f/uid-w1/main) for GPU 1 ("+uuidGPU1+")")
			assert.Contains(t, r.stderr, "it joins the queue again at its tail")
			st := f.state(t)
			assert.Empty(t, waitersOf(st, ownW1.ContainerID))
			assert.Len(t, st.Waiters, len(before.Waiters)-1, "only that entry goes")
			assert.Equal(t, before.Claims, st.Claims)
			var dequeued bool
			for _, rec := range f.audit(t) {
				if rec.Op == ledger.OpDequeue && rec.Key == key(ownW1) && strings.Contains(rec.Reason, "gave up") {
					dequeued = true
				}
			}
			assert.True(t, dequeued, "audited with the operator's reason")
		}
	})

	t.Run("a killed gpu-guard-ctl run's ticket and its reservation", func(t *testing.T) {
		f := newFixture(t)
		id := guard.NewTicketID()
		ticket := ledger.Owner{ContainerID: id, Container: "gpu-guard-ctl run", FrontEnd: ledger.FrontEndHook, Pid: 4242, PidStart: 7}
		f.update(t, now.Add(-time.Minute), func(tx *ledger.Tx) {
			claim(t, tx, ownTrainer, "env", f.dev(t, uuidGPU1))
			tx.Enqueue(id, ticket, []devices.Device{f.dev(t, uuidGPU1)})
			tx.Enqueue(key(ownW1), ownW1, []devices.Device{f.dev(t, uuidGPU1)})
			tx.Release(idTrainer, "stop") // GPU 1 is reserved for the ticket, the head
		})
		st := f.state(t)
		require.Len(t, st.Reservations, 1)
		require.Equal(t, id, st.Reservations[0].For)

		// Its ctl still runs: removed, it would queue again at the tail.
		r := runLive(f, pidsExited{}, "release", "--container", id, "--reason", "x")
		require.Equal(t, ExitError, r.code, r.stdout)
		assert.Contains(t, r.stderr, "gpu-guard-ctl run (id "+id[:12]+") waits in the queue (requester "+id+") for GPU 1 ("+uuidGPU1+") and is still running (pid 4242)")
		assert.Equal(t, st, f.state(t))

		r = runLive(f, pidsExited{4242: "pid 4242 is gone"}, "release", "--container", id, "--reason", "ctl killed", "-o", "json")
		require.Equal(t, ExitOK, r.code, r.stderr)
		var v releasedView
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &v), r.stdout)
		require.Len(t, v.Dequeued, 1)
		assert.Equal(t, dequeuedJSON{Requester: id, ContainerID: id, Devices: []string{uuidGPU1}, Reserved: []string{uuidGPU1}}, v.Dequeued[0])
		st = f.state(t)
		assert.Empty(t, waitersOf(st, id))
		require.Len(t, st.Reservations, 1)
		assert.Equal(t, key(ownW1), st.Reservations[0].For, "the freed GPU goes to the next in line")
	})
}
