// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hookserve

import (
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// shortDir is a temp dir whose socket paths fit sun_path.
func shortDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "hs")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

func TestListen(t *testing.T) {
	dir := shortDir(t)
	path := filepath.Join(dir, "hook.sock")
	l, err := Listen(path)
	require.NoError(t, err)
	fi, err := os.Lstat(path)
	require.NoError(t, err)
	require.Equal(t, os.ModeSocket|0o600, fi.Mode())

	// A server answers there: not displaced, its socket left alone.
	_, err = Listen(path)
	require.ErrorIs(t, err, ErrInUse)
	_, err = os.Lstat(path)
	require.NoError(t, err)

	// A socket nobody listens on any more (its server was killed and left
	// it) is taken over.
	require.NoError(t, l.Close())
	stale, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	stale.SetUnlinkOnClose(false)
	require.NoError(t, stale.Close())
	_, err = os.Lstat(path)
	require.NoError(t, err, "the stale socket file is there")
	l, err = Listen(path)
	require.NoError(t, err)
	require.NoError(t, l.Close())
	_, err = os.Lstat(path)
	require.ErrorIs(t, err, os.ErrNotExist, "closing removes the socket file")

	// Anything but a socket is refused and kept.
	require.NoError(t, os.WriteFile(path, []byte("x"), 0o600))
	_, err = Listen(path)
	require.ErrorContains(t, err, "it exists and is not a socket")
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, "x", string(data))
}

func TestActivatedFD(t *testing.T) {
	const pid = 4242
	for _, tc := range []struct {
		name string
		env  map[string]string
		ok   bool
	}{
		{name: "passed", env: map[string]string{"LISTEN_PID": strconv.Itoa(pid), "LISTEN_FDS": "1"}, ok: true},
		{name: "several: the first", env: map[string]string{"LISTEN_PID": strconv.Itoa(pid), "LISTEN_FDS": "3"}, ok: true},
		{name: "for another process", env: map[string]string{"LISTEN_PID": strconv.Itoa(pid + 1), "LISTEN_FDS": "1"}},
		{name: "no descriptor", env: map[string]string{"LISTEN_PID": strconv.Itoa(pid), "LISTEN_FDS": "0"}},
		{name: "no pid", env: map[string]string{"LISTEN_FDS": "1"}},
		{name: "garbage", env: map[string]string{"LISTEN_PID": "x", "LISTEN_FDS": "1"}},
		{name: "none", env: map[string]string{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fd, ok := activatedFD(func(k string) string { return tc.env[k] }, pid)
			require.Equal(t, tc.ok, ok)
			if ok {
				require.Equal(t, 3, fd)
			}
		})
	}
}
