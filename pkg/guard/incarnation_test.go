// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// hookTrain is container "train" as an OCI hook records it: with the pid
// and start time of its process (none when pid is 0).
func hookTrain(pid int) ledger.Owner {
	o := ledger.Owner{ContainerID: "train", FrontEnd: ledger.FrontEndHook, Pid: pid}
	if pid > 0 {
		o.PidStart = uint64(pid) * 10
	}
	return o
}

// runsPids is a RemovedExited/WithdrawExited liveness answer: the recorded
// process runs if its pid is listed (and its start time is known).
func runsPids(pids ...int) func(ledger.Owner) bool {
	return func(o ledger.Owner) bool {
		if o.Pid <= 0 || o.PidStart == 0 {
			return false
		}
		for _, p := range pids {
			if o.Pid == p {
				return true
			}
		}
		return false
	}
}

// Two containers "train" (two runtime roots) hold GPU 0 (pid 100, ended)
// and GPU 1 (pid 200). The removal of the ended one, named by id alone,
// decides under the lock which claims are its own: a claim whose process
// runs is the other container's and is kept, whenever it was admitted.
// With no other running it is Removed, for NRI owners too.
func TestRemovedExitedKeepsTheRunningIncarnation(t *testing.T) {
	for _, tc := range []struct {
		name     string
		idle     bool
		ended    ledger.Owner // holds GPU 0
		other    ledger.Owner // holds GPU 1
		runs     func(ledger.Owner) bool
		wantHeld map[string]int  // device → holder pid, after
		wantKept []string        // devices RemovedExited returns
		draining map[string]bool // devices draining, after
	}{
		{
			name:  "the other runs: only the ended one's claim is released",
			ended: hookTrain(100), other: hookTrain(200), runs: runsPids(200),
			wantHeld: map[string]int{uuid(1): 200}, wantKept: []string{uuid(1)},
		},
		{
			name: "release_requires_idle: only the ended one's claim drains",
			idle: true, ended: hookTrain(100), other: hookTrain(200), runs: runsPids(200),
			wantHeld: map[string]int{uuid(0): 100, uuid(1): 200}, wantKept: []string{uuid(1)},
			draining: map[string]bool{uuid(0): true},
		},
		{
			name:  "the ended one recorded no process: its device alone is released",
			ended: hookTrain(0), other: hookTrain(200), runs: runsPids(200),
			wantHeld: map[string]int{uuid(1): 200}, wantKept: []string{uuid(1)},
		},
		{
			name: "release_requires_idle, no process recorded: released, the running one untouched",
			idle: true, ended: hookTrain(0), other: hookTrain(200), runs: runsPids(200),
			wantHeld: map[string]int{uuid(1): 200}, wantKept: []string{uuid(1)},
		},
		{
			name:  "none runs: every claim of the id ends, as Removed",
			ended: hookTrain(100), other: hookTrain(200), runs: runsPids(),
			wantHeld: map[string]int{},
		},
		{
			name: "release_requires_idle, none runs: every claim of the id drains, as Removed",
			idle: true, ended: hookTrain(100), other: hookTrain(200), runs: runsPids(),
			wantHeld: map[string]int{uuid(0): 100, uuid(1): 200},
			draining: map[string]bool{uuid(0): true, uuid(1): true},
		},
		{
			name:  "owners without a process (NRI before start): by id, as Removed",
			ended: ctr("ml", "a", "main", "train"), other: ctr("ml", "a", "main", "train"), runs: runsPids(),
			wantHeld: map[string]int{},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, _ := newStateEnv(t, func(c *config.Config) {
				c.Observe.ReleaseRequiresIdle = tc.idle
				c.Observe.IdleGrace = config.Duration{Duration: time.Minute}
			})
			for i, o := range []ledger.Owner{tc.ended, tc.other} {
				d, err := e.g.Admit(ctx, guard.Request{FrontEnd: o.FrontEnd, Owner: o, Spec: visible(uuid(i))})
				require.NoError(t, err)
				require.Equal(t, guard.Admit, d.Result, d.Message)
			}
			kept, err := e.g.RemovedExited(ctx, tc.ended, tc.runs)
			require.NoError(t, err)
			var keptUUIDs []string
			for _, c := range kept {
				keptUUIDs = append(keptUUIDs, c.Device.UUID)
			}
			assert.Equal(t, tc.wantKept, keptUUIDs)
			held := map[string]int{}
			draining := map[string]bool{}
			for _, c := range e.state().Claims {
				held[c.Device.UUID] = c.Owner.Pid
				if !c.Owner.DrainingSince.IsZero() {
					draining[c.Device.UUID] = true
				}
			}
			assert.Equal(t, tc.wantHeld, held)
			if tc.draining == nil {
				tc.draining = map[string]bool{}
			}
			assert.Equal(t, tc.draining, draining)

			// Idempotent: a second removal changes nothing more.
			_, err = e.g.RemovedExited(ctx, tc.ended, tc.runs)
			require.NoError(t, err)
			assert.Len(t, e.state().Claims, len(tc.wantHeld))
		})
	}
}

// WithdrawExited drops the queue entry of an id only if the process it
// records is gone: a container of the same id that waits keeps its place.
func TestWithdrawExited(t *testing.T) {
	for _, tc := range []struct {
		name      string
		runs      func(ledger.Owner) bool
		wantKept  bool
		wantQueue []string
	}{
		{"the waiter's process is gone", runsPids(), false, nil},
		{"the waiter's process runs: another container of the id", runsPids(200), true, []string{"train"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, _ := newStateEnv(t, nil)
			holder := ctr("ml", "a", "main", "holder0000000001")
			require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
			w := hookTrain(200)
			d, err := e.g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndHook, Owner: w, Key: "train", Spec: visible("1")})
			require.NoError(t, err)
			require.Equal(t, guard.Queue, d.Result)

			kept, err := e.g.WithdrawExited(ctx, "train", "container removed", tc.runs)
			require.NoError(t, err)
			assert.Equal(t, tc.wantKept, kept)
			assert.Equal(t, tc.wantQueue, e.waiters())

			kept, err = e.g.WithdrawExited(ctx, "nobody", "container removed", tc.runs)
			require.NoError(t, err, "no entry: nothing to do")
			assert.False(t, kept)
		})
	}
}
