// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package config

import (
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestLinkLeadingNowhereIsNotAMissingFile: without --config, a missing
// default file means the built-in defaults, another guard than the one the
// operator configured (another ledger directory: two holders on one GPU).
// Only a path where nothing at all is reads as missing: a symbolic link in
// its place whose target is gone, or a link among the directories above it,
// is an error naming the link and where it leads, never the defaults.
func TestLinkLeadingNowhereIsNotAMissingFile(t *testing.T) {
	for _, tc := range []struct {
		name string
		// setup makes the tree below dir and returns the configuration path
		// and the link the error must name with its target.
		setup      func(t *testing.T, dir string) (path, link, target string)
		targetGone bool
	}{
		{name: "the file is a link whose target is gone", targetGone: true,
			setup: func(t *testing.T, dir string) (string, string, string) {
				mkdir(t, filepath.Join(dir, "etc"))
				path, target := filepath.Join(dir, "etc", "config.toml"), filepath.Join(dir, "cm", "gpu.toml")
				require.NoError(t, os.Symlink(target, path))
				return path, path, target
			}},
		{name: "the file is a relative link whose target is gone", targetGone: true,
			setup: func(t *testing.T, dir string) (string, string, string) {
				mkdir(t, filepath.Join(dir, "etc"))
				path := filepath.Join(dir, "etc", "config.toml")
				require.NoError(t, os.Symlink("../cm/gpu.toml", path))
				return path, path, filepath.Join(dir, "cm", "gpu.toml")
			}},
		{name: "the directory is a link whose target is gone", targetGone: true,
			setup: func(t *testing.T, dir string) (string, string, string) {
				link, target := filepath.Join(dir, "nri-gpu-guard"), filepath.Join(dir, "cm")
				require.NoError(t, os.Symlink(target, link))
				return filepath.Join(link, "config.toml"), link, target
			}},
		{name: "the directory is a link to a directory without the file",
			setup: func(t *testing.T, dir string) (string, string, string) {
				link, target := filepath.Join(dir, "nri-gpu-guard"), filepath.Join(dir, "cm")
				mkdir(t, target)
				require.NoError(t, os.Symlink(target, link))
				return filepath.Join(link, "config.toml"), link, target
			}},
		{name: "a link two levels up", targetGone: true,
			setup: func(t *testing.T, dir string) (string, string, string) {
				link, target := filepath.Join(dir, "etc"), filepath.Join(dir, "gone")
				require.NoError(t, os.Symlink(target, link))
				return filepath.Join(link, "nri-gpu-guard", "config.toml"), link, target
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path, link, target := tc.setup(t, tempDir(t))
			_, err := LoadFile(path)
			require.ErrorIs(t, err, ErrLinkLeadsNowhere)
			require.NotErrorIs(t, err, fs.ErrNotExist, "reads as a missing file: the defaults would apply")
			assert.Contains(t, err.Error(), link+" is a symbolic link to "+target)
			if tc.targetGone {
				assert.Contains(t, err.Error(), target+", which does not exist")
			} else {
				assert.NotContains(t, err.Error(), "which does not exist")
			}
			assert.Contains(t, err.Error(), "Restore the configuration the link leads to")

			// Not named by the operator (the default path): an error,
			// not the built-in defaults.
			cfg, used, err := loadPath(path, false)
			require.ErrorIs(t, err, ErrLinkLeadsNowhere)
			assert.Equal(t, Config{}, cfg)
			assert.Equal(t, path, used)
		})
	}
}

// TestNothingAtTheDefaultPathIsTheDefaults: where nothing at all is (no
// file, no directory, no link on the way), the default path still means the
// built-in defaults; an explicitly named path is still an error.
func TestNothingAtTheDefaultPathIsTheDefaults(t *testing.T) {
	dir := tempDir(t)
	for _, path := range []string{filepath.Join(dir, "config.toml"), filepath.Join(dir, "nri-gpu-guard", "config.toml")} {
		_, err := LoadFile(path)
		require.ErrorIs(t, err, fs.ErrNotExist)
		require.NotErrorIs(t, err, ErrLinkLeadsNowhere)

		cfg, used, err := loadPath(path, false)
		require.NoError(t, err)
		assert.Equal(t, Default(), cfg)
		assert.Empty(t, used)

		_, _, err = loadPath(path, true)
		require.ErrorIs(t, err, fs.ErrNotExist)
	}
	// A link further up than the file's own directory that leads somewhere
	// (a distribution whose /etc is one) is only the way there.
	realEtc := filepath.Join(dir, "real-etc")
	mkdir(t, realEtc)
	etc := filepath.Join(dir, "etc")
	require.NoError(t, os.Symlink(realEtc, etc))
	cfg, used, err := loadPath(filepath.Join(etc, "nri-gpu-guard", "config.toml"), false)
	require.NoError(t, err)
	assert.Equal(t, Default(), cfg)
	assert.Empty(t, used)

	// A link to a file that is there is simply followed.
	real := filepath.Join(dir, "real.toml")
	require.NoError(t, os.WriteFile(real, []byte("[policy]\non_conflict = \"reject\"\n"), 0o600))
	link := filepath.Join(dir, "link.toml")
	require.NoError(t, os.Symlink(real, link))
	cfg, used, err = loadPath(link, false)
	require.NoError(t, err)
	assert.Equal(t, link, used)
	assert.Equal(t, ConflictReject, cfg.Policy.OnConflict)
}

func mkdir(t *testing.T, dir string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(dir, 0o755))
}

// tempDir is a temporary directory reached through no symbolic link, which
// would make every missing path below it an error.
func tempDir(t *testing.T) string {
	t.Helper()
	dir, err := filepath.EvalSymlinks(t.TempDir())
	require.NoError(t, err)
	return dir
}
