// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"
)

// crunRig is a container run by crun 1.8 with a user namespace and a
// device: its OCI state names the bundle "/" (crun's working directory),
// its spec is in bundle/config.json and in crun's copy
// root/<id>/config.json, and the hook's parent (pid crunPid, in a /proc
// tree of its own that links the container's process to the real one)
// is crun, whose command line is args and whose environment is env.
type crunRig struct {
	t      *testing.T
	e      env
	root   string // crun's --root
	bundle string
	proc   string
	env    []string
}

const crunPid = 4000

func newCrunRig(t *testing.T) *crunRig {
	t.Helper()
	r := &crunRig{t: t, root: filepath.Join(t.TempDir(), "crun"), bundle: t.TempDir(), proc: t.TempDir()}
	require.NoError(t, os.Mkdir(r.root, 0o700))
	opened := 0
	r.e = testEnv(&opened)
	r.e.procRoot = r.proc
	r.e.getppid = func() int { return crunPid }
	r.e.markerDir = t.TempDir()
	r.e.userNS = func() RuntimeUserNS { return Rootful }
	return r
}

// spec writes the container id's spec (podman's capabilities, a user
// namespace and env) to the bundle and to crun's copy.
func (r *crunRig) spec(id string, env ...string) {
	r.t.Helper()
	data, err := json.Marshal(specs.Spec{Version: specs.Version, Root: &specs.Root{Path: "rootfs"},
		Process: &specs.Process{Env: env, Capabilities: podmanCaps()},
		Linux:   &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.UserNamespace}}}})
	require.NoError(r.t, err)
	require.NoError(r.t, os.WriteFile(filepath.Join(r.bundle, "config.json"), data, 0o600))
	dir := filepath.Join(r.root, id)
	require.NoError(r.t, os.MkdirAll(dir, 0o700))
	require.NoError(r.t, os.WriteFile(filepath.Join(dir, "config.json"), data, 0o700))
}

// cmdline makes args the command line of the hook's parent, and r.env its
// environment.
func (r *crunRig) cmdline(args ...string) {
	r.t.Helper()
	dir := filepath.Join(r.proc, strconv.Itoa(crunPid))
	require.NoError(r.t, os.MkdirAll(dir, 0o755))
	require.NoError(r.t, os.WriteFile(filepath.Join(dir, "cmdline"), []byte(strings.Join(args, "\x00")+"\x00"), 0o644))
	environ := ""
	for _, kv := range r.env {
		environ += kv + "\x00"
	}
	require.NoError(r.t, os.WriteFile(filepath.Join(dir, "environ"), []byte(environ), 0o400))
}

// process links the real process pid into the rig's /proc tree.
func (r *crunRig) process(pid int) {
	r.t.Helper()
	require.NoError(r.t, os.Symlink(filepath.Join("/proc", strconv.Itoa(pid)), filepath.Join(r.proc, strconv.Itoa(pid))))
}

func crunState(t *testing.T, id string, status specs.ContainerState, pid int, bundle string) string {
	t.Helper()
	st, err := json.Marshal(specs.State{Version: specs.Version, ID: id, Status: status, Pid: pid, Bundle: bundle})
	require.NoError(t, err)
	return string(st)
}

// crun 1.8 hands a container with a user namespace and devices the bundle
// "/": the hook reads crun's own copy of the spec, and the bundle crun was
// given becomes the container's. A container that names no GPU is let
// through before the configuration is read, as any other.
func TestCrunBundleSlashNoGPU(t *testing.T) {
	r := newCrunRig(t)
	r.spec("plain", "PATH=/bin")
	r.cmdline("/usr/bin/crun", "--log-format=json", "--log", "/x/oci-log", "--root", r.root, "create", "--bundle", r.bundle, "--pid-file", "/x/pidfile", "plain")
	in := r.e.readInput(strings.NewReader(crunState(t, "plain", specs.StateCreating, 4242, "/")))
	require.NoError(t, in.specErr)
	require.True(t, in.NeverClaims())
	require.Equal(t, r.bundle, in.state.Bundle)
}

// An option given twice counts as the runtime counts it: the last one
// (crun's argp and runc's flag parser keep overwriting).
func TestCrunBundleSlashLastOptionWins(t *testing.T) {
	r := newCrunRig(t)
	r.spec("c", "PATH=/bin")
	wrong := t.TempDir()
	r.cmdline("crun", "--root", filepath.Join(wrong, "crun"), "--root="+r.root, "create", "--bundle", wrong, "-b", r.bundle, "c")
	in := r.e.readInput(strings.NewReader(crunState(t, "c", specs.StateCreating, 4242, "/")))
	require.NoError(t, in.specErr)
	require.True(t, in.NeverClaims())
	require.Equal(t, r.bundle, in.state.Bundle)
}

// One that names a GPU claims it; its marker goes by the bundle crun was
// given, and the poststop podman runs (with that bundle) finds it and
// releases the claim.
func TestCrunBundleSlashClaimsAndReleases(t *testing.T) {
	cfg := staticConfig(t)
	r := newCrunRig(t)
	pid, end := containerProcess(t)
	r.process(pid)
	r.spec("gpu", "NVIDIA_VISIBLE_DEVICES=1")
	r.cmdline("crun", "--root="+r.root, "create", "-b", r.bundle, "gpu")
	require.NoError(t, r.e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(crunState(t, "gpu", specs.StateCreated, pid, "/")), io.Discard))
	snap := ledgerState(t, cfg)
	require.Equal(t, map[string]string{gpuUUIDs[1]: "gpu"}, holdersOf(snap))
	mk := newMarker(r.e.markerDir, specs.State{ID: "gpu", Bundle: r.bundle}, cfg.Ledger.Dir)
	require.FileExists(t, mk.path, "the marker names the bundle poststop is given")

	end()
	r.cmdline("podman", "container", "cleanup", "gpu")
	require.NoError(t, r.e.run(t.Context(), PhasePoststop, cfg, strings.NewReader(crunState(t, "gpu", specs.StateStopped, 0, r.bundle)), io.Discard))
	require.Empty(t, ledgerState(t, cfg).Claims)
	require.NoFileExists(t, mk.path)
}

// `crun delete` hands poststop the bundle "/" too, and its command line
// names no bundle: poststop cannot take the spec's word and reads the
// ledger, releasing what create-runtime claimed.
func TestCrunBundleSlashDeleteReleases(t *testing.T) {
	cfg := staticConfig(t)
	r := newCrunRig(t)
	pid, end := containerProcess(t)
	r.process(pid)
	r.spec("gpu", "NVIDIA_VISIBLE_DEVICES=2")
	r.cmdline("crun", "--root", r.root, "create", "--bundle="+r.bundle, "gpu")
	require.NoError(t, r.e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(crunState(t, "gpu", specs.StateCreated, pid, "/")), io.Discard))
	require.Equal(t, map[string]string{gpuUUIDs[2]: "gpu"}, holdersOf(ledgerState(t, cfg)))

	mk := newMarker(r.e.markerDir, specs.State{ID: "gpu", Bundle: r.bundle}, cfg.Ledger.Dir)
	require.FileExists(t, mk.path)
	// Markers poststop has no business with: another container's, one of
	// another ledger.
	other := newMarker(r.e.markerDir, specs.State{ID: "other", Bundle: r.bundle}, cfg.Ledger.Dir)
	require.NoError(t, other.write())
	elsewhere := newMarker(r.e.markerDir, specs.State{ID: "gpu", Bundle: t.TempDir()}, t.TempDir())
	require.NoError(t, elsewhere.write())

	end()
	r.cmdline("crun", "--root", r.root, "delete", "-f", "gpu")
	in := r.e.readInput(strings.NewReader(crunState(t, "gpu", specs.StateStopped, 0, "/")))
	require.ErrorIs(t, in.specErr, errInput)
	require.False(t, in.NeverClaims())
	var stderr strings.Builder
	require.NoError(t, r.e.run(t.Context(), PhasePoststop, cfg, strings.NewReader(crunState(t, "gpu", specs.StateStopped, 0, "/")), &stderr))
	require.Empty(t, ledgerState(t, cfg).Claims)
	require.NoFileExists(t, mk.path, "the marker named after the bundle crun was given goes, though delete does not name it")
	require.FileExists(t, other.path)
	require.FileExists(t, elsewhere.path)
	require.Empty(t, stderr.String())
}

// A crun run without --root keeps its state in $XDG_RUNTIME_DIR/crun where
// its environment sets XDG_RUNTIME_DIR (a root login session sets
// /run/user/0), as rootless crun does: the hook reads crun's copy there,
// claims the GPU, and `crun delete`'s poststop releases it.
func TestCrunBundleSlashXDGRuntimeDir(t *testing.T) {
	cfg := staticConfig(t)
	r := newCrunRig(t)
	xdg := t.TempDir()
	r.root = filepath.Join(xdg, "crun")
	require.NoError(t, os.Mkdir(r.root, 0o700))
	r.env = []string{"PATH=/usr/bin", "XDG_RUNTIME_DIR=" + xdg}
	pid, end := containerProcess(t)
	r.process(pid)
	r.spec("gpu", "NVIDIA_VISIBLE_DEVICES=3")
	r.cmdline("crun", "create", "--bundle", r.bundle, "gpu")
	require.NoError(t, r.e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(crunState(t, "gpu", specs.StateCreated, pid, "/")), io.Discard))
	require.Equal(t, map[string]string{gpuUUIDs[3]: "gpu"}, holdersOf(ledgerState(t, cfg)))

	end()
	r.cmdline("crun", "delete", "-f", "gpu")
	require.NoError(t, r.e.run(t.Context(), PhasePoststop, cfg, strings.NewReader(crunState(t, "gpu", specs.StateStopped, 0, "/")), io.Discard))
	require.Empty(t, ledgerState(t, cfg).Claims)
}

// crun's state root: its --root; without one, $XDG_RUNTIME_DIR/crun where
// its environment sets XDG_RUNTIME_DIR and not empty (getenv's first entry),
// whatever crun's user; /run/crun otherwise.
func TestCrunStateRoot(t *testing.T) {
	for _, tc := range []struct {
		name    string
		args    []string
		environ []string
		want    string
	}{
		{"--root", []string{"crun", "--root", "/r", "create", "id"}, []string{"XDG_RUNTIME_DIR=/run/user/0"}, "/r"},
		{"--root=", []string{"crun", "--root=/r", "delete", "id"}, nil, "/r"},
		{"XDG_RUNTIME_DIR", []string{"crun", "create", "-b", "/b", "id"}, []string{"HOME=/root", "XDG_RUNTIME_DIR=/run/user/0"}, "/run/user/0/crun"},
		{"rootless", []string{"crun", "--rootless=true", "create", "id"}, []string{"XDG_RUNTIME_DIR=/run/user/1000"}, "/run/user/1000/crun"},
		{"the first of two", []string{"crun", "create", "id"}, []string{"XDG_RUNTIME_DIR=/a", "XDG_RUNTIME_DIR=/b"}, "/a/crun"},
		{"empty", []string{"crun", "create", "id"}, []string{"XDG_RUNTIME_DIR="}, crunDefaultRoot},
		{"the first of two, empty", []string{"crun", "create", "id"}, []string{"XDG_RUNTIME_DIR=", "XDG_RUNTIME_DIR=/b"}, crunDefaultRoot},
		{"another variable", []string{"crun", "create", "id"}, []string{"XDG_RUNTIME_DIRS=/a", "MY_XDG_RUNTIME_DIR=/b"}, crunDefaultRoot},
		{"no environment", []string{"crun", "create", "id"}, []string{""}, crunDefaultRoot},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// As crunSpec reads it: the environment only without --root.
			root, _, err := runtimeDirs(tc.args)
			require.NoError(t, err)
			if root == "" {
				root = crunStateRoot(tc.environ)
			}
			require.Equal(t, tc.want, root)
		})
	}
}

// The spec is crun's own only: a copy a user other than root could have
// written, or reached through a symlink, or an id that is no file name, is
// not read, and neither is "/config.json". The container is refused with
// the bundle the state names and what to do.
func TestCrunBundleSlashRefused(t *testing.T) {
	for _, tc := range []struct {
		name  string
		id    string
		setup func(r *crunRig)
		want  []string
	}{
		{"no copy in crun's root", "gone", func(r *crunRig) {
			r.cmdline("crun", "--root", r.root, "create", "--bundle", r.bundle, "gone")
		}, []string{"/gone: no such file or directory"}},
		{"default root, no copy", "gone-" + strconv.Itoa(os.Getpid()), func(r *crunRig) {
			r.cmdline("crun", "create", "--bundle", r.bundle, "gone-"+strconv.Itoa(os.Getpid()))
		}, []string{"(sought at " + filepath.Join(crunDefaultRoot, "gone-"+strconv.Itoa(os.Getpid()), "config.json") + ")"}},
		{"XDG_RUNTIME_DIR, no copy", "c", func(r *crunRig) {
			r.spec("c", "PATH=/bin") // in --root, not where crun keeps it
			r.env = []string{"XDG_RUNTIME_DIR=" + filepath.Dir(r.bundle)}
			r.cmdline("crun", "create", "--bundle", r.bundle, "c")
		}, []string{"the runtime's own copy of the spec cannot be read", "/crun: no such file or directory"}},
		{"a relative XDG_RUNTIME_DIR", "c", func(r *crunRig) {
			r.env = []string{"XDG_RUNTIME_DIR=run"}
			r.cmdline("crun", "create", "--bundle", r.bundle, "c")
		}, []string{`the runtime's state root "run/crun" is not an absolute path`}},
		{"the runtime's environment unreadable", "c", func(r *crunRig) {
			r.spec("c", "PATH=/bin")
			r.cmdline("crun", "create", "--bundle", r.bundle, "c")
			require.NoError(t, os.Remove(filepath.Join(r.proc, strconv.Itoa(crunPid), "environ")))
		}, []string{"the environment of the runtime that ran this hook (pid 4000), which names its state root (XDG_RUNTIME_DIR) " +
			"where its command line names no --root, cannot be read", "environ: no such file or directory", "Give the runtime --root"}},
		{"the runtime's environment too large", "c", func(r *crunRig) {
			r.spec("c", "PATH=/bin")
			r.env = []string{"BIG=" + strings.Repeat("x", maxEnvironBytes)}
			r.cmdline("crun", "create", "--bundle", r.bundle, "c")
		}, []string{"environ is larger than 262144 bytes"}},
		{"the runtime's environment not read with --root", "c", func(r *crunRig) {
			r.cmdline("crun", "--root", r.root, "create", "--bundle", r.bundle, "c")
			require.NoError(t, os.Remove(filepath.Join(r.proc, strconv.Itoa(crunPid), "environ")))
		}, []string{filepath.Join("crun", "c") + ": no such file or directory"}},
		{"no bundle on the command line", "c", func(r *crunRig) {
			r.spec("c", "PATH=/bin")
			r.cmdline("crun", "--root", r.root, "create", "c")
		}, []string{"names no absolute --bundle"}},
		{"a relative bundle", "c", func(r *crunRig) {
			r.spec("c", "PATH=/bin")
			r.cmdline("crun", "--root", r.root, "create", "--bundle", "b", "c")
		}, []string{"names no absolute --bundle"}},
		{"the runtime's command line unreadable", "c", func(r *crunRig) { r.spec("c", "PATH=/bin") },
			[]string{"cannot be read to find the spec"}},
		{"the copy writable by others", "c", func(r *crunRig) {
			r.spec("c", "PATH=/bin")
			require.NoError(t, os.Chmod(filepath.Join(r.root, "c", "config.json"), 0o666))
			r.cmdline("crun", "--root", r.root, "create", "--bundle", r.bundle, "c")
		}, []string{"writable by others than its owner"}},
		{"the container's dir writable by others", "c", func(r *crunRig) {
			r.spec("c", "PATH=/bin")
			require.NoError(t, os.Chmod(filepath.Join(r.root, "c"), 0o777))
			r.cmdline("crun", "--root", r.root, "create", "--bundle", r.bundle, "c")
		}, []string{"writable by others than its owner"}},
		{"the root writable by others", "c", func(r *crunRig) {
			r.spec("c", "PATH=/bin")
			require.NoError(t, os.Chmod(r.root, 0o1777))
			r.cmdline("crun", "--root", r.root, "create", "--bundle", r.bundle, "c")
		}, []string{"writable by others than its owner"}},
		{"the copy a symlink", "c", func(r *crunRig) {
			r.spec("c", "PATH=/bin")
			copyPath := filepath.Join(r.root, "c", "config.json")
			require.NoError(t, os.Rename(copyPath, copyPath+".real"))
			require.NoError(t, os.Symlink(copyPath+".real", copyPath))
			r.cmdline("crun", "--root", r.root, "create", "--bundle", r.bundle, "c")
		}, []string{"too many levels of symbolic links"}},
		{"the container's dir a symlink", "c", func(r *crunRig) {
			r.spec("elsewhere", "PATH=/bin")
			require.NoError(t, os.Symlink(filepath.Join(r.root, "elsewhere"), filepath.Join(r.root, "c")))
			r.cmdline("crun", "--root", r.root, "create", "--bundle", r.bundle, "c")
		}, []string{"not a directory"}},
		{"an id with a path", "x/../c", func(r *crunRig) {
			r.spec("c", "PATH=/bin")
			r.cmdline("crun", "--root", r.root, "create", "--bundle", r.bundle, "x/../c")
		}, []string{`the container id "x/../c" is not a file name`}},
		{"an id of ..", "..", func(r *crunRig) {
			r.cmdline("crun", "--root", r.root, "create", "--bundle", r.bundle, "..")
		}, []string{`the container id ".." is not a file name`}},
		{"an abbreviated --root", "c", func(r *crunRig) {
			r.spec("c", "PATH=/bin")
			r.cmdline("crun", "--roo", r.root, "create", "--bundle", r.bundle, "c")
		}, []string{`the command line of the runtime that ran this hook (pid 4000) cannot be read as crun reads it: ` +
			`it abbreviates --root to "--roo", which crun reads as --root: give the option in full`}},
		{"an abbreviated --bundle", "c", func(r *crunRig) {
			r.spec("c", "PATH=/bin")
			r.cmdline("crun", "--root", r.root, "create", "--bundl="+r.bundle, "c")
		}, []string{`it abbreviates --bundle to "--bundl"`}},
		{"a copy that is a FIFO", "c", func(r *crunRig) {
			require.NoError(t, os.MkdirAll(filepath.Join(r.root, "c"), 0o700))
			require.NoError(t, syscall.Mkfifo(filepath.Join(r.root, "c", "config.json"), 0o600))
			r.cmdline("crun", "--root", r.root, "create", "--bundle", r.bundle, "c")
		}, []string{"not a regular file"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newCrunRig(t)
			tc.setup(r)
			in := r.e.readInput(strings.NewReader(crunState(t, tc.id, specs.StateCreated, 4242, "/")))
			require.ErrorIs(t, in.specErr, errInput)
			require.False(t, in.NeverClaims())
			msg := in.specErr.Error()
			require.Contains(t, msg, `names the bundle "/"`)
			require.NotContains(t, msg, "open /config.json")
			for _, w := range tc.want {
				require.Contains(t, msg, w)
			}
			err := r.e.run(t.Context(), PhaseCreateRuntime, staticConfig(t), strings.NewReader(crunState(t, tc.id, specs.StateCreated, 4242, "/")), io.Discard)
			require.ErrorIs(t, err, errInput, "create-runtime refuses it")
		})
	}
}

// A copy owned by another user than the runtime's is not read (as root
// only: only root can give a file away).
func TestCrunBundleSlashForeignOwner(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("chown needs root")
	}
	r := newCrunRig(t)
	r.spec("c", "PATH=/bin")
	require.NoError(t, os.Chown(filepath.Join(r.root, "c", "config.json"), 65534, 65534))
	r.cmdline("crun", "--root", r.root, "create", "--bundle", r.bundle, "c")
	in := r.e.readInput(strings.NewReader(crunState(t, "c", specs.StateCreated, 4242, "/")))
	require.ErrorContains(t, in.specErr, "is owned by uid 65534, not by the runtime's user (uid 0)")
}

// readRuntimeSpec (a recovery's reading of crun's copy) takes the
// runtime's user to be the root's owner: a rootless crun's root is its
// user's, read by root. Under such a root a copy of another user is not
// read (as root only: only root can give a file away).
func TestReadRuntimeSpecRootOwner(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("chown needs root")
	}
	root := filepath.Join(t.TempDir(), "crun")
	data, err := json.Marshal(specs.Spec{Version: specs.Version, Root: &specs.Root{Path: "/var/lib/c/rootfs"},
		Process: &specs.Process{Env: []string{"NVIDIA_VISIBLE_DEVICES=1"}, Capabilities: podmanCaps()}})
	require.NoError(t, err)
	for _, id := range []string{"mine", "foreign"} {
		require.NoError(t, os.MkdirAll(filepath.Join(root, id), 0o700))
		require.NoError(t, os.WriteFile(filepath.Join(root, id, "config.json"), data, 0o600))
	}
	for _, p := range []string{root, filepath.Join(root, "mine"), filepath.Join(root, "mine", "config.json"), filepath.Join(root, "foreign")} {
		require.NoError(t, os.Chown(p, 1000, 1000))
	}
	spec, err := readRuntimeSpec(root, "mine")
	require.NoError(t, err)
	require.Equal(t, []string{"NVIDIA_VISIBLE_DEVICES=1"}, spec.Process.Env)
	_, err = readRuntimeSpec(root, "foreign")
	require.ErrorIs(t, err, errInput)
	require.ErrorContains(t, err, filepath.Join(root, "foreign", "config.json")+" is owned by uid 0, not by the runtime's user (uid 1000)")
	_, err = readRuntimeSpec(root, "../x")
	require.ErrorContains(t, err, `the container id "../x" is not a file name`)
}

// The bundle "/" alone is crun's: any other bundle is read as before,
// whatever the runtime's command line says.
func TestCrunBundleOnlySlash(t *testing.T) {
	r := newCrunRig(t)
	r.spec("c", "NVIDIA_VISIBLE_DEVICES=1")
	other := t.TempDir()
	data, err := json.Marshal(specs.Spec{Version: specs.Version, Process: &specs.Process{Env: []string{"PATH=/bin"}, Capabilities: podmanCaps()}})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(other, "config.json"), data, 0o600))
	r.cmdline("crun", "--root", r.root, "create", "--bundle", r.bundle, "c")
	in := r.e.readInput(strings.NewReader(crunState(t, "c", specs.StateCreated, 4242, other)))
	require.NoError(t, in.specErr)
	require.True(t, in.NeverClaims(), "the state's bundle, not crun's copy")
	require.Equal(t, other, in.state.Bundle)
}

func TestRuntimeDirs(t *testing.T) {
	for _, tc := range []struct {
		args         []string
		root, bundle string
	}{
		{[]string{"crun", "create", "id"}, "", ""},
		{[]string{"crun", "--root", "/r", "create", "--bundle", "/b", "id"}, "/r", "/b"},
		{[]string{"crun", "--root=/r", "create", "--bundle=/b", "id"}, "/r", "/b"},
		{[]string{"crun", "create", "-b", "/b", "id"}, "", "/b"},
		{[]string{"crun", "create", "-b/b", "id"}, "", "/b"},
		// The last of each counts, as both runtimes read them.
		{[]string{"runc", "--log", "/l", "--root", "/r", "--root", "/s", "create", "--bundle", "/b", "--bundle", "/c", "id"}, "/s", "/c"},
		{[]string{"crun", "--root=/r", "--root", "/s", "create", "-b/b", "--bundle=/c", "-b", "/d", "id"}, "/s", "/d"},
		{[]string{"crun", "--rootless=true", "create", "--bundle", "/b", "id"}, "", "/b"},
		{[]string{"crun", "create", "--bundle"}, "", ""},
		{[]string{"crun", "create", "--", "--bundle", "/b"}, "", ""},
		{nil, "", ""},
	} {
		root, bundle, err := runtimeDirs(tc.args)
		require.NoError(t, err, "%q", tc.args)
		require.Equal(t, [2]string{tc.root, tc.bundle}, [2]string{root, bundle}, "%q", tc.args)
	}
	// crun's argp takes an abbreviated long option: what it names cannot
	// be missed, so it is refused rather than read as no option.
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"crun", "--roo", "/r", "create", "--bundle", "/b", "id"}, `it abbreviates --root to "--roo", which crun reads as --root`},
		{[]string{"crun", "--root", "/r", "create", "--bund=/b", "id"}, `it abbreviates --bundle to "--bund"`},
		{[]string{"crun", "create", "--bundl", "/b", "id"}, `it abbreviates --bundle to "--bundl"`},
		{[]string{"crun", "--r=/r", "create", "id"}, `it abbreviates --root to "--r"`},
	} {
		_, _, err := runtimeDirs(tc.args)
		require.ErrorContains(t, err, tc.want, "%q", tc.args)
	}
}
