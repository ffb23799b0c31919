// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package liveness

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// holder builds what Exited is asked about: a started (pid > 0) or
// never-started (pid 0) container with its runtime-given cgroups path. Every
// test in this file goes through it, so a change of Exited's input type
// changes only this function.
func holder(pid int, pidStart uint64, cgroup string) Process {
	return Process{Pid: pid, PidStart: pidStart, Cgroup: cgroup}
}

// cgroup2Tree is a fake cgroup v2 (unified) hierarchy laid out the way the
// kernel lays it out, for Checker tests on hosts without cgroup v2:
//   - the root has cgroup.controllers, cgroup.subtree_control, cgroup.procs
//     and cgroup.stat, and no cgroup.events (the kernel gives the root none);
//   - every other cgroup has cgroup.events ("populated N\nfrozen N\n"),
//     cgroup.procs, cgroup.threads, cgroup.type, cgroup.controllers,
//     cgroup.subtree_control, cgroup.freeze, cgroup.kill, and the memory and
//     pids files of the controllers a container runtime enables;
//   - "populated" is 1 exactly when the cgroup or a descendant holds a
//     process, as the kernel computes it (processes are only in leaves
//     when controllers are enabled below: the "no internal processes" rule).
//
// TestFakeCgroup2TreeIsFaithful compares this layout with a real cgroup2
// mount where the host has one.
type cgroup2Tree struct {
	procs  map[string][]int // cgroup path ("/a/b") → its own processes
	frozen map[string]bool
}

func newCgroup2Tree() *cgroup2Tree {
	return &cgroup2Tree{procs: map[string][]int{}, frozen: map[string]bool{}}
}

// add declares the cgroup p (and its ancestors) with processes pids.
func (f *cgroup2Tree) add(p string, pids ...int) *cgroup2Tree {
	for q := path.Clean(p); q != "/"; q = path.Dir(q) {
		if _, ok := f.procs[q]; !ok {
			f.procs[q] = nil
		}
	}
	f.procs[path.Clean(p)] = append(f.procs[path.Clean(p)], pids...)
	return f
}

// populated reports whether p or a cgroup below it has a process.
func (f *cgroup2Tree) populated(p string) bool {
	for q, pids := range f.procs {
		if len(pids) > 0 && (q == p || strings.HasPrefix(q, p+"/")) {
			return true
		}
	}
	return false
}

// cgroup2RootFiles and cgroup2Files are the interface files the fake writes
// at the root and in every other cgroup (a subset of what the kernel shows;
// the checker reads cgroup.controllers, cgroup.events and cgroup.procs).
var (
	cgroup2RootFiles = []string{"cgroup.controllers", "cgroup.procs", "cgroup.stat", "cgroup.subtree_control", "cgroup.threads"}
	cgroup2Files     = []string{"cgroup.controllers", "cgroup.events", "cgroup.freeze", "cgroup.kill", "cgroup.procs",
		"cgroup.stat", "cgroup.subtree_control", "cgroup.threads", "cgroup.type", "memory.current", "pids.current"}
)

// write materialises the tree below a fresh directory and returns it.
func (f *cgroup2Tree) write(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	put := func(dir, name, content string) {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644))
	}
	lines := func(pids []int) string {
		var b strings.Builder
		for _, p := range pids {
			fmt.Fprintf(&b, "%d\n", p)
		}
		return b.String()
	}
	put(root, "cgroup.controllers", "cpuset cpu io memory hugetlb pids rdma misc\n")
	put(root, "cgroup.subtree_control", "cpuset cpu io memory pids\n")
	put(root, "cgroup.procs", "1\n")
	put(root, "cgroup.threads", "1\n")
	put(root, "cgroup.stat", fmt.Sprintf("nr_descendants %d\nnr_dying_descendants 0\n", len(f.procs)))
	for p, pids := range f.procs {
		dir := filepath.Join(root, filepath.FromSlash(p))
		require.NoError(t, os.MkdirAll(dir, 0o755))
		populated, frozen := 0, 0
		if f.populated(p) {
			populated = 1
		}
		if f.frozen[p] {
			frozen = 1
		}
		put(dir, "cgroup.events", fmt.Sprintf("populated %d\nfrozen %d\n", populated, frozen))
		put(dir, "cgroup.procs", lines(pids))
		put(dir, "cgroup.threads", lines(pids))
		put(dir, "cgroup.type", "domain\n")
		put(dir, "cgroup.controllers", "cpuset cpu io memory pids\n")
		put(dir, "cgroup.subtree_control", "")
		put(dir, "cgroup.freeze", fmt.Sprintf("%d\n", frozen))
		put(dir, "cgroup.kill", "")
		put(dir, "cgroup.stat", "nr_descendants 0\nnr_dying_descendants 0\n")
		put(dir, "memory.current", "0\n")
		put(dir, "pids.current", fmt.Sprintf("%d\n", len(pids)))
	}
	return root
}

// procTree is a fake procfs with the given pids running (start time 1000+pid).
func procTree(t *testing.T, pids ...int) string {
	t.Helper()
	root := t.TempDir()
	for _, p := range pids {
		dir := filepath.Join(root, strconv.Itoa(p))
		require.NoError(t, os.MkdirAll(dir, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "stat"), []byte(stat(p, "worker", 'S', strconv.Itoa(1000+p))), 0o644))
	}
	return root
}

// Kubelet's cgroup layouts on a cgroup v2 node, for pod UID
// 0a1b2c3d-aaaa-bbbb-cccc-000000000001 (systemd writes its dashes as '_')
// and container ids a1…, b1… (two containers of one pod).
const (
	podUID        = "0a1b2c3d-aaaa-bbbb-cccc-000000000001"
	podUIDSystemd = "0a1b2c3d_aaaa_bbbb_cccc_000000000001"
	ctrA          = "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1"
	ctrB          = "b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1"
)

// layout is one way a runtime names and places a container's cgroup.
type layout struct {
	name string
	// cgroupsPath is the OCI linux.cgroupsPath the runtime hands NRI for a
	// container id; dir is the cgroup directory it denotes.
	cgroupsPath func(id string) string
	dir         func(id string) string
	// pod is the pod-level cgroup both containers live below ("" if none).
	pod string
}

var cgroup2Layouts = []layout{
	{
		name: "systemd driver, burstable pod",
		cgroupsPath: func(id string) string {
			return "kubepods-burstable-pod" + podUIDSystemd + ".slice:cri-containerd:" + id
		},
		dir: func(id string) string {
			return "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + podUIDSystemd + ".slice/cri-containerd-" + id + ".scope"
		},
		pod: "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + podUIDSystemd + ".slice",
	},
	{
		name:        "systemd driver, guaranteed pod (directly below kubepods.slice)",
		cgroupsPath: func(id string) string { return "kubepods-pod" + podUIDSystemd + ".slice:cri-containerd:" + id },
		dir: func(id string) string {
			return "/kubepods.slice/kubepods-pod" + podUIDSystemd + ".slice/cri-containerd-" + id + ".scope"
		},
		pod: "/kubepods.slice/kubepods-pod" + podUIDSystemd + ".slice",
	},
	{
		name:        "cgroupfs driver, besteffort pod",
		cgroupsPath: func(id string) string { return "/kubepods/besteffort/pod" + podUID + "/" + id },
		dir:         func(id string) string { return "/kubepods/besteffort/pod" + podUID + "/" + id },
		pod:         "/kubepods/besteffort/pod" + podUID,
	},
	{
		name:        "cgroupfs driver, containerd without kubelet",
		cgroupsPath: func(id string) string { return "/k8s.io/" + id },
		dir:         func(id string) string { return "/k8s.io/" + id },
	},
}

// TestCgroup2HolderLifecycle walks one holder through its life on each
// layout, next to a running sibling container of the same pod: while its
// cgroup has a process it is alive; once its process exited (the runtime
// has not yet removed the cgroup) it has exited, although the pod's cgroup
// is still populated by the sibling; once the runtime removed the cgroup,
// the recorded pid decides.
func TestCgroup2HolderLifecycle(t *testing.T) {
	const pidA, pidB = 4100, 4200
	for _, l := range cgroup2Layouts {
		t.Run(l.name, func(t *testing.T) {
			rel, err := CgroupPath(l.cgroupsPath(ctrA))
			require.NoError(t, err)
			require.Equal(t, l.dir(ctrA), rel, "the runtime's cgroups path names the kernel's directory")

			a := holder(pidA, 1000+pidA, l.cgroupsPath(ctrA))
			b := holder(pidB, 1000+pidB, l.cgroupsPath(ctrB))

			running := newCgroup2Tree().add(l.dir(ctrA), pidA).add(l.dir(ctrB), pidB)
			c := New(running.write(t), procTree(t, pidA, pidB))
			exited, reason := c.Exited(a)
			assert.False(t, exited, reason)
			assert.Equal(t, "cgroup "+l.dir(ctrA)+" has processes", reason)

			// A's process exited; its pid is gone too, but the cgroup decides.
			gone := newCgroup2Tree().add(l.dir(ctrA)).add(l.dir(ctrB), pidB)
			cgroupRoot := gone.write(t)
			if l.pod != "" {
				require.True(t, gone.populated(l.pod), "the sibling keeps the pod's cgroup populated")
				ev, err := os.ReadFile(filepath.Join(cgroupRoot, filepath.FromSlash(l.pod), "cgroup.events"))
				require.NoError(t, err)
				require.Equal(t, "populated 1\nfrozen 0\n", string(ev))
			}
			c = New(cgroupRoot, procTree(t, pidB))
			exited, reason = c.Exited(a)
			assert.True(t, exited, reason)
			assert.Equal(t, "cgroup "+l.dir(ctrA)+" has no processes", reason)
			exited, reason = c.Exited(b)
			assert.False(t, exited, "the sibling: %s", reason)

			// The runtime deleted A's cgroup: the pid is the evidence.
			removed := newCgroup2Tree().add(l.dir(ctrB), pidB)
			c = New(removed.write(t), procTree(t, pidB))
			exited, reason = c.Exited(a)
			assert.True(t, exited, reason)
			assert.Equal(t, "cgroup "+l.dir(ctrA)+" not found; pid 4100 is gone", reason)
			// ... and a pid taken over by an unrelated process is no holder.
			reused := procTree(t, pidB)
			require.NoError(t, os.MkdirAll(filepath.Join(reused, strconv.Itoa(pidA)), 0o755))
			require.NoError(t, os.WriteFile(filepath.Join(reused, strconv.Itoa(pidA), "stat"), []byte(stat(pidA, "bash", 'S', "999999")), 0o644))
			exited, reason = New(removed.write(t), reused).Exited(a)
			assert.True(t, exited, reason)
			assert.Contains(t, reason, "reused by another process")
		})
	}
}

// TestCgroup2NestedCgroups: a container may create cgroups of its own below
// its cgroup (systemd or a container engine inside it). On cgroup v2 its
// processes then live only in those leaves and the container's own
// cgroup.procs is empty; populated covers the subtree, so the holder is
// alive until the last leaf is empty.
func TestCgroup2NestedCgroups(t *testing.T) {
	for _, l := range cgroup2Layouts {
		t.Run(l.name, func(t *testing.T) {
			dir := l.dir(ctrA)
			h := holder(4100, 0, l.cgroupsPath(ctrA))

			nested := newCgroup2Tree().add(dir).add(dir+"/init.scope").add(dir+"/workload/rank0", 4100, 4101)
			root := nested.write(t)
			procs, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(dir), "cgroup.procs"))
			require.NoError(t, err)
			require.Empty(t, procs, "no internal processes")
			exited, reason := New(root, t.TempDir()).Exited(h)
			assert.False(t, exited, reason)

			empty := newCgroup2Tree().add(dir).add(dir + "/init.scope").add(dir + "/workload/rank0")
			exited, reason = New(empty.write(t), t.TempDir()).Exited(h)
			assert.True(t, exited, reason)
			assert.Equal(t, "cgroup "+dir+" has no processes", reason)
		})
	}
}

// TestCgroup2NotYetStartedAndPaused: between create and start, runc's init
// process already sits in the container's cgroup (populated 1): alive. A
// paused (frozen) container keeps its processes: alive. A holder the
// runtime never started has no pid and, in NRI's CreateContainer, no cgroup
// yet: alive, whatever the tree holds.
func TestCgroup2NotYetStartedAndPaused(t *testing.T) {
	l := cgroup2Layouts[0]
	dir := l.dir(ctrA)
	created := newCgroup2Tree().add(dir, 4100)
	exited, reason := New(created.write(t), t.TempDir()).Exited(holder(0, 0, l.cgroupsPath(ctrA)))
	assert.False(t, exited, "created (runc init waiting): %s", reason)

	paused := newCgroup2Tree().add(dir, 4100)
	paused.frozen[dir] = true
	root := paused.write(t)
	ev, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(dir), "cgroup.events"))
	require.NoError(t, err)
	require.Equal(t, "populated 1\nfrozen 1\n", string(ev))
	exited, reason = New(root, t.TempDir()).Exited(holder(4100, 0, l.cgroupsPath(ctrA)))
	assert.False(t, exited, "paused: %s", reason)

	exited, reason = New(newCgroup2Tree().write(t), t.TempDir()).Exited(holder(0, 0, ""))
	assert.False(t, exited, reason)
	assert.Contains(t, reason, "never started")
}

// TestCgroup2PrivateNamespaceView: a guard in a container with its own
// cgroup namespace (the default for containers on cgroup v2) sees its own
// cgroup as the root of /sys/fs/cgroup, and no holder's cgroup. That view
// is still cgroup v2, so the missing cgroup must not read as "exited": the
// pid decides, and without a pid the claim is kept.
func TestCgroup2PrivateNamespaceView(t *testing.T) {
	l := cgroup2Layouts[0]
	// The guard's own view: a cgroup v2 root holding only the guard.
	own := newCgroup2Tree().add("/", 1)
	root := own.write(t)

	exited, reason := New(root, procTree(t, 4100)).Exited(holder(4100, 1000+4100, l.cgroupsPath(ctrA)))
	assert.False(t, exited, reason)
	assert.Equal(t, "cgroup "+l.dir(ctrA)+" not found; pid 4100 is running", reason)

	exited, reason = New(root, procTree(t)).Exited(holder(4100, 1000+4100, l.cgroupsPath(ctrA)))
	assert.True(t, exited, reason)

	exited, reason = New(root, procTree(t)).Exited(holder(0, 0, l.cgroupsPath(ctrA)))
	assert.False(t, exited, reason)
	assert.Contains(t, reason, "no pid is recorded")
}

// cgroup2Mount finds a writable cgroup v2 mount of this host (the unified
// hierarchy of a hybrid host is one), or "".
func cgroup2Mount() string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return ""
	}
	defer func() { _ = f.Close() }()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// id parent major:minor root mountpoint options ... - fstype source super
		fields := strings.Fields(sc.Text())
		i := slices.Index(fields, "-")
		if i < 0 || i+1 >= len(fields) || len(fields) < 6 || fields[i+1] != "cgroup2" || fields[3] != "/" {
			continue
		}
		if strings.Contains(","+fields[5]+",", ",rw,") {
			return fields[4]
		}
	}
	return ""
}

// realCgroup2 makes a private cgroup below the host's cgroup v2 mount for a
// test and removes it (and everything below, deepest first) afterwards. It
// skips the test where there is no writable cgroup v2 hierarchy (not root,
// or a cgroup v1 host without the unified hierarchy) and fails where there is
// one but a cgroup cannot be created in it.
func realCgroup2(t *testing.T) string {
	t.Helper()
	mnt := cgroup2Mount()
	if mnt == "" || os.Geteuid() != 0 {
		t.Skip("needs root and a writable cgroup v2 hierarchy (cgroup v2 host, or the unified hierarchy of a hybrid one)")
	}
	base := filepath.Join(mnt, fmt.Sprintf("liveness-test-%d", os.Getpid()))
	// The mount is cgroup v2, read-write, and we are root: creating a child
	// cgroup must work there. A failure is a broken rig (or a liveness
	// assumption that no longer holds), not a reason to pass silently.
	require.NoError(t, os.Mkdir(base, 0o755), "create a test cgroup below the writable cgroup v2 mount %s", mnt)
	t.Cleanup(func() {
		var dirs []string
		_ = filepath.WalkDir(base, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
		for _, d := range dirs {
			if err := syscall.Rmdir(d); err != nil {
				t.Errorf("remove test cgroup %s: %v", d, err)
			}
		}
	})
	return base
}

// helperEnv makes the test binary, run again, block until its stdin closes:
// a process the test can place in a cgroup and end.
const helperEnv = "LIVENESS_TEST_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) == "1" {
		_, _ = io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// startIn starts a helper process and moves it into cgroup dir.
func startIn(t *testing.T, dir string) (*exec.Cmd, io.Closer) {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), helperEnv+"=1")
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = stdin.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	require.NoError(t, os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644))
	return cmd, stdin
}

// TestFakeCgroup2TreeIsFaithful checks the fake against the kernel: a fresh
// cgroup has every file the fake writes for a non-root cgroup (controller
// files only where the controller is enabled), cgroup.events reads exactly
// "populated 0\nfrozen 0\n" and turns to populated 1 with a process in a
// child, and the hierarchy's root has no cgroup.events.
func TestFakeCgroup2TreeIsFaithful(t *testing.T) {
	base := realCgroup2(t)
	child := filepath.Join(base, "child")
	require.NoError(t, os.Mkdir(child, 0o755))
	enabled, err := os.ReadFile(filepath.Join(base, "cgroup.controllers"))
	require.NoError(t, err)
	for _, name := range cgroup2Files {
		if ctrl, _, ok := strings.Cut(name, "."); ok && ctrl != "cgroup" && !slices.Contains(strings.Fields(string(enabled)), ctrl) {
			continue // this hierarchy does not have that controller
		}
		_, err := os.Stat(filepath.Join(child, name))
		assert.NoError(t, err, "a real cgroup has %s", name)
	}
	for _, name := range cgroup2RootFiles {
		_, err := os.Stat(filepath.Join(cgroup2Mount(), name))
		assert.NoError(t, err, "the real root has %s", name)
	}
	_, err = os.Stat(filepath.Join(cgroup2Mount(), "cgroup.events"))
	assert.ErrorIs(t, err, os.ErrNotExist, "the root cgroup has no cgroup.events")

	ev, err := os.ReadFile(filepath.Join(child, "cgroup.events"))
	require.NoError(t, err)
	assert.Equal(t, "populated 0\nfrozen 0\n", string(ev))
	leaf := filepath.Join(child, "leaf")
	require.NoError(t, os.Mkdir(leaf, 0o755))
	cmd, stdin := startIn(t, leaf)
	ev, err = os.ReadFile(filepath.Join(child, "cgroup.events"))
	require.NoError(t, err)
	assert.Equal(t, "populated 1\nfrozen 0\n", string(ev), "populated covers the subtree")
	procs, err := os.ReadFile(filepath.Join(child, "cgroup.procs"))
	require.NoError(t, err)
	assert.Empty(t, procs, "cgroup.procs lists only the cgroup's own processes")
	require.NoError(t, stdin.Close())
	require.NoError(t, cmd.Wait())
}

// TestRealCgroup2HolderExits runs the checker on the kernel's own cgroup v2
// files, for the systemd and the cgroupfs layout: a holder whose process
// runs in its container cgroup (next to a sibling of the same pod) is alive;
// once its process exited and was reaped, it has exited and the sibling is
// still alive; a holder whose process runs only in a nested cgroup is alive.
// The kernel updates "populated" before the exit is reported to the parent,
// so no waiting is needed after Wait.
func TestRealCgroup2HolderExits(t *testing.T) {
	base := realCgroup2(t)
	for i, l := range []layout{cgroup2Layouts[0], cgroup2Layouts[2]} {
		t.Run(l.name, func(t *testing.T) {
			// This layout's tree below a private root of its own.
			root := filepath.Join(base, strconv.Itoa(i))
			dirA := filepath.Join(root, filepath.FromSlash(l.dir(ctrA)))
			dirB := filepath.Join(root, filepath.FromSlash(l.dir(ctrB)))
			require.NoError(t, os.MkdirAll(dirA, 0o755))
			require.NoError(t, os.MkdirAll(dirB, 0o755))
			procA, stdinA := startIn(t, dirA)
			procB, _ := startIn(t, dirB)
			c := New(root, "/proc")
			startA, err := c.PidStart(procA.Process.Pid)
			require.NoError(t, err)
			a := holder(procA.Process.Pid, startA, l.cgroupsPath(ctrA))
			b := holder(procB.Process.Pid, 0, l.cgroupsPath(ctrB))

			exited, reason := c.Exited(a)
			assert.False(t, exited, reason)
			assert.Equal(t, "cgroup "+l.dir(ctrA)+" has processes", reason)

			require.NoError(t, stdinA.Close())
			require.NoError(t, procA.Wait())
			exited, reason = c.Exited(a)
			assert.True(t, exited, reason)
			assert.Equal(t, "cgroup "+l.dir(ctrA)+" has no processes", reason)
			exited, reason = c.Exited(b)
			assert.False(t, exited, "the sibling: %s", reason)

			// A container that nests its processes one level down.
			nested := filepath.Join(dirA, "inner")
			require.NoError(t, os.Mkdir(nested, 0o755))
			procN, stdinN := startIn(t, nested)
			exited, reason = c.Exited(holder(procN.Process.Pid, 0, l.cgroupsPath(ctrA)))
			assert.False(t, exited, reason)
			require.NoError(t, stdinN.Close())
			require.NoError(t, procN.Wait())
			exited, reason = c.Exited(holder(procN.Process.Pid, 0, l.cgroupsPath(ctrA)))
			assert.True(t, exited, reason)
		})
	}
}
