// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hookserve

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"syscall"
	"time"
)

// DefaultSocket is where the server listens and the relay connects.
const DefaultSocket = "/run/nri-gpu-guard/hook.sock"

// ErrInUse is Listen's error where another server answers on the socket path.
var ErrInUse = errors.New("another hook server answers on the socket")

// probeTimeout bounds the connect that tells whether a server answers on
// a path: a live server's kernel completes it at once (its backlog is
// not read for it), a dead one's refuses it.
const probeTimeout = time.Second

// Listen listens on a unix socket at path with mode 0600. A server that
// already answers there is not displaced (ErrInUse); a socket file left by
// one that is gone is removed first; anything else at path is refused.
// The socket file is removed when the listener is closed.
func Listen(path string) (*net.UnixListener, error) {
	fi, err := os.Lstat(path)
	switch {
	case err == nil && fi.Mode()&os.ModeSocket == 0:
		return nil, fmt.Errorf("listen on %s: it exists and is not a socket (%s); remove it or choose another --socket", path, fi.Mode().Type())
	case err == nil:
		if c, derr := net.DialTimeout("unix", path, probeTimeout); derr == nil {
			_ = c.Close()
			return nil, fmt.Errorf("listen on %s: %w; stop that server first, or choose another --socket", path, ErrInUse)
		}
		// A socket nobody listens on: a server that is gone left it.
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("listen on %s: remove the stale socket: %w", path, err)
		}
	case !errors.Is(err, os.ErrNotExist):
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	// Before the chmod the socket has the umask's mode; a peer of another
	// uid that connects meanwhile is still refused by the uid check.
	if err := os.Chmod(path, 0o600); err != nil {
		_ = l.Close()
		return nil, fmt.Errorf("listen on %s: set mode 0600: %w", path, err)
	}
	return l, nil
}

// listenFDsStart is the first descriptor systemd passes (SD_LISTEN_FDS_START).
const listenFDsStart = 3

// Activated returns the socket systemd passed (socket activation:
// $LISTEN_PID is this process and $LISTEN_FDS at least 1: the first, fd 3),
// or ok false when there is none. It unsets $LISTEN_PID, $LISTEN_FDS and
// $LISTEN_FDNAMES, so that nothing started later takes them for its own.
func Activated() (l *net.UnixListener, ok bool, err error) {
	fd, ok := activatedFD(os.Getenv, os.Getpid())
	if !ok {
		return nil, false, nil
	}
	for _, k := range []string{"LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"} {
		_ = os.Unsetenv(k)
	}
	syscall.CloseOnExec(fd)
	f := os.NewFile(uintptr(fd), "systemd socket")
	defer func() { _ = f.Close() }() // FileListener dups it
	fl, err := net.FileListener(f)
	if err != nil {
		return nil, true, fmt.Errorf("the socket systemd passed (fd %d): %w", fd, err)
	}
	ul, isUnix := fl.(*net.UnixListener)
	if !isUnix {
		_ = fl.Close()
		return nil, true, fmt.Errorf("the socket systemd passed (fd %d) is %s, not a unix stream socket: set ListenStream=%s in the .socket unit",
			fd, fl.Addr().Network(), DefaultSocket)
	}
	// systemd owns the path: closing must not remove it.
	ul.SetUnlinkOnClose(false)
	return ul, true, nil
}

// activatedFD tells, from the environment getenv reads, whether systemd
// passed process pid a socket, and its descriptor.
func activatedFD(getenv func(string) string, pid int) (int, bool) {
	lp, err := strconv.Atoi(getenv("LISTEN_PID"))
	if err != nil || lp != pid {
		return 0, false
	}
	n, err := strconv.Atoi(getenv("LISTEN_FDS"))
	if err != nil || n < 1 {
		return 0, false
	}
	return listenFDsStart, true
}
