// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// TestStateDirFlagIsJudgedAsLedgerDir: --state-dir stands for [ledger] dir
// and is refused where that key would be, with the same words: a system
// directory (the operator meant /var/lib/nri-gpu-guard and typed /var/lib)
// or one on a kernel file system. A mutating command given one would write
// the ledger's files there and make the directory 0700. Nothing is written
// and the directory's mode is left as it was.
func TestStateDirFlagIsJudgedAsLedgerDir(t *testing.T) {
	for _, dir := range []string{"/var/lib", "/var/lib/", "/", "/etc", "/tmp", "/dev/shm", "/proc/self", "/sys"} {
		problem := config.CheckLedgerDir(dir)
		require.Error(t, problem, dir)
		// The configuration's own judgement of the same directory.
		cfg := config.Default()
		cfg.Ledger.Dir = dir
		require.ErrorContains(t, cfg.Validate(), "ledger.dir: "+problem.Error())

		for _, args := range [][]string{{"cordon", "0", "--reason", "maintenance"}, {"claims"}, {"status", "-o", "json"}, {"gc"}} {
			t.Run(dir+"/"+strings.Join(args, " "), func(t *testing.T) {
				before, err := os.Stat(dir)
				require.NoError(t, err)
				_, lockErr := os.Lstat(filepath.Join(dir, "ledger.lock"))

				f := newFixture(t)
				r := f.run(t, append([]string{"--state-dir", dir}, args...)...)
				require.Equal(t, ExitUsage, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
				assert.Empty(t, r.stdout)
				assert.Contains(t, r.stderr, "--state-dir: "+problem.Error())

				after, err := os.Stat(dir)
				require.NoError(t, err)
				assert.Equal(t, before.Mode(), after.Mode(), "the mode of %s is left alone", dir)
				if errors.Is(lockErr, fs.ErrNotExist) {
					assert.NoFileExists(t, filepath.Join(dir, "ledger.lock"))
				}
			})
		}
	}
}

// TestStateDirFlagRelativeIsTheLedgerDirsWords: a relative --state-dir is
// refused in the words of [ledger] dir's check.
func TestStateDirFlagRelativeIsTheLedgerDirsWords(t *testing.T) {
	f := newFixture(t)
	r := f.run(t, "--state-dir", "state", "claims")
	require.Equal(t, ExitUsage, r.code, r.stderr)
	assert.Contains(t, r.stderr, `--state-dir: want the absolute path of a directory of the guard's own such as /var/lib/nri-gpu-guard, got "state"`)
}
