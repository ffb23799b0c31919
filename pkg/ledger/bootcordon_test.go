// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// rebootOptions are the options of the same host after a reboot: a new boot
// id and an empty runtime dir (a tmpfs).
func rebootOptions(t *testing.T, c *clock, boot string) Options {
	opts := testOptions(c)
	opts.BootID = boot
	opts.RuntimeDir = t.TempDir()
	return opts
}

// cordonSources maps each cordon's device UUID to its source.
func cordonSources(ks []Cordon) map[string]string {
	m := map[string]string{}
	for _, k := range ks {
		m[k.Device.UUID] = k.Source
	}
	return m
}

// An operator's cordons outlive a reboot (read before the first Update,
// kept by it, audited, journaled so that recovery keeps them), the
// observer's are dropped (audited), and everything else of the earlier boot
// is discarded as before.
func TestOperatorCordonsSurviveAReboot(t *testing.T) {
	c := newClock()
	dir := filepath.Join(t.TempDir(), "state")
	l, err := Open(dir, rebootOptions(t, c, testBoot))
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h1"), devs(gpu(0)), "env")
		require.NoError(t, err)
		tx.Enqueue("w", owner("w"), devs(gpu(0)))
		_, _, err = tx.Cordon(gpu(1), CordonOperator, "ECC errors, RMA 4711", "uid 0 via gpu-guard-ctl")
		require.NoError(t, err)
		_, _, err = tx.Cordon(mig(2, 0), CordonOperator, "MIG layout change", "uid 0 via gpu-guard-ctl")
		require.NoError(t, err)
		_, _, err = tx.Cordon(gpu(3), CordonIntruder, "pid 4242 not admitted", "observer")
		require.NoError(t, err)
		_, _, err = tx.Cordon(mig(4, 1), CordonUnhealthy, "Xid 79", "observer")
		require.NoError(t, err)
	})
	before := snapshot(t, l)
	require.Len(t, before.Cordons, 4)
	var want []Cordon
	for _, k := range before.Cordons {
		if k.Source == CordonOperator {
			want = append(want, k)
		}
	}
	require.Len(t, want, 2)
	oldBytes := mustRead(t, l.StatePath())

	c.Advance(time.Hour)
	opts := rebootOptions(t, c, "after-reboot")

	// A reader (gpu-guard-ctl status) before anything wrote in this boot
	// already sees the operator's cordons, and nothing else; it writes nothing.
	ro, err := OpenReadOnly(dir, opts)
	require.NoError(t, err)
	st := snapshot(t, ro)
	assert.Equal(t, want, st.Cordons, "source, reason, by and since kept as they were")
	assert.Empty(t, st.Claims)
	assert.Empty(t, st.Waiters)
	require.Equal(t, oldBytes, mustRead(t, l.StatePath()))

	// The first Update starts from the fresh state with those cordons: they
	// still refuse, the observer's no longer do.
	l2, err := Open(dir, opts)
	require.NoError(t, err)
	update(t, l2, func(tx *Tx) {
		assert.Equal(t, want, tx.State().Cordons)
		assert.Empty(t, tx.State().Claims)
		cordoned := map[string]string{}
		for _, cd := range tx.CordonsOn("", devs(gpu(1), gpu(2), gpu(3), mig(4, 1), gpu(4))) {
			cordoned[cd.Wanted.UUID] = cd.Cordon.Device.UUID
		}
		assert.Equal(t, map[string]string{gpu(1).UUID: gpu(1).UUID, gpu(2).UUID: mig(2, 0).UUID}, cordoned,
			"GPU 1 and (through its MIG instance) GPU 2 stay cordoned; GPU 3 and MIG 4:1 are free again")
		_, err := tx.Claim("", owner("n1"), devs(gpu(3)), "env")
		require.NoError(t, err)
	})
	after := snapshot(t, l2)
	assert.Equal(t, want, after.Cordons)
	assert.Equal(t, map[string]string{gpu(3).UUID: "n1"}, holders(after), "the earlier boot's claim is gone")
	assert.Empty(t, after.Waiters)
	assert.Equal(t, "after-reboot", after.BootID)
	assert.NotEqual(t, before.Lineage, after.Lineage, "a fresh state has a fresh lineage")

	// Audited: the discard, then each cordon kept or dropped, in the commit
	// of the first Update.
	kept, dropped := map[string]AuditRecord{}, map[string]AuditRecord{}
	var discard bool
	for _, r := range auditRecords(t, l2) {
		if r.Generation != after.Generation {
			continue
		}
		switch {
		case r.Op == OpDiscard:
			discard = true
		case r.Op == OpCordon && strings.HasPrefix(r.Reason, "kept across the reboot"):
			kept[r.Devices[0]] = r
		case r.Op == OpUncordon && strings.HasPrefix(r.Reason, "dropped at the reboot"):
			dropped[r.Devices[0]] = r
		}
	}
	assert.True(t, discard)
	require.Len(t, kept, 2)
	assert.Contains(t, kept[gpu(1).UUID].Reason, "operator cordon by uid 0 via gpu-guard-ctl since 2026-03-01T12:00:00Z: ECC errors, RMA 4711")
	assert.Contains(t, kept[mig(2, 0).UUID].Reason, "MIG layout change")
	require.Len(t, dropped, 2)
	assert.Contains(t, dropped[gpu(3).UUID].Reason, "if a process the ledger does not explain runs on it again): was intruder cordon by observer")
	assert.Contains(t, dropped[mig(4, 1).UUID].Reason, "if it finds the device still unhealthy): was unhealthy cordon by observer")

	// Only once: the next Update of this boot changes no cordon.
	update(t, l2, func(tx *Tx) { tx.Release("n1", "stop") })
	n := 0
	for _, r := range auditRecords(t, l2) {
		if strings.HasPrefix(r.Reason, "kept across the reboot") || strings.HasPrefix(r.Reason, "dropped at the reboot") {
			n++
		}
	}
	assert.Equal(t, 4, n)

	// The cordons are committed like any change: a cold read, and recovery
	// from the journal alone after the snapshot is lost, keep them.
	cold, err := Open(dir, opts)
	require.NoError(t, err)
	assert.Equal(t, want, snapshot(t, cold).Cordons)
	require.NoError(t, os.Remove(cold.StatePath()))
	_, err = cold.Recover(context.Background(), RecoverOptions{Reason: "test"})
	require.NoError(t, err)
	assert.Equal(t, want, snapshot(t, cold).Cordons, "recovered from the journal")

	// A cordon lifted stays lifted across the next reboot; the other is
	// kept again.
	update(t, cold, func(tx *Tx) {
		_, ok := tx.Uncordon(gpu(1).UUID, "root")
		require.True(t, ok)
	})
	l3, err := Open(dir, rebootOptions(t, c, "second-reboot"))
	require.NoError(t, err)
	update(t, l3, func(*Tx) {})
	assert.Equal(t, map[string]string{mig(2, 0).UUID: CordonOperator}, cordonSources(snapshot(t, l3).Cordons))
}

// A compacted state whose only content is a cordon is not a "genesis"
// (empty) base: with the snapshots lost, recovery from the journal alone
// must not replay from nothing and report a complete recovery without the
// cordons; it says nothing verifies instead.
func TestCordonOnlyBaseIsNotGenesis(t *testing.T) {
	opts := rebootOptions(t, newClock(), testBoot)
	l, err := Open(filepath.Join(t.TempDir(), "state"), opts)
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, _, err := tx.Cordon(gpu(1), CordonOperator, "reseat", "root")
		require.NoError(t, err)
	})
	l.compactAlways = true
	update(t, l, func(tx *Tx) {
		_, _, err := tx.Cordon(gpu(2), CordonOperator, "reseat", "root")
		require.NoError(t, err)
	})
	require.False(t, l.cached().jHdr.Genesis, "the journal's base holds two cordons")
	for _, name := range []string{stateName, prevName, journalPrevName} {
		require.NoError(t, os.Remove(filepath.Join(l.Dir(), name)))
	}
	rep, err := l.Recover(context.Background(), RecoverOptions{Reason: "test"})
	require.ErrorIs(t, err, ErrNeedsRecovery)
	assert.False(t, rep.Complete)
}
