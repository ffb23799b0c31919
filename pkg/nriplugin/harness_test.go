// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/nri/pkg/adaptation"
	"github.com/containerd/nri/pkg/api"
	nrilog "github.com/containerd/nri/pkg/log"
	"github.com/containerd/nri/pkg/stub"
	"github.com/containerd/ttrpc"
	"github.com/gofrs/flock"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testtmp"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/daemon"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

func gpuUUID(i int) string { return fmt.Sprintf("GPU-6c1a2f2e-0000-4000-8000-%012d", i) }

// TestMain keeps the NRI runtime's own log lines (logrus by default) out of
// the test output.
func TestMain(m *testing.M) {
	nrilog.Set(slogAdapter{log: slog.New(slog.DiscardHandler)})
	os.Exit(testtmp.Main(m))
}

type testClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *testClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }

// runtime is the containerd side: a real NRI adaptation on a unix socket plus
// the pods and containers it would list at Synchronize.
type runtime struct {
	t          testing.TB
	dir        string
	socket     string
	cgroupRoot string
	ledgerDir  string
	cfg        config.Config
	clock      *testClock
	nri        *adaptation.Adaptation

	// deadlines, when set before startPlugin, watches the deadline each
	// handler gives its ledger work (see deadlineProbe).
	deadlines *deadlineProbe

	// plugins are the plugins started (startPlugin): start waits for their
	// start records, which they commit in the background.
	plugins []*plugin
	// running are the plugins runPlugin runs (Run, reconnecting): start
	// waits for their start records too.
	running []*Plugin
	// syncs, when set, receives the plugin's answer to every Synchronize.
	syncs chan error

	mu   sync.Mutex
	pods map[string]*api.PodSandbox
	// listed are the CREATED/RUNNING containers, as containerd lists them.
	listed map[string]*api.Container
	order  []string
}

// deadlineProbe stands between the handlers and decisionContext. It records
// the request's deadline and the deadline the handler's ledger work got and,
// while expiring is set, hands the handler a context whose deadline has
// already passed: the handler then behaves as when the ledger stays locked
// to the end of its budget, without the test racing the runtime's request
// timer against the plugin's margin.
type deadlineProbe struct {
	expiring atomic.Bool

	mu    sync.Mutex
	calls []deadlineCall
}

// deadlineCall is one handler's deadlines.
type deadlineCall struct {
	at              time.Time
	request         time.Time // zero: the request had none
	decision        time.Time
	lockTimeoutUsed time.Duration
}

func (d *deadlineProbe) decisionContext(ctx context.Context, limit time.Duration) (context.Context, context.CancelFunc) {
	at := time.Now()
	dctx, cancel := decisionContext(ctx, limit)
	call := deadlineCall{at: at, lockTimeoutUsed: limit}
	call.request, _ = ctx.Deadline()
	call.decision, _ = dctx.Deadline()
	if !d.expiring.Load() {
		return dctx, cancel
	}
	d.mu.Lock()
	d.calls = append(d.calls, call)
	d.mu.Unlock()
	cancel()
	return context.WithDeadline(ctx, at.Add(-time.Nanosecond))
}

// expired returns the calls made while expiring was set.
func (d *deadlineProbe) expired() []deadlineCall {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.calls)
}

// plugin is one plugin process: a Plugin served by one stub.
type plugin struct {
	p     *Plugin
	stub  stub.Stub
	ready chan struct{}
}

func newRuntime(t testing.TB, mutate func(*config.Config)) *runtime {
	t.Helper()
	// A short path: unix socket paths are limited to ~108 bytes.
	dir, err := os.MkdirTemp("", "gg-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	rt := &runtime{
		t: t, dir: dir, socket: filepath.Join(dir, "nri.sock"),
		cgroupRoot: filepath.Join(dir, "cgroup"), ledgerDir: filepath.Join(dir, "state"),
		clock:  &testClock{now: time.Date(2026, 5, 9, 8, 0, 0, 0, time.UTC)},
		pods:   map[string]*api.PodSandbox{},
		listed: map[string]*api.Container{},
	}
	// A cgroup v2 root.
	require.NoError(t, os.MkdirAll(rt.cgroupRoot, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(rt.cgroupRoot, "cgroup.controllers"), []byte("cpu memory pids\n"), 0o644))

	rt.cfg = config.Default()
	rt.cfg.Ledger.Dir = rt.ledgerDir
	rt.cfg.Devices.Source = config.SourceStatic
	rt.cfg.Devices.ProcRoot = t.TempDir() // fake GPUs: no driver tree to check the list against
	// No runtime of this host: a recovery adopts the hook containers it
	// finds in the runtimes' state roots, and the host's /run/runc holds
	// whatever other tests (or the machine) run at the same time.
	rt.cfg.Hook.RuntimeRoots = []string{t.TempDir()}
	for i := 0; i < 4; i++ {
		rt.cfg.Devices.Static = append(rt.cfg.Devices.Static, config.StaticGPU{Index: i, UUID: gpuUUID(i), Minor: i, Model: "Fake GPU"})
	}
	if mutate != nil {
		mutate(&rt.cfg)
	}
	require.NoError(t, rt.cfg.Validate())

	rt.startNRI()
	return rt
}

// startNRI starts (or, after a Stop, restarts) the runtime side of NRI.
func (rt *runtime) startNRI() {
	rt.t.Helper()
	r, err := adaptation.New("containerd", "v2.2.1", rt.sync,
		func(context.Context, []*api.ContainerUpdate) ([]*api.ContainerUpdate, error) { return nil, nil },
		adaptation.WithPluginPath(filepath.Join(rt.dir, "plugins")),
		adaptation.WithPluginConfigPath(filepath.Join(rt.dir, "conf.d")),
		adaptation.WithSocketPath(rt.socket))
	require.NoError(rt.t, err)
	require.NoError(rt.t, r.Start())
	rt.t.Cleanup(r.Stop)
	rt.nri = r
}

func (rt *runtime) sync(ctx context.Context, cb adaptation.SyncCB) error {
	rt.mu.Lock()
	pods := make([]*api.PodSandbox, 0, len(rt.pods))
	for _, p := range rt.pods {
		pods = append(pods, p)
	}
	ctrs := make([]*api.Container, 0, len(rt.listed))
	for _, id := range rt.order {
		if c, ok := rt.listed[id]; ok {
			ctrs = append(ctrs, c)
		}
	}
	rt.mu.Unlock()
	_, err := cb(ctx, pods, ctrs)
	if rt.syncs != nil {
		rt.syncs <- err
	}
	return err
}

// startPlugin starts a plugin process and waits until the runtime has it
// registered and synchronized.
func (rt *runtime) startPlugin() *plugin {
	rt.t.Helper()
	return rt.startPluginWith(nil)
}

// startPluginWith is startPlugin with a liveness check of the test's own
// (nil = the cgroup tree under rt.cgroupRoot).
func (rt *runtime) startPluginWith(live guard.Liveness) *plugin {
	rt.t.Helper()
	if live == nil {
		live = liveness.New(rt.cgroupRoot, filepath.Join(rt.dir, "proc"))
	}
	b := &daemon.Builder{
		Liveness: live,
		Now:      rt.clock.Now,
		Logger:   slog.New(slog.DiscardHandler),
	}
	pl := &plugin{ready: make(chan struct{}, 1)}
	var err error
	pl.p, err = New(Options{Config: rt.cfg, Setup: b.Setup, Logger: slog.New(slog.DiscardHandler),
		Ready: func(ok bool) {
			if ok {
				select {
				case pl.ready <- struct{}{}:
				default:
				}
			}
		}})
	require.NoError(rt.t, err)
	rt.t.Cleanup(pl.p.halt) // what Run does when it returns
	if rt.deadlines != nil {
		pl.p.decisionCtx = rt.deadlines.decisionContext
	}
	pl.stub, err = stub.New(pl.p, pl.p.stubOptions(Identity{Name: "gpu-guard", Index: "90", Socket: rt.socket}, func() {})...)
	require.NoError(rt.t, err)
	require.NoError(rt.t, pl.stub.Start(context.Background()))
	rt.t.Cleanup(pl.stub.Stop)
	<-pl.ready
	rt.registered()
	rt.plugins = append(rt.plugins, pl)
	return pl
}

// registered waits, once a plugin's Synchronize returned, until the runtime
// has added it to its registry (right after the sync, under the sync lock)
// and has dropped every connection a plugin closed before.
//
// NRI marks a plugin closed only when the close handler of its connection
// has run, on a goroutine of its own, and removes it at the end of the next
// request: a plugin that dropped its connection to reconnect (a resync, a
// restart) can be registered again before that, and the next request relayed
// to the old registration fails with ttrpc.ErrClosed, which also drops it.
// A probe every plugin answers at no cost (the stop of a container no one
// tracks) takes that failure, so that the requests a test checks meet only
// live plugins.
func (rt *runtime) registered() {
	rt.t.Helper()
	rt.nri.BlockPluginSync().Unblock()
	probe := &api.StopContainerRequest{
		Pod:       &api.PodSandbox{Id: "sb-probe", Name: "probe", Uid: "uid-probe", Namespace: "probe"},
		Container: &api.Container{Id: "probe", PodSandboxId: "sb-probe", Name: "probe"},
	}
	// Each failure drops one stale registration; a test has at most a
	// few reconnects behind it.
	for range 8 {
		_, err := rt.nri.StopContainer(context.Background(), probe)
		if !errors.Is(err, ttrpc.ErrClosed) {
			require.NoError(rt.t, err, "the probe of the runtime's plugins")
			return
		}
	}
	rt.t.Fatal("the runtime keeps relaying requests to closed plugin connections")
}

func (rt *runtime) addPod(name string) *api.PodSandbox {
	pod := &api.PodSandbox{Id: "sb-" + name, Name: name, Uid: "uid-" + name, Namespace: "ml"}
	rt.mu.Lock()
	rt.pods[pod.Id] = pod
	rt.mu.Unlock()
	return pod
}

// container builds a container of pod asking for GPUs through env.
func container(pod *api.PodSandbox, name, id string, env ...string) *api.Container {
	return &api.Container{
		Id: id, PodSandboxId: pod.Id, Name: name,
		Env:   append([]string{"PATH=/usr/bin"}, env...),
		Linux: &api.LinuxContainer{CgroupsPath: "/k8s.io/" + id},
	}
}

// create runs CreateContainer as containerd does: state unknown, no pid. On
// success the container is listed as CREATED; on refusal containerd's undo
// sends StopContainer and RemoveContainer for the refused id.
func (rt *runtime) create(pod *api.PodSandbox, c *api.Container) error {
	rt.t.Helper()
	c.State = api.ContainerState_CONTAINER_UNKNOWN
	c.Pid = 0
	_, err := rt.nri.CreateContainer(context.Background(), &api.CreateContainerRequest{Pod: pod, Container: c})
	if err != nil {
		_, serr := rt.nri.StopContainer(context.Background(), &api.StopContainerRequest{Pod: pod, Container: c})
		require.NoError(rt.t, serr)
		require.NoError(rt.t, rt.nri.RemoveContainer(context.Background(), &api.RemoveContainerRequest{Pod: pod, Container: c}))
		return err
	}
	c.State = api.ContainerState_CONTAINER_CREATED
	rt.mu.Lock()
	rt.listed[c.Id] = c
	rt.order = append(rt.order, c.Id)
	rt.mu.Unlock()
	return nil
}

// lockLedger takes the ledger lock as another process would, and returns
// it for the test to let go.
func (rt *runtime) lockLedger() *flock.Flock {
	rt.t.Helper()
	lk := flock.New(filepath.Join(rt.ledgerDir, "ledger.lock"))
	locked, err := lk.TryLock()
	require.NoError(rt.t, err)
	require.True(rt.t, locked, "the ledger lock is free")
	return lk
}

// start starts a created container with pid and a populated cgroup.
func (rt *runtime) start(pod *api.PodSandbox, c *api.Container, pid uint32) {
	rt.t.Helper()
	cg := filepath.Join(rt.cgroupRoot, c.Linux.CgroupsPath)
	require.NoError(rt.t, os.MkdirAll(cg, 0o755))
	require.NoError(rt.t, os.WriteFile(filepath.Join(cg, "cgroup.procs"), fmt.Appendf(nil, "%d\n", pid), 0o644))
	c.State, c.Pid = api.ContainerState_CONTAINER_RUNNING, pid
	require.NoError(rt.t, rt.nri.StartContainer(context.Background(), &api.StartContainerRequest{Pod: pod, Container: c}))
	require.NoError(rt.t, rt.nri.PostStartContainer(context.Background(), &api.PostStartContainerRequest{Pod: pod, Container: c}))
	// The plugins answer at once and commit the start record in the
	// background; a test that reads the ledger next expects to see it.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, pl := range rt.plugins {
		require.NoError(rt.t, pl.p.starts.wait(ctx), "the start record committed")
	}
	for _, p := range rt.running {
		require.NoError(rt.t, p.starts.wait(ctx), "the start record committed")
	}
}

// exit empties the container's cgroup (its processes are gone) without any
// NRI event, and drops it from the runtime's list.
func (rt *runtime) exit(c *api.Container) {
	rt.t.Helper()
	require.NoError(rt.t, os.WriteFile(filepath.Join(rt.cgroupRoot, c.Linux.CgroupsPath, "cgroup.procs"), nil, 0o644))
	rt.unlist(c)
}

func (rt *runtime) unlist(c *api.Container) {
	rt.mu.Lock()
	delete(rt.listed, c.Id)
	rt.mu.Unlock()
}

// stop delivers StopContainer (the task exited) and unlists the container.
func (rt *runtime) stop(pod *api.PodSandbox, c *api.Container) {
	rt.t.Helper()
	c.State = api.ContainerState_CONTAINER_STOPPED
	_, err := rt.nri.StopContainer(context.Background(), &api.StopContainerRequest{Pod: pod, Container: c})
	require.NoError(rt.t, err)
	rt.unlist(c)
}

func (rt *runtime) remove(pod *api.PodSandbox, c *api.Container) {
	rt.t.Helper()
	require.NoError(rt.t, rt.nri.RemoveContainer(context.Background(), &api.RemoveContainerRequest{Pod: pod, Container: c}))
	rt.unlist(c)
}

func (rt *runtime) stopPod(pod *api.PodSandbox) {
	rt.t.Helper()
	require.NoError(rt.t, rt.nri.StopPodSandbox(context.Background(), &api.StopPodSandboxRequest{Pod: pod}))
}

func (rt *runtime) removePod(pod *api.PodSandbox) {
	rt.t.Helper()
	require.NoError(rt.t, rt.nri.RemovePodSandbox(context.Background(), &api.RemovePodSandboxRequest{Pod: pod}))
	rt.mu.Lock()
	delete(rt.pods, pod.Id)
	rt.mu.Unlock()
}

// state reads the ledger as gpu-guard-ctl would.
func (rt *runtime) state() ledger.State {
	rt.t.Helper()
	l, err := ledger.OpenReadOnly(rt.ledgerDir, ledger.Options{Now: rt.clock.Now})
	require.NoError(rt.t, err)
	st, err := l.Snapshot(context.Background())
	require.NoError(rt.t, err)
	return st
}

// holders maps GPU index → holding container id.
func (rt *runtime) holders() map[string]string {
	out := map[string]string{}
	for _, c := range rt.state().Claims {
		out[c.Device.Index] = c.Owner.ContainerID
	}
	return out
}

func (rt *runtime) waiters() []string {
	var out []string
	for _, w := range rt.state().Waiters {
		out = append(out, w.Key)
	}
	return out
}
