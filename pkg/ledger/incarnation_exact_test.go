// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// procOwner is container id as an OCI hook or NRI records it, with whatever
// of its process is known (pid, pid start time, cgroup; zero: not known).
func procOwner(id string, pid int, start uint64, cgroup string) Owner {
	o := owner(id)
	o.FrontEnd, o.Pid, o.PidStart, o.Cgroup = FrontEndHook, pid, start, cgroup
	return o
}

// The incarnation operations end exactly the exited process's claims: an
// exited container of id "train" whose record lacks what tells it apart
// (no pid start time, or only its cgroup) must not end the claim of a live
// "train" whose process is recorded and differs. The reviewer's repro is
// the first case: ReleaseIncarnation of the exited one released both.
func TestIncarnationOpsDoNotEndAnotherRecordedProcess(t *testing.T) {
	live := procOwner("train", 200, 2, "/b/train")
	for _, exited := range []struct {
		name  string
		owner Owner
	}{
		{"pid without start time", procOwner("train", 100, 0, "/a/train")},
		{"pid without start time or cgroup", procOwner("train", 100, 0, "")},
		{"cgroup only (created, not started)", procOwner("train", 0, 0, "/a/train")},
		{"same cgroup path, other pid (two runc roots)", procOwner("train", 100, 0, "/b/train")},
		{"same pid, other start time (pid reused)", procOwner("train", 200, 1, "/b/train")},
	} {
		for _, op := range []struct {
			name string
			do   func(tx *Tx, dead Owner)
			kept bool // the exited one's claim stays (marked)
		}{
			{name: "release", do: func(tx *Tx, dead Owner) { tx.ReleaseIncarnation(dead, "exited") }},
			{name: "drain", kept: true, do: func(tx *Tx, dead Owner) { tx.MarkDrainingIncarnation(dead, "exited") }},
			{name: "stopped", kept: true, do: func(tx *Tx, dead Owner) { tx.MarkStoppedIncarnation(dead) }},
		} {
			t.Run(exited.name+"/"+op.name, func(t *testing.T) {
				opts := testOptions(newClock())
				opts.DrainGrace = time.Hour
				l, err := Open(t.TempDir(), opts)
				require.NoError(t, err)
				update(t, l, func(tx *Tx) {
					_, err := tx.Claim("", exited.owner, devs(gpu(2)), "env")
					require.NoError(t, err)
					_, err = tx.Claim("", live, devs(gpu(1)), "env")
					require.NoError(t, err)
				})
				update(t, l, func(tx *Tx) { op.do(tx, exited.owner) })
				st := snapshot(t, l)
				want := map[string]string{gpu(1).UUID: "train"}
				if op.kept {
					want[gpu(2).UUID] = "train"
				}
				assert.Equal(t, want, holders(st), "the live train keeps GPU 1")
				for _, c := range st.Claims {
					switch c.Device.UUID {
					case gpu(1).UUID:
						assert.True(t, c.Owner.DrainingSince.IsZero() && c.Owner.StoppedAt.IsZero(), "the live train is untouched: %+v", c.Owner)
					case gpu(2).UUID:
						assert.True(t, !c.Owner.DrainingSince.IsZero() || !c.Owner.StoppedAt.IsZero(), "the exited train is marked: %+v", c.Owner)
					}
				}
			})
		}
	}
}

// SameRecordedProcess matches on evidence only: every field both record
// agrees, and the claim records a process when the incarnation does; an
// incarnation named by id alone matches every claim of the id.
func TestSameRecordedProcess(t *testing.T) {
	for _, tc := range []struct {
		name  string
		claim Owner
		o     Owner
		same  bool
	}{
		{"identical pid, start and cgroup", procOwner("t", 1, 10, "/a"), procOwner("t", 1, 10, "/a"), true},
		{"start time known on one side only", procOwner("t", 1, 10, "/a"), procOwner("t", 1, 0, "/a"), true},
		{"cgroup known on one side only", procOwner("t", 1, 10, ""), procOwner("t", 1, 10, "/a"), true},
		{"cgroup only, the same", procOwner("t", 0, 0, "/a"), procOwner("t", 0, 0, "/a"), true},
		{"another container id", procOwner("u", 1, 10, "/a"), procOwner("t", 1, 10, "/a"), false},
		{"another pid", procOwner("t", 2, 10, "/a"), procOwner("t", 1, 10, "/a"), false},
		{"another pid, starts unknown", procOwner("t", 2, 0, "/a"), procOwner("t", 1, 0, "/a"), false},
		{"another start time", procOwner("t", 1, 11, "/a"), procOwner("t", 1, 10, "/a"), false},
		{"another cgroup", procOwner("t", 1, 10, "/b"), procOwner("t", 1, 10, "/a"), false},
		{"cgroup only, another", procOwner("t", 0, 0, "/b"), procOwner("t", 0, 0, "/a"), false},
		{"claim with a pid, exited one with none", procOwner("t", 1, 10, "/a"), procOwner("t", 0, 0, "/a"), false},
		{"claim without a pid, exited one with one", procOwner("t", 0, 0, "/a"), procOwner("t", 1, 10, "/a"), false},
		{"claim records no process", procOwner("t", 0, 0, ""), procOwner("t", 1, 10, "/a"), false},
		{"named by id alone: a claim with a process", procOwner("t", 1, 10, "/a"), procOwner("t", 0, 0, ""), true},
		{"named by id alone: a claim without", procOwner("t", 0, 0, ""), procOwner("t", 0, 0, ""), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.same, SameRecordedProcess(&tc.claim, &tc.o))
		})
	}
}
