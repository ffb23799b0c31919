// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build integration

package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// FakeGPU is one GPU of the tests' static inventory. Each has a character
// device node (major 195, its minor) in the temp dir and a CDI device named
// by its index, so all four ways into a container name the same GPU.
type FakeGPU struct {
	Index int
	Minor int
	UUID  string
}

// FakeGPUs is the four-GPU host the tests pretend to be.
var FakeGPUs = []FakeGPU{
	{Index: 0, Minor: 0, UUID: "GPU-2f6f6c3a-0000-4a6e-9d0c-7a1e00000000"},
	{Index: 1, Minor: 1, UUID: "GPU-2f6f6c3a-1111-4a6e-9d0c-7a1e11111111"},
	{Index: 2, Minor: 2, UUID: "GPU-2f6f6c3a-2222-4a6e-9d0c-7a1e22222222"},
	{Index: 3, Minor: 3, UUID: "GPU-2f6f6c3a-3333-4a6e-9d0c-7a1e33333333"},
}

// nvidiaMajor is the character major of /dev/nvidia<minor>.
const nvidiaMajor = 195

// ContainerdOptions tune a containerd started by the harness.
type ContainerdOptions struct {
	// Imports are containerd config files merged over the generated config
	// (its top-level `imports`), e.g. the shipped drop-in.
	Imports []string
	// ExtraConfig is TOML appended to the generated config. It must not
	// repeat a table the harness writes (see configText).
	ExtraConfig string
	// SkipImages leaves the test image out (a test imports its own).
	SkipImages bool
	// BeforeStart runs after the dirs exist and before containerd first
	// starts (e.g. to pre-install a plugin under PluginPath).
	BeforeStart func(c *Containerd) error
}

// Containerd is a containerd daemon of the harness, in its own temp dir.
type Containerd struct {
	// Dir is the temp dir everything lives in.
	Dir string
	// ConfigPath is containerd's config file.
	ConfigPath string
	// Socket is containerd's gRPC socket (CRI and containerd API).
	Socket string
	// NRISocket is where external NRI plugins connect.
	NRISocket string
	// PluginPath and PluginConfigPath are NRI's pre-installed plugin dirs.
	PluginPath, PluginConfigPath string
	// CDIDir is the only CDI spec dir containerd reads.
	CDIDir string
	// DevDir holds the fake /dev/nvidiaN nodes.
	DevDir string
	// PodLogDir is where container logs go.
	PodLogDir string
	// LogPath is containerd's own log.
	LogPath string
	// CrictlConfig is crictl's config file for this daemon.
	CrictlConfig string
	// GPUs is the fake GPU set behind DevDir and CDIDir.
	GPUs []FakeGPU

	opts ContainerdOptions
	proc *process
	mu   sync.Mutex
	seq  int // for unique file names
}

// StartContainerd starts a containerd of the test's own; it is torn down
// when the test ends (also on failure), and its log is shown if the test
// failed.
func StartContainerd(t testing.TB, opts ContainerdOptions) *Containerd {
	t.Helper()
	c, err := NewContainerd(opts)
	if err != nil {
		t.Fatalf("start containerd: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("containerd log (%s), last lines:\n%s", c.LogPath, logTail(c.LogPath, 0, 60))
		}
		if err := c.Close(); err != nil {
			t.Errorf("tear down containerd: %v", err)
		}
	})
	return c
}

// NewContainerd prepares a temp dir with fake GPUs, starts containerd in it
// and imports the test image. Close tears it down; on error nothing is left.
func NewContainerd(opts ContainerdOptions) (_ *Containerd, err error) {
	dir, err := newTempDir()
	if err != nil {
		return nil, err
	}
	c := &Containerd{
		Dir:              dir,
		ConfigPath:       filepath.Join(dir, "containerd.toml"),
		Socket:           filepath.Join(dir, "containerd.sock"),
		NRISocket:        filepath.Join(dir, "nri.sock"),
		PluginPath:       filepath.Join(dir, "nri-plugins"),
		PluginConfigPath: filepath.Join(dir, "nri-conf.d"),
		CDIDir:           filepath.Join(dir, "cdi"),
		DevDir:           filepath.Join(dir, "dev"),
		PodLogDir:        filepath.Join(dir, "pod-logs"),
		LogPath:          filepath.Join(dir, "containerd.log"),
		CrictlConfig:     filepath.Join(dir, "crictl.yaml"),
		GPUs:             FakeGPUs,
		opts:             opts,
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, c.Close())
		}
	}()
	for _, d := range []string{c.PluginPath, c.PluginConfigPath, c.CDIDir, c.DevDir, c.PodLogDir, filepath.Join(dir, "cri")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
	}
	if err := c.makeFakeGPUs(); err != nil {
		return nil, err
	}
	if err := os.WriteFile(c.ConfigPath, []byte(c.configText()), 0o600); err != nil {
		return nil, err
	}
	crictl := fmt.Sprintf("runtime-endpoint: unix://%s\nimage-endpoint: unix://%s\ntimeout: 60\n", c.Socket, c.Socket)
	if err := os.WriteFile(c.CrictlConfig, []byte(crictl), 0o600); err != nil {
		return nil, err
	}
	if opts.BeforeStart != nil {
		if err := opts.BeforeStart(c); err != nil {
			return nil, err
		}
	}
	if err := c.Start(); err != nil {
		return nil, err
	}
	if !opts.SkipImages {
		if err := c.ImportImage(ImageTar); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// configText is containerd's config in the format of the runtime under test
// (version 3 for 2.x, version 2 for 1.7): every path in the temp dir, NRI on
// (1.7 has it off by default) with short timeouts, overlayfs, the pinned
// sandbox image, restrict_oom_score_adj (the CRI sandbox's -998 is refused on
// hosts that do not allow lowering it), and CDI specs read only from CDIDir
// (1.7 also needs CDI turned on).
func (c *Containerd) configText() string {
	var b strings.Builder
	fmt.Fprintf(&b, "version = %d\n", configVersion(Runtime))
	if len(c.opts.Imports) > 0 {
		q := make([]string, len(c.opts.Imports))
		for i, p := range c.opts.Imports {
			q[i] = tomlString(p)
		}
		fmt.Fprintf(&b, "imports = [%s]\n", strings.Join(q, ", "))
	}
	fmt.Fprintf(&b, `root = %s
state = %s

[grpc]
  address = %s

[plugins."io.containerd.nri.v1.nri"]
  disable = false
  socket_path = %s
  plugin_path = %s
  plugin_config_path = %s
  plugin_registration_timeout = "5s"
  plugin_request_timeout = "2s"
`, tomlString(filepath.Join(c.Dir, "root")), tomlString(filepath.Join(c.Dir, "state")), tomlString(c.Socket),
		tomlString(c.NRISocket), tomlString(c.PluginPath), tomlString(c.PluginConfigPath))
	if configVersion(Runtime) == 2 {
		fmt.Fprintf(&b, `
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %s
  restrict_oom_score_adj = true
  enable_cdi = true
  cdi_spec_dirs = [%s]
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
`, tomlString(SandboxImage), tomlString(c.CDIDir))
		if RuncBinary != "" {
			fmt.Fprintf(&b, `  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      BinaryName = %s
`, tomlString(RuncBinary))
		}
	} else {
		fmt.Fprintf(&b, `
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = %s

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  cdi_spec_dirs = [%s]
`, tomlString(SandboxImage), tomlString(c.CDIDir))
		if RuncBinary != "" {
			fmt.Fprintf(&b, `  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
      BinaryName = %s
`, tomlString(RuncBinary))
		}
	}
	if c.opts.ExtraConfig != "" {
		b.WriteString("\n" + c.opts.ExtraConfig + "\n")
	}
	return b.String()
}

// tomlString quotes s as a TOML basic string (JSON's escapes are valid).
func tomlString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// makeFakeGPUs creates /dev/nvidiaN-like nodes in DevDir and a CDI spec
// (kind nvidia.com/gpu, devices named by index) pointing at them.
func (c *Containerd) makeFakeGPUs() error {
	type deviceNode struct {
		Path     string `json:"path"`
		HostPath string `json:"hostPath"`
	}
	type edits struct {
		DeviceNodes []deviceNode `json:"deviceNodes"`
		Env         []string     `json:"env"`
	}
	type device struct {
		Name           string `json:"name"`
		ContainerEdits edits  `json:"containerEdits"`
	}
	spec := struct {
		CDIVersion string   `json:"cdiVersion"`
		Kind       string   `json:"kind"`
		Devices    []device `json:"devices"`
	}{CDIVersion: "0.6.0", Kind: "nvidia.com/gpu"}
	for _, g := range c.GPUs {
		node := c.DevicePath(g.Index)
		dev := nvidiaMajor<<8 | g.Minor // Linux makedev for minors < 256
		if err := syscall.Mknod(node, syscall.S_IFCHR|0o666, dev); err != nil {
			return fmt.Errorf("mknod %s c %d %d: %w", node, nvidiaMajor, g.Minor, err)
		}
		spec.Devices = append(spec.Devices, device{
			Name: fmt.Sprint(g.Index),
			ContainerEdits: edits{
				DeviceNodes: []deviceNode{{Path: fmt.Sprintf("/dev/nvidia%d", g.Minor), HostPath: node}},
				Env:         []string{fmt.Sprintf("GPU_GUARD_TEST_CDI_DEVICE=%d", g.Index)},
			},
		})
	}
	b, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(c.CDIDir, "nvidia-gpu-guard-test.json"), b, 0o600)
}

// DevicePath is the host path of the fake device node of GPU index i.
func (c *Containerd) DevicePath(i int) string {
	return filepath.Join(c.DevDir, fmt.Sprintf("nvidia%d", c.GPUs[i].Minor))
}

// env is the environment of containerd and the tools: the version's dir
// first on PATH (containerd finds its shim there, the shim finds runc).
func (c *Containerd) env() []string {
	path := ContainerdDir + string(os.PathListSeparator) + os.Getenv("PATH")
	return []string{"PATH=" + path, "HOME=" + os.Getenv("HOME"), "TMPDIR=" + c.Dir}
}

// Start starts containerd (again) and waits until CRI answers.
func (c *Containerd) Start() error {
	if c.proc != nil {
		if ok, _ := c.proc.exited(); !ok {
			return fmt.Errorf("containerd (pid %d) is already running", c.proc.Pid())
		}
	}
	from := fileSize(c.LogPath)
	p, err := startProcess("containerd", c.LogPath, c.env(), filepath.Join(ContainerdDir, "containerd"), "--config", c.ConfigPath)
	if err != nil {
		return err
	}
	c.proc = p
	err = poll(startTimeout, func() (bool, error) {
		if ok, werr := p.exited(); ok {
			return false, fmt.Errorf("containerd exited during start: %w; log:\n%s", exitError(werr), logTail(c.LogPath, from, 30))
		}
		if _, err := os.Stat(c.Socket); err != nil {
			return false, nil
		}
		// `crictl info` succeeds once the CRI service is initialised.
		_, err := c.Crictl("info")
		return err == nil, nil
	})
	if err != nil {
		return fmt.Errorf("containerd did not become ready: %w; log:\n%s", err, logTail(c.LogPath, from, 30))
	}
	return nil
}

// Stop stops containerd by its pid (SIGTERM, then SIGKILL). Containers keep
// running: their shims do not depend on the daemon.
func (c *Containerd) Stop() error {
	if c.proc == nil {
		return nil
	}
	return c.proc.stop(stopTimeout)
}

// Restart stops and starts containerd.
func (c *Containerd) Restart(t testing.TB) {
	t.Helper()
	if err := c.Stop(); err != nil {
		t.Fatalf("stop containerd: %v", err)
	}
	if err := c.Start(); err != nil {
		t.Fatalf("restart containerd: %v", err)
	}
}

// Pid is containerd's process id (0 before the first start).
func (c *Containerd) Pid() int {
	if c.proc == nil {
		return 0
	}
	return c.proc.Pid()
}

// Running reports whether containerd is up.
func (c *Containerd) Running() bool {
	if c.proc == nil {
		return false
	}
	ok, _ := c.proc.exited()
	return !ok
}

// Close removes every pod (while containerd runs), stops containerd by its
// pid, kills whatever still runs from the temp dir, unmounts what is mounted
// under it and removes it.
func (c *Containerd) Close() error {
	var errs []error
	if c.Running() {
		if _, err := c.Crictl("rmp", "--force", "--all"); err != nil {
			errs = append(errs, fmt.Errorf("remove pods: %w", err))
		}
		if err := c.Stop(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := sweep(c.Dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// ImportImage imports an OCI layout tar into the CRI namespace.
func (c *Containerd) ImportImage(tar string) error {
	_, err := c.Ctr("images", "import", tar)
	return err
}

// Crictl runs crictl against this containerd and returns its stdout.
func (c *Containerd) Crictl(args ...string) (string, error) {
	return runTool(c.env(), filepath.Join(ToolsDir, "crictl"), append([]string{"--config", c.CrictlConfig}, args...)...)
}

// Ctr runs ctr against this containerd in the k8s.io namespace. A `ctr
// run` uses RuncBinary, when the harness has one, as CRI containers do.
func (c *Containerd) Ctr(args ...string) (string, error) {
	if len(args) > 0 && args[0] == "run" && RuncBinary != "" {
		args = append([]string{"run", "--runc-binary", RuncBinary}, args[1:]...)
	}
	return runTool(c.env(), filepath.Join(ContainerdDir, "ctr"), append([]string{"--address", c.Socket, "--namespace", "k8s.io"}, args...)...)
}

// ToolError is a failed tool invocation with its output.
type ToolError struct {
	Args   []string
	Stdout string
	Stderr string
	Err    error
}

func (e *ToolError) Error() string {
	return fmt.Sprintf("%s: %v: %s", strings.Join(e.Args, " "), e.Err, strings.TrimSpace(e.Stderr))
}

func (e *ToolError) Unwrap() error { return e.Err }

// runTool runs bin with a bounded time and returns its stdout.
func runTool(env []string, bin string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), cmdTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = env
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), &ToolError{Args: append([]string{filepath.Base(bin)}, args...), Stdout: stdout.String(), Stderr: stderr.String(), Err: err}
	}
	return stdout.String(), nil
}

// exitCode is the exit status of a tool runTool ran: 0 for no error, -1
// when the tool did not exit by itself (it could not start, or was killed).
func exitCode(err error) int {
	if err == nil {
		return 0
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	return -1
}

// statusAttention is `gpu-guard-ctl status`'s documented exit status when a
// problem (a conflict, a stale claim, an intruder) needs an operator.
const statusAttention = 3

// uniqueFile returns a new path in the temp dir for a generated file.
func (c *Containerd) uniqueFile(name string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seq++
	return filepath.Join(c.Dir, "cri", fmt.Sprintf("%03d-%s", c.seq, name))
}

// logOffset is where containerd's log ends now.
func (c *Containerd) logOffset() int64 { return fileSize(c.LogPath) }

// logged reports whether containerd's log, after offset from, has a message
// containing msg, and returns the lines that mention any of also (for a
// failure report).
func (c *Containerd) logged(from int64, msg string, also ...string) (bool, string) {
	b, err := os.ReadFile(c.LogPath)
	if err != nil || int64(len(b)) < from {
		return false, fmt.Sprint(err)
	}
	text := string(b[from:])
	var related []string
	for _, line := range strings.Split(text, "\n") {
		for _, a := range also {
			if strings.Contains(line, a) {
				related = append(related, line)
				break
			}
		}
	}
	return strings.Contains(text, logEscape(msg)), strings.Join(related, "\n")
}

// logEscape is msg as logrus writes it inside msg="...".
func logEscape(msg string) string { return strings.Trim(strconv.Quote(msg), `"`) }

// waitLog waits until containerd's log, after offset from, has a message
// containing msg (as written: logrus escapes the quotes in msg="...").
func (c *Containerd) waitLog(t testing.TB, from int64, msg string, timeout time.Duration) {
	t.Helper()
	escaped := logEscape(msg)
	waitFor(t, timeout, fmt.Sprintf("containerd to log %q", msg), func() (bool, string) {
		b, err := os.ReadFile(c.LogPath)
		if err != nil || int64(len(b)) < from {
			return false, fmt.Sprint(err)
		}
		return strings.Contains(string(b[from:]), escaped), logTail(c.LogPath, from, 5)
	})
}
