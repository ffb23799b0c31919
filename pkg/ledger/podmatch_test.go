// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// A pod event names one sandbox: the sandbox id decides when both sides
// have one (the pod UID outlives a sandbox the kubelet replaces), the pod
// UID only when one side has none.
func TestPodMatchesTheSandboxNotThePod(t *testing.T) {
	nri := func(uid, sandbox string) Owner {
		return Owner{ContainerID: "c", FrontEnd: FrontEndNRI, PodUID: uid, PodSandboxID: sandbox}
	}
	for _, tc := range []struct {
		name            string
		o               Owner
		fe              FrontEnd
		podUID, sandbox string
		match           bool
	}{
		{"the event's sandbox", nri("u", "s1"), FrontEndNRI, "u", "s1", true},
		{"another sandbox of the same pod", nri("u", "s2"), FrontEndNRI, "u", "s1", false},
		{"the sandbox, without the UID in the event", nri("u", "s1"), FrontEndNRI, "", "s1", true},
		{"the sandbox id decides even if the UID differs", nri("other", "s1"), FrontEndNRI, "u", "s1", true},
		{"event without a sandbox id: by UID", nri("u", "s2"), FrontEndNRI, "u", "", true},
		{"event without a sandbox id: another pod", nri("v", "s2"), FrontEndNRI, "u", "", false},
		{"owner without a sandbox id: by UID", nri("u", ""), FrontEndNRI, "u", "s1", true},
		{"owner without a sandbox id: another pod", nri("v", ""), FrontEndNRI, "u", "s1", false},
		{"owner without a sandbox id, event without a UID", nri("u", ""), FrontEndNRI, "", "s1", false},
		{"another front end's owner", Owner{ContainerID: "c", FrontEnd: FrontEndHook, PodUID: "u", PodSandboxID: "s1"}, FrontEndNRI, "u", "s1", false},
		{"an event naming nothing", nri("", ""), FrontEndNRI, "", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.match, PodMatches(&tc.o, tc.fe, tc.podUID, tc.sandbox))
		})
	}
}

// The removal of a pod's old sandbox, after the kubelet replaced it, ends
// nothing of the new sandbox's containers: neither the claim of the one
// that runs nor the place of the one that waits.
func TestReleasePodOfAReplacedSandboxKeepsTheNewOnes(t *testing.T) {
	l := openTest(t, newClock())
	inNew := func(id string) Owner {
		o := owner(id)
		o.FrontEnd, o.PodUID, o.PodSandboxID = FrontEndNRI, "uid-a", "sb-a2"
		return o
	}
	other := owner("other")
	other.FrontEnd = FrontEndNRI
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", inNew("c2"), devs(gpu(0)), "env")
		assert.NoError(t, err)
		_, err = tx.Claim("", other, devs(gpu(1)), "env")
		assert.NoError(t, err)
		tx.Enqueue("ml/uid-a/side", inNew("side-1"), devs(gpu(1)))
	})
	update(t, l, func(tx *Tx) {
		assert.Empty(t, tx.ReleasePod(FrontEndNRI, "uid-a", "sb-a1", "pod gone"))
		assert.Empty(t, tx.DropPodWaiters(FrontEndNRI, "uid-a", "sb-a1", "pod gone"))
	})
	st := snapshot(t, l)
	assert.Equal(t, map[string]string{gpu(0).UUID: "c2", gpu(1).UUID: "other"}, holders(st))
	assert.Len(t, st.Waiters, 1)

	// The new sandbox's own removal ends them.
	update(t, l, func(tx *Tx) {
		assert.Len(t, tx.ReleasePod(FrontEndNRI, "uid-a", "sb-a2", "pod gone"), 1)
		assert.Len(t, tx.DropPodWaiters(FrontEndNRI, "uid-a", "sb-a2", "pod gone"), 1)
	})
	st = snapshot(t, l)
	assert.Equal(t, map[string]string{gpu(1).UUID: "other"}, holders(st))
	assert.Empty(t, st.Waiters)
}
