// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build podman

package integration

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// podmanScenario is one scenario of the suite, run on the rig of each
// runtime, one after the other; each leaves no container and an empty
// ledger (podmanRig.runScenarios checks).
type podmanScenario struct {
	name string
	run  func(t *testing.T, r *podmanRig)
}

// podmanScenarios are the suite's scenarios: TestPodman runs them with the
// hooks run by the runtime, TestPodmanRelay through the hook relay.
var podmanScenarios = []podmanScenario{
	{"QueueFIFOAndOtherGPU", podmanQueueFIFO},
	{"RefusedContainerRemoved", podmanRefusedRemoved},
	{"HolderKilled", podmanHolderKilled},
	{"RestartPolicyClaimsAgain", podmanRestartPolicy},
	{"Privileged", podmanPrivileged},
	{"AllAndDeviceWhileHeld", podmanAllAndDevice},
	{"AbandonedCreate", podmanAbandoned},
	{"HostDevBind", podmanHostDevBind},
	{"MknodWithoutCgroup", podmanMknodWithoutCgroup},
	{"DevicePathUserNS", podmanDevicePathUserNS},
	{"RootNodevInContainer", podmanRootNodev},
	{"ImageNodesWithoutCgroup", podmanImageNodes},
	{"UserNSImageNodesWithoutCgroup", podmanUserNSImageNodes},
	{"BoundDirWithoutCgroup", podmanBoundDir},
	{"UserNSDeviceBundle", podmanUserNSDeviceBundle},
	{"FailedCreateUnderRemove", podmanFailedCreateUnderRemove},
	{"FailedCreateThenStart", podmanFailedCreateThenStart},
	{"OneHook", podmanOneHook},
	{"OneHookStatusNoProblem", podmanOneHookStatus},
}

// podmanRuntimes are the OCI runtimes the suite runs podman with.
var podmanRuntimes = []string{"runc", "crun"}

// TestPodman runs every scenario on podman with runc and with crun.
func TestPodman(t *testing.T) {
	for _, rt := range podmanRuntimes {
		t.Run(rt, func(t *testing.T) {
			newPodmanRig(t, rt, false).runScenarios(t, podmanScenarios)
		})
	}
}

// runScenarios runs each scenario as a subtest of t, resetting the rig
// after it; in relay mode it also checks that the hook server answered
// every relay of the scenario.
func (r *podmanRig) runScenarios(t *testing.T, scenarios []podmanScenario) {
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			r.t = t
			if r.relaySock != "" {
				defer r.requireServerAnswered(t) // after the reset's poststops
			}
			defer r.reset()
			sc.run(t, r)
		})
	}
}

// refusal checks what the person who ran a refused `podman run` is told:
// under runc the hook's own words; under crun only the hook's exit code
// (75: busy), with the reason in `gpu-guard-ctl audit`.
func (r *podmanRig) refusal(out string, want ...string) {
	r.t.Helper()
	if r.runtime == "crun" {
		require.Contains(r.t, out, "exit code: 75", out)
		audit, err := r.ctl("audit", "-n", "1", "-o", "json")
		require.NoError(r.t, err, audit)
		out = audit
	} else {
		require.NotContains(r.t, out, "Kubernetes")
	}
	for _, s := range want {
		require.Contains(r.t, out, s)
	}
}

// podmanQueueFIFO: a holder, two `gpu-guard-ctl run` waiters for its GPU and
// a container on another GPU at once. While they wait, podman answers (ps -a,
// a refused run); stopping the holder admits the head of the queue, then the
// next one.
func podmanQueueFIFO(t *testing.T, r *podmanRig) {
	out, err := r.runGPU("h", "1")
	require.NoError(t, err, out)
	h := r.id("h")
	require.Equal(t, map[int]string{1: h}, r.holders())

	w1 := r.ctlRun("w1", "1")
	r.queued(w1, 1)
	w2 := r.ctlRun("w2", "1")
	r.queued(w2, 2)
	queue := r.waiterKeys()

	out, err = r.runGPU("o", "2")
	require.NoError(t, err, "another GPU is admitted while GPU 1 has a queue: %s", out)

	psOut, psTime, err := r.timed("ps", "-a")
	require.NoError(t, err, psOut)
	t.Logf("podman ps -a while 2 wait: %s", psTime)

	out, err = r.runGPU("late", "1")
	require.Error(t, err, "a plain run for GPU 1 is refused at once: %s", out)
	r.refusal(out, "GPU 1 ("+r.gpu[1]+") is held by container "+h[:12], "2 requests wait for it before this one")
	require.Equal(t, queue, r.waiterKeys(), "the refused run did not join the queue")
	require.Equal(t, h, r.holders()[1], "the holder still holds")

	r.mustPodman("stop", "-t", "5", "h")
	require.NoError(t, w1.wait(t), w1.out.String())
	id1 := r.id("w1")
	r.waitFor("w1 to hold GPU 1", func() bool { return r.holders()[1] == id1 })
	require.Contains(t, w1.out.String(), "claimed for ticket "+queue[0])
	require.Equal(t, queue[1:], r.waiterKeys(), "w2 is next")
	require.Equal(t, "running", r.inspect("w1", "{{.State.Status}}"))

	r.mustPodman("stop", "-t", "5", "w1")
	require.NoError(t, w2.wait(t), w2.out.String())
	id2 := r.id("w2")
	r.waitFor("w2 to hold GPU 1", func() bool { return r.holders()[1] == id2 })
	require.Empty(t, r.waiterKeys())
}

// podmanRefusedRemoved: a container refused because its GPU is busy is
// left "Created" by podman; `podman rm -f` of it returns at once (its hook
// is not blocking the container's lock) and leaves no waiter and no claim;
// a `gpu-guard-ctl run` waiter is cancelled with Ctrl-C and leaves the queue.
func podmanRefusedRemoved(t *testing.T, r *podmanRig) {
	out, err := r.runGPU("h", "1")
	require.NoError(t, err, out)
	w := r.ctlRun("wq", "1")
	r.queued(w, 1)

	out, err = r.runGPU("x", "1")
	require.Error(t, err, out)
	require.Equal(t, "created", r.inspect("x", "{{.State.Status}}"))
	rmOut, rmTime, err := r.timed("rm", "-f", "x")
	require.NoError(t, err, rmOut)
	t.Logf("podman rm -f of a refused container while another waits: %s", rmTime)
	require.Len(t, r.waiterKeys(), 1, "only the ctl waiter")
	require.Equal(t, []int{1}, keys(r.holders()), "x holds nothing")

	require.NoError(t, w.cmd.Process.Signal(syscall.SIGINT))
	err = w.wait(t)
	require.Error(t, err)
	require.Contains(t, w.out.String(), "not queued any more and holds no GPU")
	require.Empty(t, r.waiterKeys(), "Ctrl-C left the queue")
	_, err = r.podman("inspect", "wq")
	require.Error(t, err, "the cancelled run started no container")
}

// podmanHolderKilled: kill -9 of the holder's process (podman's cleanup
// runs poststop) and kill -9 of conmon then the process (no poststop; the
// next request finds the holder's process gone and releases it).
func podmanHolderKilled(t *testing.T, r *podmanRig) {
	out, err := r.runGPU("k", "1")
	require.NoError(t, err, out)
	pid, err := strconv.Atoi(r.inspect("k", "{{.State.Pid}}"))
	require.NoError(t, err)
	require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
	r.waitFor("k's poststop to release GPU 1", func() bool { return len(r.holders()) == 0 })

	out, err = r.runGPU("c", "2")
	require.NoError(t, err, out)
	conmon, err := strconv.Atoi(r.inspect("c", "{{.State.ConmonPid}}"))
	require.NoError(t, err)
	pid, err = strconv.Atoi(r.inspect("c", "{{.State.Pid}}"))
	require.NoError(t, err)
	require.NoError(t, syscall.Kill(conmon, syscall.SIGKILL))
	require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
	r.waitFor("c's process to be gone", func() bool { return syscall.Kill(pid, 0) != nil })
	require.Equal(t, r.id("c"), r.holders()[2], "no poststop ran: the claim is still there")

	out, err = r.runGPU("n", "2")
	require.NoError(t, err, "the holder's process is gone: released at the next request: %s", out)
	require.Equal(t, r.id("n"), r.holders()[2])
}

// podmanRestartPolicy: a GPU container with --restart=on-failure whose
// process dies (kill -9: exit 137) is restarted by podman itself: conmon runs
// `podman container cleanup`, whose poststop releases the claim, and which
// then creates the container again from a spec with the hooks of its own
// configuration. The restarted container claims its GPU again (the claim
// names its new process) and a second container on that GPU is refused.
// podman before containers/podman#26127 does not pass --hooks-dir on to that
// command: hooks installed with the flag alone are not in the restarted
// container's spec (no claim; the second container is admitted onto the
// same GPU). The rig installs them as docs/hook.md says, with hooks_dir in
// containers.conf, which reaches it.
func podmanRestartPolicy(t *testing.T, r *podmanRig) {
	out, err := r.runGPU("rp", "1", "--restart=on-failure:3")
	require.NoError(t, err, out)
	id := r.id("rp")
	require.Equal(t, map[int]string{1: id}, r.holders())
	first, pid := r.killForRestart("rp")
	require.NotEqual(t, first, pid, "a new process")

	claims := r.state().Claims
	require.Len(t, claims, 1, "the restarted container claims GPU 1 again: %+v", claims)
	require.Equal(t, r.gpu[1], claims[0].Device.UUID)
	require.Equal(t, id, claims[0].Owner.ContainerID)
	require.Equal(t, pid, claims[0].Owner.Pid, "the claim is the restarted process's, not the killed one's")

	out, err = r.runGPU("second", "1")
	require.Error(t, err, "GPU 1 is held by the restarted container: %s", out)
	r.refusal(out, "GPU 1 ("+r.gpu[1]+") is held by container "+id[:12])
	require.Equal(t, map[int]string{1: id}, r.holders())
}

// killForRestart kills the process of container name, which runs under a
// restart policy for the first time, waits for podman to restart it, and
// returns the killed pid and the restarted one.
func (r *podmanRig) killForRestart(name string) (first, restarted int) {
	r.t.Helper()
	first, err := strconv.Atoi(r.inspect(name, "{{.State.Pid}}"))
	require.NoError(r.t, err)
	require.NoError(r.t, syscall.Kill(first, syscall.SIGKILL))
	var state string
	r.waitFor("podman to restart "+name, func() bool {
		state = r.inspect(name, "{{.RestartCount}} {{.State.Status}} {{.State.Pid}}")
		return strings.HasPrefix(state, "1 running ")
	})
	restarted, err = strconv.Atoi(strings.TrimPrefix(state, "1 running "))
	require.NoError(r.t, err, state)
	return first, restarted
}

// podmanFailedCreateUnderRemove: under release_on = "remove", a container
// whose create fails after the guard's create-runtime hook admitted it (a
// createContainer hook fails, as CDI's nvidia-ctk hooks may) is deleted by
// the runtime, and podman, which runs the poststop hooks itself, runs none
// for it (with runc as with crun). Its claim used to outlive it for good:
// `podman rm -f` and `podman ps -a` showed nothing, gc had "nothing to
// release", and the next container on the GPU was refused. No runtime root
// lists it any more: status says so, and the next request releases the
// claim.
func podmanFailedCreateUnderRemove(t *testing.T, r *podmanRig) {
	cfg, err := os.ReadFile(r.cfgPath)
	require.NoError(t, err)
	require.NotContains(t, string(cfg), "[policy]")
	require.NoError(t, os.WriteFile(r.cfgPath, append(slices.Clone(cfg), "[policy]\nrelease_on = \"remove\"\n"...), 0o600))
	t.Cleanup(func() { require.NoError(t, os.WriteFile(r.cfgPath, cfg, 0o600)) })
	// A createContainer hook that fails, for the containers annotated so:
	// it runs after the guard's createRuntime hook admitted them.
	falseBin, err := exec.LookPath("false")
	require.NoError(t, err)
	failing := filepath.Join(r.hooksDir, "zz-fail-create.json")
	doc := fmt.Sprintf(`{"version": "1.0.0", "hook": {"path": %q}, "when": {"annotations": {"^gg\\.test/fail-create$": "^1$"}}, "stages": ["createContainer"]}`,
		falseBin)
	require.NoError(t, os.WriteFile(failing, []byte(doc), 0o644))
	t.Cleanup(func() { require.NoError(t, os.Remove(failing)) })

	extra := []string{"--annotation", "gg.test/fail-create=1"}
	if r.runtime == "crun" {
		// In this rig crun runs where /sys/fs/cgroup/unified is unmounted,
		// and "creates" the container's cgroup v2 as a plain directory of
		// the tmpfs below, whose cgroup.procs file keeps the pid after the
		// failed create: read there, the holder would never look exited.
		// Without a cgroup its liveness goes by its pid, as on a real host
		// by its emptied cgroup (and, under no device cgroup, it claims
		// every GPU).
		extra = append(extra, "--cgroups=disabled")
	}
	out, err := r.runGPU("f", "1", extra...)
	require.Error(t, err, "its createContainer hook fails: %s", out)
	f := r.id("f")
	r.mustPodman("rm", "-f", "-t", "0", "f")
	require.Equal(t, f, r.holders()[1], "no poststop ran")
	st, err := r.ctl("status")
	require.Error(t, err, "status exits 3: %s", st)
	require.Contains(t, st, "ATTENTION (")
	require.Contains(t, st, "whose processes are gone and whose container was removed")
	require.Contains(t, st, "release it with `sudo gpu-guard-ctl gc`")

	out, err = r.runGPU("n", "1")
	require.NoError(t, err, "the removed container's claim does not block GPU 1: %s", out)
	require.Equal(t, map[int]string{1: r.id("n")}, r.holders())
}

// podmanPrivileged: podman adds every /dev/nvidiaN to a privileged container;
// under privileged = "declared" it claims only the GPUs it names, and
// gpu-guard-ctl explain says the same of its config.json.
func podmanPrivileged(t *testing.T, r *podmanRig) {
	out, err := r.runGPU("h", "1")
	require.NoError(t, err, out)

	out, err = r.runGPU("p0", "", "--privileged")
	require.NoError(t, err, "privileged, names no GPU: admitted while GPU 1 is held: %s", out)
	out, err = r.runGPU("p2", "2", "--privileged")
	require.NoError(t, err, "privileged, names GPU 2: %s", out)
	require.Equal(t, map[int]string{1: r.id("h"), 2: r.id("p2")}, r.holders())

	spec := r.inspect("p2", "{{.OCIConfigPath}}")
	nodes, err := exec.Command("grep", "-c", "/dev/nvidia", spec).Output()
	require.NoError(t, err)
	require.NotEqual(t, "0\n", string(nodes), "podman added the device nodes")
	ex, err := r.ctl("explain", "--spec", spec, "-o", "json")
	require.NoError(t, err, ex)
	var v struct {
		Devices []struct {
			Index   string   `json:"index"`
			Sources []string `json:"sources"`
		} `json:"devices"`
		Privileged bool     `json:"privileged"`
		Notes      []string `json:"notes"`
	}
	require.NoError(t, json.Unmarshal([]byte(ex), &v), ex)
	require.True(t, v.Privileged)
	require.Len(t, v.Devices, 1, ex)
	require.Equal(t, "2", v.Devices[0].Index)
	require.Equal(t, []string{`env NVIDIA_VISIBLE_DEVICES="2"`}, v.Devices[0].Sources)
	require.True(t, slices.ContainsFunc(v.Notes, func(n string) bool { return strings.Contains(n, "not counted as a request") }), ex)
}

// podmanAllAndDevice: NVIDIA_VISIBLE_DEVICES=all, --device /dev/nvidia1 and
// --cap-add SYS_ADMIN --device /dev/nvidia1 are refused while GPU 1 is held;
// --device of a free GPU is admitted.
func podmanAllAndDevice(t *testing.T, r *podmanRig) {
	out, err := r.runGPU("h", "1")
	require.NoError(t, err, out)
	h := r.id("h")

	out, err = r.runGPU("all", "all")
	require.Error(t, err, out)
	r.refusal(out, "GPU 1 ("+r.gpu[1]+") is held by container "+h[:12])
	out, err = r.runGPU("d1", "", "--device", "/dev/nvidia1")
	require.Error(t, err, out)
	r.refusal(out, "GPU 1 ("+r.gpu[1]+") is held by container "+h[:12])
	// CAP_SYS_ADMIN is not --privileged: its device cgroup still allows only
	// the node it names, and that node is a request.
	out, err = r.runGPU("s1", "", "--cap-add", "SYS_ADMIN", "--device", "/dev/nvidia1")
	require.Error(t, err, out)
	r.refusal(out, "GPU 1 ("+r.gpu[1]+") is held by container "+h[:12])
	out, err = r.runGPU("d3", "", "--device", "/dev/nvidia3")
	require.NoError(t, err, out)
	require.Equal(t, map[int]string{1: h, 3: r.id("d3")}, r.holders())
}

// podmanAbandoned: nothing can make podman abandon a create any more: even
// with --wait in the hooks file, the hook sees that its runtime runs under
// conmon and answers at once. A `gpu-guard-ctl run` killed with SIGKILL
// while it waits (the client gave up) never takes the GPU and does not keep
// the freed GPU from the next request.
func podmanAbandoned(t *testing.T, r *podmanRig) {
	out, err := r.runGPU("h", "1")
	require.NoError(t, err, out)

	out, err = r.podmanEnv([]string{"GG_CONTAINERS_CONF=" + filepath.Join(r.base, "containers-wait.conf")},
		"run", "-d", "--name", "wt", "-e", "NVIDIA_VISIBLE_DEVICES=1", podmanImage)
	require.Error(t, err, out)
	if r.runtime == "runc" {
		require.Contains(t, out, "deciding without waiting although --wait is set")
		require.Contains(t, out, "conmon")
	}
	require.Empty(t, r.waiterKeys())

	g := r.ctlRun("ghost", "1")
	r.queued(g, 1)
	require.NoError(t, g.cmd.Process.Kill())
	_ = g.wait(t)
	require.Len(t, r.waiterKeys(), 1, "SIGKILL: it could not withdraw")

	r.mustPodman("stop", "-t", "5", "h")
	r.waitFor("h released", func() bool { return len(r.holders()) == 0 })
	out, err = r.runGPU("next", "1")
	require.NoError(t, err, "the dead waiter does not block the freed GPU: %s", out)
	require.Equal(t, map[int]string{1: r.id("next")}, r.holders())
	require.Empty(t, r.waiterKeys(), "the dead waiter was dropped")
}

func keys(m map[int]string) []int {
	var out []int
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// podmanHostDevBind: a container that binds the host's /dev (a monitoring
// agent's -v /dev:/host/dev) reaches the GPU nodes its device cgroup lets it
// open. In the cgroup podman creates for it, the spec's device rules hold:
// admitted, nothing claimed. With --cgroups=disabled (crun: the process
// stays where podman's conmon runs it, under no device rules) every GPU
// opens: it claims them all, and is refused while one is held.
func podmanHostDevBind(t *testing.T, r *podmanRig) {
	out, err := r.runGPU("b", "", "-v", "/dev:/host-dev")
	require.NoError(t, err, out)
	require.Empty(t, r.holders(), "the device cgroup stops what the bind brings")
	if r.runtime != "crun" {
		return // podman disables a container's cgroups with crun only
	}
	out, err = r.runGPU("h", "1")
	require.NoError(t, err, out)
	out, err = r.runGPU("nc", "", "--cgroups=disabled", "-v", "/dev:/host-dev")
	require.Error(t, err, "GPU 1 is held: a container that opens every GPU is refused: %s", out)
	r.refusal(out, "GPU 1 ("+r.gpu[1]+") is held by container "+r.id("h")[:12])
	r.mustPodman("rm", "-f", "nc")
	r.mustPodman("rm", "-f", "-t", "0", "h")
	r.waitFor("h's claim released", func() bool { return len(r.holders()) == 0 })

	out, err = r.runGPU("nc2", "", "--cgroups=disabled", "-v", "/dev:/host-dev")
	require.NoError(t, err, out)
	r.requireHoldsEveryGPU("nc2", "a bound /dev")
}

// requireHoldsEveryGPU checks that container name holds every GPU, and
// nothing else holds one.
func (r *podmanRig) requireHoldsEveryGPU(name, why string) {
	r.t.Helper()
	id := r.id(name)
	held := r.holders()
	require.Len(r.t, held, len(r.gpu), "%s: every GPU: %v", why, held)
	for _, holder := range held {
		require.Equal(r.t, id, holder, why)
	}
}

// podmanMknodWithoutCgroup: a container that may make device nodes
// (--cap-add MKNOD) opens a GPU node it makes when no device cgroup stops it,
// and a bind of the host's /dev through a symlink is the host's /dev. In the
// cgroup podman creates, neither reaches a GPU: admitted, nothing claimed.
// With --cgroups=disabled (crun) each claims every GPU.
func podmanMknodWithoutCgroup(t *testing.T, r *podmanRig) {
	out, err := r.runGPU("m", "", "--cap-add", "MKNOD")
	require.NoError(t, err, out)
	require.Empty(t, r.holders(), "the device cgroup denies what it makes")
	devLink := filepath.Join(t.TempDir(), "devlink")
	require.NoError(t, os.Symlink("/dev", devLink))
	out, err = r.runGPU("l", "", "-v", devLink+":/host-dev")
	require.NoError(t, err, out)
	require.Empty(t, r.holders(), "the device cgroup stops what the bind brings")
	if r.runtime != "crun" {
		return // podman disables a container's cgroups with crun only
	}
	for _, tc := range []struct {
		name, why string
		args      []string
	}{
		{"mk", "CAP_MKNOD", []string{"--cap-add", "MKNOD"}},
		{"ml", "/dev through a symlink", []string{"-v", devLink + ":/host-dev"}},
	} {
		out, err = r.runGPU(tc.name, "", append([]string{"--cgroups=disabled"}, tc.args...)...)
		require.NoError(t, err, "%s: %s", tc.why, out)
		r.requireHoldsEveryGPU(tc.name, tc.why)
		r.mustPodman("rm", "-f", "-t", "0", tc.name)
		r.waitFor(tc.why+": its claims released", func() bool { return len(r.holders()) == 0 })
	}
}

// podmanDevicePathUserNS: `--device /dev/null:/dev/nvidia2` lists
// {path /dev/nvidia2, c 1:3}. In a user namespace runc cannot mknod and
// binds the host's node at that path: the container's /dev/nvidia2 is GPU
// 2 (195:2), not /dev/null. Its device cgroup allows 1:3 only: admitted,
// nothing claimed. Where no device cgroup applies (crun
// --cgroups=disabled) the hook reads the path as well as the numbers,
// since it cannot tell whether its runtime binds or mknods (crun 1.8
// rootful mknods 1:3): the container claims GPU 2 for its path. It claims
// every other GPU too, for its root filesystem, whose nodev crun drops
// (podmanImageNodes). (crun 1.8 with a user namespace and a device hands
// createRuntime hooks the bundle "/": see podmanUserNSDeviceBundle.)
func podmanDevicePathUserNS(t *testing.T, r *podmanRig) {
	device := []string{"--device", "/dev/null:/dev/nvidia2"}
	if r.runtime == "runc" {
		out, err := r.runGPU("u", "", append([]string{"--uidmap", "0:0:65536", "--gidmap", "0:0:65536"}, device...)...)
		require.NoError(t, err, out)
		require.Empty(t, r.holders(), "the device cgroup allows 1:3 only")
		var st syscall.Stat_t
		node := "/proc/" + r.inspect("u", "{{.State.Pid}}") + "/root/dev/nvidia2"
		require.NoError(t, syscall.Stat(node, &st))
		require.Equal(t, [2]uint32{195, 2}, [2]uint32{unix.Major(st.Rdev), unix.Minor(st.Rdev)},
			"runc binds the host's node at the entry's path")
		return // podman disables a container's cgroups with crun only
	}
	// Without CAP_MKNOD (in podman's built-in set), which alone opens
	// every GPU there.
	out, err := r.runGPU("un", "", append([]string{"--cgroups=disabled", "--cap-drop", "MKNOD"}, device...)...)
	require.NoError(t, err, out)
	r.requireHoldsEveryGPU("un", "its root, whose nodev crun drops")
	for _, c := range r.state().Claims {
		if c.Device.UUID == r.gpu[2] {
			require.Contains(t, c.Source, "/dev/nvidia2", "GPU 2 is claimed for the path as well")
		}
	}
}

// rootMountOptions returns the mount options of container name's "/", as
// its process's mountinfo shows them (read from the host: the container's
// own mount namespace).
func (r *podmanRig) rootMountOptions(name string) []string {
	r.t.Helper()
	data, err := os.ReadFile("/proc/" + r.inspect(name, "{{.State.Pid}}") + "/mountinfo")
	require.NoError(r.t, err)
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) > 5 && f[4] == "/" {
			return strings.Split(f[5], ",")
		}
	}
	r.t.Fatalf("no / in %s's mountinfo: %s", name, data)
	return nil
}

// podmanRootNodev: what becomes of the nodev of container storage mounted
// nodev (the rig's overlay.mountopt=nodev) at the container's "/", which
// decides whether a device node its image carries opens where no device
// cgroup applies (the hook counts by it: podmanImageNodes). runc 1.1.5
// keeps it for a read-write root and drops it for a read-only one
// (--read-only: it remounts the root MS_RDONLY alone); crun 1.8.1 drops it
// for either. Read from the container's mountinfo; these containers have
// their device cgroup and claim nothing.
func podmanRootNodev(t *testing.T, r *podmanRig) {
	for _, tc := range []struct {
		name  string
		extra []string
		nodev bool
	}{
		{"rw", nil, r.runtime == "runc"},
		{"ro", []string{"--read-only"}, false},
	} {
		out, err := r.runGPU(tc.name, "", tc.extra...)
		require.NoError(t, err, out)
		require.Equal(t, tc.nodev, slices.Contains(r.rootMountOptions(tc.name), "nodev"), "%s, %s root", r.runtime, tc.name)
		r.mustPodman("rm", "-f", "-t", "0", tc.name)
	}
	require.Empty(t, r.holders(), "in their device cgroups nothing opens")
}

// podmanImageNodes: podman unpacks an image as root, device nodes and all,
// and without a device cgroup (crun --cgroups=disabled) a node of a GPU's
// numbers in the image opens that GPU. The hook does not walk the image:
// unless the root is nodev in the container, such a container counts as
// reaching every GPU, claims them all with a source that says why, and is
// refused while one is held. crun drops the nodev of container storage
// mounted nodev (podmanRootNodev), so under crun --cgroups=disabled every
// container counts so, on the rig's nodev storage as on storage without
// nodev: a deliberate, conservative reading (before, the hook trusted the
// storage's nodev and admitted "nd" claiming nothing, while a node in its
// image opened). What an operator can do: keep the device cgroup, where
// nothing of the image opens and nothing is claimed, on either storage.
// None has CAP_MKNOD, which alone opens every GPU there.
func podmanImageNodes(t *testing.T, r *podmanRig) {
	if r.runtime != "crun" {
		return // podman disables a container's cgroups with crun only
	}
	// Without CAP_MKNOD (in podman's built-in set), which alone opens
	// every GPU there.
	noMknod := []string{"--cap-drop", "MKNOD"}
	out, err := r.runGPU("nd", "", append([]string{"--cgroups=disabled"}, noMknod...)...)
	require.NoError(t, err, out)
	require.NotContains(t, r.rootMountOptions("nd"), "nodev", "crun drops the storage's nodev")
	r.requireHoldsEveryGPU("nd", "a root on nodev storage, whose nodev crun drops")
	for _, c := range r.state().Claims {
		require.Contains(t, c.Source, "root filesystem's nodev dropped by a runtime not known to be runc")
	}
	r.mustPodman("rm", "-f", "-t", "0", "nd")
	r.waitFor("nd's claims released", func() bool { return len(r.holders()) == 0 })

	out, err = r.runGPU("ndc", "", noMknod...)
	require.NoError(t, err, out)
	require.Empty(t, r.holders(), "in its device cgroup nothing of its image opens")
	r.mustPodman("rm", "-f", "-t", "0", "ndc")

	nodevless := []string{"GG_STORAGE_OPTS="}
	run := func(name string, extra ...string) (string, error) {
		args := append(append([]string{"run", "-d", "--name", name}, noMknod...), extra...)
		return r.podmanEnv(nodevless, append(args, podmanImage)...)
	}
	out, err = run("own")
	require.NoError(t, err, out)
	require.Empty(t, r.holders(), "its device cgroup stops what its image holds")
	root := r.inspect("own", "{{.GraphDriver.Data.MergedDir}}")
	var fs unix.Statfs_t
	require.NoError(t, unix.Statfs(root, &fs))
	require.Zero(t, fs.Flags&unix.ST_NODEV, "podman's storage without the option is not nodev")
	r.mustPodman("rm", "-f", "-t", "0", "own")

	out, err = r.runGPU("h", "1")
	require.NoError(t, err, out)
	out, err = run("ni", "--cgroups=disabled")
	require.Error(t, err, "GPU 1 is held: a container that may open every GPU is refused: %s", out)
	r.refusal(out, "GPU 1 ("+r.gpu[1]+") is held by container "+r.id("h")[:12])
	r.mustPodman("rm", "-f", "ni")
	r.mustPodman("rm", "-f", "-t", "0", "h")
	r.waitFor("h's claim released", func() bool { return len(r.holders()) == 0 })

	out, err = run("ni2", "--cgroups=disabled")
	require.NoError(t, err, out)
	r.requireHoldsEveryGPU("ni2", "a root filesystem without nodev")
	for _, c := range r.state().Claims {
		require.Contains(t, c.Source, "root filesystem not mounted nodev")
	}
}

// podmanUserNSImageNodes: a container with a user namespace of its own
// (--uidmap) keeps the nodev of container storage mounted nodev under crun
// --cgroups=disabled, read-only root or not: crun makes its mount namespace
// in that user namespace, where the kernel locks the nodev of the mounts it
// copies (without one crun drops it: podmanImageNodes). The hook reads the
// container's process in another user namespace than its own and counts
// nothing of its image: one that names no GPU claims none, one that names
// GPU 1 claims that one alone. On storage without nodev it still claims
// every GPU, the remedy named being storage mounted nodev.
func podmanUserNSImageNodes(t *testing.T, r *podmanRig) {
	if r.runtime != "crun" {
		return // podman disables a container's cgroups with crun only
	}
	// Without CAP_MKNOD (in podman's built-in set), which alone opens
	// every GPU there; mapped to root's own ids, as
	// podmanUserNSDeviceBundle.
	userns := []string{"--cgroups=disabled", "--cap-drop", "MKNOD", "--uidmap", "0:0:65536", "--gidmap", "0:0:65536"}
	for _, tc := range []struct {
		name  string
		extra []string
	}{{"un", nil}, {"unro", []string{"--read-only"}}} {
		out, err := r.runGPU(tc.name, "", append(slices.Clone(userns), tc.extra...)...)
		require.NoError(t, err, out)
		require.Contains(t, r.rootMountOptions(tc.name), "nodev", "%s: the storage's nodev, locked in its user namespace", tc.name)
		require.Empty(t, r.holders(), "%s: nothing of its image opens", tc.name)
		r.mustPodman("rm", "-f", "-t", "0", tc.name)
	}
	out, err := r.runGPU("ug", "1", userns...)
	require.NoError(t, err, out)
	require.Equal(t, map[int]string{1: r.id("ug")}, r.holders(), "the GPU it names alone")
	r.mustPodman("rm", "-f", "-t", "0", "ug")
	r.waitFor("ug's claim released", func() bool { return len(r.holders()) == 0 })

	args := append(append([]string{"run", "-d", "--name", "und"}, userns...), podmanImage)
	out, err = r.podmanEnv([]string{"GG_STORAGE_OPTS="}, args...)
	require.NoError(t, err, out)
	r.requireHoldsEveryGPU("und", "a root filesystem without nodev, in a user namespace too")
	for _, c := range r.state().Claims {
		require.Contains(t, c.Source, "root filesystem not mounted nodev")
	}
}

// podmanBoundDir: a directory bound into a container without a device
// cgroup (crun --cgroups=disabled) may hold device nodes (a named volume
// podman filled from the image, a node made on the host), and the hook
// does not list it: on a mount that is not nodev, bound without nodev, it
// counts as reaching every GPU, with a source that names it; bound nodev
// (-v dir:/data:nodev) nothing of it opens, and the claims do not name it.
// podman's own binds (/dev/shm, /etc/hosts and the like) count for nothing.
// Under crun --cgroups=disabled each of these containers claims every GPU
// anyway, for its root, whose nodev crun drops (podmanImageNodes): the
// claims' sources tell the bind's part. In its device cgroup ("bc") the
// directory's nodes do not open and nothing is claimed: what an operator
// can do.
func podmanBoundDir(t *testing.T, r *podmanRig) {
	if r.runtime != "crun" {
		return // podman disables a container's cgroups with crun only
	}
	// Without CAP_MKNOD (in podman's built-in set), which alone opens
	// every GPU there.
	noCgroup := []string{"--cgroups=disabled", "--cap-drop", "MKNOD"}
	// claimsName checks that container name holds every GPU, for its root,
	// and whether the claims name dir.
	claimsName := func(name, dir string, named bool) {
		r.requireHoldsEveryGPU(name, "its root, whose nodev crun drops")
		for _, c := range r.state().Claims {
			require.Contains(t, c.Source, "root filesystem's nodev dropped", name)
			require.Equal(t, named, strings.Contains(c.Source, "bind source "+dir+" "), "%s: %s", name, c.Source)
		}
		r.mustPodman("rm", "-f", "-t", "0", name)
		r.waitFor(name+"'s claims released", func() bool { return len(r.holders()) == 0 })
	}
	out, err := r.runGPU("nb", "", noCgroup...)
	require.NoError(t, err, out)
	claimsName("nb", "/", false) // nothing bound in but podman's own

	// A tmpfs without nodev, in the mount namespace podman and its hooks
	// run in (crun's: see newPodmanRig).
	dir := t.TempDir()
	r.mustRun("nsenter", "--mount="+r.nsFile, "mount", "-t", "tmpfs", "-o", "dev", "gg-vol", dir)
	t.Cleanup(func() { _ = exec.Command("nsenter", "--mount="+r.nsFile, "umount", dir).Run() })
	out, err = r.runGPU("bn", "", append(noCgroup, "-v", dir+":/data:nodev")...)
	require.NoError(t, err, out)
	claimsName("bn", dir, false) // bound nodev: no node in it opens

	out, err = r.runGPU("bd", "", append(noCgroup, "-v", dir+":/data")...)
	require.NoError(t, err, out)
	for _, c := range r.state().Claims {
		require.Contains(t, c.Source, "bind source "+dir+" not mounted nodev")
	}
	claimsName("bd", dir, true)

	out, err = r.runGPU("bc", "", "--cap-drop", "MKNOD", "-v", dir+":/data")
	require.NoError(t, err, out)
	require.Empty(t, r.holders(), "in its device cgroup nothing in the directory opens")
}

// podmanUserNSDeviceBundle: a container with a user namespace (--uidmap)
// and a device. crun 1.8 hands its createRuntime hooks the bundle "/" (its
// working directory, not the bundle); the hook reads crun's own copy of the
// spec instead of /config.json. One that names no GPU is admitted; one that
// names GPU 1 claims it, and its poststop (run by podman, with the bundle)
// releases it. runc gives the bundle: the same outcome.
func podmanUserNSDeviceBundle(t *testing.T, r *podmanRig) {
	userns := []string{"--uidmap", "0:0:65536", "--gidmap", "0:0:65536", "--device", "/dev/zero"}
	out, err := r.runGPU("un", "", userns...)
	require.NoError(t, err, "names no GPU: %s", out)
	require.Empty(t, r.holders())

	out, err = r.runGPU("ug", "1", userns...)
	require.NoError(t, err, "names GPU 1: %s", out)
	require.Equal(t, map[int]string{1: r.id("ug")}, r.holders())
	out, err = r.runGPU("ux", "1", userns...)
	require.Error(t, err, "GPU 1 is held: %s", out)
	r.refusal(out, "GPU 1 ("+r.gpu[1]+") is held by container "+r.id("ug")[:12])
	r.mustPodman("rm", "-f", "ux")

	r.mustPodman("stop", "-t", "0", "ug")
	r.waitFor("ug's poststop to release GPU 1", func() bool { return len(r.holders()) == 0 })
}

// podmanFailedCreateThenStart: a container whose create fails after the
// guard's create-runtime hook admitted it (a createContainer hook fails) is
// deleted by the runtime, and podman runs no poststop for it: its claim
// stays. Once the cause is gone, `podman start` creates it again under the
// same id, in the cgroup the runtime names after the id, the one its
// earlier claim records: that start was refused as "held by container
// <its own id>" until an operator released the claim. It is admitted and
// holds the GPU.
func podmanFailedCreateThenStart(t *testing.T, r *podmanRig) {
	// A createContainer hook that fails while the flag file exists, for the
	// containers annotated so.
	flag := filepath.Join(r.base, "fail-create")
	require.NoError(t, os.WriteFile(flag, nil, 0o600))
	failing := filepath.Join(r.hooksDir, "zz-fail-create-while-flag.json")
	doc := fmt.Sprintf(`{"version": "1.0.0", "hook": {"path": "/bin/sh", "args": ["sh", "-c", %q]}, `+
		`"when": {"annotations": {"^gg\\.test/fail-create-while-flag$": "^1$"}}, "stages": ["createContainer"]}`,
		"! test -e "+flag)
	require.NoError(t, os.WriteFile(failing, []byte(doc), 0o644))
	t.Cleanup(func() { require.NoError(t, os.Remove(failing)) })

	out, err := r.runGPU("fs", "1", "--annotation", "gg.test/fail-create-while-flag=1")
	require.Error(t, err, "its createContainer hook fails: %s", out)
	id := r.id("fs")
	claims := r.state().Claims
	require.Len(t, claims, 1, "admitted, then undone without a poststop: the claim stays")
	require.Equal(t, id, claims[0].Owner.ContainerID)
	first := claims[0].Owner
	require.NotEmpty(t, first.Cgroup)

	require.NoError(t, os.Remove(flag))
	out, err = r.podman("start", "fs")
	require.NoError(t, err, "the start is not refused by the claim of its own undone create: %s", out)
	require.Equal(t, "running", r.inspect("fs", "{{.State.Status}}"))
	pid, err := strconv.Atoi(r.inspect("fs", "{{.State.Pid}}"))
	require.NoError(t, err)
	claims = r.state().Claims
	require.Len(t, claims, 1)
	require.Equal(t, r.gpu[1], claims[0].Device.UUID)
	require.Equal(t, id, claims[0].Owner.ContainerID)
	require.Equal(t, pid, claims[0].Owner.Pid, "the claim is the started process's")
	require.Equal(t, first.Cgroup, claims[0].Owner.Cgroup, "in the cgroup the undone create recorded")
	released := releaseReasons(r.audit(), id)
	require.Len(t, released, 1, "the undone create's claim released once")
	require.Contains(t, released[0], "created again (a restart)")

	out, err = r.runGPU("second", "1")
	require.Error(t, err, "GPU 1 is held by the started container: %s", out)
	r.refusal(out, "GPU 1 ("+r.gpu[1]+") is held by container "+id[:12])
}

// releaseReasons are the reasons of the audit's release records of container
// id, oldest first.
func releaseReasons(recs []ledger.AuditRecord, id string) []string {
	var out []string
	for _, rec := range recs {
		if rec.Op == ledger.OpRelease && rec.ContainerID == id {
			out = append(out, rec.Reason)
		}
	}
	return out
}

// podmanOneHook: a host that installs the createRuntime hook alone
// ([hook] poststop = false, no poststop hooks.d file). A GPU container that
// exited keeps its claim (nothing runs after it), and the next container
// asking that GPU is admitted: its request finds the holder's processes gone
// and releases it first. A --restart=on-failure container killed is
// restarted by podman: with no poststop in between, the restart meets its
// predecessor's claim, in the cgroup it runs in itself, and claims the GPU
// again.
func podmanOneHook(t *testing.T, r *podmanRig) {
	defer r.oneHook(t)()
	var extra []string
	if r.runtime == "crun" {
		// In this rig crun runs where /sys/fs/cgroup/unified is unmounted,
		// and "creates" the container's cgroup v2 as a plain directory of
		// the tmpfs below, which its deletion leaves behind with the pid in
		// its cgroup.procs file: read there, the holder would never look
		// exited once crun deleted it (a real host shows no such file).
		// Without a cgroup its liveness goes by its pid
		// (podmanFailedCreateUnderRemove), and, under no device cgroup, it
		// claims every GPU.
		extra = append(extra, "--cgroups=disabled")
	}
	out, err := r.runGPU("done", "1", extra...)
	require.NoError(t, err, out)
	done := r.id("done")
	r.mustPodman("stop", "-t", "5", "done") // the sleeper exits at SIGTERM
	require.Equal(t, "exited", r.inspect("done", "{{.State.Status}}"))
	held := r.holders()
	require.Equal(t, done, held[1], "no poststop: the exited container's claim stays")
	for _, h := range held {
		require.Equal(t, done, h)
	}

	out, err = r.runGPU("next", "1")
	require.NoError(t, err, "done's processes are gone: its claim does not block GPU 1: %s", out)
	next := r.id("next")
	require.Equal(t, map[int]string{1: next}, r.holders())
	recs := r.audit()
	rel := slices.IndexFunc(recs, func(rec ledger.AuditRecord) bool { return rec.Op == ledger.OpRelease && rec.ContainerID == done })
	claim := slices.IndexFunc(recs, func(rec ledger.AuditRecord) bool { return rec.Op == ledger.OpClaim && rec.ContainerID == next })
	require.NotEqual(t, -1, rel, "done released: %+v", recs)
	require.NotEqual(t, -1, claim, "next claimed: %+v", recs)
	require.Less(t, rel, claim, "done's claim ended before next's began")
	require.True(t, strings.HasPrefix(recs[rel].Reason, "holder exited: "), recs[rel].Reason)

	out, err = r.runGPU("rp", "2", "--restart=on-failure:3")
	require.NoError(t, err, out)
	id := r.id("rp")
	_, pid := r.killForRestart("rp")
	var onGPU2 []ledger.Claim
	for _, c := range r.state().Claims {
		if c.Device.UUID == r.gpu[2] {
			onGPU2 = append(onGPU2, c)
		}
	}
	require.Len(t, onGPU2, 1)
	require.Equal(t, id, onGPU2[0].Owner.ContainerID)
	require.Equal(t, pid, onGPU2[0].Owner.Pid, "the claim is the restarted process's, not the killed one's")
	released := releaseReasons(r.audit(), id)
	require.Len(t, released, 1, "the killed incarnation released once, by its restart")
	require.Contains(t, released[0], "created again (a restart)")

	out, err = r.runGPU("second", "2")
	require.Error(t, err, "GPU 2 is held by the restarted container: %s", out)
	r.refusal(out, "GPU 2 ("+r.gpu[2]+") is held by container "+id[:12])
}

// podmanOneHookStatus: on a host that runs the createRuntime hook alone, a
// claim whose container exited is how every claim ends until the next
// request for its GPU: `gpu-guard-ctl status` lists it as exited, ending at
// the next request, and exits 0 (no ATTENTION: it used to report a
// holder-exited problem after every GPU container of such a host). A
// container that opts into the poststop (annotation
// io.nri-gpu-guard.poststop=on, what the shipped mask matches) is released
// at its stop, as on a host with both hooks.
func podmanOneHookStatus(t *testing.T, r *podmanRig) {
	defer r.oneHook(t)()
	out, err := r.runGPU("done", "1")
	require.NoError(t, err, out)
	done := r.id("done")
	r.mustPodman("stop", "-t", "5", "done")
	require.Equal(t, done, r.holders()[1], "no poststop: the exited container's claim stays")

	st, err := r.ctl("status")
	require.NoError(t, err, "status exits 0: %s", st)
	require.NotContains(t, st, "ATTENTION")
	require.Contains(t, st, "held,exited")
	require.Contains(t, st, "EXITED, NO POSTSTOP (1):")
	require.Contains(t, st, "held by "+done[:12])

	out, err = r.runGPU("opted", "2", "--annotation", "io.nri-gpu-guard.poststop=on")
	require.NoError(t, err, out)
	opted := r.id("opted")
	require.Equal(t, opted, r.holders()[2])
	r.mustPodman("stop", "-t", "5", "opted")
	r.waitFor("opted's poststop to release GPU 2", func() bool { _, held := r.holders()[2]; return !held })
	released := releaseReasons(r.audit(), opted)
	require.Len(t, released, 1)
	require.Equal(t, "removed", released[0], "released by its poststop")
}
