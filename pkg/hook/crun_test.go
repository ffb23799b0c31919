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
// the spec there: the container claims its GPU (that one alone: in its
// user namespace the kernel keeps the nodev of its root's mount, which crun
// drops elsewhere), and `crun delete`'s poststop releases it and removes
// its marker. Real crun, as root.
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
	// Only the GPU it names: crun drops the nodev of the rig's rootfs
	// outside a user namespace (the hook then counts its root as reaching
	// every GPU, a node its image may carry), but the container's user
	// namespace locks it, and the hook reads the container's process in
	// another user namespace than its own.
	require.Equal(t, map[string]string{gpuUUIDs[2]: id}, holdersOf(r.state()))
	for _, c := range r.state().Claims {
		require.Contains(t, c.Source, "NVIDIA_VISIBLE_DEVICES", "the GPU it names is named so")
	}
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

// crunBox runs containers of a rig under crun --cgroup-manager=disabled
// (podman --cgroups=disabled's crun: no device cgroup), each running the
// container program on the rig's rootfs (mounted nodev), with the rig's
// /shared, its hooks the real hook.
type crunBox struct {
	t    *testing.T
	r    *rig
	crun string
	root string
	// userNS gives the containers a user namespace of their own, mapped
	// to root's own ids (the container's root reaches the rig's private
	// directories).
	userNS bool
}

// newCrunBox skips the test where crun or unshare is not installed.
func newCrunBox(t *testing.T, r *rig) *crunBox {
	t.Helper()
	crun, err := exec.LookPath("crun")
	if err != nil {
		t.Skip("crun not installed")
	}
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skip("unshare not installed")
	}
	return &crunBox{t: t, r: r, crun: crun, root: filepath.Join(r.base, "crun")}
}

// run runs crun with args under the box's state root.
func (c *crunBox) run(args ...string) (string, error) {
	return crunIn(c.t, c.crun, []string{"PATH=" + os.Getenv("PATH")}, append([]string{"--root", c.root}, args...)...)
}

// create makes container id, whose hooks read cfgPath, with a read-only
// root where readonly says so, and mounts after the rig's; its program
// opens path once started. Its output is crun's, then its hooks' (crun
// writes theirs to the file its run.oci.hooks.stderr annotation names).
func (c *crunBox) create(id, cfgPath string, readonly bool, path string, mounts ...specs.Mount) (string, error) {
	t, r := c.t, c.r
	hookErr := filepath.Join(r.base, id+".hook-stderr")
	caps := []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL"}
	env := RuntimeEnv()
	spec := specs.Spec{
		Version: "1.0.2", // crun 1.8 refuses versions it does not know
		Root:    &specs.Root{Path: r.rootfs, Readonly: readonly},
		Process: &specs.Process{
			Args: []string{"/ctrprog", "/shared", id, "open:" + path}, Env: []string{"PATH=/"}, Cwd: "/",
			Capabilities: &specs.LinuxCapabilities{Bounding: caps, Effective: caps, Permitted: caps},
		},
		Mounts: append([]specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "mode=755"}},
			{Destination: "/shared", Type: "bind", Source: r.shared, Options: []string{"rbind", "rw", "nodev"}},
		}, mounts...),
		Hooks: &specs.Hooks{
			CreateRuntime: []specs.Hook{{Path: hookBin, Args: []string{"nri-gpu-guard-hook", PhaseCreateRuntime, "--config", cfgPath}, Env: env}},
			Poststop:      []specs.Hook{{Path: hookBin, Args: []string{"nri-gpu-guard-hook", PhasePoststop, "--config", cfgPath}, Env: env}},
		},
		Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{
			{Type: specs.PIDNamespace}, {Type: specs.MountNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
		}},
		Annotations: map[string]string{"run.oci.hooks.stderr": hookErr},
	}
	if c.userNS {
		l := spec.Linux
		l.Namespaces = append(l.Namespaces, specs.LinuxNamespace{Type: specs.UserNamespace})
		l.UIDMappings = []specs.LinuxIDMapping{{ContainerID: 0, HostID: 0, Size: 65536}}
		l.GIDMappings = []specs.LinuxIDMapping{{ContainerID: 0, HostID: 0, Size: 65536}}
	}
	bundle := filepath.Join(r.base, "b", id)
	require.NoError(t, os.MkdirAll(bundle, 0o755))
	data, err := json.Marshal(spec)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
	t.Cleanup(func() { _, _ = c.run("delete", "--force", id) })
	out, err := c.run("--cgroup-manager=disabled", "create", "--bundle", bundle, id)
	hookOut, rerr := os.ReadFile(hookErr)
	if !errors.Is(rerr, os.ErrNotExist) {
		require.NoError(t, rerr)
	}
	return out + string(hookOut), err
}

// opens starts container id and returns what its program's open gave,
// once its process is gone.
func (c *crunBox) opens(id string) string {
	t, r := c.t, c.r
	pid := c.pid(id)
	out, err := c.run("start", id)
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

// pid is the process of container id, as crun states it.
func (c *crunBox) pid(id string) int {
	out, err := c.run("state", id)
	require.NoError(c.t, err, out)
	var st specs.State
	require.NoError(c.t, json.Unmarshal([]byte(out), &st), out)
	return st.Pid
}

// everyGPU is every GPU of the rig held by container id.
func everyGPU(id string) map[string]string {
	want := map[string]string{}
	for _, u := range gpuUUIDs {
		want[u] = id
	}
	return want
}

// crun 1.8 remounts every bind with the flags its options make, so a
// directory on a nodev mount bound with "rbind" alone is not nodev in the
// container: a device node in it opens where no device cgroup applies
// (--cgroup-manager=disabled). The hook, run by crun (its parent), counts
// such a directory as reaching every GPU node: the container claims every
// GPU, the claims naming the directory, and under all_devices = "reject"
// it is refused with the remedy, the bind's nodev option (a nodev mount,
// which the directory has, does not help). With that option the node does
// not open and the directory is no cause; the container still claims every
// GPU, for its root, whose nodev crun drops too
// (TestCrunRootFromNodevMount). runc's counterpart, which keeps the
// source's nodev: TestRuncBindFromNodevMount. Real crun, as root.
func TestCrunBindFromNodevMount(t *testing.T) {
	r := newRig(t, rigOpts{})
	c := newCrunBox(t, r)
	vol := nodevVolume(t, r.base)
	require.NoError(t, os.Mkdir(filepath.Join(r.rootfs, "data"), 0o755))
	bind := func(opts ...string) specs.Mount {
		return specs.Mount{Destination: "/data", Type: "bind", Source: vol, Options: opts}
	}

	out, err := c.create("refused", r.rejectAllConfig(), false, "/data/node", bind("rbind"))
	require.Error(t, err, "a directory from a nodev mount bound without nodev, under crun: %s", out)
	require.Contains(t, out, "bind source "+vol+" bound without nodev: its mount's nodev not kept")
	require.Contains(t, out, "give the bind of "+vol+" the nodev option")
	require.NotContains(t, out, "mount "+vol+" nodev", "it is: that is no remedy")
	require.Empty(t, r.state().Claims)

	out, err = c.create("claimed", r.cfgPath, false, "/data/node", bind("rbind"))
	require.NoError(t, err, out)
	require.Equal(t, everyGPU("claimed"), holdersOf(r.state()), "every GPU: the directory's nodes open")
	for _, cl := range r.state().Claims {
		require.Contains(t, cl.Source, "bind source "+vol+" bound without nodev")
	}
	require.Equal(t, "ok", c.opens("claimed"), "crun does not keep the source's nodev: the node opens")
	out, err = c.run("delete", "--force", "claimed")
	require.NoError(t, err, out)
	require.Empty(t, r.state().Claims, "crun delete's poststop released them")

	out, err = c.create("nodev", r.cfgPath, false, "/data/node", bind("rbind", "nodev"))
	require.NoError(t, err, out)
	require.Equal(t, everyGPU("nodev"), holdersOf(r.state()), "its root, whose nodev crun drops, still reaches every GPU")
	for _, cl := range r.state().Claims {
		require.NotContains(t, cl.Source, "bind source", "the bind's nodev option: the directory is no cause")
		require.Contains(t, cl.Source, "root filesystem's nodev dropped")
	}
	require.Contains(t, c.opens("nodev"), "permission denied", "the bind is nodev")
}

// crun 1.8 drops the nodev of the root's mount, read-only root or not: a
// device node in a root on a nodev mount (container storage mounted nodev,
// as podman's --storage-opt overlay.mountopt=nodev) opens where no device
// cgroup applies (--cgroup-manager=disabled). The hook, run by crun, counts
// such a root as reaching every GPU: the container claims every GPU, and
// under all_devices = "reject" it is refused with the remedies that help
// there (a device cgroup, or runc with a read-write root), not storage
// mounted nodev, which it is. runc's counterpart, which keeps a read-write
// root's nodev: TestRuncRootFromNodevMount. Real crun, as root.
func TestCrunRootFromNodevMount(t *testing.T) {
	r := newRig(t, rigOpts{})
	c := newCrunBox(t, r)
	r.rootNode()
	reject := r.rejectAllConfig()
	for _, readonly := range []bool{false, true} {
		suffix := map[bool]string{false: "-rw", true: "-ro"}[readonly]
		out, err := c.create("refused"+suffix, reject, readonly, "/node")
		require.Error(t, err, "a root on a nodev mount, under crun, readonly %v: %s", readonly, out)
		require.Contains(t, out, "root filesystem's nodev dropped by a runtime not known to be runc")
		require.Contains(t, out, "run it in a device cgroup of its own (cgroups enabled), or run it under runc with a read-write root")
		require.NotContains(t, out, "mountopt", "the storage is nodev already")
		require.Empty(t, r.state().Claims)

		id := "claimed" + suffix
		out, err = c.create(id, r.cfgPath, readonly, "/node")
		require.NoError(t, err, out)
		require.Equal(t, everyGPU(id), holdersOf(r.state()), "every GPU: the root's nodes open")
		require.Equal(t, "ok", c.opens(id), "crun does not keep the root's nodev (readonly %v): the node opens", readonly)
		out, err = c.run("delete", "--force", id)
		require.NoError(t, err, out)
		require.Empty(t, r.state().Claims, "crun delete's poststop released them")
	}
}

// With a user namespace of its own, a container keeps the nodev of its
// root's mount under crun 1.8, read-only root or not: crun makes its mount
// namespace inside that user namespace, where the kernel locks the flags
// of the mounts it copies, and crun's remount of the root cannot clear
// them. The hook, run by crun, finds the container's process in another
// user namespace than its own and admits it under all_devices = "reject",
// claiming nothing: the root's node does not open. A directory bound from
// a nodev mount is another matter: crun clones it outside the user
// namespace and remounts it, for "ro", with the flags its options make,
// nodev gone. Its node opens, and the hook counts the bind (as it counts
// every crun bind from a nodev mount without a nodev option of its own):
// refused under "reject" with the bind's remedy, every GPU claimed
// otherwise. Without the user namespace: TestCrunRootFromNodevMount. Real
// crun, as root.
func TestCrunUserNSRootFromNodevMount(t *testing.T) {
	r := newRig(t, rigOpts{})
	c := newCrunBox(t, r)
	c.userNS = true
	r.rootNode()
	reject := r.rejectAllConfig()
	for _, readonly := range []bool{false, true} {
		id := "userns" + map[bool]string{false: "-rw", true: "-ro"}[readonly]
		out, err := c.create(id, reject, readonly, "/node")
		require.NoError(t, err, "a root on a nodev mount, crun, a user namespace, readonly %v: %s", readonly, out)
		require.Empty(t, r.state().Claims)
		require.Contains(t, c.opens(id), "permission denied", "the root's nodev holds (readonly %v)", readonly)
		out, err = c.run("delete", "--force", id)
		require.NoError(t, err, out)
	}

	vol := nodevVolume(t, r.base)
	require.NoError(t, os.Mkdir(filepath.Join(r.rootfs, "data"), 0o755))
	bindRO := specs.Mount{Destination: "/data", Type: "bind", Source: vol, Options: []string{"rbind", "ro"}}
	out, err := c.create("refused", reject, false, "/data/node", bindRO)
	require.Error(t, err, "a directory from a nodev mount bound ro, crun, a user namespace: %s", out)
	require.Contains(t, out, "bind source "+vol+" bound without nodev: its mount's nodev not kept")
	require.Contains(t, out, "give the bind of "+vol+" the nodev option")
	require.NotContains(t, out, "root filesystem", "the root is no cause")
	require.Empty(t, r.state().Claims)

	out, err = c.create("claimed", r.cfgPath, false, "/data/node", bindRO)
	require.NoError(t, err, out)
	require.Equal(t, everyGPU("claimed"), holdersOf(r.state()), "every GPU: the directory's nodes open")
	require.Equal(t, "ok", c.opens("claimed"), "crun drops the source's nodev on a bind ro in a user namespace too")
}
