// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package runtimestate

import (
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
)

// host is a fake host: runtime roots in a temp dir, bundles, and a fake
// procfs with the processes the test says are running.
type host struct {
	t    testing.TB
	base string
	proc string
}

func newHost(t testing.TB) *host {
	h := &host{t: t, base: t.TempDir()}
	h.proc = filepath.Join(h.base, "proc")
	require.NoError(t, os.MkdirAll(h.proc, 0o755))
	return h
}

func (h *host) root(name string) string { return filepath.Join(h.base, name) }

// process writes /proc/<pid>/stat of a process in state st (R, S, Z) that
// started at start.
func (h *host) process(pid int, start uint64, st byte) {
	dir := filepath.Join(h.proc, fmt.Sprint(pid))
	require.NoError(h.t, os.MkdirAll(dir, 0o755))
	// Fields 3..21, then starttime (22) and a few more.
	fields := []string{string(st)}
	for i := 4; i <= 21; i++ {
		fields = append(fields, "0")
	}
	fields = append(fields, fmt.Sprint(start), "0", "0")
	line := fmt.Sprintf("%d (ctr prog) %s\n", pid, strings.Join(fields, " "))
	require.NoError(h.t, os.WriteFile(filepath.Join(dir, "stat"), []byte(line), 0o644))
}

// bundle writes a bundle whose config.json sets env and annotations.
func (h *host) bundle(id string, env []string, ann map[string]string) string {
	dir := filepath.Join(h.base, "bundles", id)
	require.NoError(h.t, os.MkdirAll(dir, 0o755))
	data, err := json.Marshal(specs.Spec{Version: specs.Version, Process: &specs.Process{Env: env}, Annotations: ann})
	require.NoError(h.t, err)
	require.NoError(h.t, os.WriteFile(filepath.Join(dir, "config.json"), data, 0o600))
	return dir
}

// podmanCaps is podman's default capability set: neither CAP_MKNOD nor
// CAP_SYS_ADMIN. A spec without a capabilities object counts as holding
// every capability (see hook.RunningRequest).
func podmanCaps() *specs.LinuxCapabilities {
	caps := []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_NET_BIND_SERVICE",
		"CAP_SETFCAP", "CAP_SETGID", "CAP_SETPCAP", "CAP_SETUID", "CAP_SYS_CHROOT"}
	return &specs.LinuxCapabilities{Bounding: caps, Effective: caps, Permitted: caps}
}

// testdata decodes a captured state file into a generic map.
func testdata(t testing.TB, name string) map[string]any {
	data, err := os.ReadFile(filepath.Join("testdata", name))
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, json.Unmarshal(data, &m))
	return m
}

// runc writes <root>/<id>/state.json: the state runc 1.1 wrote for a real
// container (testdata/runc.state.json), with this container's id, pid,
// start time and bundle.
func (h *host) runc(root, id string, pid int, start uint64, bundle string, created bool) string {
	return h.runcFrom("runc.state.json", root, id, pid, start, bundle, created)
}

// scanRunning writes spec as bundle's config.json, lists a running runc
// container c1 of it (pid 300) under a runc root that owner owns, and
// returns the scan's reading of it, which must have read the spec.
func (h *host) scanRunning(t *testing.T, bundle string, spec specs.Spec, owner int) Container {
	t.Helper()
	data, err := json.Marshal(spec)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
	root := h.root("runc")
	h.runc(root, "c1", 300, 30, bundle, false)
	require.NoError(t, os.Chown(root, owner, owner))
	c := byID(h.scan(root))["c1"]
	require.True(t, c.Live(), c.Why)
	require.NoError(t, c.SpecErr)
	return c
}

func (h *host) runcFrom(file, root, id string, pid int, start uint64, bundle string, created bool) string {
	m := testdata(h.t, file)
	m["id"], m["init_process_pid"], m["init_process_start"] = id, pid, start
	cfg := m["config"].(map[string]any)
	var labels []any
	for _, l := range cfg["labels"].([]any) {
		if !strings.HasPrefix(l.(string), "bundle=") {
			labels = append(labels, l)
		}
	}
	cfg["labels"] = append(labels, "bundle="+bundle)
	data, err := json.Marshal(m)
	require.NoError(h.t, err)
	return h.stateFile(root, id, runcStateFile, data, created)
}

// crun writes <root>/<id>/status from testdata/crun.status.
func (h *host) crun(root, id string, pid int, start uint64, bundle string, created bool) string {
	m := testdata(h.t, "crun.status")
	m["pid"], m["process-start-time"], m["bundle"] = pid, start, bundle
	data, err := json.Marshal(m)
	require.NoError(h.t, err)
	return h.stateFile(root, id, crunStateFile, data, created)
}

func (h *host) stateFile(root, id, name string, data []byte, created bool) string {
	dir := filepath.Join(root, id)
	require.NoError(h.t, os.MkdirAll(dir, 0o700))
	p := filepath.Join(dir, name)
	require.NoError(h.t, os.WriteFile(p, data, 0o600))
	if created {
		require.NoError(h.t, syscall.Mkfifo(filepath.Join(dir, execFifo), 0o622))
	}
	return p
}

func (h *host) scan(roots ...string) Result {
	return Scan(roots, Options{ProcRoot: h.proc})
}

func byID(res Result) map[string]Container {
	out := map[string]Container{}
	for _, c := range res.Containers {
		out[c.ID] = c
	}
	return out
}

func problemPaths(res Result) map[string]string {
	out := map[string]string{}
	for _, p := range res.Problems {
		out[p.Path] = p.Err.Error()
	}
	return out
}

// TestScanRuncAndCrun reads both runtimes' real formats: running and
// created containers with their pid, start time, bundle, cgroup, request
// and annotations.
func TestScanRuncAndCrun(t *testing.T) {
	h := newHost(t)
	runcRoot, crunRoot := h.root("runc"), h.root("crun")
	ann := map[string]string{"io.kubernetes.pod.namespace": "ns1"}
	h.process(100, 5000, 'S')
	h.process(101, 4000, 'S')
	h.process(102, 6000, 'R')
	h.runc(runcRoot, "r-running", 100, 5000, h.bundle("r-running", []string{"NVIDIA_VISIBLE_DEVICES=1"}, ann), false)
	h.runc(runcRoot, "r-created", 101, 4000, h.bundle("r-created", []string{"NVIDIA_VISIBLE_DEVICES=2"}, nil), true)
	h.crun(crunRoot, "c-running", 102, 6000, h.bundle("c-running", []string{"NVIDIA_VISIBLE_DEVICES=0"}, nil), false)

	res := h.scan(runcRoot, crunRoot, h.root("absent"))
	require.Empty(t, res.Problems)
	assert.Equal(t, []string{runcRoot, crunRoot}, res.Roots, "a missing root is no problem and not listed")
	// Ordered by start time: r-created (4000), r-running, c-running.
	var ids []string
	for _, c := range res.Containers {
		ids = append(ids, c.ID)
	}
	require.Equal(t, []string{"r-created", "r-running", "c-running"}, ids)

	got := byID(res)
	r := got["r-running"]
	assert.Equal(t, StatusRunning, r.Status)
	assert.Equal(t, RuntimeRunc, r.Runtime)
	assert.Equal(t, 100, r.Pid)
	assert.Equal(t, uint64(5000), r.PidStart)
	assert.Equal(t, filepath.Join(h.base, "bundles", "r-running"), r.Bundle)
	assert.Equal(t, "/gg-example", r.Cgroup, "the cgroup runc recorded")
	assert.Equal(t, "ns1", r.Annotations["io.kubernetes.pod.namespace"])
	assert.Contains(t, r.Request.Env, "NVIDIA_VISIBLE_DEVICES=1")
	assert.NoError(t, r.SpecErr)
	assert.False(t, r.Created.IsZero())

	assert.Equal(t, StatusCreated, got["r-created"].Status, "exec.fifo present: created, not started")
	assert.True(t, got["r-created"].Live())

	c := got["c-running"]
	assert.Equal(t, StatusRunning, c.Status)
	assert.Equal(t, RuntimeCrun, c.Runtime)
	assert.Equal(t, uint64(6000), c.PidStart)
	assert.Contains(t, c.Request.Env, "NVIDIA_VISIBLE_DEVICES=0")
	assert.Len(t, res.Live(), 3)
}

// TestScanStoppedAndPidReuse: a container whose init pid is gone, a zombie,
// or reused by a process that started at another time is stopped; its
// bundle is not read (it may be gone).
func TestScanStoppedAndPidReuse(t *testing.T) {
	h := newHost(t)
	root := h.root("runc")
	h.process(201, 999, 'S') // pid 201 now belongs to a later process
	h.process(202, 7000, 'Z')
	h.runc(root, "gone", 200, 7000, "/nonexistent/bundle", false)
	h.runc(root, "reused", 201, 7000, "/nonexistent/bundle", false)
	h.crun(root, "zombie", 202, 7000, "/nonexistent/bundle", false)
	// A real podman container's state (podman's labels and paths), stopped.
	h.runcFrom("runc-podman.state.json", root, "podman1", 203, 1739544, "/nonexistent/bundle", false)

	res := h.scan(root)
	require.Empty(t, res.Problems)
	got := byID(res)
	require.Len(t, got, 4)
	for id, want := range map[string]string{"gone": "pid 200 is gone", "reused": "reused", "zombie": "zombie", "podman1": "pid 203 is gone"} {
		c := got[id]
		assert.Equal(t, StatusStopped, c.Status, id)
		assert.False(t, c.Live(), id)
		assert.Contains(t, c.Why, want, id)
		assert.Nil(t, c.Spec, id)
		assert.NoError(t, c.SpecErr, "%s: a stopped container's bundle is not read", id)
	}
	assert.Empty(t, res.Live())
}

// TestScanBadEntries: each bad entry is reported with its path and why,
// and the good container next to them is still listed.
func TestScanBadEntries(t *testing.T) {
	h := newHost(t)
	root := h.root("runc")
	h.process(300, 1, 'S')
	h.runc(root, "good", 300, 1, h.bundle("good", []string{"NVIDIA_VISIBLE_DEVICES=1"}, nil), false)

	// Malformed JSON.
	h.stateFile(root, "malformed", runcStateFile, []byte(`{"id":"malformed","init_process_pid":`), false)
	// Over-size (sparse: cheap).
	big := h.stateFile(root, "huge", runcStateFile, []byte("{}"), false)
	require.NoError(t, os.Truncate(big, MaxStateBytes+1))
	// The id inside is not the directory's.
	h.runc(root, "renamed", 300, 1, "/b", false)
	require.NoError(t, os.Rename(filepath.Join(root, "renamed"), filepath.Join(root, "other")))
	// A symlinked container directory and a symlinked state file, both
	// pointing at the good container's state: never followed.
	require.NoError(t, os.Symlink(filepath.Join(root, "good"), filepath.Join(root, "linkdir")))
	require.NoError(t, os.MkdirAll(filepath.Join(root, "linkfile"), 0o700))
	require.NoError(t, os.Symlink(filepath.Join(root, "good", runcStateFile), filepath.Join(root, "linkfile", runcStateFile)))
	// A FIFO as the state file: refused at once, not read (no hang).
	require.NoError(t, os.MkdirAll(filepath.Join(root, "fifo"), 0o700))
	require.NoError(t, syscall.Mkfifo(filepath.Join(root, "fifo", crunStateFile), 0o600))
	// No pid, a relative bundle.
	h.crun(root, "nopid", 0, 0, "/b", false)
	h.crun(root, "relbundle", 300, 1, "bundles/x", false)
	// A plain file in the root.
	require.NoError(t, os.WriteFile(filepath.Join(root, "stray"), nil, 0o600))
	// A directory with no state file yet: a create in progress.
	require.NoError(t, os.MkdirAll(filepath.Join(root, "creating"), 0o700))
	require.NoError(t, syscall.Mkfifo(filepath.Join(root, "creating", execFifo), 0o622))

	res := h.scan(root)
	require.Len(t, res.Containers, 1, "only the good container: %+v", res.Containers)
	assert.Equal(t, "good", res.Containers[0].ID)
	assert.Equal(t, StatusRunning, res.Containers[0].Status)
	assert.Equal(t, []string{filepath.Join(root, "creating")}, res.Creating)

	probs := problemPaths(res)
	for name, want := range map[string]string{
		"malformed": "decode",
		"huge":      "more than",
		"other":     `holds container "renamed"`,
		"linkdir":   "symlink",
		"linkfile":  "symlink: not followed",
		"fifo":      "not a regular file",
		"nopid":     "no init pid",
		"relbundle": "no absolute bundle",
		"stray":     "not a container directory",
	} {
		p := filepath.Join(root, name)
		require.Contains(t, probs, p, "problem for %s", name)
		assert.Contains(t, probs[p], want, name)
	}
	assert.Len(t, probs, 9)
}

// TestScanRootProblems: a root that is a symlink or a file is reported
// and not read; a relative root is refused.
func TestScanRootProblems(t *testing.T) {
	h := newHost(t)
	realRoot := h.root("real")
	h.process(400, 1, 'S')
	h.runc(realRoot, "a", 400, 1, h.bundle("a", nil, nil), false)
	require.NoError(t, os.Symlink(realRoot, h.root("link")))
	require.NoError(t, os.WriteFile(h.root("file"), nil, 0o600))

	res := h.scan(h.root("link"), h.root("file"), "relative/root")
	assert.Empty(t, res.Containers)
	assert.Empty(t, res.Roots)
	probs := problemPaths(res)
	assert.Contains(t, probs[h.root("link")], "symlink")
	assert.Contains(t, probs[h.root("file")], "not a directory")
	assert.Contains(t, probs["relative/root"], "absolute")
}

// TestScanLiveWithoutSpec: a live container whose bundle cannot be read is
// listed, with why: it runs, whatever it reaches.
func TestScanLiveWithoutSpec(t *testing.T) {
	h := newHost(t)
	root := h.root("crun")
	h.process(500, 1, 'S')
	h.crun(root, "nobundle", 500, 1, filepath.Join(h.base, "vanished"), false)
	res := h.scan(root)
	require.Len(t, res.Live(), 1)
	c := res.Live()[0]
	assert.Equal(t, StatusRunning, c.Status)
	assert.Nil(t, c.Spec)
	require.Error(t, c.SpecErr)
	assert.Contains(t, c.SpecErr.Error(), "config.json")
}

// TestScanCrunBundleSlash: crun 1.8 records the bundle "/" (its working
// directory) for a container with a user namespace and devices. The scan
// reads crun's own copy of the spec, <root>/<id>/config.json, as the hook
// did at create, and never /config.json: where the copy cannot be read, or
// names paths relative to the bundle (unknown), the container is listed
// with why.
func TestScanCrunBundleSlash(t *testing.T) {
	h := newHost(t)
	root := h.root("crun")
	copyOf := func(id string, spec specs.Spec, mode os.FileMode) {
		data, err := json.Marshal(spec)
		require.NoError(t, err)
		p := filepath.Join(root, id, "config.json")
		require.NoError(t, os.WriteFile(p, data, 0o600))
		require.NoError(t, os.Chmod(p, mode))
	}
	gpu0 := specs.Spec{Version: specs.Version, Process: &specs.Process{Env: []string{"NVIDIA_VISIBLE_DEVICES=0"}, Capabilities: podmanCaps()},
		Annotations: map[string]string{"io.kubernetes.pod.namespace": "ns1"}}
	for i, id := range []string{"slash", "slashes", "none", "open", "relroot", "relbind"} {
		h.process(200+i, 7000, 'S')
		bundle := "/"
		if id == "slashes" {
			bundle = "//"
		}
		h.crun(root, id, 200+i, 7000, bundle, false)
	}
	copyOf("slash", gpu0, 0o600)
	copyOf("slashes", gpu0, 0o644)
	copyOf("open", gpu0, 0o666)
	rel := gpu0
	rel.Root = &specs.Root{Path: "rootfs"}
	copyOf("relroot", rel, 0o600)
	rel = gpu0
	rel.Mounts = []specs.Mount{{Destination: "/data", Type: "bind", Source: "data", Options: []string{"rbind"}}}
	copyOf("relbind", rel, 0o600)

	got := byID(h.scan(root))
	for _, id := range []string{"slash", "slashes"} {
		c := got[id]
		require.NoError(t, c.SpecErr, id)
		assert.Contains(t, c.Request.Env, "NVIDIA_VISIBLE_DEVICES=0", id)
		assert.Equal(t, "ns1", c.Annotations["io.kubernetes.pod.namespace"], id)
	}
	const why = `the runtime records the bundle "/", which crun 1.8 records instead of the bundle for a container with a user namespace ` +
		`and devices (its working directory): /config.json is not its spec, and crun's copy in its state directory is read instead: `
	for id, want := range map[string]string{
		"none":    "open " + filepath.Join(root, "none", "config.json") + ": no such file or directory",
		"open":    filepath.Join(root, "open", "config.json") + " is writable by others than its owner",
		"relroot": `names the relative root.path "rootfs", read from the bundle, which the runtime did not record`,
		"relbind": `binds the relative source "data" at "/data", read from the bundle, which the runtime did not record`,
	} {
		c := got[id]
		require.True(t, c.Live(), id)
		require.Error(t, c.SpecErr, id)
		assert.Nil(t, c.Spec, id)
		assert.Contains(t, c.SpecErr.Error(), why, id)
		assert.Contains(t, c.SpecErr.Error(), want, id)
		assert.NotContains(t, c.SpecErr.Error(), "open /config.json", id)
	}
}

// TestScanStopsAtItsDeadline: a scan whose deadline has passed lists nothing
// more and says where it stopped, so that a caller who must answer by then
// knows the list is incomplete (a recovery from it would lose the claims of
// the containers left out).
func TestScanStopsAtItsDeadline(t *testing.T) {
	h := newHost(t)
	runcRoot := h.root("runc")
	h.process(100, 5000, 'S')
	h.runc(runcRoot, "r-running", 100, 5000, h.bundle("r-running", []string{"NVIDIA_VISIBLE_DEVICES=1"}, nil), false)

	res := Scan([]string{runcRoot}, Options{ProcRoot: h.proc, Deadline: time.Now().Add(-time.Second)})
	assert.Empty(t, res.Containers)
	assert.Contains(t, res.Unfinished, "stopped at its deadline in "+runcRoot+" after 0 of 1 entries")

	res = Scan([]string{runcRoot}, Options{ProcRoot: h.proc, Deadline: time.Now().Add(time.Hour)})
	assert.Empty(t, res.Unfinished)
	assert.Len(t, res.Live(), 1)
}

// A running container is read as its hook read it at create-runtime: a bind
// of the host's /dev opens every GPU where no device cgroup stops it (the
// container's process in no cgroup named after it, or a rootless runtime,
// whose state root another user owns), so that a recovery rebuilds the
// claim the hook made; where the container's own cgroup (crun's systemd
// sub-cgroup of its scope included) applies its rules, the bind brings
// nothing. So does CAP_MKNOD, and a spec without a capabilities object,
// which counts as holding every capability.
func TestScanReadsBindsAsTheHookDid(t *testing.T) {
	for _, tc := range []struct {
		name      string
		cgroup    string // /proc/<pid>/cgroup; "" = none
		rootOwner int
		opens     bool
		// mknod: the container has CAP_MKNOD and binds no /dev.
		mknod bool
		// noCaps: its spec has no capabilities object (every capability)
		// and binds no /dev.
		noCaps bool
	}{
		{"own scope", "0::/machine.slice/libpod-c1.scope\n", 0, false, false, false},
		{"crun's sub-cgroup of its scope", "0::/machine.slice/libpod-c1.scope/container\n", 0, false, false, false},
		{"v1 own devices cgroup", "11:devices:/c1\n0::/user.slice/session-1.scope\n", 0, false, false, false},
		{"the caller's cgroup (no device cgroup)", "0::/user.slice/session-1.scope\n", 0, true, false, false},
		{"cgroup unreadable", "", 0, true, false, false},
		{"rootless runtime's root", "0::/user.slice/user-1000.slice/user@1000.service/libpod-c1.scope\n", 1000, true, false, false},
		{"CAP_MKNOD, own scope", "0::/machine.slice/libpod-c1.scope\n", 0, false, true, false},
		{"CAP_MKNOD, the caller's cgroup", "0::/user.slice/session-1.scope\n", 0, true, true, false},
		{"CAP_MKNOD, rootless runtime's root", "0::/user.slice/user-1000.slice/user@1000.service/libpod-c1.scope\n", 1000, false, true, false},
		{"no capabilities object, own scope", "0::/machine.slice/libpod-c1.scope\n", 0, false, false, true},
		{"no capabilities object, the caller's cgroup", "0::/user.slice/session-1.scope\n", 0, true, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHost(t)
			h.process(300, 30, 'S')
			if tc.cgroup != "" {
				require.NoError(t, os.WriteFile(filepath.Join(h.proc, "300", "cgroup"), []byte(tc.cgroup), 0o644))
			}
			bundle := filepath.Join(h.base, "bundles", "c1")
			require.NoError(t, os.MkdirAll(bundle, 0o755))
			spec := specs.Spec{Version: specs.Version, Process: &specs.Process{Env: []string{"PATH=/bin"}, Capabilities: podmanCaps()},
				Mounts: []specs.Mount{{Destination: "/host/dev", Source: "/dev", Type: "bind", Options: []string{"rbind"}}}}
			switch {
			case tc.mknod:
				spec.Process.Capabilities = &specs.LinuxCapabilities{Bounding: []string{"CAP_MKNOD"}}
				spec.Mounts = []specs.Mount{{Destination: "/data", Source: h.base, Type: "bind"}}
			case tc.noCaps:
				spec.Process.Capabilities = nil
				spec.Mounts = []specs.Mount{{Destination: "/data", Source: h.base, Type: "bind"}}
			}
			c := h.scanRunning(t, bundle, spec, tc.rootOwner)
			assert.Equal(t, !tc.mknod && !tc.noCaps, c.Request.HostDevMounted)
			assert.Equal(t, tc.opens, c.Request.GPUNodesAllowed)
			assert.Equal(t, tc.opens, c.Request.NoDeviceCgroup)
		})
	}
}

// A root whose owner cannot be told may be a rootful runtime's or a
// rootless one's: its containers are read both ways at once. No device
// cgroup applies (a rootless runtime sets up none), and CAP_MKNOD and an
// overlay of the host's /dev open every GPU (as under a rootful runtime
// that sets up none), though each container's process is in a cgroup of
// its own. A container with neither, binding nothing device-like, reaches
// nothing.
func TestScanRootOwnerUnknownReadsBothWays(t *testing.T) {
	for name, stat := range map[string]func(*os.File) (fs.FileInfo, error){
		"stat fails":           func(*os.File) (fs.FileInfo, error) { return nil, syscall.EIO },
		"no owner in its info": func(f *os.File) (fs.FileInfo, error) { return noOwner{}, nil },
	} {
		t.Run(name, func(t *testing.T) {
			h := newHost(t)
			root := h.root("runc")
			for i, tc := range []struct {
				id    string
				edit  func(*specs.Spec)
				opens bool
			}{
				{"mknod", func(s *specs.Spec) {
					s.Process.Capabilities.Bounding = append(s.Process.Capabilities.Bounding, "CAP_MKNOD")
				}, true},
				{"overlay", func(s *specs.Spec) {
					s.Mounts = append(s.Mounts, specs.Mount{Destination: "/x", Type: "overlay", Source: "overlay", Options: []string{"lowerdir=/dev"}})
				}, true},
				{"bind", func(s *specs.Spec) {
					s.Mounts = append(s.Mounts, specs.Mount{Destination: "/x", Type: "bind", Source: "/dev", Options: []string{"rbind"}})
				}, true},
				{"plain", func(*specs.Spec) {}, false},
			} {
				pid := 300 + i
				h.process(pid, 30, 'S')
				require.NoError(t, os.WriteFile(filepath.Join(h.proc, fmt.Sprint(pid), "cgroup"),
					[]byte("0::/machine.slice/libpod-"+tc.id+".scope\n"), 0o644))
				bundle := filepath.Join(h.base, "bundles", tc.id)
				require.NoError(t, os.MkdirAll(bundle, 0o755))
				// The data bind is nodev: a directory bound without it reaches
				// every GPU where no device cgroup applies (a node in it opens).
				spec := specs.Spec{Version: specs.Version, Process: &specs.Process{Env: []string{"PATH=/bin"}, Capabilities: podmanCaps()},
					Mounts: []specs.Mount{{Destination: "/data", Source: h.base, Type: "bind", Options: []string{"rbind", "nodev"}}}}
				tc.edit(&spec)
				data, err := json.Marshal(spec)
				require.NoError(t, err)
				require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
				h.runc(root, tc.id, pid, 30, bundle, false)
			}
			// root's: rootful, each container fenced by its own cgroup.
			require.NoError(t, os.Chown(root, 0, 0))
			for id, c := range byID(h.scan(root)) {
				require.True(t, c.Live(), c.Why)
				require.NoError(t, c.SpecErr)
				assert.False(t, c.Request.GPUNodesAllowed, "%s: its own device cgroup fences it", id)
			}
			got := byID(Scan([]string{root}, Options{ProcRoot: h.proc, statRoot: stat}))
			require.Len(t, got, 4)
			for id, want := range map[string]bool{"mknod": true, "overlay": true, "bind": true, "plain": false} {
				c := got[id]
				require.True(t, c.Live(), c.Why)
				require.NoError(t, c.SpecErr)
				assert.Equal(t, want, c.Request.GPUNodesAllowed, id)
				assert.Equal(t, want, c.Request.NoDeviceCgroup, id)
			}
		})
	}
}

// A container that no device cgroup fences, whose read-write root
// filesystem lies on nodev storage and which binds a directory from it
// without flag options of its own, reaches no GPU under runc (it keeps
// both nodevs) and every GPU under crun (it drops both): the scan reads
// each as the runtime its state file's format names left it, as its hook
// read it at create-runtime, so that a recovery claims for a runc
// container what its hook did, not every GPU.
func TestScanReadsNodevAsItsRuntimeKeptIt(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("a nodev mount needs root")
	}
	h := newHost(t)
	storage := filepath.Join(h.base, "storage")
	require.NoError(t, os.MkdirAll(storage, 0o755))
	require.NoError(t, unix.Mount("gg", storage, "tmpfs", unix.MS_NODEV, ""))
	t.Cleanup(func() { _ = unix.Unmount(storage, unix.MNT_DETACH) })
	runcRoot, crunRoot := h.root("runc"), h.root("crun")
	for i, tc := range []struct {
		id    string
		write func(root, id string, pid int, start uint64, bundle string, created bool) string
		root  string
	}{
		{"r1", h.runc, runcRoot},
		{"c1", h.crun, crunRoot},
	} {
		pid := 300 + i
		h.process(pid, 30, 'S')
		// The caller's cgroup: no device cgroup of its own.
		require.NoError(t, os.WriteFile(filepath.Join(h.proc, fmt.Sprint(pid), "cgroup"),
			[]byte("0::/user.slice/session-1.scope\n"), 0o644))
		rootfs, data := filepath.Join(storage, tc.id, "rootfs"), filepath.Join(storage, tc.id, "data")
		require.NoError(t, os.MkdirAll(rootfs, 0o755))
		require.NoError(t, os.MkdirAll(data, 0o755))
		bundle := filepath.Join(h.base, "bundles", tc.id)
		require.NoError(t, os.MkdirAll(bundle, 0o755))
		spec := specs.Spec{Version: specs.Version, Process: &specs.Process{Env: []string{"PATH=/bin"}, Capabilities: podmanCaps()},
			Root: &specs.Root{Path: rootfs},
			Mounts: []specs.Mount{
				{Destination: "/dev", Type: "tmpfs", Source: "tmpfs"},
				{Destination: "/data", Type: "bind", Source: data, Options: []string{"rbind"}},
			}}
		raw, err := json.Marshal(spec)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), raw, 0o600))
		tc.write(tc.root, tc.id, pid, 30, bundle, false)
	}
	require.NoError(t, os.Chown(runcRoot, 0, 0))
	require.NoError(t, os.Chown(crunRoot, 0, 0))
	got := byID(h.scan(runcRoot, crunRoot))
	require.Len(t, got, 2)
	for id, want := range map[string]struct {
		runtime string
		opens   bool
	}{"r1": {RuntimeRunc, false}, "c1": {RuntimeCrun, true}} {
		c := got[id]
		require.True(t, c.Live(), c.Why)
		require.NoError(t, c.SpecErr)
		assert.Equal(t, want.runtime, c.Runtime, id)
		assert.Equal(t, want.opens, c.Request.RootStorageNodev, "%s: its root on nodev storage, named where counted", id)
		assert.Equal(t, want.opens, c.Request.GPUNodesAllowed, id)
		assert.Equal(t, want.opens, c.Request.ImageNodes, "%s: its root", id)
		if want.opens {
			assert.Equal(t, devices.RootNodevDroppedByRuntime, c.Request.RootNodev, id)
			assert.Equal(t, []devices.NodeDir{{Path: filepath.Join(storage, id, "data"), BoundAt: "/data", NodevDropped: true}},
				c.Request.NodeDirs, "%s: its bind", id)
		} else {
			assert.Equal(t, devices.RootNodevKept, c.Request.RootNodev, id)
			assert.Empty(t, c.Request.NodeDirs, "%s: its bind", id)
		}
	}
}

// A state file's format names the runtime RunningRequest reads a container
// as: runc's keeps the nodevs its hook read kept; crun's, or one not told,
// is read as crun leaves a container.
func TestHookRuntime(t *testing.T) {
	assert.Equal(t, hook.RuntimeRunc, hookRuntime(RuntimeRunc))
	assert.Equal(t, hook.RuntimeCrun, hookRuntime(RuntimeCrun))
	assert.Equal(t, hook.RuntimeUnknown, hookRuntime(""))
	assert.Equal(t, hook.RuntimeUnknown, hookRuntime("youki"))
}

// A linux.devices entry whose path is a GPU node on the host, though its
// numbers are /dev/null's, reaches that GPU where the runtime binds the
// path (it cannot mknod: a rootless runtime, runc for a container with a
// user namespace of its own) and no device cgroup stops the open: the scan
// reads it as the hook did at create-runtime. In a device cgroup of its own
// under a rootful runtime only the numbers count.
func TestScanReadsDevicePathsAsTheHookDid(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mknod of a GPU node needs root")
	}
	gpu := filepath.Join(t.TempDir(), "g")
	require.NoError(t, syscall.Mknod(gpu, syscall.S_IFCHR|0o600, int(195<<8|2)))
	for _, tc := range []struct {
		name      string
		cgroup    string
		rootOwner int
		reaches   bool
	}{
		{"rootless runtime's root", "0::/user.slice/user-1000.slice/user@1000.service/libpod-c1.scope\n", 1000, true},
		{"rootful, the caller's cgroup (no device cgroup)", "0::/user.slice/session-1.scope\n", 0, true},
		{"rootful, own scope", "0::/machine.slice/libpod-c1.scope\n", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHost(t)
			h.process(300, 30, 'S')
			require.NoError(t, os.WriteFile(filepath.Join(h.proc, "300", "cgroup"), []byte(tc.cgroup), 0o644))
			bundle := filepath.Join(h.base, "bundles", "c1")
			require.NoError(t, os.MkdirAll(bundle, 0o755))
			spec := specs.Spec{Version: specs.Version, Process: &specs.Process{Env: []string{"PATH=/bin"}, Capabilities: podmanCaps()},
				Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.UserNamespace}},
					Devices: []specs.LinuxDevice{{Path: gpu, Type: "c", Major: 1, Minor: 3}}}}
			c := h.scanRunning(t, bundle, spec, tc.rootOwner)
			var bound []int64
			for _, d := range c.Request.Devices {
				if d.BoundAt != "" {
					bound = append(bound, d.Major, d.Minor)
				}
			}
			if tc.reaches {
				assert.Equal(t, []int64{195, 2}, bound, "the host's node at the path")
			} else {
				assert.Empty(t, bound, "its device cgroup allows only what the numbers make")
			}
		})
	}
}

// noOwner is a root's FileInfo that carries no owner.
type noOwner struct{}

func (noOwner) Name() string       { return "runc" }
func (noOwner) Size() int64        { return 0 }
func (noOwner) Mode() fs.FileMode  { return fs.ModeDir | 0o700 }
func (noOwner) ModTime() time.Time { return time.Time{} }
func (noOwner) IsDir() bool        { return true }
func (noOwner) Sys() any           { return nil }

func TestRootUserNS(t *testing.T) {
	fi, err := os.Stat(t.TempDir())
	require.NoError(t, err)
	owner := *fi.Sys().(*syscall.Stat_t)
	owner.Uid = 0
	require.Equal(t, hook.Rootful, rootUserNS(withSys{fi, &owner}, nil), "root's")
	owner.Uid = 1000
	require.Equal(t, hook.Rootless, rootUserNS(withSys{fi, &owner}, nil), "another user's")
	require.Equal(t, hook.UnknownUserNS, rootUserNS(nil, syscall.EIO), "not read")
	require.Equal(t, hook.UnknownUserNS, rootUserNS(noOwner{}, nil), "no owner")
}

// withSys is a FileInfo with another Sys.
type withSys struct {
	fs.FileInfo
	sys any
}

func (w withSys) Sys() any { return w.sys }
