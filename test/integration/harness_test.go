// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build integration

package integration

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// Image names. The same image serves as the pod sandbox ("pause") image,
// under the name containerd's config pins, and as every workload.
const (
	SandboxImage  = "registry.k8s.io/pause:3.10"
	WorkloadImage = "localhost/gpu-guard-test/sleeper:1"
)

const (
	// tmpPrefix names every temp dir of this suite, so that a later run can
	// find what a killed run left behind.
	tmpPrefix = "ggi-"
	// ownerFile in a temp dir records the test process that owns it.
	ownerFile = "owner"

	startTimeout = 60 * time.Second
	stopTimeout  = 20 * time.Second
	// cmdTimeout bounds every crictl/ctr/ctl invocation.
	cmdTimeout = 90 * time.Second
	// waitTimeout bounds waiting for an effect of an action (a release
	// reaching the ledger): generous, since the hosts are loaded.
	waitTimeout = 30 * time.Second
)

// Paths found by TestMain.
var (
	// RepoRoot is the repository's root directory.
	RepoRoot string
	// ToolsDir holds crictl, and one containerd-<version> dir per
	// containerd version setup.sh built.
	ToolsDir string
	// ContainerdDir holds containerd, containerd-shim-runc-v2 and ctr of
	// the version under test (Runtime).
	ContainerdDir string
	// Runtime is the containerd version under test: $CONTAINERD_VERSION,
	// or DefaultContainerdVersion.
	Runtime ContainerdVersion
	// RuncBinary, when set, is the runc containerd's runc shim runs
	// instead of the one on PATH (see prepareRunc).
	RuncBinary string
	// ImageTar is the test image (an OCI layout tar) built by setup.sh.
	ImageTar string
	// GuardBin and CtlBin are the binaries under test (make build).
	GuardBin, CtlBin string
)

func TestMain(m *testing.M) {
	os.Exit(runTests(m))
}

func runTests(m *testing.M) int {
	if err := locate(); err != nil {
		fmt.Fprintf(os.Stderr, "integration: %v\n", err)
		return 1
	}
	sweepStale()
	cleanup, err := prepareRunc()
	if err != nil {
		fmt.Fprintf(os.Stderr, "integration: %v\n", err)
		return 1
	}
	defer cleanup()
	defer removeFakeNVMLGuard()
	code := m.Run()
	if err := closeShared(); err != nil {
		fmt.Fprintf(os.Stderr, "integration: tearing down the shared containerd: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	return code
}

// locate finds the tools, the image and the binaries, and explains how to
// get them when one is missing.
func locate() error {
	if os.Geteuid() != 0 {
		return errors.New("the end-to-end tests run containerd and need root")
	}
	wd, err := os.Getwd()
	if err != nil {
		return err
	}
	RepoRoot = filepath.Clean(filepath.Join(wd, "..", ".."))
	if _, err := os.Stat(filepath.Join(RepoRoot, "go.mod")); err != nil {
		return fmt.Errorf("cannot find the repository root from %s: %w", wd, err)
	}
	cache := os.Getenv("NRI_GPU_GUARD_CACHE")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return err
		}
		cache = filepath.Join(home, ".cache", "nri-gpu-guard")
	}
	ToolsDir = os.Getenv("TOOLS_DIR")
	if ToolsDir == "" {
		ToolsDir = filepath.Join(cache, "tools")
	}
	Runtime, err = runtimeUnderTest()
	if err != nil {
		return err
	}
	ContainerdDir = filepath.Join(ToolsDir, "containerd-"+Runtime.String())
	ImageTar = filepath.Join(cache, "images", "gpu-guard-test.tar")
	GuardBin = filepath.Join(RepoRoot, "bin", "nri-gpu-guard")
	CtlBin = filepath.Join(RepoRoot, "bin", "gpu-guard-ctl")
	var missing []string
	for _, p := range []string{
		filepath.Join(ContainerdDir, "containerd"), filepath.Join(ContainerdDir, "containerd-shim-runc-v2"),
		filepath.Join(ContainerdDir, "ctr"), filepath.Join(ToolsDir, "crictl"), ImageTar,
	} {
		if _, err := os.Stat(p); err != nil {
			missing = append(missing, p)
		}
	}
	if _, err := exec.LookPath("runc"); err != nil {
		missing = append(missing, "runc (on PATH)")
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing %s: run CONTAINERD_VERSION=%s ./test/integration/setup.sh as root (or `make integration CONTAINERD_VERSION=%[2]s`)", strings.Join(missing, ", "), Runtime)
	}
	for _, p := range []string{GuardBin, CtlBin} {
		if _, err := os.Stat(p); err != nil {
			return fmt.Errorf("missing %s: run `make build` (or `make integration`)", p)
		}
	}
	return nil
}

// tmpBase is where temp dirs go: /tmp unless TMPDIR is short enough for the
// sockets inside (containerd's shim and NRI sockets are unix sockets).
func tmpBase() string {
	if d := os.TempDir(); len(d) <= 20 {
		return d
	}
	return "/tmp"
}

// newTempDir makes a ggi-* dir and records this process as its owner.
func newTempDir() (string, error) {
	dir, err := os.MkdirTemp(tmpBase(), tmpPrefix)
	if err != nil {
		return "", err
	}
	start, err := procStartTime(os.Getpid())
	if err != nil {
		return "", err
	}
	owner := fmt.Sprintf("%d %d\n", os.Getpid(), start)
	if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(owner), 0o600); err != nil {
		return "", err
	}
	return dir, nil
}

// procStartTime is field 22 of /proc/PID/stat: with the pid, it identifies a
// process across pid reuse.
func procStartTime(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name (field 2) may hold spaces; it ends at the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	return strconv.ParseUint(f[19], 10, 64)
}

// sweepStale removes what earlier runs left behind when they were killed
// before their teardown: temp dirs whose owner process is gone.
func sweepStale() {
	dirs, _ := filepath.Glob(filepath.Join(tmpBase(), tmpPrefix+"*"))
	for _, dir := range dirs {
		b, err := os.ReadFile(filepath.Join(dir, ownerFile))
		if err == nil {
			var pid int
			var start uint64
			if _, err := fmt.Sscanf(string(b), "%d %d", &pid, &start); err == nil {
				if s, err := procStartTime(pid); err == nil && s == start {
					continue // its run is still going
				}
			}
		}
		if err := sweep(dir); err != nil {
			fmt.Fprintf(os.Stderr, "integration: cleaning up %s left by an earlier run: %v\n", dir, err)
		} else {
			fmt.Fprintf(os.Stderr, "integration: cleaned up %s left by an earlier run\n", dir)
		}
	}
}

// sweep kills every process still running from dir (its binary or an
// argument lies under dir: a daemon, shims, launched plugins; or it runs in
// the cgroup of a container whose task state is under dir), removes those
// containers' runc state and cgroups, unmounts everything mounted under dir
// and removes it.
func sweep(dir string) error {
	var errs []error
	tasks := containerTasks(dir)
	for round := 0; round < 5; round++ {
		procs := append(processesUnder(dir), processesInCgroups(tasks)...)
		if len(procs) == 0 {
			break
		}
		for _, pid := range procs {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		// Reaped by their parents (or init): wait until they are gone.
		_ = poll(5*time.Second, func() (bool, error) {
			for _, pid := range procs {
				if processExists(pid) {
					return false, nil
				}
			}
			return true, nil
		})
	}
	if left := append(processesUnder(dir), processesInCgroups(tasks)...); len(left) > 0 {
		errs = append(errs, fmt.Errorf("processes %v still run from %s", left, dir))
	}
	for _, task := range tasks {
		removeTaskLeftovers(task)
	}
	if err := unmountUnder(dir); err != nil {
		errs = append(errs, err)
	}
	if err := os.RemoveAll(dir); err != nil {
		errs = append(errs, err)
	}
	// The plugin's and the hooks' ledgers below dir are gone: so are their
	// boot markers in the host's runtime dir.
	if _, err := ledger.RemoveMarkersUnder(ledger.DefaultRuntimeDir, dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// processesUnder lists the pids (other than this process) whose executable
// or command line refers to dir. Zombies are skipped: they are gone already.
// (A container's /proc/PID/root is relative to its own mount namespace and
// does not show dir: processesInCgroups finds those.)
func processesUnder(dir string) []int {
	prefix := dir + string(filepath.Separator)
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		if !processExists(pid) {
			continue
		}
		proc := "/proc/" + e.Name()
		match := false
		if p, err := os.Readlink(proc + "/exe"); err == nil && strings.HasPrefix(p, prefix) {
			match = true
		}
		if cmd, err := os.ReadFile(proc + "/cmdline"); err == nil {
			for _, arg := range strings.Split(string(cmd), "\x00") {
				if strings.Contains(arg, prefix) || arg == dir {
					match = true
				}
			}
		}
		if match {
			pids = append(pids, pid)
		}
	}
	return pids
}

// containerTask is a container (or sandbox) whose runtime task state
// containerd keeps under its state dir.
type containerTask struct{ namespace, id string }

// containerTasks lists the tasks under dir's containerd state: those that
// a crashed run may have left running.
func containerTasks(dir string) []containerTask {
	base := filepath.Join(dir, "state", "io.containerd.runtime.v2.task")
	nss, _ := os.ReadDir(base)
	var tasks []containerTask
	for _, ns := range nss {
		ids, _ := os.ReadDir(filepath.Join(base, ns.Name()))
		for _, id := range ids {
			tasks = append(tasks, containerTask{namespace: ns.Name(), id: id.Name()})
		}
	}
	return tasks
}

// processesInCgroups lists the processes in the cgroup of any of tasks (the
// cgroupfs layout containerd uses without systemd: /<namespace>/<id>). This
// finds a container's processes even after its shim died: they live in
// their own pid and mount namespaces, and nothing else points at dir.
func processesInCgroups(tasks []containerTask) []int {
	if len(tasks) == 0 {
		return nil
	}
	paths := map[string]bool{}
	for _, task := range tasks {
		paths["/"+task.namespace+"/"+task.id] = true
	}
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() || !processExists(pid) {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cgroup")
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			// hierarchy-id:controllers:path
			if parts := strings.SplitN(line, ":", 3); len(parts) == 3 && paths[parts[2]] {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids
}

// removeTaskLeftovers removes what runc keeps outside dir for a container
// that was never deleted: its state under runc's default root and its
// (now empty) cgroups.
func removeTaskLeftovers(task containerTask) {
	_ = os.RemoveAll(filepath.Join("/run/containerd/runc", task.namespace, task.id))
	cgroups, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", task.namespace, task.id))
	cgroups = append(cgroups, filepath.Join("/sys/fs/cgroup", task.namespace, task.id))
	for _, cg := range cgroups {
		_ = syscall.Rmdir(cg)
	}
}

// processExists reports whether pid is a process that has not exited
// (a zombie counts as exited).
func processExists(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	return i < 0 || i+2 >= len(b) || b[i+2] != 'Z'
}

// unmountUnder detaches every mount point below dir, deepest first (overlay
// rootfs and shm mounts of sandboxes a killed containerd left behind).
func unmountUnder(dir string) error {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	prefix := dir + "/"
	var points []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		p := unescapeMountPath(fields[4])
		if strings.HasPrefix(p, prefix) {
			points = append(points, p)
		}
	}
	slices.SortFunc(points, func(a, b string) int { return len(b) - len(a) })
	var errs []error
	for _, p := range points {
		if err := syscall.Unmount(p, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", p, err))
		}
	}
	return errors.Join(errs...)
}

// unescapeMountPath undoes mountinfo's octal escapes (\040 for a space).
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// poll calls cond every 50ms until it reports true, returns an error, or
// timeout passes. It is how the tests wait: on a condition, never a fixed
// sleep.
func poll(timeout time.Duration, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		ok, err := cond()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("still not true after %s", timeout)
		}
		<-tick.C
	}
}

// waitFor polls cond until it holds; on timeout the test fails with what and
// the last state cond described.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	var last string
	err := poll(timeout, func() (bool, error) {
		ok, state := cond()
		last = state
		return ok, nil
	})
	if err != nil {
		t.Fatalf("waiting for %s: %v; last state: %s", what, err, last)
	}
}

// process is a daemon started by the harness, known by its pid.
type process struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	done    chan struct{}
	err     error // set before done is closed
}

// startProcess starts bin with args, appending its stdout and stderr to
// logPath. The child gets its own process group (a ^C to the test does not
// reach it first) and is killed if the test process dies.
func startProcess(name, logPath string, env []string, bin string, args ...string) (*process, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	_, _ = fmt.Fprintf(logf, "=== harness: %s starting at %s: %s %s\n", name, time.Now().UTC().Format(time.RFC3339Nano), bin, strings.Join(args, " "))
	cmd := exec.Command(bin, args...)
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &process{name: name, cmd: cmd, logPath: logPath, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		_ = logf.Close()
		close(p.done)
	}()
	return p, nil
}

// Pid is the process id.
func (p *process) Pid() int { return p.cmd.Process.Pid }

// exited reports whether the process has ended, and how.
func (p *process) exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.err
	default:
		return false, nil
	}
}

// signal sends sig to the process (by its pid) unless it has ended.
func (p *process) signal(sig syscall.Signal) error {
	if ok, _ := p.exited(); ok {
		return nil
	}
	return p.cmd.Process.Signal(sig)
}

// wait waits up to timeout for the process to end.
func (p *process) wait(timeout time.Duration) error {
	select {
	case <-p.done:
		return nil
	case <-time.After(timeout):
		return fmt.Errorf("%s (pid %d) still runs after %s", p.name, p.Pid(), timeout)
	}
}

// stop ends the process: SIGTERM, then SIGKILL after grace.
func (p *process) stop(grace time.Duration) error {
	if err := p.signal(syscall.SIGTERM); err != nil {
		return err
	}
	if err := p.wait(grace); err == nil {
		return nil
	}
	if err := p.signal(syscall.SIGKILL); err != nil {
		return err
	}
	return p.wait(grace)
}

// kill ends the process with SIGKILL (a crash) and waits until it is gone.
func (p *process) kill() error {
	if err := p.signal(syscall.SIGKILL); err != nil {
		return err
	}
	return p.wait(stopTimeout)
}

// exitError describes how a process ended: its wait error, or a clean
// exit (which is no less unexpected for a daemon).
func exitError(err error) error {
	if err == nil {
		return errors.New("exit status 0")
	}
	return err
}

// logTail returns the last n lines of a log file, for failure reports.
func logTail(path string, from int64, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(%v)", err)
	}
	defer func() { _ = f.Close() }()
	if from > 0 {
		if _, err := f.Seek(from, io.SeekStart); err != nil {
			return fmt.Sprintf("(%v)", err)
		}
	}
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > n {
			lines = lines[1:]
		}
	}
	return strings.Join(lines, "\n")
}

// fileSize is the current size of path (0 if it does not exist): log
// offsets, so that a failure shows only what the failing test logged.
func fileSize(path string) int64 {
	st, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return st.Size()
}

// shared is the containerd that tests which do not restart or reconfigure
// containerd share (each with its own plugin process and ledger).
var shared struct {
	once sync.Once
	c    *Containerd
	err  error
}

// SharedContainerd returns the suite's shared containerd, starting it on
// first use; TestMain tears it down. Tests using it must leave no pods behind
// (NewGuardEnv's cleanup removes them) and must not restart it.
func SharedContainerd(t testing.TB) *Containerd {
	t.Helper()
	shared.once.Do(func() {
		shared.c, shared.err = NewContainerd(ContainerdOptions{})
	})
	if shared.err != nil {
		t.Fatalf("shared containerd: %v", shared.err)
	}
	return shared.c
}

func closeShared() error {
	if shared.c == nil {
		return nil
	}
	return shared.c.Close()
}

// prepareRunc sets RuncBinary where runc cannot run the suite's containers
// as they are: on a cgroup v2 view of a hybrid host (cgroup2.sh) the cpu
// controller stays bound to cgroup v1, and runc fails writing cpu.weight for
// the CRI sandbox's default CPU shares. There a small wrapper
// (testdata/runcwrap) drops the CPU resources from the spec and runs runc.
func prepareRunc() (cleanup func(), err error) {
	if cgroupMode() != "v2" {
		return func() {}, nil
	}
	ctrls, err := os.ReadFile("/sys/fs/cgroup/cgroup.controllers")
	if err != nil {
		return nil, err
	}
	if slices.Contains(strings.Fields(string(ctrls)), "cpu") {
		return func() {}, nil
	}
	dir, err := os.MkdirTemp(tmpBase(), "gg-runc-")
	if err != nil {
		return nil, err
	}
	cleanup = func() { _ = os.RemoveAll(dir) }
	bin := filepath.Join(dir, "runc")
	cmd := exec.Command("go", "build", "-o", bin, "./testdata/runcwrap")
	cmd.Dir = filepath.Join(RepoRoot, "test", "integration")
	if out, err := cmd.CombinedOutput(); err != nil {
		cleanup()
		return nil, fmt.Errorf("building the runc wrapper: %w: %s", err, out)
	}
	fmt.Fprintf(os.Stderr, "integration: cgroup v2 without the cpu controller (%s): containers run through %s, which drops their CPU resources\n",
		strings.TrimSpace(string(ctrls)), bin)
	RuncBinary = bin
	return cleanup, nil
}
