// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

// The one-hook configuration with the real runc: the host installs the
// createRuntime hook alone and says [hook] poststop = false. No poststop ever
// runs; a claim whose container exited ends when the next request for its
// GPU finds its processes gone, and never while they run.

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// markerPath is where create-runtime would leave container id's marker.
func (r *rig) markerPath(id string) string {
	return filepath.Join(DefaultMarkerDir, markerName(id, filepath.Join(r.base, "b", id)))
}

// auditIndex is the position of the first audit record of container id with
// operation op, or -1.
func auditIndex(recs []ledger.AuditRecord, op, id string) int {
	return slices.IndexFunc(recs, func(rec ledger.AuditRecord) bool { return rec.Op == op && rec.ContainerID == id })
}

// TestRuncOneHookClaimEndsAtNextRequest: a container that ran and exited
// keeps its claim (nothing runs after it), leaves no marker (no poststop
// would read or remove it), and the next container asking its GPU, without
// --wait as the shipped hook definition runs, is admitted: its request
// released the exited holder first.
func TestRuncOneHookClaimEndsAtNextRequest(t *testing.T) {
	r := newRig(t, rigOpts{noPoststop: true})
	a := r.start("a", ctrOpts{env: gpuEnv(0), noWait: true})
	r.waitFor("a to start", func() bool { return r.started("a") })
	require.Equal(t, map[string]string{gpuUUIDs[0]: "a"}, r.holders())
	require.NoFileExists(t, r.markerPath("a"), "no marker for a container that gets no poststop")

	r.release("a")
	require.NoError(t, a.wait(t))
	require.Equal(t, map[string]string{gpuUUIDs[0]: "a"}, r.holders(), "no poststop ran: a's claim is still recorded")
	require.NoFileExists(t, r.markerPath("a"))

	_, err := r.run("b", ctrOpts{env: gpuEnv(0), noWait: true, mode: "exit"})
	require.NoError(t, err, "a's processes are gone: its claim does not block GPU 0")
	require.Equal(t, []string{"a start", "a exit", "b start", "b exit"}, r.order())
	require.Equal(t, map[string]string{gpuUUIDs[0]: "b"}, r.holders(), "b's claim stays in turn")

	recs := r.audit()
	rel, claim := auditIndex(recs, ledger.OpRelease, "a"), auditIndex(recs, ledger.OpClaim, "b")
	require.NotEqual(t, -1, rel, "a released: %+v", recs)
	require.NotEqual(t, -1, claim, "b claimed: %+v", recs)
	require.Less(t, rel, claim, "a's claim ended before b's began")
	require.True(t, strings.HasPrefix(recs[rel].Reason, guard.ReasonHolderExited+": "), recs[rel].Reason)
	require.Equal(t, []string{gpuUUIDs[0]}, recs[rel].Devices)
}

// TestRuncOneHookSameIDAgain: a container run again under the id of one that
// exited (runc names its cgroup after the id: the new one's init runs in the
// cgroup the earlier claim records) is admitted; it was refused as "held by
// container a", by its own earlier incarnation.
func TestRuncOneHookSameIDAgain(t *testing.T) {
	r := newRig(t, rigOpts{noPoststop: true})
	_, err := r.run("a", ctrOpts{env: gpuEnv(0), noWait: true, mode: "exit"})
	require.NoError(t, err)
	claims := r.state().Claims
	require.Len(t, claims, 1, "no poststop ran: the first a's claim is still recorded")
	first := claims[0].Owner
	require.NotEmpty(t, first.Cgroup)

	again := r.start("a", ctrOpts{env: gpuEnv(0), noWait: true})
	r.waitFor("a to start again, or its runc to fail", func() bool { return len(r.order()) == 3 || !again.running() })
	require.True(t, again.running(), "a is admitted again: %s", again.out.String())
	require.Equal(t, []string{"a start", "a exit", "a start"}, r.order())
	claims = r.state().Claims
	require.Len(t, claims, 1)
	require.Equal(t, "a", claims[0].Owner.ContainerID)
	require.Equal(t, first.Cgroup, claims[0].Owner.Cgroup, "the same cgroup as its predecessor")
	require.Equal(t, r.runcPid("a"), claims[0].Owner.Pid, "the claim is the running incarnation's")
	require.NotEqual(t, first.Pid, claims[0].Owner.Pid)

	var released []string
	for _, rec := range r.audit() {
		if rec.Op == ledger.OpRelease && rec.ContainerID == "a" {
			released = append(released, rec.Reason)
		}
	}
	require.Len(t, released, 1, "the earlier incarnation released once")
	require.Contains(t, released[0], guard.ReasonHolderExited+": ")
	require.Contains(t, released[0], "created again (a restart)")

	r.release("a")
	require.NoError(t, again.wait(t))
}

// TestRuncOneHookRunningHolderKeepsItsGPU: with no poststop, a holder's
// claim ends only once its processes are gone. While it runs, a request
// without --wait is refused in its name and one with --wait queues; once it
// exits, the waiting hook's own poll finds it gone and its container starts.
func TestRuncOneHookRunningHolderKeepsItsGPU(t *testing.T) {
	r := newRig(t, rigOpts{noPoststop: true})
	h := r.start("h", ctrOpts{env: gpuEnv(0)})
	r.waitFor("h to start", func() bool { return r.started("h") })

	x, err := r.run("x", ctrOpts{env: gpuEnv(0), noWait: true, mode: "exit"})
	require.Error(t, err, "h runs: x is refused")
	require.Contains(t, x.out.String(), "GPU 0 ("+gpuUUIDs[0]+") is held by container h")
	require.False(t, r.started("x"))

	w := r.start("w", ctrOpts{env: gpuEnv(0)})
	r.waitFor("w to queue", func() bool { return slices.Contains(r.waiterKeys(), "w") })
	require.False(t, r.started("w"), "w must not start while h runs")
	require.True(t, w.running(), "w's runc waits in its createRuntime hook")
	require.Equal(t, map[string]string{gpuUUIDs[0]: "h"}, r.holders())
	require.Equal(t, -1, auditIndex(r.audit(), ledger.OpRelease, "h"), "h's claim never ended while it ran")

	r.release("h")
	require.NoError(t, h.wait(t))
	r.waitFor("w to start", func() bool { return r.started("w") })
	require.Equal(t, []string{"h start", "h exit", "w start"}, r.order())
	require.Equal(t, map[string]string{gpuUUIDs[0]: "w"}, r.holders())
	require.Empty(t, r.state().Waiters)
	recs := r.audit()
	rel := auditIndex(recs, ledger.OpRelease, "h")
	require.NotEqual(t, -1, rel, "h released by w's poll: %+v", recs)
	require.True(t, strings.HasPrefix(recs[rel].Reason, guard.ReasonHolderExited+": "), recs[rel].Reason)

	r.release("w")
	require.NoError(t, w.wait(t))
}

// TestRuncOneHookOptedInContainerGetsItsMarker: on a one-hook host a
// container annotated io.nri-gpu-guard.poststop=on gets the poststop (the
// shipped mask runs it for such containers), so create-runtime leaves it
// the marker a poststop needs to find a claim its spec does not show (one
// made because no device cgroup applies), and the poststop releases its
// claim at once and removes the marker.
func TestRuncOneHookOptedInContainerGetsItsMarker(t *testing.T) {
	r := newRig(t, rigOpts{noPoststop: true})
	c := r.start("in", ctrOpts{env: gpuEnv(0), noWait: true, optIn: true})
	r.waitFor("in to start", func() bool { return r.started("in") })
	require.FileExists(t, r.markerPath("in"), "the opted-in container's poststop will read the ledger")
	r.release("in")
	require.NoError(t, c.wait(t))
	require.Empty(t, r.holders(), "its poststop released it")
	require.NoFileExists(t, r.markerPath("in"), "and removed its marker")
	recs := r.audit()
	rel := auditIndex(recs, ledger.OpRelease, "in")
	require.NotEqual(t, -1, rel, "%+v", recs)
	require.Equal(t, "removed", recs[rel].Reason)
}
