// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

func hookOwner(id string) Owner {
	o := owner(id)
	o.FrontEnd = FrontEndHook
	return o
}

func TestReconcile(t *testing.T) {
	l := openTest(t, newClock())
	update(t, l, func(tx *Tx) {
		for _, c := range []struct {
			o Owner
			d devices.Device
		}{
			{owner("gone"), gpu(0)},       // NRI, not listed any more → stale
			{owner("kept"), gpu(1)},       // NRI, listed → kept
			{owner("moved"), gpu(2)},      // NRI, listed on another device now
			{hookOwner("hook-1"), gpu(3)}, // another front end → untouched
		} {
			_, err := tx.Claim("", c.o, devs(c.d), "env")
			require.NoError(t, err)
		}
		tx.Enqueue("w", owner("w"), devs(gpu(5))) // GPU 5 is free: reserved for w
	})
	require.Equal(t, map[string]string{gpu(5).UUID: "w"}, reservedFor(snapshot(t, l)))

	kept := owner("kept")
	kept.Pid, kept.PidStart, kept.Cgroup = 77, 88, "/k8s/kept"
	var res ReconcileResult
	update(t, l, func(tx *Tx) {
		res = tx.Reconcile(FrontEndNRI, []Holding{
			{Owner: kept, Devices: devs(gpu(1))},
			{Owner: owner("moved"), Devices: devs(gpu(4))},
			{Owner: owner("intruder"), Devices: devs(gpu(3)), Source: "privileged"}, // on the hook's GPU
			{Owner: owner("squatter"), Devices: devs(gpu(5)), Source: "env"},        // on w's reserved GPU
			{Owner: owner("second"), Devices: devs(gpu(5))},                         // same GPU, later in the list
		})
	})
	var released, adopted, conflicts []string
	for _, c := range res.Released {
		released = append(released, c.Owner.ContainerID+"@"+c.Device.Index)
	}
	for _, c := range res.Adopted {
		adopted = append(adopted, c.Owner.ContainerID+"@"+c.Device.Index)
	}
	for _, c := range res.Conflicts {
		conflicts = append(conflicts, c.Owner.ContainerID+"@"+c.Device.Index)
	}
	require.ElementsMatch(t, []string{"gone@0", "moved@2"}, released)
	require.Equal(t, []string{"moved@4", "squatter@5"}, adopted)
	require.Equal(t, []string{"intruder@3", "second@5"}, conflicts)

	st := snapshot(t, l)
	require.Equal(t, map[string]string{
		gpu(1).UUID: "kept", gpu(3).UUID: "hook-1", gpu(4).UUID: "moved", gpu(5).UUID: "squatter",
	}, holders(st))
	require.Empty(t, st.Reservations, "the running container wins over the reservation")
	require.Equal(t, []string{"w"}, waiterKeys(st), "the waiter stays queued")
	require.Len(t, st.Conflicts, 2)
	for _, c := range st.Claims {
		if c.Owner.ContainerID == "kept" {
			require.Equal(t, 77, c.Owner.Pid, "process details filled in")
			require.Equal(t, "/k8s/kept", c.Owner.Cgroup)
		}
	}

	// Reconciling again with the same list changes nothing.
	gen := st.Generation
	update(t, l, func(tx *Tx) {
		res = tx.Reconcile(FrontEndNRI, []Holding{
			{Owner: kept, Devices: devs(gpu(1))},
			{Owner: owner("moved"), Devices: devs(gpu(4))},
			{Owner: owner("intruder"), Devices: devs(gpu(3))},
			{Owner: owner("squatter"), Devices: devs(gpu(5))},
			{Owner: owner("second"), Devices: devs(gpu(5))},
		})
	})
	require.Empty(t, res.Released)
	require.Empty(t, res.Adopted)
	require.Len(t, res.Conflicts, 2)
	require.Equal(t, gen, snapshot(t, l).Generation, "an unchanged reconcile writes nothing")

	// The hook container exits: the intruder found on its GPU becomes the holder.
	update(t, l, func(tx *Tx) { tx.Release("hook-1", "poststop") })
	st = snapshot(t, l)
	require.Equal(t, "intruder", holders(st)[gpu(3).UUID])
	require.Len(t, st.Conflicts, 1)
	require.Contains(t, auditOps(t, l), OpPromote)

	// The squatter goes; "second" is promoted to GPU 5 ahead of waiter w.
	update(t, l, func(tx *Tx) { tx.Release("squatter", "stop") })
	st = snapshot(t, l)
	require.Equal(t, "second", holders(st)[gpu(5).UUID])
	require.Empty(t, st.Conflicts)
	require.Empty(t, st.Reservations)

	// An empty list releases every NRI claim; the hook front end's are kept.
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", hookOwner("hook-2"), devs(gpu(6)), "env")
		require.NoError(t, err)
		tx.Reconcile(FrontEndNRI, nil)
	})
	require.Equal(t, map[string]string{gpu(6).UUID: "hook-2"}, holders(snapshot(t, l)))
	require.Equal(t, map[string]string{gpu(5).UUID: "w"}, reservedFor(snapshot(t, l)))
}

func TestReconcileMIG(t *testing.T) {
	l := openTest(t, newClock())
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", hookOwner("h"), devs(mig(0, 0)), "env")
		require.NoError(t, err)
		res := tx.Reconcile(FrontEndNRI, []Holding{
			{Owner: owner("full"), Devices: devs(gpu(0))},       // conflicts with the MIG holder
			{Owner: owner("sibling"), Devices: devs(mig(0, 1))}, // does not
		})
		require.Len(t, res.Conflicts, 1)
		require.Equal(t, "full", res.Conflicts[0].Owner.ContainerID)
		require.Len(t, res.Adopted, 1)
		require.Equal(t, "sibling", res.Adopted[0].Owner.ContainerID)
	})
	// When the MIG holder leaves, GPU 0 is still partly held by "sibling":
	// "full" stays a conflict.
	update(t, l, func(tx *Tx) { tx.Release("h", "stop") })
	st := snapshot(t, l)
	require.Len(t, st.Conflicts, 1)
	require.Equal(t, map[string]string{mig(0, 1).UUID: "sibling"}, holders(st))
}

// A container recorded in conflict before it started (listed without a
// process) is listed again once it runs: the record learns its process, as
// a claim does, so that the claim it becomes once the holder goes can be
// found exited. Without it the promoted claim counted as never started and
// kept the device for good.
func TestReconcileFillsAConflictRecordsProcess(t *testing.T) {
	l := openTest(t, newClock())
	holder := owner("holder")
	holder.Pid, holder.PidStart, holder.Cgroup = 70, 700, "/k8s/holder"
	late := owner("late")
	update(t, l, func(tx *Tx) {
		tx.Reconcile(FrontEndNRI, []Holding{{Owner: holder, Devices: devs(gpu(2))}, {Owner: late, Devices: devs(gpu(2))}})
	})
	st := snapshot(t, l)
	require.Len(t, st.Conflicts, 1)
	require.Zero(t, st.Conflicts[0].Owner.Pid, "created, not started")

	late.Pid, late.PidStart, late.Cgroup = 77, 770, "/k8s/late"
	update(t, l, func(tx *Tx) {
		tx.Reconcile(FrontEndNRI, []Holding{{Owner: holder, Devices: devs(gpu(2))}, {Owner: late, Devices: devs(gpu(2))}})
	})
	st = snapshot(t, l)
	require.Len(t, st.Conflicts, 1)
	c := st.Conflicts[0].Owner
	require.Equal(t, 77, c.Pid)
	require.Equal(t, uint64(770), c.PidStart)
	require.Equal(t, "/k8s/late", c.Cgroup)
	require.Contains(t, auditOps(t, l), OpStarted)

	// The holder goes: the record becomes the claim, with the process.
	update(t, l, func(tx *Tx) { tx.Release("holder", "stop") })
	st = snapshot(t, l)
	require.Len(t, st.Claims, 1)
	require.Equal(t, 77, st.Claims[0].Owner.Pid)
}

// ReconcileWith asks its rule about each process whose container the
// runtime does not list at all (once, however many claims and records name
// it; never about a draining claim, a listed container or another front
// end's), and does what it says: a kept container (the runtime hides a
// running container it could not load) keeps its claims and its conflict
// records, audited as unlisted; one found gone is released, its record
// cleared before it could be promoted; one draining under
// release_requires_idle is marked so.
func TestReconcileWithUnlistedRule(t *testing.T) {
	opts := testOptions(newClock())
	opts.DrainGrace = time.Hour
	l, err := Open(t.TempDir(), opts)
	require.NoError(t, err)
	proc := func(id string, pid int) Owner {
		o := owner(id)
		o.Pid, o.PidStart, o.Cgroup = pid, uint64(pid)*10, "/k8s/"+id
		return o
	}
	runs, gone, drains := proc("runs", 10), proc("gone", 20), proc("drains", 30)
	twinRuns, twinGone := proc("twin-runs", 11), proc("twin-gone", 21)
	update(t, l, func(tx *Tx) {
		tx.Reconcile(FrontEndNRI, []Holding{
			{Owner: runs, Devices: devs(gpu(0), gpu(1))},
			{Owner: gone, Devices: devs(gpu(2))},
			{Owner: drains, Devices: devs(gpu(3))},
			{Owner: proc("draining", 40), Devices: devs(gpu(4))},
			{Owner: twinRuns, Devices: devs(gpu(0))},
			{Owner: twinGone, Devices: devs(gpu(2))},
		})
		tx.MarkDraining("draining", "stop")
		_, err := tx.Claim("", hookOwner("hook-1"), devs(gpu(6)), "env")
		require.NoError(t, err)
	})
	require.Len(t, snapshot(t, l).Conflicts, 2)

	verdicts := map[string]UnlistedVerdict{
		"runs":      {Action: UnlistedKeep, Why: "cgroup /k8s/runs has processes"},
		"twin-runs": {Action: UnlistedKeep, Why: "cgroup /k8s/twin-runs has processes"},
		"gone":      {Action: UnlistedRelease, Why: "cgroup /k8s/gone has no processes"},
		"twin-gone": {Action: UnlistedRelease, Why: "cgroup /k8s/twin-gone has no processes"},
		"drains":    {Action: UnlistedDrain, Why: "cgroup /k8s/drains has no processes"},
	}
	var asked []string
	var rep ReconcileReport
	update(t, l, func(tx *Tx) {
		rep = tx.ReconcileWith(FrontEndNRI, []Holding{{Owner: proc("listed", 50), Devices: devs(gpu(5))}},
			func(o Owner) UnlistedVerdict {
				asked = append(asked, o.ContainerID)
				return verdicts[o.ContainerID]
			})
	})
	assert.ElementsMatch(t, []string{"runs", "gone", "drains", "twin-runs", "twin-gone"}, asked,
		"once per process; never a draining claim, a listed container or the hook's")

	ids := func(cs []Claim) []string {
		var out []string
		for _, c := range cs {
			out = append(out, c.Owner.ContainerID+"@"+c.Device.Index)
		}
		return out
	}
	assert.Equal(t, []string{"gone@2"}, ids(rep.Released))
	assert.Equal(t, []string{"runs@0", "runs@1"}, ids(rep.Kept))
	assert.Equal(t, []string{"drains@3"}, ids(rep.Drained))
	assert.Equal(t, []string{"listed@5"}, ids(rep.Adopted))

	st := snapshot(t, l)
	assert.Equal(t, map[string]string{
		gpu(0).UUID: "runs", gpu(1).UUID: "runs", gpu(3).UUID: "drains", gpu(4).UUID: "draining",
		gpu(5).UUID: "listed", gpu(6).UUID: "hook-1",
	}, holders(st), "twin-gone is not promoted onto the GPU gone left: it is gone too")
	for _, c := range st.Claims {
		switch c.Owner.ContainerID {
		case "drains", "draining":
			assert.False(t, c.Owner.DrainingSince.IsZero(), c.Owner.ContainerID)
		default:
			assert.True(t, c.Owner.DrainingSince.IsZero(), c.Owner.ContainerID)
		}
	}
	require.Len(t, st.Conflicts, 1)
	assert.Equal(t, "twin-runs", st.Conflicts[0].Owner.ContainerID, "a running container in conflict stays recorded")

	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	unlisted := map[string]AuditRecord{}
	for _, r := range recs {
		if r.Op == OpUnlisted {
			unlisted[r.ContainerID] = r
		}
	}
	require.Len(t, unlisted, 2)
	assert.Equal(t, []string{gpu(0).UUID, gpu(1).UUID}, unlisted["runs"].Devices)
	assert.Contains(t, unlisted["runs"].Reason, "cgroup /k8s/runs has processes")
	assert.Equal(t, []string{gpu(0).UUID}, unlisted["twin-runs"].Devices)
	var releases []string
	for _, r := range recs {
		if r.Op == OpRelease && strings.Contains(r.Reason, "cgroup /k8s/gone has no processes") {
			releases = append(releases, r.ContainerID)
		}
	}
	assert.Equal(t, []string{"gone"}, releases, "the release says what the rule found")

	// The kept container exits: the next reconcile's rule releases it, and
	// the GPU goes to nobody in conflict (twin-runs is gone too).
	verdicts["runs"] = UnlistedVerdict{Action: UnlistedRelease, Why: "cgroup /k8s/runs has no processes"}
	verdicts["twin-runs"] = UnlistedVerdict{Action: UnlistedRelease, Why: "cgroup /k8s/twin-runs has no processes"}
	update(t, l, func(tx *Tx) {
		rep = tx.ReconcileWith(FrontEndNRI, []Holding{{Owner: proc("listed", 50), Devices: devs(gpu(5))}},
			func(o Owner) UnlistedVerdict { return verdicts[o.ContainerID] })
	})
	assert.Equal(t, []string{"runs@0", "runs@1"}, ids(rep.Released))
	st = snapshot(t, l)
	assert.Empty(t, st.Conflicts)
	assert.NotContains(t, holders(st), gpu(0).UUID)
}

// A container's claims and conflict records share one verdict: the rule is
// asked about the process any of them records, so a record made from a list
// entry that carried no process (or a claim made before the start was
// seen) is kept with the rest while that process runs. Asked apart, the
// process-less one read as never started and ended, freeing a device the
// container was still found running on.
func TestReconcileWithJudgesAContainerWhole(t *testing.T) {
	running := func(o Owner) UnlistedVerdict {
		if o.Pid > 0 || o.Cgroup != "" {
			return UnlistedVerdict{Action: UnlistedKeep, Why: "cgroup " + o.Cgroup + " has processes"}
		}
		return UnlistedVerdict{Action: UnlistedRelease, Why: "it never started"}
	}
	for _, tc := range []struct {
		name string
		// first lists c with its process; second lists it without one.
		first, second []devices.Device
	}{
		{name: "claim records the process, record does not", first: devs(gpu(0)), second: devs(gpu(0), gpu(1))},
		{name: "record records the process, claim does not", first: devs(gpu(1)), second: devs(gpu(0), gpu(1))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := Open(t.TempDir(), testOptions(newClock()))
			require.NoError(t, err)
			holder := owner("holder")
			holder.Pid, holder.PidStart, holder.Cgroup = 10, 100, "/k8s/holder"
			started := owner("c")
			started.Pid, started.PidStart, started.Cgroup = 20, 200, "/k8s/c"
			update(t, l, func(tx *Tx) {
				tx.Reconcile(FrontEndNRI, []Holding{{Owner: holder, Devices: devs(gpu(1))}, {Owner: started, Devices: tc.first}})
			})
			update(t, l, func(tx *Tx) {
				tx.Reconcile(FrontEndNRI, []Holding{{Owner: holder, Devices: devs(gpu(1))}, {Owner: owner("c"), Devices: tc.second}})
			})
			st := snapshot(t, l)
			require.Len(t, st.Claims, 2)
			require.Len(t, st.Conflicts, 1)
			require.Equal(t, "c", st.Conflicts[0].Owner.ContainerID)
			i, ok := claimOn(st, gpu(0).UUID)
			require.True(t, ok)
			require.Equal(t, "c", st.Claims[i].Owner.ContainerID)
			require.NotEqual(t, st.Claims[i].Owner.Pid, st.Conflicts[0].Owner.Pid,
				"the fixture: one of c's entries records its process, the other not")

			var asked []Owner
			var rep ReconcileReport
			update(t, l, func(tx *Tx) {
				rep = tx.ReconcileWith(FrontEndNRI, []Holding{{Owner: holder, Devices: devs(gpu(1))}}, func(o Owner) UnlistedVerdict {
					asked = append(asked, o)
					return running(o)
				})
			})
			st = snapshot(t, l)
			assert.Equal(t, map[string]string{gpu(0).UUID: "c", gpu(1).UUID: "holder"}, holders(st))
			require.Len(t, st.Conflicts, 1, "the record of c running on the held GPU stays while c runs")
			assert.Equal(t, "c", st.Conflicts[0].Owner.ContainerID)
			assert.NotContains(t, auditOps(t, l), OpConflictCleared)
			assert.Empty(t, rep.Released)
			require.Len(t, rep.Kept, 1)
			assert.Equal(t, gpu(0).UUID, rep.Kept[0].Device.UUID)

			require.Len(t, asked, 1, "one verdict for the container")
			assert.Equal(t, 20, asked[0].Pid, "asked about the process it records")

			recs, err := ReadAudit(l.AuditPath())
			require.NoError(t, err)
			var kept []AuditRecord
			for _, r := range recs {
				if r.Op == OpUnlisted {
					kept = append(kept, r)
				}
			}
			require.Len(t, kept, 1, "one unlisted record for the container")
			assert.Equal(t, []string{gpu(0).UUID, gpu(1).UUID}, kept[0].Devices)
			assert.Contains(t, kept[0].Reason, "/k8s/c has processes")
		})
	}
}

func claimOn(st State, uuid string) (int, bool) {
	for i := range st.Claims {
		if st.Claims[i].Device.UUID == uuid {
			return i, true
		}
	}
	return 0, false
}

// Without a rule ReconcileWith keeps the claims and records of a container
// it is not told the fate of: not being listed is no evidence of exit, and
// the zero UnlistedAction is UnlistedKeep. Reconcile, for lists known to be
// complete, releases them.
func TestReconcileWithoutARuleKeeps(t *testing.T) {
	l, err := Open(t.TempDir(), testOptions(newClock()))
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		tx.Reconcile(FrontEndNRI, []Holding{{Owner: owner("a"), Devices: devs(gpu(0))}, {Owner: owner("b"), Devices: devs(gpu(0))}})
	})
	var rep ReconcileReport
	update(t, l, func(tx *Tx) { rep = tx.ReconcileWith(FrontEndNRI, nil, nil) })
	assert.Empty(t, rep.Released)
	require.Len(t, rep.Kept, 1)
	assert.Equal(t, "a", rep.Kept[0].Owner.ContainerID)
	st := snapshot(t, l)
	assert.Equal(t, map[string]string{gpu(0).UUID: "a"}, holders(st))
	require.Len(t, st.Conflicts, 1)
	assert.Contains(t, auditOps(t, l), OpUnlisted)

	update(t, l, func(tx *Tx) { rep.ReconcileResult = tx.Reconcile(FrontEndNRI, nil) })
	require.Len(t, rep.Released, 1)
	st = snapshot(t, l)
	assert.Empty(t, st.Claims)
	assert.Empty(t, st.Conflicts, "b is gone too: its record is not promoted")
}
