// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package observe

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Container ids used across the tests: full 64-hex ids as runtimes make them.
var (
	idA = strings.Repeat("a1", 32)
	idB = strings.Repeat("b2", 32)
	idC = strings.Repeat("c3", 32)
)

// fakeProc is a /proc tree in a temporary directory: uptime plus, per pid,
// stat (with a start time) and cgroup.
type fakeProc struct {
	t    testing.TB
	root string
}

func newFakeProc(t testing.TB, uptimeSecs float64) *fakeProc {
	t.Helper()
	p := &fakeProc{t: t, root: t.TempDir()}
	require.NoError(t, os.MkdirAll(filepath.Join(p.root, "proc"), 0o755))
	p.setUptime(uptimeSecs)
	return p
}

func (p *fakeProc) setUptime(secs float64) {
	p.t.Helper()
	require.NoError(p.t, os.WriteFile(filepath.Join(p.root, "proc", "uptime"), fmt.Appendf(nil, "%.2f 1234.56\n", secs), 0o644))
}

// add creates pid with the given cgroup document and start time (ticks).
func (p *fakeProc) add(pid int, startTicks uint64, cgroup string) {
	p.t.Helper()
	dir := filepath.Join(p.root, "proc", fmt.Sprint(pid))
	require.NoError(p.t, os.MkdirAll(dir, 0o755))
	// A command name with spaces and parentheses, as a process may choose.
	stat := fmt.Sprintf("%d (py (worker) 1) S 1 %d %d 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 4 0 %d 1000000 200 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0\n",
		pid, pid, pid, startTicks)
	require.NoError(p.t, os.WriteFile(filepath.Join(dir, "stat"), []byte(stat), 0o644))
	require.NoError(p.t, os.WriteFile(filepath.Join(dir, "cgroup"), []byte(cgroup), 0o644))
}

// addIn creates pid as a process of container id (cgroup v2, systemd
// driver, containerd CRI) started at startTicks.
func (p *fakeProc) addIn(pid int, startTicks uint64, id string) {
	p.add(pid, startTicks, "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1234.slice/cri-containerd-"+id+".scope\n")
}

func TestContainerIDFromCgroup(t *testing.T) {
	upper := strings.ToUpper(idA)
	tests := []struct {
		path, want string
	}{
		{"/k8s.io/" + idA, idA},
		{"/kubepods/burstable/pod0a1b2c3d-0000-4000-8000-000000000000/" + idB, idB},
		{"/kubepods.slice/kubepods-pod1.slice/cri-containerd-" + idA + ".scope", idA},
		{"/system.slice/docker-" + idB + ".scope", idB},
		{"/docker/" + idC, idC},
		{"/machine.slice/libpod-" + idA + ".scope", idA},
		{"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-" + idA + ".scope/container", idA},
		{"/kubepods.slice/kubepods-burstable.slice/crio-" + idC + ".scope", idC},
		{"/k8s.io/" + upper, idA},
		// Host processes and runtime helpers are not containers.
		{"/machine.slice/libpod-conmon-" + idA + ".scope", ""},
		{"/system.slice/containerd.service", ""},
		{"/user.slice/user-0.slice/session-3.scope", ""},
		{"/", ""},
		{"/k8s.io/" + idA[:63], ""},
		{"/k8s.io/" + idA + "0", ""},
		{"/k8s.io/" + strings.Repeat("g", 64), ""},
	}
	for _, tt := range tests {
		assert.Equal(t, tt.want, ContainerIDFromCgroup(tt.path), "path %q", tt.path)
	}
}

// hybridCgroup is /proc/PID/cgroup of a process of container id on a hybrid
// host (cgroup v1 controllers plus the unified hierarchy; systemd's hybrid
// mode, the default of Ubuntu 20.04 and DGX OS 5) whose runtime uses runc's
// cgroupfs driver: runc joins the v1 controllers and name=systemd only, so
// the "0::" line stays at the shim's cgroup.
func hybridCgroup(id string) string {
	p := hybridPath(id)
	return "12:devices:" + p + "\n11:memory:" + p + "\n7:net_cls,net_prio:/\n3:pids:" + p + "\n1:name=systemd:" + p +
		"\n0::/system.slice/containerd.service\n"
}

func hybridPath(id string) string {
	return "/kubepods/besteffort/pod0a1b2c3d-0000-4000-8000-000000000000/" + id
}

func TestParseCgroupPrefersTheLineNamingAContainer(t *testing.T) {
	// Hybrid host: the v1 lines name the container, the unified one the
	// shim's service.
	path, id := parseCgroup([]byte(hybridCgroup(idA)))
	assert.Equal(t, hybridPath(idA), path)
	assert.Equal(t, idA, id)

	// Hybrid host, systemd driver: every line names it.
	scope := "/kubepods.slice/kubepods-pod1.slice/cri-containerd-" + idB + ".scope"
	path, id = parseCgroup([]byte("3:pids:" + scope + "\n1:name=systemd:" + scope + "\n0::" + scope + "\n"))
	assert.Equal(t, scope, path)
	assert.Equal(t, idB, id)

	// Only the unified line names one: it wins.
	path, id = parseCgroup([]byte("3:pids:/system.slice/containerd.service\n0::/k8s.io/" + idB + "\n"))
	assert.Equal(t, "/k8s.io/"+idB, path)
	assert.Equal(t, idB, id)

	// Lines naming different containers: a v1 controller every runtime
	// joins, not the unified hierarchy (it carries no controller on a
	// hybrid host) nor one a runtime may leave alone.
	path, id = parseCgroup([]byte("13:cpuset:/docker/" + idB + "\n12:pids:/k8s.io/" + idA + "\n0::/k8s.io/" + idB + "\n"))
	assert.Equal(t, "/k8s.io/"+idA, path)
	assert.Equal(t, idA, id)

	// cgroup v1: a hierarchy that names the container.
	path, id = parseCgroup([]byte("13:cpuset:/\n12:pids:/docker/" + idC + "\n1:name=systemd:/docker/" + idC + "\n"))
	assert.Equal(t, "/docker/"+idC, path)
	assert.Equal(t, idC, id)

	// A host process: no id; the path liveness.ProcessCgroup would record.
	path, id = parseCgroup([]byte("0::/system.slice/sshd.service\n"))
	assert.Equal(t, "/system.slice/sshd.service", path)
	assert.Empty(t, id)
	path, id = parseCgroup([]byte("12:hugetlb:/\n3:pids:/user.slice/job\n0::/user.slice/user-0.slice/session-1.scope\n"))
	assert.Equal(t, "/user.slice/job", path)
	assert.Empty(t, id)

	// A path holding ':' is kept whole.
	path, _ = parseCgroup([]byte("0::/odd:name\n"))
	assert.Equal(t, "/odd:name", path)
}

func TestAttribute(t *testing.T) {
	fp := newFakeProc(t, 1000) // 100000 ticks since boot
	pr := procFS{root: fp.root}
	listedAt, err := pr.uptimeTicks()
	require.NoError(t, err)
	require.EqualValues(t, 100000, listedAt)

	fp.addIn(10, 5000, idA)
	p := Process{PID: 10}
	require.NoError(t, pr.attribute(&p, listedAt))
	assert.Equal(t, idA, p.ContainerID)
	assert.False(t, p.Gone)
	assert.EqualValues(t, 5000, p.startTicks)

	fp.add(11, 6000, "0::/user.slice/user-0.slice/session-1.scope\n")
	p = Process{PID: 11}
	require.NoError(t, pr.attribute(&p, listedAt))
	assert.Empty(t, p.ContainerID, "a host process stays a host process")
	assert.False(t, p.Gone)

	p = Process{PID: 12}
	require.NoError(t, pr.attribute(&p, listedAt))
	assert.True(t, p.Gone, "no /proc entry: gone, not a guess")
	assert.Empty(t, p.ContainerID)

	// Pid 13 was listed by NVML, exited, and the pid went to a process of
	// another container that started after the listing.
	fp.addIn(13, listedAt+50, idB)
	p = Process{PID: 13}
	require.NoError(t, pr.attribute(&p, listedAt))
	assert.True(t, p.Gone, "a process younger than the listing is not the one NVML saw")
	assert.Empty(t, p.ContainerID, "the new owner of the pid is not blamed")

	// Rounding: one tick after the listing is still the listed process.
	fp.addIn(14, listedAt+1, idB)
	p = Process{PID: 14}
	require.NoError(t, pr.attribute(&p, listedAt))
	assert.False(t, p.Gone)

	// A stat without a cgroup (the process exited between the reads).
	fp.addIn(15, 10, idA)
	require.NoError(t, os.Remove(filepath.Join(fp.root, "proc", "15", "cgroup")))
	p = Process{PID: 15}
	require.NoError(t, pr.attribute(&p, listedAt))
	assert.True(t, p.Gone)

	// A malformed stat is an error, not a guess.
	require.NoError(t, os.WriteFile(filepath.Join(fp.root, "proc", "14", "stat"), []byte("14 (x) S 1\n"), 0o644))
	p = Process{PID: 14}
	require.ErrorContains(t, pr.attribute(&p, listedAt), "pid 14: malformed stat")
}

func TestPidReusedDuringTheRead(t *testing.T) {
	fp := newFakeProc(t, 1000)
	fp.addIn(20, 500, idA)
	// Between the cgroup read and the second stat read, pid 20 exits and
	// the pid goes to a process of B: the cgroup read may be either's.
	pr := procFS{root: fp.root, betweenReads: func(pid int) { fp.addIn(pid, 600, idB) }}
	p := Process{PID: 20}
	require.NoError(t, pr.attribute(&p, 100000))
	assert.True(t, p.Gone)
	assert.Empty(t, p.ContainerID)

	// Exited between the reads, pid not reused: gone as well.
	fp.addIn(21, 500, idA)
	pr.betweenReads = func(pid int) { require.NoError(t, os.RemoveAll(filepath.Join(fp.root, "proc", fmt.Sprint(pid)))) }
	p = Process{PID: 21}
	require.NoError(t, pr.attribute(&p, 100000))
	assert.True(t, p.Gone)
}

func TestUptimeErrors(t *testing.T) {
	fp := newFakeProc(t, 1)
	require.NoError(t, os.WriteFile(filepath.Join(fp.root, "proc", "uptime"), []byte("soon\n"), 0o644))
	_, err := procFS{root: fp.root}.uptimeTicks()
	require.ErrorContains(t, err, `unexpected "soon"`)
	_, err = procFS{root: t.TempDir()}.uptimeTicks()
	require.ErrorIs(t, err, os.ErrNotExist)
}
