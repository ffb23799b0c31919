// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package observe

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// errESRCH is what reading /proc/PID/* returns for a process that exited
// between open and read.
var errESRCH error = syscall.ESRCH

// clockTicks is USER_HZ (liveness.ClockTicks).
const clockTicks = liveness.ClockTicks

// procFS reads the processes of a /proc tree: the host's ("/") or a fake
// one in tests.
type procFS struct {
	root string // the directory that holds proc/
	// betweenReads, when set (tests only), runs after a process's cgroup
	// was read and before its start time is read again.
	betweenReads func(pid int)
}

func (p procFS) path(elem ...string) string {
	return filepath.Join(append([]string{p.root, "proc"}, elem...)...)
}

// read reads a file of the /proc tree (below the configured root; the
// elements are a pid and fixed names).
func (p procFS) read(elem ...string) ([]byte, error) {
	return os.ReadFile(p.path(elem...))
}

// uptimeTicks is the time since boot in clock ticks (/proc/uptime).
func (p procFS) uptimeTicks() (uint64, error) {
	data, err := p.read("uptime")
	if err != nil {
		return 0, fmt.Errorf("read uptime: %w", err)
	}
	f := strings.Fields(string(data))
	if len(f) == 0 {
		return 0, fmt.Errorf("read uptime: empty %s", p.path("uptime"))
	}
	secs, err := strconv.ParseFloat(f[0], 64)
	if err != nil || secs < 0 {
		return 0, fmt.Errorf("read uptime: unexpected %q", f[0])
	}
	return uint64(secs * clockTicks), nil
}

// errGone is returned for a pid whose /proc entry does not exist and that
// the kernel does not know either.
var errGone = errors.New("process is gone")

// gone is errGone for a pid whose entry read failed with err (missing, or
// ESRCH), unless the kernel still knows the pid: a procfs mounted with
// hidepid shows no entry for another user's process, which may run (and
// use the GPU); that is an error, never "gone".
func (p procFS) gone(pid int, err error) error {
	if liveness.Hidden(filepath.Join(p.root, "proc"), pid) {
		return fmt.Errorf("pid %d: %s shows no entry, but the kernel knows the process (kill(pid, 0)): "+
			"is /proc mounted with hidepid? %w", pid, p.path(), err)
	}
	return errGone
}

// startTicks reads a process's start time (field 22 of /proc/PID/stat).
func (p procFS) startTicks(pid int) (uint64, error) {
	data, err := p.read(strconv.Itoa(pid), "stat")
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, errESRCH) {
			return 0, p.gone(pid, err)
		}
		return 0, fmt.Errorf("pid %d: read stat: %w", pid, err)
	}
	// The command name (field 2) is in parentheses and may itself hold
	// spaces and parentheses: the fields proper start after the last ')'.
	end := bytes.LastIndexByte(data, ')')
	if end < 0 {
		return 0, fmt.Errorf("pid %d: malformed stat", pid)
	}
	f := strings.Fields(string(data[end+1:]))
	const startField = 22 - 3 // f[0] is field 3 (state)
	if len(f) <= startField {
		return 0, fmt.Errorf("pid %d: malformed stat: %d fields", pid, len(f)+2)
	}
	v, err := strconv.ParseUint(f[startField], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("pid %d: malformed start time %q", pid, f[startField])
	}
	return v, nil
}

// cgroup reads a process's cgroup path and the container id in it.
func (p procFS) cgroup(pid int) (path, id string, err error) {
	data, err := p.read(strconv.Itoa(pid), "cgroup")
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, errESRCH) {
			return "", "", p.gone(pid, err)
		}
		return "", "", fmt.Errorf("pid %d: read cgroup: %w", pid, err)
	}
	path, id = parseCgroup(data)
	return path, id, nil
}

// parseCgroup picks the cgroup path of a /proc/PID/cgroup document and the
// container id in it ("" for a host process). The path is the one a line
// naming a container gives, else that of the line liveness.ProcessCgroup
// records a holder's cgroup from (liveness.PickCgroup, one rule for both):
// on a hybrid host (v1 controllers plus a unified "0::" line) runc's
// cgroupfs driver leaves "0::" at the shim's cgroup, so the unified line
// must not win over a v1 line that names the container.
func parseCgroup(data []byte) (path, id string) {
	path = liveness.PickCgroup(data, func(p string) bool { return ContainerIDFromCgroup(p) != "" })
	return path, ContainerIDFromCgroup(path)
}

// runtimeScopePrefixes are the systemd scope names runtimes give containers:
// containerd's CRI, docker, podman, CRI-O.
var runtimeScopePrefixes = []string{"cri-containerd-", "docker-", "libpod-", "crio-"}

// ContainerIDFromCgroup returns the container id in a cgroup path, or "" for
// a path that names no container (a host process). It recognises the
// cgroupfs layouts (/kubepods/…/pod<uid>/<id>, /k8s.io/<id>, /docker/<id>)
// and the systemd scopes cri-containerd-<id>.scope, docker-<id>.scope,
// libpod-<id>.scope and crio-<id>.scope; the component nearest the leaf
// wins, so a container's nested cgroup (podman's …/libpod-<id>.scope/container)
// still names it. Conmon scopes (libpod-conmon-<id>.scope) are host processes.
func ContainerIDFromCgroup(path string) string {
	comps := strings.Split(path, "/")
	for i := len(comps) - 1; i >= 0; i-- {
		c := strings.TrimSuffix(comps[i], ".scope")
		for _, p := range runtimeScopePrefixes {
			if rest, ok := strings.CutPrefix(c, p); ok && isContainerID(rest) {
				return strings.ToLower(rest)
			}
		}
		if isContainerID(c) {
			return strings.ToLower(c)
		}
	}
	return ""
}

// isContainerID reports whether s is a full container id: 64 hex digits.
func isContainerID(s string) bool {
	if len(s) != 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') && (c < 'A' || c > 'F') {
			return false
		}
	}
	return true
}

// attribute maps an NVML pid to its container. listedAt is the boot-relative
// time (ticks) just before NVML was asked: a process that started after it
// cannot be the one NVML listed, so its pid was reused and it is reported
// gone rather than blamed. The start time is read before and after the
// cgroup, so a pid reused during the read is caught too.
func (p procFS) attribute(pr *Process, listedAt uint64) error {
	before, err := p.startTicks(pr.PID)
	if errors.Is(err, errGone) {
		pr.Gone = true
		return nil
	}
	if err != nil {
		return err
	}
	path, id, err := p.cgroup(pr.PID)
	if errors.Is(err, errGone) {
		pr.Gone = true
		return nil
	}
	if err != nil {
		return err
	}
	if p.betweenReads != nil {
		p.betweenReads(pr.PID)
	}
	after, err := p.startTicks(pr.PID)
	if errors.Is(err, errGone) || (err == nil && after != before) {
		pr.Gone = true
		return nil
	}
	if err != nil {
		return err
	}
	// One tick of slack: /proc/uptime and the start time are each rounded
	// to a tick.
	if before > listedAt+1 {
		pr.Gone = true
		return nil
	}
	pr.startTicks, pr.Cgroup, pr.ContainerID = before, path, id
	return nil
}
