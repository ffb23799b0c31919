// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
)

// neverClaims is guard.NeverClaims of the request a spec makes, the
// question Input.NeverClaims answers.
func neverClaims(spec *specs.Spec) bool {
	return guard.NeverClaims(devices.RequestFromSpec(spec))
}

// neverClaims must hold for what ordinary containers carry and fail for
// everything a configuration could turn into a claim, whatever the policy
// and inventory are now.
func TestNeverClaims(t *testing.T) {
	withEnv := func(env ...string) *specs.Spec { return &specs.Spec{Process: &specs.Process{Env: env}} }
	withDev := func(d specs.LinuxDevice) *specs.Spec {
		return &specs.Spec{Linux: &specs.Linux{Devices: []specs.LinuxDevice{d}}}
	}
	for _, tc := range []struct {
		name string
		spec *specs.Spec
		want bool
	}{
		{"nil spec", nil, true},
		{"plain env", withEnv("PATH=/bin", "HOME=/root"), true},
		{"NVIDIA_VISIBLE_DEVICES=none", withEnv("NVIDIA_VISIBLE_DEVICES=none"), true},
		{"NVIDIA_VISIBLE_DEVICES=void", withEnv("NVIDIA_VISIBLE_DEVICES=void"), true},
		{"ordinary mounts", &specs.Spec{Mounts: []specs.Mount{{Destination: "/proc"}, {Destination: "/data"}}}, true},
		{"fuse and null", &specs.Spec{Linux: &specs.Linux{Devices: []specs.LinuxDevice{
			{Path: "/dev/fuse", Type: "c", Major: 10, Minor: 229}, {Path: "/dev/null", Type: "c", Major: 1, Minor: 3}}}}, true},
		{"block device of a dynamic major", withDev(specs.LinuxDevice{Path: "/dev/vdb", Type: "b", Major: 252}), true},

		{"GPU by index", withEnv("NVIDIA_VISIBLE_DEVICES=0"), false},
		{"GPU by UUID", withEnv("NVIDIA_VISIBLE_DEVICES=GPU-6c1a2f2e-0000-4000-8000-000000000000"), false},
		{"all (claimed under all_devices = claim)", withEnv("NVIDIA_VISIBLE_DEVICES=all"), false},
		{"DOCKER_RESOURCE_GPU", withEnv("DOCKER_RESOURCE_GPU=1"), false},
		{"volume-mount strategy", &specs.Spec{Mounts: []specs.Mount{{Destination: "/var/run/nvidia-container-devices/0"}}}, false},
		{"CDI annotation", &specs.Spec{Annotations: map[string]string{"cdi.k8s.io/gpu": "nvidia.com/gpu=0"}}, false},
		{"privileged (claims all under privileged = all)", &specs.Spec{Process: &specs.Process{
			Capabilities: &specs.LinuxCapabilities{Bounding: []string{"CAP_SYS_ADMIN"}}}}, false},
		{"GPU node", withDev(specs.LinuxDevice{Path: "/dev/nvidia0", Type: "c", Major: 195}), false},
		{"GPU node renamed", withDev(specs.LinuxDevice{Path: "/dev/x", Type: "c", Major: 195, Minor: 1}), false},
		{"GPU node by path only", withDev(specs.LinuxDevice{Path: "/dev/nvidia1"}), false},
		{"MIG capability by path", withDev(specs.LinuxDevice{Path: "/dev/nvidia-caps/nvidia-cap12", Type: "c"}), false},
		{"MIG capability renamed (dynamic major)", withDev(specs.LinuxDevice{Path: "/dev/x", Type: "c", Major: 508, Minor: 12}), false},
		{"unknown type, dynamic major", withDev(specs.LinuxDevice{Path: "/dev/y", Major: 240}), false},
		// policy.swarm_resource_envvars may name any DOCKER_RESOURCE_
		// variable, and the shortcut answers before the configuration is
		// read.
		{"a swarm generic resource", withEnv("DOCKER_RESOURCE_NVIDIA-GPU=0"), false},
		// Rootless podman turns --device /dev/nvidia0 into a bind mount
		// (no linux.devices entry, no device cgroup).
		{"GPU node bind-mounted", &specs.Spec{Mounts: []specs.Mount{{Destination: "/dev/nvidia0", Source: "/dev/nvidia0", Type: "bind"}}}, false},
		{"GPU node bind-mounted elsewhere", &specs.Spec{Mounts: []specs.Mount{{Destination: "/dev/gpu", Source: "/dev/nvidia3", Type: "bind"}}}, false},
		{"an ordinary bind mount", &specs.Spec{Mounts: []specs.Mount{{Destination: "/data", Source: "/srv/data", Type: "bind"}}}, true},
		{"GPU node by udev's number link", &specs.Spec{Mounts: []specs.Mount{{Destination: "/dev/g", Source: "/dev/char/195:0", Type: "bind"}}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, neverClaims(tc.spec))
		})
	}
}

// A poststop for a container that names no GPU never opens the ledger: here
// the ledger directory is a FIFO, which any ledger access would fail on (or
// block in), and the poststop still succeeds. The same poststop for a
// container that names a GPU does reach the ledger, and says so; so does one
// whose bundle is gone (it cannot tell, so it reads the ledger).
func TestPoststopNoGPUSkipsLedger(t *testing.T) {
	cfg := staticConfig(t)
	cfg.Ledger.Dir = filepath.Join(t.TempDir(), "ledger-fifo")
	require.NoError(t, syscall.Mkfifo(cfg.Ledger.Dir, 0o600))

	poststop := func(stdin string) (int, error) {
		opened := 0
		err := testEnv(&opened).run(context.Background(), PhasePoststop, cfg, strings.NewReader(stdin), io.Discard)
		return opened, err
	}

	opened, err := poststop(stateFor(t, "plain", 0, "PATH=/bin"))
	require.NoError(t, err)
	require.Zero(t, opened, "no ledger for a container without GPU")

	opened, err = poststop(stateFor(t, "gpu", 0, "NVIDIA_VISIBLE_DEVICES=1"))
	require.Equal(t, 1, opened)
	require.Error(t, err)
	require.Contains(t, err.Error(), "container gpu: cannot release its GPUs")

	opened, err = poststop(`{"id":"gone","status":"stopped","bundle":"/nonexistent/bundle"}`)
	require.Equal(t, 1, opened, "an unreadable bundle falls back to the ledger")
	require.Error(t, err)

	fi, err := os.Lstat(cfg.Ledger.Dir)
	require.NoError(t, err)
	require.Equal(t, os.ModeNamedPipe, fi.Mode().Type(), "left as it was")
}

// A bundle whose config.json is privileged takes the ledger path even though
// it names no GPU: policy.privileged may have made it claim every GPU.
func TestPoststopPrivilegedReadsLedger(t *testing.T) {
	cfg := staticConfig(t)
	bundle := t.TempDir()
	data, err := json.Marshal(specs.Spec{Version: specs.Version, Process: &specs.Process{
		Capabilities: &specs.LinuxCapabilities{Bounding: []string{"CAP_SYS_ADMIN"}}}})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
	st, err := json.Marshal(specs.State{Version: specs.Version, ID: "priv", Status: specs.StateStopped, Bundle: bundle})
	require.NoError(t, err)
	opened := 0
	require.NoError(t, testEnv(&opened).run(context.Background(), PhasePoststop, cfg, strings.NewReader(string(st)), io.Discard))
	require.Equal(t, 1, opened)
}

// readSpec decodes only part of config.json: what it keeps must give the
// same device request and owner as the whole spec.
func TestReadSpecKeepsWhatTheHookUses(t *testing.T) {
	full := specs.Spec{
		Version:  specs.Version,
		Hostname: "h",
		Root:     &specs.Root{Path: "rootfs"},
		Process: &specs.Process{Args: []string{"/app"}, Cwd: "/", Env: []string{"A=1", "NVIDIA_VISIBLE_DEVICES=1,2"},
			Capabilities: &specs.LinuxCapabilities{Bounding: []string{"CAP_CHOWN", "CAP_SYS_ADMIN"}, Effective: []string{"CAP_CHOWN"}}},
		Mounts:      []specs.Mount{{Destination: "/proc", Type: "proc"}, {Destination: "/var/run/nvidia-container-devices/3", Source: "/dev/null"}},
		Annotations: map[string]string{"cdi.k8s.io/gpu": "nvidia.com/gpu=0", "io.kubernetes.pod.name": "p"},
		Linux: &specs.Linux{CgroupsPath: "/kubepods/x", Devices: []specs.LinuxDevice{
			{Path: "/dev/nvidia0", Type: "c", Major: 195, Minor: 0}, {Path: "/dev/fuse", Type: "c", Major: 10, Minor: 229}},
			Namespaces: []specs.LinuxNamespace{{Type: specs.PIDNamespace}},
			Resources:  &specs.LinuxResources{Devices: []specs.LinuxDeviceCgroup{{Allow: true, Access: "rwm"}}}},
	}
	req := devices.RequestFromSpec(&full)
	require.True(t, req.AllDevicesAllowed, "the fixture is an engine's privileged container")
	data, err := json.Marshal(full)
	require.NoError(t, err)
	bundle := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
	st := specs.State{ID: "c1", Pid: 7, Bundle: bundle}
	got, err := readSpec(st)
	require.NoError(t, err)
	require.Equal(t, devices.RequestFromSpec(&full), devices.RequestFromSpec(got))
	require.Equal(t, OwnerFrom(st, &full, 9), OwnerFrom(st, got, 9))
}

// A config.json that names a GPU only in the last of repeated keys (the one
// encoding/json and runc keep) is not taken for a container without GPU:
// the fast decoder gives up on it, and the spec is refused (runtimes
// disagree on which key counts, see checkKeys).
func TestNeverClaimsRepeatedKeys(t *testing.T) {
	for _, doc := range []string{
		`{"process":{"env":["PATH=/bin"]},"process":{"env":["NVIDIA_VISIBLE_DEVICES=0"]}}`,
		`{"process":{"env":["PATH=/bin"],"env":["NVIDIA_VISIBLE_DEVICES=0"]}}`,
		`{"linux":{"devices":[]},"linux":{"devices":[{"path":"/dev/nvidia0","type":"c","major":195}]}}`,
		`{"annotations":{"a":"b"},"annotations":{"cdi.k8s.io/gpu":"nvidia.com/gpu=0"}}`,
	} {
		bundle := t.TempDir()
		require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), []byte(doc), 0o600))
		st, err := json.Marshal(specs.State{Version: specs.Version, ID: "dup", Status: specs.StateCreating, Bundle: bundle})
		require.NoError(t, err)
		in := ReadInput(strings.NewReader(string(st)))
		require.ErrorIs(t, in.specErr, errAmbiguousKey, doc)
		require.False(t, in.NeverClaims(), doc)
	}
}

// A device cgroup rule of type "a" (or without a type) allows every device,
// whatever numbers or access it names: such a container can mknod and open
// every GPU, and is never let through before the configuration is read.
func TestNeverClaimsTypeARules(t *testing.T) {
	one, three := int64(1), int64(3)
	for _, rules := range [][]specs.LinuxDeviceCgroup{
		{{Allow: false, Access: "rwm"}, {Allow: true, Type: "a", Major: &one, Minor: &three, Access: "r"}},
		{{Allow: false, Access: "rwm"}, {Allow: true, Type: "a", Access: "m"}},
		{{Allow: false, Access: "rwm"}, {Allow: true, Major: &one, Minor: &three, Access: "rw"}},
	} {
		spec := specs.Spec{Version: specs.Version, Process: &specs.Process{Env: []string{"PATH=/bin"}},
			Linux: &specs.Linux{Resources: &specs.LinuxResources{Devices: rules}}}
		data, err := json.Marshal(spec)
		require.NoError(t, err)
		bundle := t.TempDir()
		require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
		st, err := json.Marshal(specs.State{Version: specs.Version, ID: "a-rule", Status: specs.StateCreating, Bundle: bundle})
		require.NoError(t, err)
		in := ReadInput(strings.NewReader(string(st)))
		require.NoError(t, in.specErr)
		require.False(t, in.NeverClaims(), "%+v", rules[1])
		require.True(t, in.request.GPUNodesAllowed, "%+v", rules[1])
	}
}

// A GPU node bind-mounted into the container (rootless podman's --device)
// is a request for that GPU, by the host node it binds; so is the whole of
// the host's /dev in a runtime without device cgroup (one in a user
// namespace).
func TestBindMountedNodes(t *testing.T) {
	inv, err := devices.NewInventory("static", []devices.GPU{{Index: 0, UUID: "GPU-00000000-0000-4000-8000-000000000000", Minor: 0},
		{Index: 1, UUID: "GPU-00000000-0000-4000-8000-000000000001", Minor: 3}})
	require.NoError(t, err)
	resolve := func(req devices.Request) []string {
		res, err := devices.NewResolver(inv, config.Default().Policy).Resolve(req)
		require.NoError(t, err)
		var out []string
		for _, d := range res.Devices {
			out = append(out, d.Index)
		}
		return out
	}
	req := devices.RequestFromSpec(&specs.Spec{Mounts: []specs.Mount{
		{Destination: "/dev/nvidia0", Source: "/dev/nvidia3", Type: "bind", Options: []string{"rbind"}},
		{Destination: "/dev/nvidiactl", Source: "/dev/nvidiactl", Type: "bind"}}})
	require.Equal(t, []string{"1"}, resolve(req), "the host's /dev/nvidia3 (minor 3) is GPU 1, whatever its name inside")
	res, err := devices.NewResolver(inv, config.Default().Policy).Resolve(req)
	require.NoError(t, err)
	require.Equal(t, []string{"bind mount /dev/nvidia0 from /dev/nvidia3 (195:3)"}, res.Devices[0].Sources, "messages name both")

	whole := devices.RequestFromSpec(&specs.Spec{Mounts: []specs.Mount{{Destination: "/dev", Source: "/dev/", Type: "bind"}}})
	require.True(t, whole.HostDevMounted)
	fresh := devices.RequestFromSpec(&specs.Spec{Mounts: []specs.Mount{{Destination: "/d", Source: "devtmpfs", Type: "devtmpfs"}}})
	require.True(t, fresh.HostDevMounted, "a devtmpfs mounted afresh is the host's /dev")
	root := devices.RequestFromSpec(&specs.Spec{Mounts: []specs.Mount{{Destination: "/host", Source: "/", Type: "bind"}}})
	require.True(t, root.HostDevMounted, "the host's / holds its /dev")
	byNumber := devices.RequestFromSpec(&specs.Spec{Mounts: []specs.Mount{{Destination: "/dev/g", Source: "/dev/char/195:3", Type: "bind"}}})
	require.Equal(t, []string{"1"}, resolve(byNumber), "udev's /dev/char/195:3 is minor 3, GPU 1")
	require.Empty(t, resolve(whole), "a device cgroup (rootful) decides what of /dev opens")
	whole.GPUNodesAllowed = true // what ReadInput sets in a user namespace
	require.Equal(t, []string{"0", "1"}, resolve(whole))

	// The runtime resolves a process's root link before it mounts: the
	// host's /dev, however it is spelled.
	for _, src := range []string{"/proc/self/root/dev", "/proc/1/root", "/proc"} {
		viaProc := devices.RequestFromSpec(&specs.Spec{Mounts: []specs.Mount{{Destination: "/hostdev", Source: src, Type: "bind"}}})
		require.True(t, viaProc.HostDevMounted, src)
	}
	// A symlink to /dev, followed by the runtime: read as what it is where
	// no device cgroup stops what it brings (a rootless runtime).
	link := filepath.Join(t.TempDir(), "devlink")
	require.NoError(t, os.Symlink("/dev", link))
	mounts := []specs.Mount{{Destination: "/hostdev", Source: link, Type: "bind"}}
	viaLink := devices.RequestFromSpec(&specs.Spec{Mounts: mounts})
	require.False(t, viaLink.HostDevMounted, "by its spelling alone")
	markUnfenced(&viaLink, boundNodes(mounts, "", false, &hostDirs{}), false)
	require.True(t, viaLink.HostDevMounted)

	// A GPU node made outside /dev/nvidia*: its numbers tell it (mknod
	// needs root, as this test does).
	if os.Geteuid() == 0 {
		node := filepath.Join(t.TempDir(), "gpu")
		require.NoError(t, syscall.Mknod(node, syscall.S_IFCHR|0o600, int(unix.Mkdev(195, 3))))
		mounts = []specs.Mount{{Destination: "/dev/x", Source: node, Type: "bind"}}
		byNumber := devices.RequestFromSpec(&specs.Spec{Mounts: mounts})
		require.Empty(t, resolve(byNumber), "by its spelling alone")
		markUnfenced(&byNumber, boundNodes(mounts, "", false, &hostDirs{}), false)
		require.Equal(t, []string{"1"}, resolve(byNumber), "minor 3 is GPU 1")
	}
}

// makesNodes reads a spec without a capabilities object (or without a
// process) as holding every capability: recent runc keeps its own then.
// An object without CAP_MKNOD and CAP_SYS_ADMIN in its bounding set, or a
// user namespace of the container's own, makes no node.
func TestMakesNodes(t *testing.T) {
	userNS := &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.MountNamespace}, {Type: specs.UserNamespace}}}
	for _, tc := range []struct {
		name string
		spec specs.Spec
		want bool
	}{
		{"no process", specs.Spec{}, true},
		{"no capabilities object", specs.Spec{Process: &specs.Process{}}, true},
		{"no capabilities object, user namespace", specs.Spec{Process: &specs.Process{}, Linux: userNS}, false},
		{"an empty object", specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{}}}, false},
		{"CAP_MKNOD effective only", specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{Effective: []string{capMknod}}}}, false},
		{"CAP_MKNOD", specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{Bounding: []string{capMknod}}}}, true},
		{"CAP_SYS_ADMIN", specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{Bounding: []string{capSysAdmin}}}}, true},
		{"podman's default set", specs.Spec{Process: &specs.Process{Capabilities: podmanCaps()}}, false},
	} {
		require.Equal(t, tc.want, makesNodes(&tc.spec), tc.name)
	}
}

// The runtime's user namespace is read from procRoot/self/uid_map: only
// the initial namespace's identity map is rootful; a map that cannot be
// read tells neither.
func TestRuntimeUserNS(t *testing.T) {
	for _, tc := range []struct {
		name  string
		write func(t *testing.T, path string)
		want  RuntimeUserNS
	}{
		{"identity map", func(t *testing.T, p string) {
			require.NoError(t, os.WriteFile(p, []byte("         0          0 4294967295\n"), 0o644))
		}, Rootful},
		{"rootless podman's map", func(t *testing.T, p string) {
			require.NoError(t, os.WriteFile(p, []byte("         0       1000          1\n         1     100000      65536\n"), 0o644))
		}, Rootless},
		{"missing", func(*testing.T, string) {}, UnknownUserNS},
		{"not a file", func(t *testing.T, p string) { require.NoError(t, os.Mkdir(p, 0o755)) }, UnknownUserNS},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			require.NoError(t, os.Mkdir(filepath.Join(root, "self"), 0o755))
			tc.write(t, filepath.Join(root, "self", "uid_map"))
			require.Equal(t, tc.want, runtimeUserNS(root))
		})
	}
	require.Equal(t, UnknownUserNS, RuntimeUserNS(0), "the zero value fails closed")
}

func TestInUserNamespace(t *testing.T) {
	for uidMap, want := range map[string]bool{
		"         0          0 4294967295\n":                                   false,
		"         0       1000          1\n         1     100000      65536\n": true,
		"0 0 65536\n": true,
		"":            true,
	} {
		require.Equal(t, want, inUserNamespace([]byte(uidMap)), "%q", uidMap)
	}
}

// OverlayLayers names every layer the kernel takes, once, and says when it
// cannot tell them: an escaped character, a relative layer, too many.
func TestOverlayLayers(t *testing.T) {
	for _, tc := range []struct {
		name   string
		opts   []string
		layers []string
		opaque bool
	}{
		{"joined and apart", []string{"lowerdir=/a:/b,upperdir=/u", "workdir=/w", "lowerdir=/c", "ro"}, []string{"/a", "/b", "/u", "/c"}, false},
		{"newer kernels' keys", []string{"lowerdir+=/a", "lowerdir+=/dev", "datadir+=/d"}, []string{"/a", "/dev", "/d"}, false},
		{"once each", []string{"lowerdir=/a:/a", "upperdir=/a"}, []string{"/a"}, false},
		{"escaped comma", []string{`lowerdir=/tmp/a\,b:/dev`}, []string{"/tmp/a\\"}, true},
		{"escape split by the runtime's join", []string{`lowerdir=/tmp/a\`, "b:/dev"}, []string{"/tmp/a\\"}, true},
		{"relative layer", []string{"lowerdir=../../../../dev"}, nil, true},
		{"empty layer", []string{"lowerdir=/a::/b"}, []string{"/a", "/b"}, true},
		{"no layers", []string{"ro", "nodev"}, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			layers, opaque := devices.OverlayLayers(tc.opts)
			assert.Equal(t, tc.layers, layers)
			assert.Equal(t, tc.opaque, opaque)
		})
	}
	many := make([]string, 600)
	for i := range many {
		many[i] = fmt.Sprintf("lowerdir+=/l%d", i)
	}
	layers, opaque := devices.OverlayLayers(many)
	assert.Len(t, layers, 512)
	assert.True(t, opaque, "more layers than the kernel takes: not told")
}

// A relative bind source is read from the bundle both as runc joins it (as
// text: x/../dev is bundle/dev) and as crun's kernel walks it (following a
// symlink x first): either one that is the host's /dev counts.
func TestRelativeBindSourceReadBothWays(t *testing.T) {
	bundle := t.TempDir()
	require.NoError(t, os.Symlink("/etc", filepath.Join(bundle, "x")))
	mount := func(src string) []specs.Mount {
		return []specs.Mount{{Destination: "/d", Type: "bind", Source: src, Options: []string{"rbind"}}}
	}
	rel, err := filepath.Rel(bundle, "/dev")
	require.NoError(t, err)
	assert.True(t, boundNodes(mount(rel), bundle, false, &hostDirs{}).hostDev, "runc's join reaches /dev")
	assert.True(t, boundNodes(mount("x/../dev"), bundle, false, &hostDirs{}).hostDev, "the kernel follows x to /etc, then .. to /")
	assert.False(t, boundNodes(mount("x"), bundle, false, &hostDirs{}).hostDev, "/etc is not /dev")
}

// Only runc's executable names a runtime known to keep a bind source's
// nodev on a bind without flag options: runc, runc's release binaries by
// their download names, and a runc replaced on disk while it runs. crun,
// other runtimes, docker-runc (never verified) and names that merely hold
// "runc" are not.
func TestKeepsFlagsName(t *testing.T) {
	for name, want := range map[string]bool{
		"runc": true, "runc.amd64": true, "runc.arm64": true, "runc (deleted)": true, "runc.s390x (deleted)": true,
		"crun": false, "crun (deleted)": false, "youki": false, "runsc": false, "kata-runtime": false,
		"docker-runc": false, "runc.sh": false, "runc.": false, "runc-gpu-guard": false, "myrunc": false, "": false,
	} {
		require.Equal(t, want, keepsFlagsName(name), "%q", name)
	}
}

// recoveryRuntimes are the runtimes a recovery can be told by a state
// file (RunningRequest), each with whether it keeps a bind source's nodev
// on a bind without flag options and a read-write root's: runc's
// state.json does, crun's status does not, and a runtime that cannot be
// told is read as crun leaves a container.
var recoveryRuntimes = []struct {
	name  string
	rt    Runtime
	keeps bool
}{{"runc", RuntimeRunc, true}, {"crun", RuntimeCrun, false}, {"unknown", RuntimeUnknown, false}}

// A directory on a nodev mount bound without options of its own keeps its
// nodev under runc and loses it under crun. Recovery (RunningRequest) reads
// it as the runtime its state names left it, as the hook read it at
// create-runtime: under runc it reaches nothing, under crun or a runtime
// that cannot be told every GPU node. gpu-guard-ctl explain
// --no-device-cgroup (UnfencedRequest) cannot tell which runtime will run
// the spec: it reads it as crun leaves it. Bound nodev, it reaches nothing
// under any.
func TestRequestsWithoutRuntimeCountNodevSourceBinds(t *testing.T) {
	src := nodevDir(t)
	for _, tc := range []struct {
		opts []string
		// dropped: the nodev is gone where the runtime drops a source's
		// flags.
		dropped bool
	}{
		{[]string{"rbind"}, true},
		{[]string{"bind", "rprivate"}, true},
		{[]string{"rbind", "nodev"}, false},
	} {
		spec := &specs.Spec{Process: &specs.Process{Capabilities: podmanCaps()},
			Mounts: []specs.Mount{{Destination: "/data", Type: "bind", Source: src, Options: tc.opts}}}
		reqs := map[string]devices.Request{}
		wants := map[string]bool{}
		for _, r := range recoveryRuntimes {
			running := devices.RequestFromSpec(spec)
			// pid 0: no device cgroup can be read for it.
			RunningRequest(&running, spec, t.TempDir(), t.TempDir(), 0, "train", Rootful, r.rt)
			what := "RunningRequest " + r.name
			reqs[what], wants[what] = running, tc.dropped && !r.keeps
		}
		unfenced := devices.RequestFromSpec(spec)
		UnfencedRequest(&unfenced, spec, t.TempDir())
		reqs["UnfencedRequest"], wants["UnfencedRequest"] = unfenced, tc.dropped
		for what, req := range reqs {
			require.Equal(t, wants[what], req.GPUNodesAllowed, "%s %v", what, tc.opts)
			if wants[what] {
				require.Equal(t, []devices.NodeDir{{Path: src, BoundAt: "/data", NodevDropped: true}}, req.NodeDirs, "%s %v", what, tc.opts)
			} else {
				require.Empty(t, req.NodeDirs, "%s %v", what, tc.opts)
			}
		}
	}
}

// A root filesystem on a nodev mount keeps that nodev under runc where it
// is read-write, and loses it under runc read-only and under crun either
// way. Recovery (RunningRequest) reads it as the runtime its state names
// left it, as the hook read it at create-runtime: counted as reaching
// every GPU node, named with the runtime's drop of the storage's nodev,
// except runc's read-write root; a runtime that cannot be told counts as
// crun. gpu-guard-ctl explain --no-device-cgroup (UnfencedRequest) cannot
// tell which runtime will run the spec: it reads it as crun leaves it. A
// rootless runtime's root is not read.
func TestRequestsWithoutRuntimeCountNodevRoot(t *testing.T) {
	root := filepath.Join(nodevDir(t), "rootfs")
	require.NoError(t, os.MkdirAll(root, 0o755))
	for _, readonly := range []bool{false, true} {
		spec := &specs.Spec{Process: &specs.Process{Capabilities: podmanCaps()}, Root: &specs.Root{Path: root, Readonly: readonly},
			Mounts: []specs.Mount{{Destination: "/dev", Type: "tmpfs", Source: "tmpfs"}}}
		type want struct {
			counted bool
			drop    devices.RootNodev
		}
		reqs := map[string]devices.Request{}
		wants := map[string]want{}
		for _, r := range recoveryRuntimes {
			running := devices.RequestFromSpec(spec)
			// pid 0: no device cgroup can be read for it.
			RunningRequest(&running, spec, t.TempDir(), t.TempDir(), 0, "train", Rootful, r.rt)
			what := "RunningRequest " + r.name
			reqs[what] = running
			switch {
			case !r.keeps:
				wants[what] = want{true, devices.RootNodevDroppedByRuntime}
			case readonly:
				wants[what] = want{true, devices.RootNodevDroppedReadOnly}
			default:
				wants[what] = want{false, devices.RootNodevKept}
			}
		}
		unfenced := devices.RequestFromSpec(spec)
		UnfencedRequest(&unfenced, spec, t.TempDir())
		reqs["UnfencedRequest"], wants["UnfencedRequest"] = unfenced, want{true, devices.RootNodevDroppedByRuntime}
		for what, req := range reqs {
			w := wants[what]
			require.Equal(t, w.counted, req.GPUNodesAllowed, "%s readonly %v", what, readonly)
			require.Equal(t, w.counted, req.ImageNodes, "%s readonly %v", what, readonly)
			require.Equal(t, w.drop, req.RootNodev, "%s readonly %v", what, readonly)
			// Named only with a root counted.
			require.Equal(t, w.counted, req.RootStorageNodev, "%s readonly %v", what, readonly)
		}
		for _, r := range recoveryRuntimes {
			rootless := devices.RequestFromSpec(spec)
			RunningRequest(&rootless, spec, t.TempDir(), t.TempDir(), 0, "train", Rootless, r.rt)
			require.False(t, rootless.GPUNodesAllowed, "rootless %s, readonly %v", r.name, readonly)
		}
	}
}
