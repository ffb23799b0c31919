// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// TestReadCommandsWarnOfAMissingLedgerDir: a [ledger] dir that does not exist
// reads as an empty ledger (every GPU free). On a fresh host that is true, so
// the read commands do not refuse it and exit as before, but they say on
// stderr which directory is missing and where it was configured, so that a
// mistyped path is not taken for a free host. An existing dir gets no
// warning.
func TestReadCommandsWarnOfAMissingLedgerDir(t *testing.T) {
	for _, tc := range []struct {
		name    string
		args    []string
		missing bool
	}{
		{name: "status, missing dir", args: []string{"status"}, missing: true},
		{name: "status json, missing dir", args: []string{"status", "-o", "json"}, missing: true},
		{name: "claims, missing dir", args: []string{"claims"}, missing: true},
		{name: "queue, missing dir", args: []string{"queue"}, missing: true},
		{name: "explain, missing dir", args: []string{"explain", "--env", "NVIDIA_VISIBLE_DEVICES=1"}, missing: true},
		{name: "explain json, missing dir", args: []string{"explain", "--env", "NVIDIA_VISIBLE_DEVICES=1", "-o", "json"}, missing: true},
		{name: "explain, empty dir", args: []string{"explain", "--env", "NVIDIA_VISIBLE_DEVICES=1"}},
		{name: "status, empty dir", args: []string{"status"}},
		{name: "claims, empty dir", args: []string{"claims"}},
		{name: "queue, empty dir", args: []string{"queue"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			dir := f.dir
			if tc.missing {
				dir = f.dir + "-typo"
				cfg, err := os.ReadFile(f.config)
				require.NoError(t, err)
				next := strings.Replace(string(cfg), `dir = "`+f.dir+`"`, `dir = "`+dir+`"`, 1)
				require.NotEqual(t, string(cfg), next)
				require.NoError(t, os.WriteFile(f.config, []byte(next), 0o600))
			}
			r := f.run(t, tc.args...)
			require.Equal(t, ExitOK, r.code, "exit code unchanged: stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			if !tc.missing {
				assert.NotContains(t, r.stderr, "ledger directory")
				return
			}
			assert.Contains(t, r.stderr, "warning: the ledger directory "+dir+" ([ledger] dir of "+f.config+") does not exist")
			assert.Contains(t, r.stderr, "no claim was ever recorded on this host")
			assert.Contains(t, r.stderr, "or the path is wrong")
			_, err := os.Stat(dir)
			assert.ErrorIs(t, err, os.ErrNotExist, "a read command creates nothing")
		})
	}
}

// TestLedgerDirFilesAreWhatIsWritten: every file a used ledger dir holds —
// the ledger's (a compaction's copies, the audit log's rotation, the gate
// of a contended lock) and the daemon's (inventory cache, observer report,
// carry file) — is one ledgerDirFiles knows, so that a dir holding any one
// of them alone is a ledger dir, not "no ledger here". Before, the list was
// spelled out in ctl and left out the daemon's carry file and the gate: a
// --state-dir holding only those was refused.
func TestLedgerDirFilesAreWhatIsWritten(t *testing.T) {
	f := newFixture(t) // writes the daemon's inventory cache
	opts := f.ledgerOpts(2048)
	l, err := ledger.Open(f.dir, opts)
	require.NoError(t, err)
	ctx := context.Background()
	gpu := f.dev(t, uuidGPU1)
	for range 100 { // enough commits for a compaction and an audit rotation
		require.NoError(t, l.Update(ctx, func(tx *ledger.Tx) error {
			claim(t, tx, ownTrainer, "env", gpu)
			return nil
		}))
		require.NoError(t, l.Update(ctx, func(tx *ledger.Tx) error {
			tx.Release(ownTrainer.ContainerID, "test")
			return nil
		}))
	}
	// A writer that finds the lock held closes the gate; it gives up as
	// soon as it starts waiting.
	waitCtx, giveUp := context.WithCancel(ctx)
	defer giveUp()
	opts.BeforeLockWait = giveUp
	other, err := ledger.Open(f.dir, opts)
	require.NoError(t, err)
	require.NoError(t, l.Update(ctx, func(*ledger.Tx) error {
		require.Error(t, other.Update(waitCtx, func(*ledger.Tx) error { return nil }))
		return nil
	}))
	require.NoError(t, observe.WriteFile(f.dir, observe.File{Time: now}))
	require.NoError(t, observe.WriteCarry(f.dir, observe.Carry{BootID: bootID}))

	entries, err := os.ReadDir(f.dir)
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	for _, name := range []string{"ledger.json.prev", "ledger.journal.prev", "audit.log.1", "ledger.gate",
		devices.CacheFile, observe.FileName, observe.CarryFileName} {
		require.Contains(t, names, name, "the test writes every kind of file")
	}
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			assert.Contains(t, ledgerDirFiles, name)
			alone := filepath.Join(t.TempDir(), "state")
			require.NoError(t, os.Mkdir(alone, 0o700))
			data, err := os.ReadFile(filepath.Join(f.dir, name))
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(filepath.Join(alone, name), data, 0o600))
			r := f.run(t, "--state-dir", alone, "claims")
			assert.NotContains(t, r.stderr, "no ledger here", "a dir holding only %s is a ledger dir", name)
		})
	}
}
