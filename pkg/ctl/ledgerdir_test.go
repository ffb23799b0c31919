// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
