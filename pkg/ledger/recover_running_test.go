// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func hookHolder(id string) Owner {
	return Owner{ContainerID: id, FrontEnd: FrontEndHook, Pid: 1000, PidStart: 42}
}

// lostClaimLedger is a hook host where h1 holds GPU 0 and h2 GPU 1 (in the
// snapshot), then h3 claimed GPU 2 (the journal's last record), and that
// record was damaged: recovery cannot bring h3's claim back.
func lostClaimLedger(t *testing.T) (*Ledger, Options) {
	t.Helper()
	opts := testOptions(newClock())
	opts.RuntimeDir = t.TempDir()
	dir := filepath.Join(t.TempDir(), "state")
	l, err := Open(dir, opts)
	require.NoError(t, err)
	for i, id := range []string{"h1", "h2", "h3"} {
		update(t, l, func(tx *Tx) {
			_, err := tx.Claim("", hookHolder(id), devs(gpu(i)), "env")
			require.NoError(t, err)
		})
	}
	p := filepath.Join(dir, journalName)
	data, err := os.ReadFile(p)
	require.NoError(t, err)
	data[len(data)-10] ^= 0x20 // inside h3's record
	require.NoError(t, os.WriteFile(p, data, 0o600))
	l, err = Open(dir, opts)
	require.NoError(t, err)
	_, err = l.Snapshot(context.Background())
	require.ErrorIs(t, err, ErrNeedsRecovery)
	return l, opts
}

// TestRecoverAdoptsRunningContainers: the containers the runtime runs are
// applied to the recovered state. h3, whose claim was lost, adopts GPU 2
// back; h1, whose liveness check says gone, keeps GPU 0 because the runtime
// runs it; x, on h2's GPU 1, is a conflict; y and z both reach the free
// GPU 3: the one listed first adopts it and the other is a conflict, and
// both are in the report; a listed container without devices adopts
// nothing. Every adoption and conflict is audited with where it was found.
func TestRecoverAdoptsRunningContainers(t *testing.T) {
	for _, dryRun := range []bool{true, false} {
		t.Run(fmt.Sprintf("dry-run=%t", dryRun), func(t *testing.T) {
			l, _ := lostClaimLedger(t)
			running := []Holding{
				{Owner: hookHolder("h1"), Devices: devs(gpu(0)), Source: "env"},
				{Owner: hookHolder("h3"), Devices: devs(gpu(2)), Source: "env"},
				{Owner: hookHolder("x"), Devices: devs(gpu(1)), Source: "env"},
				{Owner: hookHolder("y"), Devices: devs(gpu(3)), Source: "env"},
				{Owner: hookHolder("z"), Devices: devs(gpu(3)), Source: "env"},
				{Owner: hookHolder("nospec")},
			}
			var asked []string
			rep, err := l.Recover(context.Background(), RecoverOptions{
				DryRun:  dryRun,
				Running: running,
				RunningWhy: func(i int) string {
					return "recover: found running in runc state (" + running[i].Owner.ContainerID + ")"
				},
				Alive: func(c Claim) (bool, error) {
					asked = append(asked, c.Owner.ContainerID)
					return c.Owner.ContainerID == "h2", nil
				},
			})
			require.NoError(t, err)
			require.False(t, rep.Complete, "h3's commit was lost")
			assert.Equal(t, []string{"h2"}, asked, "a listed holder's liveness is not even asked")
			assert.Empty(t, rep.Released)

			adopted := map[string]string{}
			for _, c := range rep.Adopted {
				adopted[c.Device.UUID] = c.Owner.ContainerID
				assert.Equal(t, FrontEndHook, c.Owner.FrontEnd)
			}
			assert.Equal(t, map[string]string{gpu(2).UUID: "h3", gpu(3).UUID: "y"}, adopted)
			conflicts := map[string]string{}
			for _, c := range rep.Conflicts {
				conflicts[c.Owner.ContainerID] = c.Device.UUID
			}
			assert.Equal(t, map[string]string{"x": gpu(1).UUID, "z": gpu(3).UUID}, conflicts)
			want := map[string]string{gpu(0).UUID: "h1", gpu(1).UUID: "h2", gpu(2).UUID: "h3", gpu(3).UUID: "y"}
			require.Equal(t, want, holders(State{Claims: rep.Claims}))

			if dryRun {
				_, err := l.Snapshot(context.Background())
				require.ErrorIs(t, err, ErrNeedsRecovery, "a dry run writes nothing")
				return
			}
			st := snapshot(t, l)
			require.Equal(t, want, holders(st))
			require.Len(t, st.Conflicts, 2)
			recs, err := ReadAudit(l.AuditPath())
			require.NoError(t, err)
			var adopts, conflictRecs []AuditRecord
			for _, r := range recs {
				switch r.Op {
				case OpAdopt:
					adopts = append(adopts, r)
				case OpConflict:
					conflictRecs = append(conflictRecs, r)
				}
			}
			require.Len(t, adopts, 2)
			assert.Equal(t, "h3", adopts[0].ContainerID)
			assert.Equal(t, "recover: found running in runc state (h3)", adopts[0].Reason)
			assert.Equal(t, "y", adopts[1].ContainerID)
			require.Len(t, conflictRecs, 2)
			assert.Contains(t, conflictRecs[0].Reason, "recover: found running in runc state (x); running on a device held by")
			assert.Contains(t, conflictRecs[1].Reason, "held by container y")

			// The next claim of GPU 2 is refused: h3 holds it again.
			err = l.Update(context.Background(), func(tx *Tx) error {
				_, err := tx.Claim("", hookHolder("late"), devs(gpu(2)), "env")
				return err
			})
			require.True(t, isBusy(err), "GPU 2 is held by h3 again: %v", err)
		})
	}
}

// TestRecoverRunningOnHealthyLedgerChangesNothing: a healthy ledger is not
// recovered, whatever the runtime runs.
func TestRecoverRunningOnHealthyLedgerChangesNothing(t *testing.T) {
	l := openTest(t, newClock())
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", hookHolder("h1"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	rep, err := l.Recover(context.Background(), RecoverOptions{Running: []Holding{{Owner: hookHolder("y"), Devices: devs(gpu(1))}}})
	require.NoError(t, err)
	require.Empty(t, rep.Problem)
	require.Empty(t, rep.Adopted)
	require.Equal(t, map[string]string{gpu(0).UUID: "h1"}, holders(snapshot(t, l)))
}

// TestResetWithRunningStartsFromTheRunningContainers: the reset state holds
// exactly the running containers' devices, the later of two on one GPU
// being a conflict; every adoption is audited before the reset record.
func TestResetWithRunningStartsFromTheRunningContainers(t *testing.T) {
	l, _ := lostClaimLedger(t)
	rep, err := l.ResetWith(context.Background(), ResetOptions{Reason: "test", Running: []Holding{
		{Owner: hookHolder("h1"), Devices: devs(gpu(0))},
		{Owner: hookHolder("x"), Devices: devs(gpu(0))},
		{Owner: hookHolder("h3"), Devices: devs(gpu(2))},
	}})
	require.NoError(t, err)
	require.False(t, rep.Empty)
	require.True(t, rep.NewLineage)
	require.Len(t, rep.Adopted, 2)
	require.Len(t, rep.Conflicts, 1)
	assert.Equal(t, "x", rep.Conflicts[0].Owner.ContainerID)
	st := snapshot(t, l)
	require.Equal(t, map[string]string{gpu(0).UUID: "h1", gpu(2).UUID: "h3"}, holders(st), "h2, not running, is forgotten")
	require.Len(t, st.Conflicts, 1)
	var reasons []string
	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	for _, r := range recs {
		if r.Op == OpAdopt || r.Op == OpReset {
			reasons = append(reasons, r.Op+": "+r.Reason)
		}
	}
	require.Len(t, reasons, 3)
	assert.Equal(t, "adopt: reset: found running in the runtime's state", reasons[0])
	assert.Contains(t, reasons[2], "reset: test; old files moved to")
	assert.Contains(t, reasons[2], "2 claim(s) adopted")
}
