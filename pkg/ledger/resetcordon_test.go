// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestResetKeepsTheOperatorsCordons: a reset forgets holders and waiters,
// not maintenance set on purpose. The operator's cordons of the newest
// state that verifies (a healthy one, one rebuilt from the journal, the
// snapshot beside a damaged journal, an earlier boot's) are carried into
// the reset state, each audited, and reported; the observer's are dropped,
// audited. When no state verifies, the report and the audit say that the
// cordons could not be carried; a dir that never held a state loses nothing.
func TestResetKeepsTheOperatorsCordons(t *testing.T) {
	const lostCordons = "the operator's cordons: no state verified to read them from"
	for _, tc := range []struct {
		name      string
		compacted bool                                         // every commit compacted: ledger.json holds it all
		empty     bool                                         // nothing was ever written
		damage    func(t *testing.T, dir string, opts Options) // before the reset
		reboot    bool                                         // the reset runs in a later boot
		kept      bool                                         // the operator's cordons are carried
		lost      string                                       // in the report's Lost
	}{
		{name: "healthy ledger", kept: true},
		{name: "healthy compacted ledger", compacted: true, kept: true},
		{name: "snapshot damaged, journal replays onto its empty base", kept: true,
			damage: junk(stateName)},
		{name: "journal damaged, compacted snapshot verifies", compacted: true, kept: true,
			damage: junk(journalName)},
		{name: "state of an earlier boot", reboot: true, kept: true},
		{name: "nothing verifies", compacted: true, lost: lostCordons,
			damage: junk(stateName, prevName, journalName, journalPrevName)},
		{name: "state dir never written", empty: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := testOptions(newClock())
			opts.RuntimeDir = t.TempDir()
			dir := filepath.Join(t.TempDir(), "state")
			l, err := Open(dir, opts)
			require.NoError(t, err)
			l.compactAlways = tc.compacted
			if !tc.empty {
				update(t, l, func(tx *Tx) {
					_, err := tx.Claim("", owner("h1"), devs(gpu(0)), "env")
					require.NoError(t, err)
					_, _, err = tx.Cordon(gpu(1), CordonOperator, "ECC errors, RMA 4711", "uid 0 via gpu-guard-ctl")
					require.NoError(t, err)
					_, _, err = tx.Cordon(gpu(2), CordonIntruder, "pid 4242 not admitted", "observer")
					require.NoError(t, err)
				})
				update(t, l, func(tx *Tx) {
					_, _, err := tx.Cordon(mig(3, 0), CordonOperator, "MIG layout change", "uid 0 via gpu-guard-ctl")
					require.NoError(t, err)
				})
			}
			if tc.damage != nil {
				tc.damage(t, dir, opts)
			}
			if tc.reboot {
				opts = rebootOptions(t, newClock(), "after-reboot")
			}
			l, err = Open(dir, opts)
			require.NoError(t, err)
			auditBefore := 0
			if recs, err := ReadAudit(l.AuditPath()); err == nil {
				auditBefore = len(recs)
			}

			rep, err := l.Reset(context.Background(), "test")
			require.NoError(t, err)

			want := map[string]string{}
			if tc.kept {
				want = map[string]string{gpu(1).UUID: CordonOperator, mig(3, 0).UUID: CordonOperator}
			}
			st := snapshot(t, l)
			assert.Equal(t, want, cordonSources(st.Cordons), "the reset state's cordons")
			assert.Equal(t, want, cordonSources(rep.KeptCordons), "the report lists each kept cordon")
			assert.Empty(t, st.Claims, "the holders are forgotten")
			if tc.kept && assert.NotEmpty(t, st.Cordons) {
				k := st.Cordons[0]
				assert.Equal(t, "ECC errors, RMA 4711", k.Reason, "reason, by and since kept as they were")
				assert.Equal(t, "uid 0 via gpu-guard-ctl", k.By)
			}
			if tc.lost == "" {
				assert.Empty(t, rep.Lost)
			} else {
				assert.Contains(t, rep.Lost, tc.lost)
			}

			recs, err := ReadAudit(l.AuditPath())
			require.NoError(t, err)
			kept, dropped := map[string]bool{}, map[string]bool{}
			var reset AuditRecord
			for _, r := range recs[auditBefore:] {
				switch {
				case r.Op == OpCordon && strings.HasPrefix(r.Reason, "kept across the reset"):
					kept[r.Devices[0]] = true
				case r.Op == OpUncordon && strings.HasPrefix(r.Reason, "dropped at the reset"):
					dropped[r.Devices[0]] = true
				case r.Op == OpReset:
					reset = r
				}
			}
			assert.Len(t, kept, len(want), "every kept cordon is audited")
			for uuid := range want {
				assert.True(t, kept[uuid], uuid)
			}
			assert.Equal(t, tc.kept, dropped[gpu(2).UUID], "the observer's cordon is dropped, audited")
			require.Equal(t, OpReset, reset.Op)
			assert.Contains(t, reset.Reason, "operator cordon(s) kept")
			if tc.lost != "" {
				assert.Contains(t, reset.Reason, "lost: "+tc.lost)
			}

			// The kept cordons are written: a new handle reads them.
			l, err = Open(dir, opts)
			require.NoError(t, err)
			assert.Equal(t, want, cordonSources(snapshot(t, l).Cordons))
		})
	}
}

// junk returns a damage that overwrites the named state files that exist.
func junk(names ...string) func(t *testing.T, dir string, opts Options) {
	return func(t *testing.T, dir string, _ Options) {
		t.Helper()
		for _, n := range names {
			p := filepath.Join(dir, n)
			if _, err := os.Stat(p); err == nil {
				require.NoError(t, os.WriteFile(p, []byte("junk"), 0o600))
			}
		}
	}
}
