// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hookserve

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// peerNamespaces are the namespaces a relay must share with the server: what
// the hook reads of "its own" process (its user namespace's uid_map, its
// mount table, pids and cgroups under /proc, the boot clock) the server
// reads of itself, and that is the relay's only where they are the same.
// The time namespace is compared only where the kernel has one.
var peerNamespaces = []struct {
	name     string
	optional bool // absent from /proc/self/ns on kernels without it
}{
	{name: "mnt"}, {name: "pid"}, {name: "user"}, {name: "cgroup"}, {name: "time", optional: true},
}

// peerCheck decides whether a peer may have its hook run here.
type peerCheck struct {
	// procRoot is where namespaces are read (/proc).
	procRoot string
	// euid is the server's effective uid.
	euid int
}

// credentials reads the peer's SO_PEERCRED: the process that connected, as
// the kernel recorded it at connect().
func credentials(c *net.UnixConn) (*unix.Ucred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("read the peer's credentials: %w", err)
	}
	var (
		cred    *unix.Ucred
		credErr error
	)
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, fmt.Errorf("read the peer's credentials: %w", err)
	}
	if credErr != nil {
		return nil, fmt.Errorf("read the peer's credentials (SO_PEERCRED): %w", credErr)
	}
	return cred, nil
}

// check returns why the peer cred describes must not be served, or nil:
// another uid than the server's effective one, a pid the server cannot see
// (0: in another pid namespace), or a namespace of the list not the
// server's. Anything unreadable refuses.
func (p peerCheck) check(cred *unix.Ucred) error {
	if int(cred.Uid) != p.euid {
		return fmt.Errorf("the peer runs as uid %d, the server as uid %d: only the server's own user is served", cred.Uid, p.euid)
	}
	if cred.Pid <= 0 {
		return errors.New("the peer's pid is not visible here (another pid namespace)")
	}
	pid := strconv.Itoa(int(cred.Pid))
	for _, ns := range peerNamespaces {
		var own, peer unix.Stat_t
		ownPath := filepath.Join(p.procRoot, "self", "ns", ns.name)
		if err := unix.Stat(ownPath, &own); err != nil {
			if ns.optional && errors.Is(err, os.ErrNotExist) {
				continue
			}
			return fmt.Errorf("read the server's %s namespace (%s): %w", ns.name, ownPath, err)
		}
		peerPath := filepath.Join(p.procRoot, pid, "ns", ns.name)
		if err := unix.Stat(peerPath, &peer); err != nil {
			return fmt.Errorf("read the peer's %s namespace (%s): %w", ns.name, peerPath, err)
		}
		if own.Dev != peer.Dev || own.Ino != peer.Ino {
			return fmt.Errorf("the peer (pid %s) is in another %s namespace than the server: its hook must run as its own process", pid, ns.name)
		}
	}
	return nil
}
