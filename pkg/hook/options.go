// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// Options are the create-runtime hook's command-line options.
type Options struct {
	// Wait makes create-runtime wait in the queue (up to hook.wait_timeout)
	// instead of refusing at once while a GPU it names is busy. Only for
	// engines that hold no lock around the create (plain runc or crun, a
	// wrapper runtime); ignored, with a note, when the engine is one that does
	// (see engineHoldsLock).
	Wait bool
	// Started is when the hook process started: the timeout a runtime
	// gives a hook counts from there, and so does the wait of a --wait
	// hook. Zero: when RunInput is called.
	Started time.Time
}

// lockingEngines are the processes that run an OCI runtime while their
// engine holds a lock around the container's create: conmon is what podman
// and CRI-O start the runtime under, and both hold the container's lock (and
// podman abandons the create after 240s while the hook lives on); Docker and
// containerd start it under containerd-shim.
var lockingEngines = map[string]string{
	"conmon": "the runtime runs under conmon (podman or CRI-O), whose engine holds the container's lock during the create",
	// CRI-O with runtime_type = "pod" starts the runtime under conmon-rs.
	"conmonrs": "the runtime runs under conmon-rs (CRI-O), whose engine holds the container's lock during the create",
	// comm is cut at 15 bytes: containerd-shim-runc-v2 reads "containerd-shim".
	// Docker (dockerd 20.10 observed) keeps `docker rm -f` of a container
	// whose create waits hanging until the hook returns.
	"containerd-shim": "the runtime runs under containerd-shim (Docker or containerd), whose engine holds the container during the create",
}

// engineHoldsLock reports whether the runtime that ran this hook (its parent,
// ppid) was started by an engine that holds a lock for the whole create, and
// why. Anything it cannot read counts as "no": plain runc is the case that
// waits, and it has no such parent.
func engineHoldsLock(procRoot string, ppid int) (bool, string) {
	grand, err := parentOf(procRoot, ppid)
	if err != nil || grand <= 1 {
		return false, ""
	}
	comm, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(grand), "comm")) //nolint:gosec // a /proc file of a numeric pid
	if err != nil {
		return false, ""
	}
	if why, ok := lockingEngines[string(bytes.TrimSpace(comm))]; ok {
		return true, fmt.Sprintf("%s (pid %d)", why, grand)
	}
	return false, ""
}

// parentOf reads the parent pid of pid from procRoot/<pid>/stat.
func parentOf(procRoot string, pid int) (int, error) {
	if pid <= 0 {
		return 0, fmt.Errorf("invalid pid %d", pid)
	}
	data, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(pid), "stat")) //nolint:gosec // a /proc file of a numeric pid
	if err != nil {
		return 0, err
	}
	end := bytes.LastIndexByte(data, ')')
	if end < 0 {
		return 0, fmt.Errorf("malformed %s/%d/stat", procRoot, pid)
	}
	fields := bytes.Fields(data[end+1:])
	if len(fields) < 2 {
		return 0, fmt.Errorf("malformed %s/%d/stat", procRoot, pid)
	}
	return strconv.Atoi(string(fields[1]))
}
