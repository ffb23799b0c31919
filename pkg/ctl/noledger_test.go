// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// readCommands are the commands that show the ledger without changing it.
var readCommands = [][]string{
	{"status"}, {"status", "-o", "json"}, {"claims"}, {"queue"},
	{"explain", "--env", "NVIDIA_VISIBLE_DEVICES=1"}, {"audit"},
}

// setLedgerDir points the fixture's configuration at dir.
func (f *fixture) setLedgerDir(t *testing.T, dir string) {
	t.Helper()
	cfg, err := os.ReadFile(f.config)
	require.NoError(t, err)
	next := strings.Replace(string(cfg), `dir = "`+f.dir+`"`, `dir = "`+dir+`"`, 1)
	require.NotEqual(t, string(cfg), next)
	require.NoError(t, os.WriteFile(f.config, []byte(next), 0o600))
}

// TestReadCommandsOnADirWithoutLedger: a state dir that exists but holds
// none of the ledger's files (nor the daemon's) reads as an empty ledger,
// every GPU free, while the real one (the fixture's) holds a claim. Named by --state-dir (/run/nri-gpu-guard, the ledger dir's
// parent), it is refused, exit 1, nothing shown; the [ledger] dir of the
// configuration is a fresh host's before its first claim (the package
// creates it empty), so it is only warned about, as a missing one is; a
// --state-dir naming that same dir is judged as it. A dir any writer has
// locked (ledger.lock), or where the daemon keeps its inventory cache, is
// a ledger dir, however empty its ledger. Before, every case showed an
// empty ledger with exit 0 and no word.
func TestReadCommandsOnADirWithoutLedger(t *testing.T) {
	for _, tc := range []struct {
		name string
		// setup returns the --state-dir to pass ("" for none).
		setup func(t *testing.T, f *fixture, empty string) string
		code  int
		// stderr is what it says; "" = nothing.
		stderr string
	}{
		{name: "--state-dir without a ledger", code: ExitError, stderr: "error: --state-dir $EMPTY: no ledger here: it holds none of the ledger's files",
			setup: func(_ *testing.T, _ *fixture, empty string) string { return empty }},
		{name: "--state-dir a writer locked, nothing committed", code: ExitOK,
			setup: func(t *testing.T, f *fixture, empty string) string {
				l, err := ledger.Open(empty, f.ledgerOpts(0))
				require.NoError(t, err)
				require.NoError(t, l.Update(context.Background(), func(*ledger.Tx) error { return nil }))
				require.FileExists(t, filepath.Join(empty, "ledger.lock"))
				return empty
			}},
		{name: "--state-dir with the daemon's inventory cache only", code: ExitOK,
			setup: func(t *testing.T, _ *fixture, _ string) string { return newFixture(t).dir }},
		{name: "[ledger] dir without a ledger", code: ExitOK,
			stderr: "warning: the ledger directory $EMPTY ([ledger] dir of $CONFIG) holds no ledger (none of ledger.json, ledger.journal, ledger.lock, audit.log), so the ledger reads as empty: either no claim was ever recorded on this host",
			setup: func(t *testing.T, f *fixture, empty string) string {
				f.setLedgerDir(t, empty)
				return ""
			}},
		{name: "--state-dir naming the configured [ledger] dir", code: ExitOK,
			stderr: "warning: the ledger directory $EMPTY ([ledger] dir of $CONFIG) holds no ledger",
			setup: func(t *testing.T, f *fixture, empty string) string {
				f.setLedgerDir(t, empty)
				return empty + "/"
			}},
		{name: "the configured ledger", code: ExitOK,
			setup: func(*testing.T, *fixture, string) string { return "" }},
	} {
		for _, args := range readCommands {
			t.Run(tc.name+"/"+strings.Join(args, " "), func(t *testing.T) {
				f := newFixture(t)
				// The real ledger holds a claim (of a running holder: no
				// problem, status exits 0 on it).
				f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
					claim(t, tx, ownTrainer, "env", f.dev(t, uuidGPU1))
				})
				empty := filepath.Join(filepath.Dir(f.dir), "not-the-ledger")
				require.NoError(t, os.Mkdir(empty, 0o700))
				if flag := tc.setup(t, f, empty); flag != "" {
					args = append([]string{"--state-dir", flag}, args...)
				}
				r := f.run(t, args...)
				require.Equal(t, tc.code, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
				if tc.stderr == "" {
					assert.Empty(t, r.stderr)
					return
				}
				want := strings.NewReplacer("$EMPTY", empty, "$CONFIG", f.config).Replace(tc.stderr)
				assert.Contains(t, r.stderr, want)
				assert.Equal(t, 1, strings.Count(r.stderr, "\n"), "one line: %s", r.stderr)
				if tc.code != ExitOK {
					assert.Empty(t, r.stdout, "nothing is shown")
					assert.Contains(t, r.stderr, "name the ledger directory the daemon and the hook use")
				}
				entries, err := os.ReadDir(empty)
				require.NoError(t, err)
				if tc.name != "--state-dir a writer locked, nothing committed" {
					assert.Empty(t, entries, "a read command writes nothing")
				}
			})
		}
	}
}
