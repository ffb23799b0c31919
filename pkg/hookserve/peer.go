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
	"strings"

	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
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
	// own holds the server's own namespaces and root ("ns/mnt", ...,
	// "root") as read once at its start (newPeerCheck): they do not change
	// while it runs. nil: read them at each check.
	own map[string]unix.Stat_t
}

// newPeerCheck returns the check of a server reading procRoot, with its own
// namespaces and root read once now.
func newPeerCheck(procRoot string, euid int) peerCheck {
	p := peerCheck{procRoot: procRoot, euid: euid}
	own := map[string]unix.Stat_t{}
	for _, name := range peerFiles() {
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(procRoot, "self", name), &st); err == nil {
			own[name] = st
		}
	}
	// Anything unreadable now is read (and reported) at each check.
	if len(own) == len(peerFiles()) || (len(own) == len(peerFiles())-1 && !hasTimeNS(own)) {
		p.own = own
	}
	return p
}

// peerFiles are the files of /proc/<pid> compared: the namespaces of
// peerNamespaces, then the root directory.
func peerFiles() []string {
	files := make([]string, 0, len(peerNamespaces)+1)
	for _, ns := range peerNamespaces {
		files = append(files, "ns/"+ns.name)
	}
	return append(files, "root")
}

func hasTimeNS(own map[string]unix.Stat_t) bool {
	_, ok := own["ns/time"]
	return ok
}

// ownStat is the server's own file name of /proc/self (see own).
func (p peerCheck) ownStat(name string, st *unix.Stat_t) error {
	if p.own != nil {
		if s, ok := p.own[name]; ok {
			*st = s
			return nil
		}
		return os.ErrNotExist
	}
	return unix.Stat(filepath.Join(p.procRoot, "self", name), st)
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
	// The peer's files are read relative to its /proc directory, looked up
	// once (each lookup below /proc costs).
	peerDir := filepath.Join(p.procRoot, pid)
	dirfd, err := unix.Open(peerDir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("read the peer's mnt namespace (%s): %w", peerDir, err)
	}
	defer func() { _ = unix.Close(dirfd) }()
	for _, ns := range peerNamespaces {
		var own, peer unix.Stat_t
		name := "ns/" + ns.name
		if err := p.ownStat(name, &own); err != nil {
			if ns.optional && errors.Is(err, os.ErrNotExist) {
				continue
			}
			return fmt.Errorf("read the server's %s namespace (%s): %w", ns.name, filepath.Join(p.procRoot, "self", name), err)
		}
		if err := unix.Fstatat(dirfd, name, &peer, 0); err != nil {
			return fmt.Errorf("read the peer's %s namespace (%s): %w", ns.name, filepath.Join(peerDir, name), err)
		}
		if own.Dev != peer.Dev || own.Ino != peer.Ino {
			return fmt.Errorf("the peer (pid %s) is in another %s namespace than the server: its hook must run as its own process", pid, ns.name)
		}
	}
	// The root directory: a runtime chrooted in the host's mount namespace
	// reads the bundle, the configuration and the ledger below its root,
	// which the server would read below its own.
	var ownRoot, peerRoot unix.Stat_t
	if err := p.ownStat("root", &ownRoot); err != nil {
		return fmt.Errorf("read the server's root directory: %w", err)
	}
	if err := unix.Fstatat(dirfd, "root", &peerRoot, 0); err != nil {
		return fmt.Errorf("read the peer's root directory: %w", err)
	}
	if ownRoot.Dev != peerRoot.Dev || ownRoot.Ino != peerRoot.Ino {
		return fmt.Errorf("the peer (pid %s) has another root directory than the server (chroot): its hook must run as its own process", pid)
	}
	return nil
}

// relativePaths returns why inv names a file relative to the hook's working
// directory (--config, --state-dir, or the $NRI_GPU_GUARD_CONFIG of env),
// or "": the server's working directory is not the relay's (a runtime runs
// its hooks in the bundle directory), so such a path is left to the hook
// itself.
func relativePaths(inv hook.Invocation, env []string) string {
	for _, f := range []struct{ flag, v string }{{"--config", inv.Config}, {"--state-dir", inv.StateDir}} {
		if f.v != "" && !filepath.IsAbs(f.v) {
			return fmt.Sprintf("%s %q is relative to the hook's working directory, which is not the server's", f.flag, f.v)
		}
	}
	for _, kv := range env {
		if name, v, ok := strings.Cut(kv, "="); ok && name == config.EnvPath && v != "" && !filepath.IsAbs(v) {
			return fmt.Sprintf("$%s %q is relative to the hook's working directory, which is not the server's", config.EnvPath, v)
		}
	}
	return ""
}
