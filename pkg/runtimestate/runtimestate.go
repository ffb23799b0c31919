// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package runtimestate

import (
	"bytes"
	"encoding/json"
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
	"unicode"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// Bounds on what a scan reads.
const (
	// MaxStateBytes bounds a state file. runc's state.json embeds the
	// container's whole libcontainer config (about 35 KiB for a podman
	// container, more with a large seccomp profile); crun's status is a
	// few hundred bytes.
	MaxStateBytes = 4 << 20
	// MaxContainers bounds the entries read from one root.
	MaxContainers = 1 << 16
	// maxDirEntries bounds the entries read from one container's directory
	// (runc keeps 1 or 2 files there, crun 3 or 4).
	maxDirEntries = 64
	// maxIDLen bounds a container id (a directory name).
	maxIDLen = 1024
)

// State file names.
const (
	runcStateFile = "state.json"
	crunStateFile = "status"
	execFifo      = "exec.fifo"
)

// Runtime names, by the format of the state file found.
const (
	RuntimeRunc = "runc"
	RuntimeCrun = "crun"
)

// Status of a container as the runtime would report it.
type Status string

// Statuses. A paused container counts as running: it keeps its devices.
const (
	StatusCreated Status = "created"
	StatusRunning Status = "running"
	StatusStopped Status = "stopped"
)

// Container is one container a runtime root lists.
type Container struct {
	// Root is the runtime root it was found in; Runtime the format of its
	// state file (RuntimeRunc or RuntimeCrun).
	Root    string `json:"root"`
	Runtime string `json:"runtime"`
	ID      string `json:"id"`
	// Pid is the container's init process; PidStart its start time (clock
	// ticks since boot, as the runtime recorded it; 0 if it did not).
	Pid      int    `json:"pid"`
	PidStart uint64 `json:"pid_start,omitempty"`
	Status   Status `json:"status"`
	// Why says how the status was decided (the liveness check's words).
	Why     string    `json:"why,omitempty"`
	Bundle  string    `json:"bundle"`
	Cgroup  string    `json:"cgroup,omitempty"`
	Created time.Time `json:"created,omitzero"`
	// Spec, Request and Annotations come from the bundle's config.json, read
	// for live containers only; SpecErr says why it could not be.
	Spec        *specs.Spec       `json:"-"`
	Request     devices.Request   `json:"-"`
	Annotations map[string]string `json:"annotations,omitempty"`
	SpecErr     error             `json:"-"`
}

// Live reports whether the container is created or running: its init
// process is the one the runtime started.
func (c Container) Live() bool { return c.Status == StatusCreated || c.Status == StatusRunning }

// Problem is an entry of a root that could not be read as a container.
type Problem struct {
	Path string `json:"path"`
	Err  error  `json:"-"`
}

func (p Problem) Error() string { return p.Path + ": " + p.Err.Error() }

// MarshalJSON writes the error as text.
func (p Problem) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		Path  string `json:"path"`
		Error string `json:"error"`
	}{p.Path, p.Err.Error()})
}

// Result is what a scan found.
type Result struct {
	// Roots are the roots that exist and were read.
	Roots []string `json:"roots"`
	// Containers are sorted by start (pid start time, then creation time),
	// then root and id: the order in which they were started, as far as the
	// runtimes recorded it.
	Containers []Container `json:"containers"`
	// Creating are container directories without a state file yet: a create
	// in progress (its createRuntime hooks run before the runtime writes the
	// state), or one that failed and left its directory behind.
	Creating []string  `json:"creating,omitempty"`
	Problems []Problem `json:"problems,omitempty"`
	// Unfinished says where a scan stopped at Options.Deadline; "" when it
	// read everything. The containers past that point are not listed.
	Unfinished string `json:"unfinished,omitempty"`
}

// Live returns the live containers, in the order of Containers.
func (r *Result) Live() []Container {
	var out []Container
	for _, c := range r.Containers {
		if c.Live() {
			out = append(out, c)
		}
	}
	return out
}

// Options tune Scan.
type Options struct {
	// ProcRoot is procfs (default /proc; tests use a fake tree).
	ProcRoot string
	// Deadline, when set, stops the scan once passed (Result.Unfinished):
	// a caller that must answer by then (the NRI daemon's Synchronize)
	// learns that the list is incomplete instead of answering late.
	Deadline time.Time
	// statRoot stats an open root, for its owner (nil: (*os.File).Stat;
	// tests make it fail).
	statRoot func(*os.File) (fs.FileInfo, error)
}

// Scan lists the containers of every root. It never fails: what it cannot
// read is in Result.Problems.
func Scan(roots []string, opts Options) Result {
	var res Result
	check := liveness.New("", opts.ProcRoot)
	for _, root := range roots {
		root = filepath.Clean(root)
		if slices.Contains(res.Roots, root) {
			continue
		}
		ok := scanRoot(&res, root, check, opts)
		if ok {
			res.Roots = append(res.Roots, root)
		}
		if res.Unfinished != "" {
			break
		}
	}
	slices.SortStableFunc(res.Containers, func(a, b Container) int {
		switch {
		case a.PidStart != b.PidStart && a.PidStart != 0 && b.PidStart != 0:
			return cmpU(a.PidStart, b.PidStart)
		case !a.Created.Equal(b.Created):
			return a.Created.Compare(b.Created)
		case a.Root != b.Root:
			return strings.Compare(a.Root, b.Root)
		}
		return strings.Compare(a.ID, b.ID)
	})
	return res
}

func cmpU(a, b uint64) int {
	if a < b {
		return -1
	}
	return 1
}

// scanRoot reads one root; false when it does not exist or cannot be read.
func scanRoot(res *Result, root string, check *liveness.Checker, opts Options) bool {
	deadline := opts.Deadline
	if !filepath.IsAbs(root) {
		res.Problems = append(res.Problems, Problem{root, errors.New("not an absolute path")})
		return false
	}
	fd, err := openDir(-1, root)
	if errors.Is(err, fs.ErrNotExist) {
		return false // that runtime is not used on this host
	}
	if err != nil {
		res.Problems = append(res.Problems, Problem{root, err})
		return false
	}
	dir := os.NewFile(uintptr(fd), root)
	defer func() { _ = dir.Close() }()
	stat := opts.statRoot
	if stat == nil {
		stat = (*os.File).Stat
	}
	userNS := rootUserNS(stat(dir))
	entries, err := dir.ReadDir(MaxContainers + 1)
	if err != nil && !errors.Is(err, io.EOF) {
		res.Problems = append(res.Problems, Problem{root, fmt.Errorf("list: %w", err)})
		return false
	}
	if len(entries) > MaxContainers {
		res.Problems = append(res.Problems, Problem{root, fmt.Errorf("more than %d entries: only the first %d were read", MaxContainers, MaxContainers)})
		entries = entries[:MaxContainers]
	}
	for i, e := range entries {
		if !deadline.IsZero() && !time.Now().Before(deadline) {
			res.Unfinished = fmt.Sprintf("stopped at its deadline in %s after %d of %d entries", root, i, len(entries))
			return true
		}
		path := filepath.Join(root, e.Name())
		if err := checkName(e.Name()); err != nil {
			res.Problems = append(res.Problems, Problem{path, err})
			continue
		}
		if e.Type()&fs.ModeSymlink != 0 {
			res.Problems = append(res.Problems, Problem{path, errors.New("a symlink, not a container directory: not followed")})
			continue
		}
		if !e.IsDir() {
			res.Problems = append(res.Problems, Problem{path, fmt.Errorf("not a container directory (%s)", e.Type())})
			continue
		}
		c, found, err := readContainer(int(dir.Fd()), root, e.Name())
		switch {
		case err != nil:
			res.Problems = append(res.Problems, Problem{path, err})
			continue
		case !found:
			res.Creating = append(res.Creating, path)
			continue
		}
		decideStatus(&c, check)
		if c.Live() {
			readSpec(&c, root, opts.ProcRoot, userNS)
		}
		res.Containers = append(res.Containers, c)
	}
	return true
}

// rootUserNS tells, from the owner of a state root (fi, or err when it
// could not be read), the user namespace its runtime ran in: a root that
// root owns is a rootful runtime's; one another user owns a rootless
// runtime's (podman's under $XDG_RUNTIME_DIR), which set up no device
// cgroup for its containers. One whose owner cannot be told is either
// (hook.UnknownUserNS), as the hook takes an unreadable uid_map: its
// containers are read both ways at once.
func rootUserNS(fi fs.FileInfo, err error) hook.RuntimeUserNS {
	if err != nil {
		return hook.UnknownUserNS
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !ok:
		return hook.UnknownUserNS
	case st.Uid != 0:
		return hook.Rootless
	}
	return hook.Rootful
}

// checkName refuses directory names no runtime gives a container.
func checkName(name string) error {
	switch {
	case len(name) > maxIDLen:
		return fmt.Errorf("name longer than %d bytes: not a container id", maxIDLen)
	case strings.IndexFunc(name, func(r rune) bool { return unicode.IsControl(r) || unicode.IsSpace(r) }) >= 0:
		return fmt.Errorf("name %q holds spaces or control characters: not a container id", name)
	}
	return nil
}

// openDir opens name (relative to dirfd, or absolute with dirfd -1) as a
// directory, refusing a symlink.
func openDir(dirfd int, name string) (int, error) {
	const flags = syscall.O_RDONLY | syscall.O_DIRECTORY | syscall.O_NOFOLLOW | syscall.O_CLOEXEC
	var fd int
	var err error
	if dirfd < 0 {
		fd, err = syscall.Open(name, flags, 0)
	} else {
		fd, err = syscall.Openat(dirfd, name, flags, 0)
	}
	switch {
	case errors.Is(err, syscall.ELOOP), errors.Is(err, syscall.ENOTDIR):
		// O_NOFOLLOW on a symlink gives ELOOP; O_DIRECTORY on a file ENOTDIR.
		return -1, errors.New("a symlink or not a directory: not followed")
	case err != nil:
		return -1, err
	}
	return fd, nil
}

// readContainer reads the state file of <root>/<name>. found is false when
// the directory has none yet (a create in progress).
func readContainer(rootfd int, root, name string) (c Container, found bool, err error) {
	fd, err := openDir(rootfd, name)
	if err != nil {
		return c, false, err
	}
	dir := os.NewFile(uintptr(fd), filepath.Join(root, name))
	defer func() { _ = dir.Close() }()
	entries, err := dir.ReadDir(maxDirEntries)
	if err != nil && !errors.Is(err, io.EOF) {
		return c, false, fmt.Errorf("list: %w", err)
	}
	has := map[string]fs.FileMode{}
	for _, e := range entries {
		has[e.Name()] = e.Type()
	}
	c = Container{Root: root, ID: name}
	if _, fifo := has[execFifo]; fifo {
		c.Status = StatusCreated
	} else {
		c.Status = StatusRunning
	}
	switch {
	case hasName(has, runcStateFile):
		c.Runtime = RuntimeRunc
		data, err := readBounded(fd, runcStateFile)
		if err != nil {
			return c, false, err
		}
		if err := decodeRunc(&c, data); err != nil {
			return c, false, fmt.Errorf("%s: %w", runcStateFile, err)
		}
	case hasName(has, crunStateFile):
		c.Runtime = RuntimeCrun
		data, err := readBounded(fd, crunStateFile)
		if err != nil {
			return c, false, err
		}
		if err := decodeCrun(&c, data); err != nil {
			return c, false, fmt.Errorf("%s: %w", crunStateFile, err)
		}
	default:
		return c, false, nil
	}
	if c.Pid <= 0 {
		return c, false, fmt.Errorf("the %s state names no init pid (%d)", c.Runtime, c.Pid)
	}
	if c.Bundle == "" || !filepath.IsAbs(c.Bundle) {
		return c, false, fmt.Errorf("the %s state names no absolute bundle directory (%q)", c.Runtime, c.Bundle)
	}
	c.Bundle = filepath.Clean(c.Bundle)
	return c, true, nil
}

func hasName(has map[string]fs.FileMode, name string) bool {
	_, ok := has[name]
	return ok
}

// readBounded reads the regular file name below dirfd, at most
// MaxStateBytes, never following a symlink and never blocking on a FIFO.
func readBounded(dirfd int, name string) ([]byte, error) {
	fd, err := syscall.Openat(dirfd, name, syscall.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if errors.Is(err, syscall.ELOOP) {
		return nil, fmt.Errorf("%s is a symlink: not followed", name)
	}
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", name, err)
	}
	f := os.NewFile(uintptr(fd), name)
	defer func() { _ = f.Close() }()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("stat %s: %w", name, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file (%s)", name, fi.Mode().Type())
	}
	if fi.Size() > MaxStateBytes {
		return nil, fmt.Errorf("%s is %d bytes, more than the %d a runtime writes", name, fi.Size(), MaxStateBytes)
	}
	data, err := io.ReadAll(io.LimitReader(f, MaxStateBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	if len(data) > MaxStateBytes {
		return nil, fmt.Errorf("%s is more than %d bytes", name, MaxStateBytes)
	}
	return data, nil
}

// runcState is what is read of libcontainer's state.json.
type runcState struct {
	ID               string          `json:"id"`
	InitProcessPid   int             `json:"init_process_pid"`
	InitProcessStart json.RawMessage `json:"init_process_start"`
	Created          time.Time       `json:"created"`
	Config           struct {
		Labels  []string `json:"labels"`
		Cgroups *struct {
			Path string `json:"path"`
		} `json:"cgroups"`
	} `json:"config"`
}

func decodeRunc(c *Container, data []byte) error {
	var s runcState
	if err := json.Unmarshal(data, &s); err != nil {
		return fmt.Errorf("decode: %w", err)
	}
	if s.ID != c.ID {
		return fmt.Errorf("holds container %q, not the %q its directory is named", s.ID, c.ID)
	}
	start, err := uintField(s.InitProcessStart)
	if err != nil {
		return fmt.Errorf("init_process_start: %w", err)
	}
	c.Pid, c.PidStart, c.Created = s.InitProcessPid, start, s.Created
	for _, l := range s.Config.Labels {
		if b, ok := strings.CutPrefix(l, "bundle="); ok {
			c.Bundle = b
		}
	}
	if s.Config.Cgroups != nil {
		c.Cgroup = s.Config.Cgroups.Path
	}
	return nil
}

// uintField reads a start time written as a number (runc 1.0 and later) or
// a string (earlier); absent is 0.
func uintField(raw json.RawMessage) (uint64, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return 0, nil
	}
	s := string(raw)
	if unq, err := strconv.Unquote(s); err == nil {
		s = unq
	}
	return strconv.ParseUint(s, 10, 64)
}

// crunStatus is what is read of crun's status file.
type crunStatus struct {
	Pid              int    `json:"pid"`
	ProcessStartTime uint64 `json:"process-start-time"`
	Bundle           string `json:"bundle"`
	CgroupPath       string `json:"cgroup-path"`
	Created          string `json:"created"`
}

func decodeCrun(c *Container, data []byte) error {
	var s crunStatus
	if err := json.Unmarshal(data, &s); err != nil {
		return fmt.Errorf("decode: %w", err)
	}
	c.Pid, c.PidStart, c.Bundle, c.Cgroup = s.Pid, s.ProcessStartTime, s.Bundle, s.CgroupPath
	if s.Created != "" {
		// Informational only (ordering): a value that does not parse is
		// left zero.
		c.Created, _ = time.Parse(time.RFC3339Nano, s.Created)
	}
	return nil
}

// hookRuntime is the runtime a state file's format names (Container.Runtime),
// as RunningRequest takes it: runc's state.json is runc's, which keeps a
// bind source's nodev on a bind without flag options, and a read-write
// root's, as its hook read them; crun's status, or anything else, is read
// as crun leaves a container (both dropped), never claiming less.
func hookRuntime(runtime string) hook.Runtime {
	switch runtime {
	case RuntimeRunc:
		return hook.RuntimeRunc
	case RuntimeCrun:
		return hook.RuntimeCrun
	}
	return hook.RuntimeUnknown
}

// decideStatus checks that the init pid the runtime recorded still runs:
// gone, a zombie or reused (another start time) is stopped.
func decideStatus(c *Container, check *liveness.Checker) {
	exited, why := check.Exited(liveness.Process{Pid: c.Pid, PidStart: c.PidStart})
	c.Why = why
	if exited {
		c.Status = StatusStopped
	}
}

// readSpec reads the bundle's config.json as the OCI hook does, and what it
// reaches as the hook read it (hook.RunningRequest: what a rootless
// runtime, or one that set up no device cgroup, lets through; userNS is
// the runtime's, told by its root's owner; the runtime, told by the format
// of c's state file, decides whether a bind source's nodev and a
// read-write root's are kept, as they were for its hook: hookRuntime).
//
// A bundle "/" is crun 1.8's working directory, recorded instead of the
// bundle for a container with a user namespace and devices (the hook reads
// crun's copy of the spec for it too): /config.json is never read as its
// spec (missing, the container's claims would be forgotten; present, another
// file would be taken for its spec). crun's copy, <root>/<id>/config.json,
// is read instead (hook.ReadSpec); where it cannot be, the container
// is reported with SpecErr, unresolved.
func readSpec(c *Container, root, procRoot string, userNS hook.RuntimeUserNS) {
	spec, err := hook.ReadSpec(root, specs.State{Version: specs.Version, ID: c.ID, Pid: c.Pid, Bundle: c.Bundle})
	if err != nil {
		c.SpecErr = err
		return
	}
	if procRoot == "" {
		procRoot = liveness.DefaultProcRoot
	}
	req := devices.RequestFromSpec(spec)
	hook.RunningRequest(&req, spec, c.Bundle, procRoot, c.Pid, c.ID, userNS, hookRuntime(c.Runtime))
	c.Spec, c.Request, c.Annotations = spec, req, spec.Annotations
}
