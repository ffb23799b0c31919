// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// Two containers "train" (two runtime roots): the one on GPU 2 exited, and
// its record lacks what would tell it apart by itself (no pid start time:
// it could not be read; or no pid at all, only its cgroup). The liveness
// check of a request for GPU 2 releases the exited one's claim and never
// the live one's on GPU 1, whose process is recorded and differs.
func TestHolderCheckKeepsTheLiveIncarnationOfAnIncompleteRecord(t *testing.T) {
	for _, tc := range []struct {
		name   string
		exited ledger.Owner
	}{
		{"pid without start time", ledger.Owner{Pid: 100, Cgroup: "/a/train-a"}},
		{"cgroup only", ledger.Owner{Cgroup: "/a/train-a"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, nil)
			dead := tc.exited
			dead.ContainerID, dead.FrontEnd = "train", ledger.FrontEndHook
			live := ledger.Owner{ContainerID: "train", FrontEnd: ledger.FrontEndHook, Pid: 200, PidStart: 2000, Cgroup: "/b/train-b"}
			// Written as they were recorded (Admit would look up the
			// start time that was missing then).
			require.NoError(t, e.l.Update(ctx, func(tx *ledger.Tx) error {
				if _, err := tx.Claim("", dead, []devices.Device{dev(t, 2)}, "env"); err != nil {
					return err
				}
				_, err := tx.Claim("", live, []devices.Device{dev(t, 1)}, "env")
				return err
			}))
			e.live.exited["train-a"] = true

			req := ctr("ml", "b", "main", "req0000000000001")
			d := e.admit(req, visible("2"))
			require.Equal(t, guard.Admit, d.Result, d.Message)
			assert.Equal(t, map[string]string{uuid(1): "train", uuid(2): req.ContainerID}, e.holders(),
				"the live train keeps GPU 1")
			assert.Equal(t, []string{"train-a"}, e.live.asked, "only the holder of GPU 2 is checked")
		})
	}
}

// dev is GPU i of the test inventory.
func dev(t *testing.T, i int) devices.Device {
	t.Helper()
	d, ok := inventory(t).Lookup(uuid(i))
	require.True(t, ok)
	return d
}
