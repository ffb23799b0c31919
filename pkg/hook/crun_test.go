// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
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

// nodevVolume is a directory on a nodev tmpfs below base, holding the device
// node "node" (c 1:3, /dev/null's numbers: where it opens, a GPU's would),
// as a named volume an engine filled from an image may hold one.
func nodevVolume(t *testing.T, base string) string {
	t.Helper()
	dir := filepath.Join(base, "vol")
	require.NoError(t, os.Mkdir(dir, 0o755))
	mountT(t, "gg", dir, "tmpfs", unix.MS_NODEV)
	require.NoError(t, unix.Mknod(filepath.Join(dir, "node"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	return dir
}

// crun 1.8 remounts every bind with the flags its options make, so a
// directory on a nodev mount bound with "rbind" alone is not nodev in the
// container: a device node in it opens where no device cgroup applies
// (--cgroup-manager=disabled). The hook, run by crun (its parent), counts
// such a directory as reaching every GPU node: the container claims every
// GPU, the claims naming the directory, and under all_devices = "reject"
// it is refused with the remedy, the bind's nodev option. With that option
// the node does not open and the container reaches no GPU. runc's
// counterpart, which keeps the source's nodev: TestRuncBindFromNodevMount.
// Real crun, as root.
func TestCrunBindFromNodevMount(t *testing.T) {
	r := newRig(t, rigOpts{})
	crun, err := exec.LookPath("crun")
	if err != nil {
		t.Skip("crun not installed")
	}
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skip("unshare not installed")
	}
	vol := nodevVolume(t, r.base)
	require.NoError(t, os.Mkdir(filepath.Join(r.rootfs, "data"), 0o755))
	reject := r.cfg
	reject.Policy.AllDevices = config.AllReject
	rejectPath := r.writeConfig("reject.toml", reject)
	f, err := os.OpenFile(rejectPath, os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(t, err)
	_, err = f.WriteString("[policy]\nall_devices = \"reject\"\n")
	require.NoError(t, errors.Join(err, f.Close()))
	got, err := config.LoadFile(rejectPath)
	require.NoError(t, err)
	require.Equal(t, config.AllReject, got.Policy.AllDevices)

	crunRoot := filepath.Join(r.base, "crun")
	crunEnv := []string{"PATH=" + os.Getenv("PATH")}
	run := func(args ...string) (string, error) {
		return crunIn(t, crun, crunEnv, append([]string{"--root", crunRoot}, args...)...)
	}
	// create makes container id, whose hooks read cfgPath, binding vol at
	// /data with opts; its program opens /data/node once started. Its
	// output is crun's, then its hooks' (crun writes theirs to the file its
	// run.oci.hooks.stderr annotation names).
	create := func(id, cfgPath string, opts ...string) (string, error) {
		hookErr := filepath.Join(r.base, id+".hook-stderr")
		caps := []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL"}
		env := RuntimeEnv()
		spec := specs.Spec{
			Version: "1.0.2", // crun 1.8 refuses versions it does not know
			Root:    &specs.Root{Path: r.rootfs, Readonly: true},
			Process: &specs.Process{
				Args: []string{"/ctrprog", "/shared", id, "open:/data/node"}, Env: []string{"PATH=/"}, Cwd: "/",
				Capabilities: &specs.LinuxCapabilities{Bounding: caps, Effective: caps, Permitted: caps},
			},
			Mounts: []specs.Mount{
				{Destination: "/proc", Type: "proc", Source: "proc"},
				{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "mode=755"}},
				{Destination: "/shared", Type: "bind", Source: r.shared, Options: []string{"rbind", "rw", "nodev"}},
				{Destination: "/data", Type: "bind", Source: vol, Options: opts},
			},
			Hooks: &specs.Hooks{
				CreateRuntime: []specs.Hook{{Path: hookBin, Args: []string{"nri-gpu-guard-hook", PhaseCreateRuntime, "--config", cfgPath}, Env: env}},
				Poststop:      []specs.Hook{{Path: hookBin, Args: []string{"nri-gpu-guard-hook", PhasePoststop, "--config", cfgPath}, Env: env}},
			},
			Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace}, {Type: specs.MountNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
			}},
			Annotations: map[string]string{"run.oci.hooks.stderr": hookErr},
		}
		bundle := filepath.Join(r.base, "b", id)
		require.NoError(t, os.MkdirAll(bundle, 0o755))
		data, err := json.Marshal(spec)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
		t.Cleanup(func() { _, _ = run("delete", "--force", id) })
		out, err := run("--cgroup-manager=disabled", "create", "--bundle", bundle, id)
		hookOut, rerr := os.ReadFile(hookErr)
		if !errors.Is(rerr, os.ErrNotExist) {
			require.NoError(t, rerr)
		}
		return out + string(hookOut), err
	}
	// opens starts container id and returns what its program's open of
	// /data/node gave, once its process is gone.
	opens := func(id string, pid int) string {
		out, err := run("start", id)
		require.NoError(t, err, out)
		r.waitFor(id+"'s program to exit", func() bool { return slices.Contains(r.order(), id+" exit") })
		r.waitFor(id+"'s process to end", func() bool { return !liveness.Running("/proc", pid, 0) })
		for _, l := range r.order() {
			if rest, ok := strings.CutPrefix(l, id+" open "); ok {
				return rest
			}
		}
		t.Fatalf("%s recorded no open: %q", id, r.order())
		return ""
	}
	crunPid := func(id string) int {
		out, err := run("state", id)
		require.NoError(t, err, out)
		var st specs.State
		require.NoError(t, json.Unmarshal([]byte(out), &st), out)
		return st.Pid
	}

	out, err := create("refused", rejectPath, "rbind")
	require.Error(t, err, "a directory from a nodev mount bound without nodev, under crun: %s", out)
	require.Contains(t, out, "bind source "+vol+" not mounted nodev")
	require.Contains(t, out, "give its bind the nodev option")
	require.Empty(t, r.state().Claims)

	out, err = create("claimed", r.cfgPath, "rbind")
	require.NoError(t, err, out)
	want := map[string]string{}
	for _, u := range gpuUUIDs {
		want[u] = "claimed"
	}
	require.Equal(t, want, holdersOf(r.state()), "every GPU: the directory's nodes open")
	for _, c := range r.state().Claims {
		require.Contains(t, c.Source, "bind source "+vol+" not mounted nodev")
	}
	require.Equal(t, "ok", opens("claimed", crunPid("claimed")), "crun does not keep the source's nodev: the node opens")
	out, err = run("delete", "--force", "claimed")
	require.NoError(t, err, out)
	require.Empty(t, r.state().Claims, "crun delete's poststop released them")

	out, err = create("nodev", r.cfgPath, "rbind", "nodev")
	require.NoError(t, err, out)
	require.Empty(t, r.state().Claims, "the bind's nodev option: no GPU")
	require.Contains(t, opens("nodev", crunPid("nodev")), "permission denied", "the bind is nodev")
}
