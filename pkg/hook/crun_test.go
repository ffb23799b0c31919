// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// crunIn runs crun with args in a mount namespace of its own where the
// cgroup2 hierarchy of a hybrid cgroup host (/sys/fs/cgroup/unified) is
// unmounted: crun 1.8 refuses such a host. env is crun's environment. Its
// output goes to a file, not a pipe: the process of a created container
// keeps crun's stdio open.
func crunIn(t *testing.T, crun string, env []string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), condTimeout)
	defer cancel()
	out, err := os.CreateTemp(t.TempDir(), "crun-out")
	require.NoError(t, err)
	defer func() { _ = out.Close() }()
	script := `! mountpoint -q /sys/fs/cgroup/unified || umount /sys/fs/cgroup/unified; exec "$@"`
	cmd := exec.CommandContext(ctx, "unshare", append([]string{"--mount", "--propagation", "private", "sh", "-c", script, "sh", crun}, args...)...)
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = out, out
	err = cmd.Run()
	data, rerr := os.ReadFile(out.Name())
	require.NoError(t, rerr)
	return string(data), err
}

// A crun run as root without --root keeps its state in
// $XDG_RUNTIME_DIR/crun when its environment sets XDG_RUNTIME_DIR (a root
// login session sets /run/user/0). crun 1.8 gives a container with a user
// namespace and a device the bundle "/", and the hook reads crun's copy of
// the spec there: the container claims its GPU, and `crun delete`'s
// poststop releases it and removes its marker. Real crun, as root.
func TestCrunXDGRuntimeDir(t *testing.T) {
	r := newRig(t, rigOpts{})
	crun, err := exec.LookPath("crun")
	if err != nil {
		t.Skip("crun not installed")
	}
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skip("unshare not installed")
	}
	xdg := filepath.Join(r.base, "xdg")
	require.NoError(t, os.Mkdir(xdg, 0o700))
	id := "ggcrun-" + strconv.Itoa(os.Getpid())
	bundle := filepath.Join(r.base, "b", id)
	require.NoError(t, os.MkdirAll(bundle, 0o755))
	caps := []string{"CAP_CHOWN"}
	env := RuntimeEnv()
	spec := specs.Spec{
		Version: "1.0.2", // crun 1.8 refuses versions it does not know
		Root:    &specs.Root{Path: r.rootfs, Readonly: true},
		Process: &specs.Process{
			Args: []string{"/ctrprog", "/shared", id, "exit"}, Env: append([]string{"PATH=/"}, gpuEnv(2)...), Cwd: "/",
			Capabilities: &specs.LinuxCapabilities{Bounding: caps, Effective: caps, Permitted: caps},
		},
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "mode=755"}},
		},
		Hooks: &specs.Hooks{
			CreateRuntime: []specs.Hook{{Path: hookBin, Args: []string{"nri-gpu-guard-hook", PhaseCreateRuntime, "--config", r.cfgPath}, Env: env}},
			Poststop:      []specs.Hook{{Path: hookBin, Args: []string{"nri-gpu-guard-hook", PhasePoststop, "--config", r.cfgPath}, Env: env}},
		},
		Linux: &specs.Linux{
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace}, {Type: specs.MountNamespace}, {Type: specs.UserNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
			},
			// Root's own ids: the container's root reaches the rig's
			// private (0700) directories.
			UIDMappings: []specs.LinuxIDMapping{{ContainerID: 0, HostID: 0, Size: 65536}},
			GIDMappings: []specs.LinuxIDMapping{{ContainerID: 0, HostID: 0, Size: 65536}},
			Devices:     []specs.LinuxDevice{{Path: "/dev/zero", Type: "c", Major: 1, Minor: 5}},
		},
	}
	data, err := json.Marshal(spec)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))

	crunEnv := []string{"PATH=" + os.Getenv("PATH"), "XDG_RUNTIME_DIR=" + xdg}
	t.Cleanup(func() { _, _ = crunIn(t, crun, crunEnv, "delete", "--force", id) })
	out, err := crunIn(t, crun, crunEnv, "--cgroup-manager=disabled", "create", "--bundle", bundle, id)
	require.NoError(t, err, out)
	require.DirExists(t, filepath.Join(xdg, "crun", id), "crun keeps its state under XDG_RUNTIME_DIR")
	if out, err := crunIn(t, crun, crunEnv, "state", id); err == nil {
		var st specs.State
		if json.Unmarshal([]byte(out), &st) == nil {
			t.Logf("crun reports the bundle %q", st.Bundle) // "/" for crun 1.8
		}
	}
	require.Equal(t, map[string]string{gpuUUIDs[2]: id}, holdersOf(r.state()))
	mk := filepath.Join(DefaultMarkerDir, markerName(id, bundle))
	require.FileExists(t, mk)

	// The container's process goes first: without a cgroup
	// (--cgroup-manager=disabled) `crun delete --force` runs poststop
	// without waiting for the process it kills, which poststop then finds
	// running, as another container's of the id would be.
	owner := r.state().Claims[0].Owner
	require.NoError(t, syscall.Kill(owner.Pid, syscall.SIGKILL))
	r.waitFor("the container's process to end", func() bool { return !liveness.Running("/proc", owner.Pid, owner.PidStart) })
	out, err = crunIn(t, crun, crunEnv, "delete", "--force", id)
	require.NoError(t, err, out)
	require.Empty(t, r.state().Claims, "crun delete's poststop released the claim")
	require.NoFileExists(t, mk, "and removed the marker")
}
