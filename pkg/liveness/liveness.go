// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package liveness

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Default roots of the host's cgroup hierarchy and procfs.
const (
	DefaultCgroupRoot = "/sys/fs/cgroup"
	DefaultProcRoot   = "/proc"
)

// v1Controllers are the cgroup v1 hierarchies a container's cgroup is looked
// up in, in order. Every runtime puts a container into the pids, memory and
// devices hierarchies (the ones ProcessCgroup records a path from, in this
// order: see cgroupRank); the others cover hosts that mount fewer
// controllers. "unified" is the v2 hierarchy of a hybrid host, last: runc's
// cgroupfs driver does not put containers there.
var v1Controllers = []string{"pids", "memory", "devices", "cpu,cpuacct", "cpuacct,cpu", "cpu", "cpuacct", "systemd", "unified"}

// maxCgroupDirs bounds the walk below a v1 cgroup: a container may create
// child cgroups, but thousands of them mean something odd is going on and the
// answer is "alive" rather than an unbounded scan under the caller's deadline.
const maxCgroupDirs = 512

// maxStatBytes bounds a read of /proc/<pid>/stat (a few hundred bytes).
const maxStatBytes = 4096

// Process is what the liveness check knows of a claim holder: the pid the
// runtime reported, its start time (against pid reuse) and its cgroup. The
// zero value is a holder that never started.
type Process struct {
	// Pid is the holder's main process; 0 when unknown.
	Pid int
	// PidStart is the start time of Pid in clock ticks since boot (field 22
	// of /proc/<pid>/stat); 0 when not recorded.
	PidStart uint64
	// Cgroup is the runtime's cgroups path of the holder; "" when unknown.
	Cgroup string
	// Successor is the pid of a later incarnation of the holder's container
	// (its id created again: a restart of the same container, or a start
	// after a create the runtime undid without a poststop) that runs in
	// Cgroup as well, or 0. The runtime names the cgroup after the id, so
	// the restart's own process lives there: it is not the holder's, and a
	// cgroup with no other process counts as empty. Only the requester
	// itself may be named here (its pid, as its runtime reported it).
	Successor int
}

// Checker tells whether a claim holder's processes are gone. It holds no
// state besides its roots and is safe for concurrent use.
type Checker struct {
	cgroupRoot string
	procRoot   string
}

// New returns a Checker reading the cgroup hierarchy at cgroupRoot and procfs
// at procRoot; empty values take DefaultCgroupRoot and DefaultProcRoot.
// Tests point both at fake trees.
func New(cgroupRoot, procRoot string) *Checker {
	if cgroupRoot == "" {
		cgroupRoot = DefaultCgroupRoot
	}
	if procRoot == "" {
		procRoot = DefaultProcRoot
	}
	return &Checker{cgroupRoot: cgroupRoot, procRoot: procRoot}
}

// PidStart returns the start time (clock ticks since boot, field 22 of
// /proc/<pid>/stat) of pid, read from this Checker's procfs.
func (c *Checker) PidStart(pid int) (uint64, error) {
	return PidStart(c.procRoot, pid)
}

// Exited reports whether the started holder o has no processes left, with a
// short reason for the audit trail and logs. It returns false whenever the
// evidence is missing or ambiguous: a claim is never released on doubt.
func (c *Checker) Exited(o Process) (bool, string) {
	if o.Pid <= 0 && o.Cgroup == "" {
		return false, "never started (no pid, no cgroup)"
	}
	if o.Cgroup != "" {
		exited, reason, decided := c.cgroupExited(o.Cgroup, o.Successor)
		if decided {
			return exited, reason
		}
		if o.Pid <= 0 {
			return false, reason + " and no pid is recorded"
		}
		exited, pidReason := c.pidExited(o.Pid, o.PidStart)
		return exited, reason + "; " + pidReason
	}
	return c.pidExited(o.Pid, o.PidStart)
}

// cgroupExited checks the cgroup named by the runtime. decided is false when
// the cgroup directory does not exist in a readable hierarchy (it was removed,
// or named in a way this host does not show): the caller then falls back to
// the pid.
func (c *Checker) cgroupExited(cgroupsPath string, successor int) (exited bool, reason string, decided bool) {
	rel, err := CgroupPath(cgroupsPath)
	if err != nil {
		return false, err.Error(), true
	}
	if isCgroup2(c.cgroupRoot) {
		dir := filepath.Join(c.cgroupRoot, rel)
		return c.dirExited(dir, rel, true, successor)
	}
	foundHierarchy := false
	for _, ctrl := range v1Controllers {
		base := filepath.Join(c.cgroupRoot, ctrl)
		if st, err := os.Stat(base); err != nil || !st.IsDir() {
			continue
		}
		foundHierarchy = true
		dir := filepath.Join(base, rel)
		if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
			continue
		}
		return c.dirExited(dir, rel, ctrl == "unified", successor)
	}
	if !foundHierarchy {
		// Without a readable hierarchy a missing cgroup proves nothing (the
		// daemon may run without the host's cgroupfs mounted); keep the claim.
		return false, fmt.Sprintf("no cgroup hierarchy readable at %s", c.cgroupRoot), true
	}
	return false, fmt.Sprintf("cgroup %s not found", rel), false
}

// dirExited reads one cgroup directory. unified selects the v2 shortcut
// (cgroup.events "populated" covers the whole subtree), which tells nothing
// once it says "populated" while a successor (see Process.Successor) runs
// there: the walk then lists who.
func (c *Checker) dirExited(dir, rel string, unified bool, successor int) (exited bool, reason string, decided bool) {
	if _, err := os.Stat(dir); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return false, fmt.Sprintf("cgroup %s not found", rel), false
		}
		return false, fmt.Sprintf("cgroup %s unreadable: %v", rel, err), true
	}
	if unified {
		populated, err := readPopulated(filepath.Join(dir, "cgroup.events"))
		switch {
		case err == nil && populated && successor > 0:
			// Who: walk cgroup.procs below.
		case err == nil && populated:
			return false, fmt.Sprintf("cgroup %s has processes", rel), true
		case err == nil:
			return true, fmt.Sprintf("cgroup %s has no processes", rel), true
		case !errors.Is(err, fs.ErrNotExist):
			return false, fmt.Sprintf("cgroup %s unreadable: %v", rel, err), true
		}
		// No cgroup.events (very old kernels, fake trees): walk cgroup.procs.
	}
	populated, err := walkPopulated(dir, successor)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		// Removed between the stat and the walk: the runtime deleted it.
		return false, fmt.Sprintf("cgroup %s not found", rel), false
	case err != nil:
		return false, fmt.Sprintf("cgroup %s unreadable: %v", rel, err), true
	case populated && successor > 0:
		return false, fmt.Sprintf("cgroup %s has processes other than pid %d, the restarted container's", rel, successor), true
	case populated:
		return false, fmt.Sprintf("cgroup %s has processes", rel), true
	case successor > 0:
		return true, fmt.Sprintf("cgroup %s has no process but pid %d, the restarted container's", rel, successor), true
	default:
		return true, fmt.Sprintf("cgroup %s has no processes", rel), true
	}
}

// pidExited is the fallback when no cgroup answers: the pid is gone, a zombie,
// or now belongs to another process.
func (c *Checker) pidExited(pid int, recordedStart uint64) (bool, string) {
	st, err := readStat(c.procRoot, pid)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if Hidden(c.procRoot, pid) {
			// /proc mounted with hidepid (or a pid namespace view that
			// hides it) shows no entry for another user's process, as if
			// it were gone; the kernel still knows it.
			return false, fmt.Sprintf("pid %d is not shown in %s, but exists (kill(pid, 0)): is /proc mounted with hidepid?", pid, c.procRoot)
		}
		return true, fmt.Sprintf("pid %d is gone", pid)
	case err != nil:
		return false, fmt.Sprintf("pid %d unreadable: %v", pid, err)
	case recordedStart != 0 && st.start != recordedStart:
		return true, fmt.Sprintf("pid %d was reused by another process (start %d, recorded %d)", pid, st.start, recordedStart)
	case st.state == 'Z' || st.state == 'X':
		// A process whose main thread ended (pthread_exit) while others
		// run shows its pid as a zombie: it runs, and may use the GPU.
		switch n, err := otherThreads(c.procRoot, pid); {
		case err != nil:
			return false, fmt.Sprintf("pid %d's main thread has exited; its other threads are unreadable: %v", pid, err)
		case n > 0:
			return false, fmt.Sprintf("pid %d's main thread has exited, but %d other thread(s) run", pid, n)
		}
		return true, fmt.Sprintf("pid %d has exited (zombie)", pid)
	default:
		return false, fmt.Sprintf("pid %d is running", pid)
	}
}

// otherThreads counts the threads of pid other than its main one
// (/proc/<pid>/task). A process entry gone meanwhile has none.
func otherThreads(procRoot string, pid int) (int, error) {
	entries, err := os.ReadDir(filepath.Join(procRoot, strconv.Itoa(pid), "task"))
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	n := 0
	for _, e := range entries {
		if e.Name() != strconv.Itoa(pid) {
			n++
		}
	}
	return n, nil
}

// ownProcfs reports whether procRoot is the procfs of this process's pid
// namespace (its "self" is this process), where kill(2) names the same
// processes: not a test's tree, nor another namespace's procfs.
func ownProcfs(procRoot string) bool {
	self, err := os.Readlink(filepath.Join(procRoot, "self"))
	return err == nil && self == strconv.Itoa(os.Getpid())
}

// Hidden reports whether pid, which procRoot shows no entry for, still
// names a process the kernel knows: procRoot is this pid namespace's procfs
// and kill(pid, 0) does not answer ESRCH. A procfs mounted with hidepid
// hides other users' processes from a reader without CAP_SYS_PTRACE (the
// DaemonSet keeps only CAP_KILL): a missing entry is then no proof that the
// process is gone.
func Hidden(procRoot string, pid int) bool {
	return pid > 0 && ownProcfs(procRoot) && pidExists(pid)
}

// pidExists asks the kernel whether pid names a process (kill with signal
// 0 sends nothing): ESRCH is the only proof that it does not; EPERM (another
// user's process, without CAP_KILL) means it does.
func pidExists(pid int) bool {
	return !errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}

// ErrBadCgroupPath is wrapped by CgroupPath for a path it cannot interpret.
var ErrBadCgroupPath = errors.New("unrecognised cgroups path")

// CgroupPath turns an OCI linux.cgroupsPath into a path relative to the
// hierarchy root. cgroupfs paths ("/k8s.io/<id>", "k8s.io/<id>") are used as
// they are; systemd paths ("<slice>:<prefix>:<name>") become
// "/<expanded slice>/<prefix>-<name>.scope", where a slice
// "kubepods-besteffort.slice" expands to
// "/kubepods.slice/kubepods-besteffort.slice". The result is always cleaned
// and absolute, so joining it to a root cannot escape that root.
func CgroupPath(cgroupsPath string) (string, error) {
	if !strings.HasPrefix(cgroupsPath, "/") && strings.Count(cgroupsPath, ":") == 2 {
		parts := strings.SplitN(cgroupsPath, ":", 3)
		slice, prefix, name := parts[0], parts[1], parts[2]
		if name == "" {
			return "", fmt.Errorf("%w: %q has no unit name", ErrBadCgroupPath, cgroupsPath)
		}
		parent, err := expandSlice(slice)
		if err != nil {
			return "", fmt.Errorf("%w: %q: %w", ErrBadCgroupPath, cgroupsPath, err)
		}
		// runc and crun join prefix and name with a dash even when the
		// prefix is empty ("-<name>.scope"); runc takes a name ending in
		// ".slice" as the unit itself.
		unit := name
		if !strings.HasSuffix(name, ".slice") {
			unit = prefix + "-" + name + ".scope"
		}
		if strings.Contains(unit, "/") {
			return "", fmt.Errorf("%w: %q: unit name contains '/'", ErrBadCgroupPath, cgroupsPath)
		}
		return filepath.Join(parent, unit), nil
	}
	clean := filepath.Clean("/" + cgroupsPath)
	if clean == "/" {
		return "", fmt.Errorf("%w: %q names the root cgroup", ErrBadCgroupPath, cgroupsPath)
	}
	return clean, nil
}

// expandSlice turns a systemd slice name into its cgroup directory:
// "a-b-c.slice" lives at "/a.slice/a-b.slice/a-b-c.slice". An empty slice is
// runc's default, "system.slice"; "-.slice" is the root.
func expandSlice(slice string) (string, error) {
	if slice == "" {
		slice = "system.slice"
	}
	if slice == "-.slice" {
		return "/", nil
	}
	if !strings.HasSuffix(slice, ".slice") || strings.Contains(slice, "/") {
		return "", fmt.Errorf("invalid slice %q", slice)
	}
	base := strings.TrimSuffix(slice, ".slice")
	if base == "" || strings.HasPrefix(base, "-") || strings.HasSuffix(base, "-") || strings.Contains(base, "--") {
		return "", fmt.Errorf("invalid slice %q", slice)
	}
	var b strings.Builder
	prefix := ""
	for _, comp := range strings.Split(base, "-") {
		prefix += comp
		b.WriteString("/" + prefix + ".slice")
		prefix += "-"
	}
	return b.String(), nil
}

// isCgroup2 reports whether root is a cgroup v2 (unified) mount.
func isCgroup2(root string) bool {
	st, err := os.Stat(filepath.Join(root, "cgroup.controllers"))
	return err == nil && st.Mode().IsRegular()
}

// readPopulated reads the "populated" key of a v2 cgroup.events file.
func readPopulated(path string) (bool, error) {
	data, err := readBounded(path, maxStatBytes)
	if err != nil {
		return false, err
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		key, value, ok := strings.Cut(strings.TrimSpace(sc.Text()), " ")
		if ok && key == "populated" {
			return strings.TrimSpace(value) == "1", nil
		}
	}
	return false, fmt.Errorf("%s has no populated key", path)
}

// walkPopulated reports whether dir or any cgroup below it lists a process in
// cgroup.procs other than except (0: any process counts). Past maxCgroupDirs
// it gives up with an error (doubt).
func walkPopulated(dir string, except int) (bool, error) {
	seen := 0
	populated := false
	errStop := errors.New("stop")
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil
		}
		seen++
		if seen > maxCgroupDirs {
			return fmt.Errorf("more than %d cgroups below %s", maxCgroupDirs, dir)
		}
		data, err := readBounded(filepath.Join(path, "cgroup.procs"), 1<<20)
		if err != nil {
			return err
		}
		if listsOther(data, except) {
			populated = true
			return errStop
		}
		return nil
	})
	if errors.Is(err, errStop) {
		return true, nil
	}
	return populated, err
}

// listsOther reports whether a cgroup.procs content lists a process other
// than except. A line that is not a pid counts as another process (doubt).
func listsOther(procs []byte, except int) bool {
	for _, f := range bytes.Fields(procs) {
		if pid, err := strconv.Atoi(string(f)); err != nil || except <= 0 || pid != except {
			return true
		}
	}
	return false
}

// procStat is what liveness needs from /proc/<pid>/stat.
type procStat struct {
	state byte
	start uint64
}

// ProcessCgroup returns the cgroup of pid as procRoot/<pid>/cgroup names it,
// the line PickCgroup picks. It is what a holder's cgroup is recorded as when
// its runtime named none (runc run with no cgroupsPath puts the container in
// a cgroup of its id), and what that is compared with (the runtime's own
// cgroup): both are read from the same hierarchy.
func ProcessCgroup(procRoot string, pid int) (string, error) {
	if pid <= 0 {
		return "", fmt.Errorf("invalid pid %d", pid)
	}
	path := filepath.Join(procRoot, strconv.Itoa(pid), "cgroup")
	data, err := readBounded(path, 16<<10)
	if err != nil {
		return "", err
	}
	cg := PickCgroup(data, nil)
	if cg == "" {
		return "", fmt.Errorf("pid %d: no cgroup in %s", pid, path)
	}
	return cg, nil
}

// cgroupRank orders the lines of /proc/PID/cgroup, lowest first, by how
// surely they hold a container's processes. On a cgroup v2 host there is one
// line ("0::"). On a v1 host, and on a hybrid one (v1 controllers plus the
// unified "0::" line; systemd's hybrid mode, the default of Ubuntu 20.04 and
// DGX OS 5), the v1 hierarchies come first: they carry the controllers, and
// every runtime puts a container into pids and memory (its limits), devices
// (the device cgroup is what lets it open the GPU) and name=systemd (runc's
// and crun's drivers join it, systemd tracks units in it). The unified
// hierarchy of a hybrid host carries no controller: runc's cgroupfs driver
// does not join it, so its "0::" line stays at the cgroup the runtime was
// started in (containerd's, the shim's, a login session). The first three
// are v1Controllers' first three, where Checker looks a recorded path up.
func cgroupRank(hierarchy, controllers string) int {
	if hierarchy == "0" && controllers == "" {
		return 5 // the unified hierarchy
	}
	listed := strings.Split(controllers, ",")
	for i, c := range v1Controllers[:3] {
		if slices.Contains(listed, c) {
			return i
		}
	}
	if controllers == "name=systemd" {
		return 3
	}
	return 4 // another v1 hierarchy: one a runtime may leave alone
}

// PickCgroup picks one cgroup path from a /proc/PID/cgroup document: the
// line of lowest cgroupRank (the first such line on a tie). With names (a
// test for "this path is a container's cgroup", such as the GPU observer's
// container id rule), a line it accepts is picked before any it does not, so
// a container is found in whichever hierarchy names it. "" when no line
// holds a path.
func PickCgroup(data []byte, names func(path string) bool) string {
	best, bestRank, bestNamed := "", 0, false
	for _, line := range strings.Split(string(data), "\n") {
		// hierarchy-ID:controller-list:cgroup-path; the path may hold ':'.
		parts := strings.SplitN(strings.TrimSpace(line), ":", 3)
		if len(parts) != 3 || !strings.HasPrefix(parts[2], "/") {
			continue
		}
		rank, named := cgroupRank(parts[0], parts[1]), names != nil && names(parts[2])
		better := best == "" || (named && !bestNamed) || (named == bestNamed && rank < bestRank)
		if better {
			best, bestRank, bestNamed = parts[2], rank, named
		}
	}
	return best
}

// Running reports whether the process recorded as pid with start time start
// certainly still runs: its stat is readable, it is no zombie, and it started
// at start. Any doubt (unreadable, start unknown) is false: for callers that
// spare a claim only on proof that its process lives.
func Running(procRoot string, pid int, start uint64) bool {
	if pid <= 0 || start == 0 {
		return false
	}
	st, err := readStat(procRoot, pid)
	return err == nil && st.state != 'Z' && st.state != 'X' && st.start == start
}

// PidStart returns the start time of pid (field 22 of procRoot/<pid>/stat,
// clock ticks since boot). Recorded with a pid, it tells a live holder from
// an unrelated process that got the same pid later. A missing process yields
// an error wrapping fs.ErrNotExist.
func PidStart(procRoot string, pid int) (uint64, error) {
	st, err := readStat(procRoot, pid)
	if err != nil {
		return 0, err
	}
	return st.start, nil
}

func readStat(procRoot string, pid int) (procStat, error) {
	if pid <= 0 {
		return procStat{}, fmt.Errorf("invalid pid %d", pid)
	}
	path := filepath.Join(procRoot, strconv.Itoa(pid), "stat")
	data, err := readBounded(path, maxStatBytes)
	if err != nil {
		return procStat{}, err
	}
	return parseStat(data)
}

// parseStat parses "pid (comm) state ppid ... starttime ...". comm may hold
// spaces and parentheses, so fields are counted after the last ')'.
func parseStat(data []byte) (procStat, error) {
	end := bytes.LastIndexByte(data, ')')
	if end < 0 {
		return procStat{}, errors.New("malformed stat: no command name")
	}
	fields := strings.Fields(string(data[end+1:]))
	// fields[0] is field 3 (state); starttime is field 22.
	const startIdx = 22 - 3
	if len(fields) <= startIdx || len(fields[0]) != 1 {
		return procStat{}, fmt.Errorf("malformed stat: %d fields after the command name", len(fields))
	}
	start, err := strconv.ParseUint(fields[startIdx], 10, 64)
	if err != nil {
		return procStat{}, fmt.Errorf("malformed stat: start time %q: %w", fields[startIdx], err)
	}
	return procStat{state: fields[0][0], start: start}, nil
}

// readBounded reads at most limit bytes of a (pseudo) file.
func readBounded(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path) //nolint:gosec // path is confined below a configured root
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	var buf bytes.Buffer
	if _, err := buf.ReadFrom(io.LimitReader(f, limit)); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// ClockTicks is USER_HZ, the unit of /proc/<pid>/stat's start time (and of
// the kernel's boot-relative clock as user space sees it): 100 on every
// Linux architecture the project and the NVIDIA driver support.
const ClockTicks = 100

// StartedAt returns when process pid started, by its start time in
// procRoot/<pid>/stat (clock ticks since boot) and this moment's
// CLOCK_BOOTTIME, or fallback where either cannot be read or the result is
// later than fallback. A runtime's hook timeout counts from the hook
// process's start, which a Go hook's own clock misses where it was exec'd
// into a process that ran before (the relay's fallback), and a server
// answering for another process has only this to go by.
func StartedAt(procRoot string, pid int, fallback time.Time) time.Time {
	ticks, err := PidStart(procRoot, pid)
	if err != nil {
		return fallback
	}
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return fallback
	}
	now := time.Now()
	// A start time past 2^62 ticks is no start time this clock can give.
	if ticks > 1<<62/uint64(time.Second/ClockTicks) {
		return fallback
	}
	since := time.Duration(ts.Nano()) - time.Duration(ticks)*(time.Second/ClockTicks)
	if since < 0 {
		return fallback
	}
	if start := now.Add(-since); start.Before(fallback) {
		return start
	}
	return fallback
}
