// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

var (
	ctrProgOnce sync.Once
	ctrProg     string // the static container program (pkg/hook/testdata/ctrprog)
	ctrProgErr  error
)

// buildCtrProg builds the program the containers run, statically, into the
// test binaries' dir.
func buildCtrProg(t *testing.T) string {
	t.Helper()
	ctrProgOnce.Do(func() {
		ctrProg = filepath.Join(binDir, "ctrprog")
		cmd := exec.Command("go", "build", "-tags", "nri_no_wasm", "-trimpath", "-o", ctrProg, "../../pkg/hook/testdata/ctrprog")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			ctrProgErr = fmt.Errorf("go build ctrprog: %w\n%s", err, out)
		}
	})
	require.NoError(t, ctrProgErr)
	return ctrProg
}

// runtimeHost is a hook-only host whose containers are real runc and crun
// containers, admitted by the real hook, with the runtimes' state in roots
// of the test that [hook] runtime_roots names.
type runtimeHost struct {
	*host
	tmp      string // short paths: runc and crun keep fifos below their roots
	runcRoot string
	crunRoot string
	rootfs   string
	// rootfsMounted: rootfs is a nodev bind of itself, undone by cleanup.
	rootfsMounted bool
	shared        string
	cfgPath       string
	runc          string
	crun          string
}

func newRuntimeHost(t *testing.T) *runtimeHost {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("runc and crun containers need root")
	}
	h := &runtimeHost{host: newHost(t)}
	var err error
	if h.runc, err = exec.LookPath("runc"); err != nil {
		t.Skip("runc is not installed")
	}
	if h.crun, err = exec.LookPath("crun"); err != nil {
		t.Skip("crun is not installed")
	}
	prog := buildCtrProg(t)
	h.tmp, err = os.MkdirTemp("", "gga")
	require.NoError(t, err)
	h.runcRoot, h.crunRoot = filepath.Join(h.tmp, "runc"), filepath.Join(h.tmp, "crun")
	h.rootfs, h.shared = filepath.Join(h.tmp, "rootfs"), filepath.Join(h.tmp, "shared")
	for _, d := range []string{h.runcRoot, h.crunRoot, h.shared, filepath.Join(h.rootfs, "proc"), filepath.Join(h.rootfs, "dev"),
		filepath.Join(h.rootfs, "shared")} {
		require.NoError(t, os.MkdirAll(d, 0o755))
	}
	data, err := os.ReadFile(prog)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(h.rootfs, "ctrprog"), data, 0o755))
	t.Cleanup(h.cleanup)
	// The rootfs is mounted nodev, as container storage should be. The
	// containers run in device cgroups of their own (cgroupName), which
	// the hook and recovery know by their names: without one, crun (and
	// runc for a read-only root) drops the root's nodev, so that a node
	// its image may carry opens and the container counts as reaching
	// every GPU, and recovery, which cannot tell the runtime, counts
	// every such container so.
	require.NoError(t, unix.Mount(h.rootfs, h.rootfs, "", unix.MS_BIND, ""))
	h.rootfsMounted = true
	require.NoError(t, unix.Mount("", h.rootfs, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_NODEV, ""))

	cfg, err := os.ReadFile(h.host.cfgPath)
	require.NoError(t, err)
	roots := fmt.Sprintf("runtime_roots = [%q, %q]", h.runcRoot, h.crunRoot)
	next := strings.Replace(string(cfg), "runtime_roots = []", roots, 1)
	require.NotEqual(t, string(cfg), next, "the host's configuration has a runtime_roots line")
	h.cfgPath = filepath.Join(h.base, "config-runtimes.toml")
	require.NoError(t, os.WriteFile(h.cfgPath, []byte(next), 0o600))
	return h
}

// runtimeCmd runs a runtime command. crun 1.8 refuses a hybrid cgroup host
// (cgroup v1 with a v2 hierarchy at /sys/fs/cgroup/unified): it runs in a
// private mount namespace without that hierarchy.
func (h *runtimeHost) runtimeCmd(runtime string, args ...string) *exec.Cmd {
	if runtime == "runc" {
		return exec.Command(h.runc, append([]string{"--root", h.runcRoot}, args...)...)
	}
	script := `if mountpoint -q /sys/fs/cgroup/unified && [ -d /sys/fs/cgroup/memory ]; then umount /sys/fs/cgroup/unified || exit 1; fi; exec "$@"`
	return exec.Command("unshare", append([]string{"--mount", "--propagation", "private", "sh", "-c", script, "sh",
		h.crun, "--root", h.crunRoot}, args...)...)
}

// cgroupName is container id's cgroup: a leaf named after it (runc's
// cgroupfs default), below one of the test's own.
func (h *runtimeHost) cgroupName(id string) string { return filepath.Join(h.cgroupParent(), id) }

func (h *runtimeHost) cgroupParent() string { return "gga-" + filepath.Base(h.tmp) }

// start runs container id detached with runtime, its createRuntime and
// poststop hooks being the real hook on the host's configuration, and
// returns the runtime's exit error and output.
func (h *runtimeHost) start(runtime, id string, env ...string) (string, error) {
	t := h.t
	caps := []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL"}
	spec := specs.Spec{
		// The version runc 1.1 and crun 1.8 write and accept (crun refuses
		// a newer one).
		Version: "1.0.2",
		Root:    &specs.Root{Path: h.rootfs, Readonly: true},
		Process: &specs.Process{
			Args:            []string{"/ctrprog", "/shared", id, "wait"},
			Env:             append([]string{"PATH=/"}, env...),
			Cwd:             "/",
			Capabilities:    &specs.LinuxCapabilities{Bounding: caps, Effective: caps, Permitted: caps},
			NoNewPrivileges: true,
		},
		Hostname: id,
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			// nodev: without a device cgroup a directory bound in whose
			// nodes open counts as opening every GPU.
			{Destination: "/shared", Type: "bind", Source: h.shared, Options: []string{"rbind", "rw", "nodev"}},
		},
		Linux: &specs.Linux{
			CgroupsPath: "/" + h.cgroupName(id),
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace}, {Type: specs.MountNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
			},
		},
		Hooks: &specs.Hooks{
			CreateRuntime: []specs.Hook{{Path: hookBin, Args: []string{"nri-gpu-guard-hook", hook.PhaseCreateRuntime, "--config", h.cfgPath}}},
			Poststop:      []specs.Hook{{Path: hookBin, Args: []string{"nri-gpu-guard-hook", hook.PhasePoststop, "--config", h.cfgPath}}},
		},
	}
	bundle := filepath.Join(h.tmp, "b", id)
	require.NoError(t, os.MkdirAll(bundle, 0o755))
	data, err := json.Marshal(spec)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
	// The container inherits the runtime's stdio: a file, not a pipe, which
	// the container would keep open after the runtime returned.
	logPath := filepath.Join(h.tmp, id+".log")
	log, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	require.NoError(t, err)
	defer func() { _ = log.Close() }()
	cmd := h.runtimeCmd(runtime, "run", "--detach", "--bundle", bundle, id)
	cmd.Stdout, cmd.Stderr = log, log
	err = cmd.Run()
	out, _ := os.ReadFile(logPath)
	return string(out), err
}

// cleanup stops every container (its poststop hook runs) and removes what
// the runtimes left.
func (h *runtimeHost) cleanup() {
	for _, rt := range []struct{ name, root string }{{"runc", h.runcRoot}, {"crun", h.crunRoot}} {
		entries, _ := os.ReadDir(rt.root)
		for _, e := range entries {
			_ = os.WriteFile(filepath.Join(h.shared, e.Name()+".release"), nil, 0o600)
			_ = h.runtimeCmd(rt.name, "delete", "--force", e.Name()).Run()
			dirs, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", h.cgroupName(e.Name())))
			for _, d := range append(dirs, filepath.Join("/sys/fs/cgroup", h.cgroupName(e.Name()))) {
				_ = os.Remove(d) // rmdir: only an empty cgroup goes
			}
		}
	}
	parents, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", h.cgroupParent()))
	for _, d := range append(parents, filepath.Join("/sys/fs/cgroup", h.cgroupParent())) {
		_ = os.Remove(d)
	}
	if h.rootfsMounted {
		_ = unix.Unmount(h.rootfs, unix.MNT_DETACH)
	}
	_ = os.RemoveAll(h.tmp)
}

// ctl runs gpu-guard-ctl with the configuration that names the runtime
// roots.
func (h *runtimeHost) ctl(args ...string) result {
	h.t.Helper()
	return runProc(h.t, nil, ctlBin, append([]string{"--config", h.cfgPath}, args...)...)
}

func (h *runtimeHost) holdersNow() map[string]string {
	st, err := h.snapshot()
	require.NoError(h.t, err)
	return h.holders(st)
}

// TestRecoverAdoptsRealContainers: a runc and a crun container admitted by
// the real hook after the last snapshot lose their claims when the
// journal is damaged. While the ledger needs recovery every GPU request is
// refused; `gpu-guard-ctl recover` finds both running in the runtimes'
// state and adopts their GPUs back (the one admitted before the snapshot
// keeps its own), and the next create-runtime for their GPUs is refused as
// busy, naming them. Stopping one releases its GPU through its poststop hook.
func TestRecoverAdoptsRealContainers(t *testing.T) {
	h := newRuntimeHost(t)
	out, err := h.start("runc", "a", gpuEnv(0))
	require.NoError(t, err, "runc run a: %s", out)
	require.Equal(t, map[string]string{"0": "a"}, h.holdersNow())

	// a's claim into the snapshot (a recovery writes one): the damage below
	// loses only what comes after. a runs and holds GPU 0: nothing to adopt.
	rewrite(snapshotFile, func([]byte) []byte { return nil })(t, h.stateDir)
	r := h.ctl("recover", "-o", "json")
	require.Equal(t, 0, r.code, "recover: %s", r)
	var rep struct {
		Complete bool           `json:"complete"`
		Lost     string         `json:"lost"`
		Adopted  []ledger.Claim `json:"adopted"`
		Runtime  *struct {
			Live     int `json:"live"`
			Problems []struct {
				Path, Error string
			} `json:"problems"`
		} `json:"runtime"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &rep), r.stdout)
	require.True(t, rep.Complete)
	require.Empty(t, rep.Adopted)
	require.NotNil(t, rep.Runtime)
	require.Equal(t, 1, rep.Runtime.Live)

	out, err = h.start("runc", "b", gpuEnv(1))
	require.NoError(t, err, "runc run b: %s", out)
	out, err = h.start("crun", "c", gpuEnv(2))
	require.NoError(t, err, "crun run c: %s", out)
	require.Equal(t, map[string]string{"0": "a", "1": "b", "2": "c"}, h.holdersNow())

	// Damage b's record, the journal's first after its header: the claims
	// of b and c are lost for good.
	p := filepath.Join(h.stateDir, journalFile)
	j, err := os.ReadFile(p)
	require.NoError(t, err)
	lines := bytes.SplitAfter(j, []byte("\n"))
	require.GreaterOrEqual(t, len(lines), 3, "a header and the records of b and c")
	off := len(lines[0]) + len(lines[1])/2
	j[off] ^= 0x20
	require.NoError(t, os.WriteFile(p, j, 0o600))

	r = h.hook(hook.PhaseCreateRuntime, "late", h.ctrProcess(), gpuEnv(1))
	require.Equal(t, hook.ExitRefused, r.code, "the ledger needs recovery: b's GPU is not handed out: %s", r)
	assert.Contains(t, r.stderr, "gpu-guard-ctl recover")

	// Without the runtimes' state, b and c would be gone: shown, not done.
	r = h.ctl("recover", "--dry-run", "--no-runtime", "-o", "json")
	require.Equal(t, 0, r.code, "recover --dry-run --no-runtime: %s", r)
	rep.Adopted, rep.Runtime = nil, nil
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &rep), r.stdout)
	require.False(t, rep.Complete)
	require.Empty(t, rep.Adopted)

	r = h.ctl("recover")
	require.Equal(t, 0, r.code, "recover: %s", r)
	assert.Contains(t, r.stdout, "LOST:")
	assert.Contains(t, r.stdout, "adopted (running without a claim): GPU 1")
	assert.Contains(t, r.stdout, "adopted (running without a claim): GPU 2")
	require.Equal(t, map[string]string{"0": "a", "1": "b", "2": "c"}, h.holdersNow(), "b and c hold their GPUs again")

	var reasons []string
	recs, err := ledger.ReadAudit(filepath.Join(h.stateDir, "audit.log"))
	require.NoError(t, err)
	for _, rec := range recs {
		if rec.Op == ledger.OpAdopt {
			reasons = append(reasons, rec.ContainerID+": "+rec.Reason)
		}
	}
	assert.Equal(t, []string{
		"b: recover: found running in runc state (" + h.runcRoot + ")",
		"c: recover: found running in crun state (" + h.crunRoot + ")",
	}, reasons)

	for gpu, holder := range map[int]string{1: "b", 2: "c", 0: "a"} {
		r = h.hook(hook.PhaseCreateRuntime, fmt.Sprintf("late%d", gpu), h.ctrProcess(), gpuEnv(gpu))
		require.Equal(t, hook.ExitBusy, r.code, "GPU %d is held by %s: %s", gpu, holder, r)
		assert.Contains(t, r.stderr, "is held by container "+holder)
	}

	// c stops: its poststop hook releases GPU 2, and the GPU is free again.
	require.NoError(t, os.WriteFile(filepath.Join(h.shared, "c.release"), nil, 0o600))
	out2, err := h.runtimeCmd("crun", "delete", "--force", "c").CombinedOutput()
	require.NoError(t, err, "crun delete c: %s", out2)
	h.waitFor("c's poststop", func() bool { _, held := h.holdersNow()["2"]; return !held })
	r = h.hook(hook.PhaseCreateRuntime, "next", h.ctrProcess(), gpuEnv(2))
	require.Equal(t, 0, r.code, "GPU 2 is free after c stopped: %s", r)
}
