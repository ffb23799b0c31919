// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package liveness

import (
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// stat builds a /proc/<pid>/stat line with the given command, state and start
// time (field 22).
func stat(pid int, comm string, state byte, start string) string {
	fields := []string{string(state)}
	for i := 4; i <= 21; i++ {
		fields = append(fields, "0")
	}
	fields = append(fields, start, "0", "0")
	return strings.Join([]string{strconv.Itoa(pid), "(" + comm + ")", strings.Join(fields, " ")}, " ") + "\n"
}

// tree writes files (path → content; a trailing "/" makes a directory) below
// a fresh root and returns the root.
func tree(t *testing.T, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for p, content := range files {
		full := filepath.Join(root, p)
		if strings.HasSuffix(p, "/") {
			require.NoError(t, os.MkdirAll(full, 0o755))
			continue
		}
		require.NoError(t, os.MkdirAll(filepath.Dir(full), 0o755))
		require.NoError(t, os.WriteFile(full, []byte(content), 0o644))
	}
	return root
}

func TestExited(t *testing.T) {
	const v2 = "cgroup.controllers"
	running := stat(4242, "python3", 'S', "1000")
	for _, tc := range []struct {
		name       string
		cgroup     map[string]string
		proc       map[string]string
		owner      Process
		wantExited bool
		wantReason string
	}{
		{
			name:       "never started: no pid, no cgroup",
			owner:      Process{},
			wantReason: "never started",
		},
		{
			name:       "v2 populated",
			cgroup:     map[string]string{v2: "", "k8s.io/c1/cgroup.events": "populated 1\nfrozen 0\n"},
			owner:      Process{Pid: 4242, Cgroup: "/k8s.io/c1"},
			wantReason: "cgroup /k8s.io/c1 has processes",
		},
		{
			name:       "v2 not populated although the pid is still listed in proc",
			cgroup:     map[string]string{v2: "", "k8s.io/c1/cgroup.events": "populated 0\nfrozen 0\n"},
			proc:       map[string]string{"4242/stat": running},
			owner:      Process{Pid: 4242, PidStart: 1000, Cgroup: "/k8s.io/c1"},
			wantExited: true,
			wantReason: "cgroup /k8s.io/c1 has no processes",
		},
		{
			name:       "v2 relative cgroupfs path",
			cgroup:     map[string]string{v2: "", "k8s.io/c1/cgroup.events": "populated 0\n"},
			owner:      Process{Cgroup: "k8s.io/c1"},
			wantExited: true,
			wantReason: "cgroup /k8s.io/c1 has no processes",
		},
		{
			name:       "v2 without cgroup.events: empty procs",
			cgroup:     map[string]string{v2: "", "k8s.io/c1/cgroup.procs": ""},
			owner:      Process{Cgroup: "/k8s.io/c1"},
			wantExited: true,
			wantReason: "cgroup /k8s.io/c1 has no processes",
		},
		{
			name:       "v2 without cgroup.events: a child cgroup has processes",
			cgroup:     map[string]string{v2: "", "k8s.io/c1/cgroup.procs": "", "k8s.io/c1/inner/cgroup.procs": "77\n"},
			owner:      Process{Cgroup: "/k8s.io/c1"},
			wantReason: "has processes",
		},
		{
			name: "v2 systemd driver path",
			cgroup: map[string]string{v2: "",
				"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/cri-containerd-abc.scope/cgroup.events": "populated 0\n"},
			owner:      Process{Pid: 4242, Cgroup: "kubepods-besteffort-pod1.slice:cri-containerd:abc"},
			wantExited: true,
			wantReason: "cgroup /kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/cri-containerd-abc.scope has no processes",
		},
		{
			name:       "v2 systemd driver path, populated",
			cgroup:     map[string]string{v2: "", "system.slice/docker-abc.scope/cgroup.events": "populated 1\n"},
			owner:      Process{Cgroup: "system.slice:docker:abc"},
			wantReason: "has processes",
		},
		{
			name:       "v2: only the restarted container's process is left in the cgroup",
			cgroup:     map[string]string{v2: "", "libpod-c1.scope/cgroup.events": "populated 1\n", "libpod-c1.scope/cgroup.procs": "555\n"},
			owner:      Process{Pid: 4242, PidStart: 1000, Cgroup: "/libpod-c1.scope", Successor: 555},
			wantExited: true,
			wantReason: "cgroup /libpod-c1.scope has no process but pid 555, the restarted container's",
		},
		{
			name:       "v2: the restarted container's process beside another",
			cgroup:     map[string]string{v2: "", "libpod-c1.scope/cgroup.events": "populated 1\n", "libpod-c1.scope/cgroup.procs": "555\n4243\n"},
			owner:      Process{Pid: 4242, Cgroup: "/libpod-c1.scope", Successor: 555},
			wantReason: "cgroup /libpod-c1.scope has processes other than pid 555, the restarted container's",
		},
		{
			name: "v2: another process in a child cgroup",
			cgroup: map[string]string{v2: "", "libpod-c1.scope/cgroup.events": "populated 1\n", "libpod-c1.scope/cgroup.procs": "555\n",
				"libpod-c1.scope/left/cgroup.procs": "4300\n"},
			owner:      Process{Pid: 4242, Cgroup: "/libpod-c1.scope", Successor: 555},
			wantReason: "has processes",
		},
		{
			name:       "v2: a line that is no pid counts as a process",
			cgroup:     map[string]string{v2: "", "libpod-c1.scope/cgroup.events": "populated 1\n", "libpod-c1.scope/cgroup.procs": "555\nx\n"},
			owner:      Process{Pid: 4242, Cgroup: "/libpod-c1.scope", Successor: 555},
			wantReason: "has processes",
		},
		{
			name:       "v2: without a successor the restart's process is the holder's",
			cgroup:     map[string]string{v2: "", "libpod-c1.scope/cgroup.events": "populated 1\n", "libpod-c1.scope/cgroup.procs": "555\n"},
			owner:      Process{Pid: 4242, Cgroup: "/libpod-c1.scope"},
			wantReason: "cgroup /libpod-c1.scope has processes",
		},
		{
			name:       "v1: only the restarted container's process is left in the cgroup",
			cgroup:     map[string]string{"pids/c1/cgroup.procs": "555\n"},
			owner:      Process{Pid: 4242, Cgroup: "/c1", Successor: 555},
			wantExited: true,
			wantReason: "cgroup /c1 has no process but pid 555, the restarted container's",
		},
		{
			name:       "v1 pids hierarchy, empty",
			cgroup:     map[string]string{"pids/k8s.io/c1/cgroup.procs": "", "memory/k8s.io/c1/cgroup.procs": "4242\n"},
			owner:      Process{Pid: 4242, Cgroup: "/k8s.io/c1"},
			wantExited: true,
			wantReason: "cgroup /k8s.io/c1 has no processes",
		},
		{
			name:       "v1 pids hierarchy, process in a child cgroup",
			cgroup:     map[string]string{"pids/k8s.io/c1/cgroup.procs": "", "pids/k8s.io/c1/sub/cgroup.procs": "9\n"},
			owner:      Process{Cgroup: "/k8s.io/c1"},
			wantReason: "has processes",
		},
		{
			name:       "v1 only cpu,cpuacct mounted",
			cgroup:     map[string]string{"cpu,cpuacct/k8s.io/c1/cgroup.procs": "1\n2\n"},
			owner:      Process{Cgroup: "/k8s.io/c1"},
			wantReason: "has processes",
		},
		{
			name: "v1 systemd hierarchy with systemd path",
			cgroup: map[string]string{
				"systemd/kubepods.slice/kubepods-pod9.slice/cri-containerd-x.scope/cgroup.procs": ""},
			owner:      Process{Cgroup: "kubepods-pod9.slice:cri-containerd:x"},
			wantExited: true,
			wantReason: "cgroup /kubepods.slice/kubepods-pod9.slice/cri-containerd-x.scope has no processes",
		},
		{
			name:       "v1 hybrid: only the unified hierarchy has it",
			cgroup:     map[string]string{"pids/": "", "unified/k8s.io/c1/cgroup.events": "populated 0\n"},
			owner:      Process{Cgroup: "/k8s.io/c1"},
			wantExited: true,
			wantReason: "cgroup /k8s.io/c1 has no processes",
		},
		{
			name:       "cgroup removed, pid gone",
			cgroup:     map[string]string{v2: "", "k8s.io/": ""},
			owner:      Process{Pid: 4242, Cgroup: "/k8s.io/c1"},
			wantExited: true,
			wantReason: "cgroup /k8s.io/c1 not found; pid 4242 is gone",
		},
		{
			name:       "cgroup removed, pid still running with the recorded start",
			cgroup:     map[string]string{v2: ""},
			proc:       map[string]string{"4242/stat": running},
			owner:      Process{Pid: 4242, PidStart: 1000, Cgroup: "/k8s.io/c1"},
			wantReason: "pid 4242 is running",
		},
		{
			name:       "cgroup removed, no pid recorded: doubt",
			cgroup:     map[string]string{v2: ""},
			owner:      Process{Cgroup: "/k8s.io/c1"},
			wantReason: "no pid is recorded",
		},
		{
			name:       "no readable hierarchy: doubt even though the pid is gone",
			cgroup:     map[string]string{"unrelated/": ""},
			owner:      Process{Pid: 4242, Cgroup: "/k8s.io/c1"},
			wantReason: "no cgroup hierarchy readable",
		},
		{
			name:       "cgroup.procs unreadable: doubt",
			cgroup:     map[string]string{v2: "", "k8s.io/c1/cgroup.procs/": ""},
			owner:      Process{Pid: 4242, Cgroup: "/k8s.io/c1"},
			wantReason: "unreadable",
		},
		{
			name:       "cgroup.events without populated key: doubt",
			cgroup:     map[string]string{v2: "", "k8s.io/c1/cgroup.events": "frozen 0\n"},
			owner:      Process{Cgroup: "/k8s.io/c1"},
			wantReason: "unreadable",
		},
		{
			name:       "path escaping the root is confined",
			cgroup:     map[string]string{v2: "", "k8s.io/c1/cgroup.events": "populated 1\n"},
			owner:      Process{Cgroup: "/../../k8s.io/c1"},
			wantReason: "cgroup /k8s.io/c1 has processes",
		},
		{
			name:       "root cgroup path is refused: doubt",
			cgroup:     map[string]string{v2: "", "cgroup.events": "populated 0\n"},
			owner:      Process{Cgroup: "/"},
			wantReason: "root cgroup",
		},
		{
			name:       "no cgroup, pid gone",
			owner:      Process{Pid: 4242},
			wantExited: true,
			wantReason: "pid 4242 is gone",
		},
		{
			name:       "no cgroup, pid running, start matches",
			proc:       map[string]string{"4242/stat": running},
			owner:      Process{Pid: 4242, PidStart: 1000},
			wantReason: "pid 4242 is running",
		},
		{
			name:       "no cgroup, pid running, no start recorded",
			proc:       map[string]string{"4242/stat": running},
			owner:      Process{Pid: 4242},
			wantReason: "pid 4242 is running",
		},
		{
			name:       "no cgroup, pid reused",
			proc:       map[string]string{"4242/stat": stat(4242, "bash", 'S', "2000")},
			owner:      Process{Pid: 4242, PidStart: 1000},
			wantExited: true,
			wantReason: "reused",
		},
		{
			name:       "no cgroup, zombie",
			proc:       map[string]string{"4242/stat": stat(4242, "python3", 'Z', "1000")},
			owner:      Process{Pid: 4242, PidStart: 1000},
			wantExited: true,
			wantReason: "zombie",
		},
		{
			// pthread_exit in the main thread: the pid shows as a zombie
			// while the process's other threads run (and may use the GPU).
			name: "no cgroup, main thread exited, other threads run",
			proc: map[string]string{"4242/stat": stat(4242, "python3", 'Z', "1000"),
				"4242/task/4242/stat": stat(4242, "python3", 'Z', "1000"), "4242/task/4243/stat": stat(4243, "python3", 'S', "1001")},
			owner:      Process{Pid: 4242, PidStart: 1000},
			wantReason: "main thread has exited, but 1 other thread(s) run",
		},
		{
			name: "no cgroup, zombie with its main thread alone",
			proc: map[string]string{"4242/stat": stat(4242, "python3", 'Z', "1000"),
				"4242/task/4242/stat": stat(4242, "python3", 'Z', "1000")},
			owner:      Process{Pid: 4242, PidStart: 1000},
			wantExited: true,
			wantReason: "zombie",
		},
		{
			name:       "no cgroup, a reused pid that is a zombie",
			proc:       map[string]string{"4242/stat": stat(4242, "bash", 'Z', "2000")},
			owner:      Process{Pid: 4242, PidStart: 1000},
			wantExited: true,
			wantReason: "reused",
		},
		{
			name:       "no cgroup, malformed stat: doubt",
			proc:       map[string]string{"4242/stat": "4242 garbage"},
			owner:      Process{Pid: 4242, PidStart: 1000},
			wantReason: "unreadable",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := New(tree(t, tc.cgroup), tree(t, tc.proc))
			exited, reason := c.Exited(tc.owner)
			assert.Equal(t, tc.wantExited, exited, "reason: %s", reason)
			// Every answer says why: a reason is what an operator reads
			// in the audit log and in status.
			require.NotEmpty(t, tc.wantReason, "the row must name the reason it expects")
			assert.Contains(t, reason, tc.wantReason)
		})
	}
}

// A procfs of this process's pid namespace that shows no entry for a pid
// (mounted with hidepid, the process another user's) does not prove it
// gone: the kernel is asked (kill(pid, 0)). A pid the kernel does not know
// is gone; a tree that is not this namespace's procfs (no "self" naming
// this process) is read as it is.
func TestPidHiddenFromProcButAlive(t *testing.T) {
	ownNamespace := tree(t, map[string]string{"1/stat": stat(1, "init", 'S', "1")})
	require.NoError(t, os.Symlink(strconv.Itoa(os.Getpid()), filepath.Join(ownNamespace, "self")))

	exited, why := New(tree(t, nil), ownNamespace).Exited(Process{Pid: os.Getpid(), PidStart: 1000})
	assert.False(t, exited, why)
	assert.Contains(t, why, "is not shown in")

	done := exec.Command("true")
	require.NoError(t, done.Run())
	exited, why = New(tree(t, nil), ownNamespace).Exited(Process{Pid: done.Process.Pid, PidStart: 1000})
	assert.True(t, exited, why)
	assert.Contains(t, why, "is gone")

	other := tree(t, map[string]string{"1/stat": stat(1, "init", 'S', "1")})
	exited, why = New(tree(t, nil), other).Exited(Process{Pid: os.Getpid(), PidStart: 1000})
	assert.True(t, exited, "a tree of no pid namespace of ours: %s", why)
}

func TestCgroupPath(t *testing.T) {
	for _, tc := range []struct {
		in, want string
		wantErr  bool
	}{
		{in: "/k8s.io/abc", want: "/k8s.io/abc"},
		{in: "k8s.io/abc", want: "/k8s.io/abc"},
		{in: "/kubepods/besteffort/pod1/abc", want: "/kubepods/besteffort/pod1/abc"},
		{in: "/a/../../b", want: "/b"},
		{in: "kubepods-burstable-pod1.slice:cri-containerd:abc",
			want: "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-containerd-abc.scope"},
		{in: "system.slice:docker:abc", want: "/system.slice/docker-abc.scope"},
		{in: ":docker:abc", want: "/system.slice/docker-abc.scope"},
		{in: "-.slice::abc", want: "/-abc.scope"},
		{in: "system.slice::abc", want: "/system.slice/-abc.scope"},
		{in: "machine.slice::vm.slice", want: "/machine.slice/vm.slice"},
		{in: "/", wantErr: true},
		{in: "", wantErr: true},
		{in: "kubepods.slice:p:", wantErr: true},
		{in: "notaslice:p:n", wantErr: true},
		{in: "a--b.slice:p:n", wantErr: true},
		{in: "a/b.slice:p:n", wantErr: true},
		{in: "a.slice:p/x:n", wantErr: true},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := CgroupPath(tc.in)
			if tc.wantErr {
				require.ErrorIs(t, err, ErrBadCgroupPath)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}

func TestPidStart(t *testing.T) {
	proc := tree(t, map[string]string{
		"10/stat": stat(10, "weird) (name", 'R', "123456789"),
		"11/stat": "11 (x) R 1 2 3\n",
		"12/stat": stat(12, "x", 'R', "notanumber"),
	})
	got, err := PidStart(proc, 10)
	require.NoError(t, err)
	assert.Equal(t, uint64(123456789), got)

	_, err = PidStart(proc, 11)
	require.ErrorContains(t, err, "malformed stat")
	_, err = PidStart(proc, 12)
	require.ErrorContains(t, err, "start time")
	_, err = PidStart(proc, 13)
	require.ErrorIs(t, err, fs.ErrNotExist)
	_, err = PidStart(proc, 0)
	require.Error(t, err)
	require.False(t, errors.Is(err, fs.ErrNotExist))

	got, err = New("", proc).PidStart(10)
	require.NoError(t, err)
	assert.Equal(t, uint64(123456789), got)
}

// Running is true only on proof: readable, not a zombie, same start time.
func TestRunning(t *testing.T) {
	proc := tree(t, map[string]string{
		"20/stat": stat(20, "worker", 'S', "500"),
		"21/stat": stat(21, "worker", 'Z', "500"),
		"22/stat": "22 (x) R 1 2 3\n",
	})
	assert.True(t, Running(proc, 20, 500))
	assert.False(t, Running(proc, 20, 501), "pid reused")
	assert.False(t, Running(proc, 20, 0), "start unknown")
	assert.False(t, Running(proc, 21, 500), "zombie")
	assert.False(t, Running(proc, 22, 500), "unreadable stat")
	assert.False(t, Running(proc, 23, 500), "gone")
	assert.False(t, Running(proc, 0, 500))
}

// TestPidStartSelf reads the real procfs: the test process's own start time is
// stable across two reads.
func TestPidStartSelf(t *testing.T) {
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no procfs")
	}
	a, err := PidStart("/proc", os.Getpid())
	require.NoError(t, err)
	b, err := PidStart("/proc", os.Getpid())
	require.NoError(t, err)
	assert.Equal(t, a, b)
	assert.NotZero(t, a)
}

func TestWalkBound(t *testing.T) {
	files := map[string]string{"cgroup.controllers": "", "c/cgroup.procs": ""}
	for i := 0; i <= maxCgroupDirs; i++ {
		files["c/"+strconv.Itoa(i)+"/cgroup.procs"] = ""
	}
	c := New(tree(t, files), t.TempDir())
	exited, reason := c.Exited(Process{Cgroup: "/c"})
	assert.False(t, exited)
	assert.Contains(t, reason, "more than")
}

// hybridDoc is /proc/PID/cgroup of a container on a hybrid host (v1
// controllers plus the unified hierarchy, systemd's hybrid mode) run by
// runc's cgroupfs driver: it joins the v1 hierarchies and name=systemd, and
// leaves the unified one where the shim runs.
const hybridDoc = "12:devices:/kubepods/besteffort/pod1/c1\n11:memory:/kubepods/besteffort/pod1/c1\n" +
	"7:net_cls,net_prio:/\n3:pids:/kubepods/besteffort/pod1/c1\n1:name=systemd:/kubepods/besteffort/pod1/c1\n" +
	"0::/system.slice/containerd.service\n"

func TestProcessCgroup(t *testing.T) {
	for _, tc := range []struct{ name, doc, want string }{
		{"cgroup v2", "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-c1.scope\n",
			"/kubepods.slice/kubepods-pod1.slice/cri-containerd-c1.scope"},
		{"hybrid, cgroupfs driver: the v1 controllers, not the shim's unified cgroup", hybridDoc, "/kubepods/besteffort/pod1/c1"},
		{"hybrid, systemd driver: every line agrees", "4:pids:/system.slice/runc-c1.scope\n1:name=systemd:/system.slice/runc-c1.scope\n0::/system.slice/runc-c1.scope\n",
			"/system.slice/runc-c1.scope"},
		{"cgroup v1: pids before the first line", "12:hugetlb:/\n11:cpuset:/\n4:pids:/k8s.io/c1\n1:name=systemd:/k8s.io/c1\n", "/k8s.io/c1"},
		{"cgroup v1: memory", "12:hugetlb:/\n5:cpu,cpuacct:/x\n3:memory:/k8s.io/c1\n", "/k8s.io/c1"},
		{"cgroup v1: devices", "12:hugetlb:/\n5:cpu,cpuacct:/x\n3:devices:/k8s.io/c1\n", "/k8s.io/c1"},
		{"cgroup v1: name=systemd", "12:hugetlb:/\n1:name=systemd:/user.slice/c1\n", "/user.slice/c1"},
		{"cgroup v1: another hierarchy, the first", "12:hugetlb:/a\n5:cpu,cpuacct:/b\n", "/a"},
		{"cgroup v1 with the unified root listed", "4:pids:/k8s.io/c1\n0::/\n", "/k8s.io/c1"},
		{"a path holding ':'", "0::/odd:name\n", "/odd:name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			proc := tree(t, map[string]string{"7/cgroup": tc.doc})
			got, err := ProcessCgroup(proc, 7)
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
	proc := tree(t, map[string]string{"7/cgroup": "garbage\n"})
	_, err := ProcessCgroup(proc, 7)
	require.ErrorContains(t, err, "no cgroup")
	_, err = ProcessCgroup(proc, 8)
	require.ErrorIs(t, err, fs.ErrNotExist)
}

// With names, a line naming a container is picked before a better-ranked
// one that does not; among lines naming one, the rank decides.
func TestPickCgroupNames(t *testing.T) {
	names := func(p string) bool { return strings.HasSuffix(p, "/c1") || strings.HasSuffix(p, "/c2") }
	assert.Equal(t, "/kubepods/besteffort/pod1/c1", PickCgroup([]byte(hybridDoc), names))
	assert.Equal(t, "/k8s.io/c1", PickCgroup([]byte("4:pids:/\n0::/k8s.io/c1\n"), names),
		"only the unified line names it")
	assert.Equal(t, "/k8s.io/c1", PickCgroup([]byte("5:cpuset:/k8s.io/c2\n4:pids:/k8s.io/c1\n0::/k8s.io/c2\n"), names),
		"disagreeing lines: the controller every runtime joins")
	assert.Equal(t, "/system.slice/sshd.service", PickCgroup([]byte("4:pids:/system.slice/sshd.service\n0::/system.slice/sshd.service\n"), names),
		"a host process: the ranked line")
	assert.Empty(t, PickCgroup([]byte("\n"), names))
}

// A holder recorded through ProcessCgroup on a hybrid host is checked in the
// hierarchy its path came from: its v1 cgroup emptied is an exit, although
// the unified cgroup of the shim it was started from still has processes.
func TestExitedHybridRecordedCgroup(t *testing.T) {
	proc := tree(t, map[string]string{"7/cgroup": hybridDoc})
	cg, err := ProcessCgroup(proc, 7)
	require.NoError(t, err)
	root := tree(t, map[string]string{
		"pids/kubepods/besteffort/pod1/c1/cgroup.procs":         "",
		"memory/kubepods/besteffort/pod1/c1/cgroup.procs":       "",
		"devices/kubepods/besteffort/pod1/c1/cgroup.procs":      "",
		"systemd/kubepods/besteffort/pod1/c1/cgroup.procs":      "",
		"unified/system.slice/containerd.service/cgroup.events": "populated 1\n",
		"systemd/system.slice/containerd.service/cgroup.procs":  "812\n",
		"pids/system.slice/containerd.service/cgroup.procs":     "812\n",
	})
	exited, reason := New(root, proc).Exited(Process{Cgroup: cg})
	assert.True(t, exited, "reason: %s", reason)
	assert.Contains(t, reason, "cgroup /kubepods/besteffort/pod1/c1 has no processes")

	// Still running: not exited.
	require.NoError(t, os.WriteFile(filepath.Join(root, "pids/kubepods/besteffort/pod1/c1/cgroup.procs"), []byte("900\n"), 0o644))
	exited, reason = New(root, proc).Exited(Process{Cgroup: cg})
	assert.False(t, exited, "reason: %s", reason)
}

// Only devices mounted of the hierarchies ProcessCgroup records from: the
// path is found there.
func TestExitedV1DevicesOnly(t *testing.T) {
	root := tree(t, map[string]string{"devices/k8s.io/c1/cgroup.procs": ""})
	exited, reason := New(root, t.TempDir()).Exited(Process{Cgroup: "/k8s.io/c1"})
	assert.True(t, exited, "reason: %s", reason)
}

// TestStartedAt: a process's start is read from /proc (to the 10 ms of a
// clock tick), never later than the fallback; a process gone, or a proc
// root without it, gives the fallback.
func TestStartedAt(t *testing.T) {
	before := time.Now()
	c := exec.Command("sleep", "3600")
	require.NoError(t, c.Start())
	t.Cleanup(func() { _ = c.Process.Kill(); _ = c.Wait() })
	later := time.Now().Add(time.Hour)
	got := StartedAt(DefaultProcRoot, c.Process.Pid, later)
	require.True(t, got.Before(later), "the start read, not the fallback: %v", got)
	require.False(t, got.Before(before.Add(-20*time.Millisecond)), "started %v, read %v", before, got)
	require.False(t, got.After(time.Now()), "read %v", got)

	gone := exec.Command("/bin/true")
	require.NoError(t, gone.Run())
	now := time.Now()
	require.Equal(t, now, StartedAt(DefaultProcRoot, gone.ProcessState.Pid(), now))
	require.Equal(t, now, StartedAt(t.TempDir(), c.Process.Pid, now))
	// A fallback earlier than the start read is kept.
	early := before.Add(-time.Hour)
	require.Equal(t, early, StartedAt(DefaultProcRoot, c.Process.Pid, early))
}
