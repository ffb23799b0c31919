// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestCheckConfigChecksLedgerDirChain: check-config refuses a ledger dir
// below a directory that group or others may write to without the sticky
// bit, or reached through a symlink, naming the directory and the fix, as
// the daemon, the hook and ctl would refuse to open it. A safe chain (and a
// dir not created yet below one) passes.
func TestCheckConfigChecksLedgerDirChain(t *testing.T) {
	base := t.TempDir() // below the sticky /tmp: safe
	open := filepath.Join(base, "open")
	require.NoError(t, os.Mkdir(open, 0o700))
	require.NoError(t, os.Chmod(open, 0o777)) // no sticky bit: anyone can `mv state stolen`
	safe := filepath.Join(base, "safe")
	require.NoError(t, os.Mkdir(safe, 0o755))
	link := filepath.Join(base, "link")
	require.NoError(t, os.Symlink(safe, link))
	writeCfg := func(name, dir string) string {
		p := filepath.Join(base, name+".toml")
		require.NoError(t, os.WriteFile(p, []byte("version = 1\n[ledger]\ndir = \""+dir+"\"\n"), 0o600))
		return p
	}
	f := newFixture(t)
	for i, tc := range []struct {
		name, dir string
		code      int
		want      []string
	}{
		{"safe chain, dir not created yet", filepath.Join(safe, "state"), ExitOK, []string{"valid",
			"ledger.dir: " + filepath.Join(safe, "state") + " is not /var/lib/nri-gpu-guard", "systemctl edit nri-gpu-guard",
			"ReadWritePaths=" + filepath.Join(safe, "state")}},
		// The daemon cleans the path; check-config must accept what it accepts.
		{"trailing slash, dir not created yet", filepath.Join(safe, "state") + "/", ExitOK, []string{"valid"}},
		{"trailing slash, existing dir", safe + "/", ExitOK, []string{"valid"}},
		{"trailing slash below a symlink", filepath.Join(link, "state") + "/", ExitError,
			[]string{"invalid (1 problem(s))", "ledger.dir:", link, "is a symlink; configure the real path"}},
		{"world-writable parent", filepath.Join(open, "state"), ExitError,
			[]string{"invalid (1 problem(s))", "ledger.dir:", open, "writable by group or others without the sticky bit", "chmod go-w"}},
		{"symlink on the path", filepath.Join(link, "state"), ExitError,
			[]string{"invalid (1 problem(s))", "ledger.dir:", link, "is a symlink; configure the real path"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := writeCfg(fmt.Sprint("cfg", i), tc.dir)
			var stdout, stderr syncBuffer
			code := Run(t.Context(), []string{"check-config", cfg}, f.env(&stdout, &stderr))
			require.Equal(t, tc.code, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
			for _, w := range tc.want {
				assert.Contains(t, stdout.String(), w)
			}
			var jsonOut syncBuffer
			code = Run(t.Context(), []string{"check-config", cfg, "-o", "json"}, f.env(&jsonOut, &stderr))
			require.Equal(t, tc.code, code)
			var v checkConfigView
			require.NoError(t, json.Unmarshal([]byte(jsonOut.String()), &v))
			assert.Equal(t, tc.code == ExitOK, v.Valid)
			if tc.code != ExitOK {
				require.Len(t, v.Errors, 1)
				assert.Contains(t, v.Errors[0], "ledger.dir: ")
			}
		})
	}
}
