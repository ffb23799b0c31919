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
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// pidLiveness reports the listed pids as exited (a holder recorded with a
// pid and no cgroup, as a ticket of gpu-guard-ctl run is).
type pidLiveness map[int]string

func (l pidLiveness) Exited(p liveness.Process) (bool, string) {
	why, ok := l[p.Pid]
	return ok, why
}

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
	live := pidLiveness{4242: "pid 4242 is gone"}

	r := runLive(f, live, "status", "-o", "json")
	require.Equal(t, ExitAttention, r.code, r.stderr)
	var view struct {
		Devices []struct {
			UUID  string `json:"uuid"`
			Stale string `json:"stale"`
		} `json:"devices"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &view))
	stale := ""
	for _, d := range view.Devices {
		if d.UUID == uuidGPU1 {
			stale = d.Stale
		}
	}
	assert.Contains(t, stale, id, "status reports the dead ticket as stale")

	r = runLive(f, live, "gc")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, uuidGPU1)
	assert.Empty(t, claimedBy(f.state(t), id), "gc released the dead ticket's claim")
	assert.True(t, strings.Contains(r.stdout, id) || strings.Contains(r.stdout, ledger.ShortID(id)), r.stdout)
}
