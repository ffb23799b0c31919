// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// incarnation is container id as the OCI hook records it: with its init
// process, which tells two containers of one id (two runc roots) apart.
func incarnation(id string, pid int, start uint64) Owner {
	o := owner(id)
	o.FrontEnd, o.Pid, o.PidStart = FrontEndHook, pid, start
	return o
}

// Two runc roots each run a container "train"; train#1 (pid 100) died.
// Whatever decides that from its process (recovery's liveness check, the
// guard's, gc) ends train#1's claims only: train#2 still runs on GPU 1.
func TestOnlyTheDeadIncarnationIsReleased(t *testing.T) {
	t1, t2 := incarnation("train", 100, 1), incarnation("train", 200, 2)
	hold := func(t *testing.T, l *Ledger) {
		update(t, l, func(tx *Tx) {
			_, err := tx.Claim("", t1, devs(gpu(0)), "env")
			require.NoError(t, err)
			_, err = tx.Claim("", t2, devs(gpu(1)), "env")
			require.NoError(t, err)
		})
	}
	t.Run("recover", func(t *testing.T) {
		opts := testOptions(newClock())
		opts.RuntimeDir = t.TempDir()
		dir := filepath.Join(t.TempDir(), "state")
		l, err := Open(dir, opts)
		require.NoError(t, err)
		hold(t, l)
		p := filepath.Join(dir, stateName)
		b := mustRead(t, p)
		b[len(b)-3] ^= 0x20
		require.NoError(t, os.WriteFile(p, b, 0o600))

		rep, err := l.Recover(context.Background(), RecoverOptions{Reason: "test",
			Alive: func(c Claim) (bool, error) { return c.Owner.Pid == 200, nil }})
		require.NoError(t, err)
		require.Len(t, rep.Released, 1)
		assert.Equal(t, 100, rep.Released[0].Owner.Pid)
		assert.Equal(t, map[string]string{gpu(1).UUID: "train"}, holders(snapshot(t, l)))
	})
	for _, tc := range []struct {
		name string
		do   func(tx *Tx, dead Owner)
		// kept: the dead incarnation's claim stays (marked), not released.
		kept bool
	}{
		{name: "release", do: func(tx *Tx, dead Owner) { tx.ReleaseIncarnation(dead, "exited") }},
		{name: "drain", kept: true, do: func(tx *Tx, dead Owner) { tx.MarkDrainingIncarnation(dead, "exited") }},
		{name: "stopped", kept: true, do: func(tx *Tx, dead Owner) { tx.MarkStoppedIncarnation(dead) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := testOptions(newClock())
			opts.DrainGrace = time.Hour
			l, err := Open(t.TempDir(), opts)
			require.NoError(t, err)
			hold(t, l)
			update(t, l, func(tx *Tx) { tc.do(tx, t1) })
			st := snapshot(t, l)
			for _, c := range st.Claims {
				if c.Owner.Pid == 200 {
					assert.True(t, c.Owner.DrainingSince.IsZero() && c.Owner.StoppedAt.IsZero(), "train#2 is untouched: %+v", c.Owner)
				}
			}
			want := map[string]string{gpu(1).UUID: "train"}
			if tc.kept {
				want[gpu(0).UUID] = "train"
			}
			assert.Equal(t, want, holders(st))
		})
	}
}

// A waiter whose container id holds a device, but as another incarnation,
// does not own that device: it heads the queue waiting for GPU 0 (only the
// free GPU 1 is kept for it), and it is busy, not admitted.
func TestAnotherIncarnationsDeviceIsNotTheWaitersOwn(t *testing.T) {
	l := openTest(t, newClock())
	t1, t2 := incarnation("train", 100, 1), incarnation("train", 200, 2)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", t1, devs(gpu(0)), "env")
		require.NoError(t, err)
		tx.Enqueue("w2", t2, devs(gpu(0), gpu(1)))
	})
	assert.Equal(t, map[string]string{gpu(1).UUID: "w2"}, reservedFor(snapshot(t, l)), "w2 waits for GPU 0 as the head of the queue")
	err := l.Update(context.Background(), func(tx *Tx) error {
		_, err := tx.Claim("w2", t2, devs(gpu(0), gpu(1)), "env")
		return err
	})
	require.True(t, isBusy(err), "%v", err)
}

// A running container listed at recovery or reconcile on a device another
// incarnation of its id holds is a conflict, not the holder.
func TestListedIncarnationOnAnothersDeviceIsAConflict(t *testing.T) {
	l := openTest(t, newClock())
	t1, t2 := incarnation("train", 100, 1), incarnation("train", 200, 2)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", t1, devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	update(t, l, func(tx *Tx) {
		adopted, conflicts := tx.adoptListed(FrontEndHook, []Holding{{Owner: t2, Devices: devs(gpu(0))}}, nil)
		assert.Empty(t, adopted)
		require.Len(t, conflicts, 1)
		assert.Equal(t, 200, conflicts[0].Owner.Pid)
	})
	st := snapshot(t, l)
	require.Len(t, st.Claims, 1)
	assert.Equal(t, 100, st.Claims[0].Owner.Pid, "train#1 keeps its claim, without train#2's pid")
	require.Len(t, st.Conflicts, 1)
}

// What ends the exited incarnation keeps a claim of the same id that
// records no process: it may be another container, created and not started
// yet (a liveness check keeps such a holder).
func TestIncarnationOpsKeepAClaimWithoutAProcess(t *testing.T) {
	dead := incarnation("train", 100, 1)
	notStarted := owner("train")
	notStarted.FrontEnd = FrontEndHook
	for _, tc := range []struct {
		name string
		do   func(tx *Tx)
	}{
		{name: "release", do: func(tx *Tx) { tx.ReleaseIncarnation(dead, "exited") }},
		{name: "drain", do: func(tx *Tx) { tx.MarkDrainingIncarnation(dead, "exited") }},
		{name: "stopped", do: func(tx *Tx) { tx.MarkStoppedIncarnation(dead) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := testOptions(newClock())
			opts.DrainGrace = time.Hour
			l, err := Open(t.TempDir(), opts)
			require.NoError(t, err)
			update(t, l, func(tx *Tx) {
				_, err := tx.Claim("", dead, devs(gpu(0)), "env")
				require.NoError(t, err)
				_, err = tx.Claim("", notStarted, devs(gpu(1)), "env")
				require.NoError(t, err)
			})
			update(t, l, tc.do)
			for _, c := range snapshot(t, l).Claims {
				if c.Device.UUID == gpu(1).UUID {
					assert.True(t, c.Owner.DrainingSince.IsZero() && c.Owner.StoppedAt.IsZero(), "untouched: %+v", c.Owner)
					return
				}
			}
			t.Fatal("the claim without a process was released")
		})
	}
}
