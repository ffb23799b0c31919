// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/nri/pkg/api"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/runtimescan"
)

// runcContainer writes runc's state for container id under root (the
// format of a file real runc wrote), whose init is a real process of this
// test, with a bundle whose spec sets env; it returns the owner the OCI
// hook recorded for it.
func runcContainer(t *testing.T, root, id string, env ...string) ledger.Owner {
	t.Helper()
	cmd := exec.Command("sleep", "3600")
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	start, err := liveness.PidStart("/proc", cmd.Process.Pid)
	require.NoError(t, err)

	bundle := filepath.Join(t.TempDir(), id)
	require.NoError(t, os.MkdirAll(bundle, 0o700))
	// podman's default capabilities: a spec without any would leave runc's
	// own (root's) in place, CAP_MKNOD among them (see hook.RunningRequest).
	caps := []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_NET_BIND_SERVICE",
		"CAP_SETFCAP", "CAP_SETGID", "CAP_SETPCAP", "CAP_SETUID", "CAP_SYS_CHROOT"}
	spec, err := json.Marshal(specs.Spec{Version: specs.Version,
		Process: &specs.Process{Env: env, Capabilities: &specs.LinuxCapabilities{Bounding: caps, Effective: caps, Permitted: caps}},
		Linux:   &specs.Linux{CgroupsPath: "/machine.slice/libpod-" + id + ".scope"}})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), spec, 0o600))

	raw, err := os.ReadFile(filepath.Join("..", "runtimestate", "testdata", "runc.state.json"))
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, json.Unmarshal(raw, &m))
	m["id"], m["init_process_pid"], m["init_process_start"] = id, cmd.Process.Pid, start
	m["config"].(map[string]any)["labels"] = []string{"bundle=" + bundle}
	data, err := json.Marshal(m)
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(filepath.Join(root, id), 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(root, id, "state.json"), data, 0o600))
	return ledger.Owner{ContainerID: id, FrontEnd: ledger.FrontEndHook, Pid: cmd.Process.Pid, PidStart: start}
}

// procStat copies the host's /proc/<pid>/stat into the fake procfs root:
// there the process runs, with its start time.
func procStat(t *testing.T, root string, pid int) {
	t.Helper()
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	require.NoError(t, err)
	dir := filepath.Join(root, strconv.Itoa(pid))
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "stat"), stat, 0o644))
}

// On a host where podman runs containers through the OCI hook beside
// containerd's, the daemon finds the ledger with nothing left to recover
// from (every state file gone) and rebuilds it: containerd's holder comes
// back from the runtime's list, and the hook's running container keeps its
// GPU, read from runc's state dir ([hook] runtime_roots), so that a
// newcomer on it is still refused. Before, the rebuild forgot it: nothing
// else would ever bring the claim back. A container of containerd's list
// found in the runtime root too (a CRI-O host) stays the NRI front end's.
func TestDaemonRecoveryKeepsTheHooksRunningContainers(t *testing.T) {
	t.Run("", func(t *testing.T) { daemonRecoveryKeepsTheHooksContainers(t, false, false) })
	// A read of the runtimes' state that fails (it ran past the
	// Synchronize's deadline) fails the recovery, which is tried again:
	// recovering without the hook's containers lost their claims.
	t.Run("first read of the runtimes fails", func(t *testing.T) { daemonRecoveryKeepsTheHooksContainers(t, true, false) })
	// A launched plugin rebuilds in place, answering no request: its read
	// of the runtimes' state gets a budget of its own, not lock_timeout
	// (here 50 ms), which a host with many containers outlasts: every
	// retry then failed, and GPU containers stayed refused.
	t.Run("launched plugin, a read longer than lock_timeout", func(t *testing.T) { daemonRecoveryKeepsTheHooksContainers(t, false, true) })
}

func daemonRecoveryKeepsTheHooksContainers(t *testing.T, failFirstRead, inPlace bool) {
	if inPlace {
		saved := readHookState
		readHookState = func(roots []string, procRoot string, deadline time.Time, guardFor func() (*guard.Guard, error)) (*runtimescan.Result, error) {
			if deadline.IsZero() || time.Until(deadline) < 10*time.Second {
				return nil, errors.New("the runtimes' state was not read in time (a host with many containers)")
			}
			return saved(roots, procRoot, deadline, guardFor)
		}
		t.Cleanup(func() { readHookState = saved })
	}
	if failFirstRead {
		var reads atomic.Int32
		saved := readHookState
		readHookState = func(roots []string, procRoot string, deadline time.Time, guardFor func() (*guard.Guard, error)) (*runtimescan.Result, error) {
			if reads.Add(1) == 1 {
				return nil, errors.New("the runtimes' state was not read in time")
			}
			return saved(roots, procRoot, deadline, guardFor)
		}
		t.Cleanup(func() { readHookState = saved })
	}
	runcRoot := filepath.Join(t.TempDir(), "runc")
	rt := newRuntime(t, func(c *config.Config) {
		c.Hook.RuntimeRoots = []string{runcRoot}
		if inPlace {
			c.Ledger.LockTimeout.Duration = 50 * time.Millisecond
		}
	})
	podA, podB := rt.addPod("a"), rt.addPod("b")
	waitReady := runPluginWith(t, rt, func(p *Plugin) { p.forceInPlace = inPlace })

	holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, holder))
	rt.start(podA, holder, 4242)

	podman := runcContainer(t, runcRoot, "podman-1", "NVIDIA_VISIBLE_DEVICES=2")
	// As on a CRI-O host (whose runc root is /run/runc), the runtime's own
	// container is in the root too: it stays the NRI front end's.
	runcContainer(t, runcRoot, holder.Id, "NVIDIA_VISIBLE_DEVICES=1")
	// Its cgroup, where the daemon's liveness check finds it running.
	cg := filepath.Join(rt.cgroupRoot, "machine.slice", "libpod-podman-1.scope")
	require.NoError(t, os.MkdirAll(cg, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(cg, "cgroup.procs"), fmt.Appendf(nil, "%d\n", podman.Pid), 0o644))
	podman.Cgroup = "/machine.slice/libpod-podman-1.scope"
	// The rebuild reads the runtimes' state on the host's /proc, where the
	// process (this test's sleep) is not in the cgroup its spec names: the
	// adopted claim records no cgroup, and the daemon's liveness check
	// (on the runtime's fake /proc) goes by its pid and start time.
	procStat(t, filepath.Join(rt.dir, "proc"), podman.Pid)
	hookLedger, err := ledger.Open(rt.ledgerDir, ledger.Options{Now: rt.clock.Now})
	require.NoError(t, err)
	gpu2 := devices.Device{UUID: gpuUUID(2), Index: "2", Kind: devices.KindGPU}
	require.NoError(t, hookLedger.Update(context.Background(), func(tx *ledger.Tx) error {
		_, err := tx.Claim("", podman, []devices.Device{gpu2}, "env")
		return err
	}))
	require.Equal(t, map[string]string{"1": holder.Id, "2": "podman-1"}, rt.holders())

	loseLedgerAndRebuild(t, rt, podB, waitReady)

	assert.Equal(t, map[string]string{"1": holder.Id, "2": "podman-1"}, rt.holders(),
		"containerd's holder re-adopted from its list, podman's from runc's state")
	require.ErrorContains(t, rt.create(podB, container(podB, "main", "b-2", "NVIDIA_VISIBLE_DEVICES=2")), "podman-1")
	require.NoError(t, rt.create(podB, container(podB, "main", "b-3", "NVIDIA_VISIBLE_DEVICES=3")))
	st := rt.state()
	fronts := map[string]ledger.FrontEnd{}
	for _, c := range st.Claims {
		fronts[c.Owner.ContainerID] = c.Owner.FrontEnd
		if c.Owner.ContainerID == "podman-1" {
			assert.Equal(t, podman.Pid, c.Owner.Pid, "with the container's init pid")
		}
	}
	assert.Equal(t, map[string]ledger.FrontEnd{holder.Id: ledger.FrontEndNRI, "podman-1": ledger.FrontEndHook, "b-3": ledger.FrontEndNRI}, fronts)
	assert.Empty(t, st.Conflicts, "a container both lists name is not a conflict with itself")
}

// A launched plugin rebuilds in place from the containers it tracks (those
// holding NRI claims), but every container the runtime has shown it is its
// own: on a CRI-O host, whose runc root is a default hook runtime root, an
// exempt GPU agent (NVIDIA_VISIBLE_DEVICES=all, no claim) is in runc's root
// too, and must not become an OCI-hook holder of every GPU.
func TestInPlaceRebuildLeavesTheRuntimesOwnContainersOut(t *testing.T) {
	runcRoot := filepath.Join(t.TempDir(), "runc")
	rt := newRuntime(t, func(c *config.Config) {
		c.Hook.RuntimeRoots = []string{runcRoot}
		c.Policy.ExemptNamespaces = []string{"monitoring"}
	})
	agentPod := rt.addPod("dcgm")
	agentPod.Namespace = "monitoring"
	podB := rt.addPod("b")
	waitReady := runPluginWith(t, rt, func(p *Plugin) { p.forceInPlace = true })

	agent := container(agentPod, "exporter", "exporter-1", "NVIDIA_VISIBLE_DEVICES=all")
	require.NoError(t, rt.create(agentPod, agent))
	rt.start(agentPod, agent, 4243)
	o := runcContainer(t, runcRoot, agent.Id, "NVIDIA_VISIBLE_DEVICES=all")
	cg := filepath.Join(rt.cgroupRoot, "machine.slice", "libpod-exporter-1.scope")
	require.NoError(t, os.MkdirAll(cg, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(cg, "cgroup.procs"), fmt.Appendf(nil, "%d\n", o.Pid), 0o644))
	require.Empty(t, rt.holders(), "exempt: no claim")

	loseLedgerAndRebuild(t, rt, podB, waitReady)

	assert.Empty(t, rt.holders(), "the exempt agent is not a holder")
	assert.NoError(t, rt.create(podB, container(podB, "main", "b-2", "NVIDIA_VISIBLE_DEVICES=3")))
}

// messageLog keeps the messages of the records logged to it.
type messageLog struct {
	mu   sync.Mutex
	msgs []string
}

func (l *messageLog) Enabled(context.Context, slog.Level) bool { return true }
func (l *messageLog) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, r.Message)
	return nil
}
func (l *messageLog) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *messageLog) WithGroup(string) slog.Handler      { return l }

func (l *messageLog) has(substr string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.ContainsFunc(l.msgs, func(m string) bool { return strings.Contains(m, substr) })
}

// A daemon that cannot read any runtime root (a DaemonSet pod, which does not
// mount them) says, when it recovers the ledger, that the OCI hook's
// containers cannot get their claims back, instead of reporting that it
// adopted none.
func TestDaemonRecoveryWithoutRuntimeRootsSaysSo(t *testing.T) {
	rt := newRuntime(t, func(c *config.Config) { c.Hook.RuntimeRoots = []string{filepath.Join(t.TempDir(), "not-mounted")} })
	podA, podB := rt.addPod("a"), rt.addPod("b")
	logs := &messageLog{}
	waitReady := runPluginWith(t, rt, func(p *Plugin) { p.log = slog.New(logs) })

	holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, holder))
	rt.start(podA, holder, 4242)
	loseLedgerAndRebuild(t, rt, podB, waitReady)

	assert.Equal(t, map[string]string{"1": holder.Id}, rt.holders(), "containerd's holder re-adopted from its list")
	assert.True(t, logs.has("none of hook.runtime_roots is readable here"), "the recovery says the hook's containers were not looked for")
	assert.False(t, logs.has("the OCI hook's running containers are adopted"), "no claim of adopting them")
}

// CRI-O runs OCI hooks as well as NRI plugins: when it connects while the
// guard's hooks files are in a directory it reads by default, the plugin
// warns (each GPU container would be checked twice, and exempt containers
// claimed by the hook). containerd, which runs no hooks.d, gets no warning.
func TestWarnsWhenCRIORunsTheHooksToo(t *testing.T) {
	dir := t.TempDir()
	saved := hookDirs
	hookDirs = []string{filepath.Join(dir, "none"), dir}
	t.Cleanup(func() { hookDirs = saved })
	require.NoError(t, os.WriteFile(filepath.Join(dir, "nri-gpu-guard-create-runtime.json"), []byte("{}"), 0o600))

	for _, tc := range []struct {
		runtime string
		warned  bool
	}{{"cri-o", true}, {"containerd", false}} {
		logs := &messageLog{}
		p := &Plugin{log: slog.New(logs)}
		p.warnHooksUnderNRI(tc.runtime)
		assert.Equal(t, tc.warned, logs.has("may also run nri-gpu-guard's OCI hooks"), tc.runtime)
	}
	require.NoError(t, os.Remove(filepath.Join(dir, "nri-gpu-guard-create-runtime.json")))
	logs := &messageLog{}
	(&Plugin{log: slog.New(logs)}).warnHooksUnderNRI("cri-o")
	assert.False(t, logs.has("OCI hooks"), "no hooks files, no warning")

	// In a pod, which mounts none of the hooks directories: it says it
	// cannot check.
	hookDirs = []string{filepath.Join(dir, "none")}
	logs = &messageLog{}
	(&Plugin{log: slog.New(logs)}).warnHooksUnderNRI("cri-o")
	assert.True(t, logs.has("cannot be checked"))
}

// The recovery of a ledger that needs it and the reconcile with the
// runtime's list are two lock holds: an OCI hook admitted between them found
// the GPU of a running NRI container free (the recovered state did not know
// it yet), and two containers shared it. The runtime's containers now go
// into the recovered state's own commit.
func TestRecoveryKnowsTheRuntimesContainersBeforeAnyOtherFrontEnd(t *testing.T) {
	rt := newRuntime(t, nil)
	podA, podB := rt.addPod("a"), rt.addPod("b")
	var hookErr error
	var armed, hooked atomic.Bool
	waitReady := runPluginWith(t, rt, func(p *Plugin) {
		p.afterRecover = func() {
			if !armed.CompareAndSwap(true, false) {
				return
			}
			hooked.Store(true)
			l, err := ledger.Open(rt.ledgerDir, ledger.Options{Now: rt.clock.Now})
			if err != nil {
				hookErr = err
				return
			}
			hookErr = l.Update(context.Background(), func(tx *ledger.Tx) error {
				_, err := tx.Claim("", ledger.Owner{ContainerID: "podman-9", FrontEnd: ledger.FrontEndHook},
					[]devices.Device{{UUID: gpuUUID(1), Index: "1", Kind: devices.KindGPU}}, "env")
				return err
			})
		}
	})
	holder := container(podA, "main", "holder-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, holder))
	rt.start(podA, holder, 4242)
	armed.Store(true) // the recovery to come, not the first Synchronize's

	loseLedgerAndRebuild(t, rt, podB, waitReady)

	require.True(t, hooked.Load())
	var busy *ledger.BusyError
	require.ErrorAs(t, hookErr, &busy, "the hook found GPU 1 held by the running NRI container")
	assert.Equal(t, map[string]string{"1": holder.Id}, rt.holders())
}

// loseLedgerAndRebuild removes every state file of the ledger (as a disk
// lost under it), and waits until the plugin has rebuilt it: the create that
// finds it needing recovery (a container of podB) is refused, deciding
// nothing, and the plugin goes unready, then ready again.
func loseLedgerAndRebuild(t *testing.T, rt *runtime, podB *api.PodSandbox, waitReady func(bool)) {
	t.Helper()
	for _, name := range []string{"ledger.json", "ledger.json.prev", "ledger.journal", "ledger.journal.prev"} {
		if err := os.Remove(filepath.Join(rt.ledgerDir, name)); err != nil {
			require.ErrorIs(t, err, os.ErrNotExist)
		}
	}
	require.Error(t, rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=3")),
		"nothing is decided while the ledger needs recovery")
	waitReady(false)
	waitReady(true)
}
