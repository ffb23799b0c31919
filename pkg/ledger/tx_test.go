// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

func TestClaimConflicts(t *testing.T) {
	type held struct {
		id  string
		dev devices.Device
	}
	for _, tc := range []struct {
		name     string
		held     []held
		reserve  []devices.Device // reserved for key "other" (a waiter)
		id       string
		want     []devices.Device
		busy     []string // UUIDs reported busy, in order
		byHolder []string // holder container id per busy entry ("" = reservation)
	}{
		{name: "free GPU", id: "c1", want: devs(gpu(0))},
		{name: "GPU held by another", held: []held{{"c0", gpu(0)}}, id: "c1", want: devs(gpu(0)),
			busy: []string{gpu(0).UUID}, byHolder: []string{"c0"}},
		{name: "MIG of a held GPU", held: []held{{"c0", gpu(0)}}, id: "c1", want: devs(mig(0, 1)),
			busy: []string{mig(0, 1).UUID}, byHolder: []string{"c0"}},
		{name: "GPU with a held MIG", held: []held{{"c0", mig(0, 1)}}, id: "c1", want: devs(gpu(0)),
			busy: []string{gpu(0).UUID}, byHolder: []string{"c0"}},
		{name: "GPU with two held MIGs lists both holders", held: []held{{"c0", mig(0, 1)}, {"c2", mig(0, 2)}}, id: "c1", want: devs(gpu(0)),
			busy: []string{gpu(0).UUID, gpu(0).UUID}, byHolder: []string{"c0", "c2"}},
		{name: "sibling MIG is free", held: []held{{"c0", mig(0, 1)}}, id: "c1", want: devs(mig(0, 2))},
		{name: "MIG of another GPU is free", held: []held{{"c0", gpu(0)}}, id: "c1", want: devs(mig(1, 0))},
		{name: "own claim is no obstacle", held: []held{{"c1", gpu(0)}}, id: "c1", want: devs(gpu(0), gpu(1))},
		{name: "all or nothing", held: []held{{"c0", gpu(1)}}, id: "c1", want: devs(gpu(0), gpu(1), gpu(2)),
			busy: []string{gpu(1).UUID}, byHolder: []string{"c0"}},
		{name: "reserved for another waiter", reserve: devs(gpu(0)), id: "c1", want: devs(gpu(0)),
			busy: []string{gpu(0).UUID}, byHolder: []string{""}},
		{name: "MIG of a GPU reserved for another", reserve: devs(gpu(0)), id: "c1", want: devs(mig(0, 0)),
			busy: []string{mig(0, 0).UUID}, byHolder: []string{""}},
		{name: "duplicates are one device", id: "c1", want: devs(gpu(3), gpu(3))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := openTest(t, newClock())
			update(t, l, func(tx *Tx) {
				for _, h := range tc.held {
					_, err := tx.Claim("", owner(h.id), devs(h.dev), "env")
					require.NoError(t, err)
				}
				if len(tc.reserve) > 0 {
					// A waiter for free devices gets them reserved.
					tx.Enqueue("other", owner("w"), tc.reserve)
				}
			})
			before := snapshot(t, l)
			var claims []Claim
			err := l.Update(context.Background(), func(tx *Tx) error {
				var err error
				claims, err = tx.Claim("", owner(tc.id), tc.want, "env")
				return err
			})
			after := snapshot(t, l)
			if len(tc.busy) == 0 {
				require.NoError(t, err)
				for _, d := range uniqueDevices(tc.want) {
					require.Equal(t, tc.id, holders(after)[d.UUID], d.UUID)
				}
				require.Len(t, claims, len(uniqueDevices(tc.want)))
				return
			}
			require.True(t, isBusy(err), "want BusyError, got %v", err)
			var be *BusyError
			require.ErrorAs(t, err, &be)
			var got, by []string
			for _, b := range be.Busy {
				got = append(got, b.Wanted.UUID)
				if b.Holder != nil {
					by = append(by, b.Holder.Owner.ContainerID)
				} else {
					require.NotNil(t, b.Reservation)
					require.Equal(t, "other", b.Reservation.For)
					by = append(by, "")
				}
			}
			require.Equal(t, tc.busy, got)
			require.Equal(t, tc.byHolder, by)
			require.Equal(t, before.Generation, after.Generation, "a refused claim writes nothing")
			require.Equal(t, holders(before), holders(after))
		})
	}
}

func TestBusyErrorNamesDevicesAndHolders(t *testing.T) {
	l := openTest(t, newClock())
	o := Owner{ContainerID: "0123456789abcdef0123", Namespace: "team-a", Pod: "trainer", Container: "cuda", FrontEnd: FrontEndNRI}
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", o, devs(gpu(1)), "env")
		require.NoError(t, err)
		tx.Enqueue("team-b/uid/ctr", owner("x"), devs(gpu(2)))
	})
	err := l.Update(context.Background(), func(tx *Tx) error {
		_, err := tx.Claim("", owner("c9"), devs(gpu(1), gpu(2)), "env")
		return err
	})
	require.Error(t, err)
	msg := err.Error()
	for _, want := range []string{
		"GPU 1 (" + gpu(1).UUID + ")", "team-a/trainer/cuda", "0123456789ab", "since 2026-03-01T12:00:00Z",
		"GPU 2 (" + gpu(2).UUID + ")", `reserved for queued request "team-b/uid/ctr"`,
	} {
		require.Contains(t, msg, want)
	}
	require.NotContains(t, msg, "0123456789abcdef0123", "ids are shortened")
}

func TestClaimIsIdempotentAndAudited(t *testing.T) {
	l := openTest(t, newClock())
	for i := 0; i < 2; i++ {
		update(t, l, func(tx *Tx) {
			_, err := tx.Claim("", owner("c1"), devs(gpu(0)), "env")
			require.NoError(t, err)
		})
	}
	st := snapshot(t, l)
	require.Len(t, st.Claims, 1)
	require.Equal(t, uint64(1), st.Generation, "re-claim of a held device changes nothing")
	require.Equal(t, []string{OpClaim}, auditOps(t, l))
}

func TestClaimRejectsInvalidRequests(t *testing.T) {
	l := openTest(t, newClock())
	for _, tc := range []struct {
		name  string
		owner Owner
		devs  []devices.Device
	}{
		{"no container id", Owner{}, devs(gpu(0))},
		{"no devices", owner("c1"), nil},
		{"device without UUID", owner("c1"), devs(devices.Device{Index: "0"})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := l.Update(context.Background(), func(tx *Tx) error {
				_, err := tx.Claim("", tc.owner, tc.devs, "env")
				return err
			})
			require.ErrorIs(t, err, ErrInvalid)
		})
	}
	require.Equal(t, uint64(0), snapshot(t, l).Generation)
}

func TestReleaseOnlyOwnClaimsAndIdempotent(t *testing.T) {
	l := openTest(t, newClock())
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("c1"), devs(gpu(0), gpu(1)), "env")
		require.NoError(t, err)
		_, err = tx.Claim("", owner("c2"), devs(gpu(2)), "env")
		require.NoError(t, err)
	})
	var rel []Claim
	update(t, l, func(tx *Tx) { rel = tx.Release("c1", "stop") })
	require.Len(t, rel, 2)
	require.Equal(t, map[string]string{gpu(2).UUID: "c2"}, holders(snapshot(t, l)))
	gen := snapshot(t, l).Generation
	update(t, l, func(tx *Tx) {
		require.Empty(t, tx.Release("c1", "stop again"))
		require.Empty(t, tx.Release("", "empty id"))
		require.Empty(t, tx.Release("unknown", "never held"))
	})
	require.Equal(t, gen, snapshot(t, l).Generation, "releasing nothing writes nothing")

	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	last := recs[len(recs)-1]
	require.Equal(t, OpRelease, last.Op)
	require.Equal(t, "c1", last.ContainerID)
	require.ElementsMatch(t, []string{gpu(0).UUID, gpu(1).UUID}, last.Devices)
	require.Equal(t, "stop", last.Reason)
}

func TestReleasePod(t *testing.T) {
	l := openTest(t, newClock())
	a, b := owner("a"), owner("b")
	a.PodUID, a.PodSandboxID = "pod-1", "sb-1"
	b.PodUID, b.PodSandboxID = "pod-1", "sb-1"
	c := owner("c")
	// A hook container whose annotations name the same pod: its pod
	// identity is its creator's word, and the NRI pod's end is not its end.
	spoof := owner("spoof")
	spoof.PodUID, spoof.PodSandboxID, spoof.FrontEnd = "pod-1", "sb-1", FrontEndHook
	update(t, l, func(tx *Tx) {
		for i, o := range []Owner{a, b, c, spoof} {
			_, err := tx.Claim("", o, devs(gpu(i)), "env")
			require.NoError(t, err)
		}
	})
	for _, tc := range []struct{ uid, sandbox string }{{"pod-1", ""}, {"", "sb-1"}} {
		l2 := openTest(t, nil)
		require.NoError(t, copyState(l, l2))
		update(t, l2, func(tx *Tx) {
			require.Len(t, tx.ReleasePod(FrontEndNRI, tc.uid, tc.sandbox, "pod removed"), 2)
			require.Empty(t, tx.ReleasePod(FrontEndNRI, "", "", "nothing named"))
		})
		require.Equal(t, map[string]string{gpu(2).UUID: "c", gpu(3).UUID: "spoof"}, holders(snapshot(t, l2)))
	}
}

// copyState copies the state files (snapshot and journal) of one ledger
// into another's dir.
func copyState(from, to *Ledger) error {
	for _, p := range [][2]string{{from.StatePath(), to.StatePath()}, {from.JournalPath(), to.JournalPath()}} {
		b, err := os.ReadFile(p[0])
		if err != nil {
			return err
		}
		if err := os.WriteFile(p[1], b, 0o600); err != nil {
			return err
		}
	}
	return nil
}

func TestReleaseDevice(t *testing.T) {
	l := openTest(t, newClock())
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("c1"), devs(gpu(0), gpu(1)), "env")
		require.NoError(t, err)
	})
	err := l.Update(context.Background(), func(tx *Tx) error {
		_, err := tx.ReleaseDevice(gpu(5).UUID, "operator")
		return err
	})
	require.ErrorIs(t, err, ErrNotFound)
	require.Contains(t, err.Error(), gpu(5).UUID)
	update(t, l, func(tx *Tx) {
		c, err := tx.ReleaseDevice(gpu(0).UUID, "force: operator")
		require.NoError(t, err)
		require.Equal(t, "c1", c.Owner.ContainerID)
	})
	require.Equal(t, map[string]string{gpu(1).UUID: "c1"}, holders(snapshot(t, l)), "only that device is released")
}

func TestStartedStoppedTakeOver(t *testing.T) {
	c := newClock()
	l := openTest(t, c)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("old"), devs(gpu(0), gpu(1)), "env")
		require.NoError(t, err)
		require.False(t, tx.SetStarted("nobody", 1, 1, "/x"))
		require.False(t, tx.MarkStopped("nobody"))
	})
	c.Advance(time.Minute)
	update(t, l, func(tx *Tx) { require.True(t, tx.SetStarted("old", 4242, 99, "/kubepods/x")) })
	st := snapshot(t, l)
	for _, cl := range st.Claims {
		require.Equal(t, 4242, cl.Owner.Pid)
		require.Equal(t, uint64(99), cl.Owner.PidStart)
		require.Equal(t, "/kubepods/x", cl.Owner.Cgroup)
		require.Equal(t, c.Now(), cl.Owner.StartedAt)
	}
	c.Advance(time.Minute)
	update(t, l, func(tx *Tx) { require.True(t, tx.MarkStopped("old")) })
	require.Equal(t, c.Now(), snapshot(t, l).Claims[0].Owner.StoppedAt)

	update(t, l, func(tx *Tx) {
		require.Empty(t, tx.TakeOver("nobody", owner("new"), devs(gpu(0), gpu(1)), "restart"))
		require.Empty(t, tx.TakeOver("old", Owner{}, devs(gpu(0), gpu(1)), "no target"))
		got := tx.TakeOver("old", owner("new"), devs(gpu(0), gpu(1)), "restart in the same pod")
		require.Len(t, got, 2)
	})
	st = snapshot(t, l)
	require.Equal(t, map[string]string{gpu(0).UUID: "new", gpu(1).UUID: "new"}, holders(st))
	require.True(t, st.Claims[0].Owner.StoppedAt.IsZero(), "the new holder has not stopped")
	require.Contains(t, auditOps(t, l), OpTakeover)
}

func TestUpdateWritesNothingWhenNothingChangesOrFnFails(t *testing.T) {
	l := openTest(t, newClock())
	update(t, l, func(tx *Tx) {})
	_, err := os.Stat(l.StatePath())
	require.ErrorIs(t, err, os.ErrNotExist, "a no-op update creates no state file")

	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("c1"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	before, err := os.ReadFile(l.StatePath())
	require.NoError(t, err)

	boom := errors.New("boom")
	err = l.Update(context.Background(), func(tx *Tx) error {
		tx.Release("c1", "x")
		_, err := tx.Claim("", owner("c2"), devs(gpu(1)), "env")
		require.NoError(t, err)
		return boom
	})
	require.ErrorIs(t, err, boom)
	after, err := os.ReadFile(l.StatePath())
	require.NoError(t, err)
	require.Equal(t, before, after, "fn error: nothing written")
	require.Equal(t, []string{OpClaim}, auditOps(t, l), "fn error: nothing audited")

	// Audit-only: the record is written, the state is not.
	update(t, l, func(tx *Tx) {
		tx.Audit("refuse", AuditRecord{Devices: []string{gpu(0).UUID}, ContainerID: "c3", Reason: "busy"})
	})
	after, err = os.ReadFile(l.StatePath())
	require.NoError(t, err)
	require.Equal(t, before, after)
	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	require.Equal(t, "refuse", recs[len(recs)-1].Op)
	require.Equal(t, uint64(1), recs[len(recs)-1].Generation)
	require.Equal(t, os.Getpid(), recs[len(recs)-1].Pid)
}

func TestTxUseAfterUpdatePanics(t *testing.T) {
	l := openTest(t, newClock())
	var kept *Tx
	update(t, l, func(tx *Tx) { kept = tx })
	require.PanicsWithValue(t, "ledger: Tx used after its Update or View returned", func() {
		kept.Release("c1", "late")
	})
}

func TestViewDiscardsChanges(t *testing.T) {
	l := openTest(t, newClock())
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("c1"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	require.NoError(t, l.View(context.Background(), func(tx *Tx) error {
		require.Len(t, tx.Busy("k", owner("c2"), devs(gpu(0))), 1)
		tx.Release("c1", "view")
		require.Empty(t, tx.Busy("k", owner("c2"), devs(gpu(0))))
		return nil
	}))
	require.Equal(t, map[string]string{gpu(0).UUID: "c1"}, holders(snapshot(t, l)))
}

func TestSnapshotIsACopy(t *testing.T) {
	l := openTest(t, newClock())
	update(t, l, func(tx *Tx) {
		tx.Enqueue("w", owner("w"), devs(gpu(0), gpu(1)))
		_, err := tx.Claim("", owner("c1"), devs(gpu(2)), "env")
		require.NoError(t, err)
	})
	s1 := snapshot(t, l)
	s1.Claims[0].Owner.ContainerID = "mutated"
	s1.Waiters[0].Devices[0].UUID = "mutated"
	s2 := snapshot(t, l)
	require.Equal(t, "c1", s2.Claims[0].Owner.ContainerID)
	require.Equal(t, gpu(0).UUID, s2.Waiters[0].Devices[0].UUID)
	// And a later Update starts from the unmutated state.
	update(t, l, func(tx *Tx) {
		require.Equal(t, gpu(0).UUID, tx.State().Waiters[0].Devices[0].UUID)
		require.True(t, strings.HasPrefix(tx.State().Claims[0].Owner.ContainerID, "c1"))
	})
}
