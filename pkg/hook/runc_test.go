// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

// Acceptance tests with the real runc: containers whose config.json runs the
// real `nri-gpu-guard-hook …` binary as createRuntime and poststop hooks,
// over a static 4-GPU inventory and a temporary ledger. They need root and
// runc; they are skipped (with the reason) elsewhere.
//
// Synchronisation is on conditions only: files the container program writes,
// process exits and ledger state, each waited for with a deadline.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
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

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/syncbuf"
	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testtmp"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// condTimeout bounds every wait for a condition. Generous: the machine may be
// loaded; a passing run takes milliseconds per wait.
const condTimeout = 60 * time.Second

// gpuUUIDs are the static inventory of every rig: GPU i has minor i.
var gpuUUIDs = []string{
	"GPU-6c1a2f2e-0000-4000-8000-000000000000",
	"GPU-6c1a2f2e-0000-4000-8000-000000000001",
	"GPU-6c1a2f2e-0000-4000-8000-000000000002",
	"GPU-6c1a2f2e-0000-4000-8000-000000000003",
}

// Built once, by the first test that needs them (unit tests do not pay for
// the builds).
var (
	prepareOnce sync.Once
	binDir      string // removed by TestMain
	hookBin     string // the nri-gpu-guard-hook binary
	ctrProg     string // the static container program
	relayBin    string // nri-gpu-guard-hook-relay, built with the C compiler
	runcBin     string
	setupSkip   string // why runc tests cannot run here
	setupErr    error  // why the binaries could not be built
	// relaySkip says why no relay could be built here (no C compiler), and
	// relayErr why its build failed: only relay rigs need it.
	relaySkip string
	relayErr  error
)

// relayEnv set to a true value (NRI_GPU_GUARD_TEST_RELAY=1) makes every rig
// a relay rig (rigOpts.relay) unless it asks for the Go hook
// (rigOpts.direct): the whole runc suite then runs its hooks through the
// relay and the hook server.
const relayEnv = "NRI_GPU_GUARD_TEST_RELAY"

func TestMain(m *testing.M) {
	flag.Parse()
	// The tests that run the hook in this process keep their container
	// markers in a dir of their own; the hook binaries the runc tests run
	// use the host's, swept below.
	dir, err := os.MkdirTemp("", "hkmarkers")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	markerDir = filepath.Join(dir, "m")
	os.Exit(testtmp.Main(m, func() {
		if binDir != "" {
			_ = os.RemoveAll(binDir)
		}
		_ = os.RemoveAll(dir)
		// TMPDIR is still the tests' root here.
		if _, err := RemoveMarkersUnder(DefaultMarkerDir, os.TempDir()); err != nil {
			fmt.Fprintln(os.Stderr, err)
		}
	}))
}

// prepareRunc finds runc and builds the two binaries the runc tests use.
func prepareRunc() {
	switch {
	case os.Geteuid() != 0:
		setupSkip = "runc tests need root"
		return
	case testing.Short():
		setupSkip = "runc tests skipped in -short mode"
		return
	}
	for _, p := range []string{"/usr/sbin/runc", "/usr/bin/runc", "/usr/local/sbin/runc", "/usr/local/bin/runc"} {
		if _, err := os.Stat(p); err == nil {
			runcBin = p
			break
		}
	}
	if runcBin == "" {
		if p, err := exec.LookPath("runc"); err == nil {
			runcBin = p
		} else {
			setupSkip = "runc not installed"
			return
		}
	}
	dir, err := os.MkdirTemp("", "hkbin")
	if err != nil {
		setupErr = err
		return
	}
	binDir = dir
	goBin, err := exec.LookPath("go")
	if err != nil {
		setupErr = fmt.Errorf("the runc tests build the hook binary and need the go command in PATH: %w", err)
		return
	}
	root, err := moduleRoot()
	if err != nil {
		setupErr = err
		return
	}
	hookBin = filepath.Join(dir, "nri-gpu-guard-hook")
	ctrProg = filepath.Join(dir, "ctrprog")
	builds := []struct {
		out, pkg string
		env      []string
	}{
		{hookBin, "./cmd/nri-gpu-guard-hook", []string{"CGO_ENABLED=0"}}, // as the release builds it
		{ctrProg, "./pkg/hook/testdata/ctrprog", []string{"CGO_ENABLED=0"}},
	}
	for _, b := range builds {
		cmd := exec.Command(goBin, "build", "-tags", "nri_no_wasm", "-trimpath", "-ldflags=-s -w", "-o", b.out, b.pkg)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), b.env...)
		if out, err := cmd.CombinedOutput(); err != nil {
			setupErr = fmt.Errorf("go build %s: %w\n%s", b.pkg, err, out)
			return
		}
	}
	relayBin = filepath.Join(dir, "nri-gpu-guard-hook-relay")
	relaySkip, relayErr = buildRelay(root, relayBin)
}

// buildRelay builds cmd/nri-gpu-guard-hook-relay as the release does: a
// static C program, warnings as errors, with the compiler `make build`
// picks (defines: -D options, e.g. another default socket). It returns why it could not try (no compiler), or the build's
// error.
func buildRelay(root, out string, defines ...string) (skip string, err error) {
	// The compiler `make build` uses: RELAY_CC, else musl-gcc where
	// installed, else $CC or cc.
	cc := os.Getenv("RELAY_CC")
	if cc == "" {
		if p, err := exec.LookPath("musl-gcc"); err == nil {
			cc = p
		} else if cc = os.Getenv("CC"); cc == "" {
			cc = "cc"
		}
	}
	if _, err := exec.LookPath(cc); err != nil {
		return fmt.Sprintf("no C compiler to build the hook relay (%s): %v", cc, err), nil
	}
	src := filepath.Join(root, "cmd", "nri-gpu-guard-hook-relay", "relay.c")
	cmd := exec.Command(cc, append(append([]string{"-O2", "-static", "-Wall", "-Wextra", "-Werror"}, defines...), "-o", out, src)...)
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("%s -static %s: %w\n%s", cc, src, err, b)
	}
	return "", nil
}

func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("go.mod not found above the test directory")
		}
		dir = parent
	}
}

// rig is one host: a runc root, a ledger, configurations, a shared rootfs
// holding the container program, and a directory bind-mounted into every
// container at /shared.
type rig struct {
	t        testing.TB
	base     string
	runcRoot string
	rootfs   string
	shared   string
	cfg      config.Config
	cfgPath  string // the default configuration (long wait_timeout)
	// noPoststop: the host installs the createRuntime hook alone
	// (rigOpts.noPoststop).
	noPoststop bool
	// relay: the containers' hooks are the relay (rigOpts.relay), which
	// forwards to the rig's hook server on sock; relayBin is the relay
	// program their hooks name (BenchmarkRuncHook names an installed copy).
	relay    bool
	relayBin string
	sock     string

	mu     sync.Mutex
	ctrs   []*ctr
	server *hookServer
}

// hookServer is a `nri-gpu-guard-hook serve` the rig started.
type hookServer struct {
	cmd  *exec.Cmd
	log  *syncBuffer // its stdout and stderr: one line per fallback or error
	done chan struct{}
	err  error
	// stopped: the test stopped it (stopServer); otherwise an exit before
	// the rig's cleanup is a failure.
	stopped bool
}

type rigOpts struct {
	waitTimeout time.Duration
	// noPoststop makes the rig a host that installs the createRuntime hook
	// alone: its configurations say [hook] poststop = false and no
	// container of it gets a poststop hook.
	noPoststop bool
	// relay makes the containers' hooks nri-gpu-guard-hook-relay (in front
	// of the Go hook, which it runs when the server cannot answer) and
	// starts `nri-gpu-guard-hook serve` on <base>/hook.sock for the rig's
	// life. NRI_GPU_GUARD_TEST_RELAY=1 sets it for every rig not direct.
	relay bool
	// direct keeps the Go hook as the containers' hooks whatever
	// NRI_GPU_GUARD_TEST_RELAY says (a relay-mode test's direct baseline).
	direct bool
	// noServer: a relay rig whose server is never started (its socket does
	// not exist), so that every relay falls back.
	noServer bool
}

// relayByEnv tells whether NRI_GPU_GUARD_TEST_RELAY asks for relay rigs.
func relayByEnv(t testing.TB) bool {
	v := os.Getenv(relayEnv)
	if v == "" {
		return false
	}
	on, err := strconv.ParseBool(v)
	if err != nil {
		t.Fatalf("%s=%q: want 1 or 0", relayEnv, v)
	}
	return on
}

func newRig(t testing.TB, o rigOpts) *rig {
	t.Helper()
	prepareOnce.Do(prepareRunc)
	if setupSkip != "" {
		t.Skip(setupSkip)
	}
	require.NoError(t, setupErr)
	// Short paths: runc keeps sockets and state under its root.
	base, err := os.MkdirTemp("", "hk")
	require.NoError(t, err)
	r := &rig{
		t:        t,
		base:     base,
		runcRoot: filepath.Join(base, "r"),
		rootfs:   filepath.Join(base, "rootfs"),
		shared:   filepath.Join(base, "shared"),

		noPoststop: o.noPoststop,
		relay:      o.relay || o.noServer || !o.direct && relayByEnv(t),
		relayBin:   relayBin,
		sock:       filepath.Join(base, "hook.sock"),
	}
	if r.relay {
		if relaySkip != "" {
			_ = os.RemoveAll(base)
			t.Skip(relaySkip)
		}
		if relayErr != nil {
			_ = os.RemoveAll(base)
			require.NoError(t, relayErr)
		}
	}
	t.Cleanup(r.cleanup)
	for _, d := range []string{r.runcRoot, r.shared, filepath.Join(r.rootfs, "proc"), filepath.Join(r.rootfs, "dev"),
		filepath.Join(r.rootfs, "shared"), filepath.Join(base, "b")} {
		require.NoError(t, os.MkdirAll(d, 0o755))
	}
	prog, err := os.ReadFile(ctrProg)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(r.rootfs, "ctrprog"), prog, 0o755))
	// The rootfs is mounted nodev, as container storage should be: the
	// hook reads the rig's containers as having no device cgroup (their
	// cgroups do not bear runc's names), where a root filesystem without
	// nodev counts as opening every GPU (a node its image may carry). runc
	// keeps that nodev for a read-write root (rig.bundle); crun never does,
	// so a crun container of the rig claims every GPU.
	mountT(t, r.rootfs, r.rootfs, "", unix.MS_NODEV)

	if o.waitTimeout == 0 {
		o.waitTimeout = 2 * time.Minute
	}
	r.cfg = r.config(o.waitTimeout)
	r.cfgPath = r.writeConfig("config.toml", r.cfg)
	if r.relay && !o.noServer {
		r.startServer()
	}
	return r
}

// startServer starts `nri-gpu-guard-hook serve --socket <base>/hook.sock`
// as a child of the test and returns once it said it listens (its first
// line, which the log does not keep). r.cleanup stops it (SIGTERM), after
// the containers are gone.
func (r *rig) startServer() {
	r.t.Helper()
	s := &hookServer{log: &syncBuffer{}, done: make(chan struct{})}
	s.cmd = exec.Command(hookBin, "serve", "--socket", r.sock)
	// As packaging/systemd/nri-gpu-guard-hook.service runs it.
	s.cmd.Env = append(os.Environ(), "GOMAXPROCS=1")
	s.cmd.Stdout = s.log
	pipe, err := s.cmd.StderrPipe()
	require.NoError(r.t, err)
	require.NoError(r.t, s.cmd.Start())
	lines := bufio.NewReader(pipe)
	first, readErr := lines.ReadString('\n')
	go func() {
		// Read to EOF (the server's exit) before Wait, as StderrPipe asks.
		_, _ = io.Copy(s.log, lines)
		s.err = s.cmd.Wait()
		close(s.done)
	}()
	r.mu.Lock()
	r.server = s
	r.mu.Unlock()
	if readErr != nil {
		<-s.done
		r.t.Fatalf("the hook server exited before it listened on %s: %v\n%s%s", r.sock, s.err, first, s.log.String())
	}
	require.Equal(r.t, "nri-gpu-guard-hook serve: listening on "+r.sock+"\n", first)
}

// stopServer sends the rig's hook server sig and waits for it to exit; it
// returns what the server logged. SIGKILL leaves its socket file behind
// (a connect is refused), SIGTERM removes it.
func (r *rig) stopServer(sig syscall.Signal) string {
	r.t.Helper()
	r.mu.Lock()
	s := r.server
	r.mu.Unlock()
	require.NotNil(r.t, s, "the rig has no hook server")
	r.mu.Lock()
	s.stopped = true
	r.mu.Unlock()
	_ = s.cmd.Process.Signal(sig)
	select {
	case <-s.done:
	case <-time.After(condTimeout):
		_ = s.cmd.Process.Kill()
		<-s.done
		r.t.Fatalf("the hook server did not exit within %s of %v\n%s", condTimeout, sig, s.log.String())
	}
	return s.log.String()
}

// killRelays kills (SIGKILL) every relay process still running with this
// rig's socket: those whose runc is gone.
func (r *rig) killRelays() {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return
	}
	mark := []byte("\x00--relay-socket=" + r.sock + "\x00")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && bytes.HasPrefix(cmdline, []byte("nri-gpu-guard-hook-relay\x00")) && bytes.Contains(cmdline, mark) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// serverLog is what the rig's hook server logged so far: one line per
// relay it told to fall back and per error, nothing per answered request.
func (r *rig) serverLog() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.server == nil {
		return ""
	}
	return r.server.log.String()
}

// config is the rig's configuration: a static inventory of gpuUUIDs, the
// rig's ledger, a short poll interval and the given wait timeout.
func (r *rig) config(waitTimeout time.Duration) config.Config {
	cfg := config.Default()
	cfg.Ledger.Dir = filepath.Join(r.base, "ledger")
	cfg.Ledger.LockTimeout = config.Duration{Duration: 5 * time.Second}
	cfg.Devices.Source = config.SourceStatic
	cfg.Devices.ProcRoot = r.base // fake GPUs: no driver tree to check the list against
	cfg.Devices.Static = nil
	for i, u := range gpuUUIDs {
		cfg.Devices.Static = append(cfg.Devices.Static, config.StaticGPU{Index: i, UUID: u, Minor: i, Model: "Fake GPU"})
	}
	cfg.Hook.PollInterval = config.Duration{Duration: 20 * time.Millisecond}
	cfg.Hook.WaitTimeout = config.Duration{Duration: waitTimeout}
	cfg.Hook.Poststop = !r.noPoststop
	return cfg
}

func (r *rig) writeConfig(name string, cfg config.Config) string {
	var b strings.Builder
	fmt.Fprintf(&b, "version = 1\n[ledger]\ndir = %q\nlock_timeout = %q\n", cfg.Ledger.Dir, cfg.Ledger.LockTimeout.Duration)
	fmt.Fprintf(&b, "[devices]\nsource = %q\nproc_root = %q\n", cfg.Devices.Source, cfg.Devices.ProcRoot)
	for _, g := range cfg.Devices.Static {
		fmt.Fprintf(&b, "[[devices.static]]\nindex = %d\nuuid = %q\nminor = %d\nmodel = %q\n", g.Index, g.UUID, g.Minor, g.Model)
	}
	fmt.Fprintf(&b, "[hook]\nwait_timeout = %q\npoll_interval = %q\n", cfg.Hook.WaitTimeout.Duration, cfg.Hook.PollInterval.Duration)
	if !cfg.Hook.Poststop {
		b.WriteString("poststop = false\n")
	}
	path := filepath.Join(r.base, name)
	require.NoError(r.t, os.WriteFile(path, []byte(b.String()), 0o600))
	// The file must say what the rig believes it says.
	got, err := config.LoadFile(path)
	require.NoError(r.t, err)
	require.Equal(r.t, cfg.Hook, got.Hook)
	require.Equal(r.t, cfg.Devices, got.Devices)
	require.Equal(r.t, cfg.Ledger.Dir, got.Ledger.Dir)
	return path
}

// ctrOpts describe one container.
type ctrOpts struct {
	env      []string // e.g. NVIDIA_VISIBLE_DEVICES=1
	mode     string   // "wait" (default) or "exit"
	cfgPath  string   // hook configuration; "" = the rig's
	noHooks  bool
	detached bool
	// hookBin replaces the hook binary in both hooks (BenchmarkRuncHook's
	// floor: a program that only reads its stdin), and the relay of a relay
	// rig: the hooks name it directly.
	hookBin string
	// direct gives the container the Go hook (hookBin) in a relay rig.
	direct bool
	// relayHook is the Go hook a relay runs when the server cannot answer
	// (--relay-hook; default: hookBin). A path that does not exist makes
	// every fallback fail (exit 1, the container refused), so that a
	// container admitted was answered by the server.
	relayHook string
	// noWait runs the create-runtime hook without --wait (the default of the
	// shipped hooks.d file): it refuses a busy GPU at once.
	noWait bool
	// hookArgs are appended to both hooks' arguments (BenchmarkRuncHook's
	// durable floor: --state-dir DIR).
	hookArgs []string
	// inheritEnv gives the hooks no environment of their own: runc runs them
	// with its own (BenchmarkRuncHook's floors, as a definition without
	// "env" would). Otherwise they get the one the shipped hook definitions
	// set (RuntimeEnv).
	inheritEnv bool
	// noPoststop gives the container the create-runtime hook only (the
	// one-hook configuration: its claim ends at the next request that
	// finds its processes gone).
	noPoststop bool
	// optIn carries the annotation that opts a container into the poststop
	// on a one-hook host (PoststopAnnotation) and gives it the poststop, as
	// the shipped mask does.
	optIn bool
	// mounts are added to the spec's after the rig's own.
	mounts []specs.Mount
	// readonlyRoot gives the container a read-only root (root.readonly),
	// whose nodev runc drops: the hook then counts it as reaching every
	// GPU (the rig's containers have no device cgroup it knows).
	readonlyRoot bool
	// userNS gives the container a user namespace of its own, mapped to
	// root's own ids (its root reaches the rig's private directories).
	userNS bool
	// runtime runs the container with this program in runc's place, given
	// runc's arguments, RUNC_GPU_GUARD_RUNC naming runc and runtimeEnv
	// (docs/hook.md's wrapper, which adds the hooks itself: the bundle
	// gets none).
	runtime    string
	runtimeEnv []string
}

// ctr is one `runc run` of the rig.
type ctr struct {
	r    *rig
	id   string
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{}
	err  error
}

// syncBuffer is the tests' shared output buffer (internal/syncbuf).
type syncBuffer = syncbuf.Buffer

// bundle writes <base>/b/<id>/config.json for a container running the
// container program as name id.
func (r *rig) bundle(id string, o ctrOpts) string {
	mode := o.mode
	if mode == "" {
		mode = "wait"
	}
	cfgPath := o.cfgPath
	if cfgPath == "" {
		cfgPath = r.cfgPath
	}
	caps := []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL"}
	spec := specs.Spec{
		Version: specs.Version,
		// Read-write unless asked: runc 1.1.5 keeps the nodev of the rig's
		// rootfs mount only for a read-write root (a read-only one it
		// remounts MS_RDONLY alone), and the hook knows it.
		Root: &specs.Root{Path: r.rootfs, Readonly: o.readonlyRoot},
		Process: &specs.Process{
			Args: []string{"/ctrprog", "/shared", id, mode},
			Env:  append([]string{"PATH=/"}, o.env...),
			Cwd:  "/",
			Capabilities: &specs.LinuxCapabilities{
				Bounding: caps, Effective: caps, Permitted: caps,
			},
			NoNewPrivileges: true,
		},
		Hostname: id,
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			// nodev: the hook reads the rig's containers as having no
			// device cgroup, where a directory bound in whose nodes open
			// counts as opening every GPU (a node it may hold).
			{Destination: "/shared", Type: "bind", Source: r.shared, Options: []string{"rbind", "rw", "nodev"}},
		},
		Linux: &specs.Linux{
			CgroupsPath: "/" + r.cgroupName(id),
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace}, {Type: specs.MountNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
			},
		},
		Annotations: map[string]string{"test": "nri-gpu-guard"},
	}
	spec.Mounts = append(spec.Mounts, o.mounts...)
	if o.userNS {
		l := spec.Linux
		l.Namespaces = append(l.Namespaces, specs.LinuxNamespace{Type: specs.UserNamespace})
		l.UIDMappings = []specs.LinuxIDMapping{{ContainerID: 0, HostID: 0, Size: 65536}}
		l.GIDMappings = []specs.LinuxIDMapping{{ContainerID: 0, HostID: 0, Size: 65536}}
	}
	if !o.noHooks && o.runtime == "" {
		// argv[0] and what comes before the phase: the Go hook's name, or
		// the relay's name and its options.
		bin, head := hookBin, []string{"nri-gpu-guard-hook"}
		switch {
		case o.hookBin != "":
			bin = o.hookBin
		case r.relay && !o.direct:
			fallback := hookBin
			if o.relayHook != "" {
				fallback = o.relayHook
			}
			bin = r.relayBin
			head = []string{"nri-gpu-guard-hook-relay", "--relay-socket=" + r.sock, "--relay-hook=" + fallback}
		}
		createArgs := append(slices.Clone(head), PhaseCreateRuntime, "--config", cfgPath)
		if !o.noWait {
			createArgs = append(createArgs, "--wait")
		}
		createArgs = append(createArgs, o.hookArgs...)
		stopArgs := append(append(slices.Clone(head), PhasePoststop, "--config", cfgPath), o.hookArgs...)
		env := RuntimeEnv()
		if o.inheritEnv {
			env = nil
		}
		spec.Hooks = &specs.Hooks{
			CreateRuntime: []specs.Hook{{Path: bin, Args: createArgs, Env: env}},
		}
		if o.optIn {
			spec.Annotations[PoststopAnnotation] = "on"
		}
		if o.optIn || !o.noPoststop && !r.noPoststop {
			spec.Hooks.Poststop = []specs.Hook{{Path: bin, Args: stopArgs, Env: env}}
		}
	}
	dir := filepath.Join(r.base, "b", id)
	require.NoError(r.t, os.MkdirAll(dir, 0o755))
	data, err := json.Marshal(spec)
	require.NoError(r.t, err)
	require.NoError(r.t, os.WriteFile(filepath.Join(dir, "config.json"), data, 0o600))
	return dir
}

// start runs `runc run` for a new container in the background (or, detached,
// until runc has started it and returned).
func (r *rig) start(id string, o ctrOpts) *ctr {
	r.t.Helper()
	bundle := r.bundle(id, o)
	args := []string{"--root", r.runcRoot, "run", "--bundle", bundle}
	if o.detached {
		args = append(args, "--detach")
	}
	args = append(args, id)
	c := &ctr{r: r, id: id, out: &syncBuffer{}, done: make(chan struct{})}
	c.cmd = exec.Command(runcBin, args...)
	if o.runtime != "" {
		c.cmd = exec.Command(o.runtime, args...)
		c.cmd.Env = append(append(os.Environ(), "RUNC_GPU_GUARD_RUNC="+runcBin), o.runtimeEnv...)
	}
	if o.detached {
		// The container inherits runc's stdio: give it none (/dev/null), so
		// that no pipe keeps the wait open after runc returned; runc's own
		// complaints are in its exit status.
		c.err = c.cmd.Run()
		close(c.done)
	} else {
		c.cmd.Stdout, c.cmd.Stderr = c.out, c.out
		require.NoError(r.t, c.cmd.Start())
		go func() {
			c.err = c.cmd.Wait()
			close(c.done)
		}()
	}
	r.mu.Lock()
	r.ctrs = append(r.ctrs, c)
	r.mu.Unlock()
	return c
}

// run is start + wait for runc to return.
func (r *rig) run(id string, o ctrOpts) (*ctr, error) {
	c := r.start(id, o)
	return c, c.wait(r.t)
}

// wait waits for runc to return and gives its error (with its output).
func (c *ctr) wait(t testing.TB) error {
	t.Helper()
	select {
	case <-c.done:
	case <-time.After(condTimeout):
		t.Fatalf("runc run %s did not return within %s; output:\n%s", c.id, condTimeout, c.out.String())
	}
	if c.err != nil {
		return fmt.Errorf("runc run %s: %w: %s", c.id, c.err, c.out.String())
	}
	return nil
}

func (c *ctr) running() bool {
	select {
	case <-c.done:
		return false
	default:
		return true
	}
}

func (r *rig) started(id string) bool {
	_, err := os.Stat(filepath.Join(r.shared, id+".started"))
	return err == nil
}

// release tells container id's program to exit.
func (r *rig) release(id string) {
	require.NoError(r.t, os.WriteFile(filepath.Join(r.shared, id+".release"), nil, 0o600))
}

// order is the lines the container programs appended, in order.
func (r *rig) order() []string {
	data, err := os.ReadFile(filepath.Join(r.shared, "order"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	require.NoError(r.t, err)
	return strings.Split(strings.TrimSpace(string(data)), "\n")
}

// waitFor waits for cond, failing the test with desc after condTimeout.
func (r *rig) waitFor(desc string, cond func() bool) {
	r.t.Helper()
	deadline := time.Now().Add(condTimeout)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			r.t.Fatalf("timed out after %s waiting for %s; ledger: %+v", condTimeout, desc, r.state())
		}
		<-tick.C
	}
}

func (r *rig) ledger() *ledger.Ledger {
	l, err := ledger.OpenReadOnly(r.cfg.Ledger.Dir, ledger.Options{})
	require.NoError(r.t, err)
	return l
}

func (r *rig) state() ledger.State {
	st, err := r.ledger().Snapshot(context.Background())
	require.NoError(r.t, err)
	return st
}

func (r *rig) waiterKeys() []string {
	var keys []string
	for _, w := range r.state().Waiters {
		keys = append(keys, w.Key)
	}
	return keys
}

func (r *rig) holders() map[string]string {
	out := map[string]string{}
	for _, c := range r.state().Claims {
		out[c.Device.UUID] = c.Owner.ContainerID
	}
	return out
}

func (r *rig) audit() []ledger.AuditRecord {
	recs, err := ledger.ReadAudit(r.ledger().AuditPath())
	require.NoError(r.t, err)
	return recs
}

// guard opens the rig's ledger in this process, as the NRI daemon would.
func (r *rig) guard() *guard.Guard {
	inv, err := devices.Discover(r.cfg.Devices, nil)
	require.NoError(r.t, err)
	l, err := ledger.Open(r.cfg.Ledger.Dir, ledger.Options{LockTimeout: r.cfg.Ledger.LockTimeout.Duration})
	require.NoError(r.t, err)
	g, err := guard.New(guard.Options{Config: r.cfg, Inventory: inv, Ledger: l})
	require.NoError(r.t, err)
	return g
}

// cgroupName is the cgroup of container id, directly below the hierarchy
// root so that cleanup can find it.
func (r *rig) cgroupName(id string) string {
	return "nri-gpu-guard-test-" + filepath.Base(r.base) + "-" + id
}

func (r *rig) cleanup() {
	r.mu.Lock()
	ctrs := slices.Clone(r.ctrs)
	r.mu.Unlock()
	for _, c := range ctrs {
		_ = os.WriteFile(filepath.Join(r.shared, c.id+".release"), nil, 0o600)
	}
	for _, c := range ctrs {
		_ = exec.Command(runcBin, "--root", r.runcRoot, "delete", "--force", c.id).Run()
		if c.cmd != nil && c.cmd.Process != nil && c.running() {
			_ = c.cmd.Process.Kill()
		}
		select {
		case <-c.done:
		case <-time.After(condTimeout):
		}
	}
	// A runc killed while creating leaves its (empty) cgroups behind.
	for _, c := range ctrs {
		dirs, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", r.cgroupName(c.id)))
		dirs = append(dirs, filepath.Join("/sys/fs/cgroup", r.cgroupName(c.id)))
		for _, d := range dirs {
			_ = os.Remove(d) // rmdir: only an empty cgroup goes
		}
	}
	// The server last: the deletes above ran poststops through it.
	r.mu.Lock()
	s := r.server
	r.mu.Unlock()
	if s != nil {
		// Relays a killed runc left waiting (a rig whose waiters poll once
		// a minute) would hold the server's stop for its grace: end them,
		// and the server cancels their runs at once.
		r.killRelays()
		r.mu.Lock()
		stopped := s.stopped
		r.mu.Unlock()
		select {
		case <-s.done:
			if !stopped {
				r.t.Errorf("the hook server exited during the test: %v", s.err)
			}
		default:
			_ = s.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-s.done:
				if s.err != nil {
					r.t.Errorf("the hook server's exit on SIGTERM: %v", s.err)
				}
			case <-time.After(condTimeout):
				_ = s.cmd.Process.Kill()
				<-s.done
				r.t.Errorf("the hook server did not exit within %s of SIGTERM", condTimeout)
			}
		}
		log := s.log.String()
		// The rig's relays run as root in the server's namespaces: the
		// server must have answered every one of them.
		if strings.Contains(log, "falls back") {
			r.t.Errorf("the hook server told relays to fall back: not every hook ran in it")
		}
		if log != "" && r.t.Failed() {
			r.t.Logf("the hook server logged:\n%s", log)
		}
	}
	_ = os.RemoveAll(r.base)
}

func gpuEnv(i int) []string { return []string{"NVIDIA_VISIBLE_DEVICES=" + strconv.Itoa(i)} }

// TestRuncSecondContainerWaitsForTheFirst: two containers on one GPU; the
// second's createRuntime hook waits, and its container starts only after the
// first exited; the first's claim ends when its poststop ran.
func TestRuncSecondContainerWaitsForTheFirst(t *testing.T) {
	r := newRig(t, rigOpts{})
	a := r.start("a", ctrOpts{env: gpuEnv(1)})
	r.waitFor("a to start", func() bool { return r.started("a") })
	require.Equal(t, "a", r.holders()[gpuUUIDs[1]])

	b := r.start("b", ctrOpts{env: gpuEnv(1)})
	r.waitFor("b to queue", func() bool { return slices.Contains(r.waiterKeys(), "b") })
	require.False(t, r.started("b"), "b must not start while a holds GPU 1")
	require.True(t, b.running(), "b's runc waits in its createRuntime hook")

	r.release("a")
	require.NoError(t, a.wait(t))
	r.waitFor("b to start", func() bool { return r.started("b") })
	require.Equal(t, []string{"a start", "a exit", "b start"}, r.order())
	require.Equal(t, "b", r.holders()[gpuUUIDs[1]])
	require.Empty(t, r.state().Waiters)
	r.release("b")
	require.NoError(t, b.wait(t))
	require.Empty(t, r.holders(), "poststop released b")
	require.Empty(t, r.state().Reservations)
}

// TestRuncPoststopReleases: without competition the claim can only end
// through the poststop hook (no waiter runs a liveness check).
func TestRuncPoststopReleases(t *testing.T) {
	r := newRig(t, rigOpts{})
	_, err := r.run("solo", ctrOpts{env: gpuEnv(0), mode: "exit"})
	require.NoError(t, err)
	require.Equal(t, []string{"solo start", "solo exit"}, r.order())
	require.Empty(t, r.holders())

	var claimed, released bool
	for _, rec := range r.audit() {
		if rec.ContainerID != "solo" {
			continue
		}
		switch rec.Op {
		case ledger.OpClaim:
			claimed = true
			require.Equal(t, []string{gpuUUIDs[0]}, rec.Devices)
			require.Equal(t, string(ledger.FrontEndHook), rec.FrontEnd)
		case ledger.OpRelease:
			released = true
			require.Equal(t, "removed", rec.Reason)
		}
	}
	require.True(t, claimed && released, "audit: claim then release by poststop: %+v", r.audit())

	// A second poststop for the same container (a runtime retrying delete)
	// is a no-op, not an error.
	cmd := exec.Command(hookBin, PhasePoststop, "--config", r.cfgPath)
	cmd.Stdin = strings.NewReader(`{"ociVersion":"1.0.2","id":"solo","status":"stopped","bundle":"/nonexistent"}`)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
}

// TestRuncQueueIsFIFO: three waiters queued one after the other start in
// that order, each after its predecessor exited.
func TestRuncQueueIsFIFO(t *testing.T) {
	r := newRig(t, rigOpts{})
	h := r.start("h", ctrOpts{env: gpuEnv(2)})
	r.waitFor("h to start", func() bool { return r.started("h") })

	ws := []string{"w1", "w2", "w3"}
	var cs []*ctr
	for i, id := range ws {
		cs = append(cs, r.start(id, ctrOpts{env: gpuEnv(2)}))
		r.waitFor(id+" to queue", func() bool { return len(r.waiterKeys()) == i+1 })
	}
	require.Equal(t, ws, r.waiterKeys(), "queue order is arrival order")

	r.release("h")
	require.NoError(t, h.wait(t))
	want := []string{"h start", "h exit"}
	for i, id := range ws {
		r.waitFor(id+" to start", func() bool { return r.started(id) })
		for _, later := range ws[i+1:] {
			require.False(t, r.started(later), "%s started before %s", later, id)
		}
		require.Equal(t, ws[i+1:], r.waiterKeysOrNil(), "the rest still queued, in order")
		r.release(id)
		require.NoError(t, cs[i].wait(t))
		want = append(want, id+" start", id+" exit")
	}
	require.Equal(t, want, r.order())
	require.Empty(t, r.holders())
	require.Empty(t, r.state().Waiters)
}

func (r *rig) waiterKeysOrNil() []string {
	k := r.waiterKeys()
	if len(k) == 0 {
		return []string{}
	}
	return k
}

// TestRuncHolderKilled: the holder is SIGKILLed and nobody deletes it (its
// poststop never runs); the waiter's own liveness check sees the dead holder
// and starts.
func TestRuncHolderKilled(t *testing.T) {
	r := newRig(t, rigOpts{})
	h := r.start("h", ctrOpts{env: gpuEnv(3), detached: true})
	require.NoError(t, h.wait(t))
	r.waitFor("h to start", func() bool { return r.started("h") })
	pid := r.runcPid("h")

	w := r.start("w", ctrOpts{env: gpuEnv(3)})
	r.waitFor("w to queue", func() bool { return slices.Contains(r.waiterKeys(), "w") })
	require.False(t, r.started("w"))

	require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
	r.waitFor("w to start", func() bool { return r.started("w") })
	require.Equal(t, "w", r.holders()[gpuUUIDs[3]])

	var reasons []string
	for _, rec := range r.audit() {
		if rec.ContainerID == "h" && rec.Op == ledger.OpRelease {
			reasons = append(reasons, rec.Reason)
		}
	}
	require.Len(t, reasons, 1, "h released once, by the waiter")
	require.Contains(t, reasons[0], guard.ReasonHolderExited)

	r.release("w")
	require.NoError(t, w.wait(t))
	// Deleting the dead holder now runs its poststop: nothing left to release.
	out, err := exec.Command(runcBin, "--root", r.runcRoot, "delete", "--force", "h").CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Empty(t, r.holders())
}

// TestRuncRuntimeKilledWhileWaiting: runc itself is SIGKILLed while its
// createRuntime hook waits. Nobody will start that container; the hook sees
// its runtime gone and leaves the queue at once (not after queue_ttl).
func TestRuncRuntimeKilledWhileWaiting(t *testing.T) {
	r := newRig(t, rigOpts{})
	h := r.start("h", ctrOpts{env: gpuEnv(0)})
	r.waitFor("h to start", func() bool { return r.started("h") })
	w := r.start("w", ctrOpts{env: gpuEnv(0)})
	r.waitFor("w to queue", func() bool { return slices.Contains(r.waiterKeys(), "w") })

	require.NoError(t, w.cmd.Process.Kill())
	require.Error(t, w.wait(t))
	// The audit record follows the state write: wait for it, not the state.
	var reasons []string
	r.waitFor("w to leave the queue", func() bool {
		reasons = nil
		for _, rec := range r.audit() {
			if rec.Key == "w" && rec.Op == ledger.OpDequeue {
				reasons = append(reasons, rec.Reason)
			}
		}
		return len(reasons) > 0
	})
	require.Empty(t, r.state().Waiters)
	require.Len(t, reasons, 1)
	require.Contains(t, reasons[0], "the runtime that ran the hook")

	r.release("h")
	require.NoError(t, h.wait(t))
	require.Empty(t, r.holders(), "w never claimed")
	require.False(t, r.started("w"))
}

// runcPid is the host pid of container id's process.
func (r *rig) runcPid(id string) int {
	out, err := exec.Command(runcBin, "--root", r.runcRoot, "state", id).Output()
	require.NoError(r.t, err)
	var st specs.State
	require.NoError(r.t, json.Unmarshal(out, &st))
	require.Positive(r.t, st.Pid)
	return st.Pid
}

// TestRuncWaitTimeout: a waiter whose hook reaches hook.wait_timeout is
// refused with the guard's message, and leaves neither a claim nor a queue
// entry behind.
func TestRuncWaitTimeout(t *testing.T) {
	r := newRig(t, rigOpts{})
	short := r.config(300 * time.Millisecond)
	shortPath := r.writeConfig("short.toml", short)

	h := r.start("h", ctrOpts{env: gpuEnv(1)})
	r.waitFor("h to start", func() bool { return r.started("h") })

	w, err := r.run("w", ctrOpts{env: gpuEnv(1), cfgPath: shortPath})
	require.Error(t, err, "w must be refused")
	msg := w.out.String()
	for _, s := range []string{"hook.wait_timeout", "GPU 1 (" + gpuUUIDs[1] + ")", "container h", "not queued any more"} {
		require.Contains(t, msg, s)
	}
	require.False(t, r.started("w"))
	require.Equal(t, map[string]string{gpuUUIDs[1]: "h"}, r.holders(), "no claim for w")
	require.Empty(t, r.state().Waiters, "w left the queue")
	require.Empty(t, r.state().Reservations)
	// Nothing changed while w waited (about 15 polls of 20ms), so its hook
	// read the ledger at each poll but wrote it only to join, to leave, and
	// to leave the refuse record every refusal leaves (crun shows only the
	// exit code), which names the holder.
	ops := map[string]int{}
	for _, rec := range r.audit() {
		if rec.Key == "w" {
			ops[rec.Op]++
			if rec.Op == guard.AuditRefuse {
				require.Contains(t, rec.Reason, "gave up waiting (hook.wait_timeout")
				require.Contains(t, rec.Reason, "container h")
			}
		}
	}
	require.Equal(t, map[string]int{ledger.OpEnqueue: 1, ledger.OpDequeue: 1, guard.AuditRefuse: 1}, ops)

	r.release("h")
	require.NoError(t, h.wait(t))
	require.Empty(t, r.holders())
	require.Empty(t, r.state().Reservations, "nobody waits: nothing reserved")
}

// TestRuncSharedLedgerWithNRI: a GPU held through the NRI front end blocks a
// hook container, and a GPU held by a hook container blocks an NRI request.
func TestRuncSharedLedgerWithNRI(t *testing.T) {
	r := newRig(t, rigOpts{})
	ctx := context.Background()
	g := r.guard()
	nriOwner := ledger.Owner{ContainerID: "nri0123456789abcdef", Namespace: "team", Pod: "trainer", PodUID: "uid-1", Container: "main", FrontEnd: ledger.FrontEndNRI}
	nriReq := func(gpu int) guard.Request {
		return guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: nriOwner, Spec: devices.Request{Env: gpuEnv(gpu)}}
	}

	// NRI holds GPU 0 (created, not started: alive without a pid).
	d, err := g.Admit(ctx, nriReq(0))
	require.NoError(t, err)
	require.Equal(t, guard.Admit, d.Result)

	w, err := r.run("w", ctrOpts{env: gpuEnv(0), noWait: true})
	require.Error(t, err)
	require.Contains(t, w.out.String(), "GPU 0 ("+gpuUUIDs[0]+") is held by team/trainer/main (id nri012345678)")
	require.False(t, r.started("w"))
	require.Equal(t, map[string]string{gpuUUIDs[0]: nriOwner.ContainerID}, r.holders())
	require.NoError(t, g.Removed(ctx, nriOwner))

	// A hook container holds GPU 2: NRI's request for it is queued behind it.
	h := r.start("h", ctrOpts{env: gpuEnv(2)})
	r.waitFor("h to start", func() bool { return r.started("h") })
	d, err = g.Admit(ctx, nriReq(2))
	require.NoError(t, err)
	require.Equal(t, guard.Queue, d.Result)
	require.Len(t, d.Busy, 1)
	require.Equal(t, "h", d.Busy[0].Holder.Owner.ContainerID)
	require.Equal(t, ledger.FrontEndHook, d.Busy[0].Holder.Owner.FrontEnd)
	require.Contains(t, d.Message, "container h")

	// Once h is gone the NRI request, at the head of the queue, gets GPU 2.
	r.release("h")
	require.NoError(t, h.wait(t))
	d, err = g.Admit(ctx, nriReq(2))
	require.NoError(t, err)
	require.Equal(t, guard.Admit, d.Result, d.Message)
	require.Equal(t, map[string]string{gpuUUIDs[2]: nriOwner.ContainerID}, r.holders())
}

// TestRuncNoGPUSkipsWithoutLedger: a container that names no GPU runs even
// when the ledger is unusable (the hook never opens it); one that names a GPU
// is refused, naming the ledger problem.
func TestRuncNoGPUSkipsWithoutLedger(t *testing.T) {
	r := newRig(t, rigOpts{})
	broken := r.config(time.Minute)
	// A ledger dir below a regular file can neither be opened nor created.
	require.NoError(t, os.WriteFile(filepath.Join(r.base, "file"), nil, 0o600))
	broken.Ledger.Dir = filepath.Join(r.base, "file", "ledger")
	brokenPath := r.writeConfig("broken.toml", broken)

	_, err := r.run("plain", ctrOpts{mode: "exit", cfgPath: brokenPath})
	require.NoError(t, err)
	require.True(t, r.started("plain"))

	c, err := r.run("gpu", ctrOpts{env: gpuEnv(0), mode: "exit", cfgPath: brokenPath})
	require.Error(t, err)
	require.False(t, r.started("gpu"))
	require.Contains(t, c.out.String(), broken.Ledger.Dir)
}

// TestRuncWaitRefusalIsAudited: with --wait, a request refused by policy (an
// unknown GPU) leaves a refuse record, as without it: under crun the audit
// log is where the reason can be read. The waiting path decided it without
// recording it.
func TestRuncWaitRefusalIsAudited(t *testing.T) {
	r := newRig(t, rigOpts{})
	c, err := r.run("u", ctrOpts{env: gpuEnv(7), mode: "exit"})
	require.Error(t, err)
	require.False(t, r.started("u"))
	require.Contains(t, c.out.String(), "unknown GPU")
	refused := 0
	for _, rec := range r.audit() {
		if rec.Op == guard.AuditRefuse && rec.ContainerID == "u" {
			refused++
			require.Contains(t, rec.Reason, "unknown GPU")
		}
	}
	require.Equal(t, 1, refused, "one refuse record")
}

// hookProc runs the hook binary directly, as a runtime would, for a
// container whose process is pid.
type hookProc struct {
	cmd    *exec.Cmd
	stderr *syncBuffer
	done   chan struct{}
	err    error
}

func (r *rig) runHook(id string, pid int, env []string) *hookProc {
	bundle := r.bundle(id, ctrOpts{env: env})
	st, err := json.Marshal(specs.State{Version: specs.Version, ID: id, Status: specs.StateCreating, Pid: pid, Bundle: bundle})
	require.NoError(r.t, err)
	p := &hookProc{stderr: &syncBuffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(hookBin, PhaseCreateRuntime, "--config", r.cfgPath, "--wait")
	p.cmd.Stdin = bytes.NewReader(st)
	p.cmd.Stdout, p.cmd.Stderr = io.Discard, p.stderr
	require.NoError(r.t, p.cmd.Start())
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	r.t.Cleanup(func() {
		if p.cmd.Process != nil {
			_ = p.cmd.Process.Kill()
		}
		<-p.done
	})
	return p
}

func (p *hookProc) wait(t testing.TB) error {
	t.Helper()
	select {
	case <-p.done:
		return p.err
	case <-time.After(condTimeout):
		t.Fatalf("hook did not exit within %s; stderr:\n%s", condTimeout, p.stderr.String())
		return nil
	}
}

// TestHookWaiterLeavesQueue: a waiting hook that is told to stop (SIGTERM),
// or whose container process disappears, leaves the queue without a claim.
func TestHookWaiterLeavesQueue(t *testing.T) {
	for _, tc := range []struct {
		name    string
		end     func(t *testing.T, hook *hookProc, ctrProc *exec.Cmd)
		wantErr []string
	}{
		{
			name: "SIGTERM",
			end: func(t *testing.T, hook *hookProc, _ *exec.Cmd) {
				require.NoError(t, hook.cmd.Process.Signal(syscall.SIGTERM))
			},
			wantErr: []string{"terminated signal received", "not queued any more and holds no GPU"},
		},
		{
			name: "container process gone",
			end: func(t *testing.T, _ *hookProc, ctrProc *exec.Cmd) {
				require.NoError(t, ctrProc.Process.Kill())
				_ = ctrProc.Wait() // reaped: the pid no longer exists
			},
			wantErr: []string{"container gone while waiting", "is gone", "not queued any more and holds no GPU"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, rigOpts{})
			h := r.start("h", ctrOpts{env: gpuEnv(1)})
			r.waitFor("h to start", func() bool { return r.started("h") })

			// The "container": a process of ours standing in for runc init.
			proc := exec.Command(ctrProg, r.shared, "stand-in", "wait")
			require.NoError(t, proc.Start())
			t.Cleanup(func() { _ = proc.Process.Kill(); _ = proc.Wait() })

			hook := r.runHook("x", proc.Process.Pid, gpuEnv(1))
			r.waitFor("x to queue", func() bool { return slices.Contains(r.waiterKeys(), "x") })
			tc.end(t, hook, proc)

			err := hook.wait(t)
			var exit *exec.ExitError
			require.ErrorAs(t, err, &exit, "the hook fails: %s", hook.stderr.String())
			for _, s := range tc.wantErr {
				require.Contains(t, hook.stderr.String(), s)
			}
			st := r.state()
			require.Empty(t, st.Waiters, "x left the queue")
			require.Equal(t, map[string]string{gpuUUIDs[1]: "h"}, r.holders())

			r.release("h")
			require.NoError(t, h.wait(t))
			require.Empty(t, r.state().Reservations, "nothing reserved for the gone waiter")
		})
	}
}

// TestRuncPoststopAfterBundleEdit: `runc run --detach`, then the bundle's
// config.json is edited to name no GPU, then `runc delete --force`: the
// poststop hook reads the edited file, and still releases the claim
// (create-runtime's marker makes it read the ledger).
func TestRuncPoststopAfterBundleEdit(t *testing.T) {
	r := newRig(t, rigOpts{})
	c := r.start("edited", ctrOpts{env: gpuEnv(2), detached: true, noWait: true})
	require.NoError(t, c.wait(t))
	r.waitFor("edited to start", func() bool { return r.started("edited") })
	require.Equal(t, map[string]string{gpuUUIDs[2]: "edited"}, r.holders())

	path := filepath.Join(r.base, "b", "edited", "config.json")
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	var spec specs.Spec
	require.NoError(t, json.Unmarshal(data, &spec))
	spec.Process.Env = []string{"PATH=/"}
	data, err = json.Marshal(spec)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(path, data, 0o600))

	out, err := exec.Command(runcBin, "--root", r.runcRoot, "delete", "--force", "edited").CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Empty(t, r.holders(), "poststop released the claim although config.json names no GPU any more: %s", out)
}

// runc keeps a bind source's mount flags on a bind without flag options of
// its own (it binds, and remounts only for such options), so a directory on
// a nodev mount bound with "rbind" alone is nodev in the container: a
// device node in it does not open (EACCES; the rig's device cgroup allows
// c 1:3), and the hook, run by runc (its parent's executable), admits the
// container as reaching no GPU. crun's counterpart, which does not keep
// it: TestCrunBindFromNodevMount. Real runc, as root; the hook reads the
// rig's containers as having no device cgroup.
func TestRuncBindFromNodevMount(t *testing.T) {
	r := newRig(t, rigOpts{})
	vol := nodevVolume(t, r.base)
	_, err := r.run("vol", ctrOpts{mode: "open:/data/node", noWait: true, noPoststop: true,
		mounts: []specs.Mount{{Destination: "/data", Type: "bind", Source: vol, Options: []string{"rbind"}}}})
	require.NoError(t, err)
	require.Contains(t, r.order(), "vol open failed: open /data/node: permission denied", "runc keeps the source's nodev")
	require.Empty(t, r.state().Claims, "nothing claimed (no poststop released anything)")
}

// rejectAllConfig writes the rig's configuration with policy.all_devices =
// "reject" (writeConfig writes no policy), checked as loaded, and returns
// its path.
func (r *rig) rejectAllConfig() string {
	r.t.Helper()
	path := r.writeConfig("reject.toml", r.cfg)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(r.t, err)
	_, err = f.WriteString("[policy]\nall_devices = \"reject\"\n")
	require.NoError(r.t, errors.Join(err, f.Close()))
	got, err := config.LoadFile(path)
	require.NoError(r.t, err)
	require.Equal(r.t, config.AllReject, got.Policy.AllDevices)
	return path
}

// rootNode makes the device node "node" (c 1:3, /dev/null's numbers:
// where it opens, a GPU's would) in the rig's rootfs, which is mounted
// nodev, as an image's node sits in a root on container storage mounted
// nodev.
func (r *rig) rootNode() {
	r.t.Helper()
	node := filepath.Join(r.rootfs, "node")
	require.NoError(r.t, unix.Mknod(node, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	r.t.Cleanup(func() { _ = os.Remove(node) })
}

// runc keeps the nodev of a read-write root's mount (it binds the root and
// remounts it only to make it read-only), so a node in a root on a nodev
// mount does not open (EACCES; the rig's device cgroup allows c 1:3), and
// the hook, run by runc, admits the container as reaching no GPU. A
// read-only root runc remounts MS_RDONLY alone, which drops the nodev: the
// node opens, and the hook counts the container as reaching every GPU,
// refused under all_devices = "reject" with the remedy (a read-write
// root), claiming every GPU otherwise. crun's counterpart, which drops it
// for any root: TestCrunRootFromNodevMount. Real runc, as root; the hook
// reads the rig's containers as having no device cgroup.
func TestRuncRootFromNodevMount(t *testing.T) {
	r := newRig(t, rigOpts{})
	r.rootNode()
	_, err := r.run("rw", ctrOpts{mode: "open:/node", noWait: true, noPoststop: true})
	require.NoError(t, err)
	require.Contains(t, r.order(), "rw open failed: open /node: permission denied", "runc keeps a read-write root's nodev")
	require.Empty(t, r.state().Claims, "nothing claimed (no poststop released anything)")

	_, err = r.run("refused", ctrOpts{mode: "open:/node", noWait: true, noPoststop: true, readonlyRoot: true, cfgPath: r.rejectAllConfig()})
	require.Error(t, err, "a read-only root on a nodev mount, under runc")
	require.ErrorContains(t, err, "read-only root filesystem remounted without nodev by runc")
	require.ErrorContains(t, err, "give it a read-write root (runc keeps the nodev of its storage there)")
	require.NotContains(t, err.Error(), "mountopt", "the storage is nodev already")
	require.Empty(t, r.state().Claims)

	_, err = r.run("ro", ctrOpts{mode: "open:/node", noWait: true, noPoststop: true, readonlyRoot: true})
	require.NoError(t, err)
	require.Contains(t, r.order(), "ro open ok", "runc drops a read-only root's nodev: the node opens")
	want := map[string]string{}
	for _, u := range gpuUUIDs {
		want[u] = "ro"
	}
	require.Equal(t, want, holdersOf(r.state()), "every GPU: the root's nodes open")
	for _, c := range r.state().Claims {
		require.Contains(t, c.Source, "read-only root filesystem remounted without nodev by runc")
	}
}

// With a user namespace of its own, a container keeps the nodev of its
// root's mount under runc 1.1.5 for a read-only root too: runc makes its
// mount namespace inside that user namespace, where the kernel locks the
// flags of the mounts it copies, and runc's read-only remount, refused,
// is made again with the mount's flags. The hook, run by runc, finds the
// container's process in another user namespace than its own and admits
// it under all_devices = "reject", claiming nothing: the root's node does
// not open. A bind from a nodev mount with flag options of its own ("ro")
// cannot clear that nodev either: runc 1.1.5 fails the mount (EPERM), and
// a runc that makes it again with the mount's flags keeps nodev. Without
// the user namespace: TestRuncRootFromNodevMount. Real runc, as root; the
// hook reads the rig's containers as having no device cgroup.
func TestRuncUserNSRootFromNodevMount(t *testing.T) {
	r := newRig(t, rigOpts{})
	r.rootNode()
	reject := r.rejectAllConfig()
	_, err := r.run("ro", ctrOpts{mode: "open:/node", noWait: true, noPoststop: true, readonlyRoot: true, userNS: true, cfgPath: reject})
	require.NoError(t, err, "a read-only root on a nodev mount, runc, a user namespace: admitted")
	require.Contains(t, r.order(), "ro open failed: open /node: permission denied", "the root's nodev holds")
	require.Empty(t, r.state().Claims, "nothing claimed (no poststop released anything)")

	vol := nodevVolume(t, r.base)
	require.NoError(t, os.Mkdir(filepath.Join(r.rootfs, "data"), 0o755))
	_, err = r.run("bindro", ctrOpts{mode: "open:/data/node", noWait: true, noPoststop: true, userNS: true, cfgPath: reject,
		mounts: []specs.Mount{{Destination: "/data", Type: "bind", Source: vol, Options: []string{"rbind", "ro"}}}})
	if err != nil {
		require.ErrorContains(t, err, "operation not permitted", "runc cannot clear the source's locked nodev")
		require.NotContains(t, err.Error(), "refused", "the hook did not refuse it")
	} else {
		require.Contains(t, r.order(), "bindro open failed: open /data/node: permission denied", "the source's nodev holds")
	}
	require.Empty(t, r.state().Claims)
}
