// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build integration

package integration

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Plugin identity as the guard registers with NRI (the defaults of [nri]).
const (
	guardPluginName  = "gpu-guard"
	guardPluginIndex = "90"
)

// GuardOptions tune a guard's configuration.
type GuardOptions struct {
	// Policy holds TOML lines for the [policy] table, e.g.
	// `on_conflict = "reject"`.
	Policy string
	// Extra is TOML appended after the generated tables (other tables).
	Extra string
	// Bin replaces bin/nri-gpu-guard (a test build); Env is added to the
	// external process's environment.
	Bin string
	Env []string
}

// Guard is one nri-gpu-guard of the harness: an external plugin process
// (StartGuard) or a plugin pre-installed for containerd to launch
// (InstallGuard). Its ledger lives in the containerd's temp dir.
type Guard struct {
	c *Containerd
	// Dir holds the guard's config, state and log.
	Dir string
	// StateDir is the ledger directory ([ledger] dir).
	StateDir string
	// ConfigPath is the config file (for an installed plugin: the NRI
	// conf.d file containerd hands it).
	ConfigPath string
	// LogPath is the external process's log (slog JSON lines).
	LogPath string
	// MetricsAddr serves /metrics, /healthz and /readyz.
	MetricsAddr string
	// Installed is true for a pre-installed plugin.
	Installed bool

	proc *process
	from int64 // log offset at the current start
	opts GuardOptions
}

// guardConfig is the guard's TOML: the fake GPUs as a static inventory, the
// ledger in the temp dir, metrics on a free local port.
func (g *Guard) guardConfig(opts GuardOptions) string {
	var b strings.Builder
	// proc_root names a dir without a driver tree: the fake GPUs are
	// compared with no real driver's (on a GPU host they would differ).
	fmt.Fprintf(&b, "version = 1\n\n[ledger]\ndir = %s\n\n[devices]\nsource = \"static\"\nproc_root = %s\n",
		tomlString(g.StateDir), tomlString(filepath.Join(g.StateDir, "no-driver")))
	for _, gpu := range g.c.GPUs {
		fmt.Fprintf(&b, "\n[[devices.static]]\nindex = %d\nuuid = %s\nminor = %d\nmodel = \"Fake GPU (integration test)\"\nmemory_mib = 81559\n",
			gpu.Index, tomlString(gpu.UUID), gpu.Minor)
	}
	fmt.Fprintf(&b, "\n[policy]\n%s\n", opts.Policy)
	fmt.Fprintf(&b, "\n[nri]\nplugin_name = %q\nplugin_index = %q\nsocket = %s\n", guardPluginName, guardPluginIndex, tomlString(g.c.NRISocket))
	fmt.Fprintf(&b, "\n[metrics]\nlisten = %s\n", tomlString(g.MetricsAddr))
	if opts.Extra != "" {
		b.WriteString("\n" + opts.Extra + "\n")
	}
	return b.String()
}

// newGuard prepares a guard's dir and config.
func newGuard(c *Containerd, opts GuardOptions, installed bool) (*Guard, error) {
	dir := c.uniqueFile("guard")
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	g := &Guard{
		c:           c,
		Dir:         dir,
		StateDir:    filepath.Join(dir, "state"),
		ConfigPath:  filepath.Join(dir, "config.toml"),
		LogPath:     filepath.Join(dir, "guard.log"),
		MetricsAddr: fmt.Sprintf("127.0.0.1:%d", port),
		Installed:   installed,
		opts:        opts,
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	cfg := g.guardConfig(opts)
	if installed {
		g.ConfigPath = filepath.Join(c.PluginConfigPath, guardPluginIndex+"-"+guardPluginName+".conf")
	}
	if err := os.WriteFile(g.ConfigPath, []byte(cfg), 0o600); err != nil {
		return nil, err
	}
	return g, nil
}

// freePort asks the kernel for a free local TCP port.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer func() { _ = l.Close() }()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// StartGuard starts bin/nri-gpu-guard as an external plugin dialing c's NRI
// socket and waits until it is registered and synchronized. It is stopped
// when the test ends.
func StartGuard(t testing.TB, c *Containerd, opts GuardOptions) *Guard {
	t.Helper()
	g, err := newGuard(c, opts, false)
	if err != nil {
		t.Fatalf("prepare guard: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("guard log (%s), last lines:\n%s", g.LogPath, logTail(g.LogPath, 0, 40))
		}
		if g.proc != nil {
			if err := g.proc.stop(stopTimeout); err != nil {
				t.Errorf("stop guard: %v", err)
			}
		}
	})
	g.Start(t)
	return g
}

// Start (re)starts the external plugin process and waits until it is ready.
func (g *Guard) Start(t testing.TB) {
	t.Helper()
	if g.Installed {
		t.Fatal("a pre-installed guard is started by containerd")
	}
	if g.proc != nil {
		if ok, _ := g.proc.exited(); !ok {
			t.Fatalf("guard (pid %d) is already running", g.proc.Pid())
		}
	}
	g.from = fileSize(g.LogPath)
	env := append([]string{"PATH=" + os.Getenv("PATH")}, g.opts.Env...)
	bin := GuardBin
	if g.opts.Bin != "" {
		bin = g.opts.Bin
	}
	p, err := startProcess("nri-gpu-guard", g.LogPath, env, bin, "--config", g.ConfigPath, "--socket", g.c.NRISocket)
	if err != nil {
		t.Fatal(err)
	}
	g.proc = p
	g.WaitReady(t)
}

// Ready reports whether /readyz answers 200 (registered with NRI and
// synchronized).
func (g *Guard) Ready() bool {
	cl := http.Client{Timeout: 2 * time.Second}
	resp, err := cl.Get("http://" + g.MetricsAddr + "/readyz")
	if err != nil {
		return false
	}
	defer func() { _ = resp.Body.Close() }()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode == http.StatusOK
}

// WaitReady waits until the guard reports ready; it fails at once if the
// external process exited.
func (g *Guard) WaitReady(t testing.TB) {
	t.Helper()
	err := poll(startTimeout, func() (bool, error) {
		if g.proc != nil {
			if ok, werr := g.proc.exited(); ok {
				return false, fmt.Errorf("nri-gpu-guard exited: %w; log:\n%s", exitError(werr), logTail(g.LogPath, g.from, 20))
			}
		}
		return g.Ready(), nil
	})
	if err != nil {
		t.Fatalf("guard not ready: %v", err)
	}
}

// Kill crashes the external plugin (SIGKILL by its pid) and waits until it
// is gone.
func (g *Guard) Kill(t testing.TB) {
	t.Helper()
	if err := g.proc.kill(); err != nil {
		t.Fatalf("kill guard: %v", err)
	}
}

// Stop stops the external plugin gracefully (SIGTERM by its pid).
func (g *Guard) Stop(t testing.TB) {
	t.Helper()
	if err := g.proc.stop(stopTimeout); err != nil {
		t.Fatalf("stop guard: %v", err)
	}
}

// Pid is the external plugin's process id.
func (g *Guard) Pid() int { return g.proc.Pid() }

// InstallGuard pre-installs the plugin: a copy of bin/nri-gpu-guard as
// <plugin_path>/90-gpu-guard and its configuration as
// <plugin_config_path>/90-gpu-guard.conf, which containerd hands the plugin
// at Configure. containerd launches it on its next start (use it from
// ContainerdOptions.BeforeStart, or restart containerd).
func InstallGuard(c *Containerd, opts GuardOptions) (*Guard, error) {
	g, err := newGuard(c, opts, true)
	if err != nil {
		return nil, err
	}
	bin, err := os.ReadFile(GuardBin)
	if err != nil {
		return nil, err
	}
	dst := filepath.Join(c.PluginPath, guardPluginIndex+"-"+guardPluginName)
	if err := os.WriteFile(dst, bin, 0o700); err != nil {
		return nil, err
	}
	return g, nil
}

// PluginExe is the path containerd launches a pre-installed guard from.
func (g *Guard) PluginExe() string {
	return filepath.Join(g.c.PluginPath, guardPluginIndex+"-"+guardPluginName)
}

// Ctl runs bin/gpu-guard-ctl on this guard's ledger and returns its stdout.
func (g *Guard) Ctl(t testing.TB, args ...string) string {
	t.Helper()
	out, err := g.TryCtl(args...)
	if err != nil {
		t.Fatalf("gpu-guard-ctl: %v", err)
	}
	return out
}

// TryCtl is Ctl returning the error (exit code 3, attention needed, is one).
func (g *Guard) TryCtl(args ...string) (string, error) {
	full := append([]string{"--config", g.ConfigPath, "--state-dir", g.StateDir}, args...)
	return runTool([]string{"PATH=" + os.Getenv("PATH")}, CtlBin, full...)
}

// LedgerClaim is one claim as `gpu-guard-ctl claims -o json` shows it.
type LedgerClaim struct {
	Device      string `json:"device"`
	Index       string `json:"index"`
	ContainerID string `json:"container_id"`
	Namespace   string `json:"namespace"`
	Pod         string `json:"pod"`
	PodUID      string `json:"pod_uid"`
	Container   string `json:"container"`
	Source      string `json:"source"`
}

// LedgerWaiter is one queued request as `gpu-guard-ctl queue -o json` shows
// it.
type LedgerWaiter struct {
	Position    int      `json:"position"`
	QueueLength int      `json:"queue_length"`
	Requester   string   `json:"requester"`
	ContainerID string   `json:"container_id"`
	Namespace   string   `json:"namespace"`
	Pod         string   `json:"pod"`
	Container   string   `json:"container"`
	Devices     []string `json:"devices"`
	Reserved    []string `json:"reserved"`
}

// Claims lists the ledger's claims.
func (g *Guard) Claims(t testing.TB) []LedgerClaim {
	t.Helper()
	var v struct {
		Claims []LedgerClaim `json:"claims"`
	}
	out := g.Ctl(t, "claims", "-o", "json")
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("gpu-guard-ctl claims -o json: %v in %q", err, out)
	}
	return v.Claims
}

// Queue lists the ledger's waiters.
func (g *Guard) Queue(t testing.TB) []LedgerWaiter {
	t.Helper()
	var v struct {
		Waiters []LedgerWaiter `json:"waiters"`
	}
	out := g.Ctl(t, "queue", "-o", "json")
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("gpu-guard-ctl queue -o json: %v in %q", err, out)
	}
	return v.Waiters
}

// Holder is the container id holding GPU index i ("" if free).
func (g *Guard) Holder(t testing.TB, i int) string {
	t.Helper()
	for _, c := range g.Claims(t) {
		if c.Device == g.c.GPUs[i].UUID {
			return c.ContainerID
		}
	}
	return ""
}

// WaitHolder waits until GPU index i is held by container id ("" = free).
func (g *Guard) WaitHolder(t testing.TB, i int, id string) {
	t.Helper()
	waitFor(t, waitTimeout, fmt.Sprintf("GPU %d to be held by %q", i, id), func() (bool, string) {
		h := g.Holder(t, i)
		return h == id, "held by " + fmt.Sprintf("%q", h)
	})
}

// ClaimsByContainer maps each claiming container id to the UUIDs it holds.
func (g *Guard) ClaimsByContainer(t testing.TB) map[string][]string {
	t.Helper()
	m := map[string][]string{}
	for _, c := range g.Claims(t) {
		m[c.ContainerID] = append(m[c.ContainerID], c.Device)
	}
	return m
}

// GuardEnv is a test's guarded node: the shared containerd, an external
// guard with a fresh ledger, and a cleanup that removes the test's pods.
type GuardEnv struct {
	C *Containerd
	G *Guard
}

// NewGuardEnv starts a guard for the test on the shared containerd. When the
// test ends, its pods are removed (so the next test starts from an empty
// node) and the guard is stopped; on failure containerd's log lines of this
// test are shown.
func NewGuardEnv(t testing.TB, opts GuardOptions) *GuardEnv {
	t.Helper()
	c := SharedContainerd(t)
	from := c.logOffset()
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("containerd log during this test (%s):\n%s", c.LogPath, logTail(c.LogPath, from, 40))
		}
	})
	g := StartGuard(t, c, opts)
	// Registered after StartGuard's cleanup, so it runs first: pods go
	// while the guard still sees their removal.
	t.Cleanup(func() {
		if _, err := c.Crictl("rmp", "--force", "--all"); err != nil {
			t.Errorf("remove the test's pods: %v", err)
		}
	})
	return &GuardEnv{C: c, G: g}
}
