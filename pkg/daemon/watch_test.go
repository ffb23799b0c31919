// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/metrics"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

var (
	idA = strings.Repeat("a1", 32) // admitted holder of GPU 0
	idB = strings.Repeat("b2", 32) // created while the plugin was down: no claim
	idC = strings.Repeat("c3", 32)
)

// gpuHost is go-nvml's DGX A100 mock (8 GPUs) with process lists and an Xid
// event stream the test controls, and a fake /proc tree for the pids.
type gpuHost struct {
	t    testing.TB
	srv  *server.Server
	proc string // holds proc/

	mu      sync.Mutex
	procs   map[string][]nvml.ProcessInfo
	block   chan struct{} // when set, listings wait on it
	entered chan struct{}
	events  chan nvml.EventData
}

func newGPUHost(t testing.TB) *gpuHost {
	h := &gpuHost{t: t, srv: dgxa100.New(), proc: t.TempDir(), procs: map[string][]nvml.ProcessInfo{},
		entered: make(chan struct{}, 8), events: make(chan nvml.EventData, 8)}
	require.NoError(t, os.MkdirAll(filepath.Join(h.proc, "proc"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(h.proc, "proc", "uptime"), []byte("1000.00 1.00\n"), 0o644))
	for i := range h.srv.Devices {
		d := h.srv.Devices[i].(*server.Device)
		uuid := d.UUID
		d.GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) {
			h.mu.Lock()
			block := h.block
			h.mu.Unlock()
			if block != nil {
				h.entered <- struct{}{}
				<-block
			}
			h.mu.Lock()
			defer h.mu.Unlock()
			return append([]nvml.ProcessInfo(nil), h.procs[uuid]...), nvml.SUCCESS
		}
		d.GetGraphicsRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.ERROR_NOT_SUPPORTED }
		d.GetSupportedEventTypesFunc = func() (uint64, nvml.Return) { return nvml.EventTypeXidCriticalError, nvml.SUCCESS }
		d.RegisterEventsFunc = func(uint64, nvml.EventSet) nvml.Return { return nvml.SUCCESS }
	}
	h.srv.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) {
		return &mock.EventSet{
			WaitFunc: func(ms uint32) (nvml.EventData, nvml.Return) {
				select {
				case ev := <-h.events:
					return ev, nvml.SUCCESS
				case <-time.After(time.Duration(ms) * time.Millisecond):
					return nvml.EventData{}, nvml.ERROR_TIMEOUT
				}
			},
			FreeFunc: func() nvml.Return { return nvml.SUCCESS },
		}, nvml.SUCCESS
	}
	return h
}

func (h *gpuHost) uuid(i int) string { return h.srv.Devices[i].(*server.Device).UUID }

// run starts pid of container id (cgroup v2, systemd driver) on GPU i.
func (h *gpuHost) run(i, pid int, id string) { h.runOn(h.uuid(i), pid, id) }

// runOn starts pid of container id ("" for a host process; cgroup v2,
// systemd driver) on device uuid.
func (h *gpuHost) runOn(uuid string, pid int, id string) {
	dir := filepath.Join(h.proc, "proc", fmt.Sprint(pid))
	require.NoError(h.t, os.MkdirAll(dir, 0o755))
	stat := fmt.Sprintf("%d (python) S 1 %d %d 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 500 0 0\n", pid, pid, pid)
	require.NoError(h.t, os.WriteFile(filepath.Join(dir, "stat"), []byte(stat), 0o644))
	cg := "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-" + id + ".scope\n"
	if id == "" {
		cg = "0::/user.slice/user-0.slice/session-1.scope\n"
	}
	require.NoError(h.t, os.WriteFile(filepath.Join(dir, "cgroup"), []byte(cg), 0o644))
	h.mu.Lock()
	defer h.mu.Unlock()
	h.procs[uuid] = append(h.procs[uuid], nvml.ProcessInfo{Pid: uint32(pid), UsedGpuMemory: 1 << 30})
}

// runCgroup starts pid on GPU i with cgroup as its /proc/PID/cgroup.
func (h *gpuHost) runCgroup(i, pid int, cgroup string) {
	dir := filepath.Join(h.proc, "proc", fmt.Sprint(pid))
	require.NoError(h.t, os.MkdirAll(dir, 0o755))
	stat := fmt.Sprintf("%d (python) S 1 %d %d 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 500 0 0\n", pid, pid, pid)
	require.NoError(h.t, os.WriteFile(filepath.Join(dir, "stat"), []byte(stat), 0o644))
	require.NoError(h.t, os.WriteFile(filepath.Join(dir, "cgroup"), []byte(cgroup), 0o644))
	h.mu.Lock()
	defer h.mu.Unlock()
	h.procs[h.uuid(i)] = append(h.procs[h.uuid(i)], nvml.ProcessInfo{Pid: uint32(pid), UsedGpuMemory: 1 << 30})
}

// stop ends pid: gone from NVML and from /proc.
func (h *gpuHost) stop(pid int) {
	require.NoError(h.t, os.RemoveAll(filepath.Join(h.proc, "proc", fmt.Sprint(pid))))
	h.mu.Lock()
	defer h.mu.Unlock()
	for u, ps := range h.procs {
		var keep []nvml.ProcessInfo
		for _, p := range ps {
			if int(p.Pid) != pid {
				keep = append(keep, p)
			}
		}
		h.procs[u] = keep
	}
}

// fakeStates records what the policy asks of the guard's device states.
type fakeStates struct {
	mu       sync.Mutex
	cordons  chan [3]string // uuid, source, reason
	cordoned map[string]bool
	sources  map[string]string // the source of each cordon in cordoned
	failing  int               // CordonDevice fails this many more times
	attempts int               // CordonDevice calls
	draining []ledger.Claim
	finished chan [2]string // container id, reason
}

func newFakeStates() *fakeStates {
	return &fakeStates{cordons: make(chan [3]string, 16), finished: make(chan [2]string, 16), cordoned: map[string]bool{},
		sources: map[string]string{}}
}

// CordonDevice records the request (cordons) and, as the ledger does,
// keeps a cordon in force whose source ranks higher (ledger.CordonKept).
func (s *fakeStates) CordonDevice(_ context.Context, uuid, source, reason string) (ledger.Cordon, bool, error) {
	s.mu.Lock()
	s.attempts++
	if s.failing > 0 {
		s.failing--
		s.mu.Unlock()
		return ledger.Cordon{}, false, errors.New("ledger lock busy")
	}
	k := ledger.Cordon{Device: devices.Device{UUID: uuid}, Source: source, Reason: reason, By: guard.ObserverBy}
	old := ledger.Cordon{Device: k.Device, Source: s.sources[uuid]}
	kept := s.cordoned[uuid] && ledger.CordonKept(&old, source)
	if kept {
		k = old
	} else {
		s.cordoned[uuid] = true
		s.sources[uuid] = source
	}
	s.mu.Unlock()
	s.cordons <- [3]string{uuid, source, reason}
	return k, kept, nil
}

func (s *fakeStates) CordonsInForce(context.Context) ([]ledger.Cordon, string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []ledger.Cordon
	for _, uuid := range slices.Sorted(maps.Keys(s.cordoned)) {
		out = append(out, ledger.Cordon{Device: devices.Device{UUID: uuid}, Source: s.sources[uuid]})
	}
	return out, "L1", nil
}

// uncordon is the operator's gpu-guard-ctl uncordon.
func (s *fakeStates) uncordon(uuid string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.cordoned, uuid)
	delete(s.sources, uuid)
}

func (s *fakeStates) Draining(context.Context) ([]ledger.Claim, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]ledger.Claim(nil), s.draining...), nil
}

func (s *fakeStates) FinishDraining(_ context.Context, id, reason string) error {
	s.mu.Lock()
	var keep []ledger.Claim
	for _, c := range s.draining {
		if c.Owner.ContainerID != id {
			keep = append(keep, c)
		}
	}
	s.draining = keep
	s.mu.Unlock()
	s.finished <- [2]string{id, reason}
	return nil
}

// guardFor builds the daemon's guard over a real ledger with the mock's GPUs
// as a static inventory.
func guardFor(t testing.TB, h *gpuHost, edit func(*config.Config)) *guard.Guard {
	cfg := config.Default()
	cfg.Ledger.Dir = t.TempDir()
	cfg.Devices.Source = config.SourceStatic
	cfg.Devices.ProcRoot = t.TempDir() // fake GPUs: no driver tree to check the list against
	for i := range h.srv.Devices {
		cfg.Devices.Static = append(cfg.Devices.Static, config.StaticGPU{Index: i, UUID: h.uuid(i), Minor: i})
	}
	if edit != nil {
		edit(&cfg)
	}
	g, err := (&Builder{}).Setup(context.Background(), cfg)
	require.NoError(t, err)
	return g
}

func admit(t *testing.T, g *guard.Guard, id, ns, pod, ctr string, gpus string) guard.Decision {
	t.Helper()
	d, err := g.Admit(context.Background(), guard.Request{FrontEnd: ledger.FrontEndNRI,
		Owner: ledger.Owner{ContainerID: id, Namespace: ns, Pod: pod, PodUID: pod + "-uid", Container: ctr, FrontEnd: ledger.FrontEndNRI},
		Spec:  devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=" + gpus}}})
	require.NoError(t, err)
	return d
}

func gaugeByIndex(t *testing.T, m *metrics.Metrics, name string) map[string]float64 {
	t.Helper()
	mfs, err := m.Registry().Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, mt := range mf.GetMetric() {
			out[label(mt, "device_index")] = mt.GetGauge().GetValue()
		}
	}
	return out
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// TestUncheckedContainerShowsUpAsIntruder is the observer end to end in the
// daemon: a container admitted through the guard holds GPU 0; a container
// created while the plugin was down (no claim) runs on GPU 0 and on the free
// GPU 3, and a host process on GPU 4. Each shows up, never silently: a log
// line naming pid, container and device, an audit record, the intruders
// gauge, observe.json, and (on_intruder = "cordon") a cordon of the device.
// When the processes leave, the findings clear the same ways. A critical Xid
// makes a device unhealthy and cordons it.
func TestUncheckedContainerShowsUpAsIntruder(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, func(c *config.Config) { c.Observe.OnIntruder = config.IntruderCordon })
	require.Equal(t, guard.Admit, admit(t, g, idA, "ml", "trainer-0", "main", "0").Result)
	h.run(0, 100, idA) // the holder itself: no finding
	h.run(0, 200, idB)
	h.run(3, 201, idB)
	h.run(4, 300, "")

	states := newFakeStates()
	logs := &syncBuffer{}
	m := metrics.New()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	_, reports := startWatch(ctx, t, h, g, states, func(w *Watch) {
		w.Logger = slog.New(slog.NewJSONHandler(logs, nil))
		w.Metrics = m
	}, done)

	testwait.Receive(t, reports, "first report")
	cordons := map[string][3]string{}
	for range 3 {
		c := testwait.Receive(t, states.cordons, "cordon")
		cordons[c[0]] = c
	}
	for _, i := range []int{0, 3, 4} {
		require.Contains(t, cordons, h.uuid(i), "GPU %d cordoned", i)
		assert.Equal(t, "intruder", cordons[h.uuid(i)][1])
	}
	assert.Contains(t, cordons[h.uuid(0)][2], "pid 200 (container "+idB[:12]+")")
	assert.Contains(t, cordons[h.uuid(4)][2], "pid 300 (host process)")

	out := logs.String()
	assert.Contains(t, out, `"msg":"GPU process not admitted by the guard","kind":"intruder","pid":200,"device":"GPU 0 (`+h.uuid(0)+`)"`)
	assert.Contains(t, out, `"container_id":"`+idB+`"`)
	assert.Contains(t, out, `"holder":"`+idA+`"`)
	assert.Contains(t, out, `"pid":300`)
	assert.Contains(t, out, `"container":"host process"`)
	assert.Equal(t, 1, strings.Count(out, `"pid":200,"device"`), "a finding is logged once, not every pass")

	recs, err := ledger.ReadAudit(g.Ledger().AuditPath())
	require.NoError(t, err)
	var intruders []ledger.AuditRecord
	for _, r := range recs {
		if r.Op == OpIntruder {
			intruders = append(intruders, r)
		}
	}
	require.Len(t, intruders, 3)
	byDevice := map[string]ledger.AuditRecord{}
	for _, r := range intruders {
		require.Len(t, r.Devices, 1)
		byDevice[r.Devices[0]] = r
	}
	assert.Equal(t, idB, byDevice[h.uuid(0)].ContainerID)
	assert.Contains(t, byDevice[h.uuid(0)].Reason, "held by ml/trainer-0/main")
	assert.Empty(t, byDevice[h.uuid(4)].ContainerID, "a host process has no container")

	// observe.json and the gauge, after a full pass has been handled.
	testwait.Receive(t, reports, "a later report")
	f, err := observe.ReadFile(g.Ledger().Dir())
	require.NoError(t, err)
	require.Len(t, f.Findings, 3)
	byPID := map[int]observe.FileFinding{}
	for _, ff := range f.Findings {
		byPID[ff.PID] = ff
	}
	assert.Equal(t, observe.KindIntruder, byPID[200].Kind)
	assert.Equal(t, idA, byPID[200].Holder)
	assert.Equal(t, "3", byPID[201].Device.Index)
	assert.False(t, f.Stale(f.Time), "fresh")
	assert.EqualValues(t, 0.001, f.IntervalSeconds)
	assert.Equal(t, map[string]float64{"0": 1, "3": 1, "4": 1}, gaugeByIndex(t, m, "nri_gpu_guard_intruders"))

	// The intruders stop: the findings clear (logged, audited), the gauge
	// and the file empty out.
	h.stop(200)
	h.stop(201)
	h.stop(300)
	for {
		testwait.Receive(t, reports, "report after the stop")
		if f, err = observe.ReadFile(g.Ledger().Dir()); err == nil && len(f.Findings) == 0 {
			break
		}
	}
	assert.Empty(t, gaugeByIndex(t, m, "nri_gpu_guard_intruders"))
	assert.Contains(t, logs.String(), "GPU finding cleared")
	recs, err = ledger.ReadAudit(g.Ledger().AuditPath())
	require.NoError(t, err)
	cleared := 0
	for _, r := range recs {
		if r.Op == OpFindingCleared {
			cleared++
		}
	}
	assert.Equal(t, 3, cleared)

	// A critical Xid on GPU 5: unhealthy, cordoned, audited, counted, shown.
	h.events <- nvml.EventData{Device: h.srv.Devices[5], EventType: nvml.EventTypeXidCriticalError, EventData: 79,
		GpuInstanceId: 0xFFFFFFFF, ComputeInstanceId: 0xFFFFFFFF}
	c := testwait.Receive(t, states.cordons, "unhealthy cordon")
	assert.Equal(t, [2]string{h.uuid(5), "unhealthy"}, [2]string{c[0], c[1]})
	assert.Contains(t, c[2], "critical Xid 79")
	// The health path sets the gauge, then writes observe.json, on its own
	// goroutine: wait for the file, the last of the two.
	for {
		testwait.Receive(t, reports, "report after the Xid")
		if f, err = observe.ReadFile(g.Ledger().Dir()); err == nil && len(f.Unhealthy) == 1 {
			break
		}
	}
	assert.Len(t, gaugeByIndex(t, m, "nri_gpu_guard_unhealthy"), 1)
	assert.Equal(t, "5", f.Unhealthy[0].Device.Index)
	assert.EqualValues(t, 79, f.Unhealthy[0].Xid)

	cancel()
	testwait.Receive(t, done, "Run to return")
	_, err = observe.ReadFile(g.Ledger().Dir())
	require.ErrorIs(t, err, observe.ErrNoFile, "a clean stop removes the report: it would only grow stale")
}

// TestObserverNeverBlocksAdmission: while NVML is stuck in a listing, the
// guard still admits (the observer holds no ledger lock while in NVML).
func TestObserverNeverBlocksAdmission(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	release := make(chan struct{})
	h.mu.Lock()
	h.block = release
	h.mu.Unlock()
	w := NewWatch()
	w.ProcRoot, w.Interval = h.proc, time.Millisecond
	w.OpenNVML = func() (observe.Source, error) { return observe.OpenNVML(h.srv) }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	w.Use(g)

	testwait.Receive(t, h.entered, "a listing stuck in NVML")
	assert.Equal(t, guard.Admit, admit(t, g, idC, "ml", "p", "c", "2").Result)
	h.mu.Lock()
	h.block = nil
	h.mu.Unlock()
	close(release)
}

// TestNoNVMLOneLogLine: without NVML the daemon runs on, says so once, and
// writes no report.
func TestNoNVMLOneLogLine(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	logs := &syncBuffer{}
	opened := make(chan struct{}, 4)
	w := NewWatch()
	w.Logger = slog.New(slog.NewJSONHandler(logs, nil))
	w.OpenNVML = func() (observe.Source, error) {
		opened <- struct{}{}
		return nil, fmt.Errorf("%w: initialise: ERROR_LIBRARY_NOT_FOUND", observe.ErrNVMLUnavailable)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.Run(ctx); close(done) }()
	w.Use(g)
	testwait.Receive(t, opened, "NVML open")
	// Another guard with another [observe] section: NVML is not tried again.
	g2, err := (&Builder{}).Setup(context.Background(), func() config.Config {
		c := g.Config()
		c.Observe.Interval = config.Duration{Duration: 20 * time.Second}
		return c
	}())
	require.NoError(t, err)
	w.Use(g2)
	cancel()
	testwait.Receive(t, done, "Run to return")
	assert.Len(t, opened, 0, "NVML is opened once")
	assert.Equal(t, 1, strings.Count(logs.String(), "GPU observer off: NVML is not available"))
	_, err = observe.ReadFile(g.Ledger().Dir())
	require.ErrorIs(t, err, observe.ErrNoFile)
}

// TestNVMLReopenedAfterCacheFallback: the GPU Operator reboot. The NVML
// library is not there when the daemon starts, so its discovery falls back
// to the cache of an earlier boot and the observer finds no NVML. Once the
// driver is up, Rediscover swaps in what discovery lists (the GPUs the
// cache listed: the usual case) and the observer opens NVML again and
// runs. It used to retry only after an inventory that listed no GPU, so the
// observer (intruders, Xids, the idle check) stayed off until a restart. A
// reconnect with the same inventory does not try NVML again.
func TestNVMLReopenedAfterCacheFallback(t *testing.T) {
	h := newGPUHost(t)
	cfg := lateDriverHost(t)
	gpu := devices.GPU{Index: 0, UUID: h.uuid(0), Minor: 0, BusID: "0000:3b:00.0"}
	prev, err := devices.NewInventory("nvml", []devices.GPU{gpu})
	require.NoError(t, err)
	require.NoError(t, devices.SaveCache(filepath.Join(cfg.Ledger.Dir, devices.CacheFile), prev, "an-earlier-boot"))
	nvmlLib, timer := &lateNVML{unavailable: true, gpus: []devices.GPU{gpu}}, newManualTimer()
	b := &Builder{NVML: nvmlLib, After: timer.after}
	g, err := b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	require.Equal(t, []devices.GPU{gpu}, g.Inventory().GPUs, "the cache fallback")

	opens := make(chan error, 8)
	reports := make(chan struct{}, 64)
	w := NewWatch()
	w.ProcRoot, w.Interval = h.proc, time.Millisecond
	w.OpenNVML = func() (observe.Source, error) {
		if !nvmlLib.up.Load() {
			err := fmt.Errorf("%w: initialise: ERROR_LIBRARY_NOT_FOUND", observe.ErrNVMLUnavailable)
			opens <- err
			return nil, err
		}
		opens <- nil
		return observe.OpenNVML(h.srv)
	}
	w.afterReport = func() {
		select {
		case reports <- struct{}{}:
		default:
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	w.Use(g)
	require.Error(t, testwait.Receive(t, opens, "first NVML open"))

	swapped, _ := runRediscover(t, b)
	testwait.Receive(t, timer.waits, "a wait")
	nvmlLib.up.Store(true)
	timer.fire <- time.Time{}
	sg := testwait.Receive(t, swapped, "the swap")
	require.Same(t, g, sg)
	require.Equal(t, []devices.GPU{gpu}, g.Inventory().GPUs, "discovery lists the GPU the cache did")
	w.Use(sg)
	require.NoError(t, testwait.Receive(t, opens, "NVML opened again after the swap"))
	testwait.Receive(t, reports, "pass of the observer")
	f, err := observe.ReadFile(cfg.Ledger.Dir)
	require.NoError(t, err, "observe.json")
	assert.False(t, f.Time.IsZero(), "observe.json shows a pass")

	// A reconnect over the same inventory keeps the observer: once a pass
	// ran under the new guard, NVML was not opened again.
	g2, err := b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	w.Use(g2)
	for pass := 0; w.guard() != g2; pass++ {
		require.Less(t, pass, 1000, "the reconnect's guard was never taken")
		testwait.Receive(t, reports, "a pass after the reconnect")
	}
	testwait.Receive(t, reports, "a pass under the reconnect's guard")
	cancel()
	testwait.Receive(t, done, "Run to return")
	assert.Empty(t, opens, "NVML is not tried again at a reconnect")
}

// TestDrainingReleasedWhenIdleOrAfterGrace: under release_requires_idle, a
// draining holder still on its device stays; once its processes left, it is
// released "idle"; one still there past idle_grace is released anyway with
// the reason naming the pid and the device.
func TestDrainingReleasedWhenIdleOrAfterGrace(t *testing.T) {
	h := newGPUHost(t)
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	g := guardFor(t, h, func(c *config.Config) { c.Observe.ReleaseRequiresIdle = true })
	cfg := g.Config()
	h.run(0, 100, idA)
	h.run(2, 300, idC)
	claim := func(i int, id string, stopped time.Time) ledger.Claim {
		return ledger.Claim{Device: devices.Device{UUID: h.uuid(i), Index: fmt.Sprint(i), Kind: devices.KindGPU},
			Owner: ledger.Owner{ContainerID: id, Namespace: "ml", Pod: "p", Container: "c", StoppedAt: stopped, DrainingSince: stopped}}
	}
	states := newFakeStates()
	states.draining = []ledger.Claim{
		claim(0, idA, now.Add(-5*time.Second)), // within the grace
		claim(2, idC, now.Add(-2*time.Minute)), // past the 1m default grace
	}
	src, err := observe.OpenNVML(h.srv)
	require.NoError(t, err)
	defer func() { _ = src.Close() }()
	o, err := observe.New(observe.Options{Source: src, GPUs: g.Inventory().GPUs, ProcRoot: h.proc,
		Ledger: observe.LedgerFunc(func() ([]observe.Holding, error) { return nil, nil })})
	require.NoError(t, err)
	w := NewWatch()
	w.Now = func() time.Time { return now }
	w.States = func(*guard.Guard) DeviceStates { return states }
	w.g = g
	ctx := context.Background()

	w.drainOnce(ctx, cfg, o)
	fin := testwait.Receive(t, states.finished, "grace release")
	assert.Equal(t, idC, fin[0])
	assert.Contains(t, fin[1], "idle grace 1m0s expired")
	assert.Contains(t, fin[1], "pid 300 still on GPU 2 ("+h.uuid(2)+")")
	assert.Len(t, states.finished, 0, "the holder within its grace and still on its GPU stays")

	h.stop(100)
	w.drainOnce(ctx, cfg, o)
	assert.Equal(t, [2]string{idA, "idle"}, testwait.Receive(t, states.finished, "idle release"))

	// Without NVML only the grace applies.
	states.draining = []ledger.Claim{claim(1, idB, now.Add(-5*time.Second))}
	w.drainOnce(ctx, cfg, nil)
	assert.Len(t, states.finished, 0)
	now = now.Add(time.Minute)
	w.drainOnce(ctx, cfg, nil)
	fin = testwait.Receive(t, states.finished, "grace release without NVML")
	assert.Contains(t, fin[1], "NVML is not available")
}

// TestDrainingReleasedWhileNVMLHangs: an idle check that NVML does not
// answer is bounded (maxIdleCheck, or the drain period when shorter, as
// here): the claims past their grace are released, naming why, the hang is
// logged naming the device, and drainOnce returns while NVML still hangs. Before, it waited for NVML forever and so
// did the claims.
func TestDrainingReleasedWhileNVMLHangs(t *testing.T) {
	h := newGPUHost(t)
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	g := guardFor(t, h, func(c *config.Config) { c.Observe.ReleaseRequiresIdle = true })
	cfg := g.Config()
	claim := func(i int, id string) ledger.Claim {
		return ledger.Claim{Device: devices.Device{UUID: h.uuid(i), Index: fmt.Sprint(i), Kind: devices.KindGPU},
			Owner: ledger.Owner{ContainerID: id, StoppedAt: now.Add(-2 * time.Minute), DrainingSince: now.Add(-2 * time.Minute)}}
	}
	states := newFakeStates()
	states.draining = []ledger.Claim{claim(2, idC), claim(3, idB)} // both past the 1m grace
	src, err := observe.OpenNVML(h.srv)
	require.NoError(t, err)
	o, err := observe.New(observe.Options{Source: src, GPUs: g.Inventory().GPUs, ProcRoot: h.proc,
		Ledger: observe.LedgerFunc(func() ([]observe.Holding, error) { return nil, nil })})
	require.NoError(t, err)
	logs := &syncBuffer{}
	w := NewWatch()
	w.Logger = slog.New(slog.NewJSONHandler(logs, nil))
	w.Now = func() time.Time { return now }
	w.Interval = 10 * time.Millisecond // the drain period, shorter than maxIdleCheck: the bound of an idle check
	w.States = func(*guard.Guard) DeviceStates { return states }
	w.g = g

	block := make(chan struct{})
	h.mu.Lock()
	h.block = block
	h.mu.Unlock()
	t.Cleanup(func() {
		close(block) // NVML returns; the listing given up on leaves it, then NVML closes
		require.NoError(t, src.Close())
	})
	done := make(chan struct{})
	go func() { w.drainOnce(context.Background(), cfg, o); close(done) }()
	for _, id := range []string{idC, idB} {
		fin := testwait.Receive(t, states.finished, "grace release while NVML hangs")
		assert.Equal(t, id, fin[0])
		assert.Contains(t, fin[1], "idle grace 1m0s expired")
		assert.Contains(t, fin[1], observe.ErrNVMLSlow.Error())
	}
	testwait.Receive(t, done, "drainOnce to return while NVML hangs")
	assert.Contains(t, logs.String(), "NVML did not answer the idle check in time")
	assert.Contains(t, logs.String(), `"device":"GPU 2 (`+h.uuid(2)+`)"`)
	assert.Equal(t, 1, strings.Count(logs.String(), "NVML did not answer the idle check in time"),
		"the next holder's check is not tried while NVML hangs")
}

// TestNestedContainerIsTheHolders: under the systemd cgroup driver the
// runtime records the holder's cgroup as "slice:prefix:name". A container
// nested in the holder (docker-in-docker) runs in a cgroup below the
// holder's, which names its own id: it is the holder's process, no
// intruder, and it keeps the holder's draining claim from being released as
// idle. The watch used to drop that form of the cgroup, so the nested
// process was an intruder (and under on_intruder = "cordon" its GPU was
// cordoned) and the draining claim read as idle while it ran.
func TestNestedContainerIsTheHolders(t *testing.T) {
	h := newGPUHost(t)
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	g := guardFor(t, h, func(c *config.Config) { c.Observe.ReleaseRequiresIdle = true })
	h.runCgroup(2, 400, "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1234.slice/cri-containerd-"+
		idA+".scope/docker/"+idC+"\n")
	claim := ledger.Claim{Device: devices.Device{UUID: h.uuid(2), Index: "2", Kind: devices.KindGPU},
		Owner: ledger.Owner{ContainerID: idA, Namespace: "ml", Pod: "dind", Container: "c",
			Cgroup:    "kubepods-besteffort-pod1234.slice:cri-containerd:" + idA,
			StoppedAt: now.Add(-5 * time.Second), DrainingSince: now.Add(-5 * time.Second)}}

	hold := HoldingOf(claim)
	assert.Equal(t, "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1234.slice/cri-containerd-"+idA+".scope",
		hold.CgroupPath)
	src, err := observe.OpenNVML(h.srv)
	require.NoError(t, err)
	defer func() { _ = src.Close() }()
	o, err := observe.New(observe.Options{Source: src, GPUs: g.Inventory().GPUs, ProcRoot: h.proc,
		Ledger: observe.LedgerFunc(func() ([]observe.Holding, error) { return []observe.Holding{HoldingOf(claim)}, nil })})
	require.NoError(t, err)
	r, err := o.Account(context.Background())
	require.NoError(t, err)
	assert.Empty(t, r.Problems(), "the nested container's process is the holder's")

	states := newFakeStates()
	states.draining = []ledger.Claim{claim}
	w := NewWatch()
	w.Now = func() time.Time { return now }
	w.States = func(*guard.Guard) DeviceStates { return states }
	w.g = g
	w.drainOnce(context.Background(), g.Config(), o)
	assert.Empty(t, states.finished, "the holder's nested process still runs on its GPU: not idle")
	res, err := o.Idle(context.Background(), HoldingOf(claim))
	require.NoError(t, err)
	assert.False(t, res.Idle)
}

// TestFindingsWaitForSynchronize: until the plugin has synchronized with the
// runtime, a container created while it was down has not been adopted yet;
// its process must not be taken for an intruder (nor its device cordoned).
// Once ready, the same process is judged.
func TestFindingsWaitForSynchronize(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, func(c *config.Config) { c.Observe.OnIntruder = config.IntruderCordon })
	h.run(2, 200, idB)
	states := newFakeStates()
	refused := make(chan struct{}, 64)
	w, reports, stop := runWatch(t, h, g, states, func(w *Watch) {
		w.SetReady(false)
		w.refused = func() {
			select {
			case refused <- struct{}{}:
			default:
			}
		}
	})
	defer stop()

	for range 3 {
		testwait.Receive(t, refused, "a pass refused the ledger before Synchronize")
	}
	assert.Empty(t, reports, "no report before Synchronize")
	assert.Empty(t, states.cordons, "nothing cordoned before Synchronize")
	f, err := observe.ReadFile(g.Ledger().Dir())
	require.NoError(t, err)
	assert.Empty(t, f.Findings)

	w.SetReady(true)
	c := testwait.Receive(t, states.cordons, "cordon once synchronized")
	assert.Equal(t, h.uuid(2), c[0])
}

// passResult is the outcome of one accounting pass.
type passResult struct {
	r   observe.Report
	err error
}

// syncRaceSetup is a watch over g (on_intruder = "cordon") whose observer's
// NVML listings block on the returned channel until it is closed, with idB's
// process on GPU 2 and no claim for it in the ledger: a container the
// plugin adopts at its Synchronize.
func syncRaceSetup(t *testing.T) (h *gpuHost, g *guard.Guard, w *Watch, o *observe.Observer, states *fakeStates, release chan struct{}) {
	t.Helper()
	h = newGPUHost(t)
	g = guardFor(t, h, func(c *config.Config) { c.Observe.OnIntruder = config.IntruderCordon })
	h.run(2, 200, idB)
	states = newFakeStates()
	w = watchOver(g, nil)
	w.States = func(*guard.Guard) DeviceStates { return states }
	w.reported = map[string]observe.FileFinding{}
	src, err := observe.OpenNVML(h.srv)
	require.NoError(t, err)
	release = make(chan struct{})
	h.mu.Lock()
	h.block = release
	h.mu.Unlock()
	t.Cleanup(func() {
		h.mu.Lock()
		h.block = nil
		h.mu.Unlock()
		select {
		case <-release:
		default:
			close(release)
		}
		_ = src.Close()
	})
	ctx := context.Background()
	o, err = observe.New(observe.Options{Source: src, GPUs: g.Inventory().GPUs, ProcRoot: h.proc,
		Ledger: observe.EpochLedgerFunc(func() ([]observe.Holding, uint64, error) { return w.holdingsAt(ctx) })})
	require.NoError(t, err)
	return h, g, w, o, states, release
}

// adopt is the plugin's Synchronize adopting idB's container on GPU 2.
func adopt(t *testing.T, g *guard.Guard) {
	t.Helper()
	require.Equal(t, guard.Admit, admit(t, g, idB, "ml", "late", "main", "2").Result)
}

// accountAndHandle runs one pass and hands its report to the policy, as
// the observer's Run does.
func accountAndHandle(t *testing.T, w *Watch, o *observe.Observer, g *guard.Guard) {
	t.Helper()
	r, err := o.Account(context.Background())
	require.NoError(t, err)
	w.onReport(context.Background(), g.Config(), r)
}

// TestPassNotReadWhileNotReady: a pass used to read the ledger while the
// plugin was not ready (daemon start before the first Synchronize, a
// reconnect, a rebuild in place after the ledger was started afresh), then
// wait in NVML while Synchronize adopted the runtime's containers and set
// the plugin ready; its report then arrived as "ready", and every running
// GPU container the view lacked was an intruder, its GPU cordoned for good.
// Now a pass is refused the ledger until the plugin is ready.
func TestPassNotReadWhileNotReady(t *testing.T) {
	h, g, w, o, states, release := syncRaceSetup(t)
	w.SetReady(false)
	results := make(chan passResult, 1)
	go func() {
		r, err := o.Account(context.Background())
		results <- passResult{r, err}
	}()
	var res passResult
	got := false
	select {
	case <-h.entered: // the pass read the ledger, and is in NVML
	case res = <-results:
		got = true
	}
	adopt(t, g)
	w.SetReady(true)
	h.mu.Lock()
	h.block = nil
	h.mu.Unlock()
	close(release)
	if !got {
		res = testwait.Receive(t, results, "the pass")
	}
	if res.err == nil {
		w.onReport(context.Background(), g.Config(), res.r)
	}
	assert.Empty(t, states.cordons, "nothing cordoned")
	require.ErrorIs(t, res.err, observe.ErrLedgerNotReady)

	for range 2 {
		accountAndHandle(t, w, o, g)
	}
	assert.Empty(t, states.cordons, "the adopted container is its GPU's holder")
	w.mu.Lock()
	assert.Empty(t, w.reported)
	w.mu.Unlock()
}

// TestReportReadBeforeResyncIsDropped: a pass reads the ledger while the
// plugin is ready, then waits in NVML; meanwhile the plugin loses its
// runtime and synchronizes again, adopting a container the pass's view
// lacks. The report, read in the earlier readiness epoch, used to be acted
// on (the plugin being ready when it arrived): the adopted container's
// process was an intruder and its GPU was cordoned. It is dropped now, and
// the next passes read the ledger afresh.
func TestReportReadBeforeResyncIsDropped(t *testing.T) {
	h, g, w, o, states, release := syncRaceSetup(t)
	results := make(chan passResult, 1)
	go func() {
		r, err := o.Account(context.Background())
		results <- passResult{r, err}
	}()
	testwait.Receive(t, h.entered, "the pass in NVML, its ledger view read")
	w.SetReady(false) // the runtime restarted
	adopt(t, g)       // Synchronize
	w.SetReady(true)
	h.mu.Lock()
	h.block = nil
	h.mu.Unlock()
	close(release)
	res := testwait.Receive(t, results, "the pass")
	require.NoError(t, res.err)
	require.Len(t, res.r.Problems(), 1, "the view read before Synchronize lacks idB's claim")
	w.onReport(context.Background(), g.Config(), res.r)
	assert.Empty(t, states.cordons, "a report read before the last Synchronize is not acted on")

	for range 2 {
		accountAndHandle(t, w, o, g)
	}
	assert.Empty(t, states.cordons)
	w.mu.Lock()
	assert.Empty(t, w.reported)
	w.mu.Unlock()
}

// TestPassAfterAnotherProcessStartedTheLedgerAfresh: an operator's
// `gpu-guard-ctl recover --reset` starts the ledger afresh; the plugin, still
// ready, learns it only at its next write. A pass reading the fresh state in
// between saw the running holders missing and took their processes for
// intruders (their GPUs cordoned for good). A state of another lineage than
// the one the plugin synchronized with is refused like an unready plugin.
func TestPassAfterAnotherProcessStartedTheLedgerAfresh(t *testing.T) {
	h, g, w, o, states, release := syncRaceSetup(t)
	h.mu.Lock()
	h.block = nil
	h.mu.Unlock()
	close(release)
	adopt(t, g) // idB holds GPU 2, where its process runs
	st, err := g.Ledger().Snapshot(context.Background())
	require.NoError(t, err)
	g.Ledger().RequireLineage(st.Lineage) // what Synchronize does
	accountAndHandle(t, w, o, g)
	require.Empty(t, states.cordons)

	other, err := ledger.Open(g.Config().Ledger.Dir, ledger.Options{})
	require.NoError(t, err)
	_, err = other.Reset(context.Background(), "test: started afresh by an operator")
	require.NoError(t, err)

	_, err = o.Account(context.Background())
	require.ErrorIs(t, err, observe.ErrLedgerNotReady, "the pass reads no holders from a state the plugin has not rebuilt")
	require.ErrorIs(t, err, ledger.ErrLineageChanged)
	assert.Empty(t, states.cordons, "nothing cordoned")
}

// The observer's view holds the exempt containers the plugin reports, as
// holdings of any device, next to the claims.
func TestWatchHoldingsCarryExemptContainers(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	require.Equal(t, guard.Admit, admit(t, g, idA, "ml", "trainer-0", "main", "0").Result)
	w := watchOver(g, nil)
	exempt := func() []string {
		t.Helper()
		hs, err := w.holdings(context.Background())
		require.NoError(t, err)
		var ids []string
		claims := 0
		for _, h := range hs {
			if h.AnyDevice {
				assert.Empty(t, h.DeviceUUID)
				ids = append(ids, h.ContainerID)
			} else {
				claims++
			}
		}
		assert.Equal(t, 1, claims, "the claim is there too")
		slices.Sort(ids)
		return ids
	}
	assert.Empty(t, exempt())
	w.SetExempt(idB, "", true)
	assert.Equal(t, []string{idB}, exempt())
	w.ResetExempt(map[string]string{idC: ""})
	assert.Equal(t, []string{idC}, exempt())
	w.SetExempt(idC, "", false)
	assert.Empty(t, exempt())
}

// A container nested in a container of an exempt namespace (a monitoring
// agent that runs its own containers) is that container's too: exempt
// containers reach the observer with their cgroup, and a process below it is
// theirs. Without it, the nested container's id was an intruder.
func TestNestedInAnExemptContainerIsExempt(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	h.runCgroup(3, 410, "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod77.slice/cri-containerd-"+
		idB+".scope/docker/"+idC+"\n")
	w := watchOver(g, nil)
	w.SetExempt(idB, "kubepods-burstable-pod77.slice:cri-containerd:"+idB, true)
	src, err := observe.OpenNVML(h.srv)
	require.NoError(t, err)
	defer func() { _ = src.Close() }()
	o, err := observe.New(observe.Options{Source: src, GPUs: g.Inventory().GPUs, ProcRoot: h.proc,
		Ledger: observe.LedgerFunc(func() ([]observe.Holding, error) { return w.holdings(context.Background()) })})
	require.NoError(t, err)
	r, err := o.Account(context.Background())
	require.NoError(t, err)
	assert.Empty(t, r.Problems(), "the nested container's process is the exempt container's")
}

// failingCordonWatch runs a watch whose first cordon write fails, after its
// first report.
func failingCordonWatch(t *testing.T) (*gpuHost, *Watch, chan struct{}, *fakeStates) {
	t.Helper()
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	states := newFakeStates()
	states.failing = 1
	w, reports, stop := runWatch(t, h, g, states, nil)
	t.Cleanup(stop)
	testwait.Receive(t, reports, "first report")
	return h, w, reports, states
}

// An unhealthy GPU whose cordon could not be written is cordoned at a later
// pass; one the operator uncordoned is forgotten, so that its next critical
// Xid cordons it again (it was reported once per device for the life of the
// observer, so an uncordoned GPU that failed again took claims).
func TestUnhealthyCordonRetriedAndRenewedAfterUncordon(t *testing.T) {
	h, w, reports, states := failingCordonWatch(t)

	xid := func(n uint64) {
		h.events <- nvml.EventData{Device: h.srv.Devices[5], EventType: nvml.EventTypeXidCriticalError, EventData: n,
			GpuInstanceId: 0xFFFFFFFF, ComputeInstanceId: 0xFFFFFFFF}
	}
	xid(79) // its cordon fails once ...
	c := testwait.Receive(t, states.cordons, "the cordon, retried at a later pass")
	assert.Equal(t, [2]string{h.uuid(5), "unhealthy"}, [2]string{c[0], c[1]})
	assert.Contains(t, c[2], "critical Xid 79")

	states.uncordon(h.uuid(5)) // the operator, at once
	for pass := 0; ; pass++ {
		require.Less(t, pass, 100, "the uncordon was never taken for the operator's")
		testwait.Receive(t, reports, "a pass after the uncordon")
		w.mu.Lock()
		n := len(w.unhealthy)
		w.mu.Unlock()
		if n == 0 {
			break
		}
	}
	xid(48) // fails again
	c = testwait.Receive(t, states.cordons, "cordoned again")
	assert.Equal(t, h.uuid(5), c[0])
	assert.Contains(t, c[2], "Xid 48")
}

// An unhealthy GPU whose cordon could not be written is cordoned at a later
// pass also while the plugin is not ready (before its first Synchronize, or
// through a rebuild that keeps failing): those passes read no ledger view,
// and the retry used to wait for a report, while the OCI hooks of the host
// kept admitting containers onto the GPU.
func TestUnhealthyCordonRetriedWhileNotReady(t *testing.T) {
	h, w, _, states := failingCordonWatch(t)
	w.SetReady(false)

	h.events <- nvml.EventData{Device: h.srv.Devices[5], EventType: nvml.EventTypeXidCriticalError, EventData: 79,
		GpuInstanceId: 0xFFFFFFFF, ComputeInstanceId: 0xFFFFFFFF}
	c := testwait.Receive(t, states.cordons, "the cordon, retried at a later pass while not ready")
	assert.Equal(t, [2]string{h.uuid(5), "unhealthy"}, [2]string{c[0], c[1]})
}

// A MIG instance that vanished from NVML (its GPU repartitioned) is recorded
// as unhealthy but not cordoned: a cordon on it would block its whole GPU
// until the next reboot. A vanished GPU is cordoned.
func TestVanishedMIGInstanceIsNotCordoned(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	states := newFakeStates()
	w := watchOver(g, nil)
	w.States = func(*guard.Guard) DeviceStates { return states }
	ctx := context.Background()
	mig := observe.Finding{Kind: observe.KindUnhealthy, Vanished: true, Message: "gone",
		Device: observe.Device{UUID: "MIG-00000000-0000-4000-8000-000000000001", Index: "5:0", ParentUUID: h.uuid(5)}}
	gpu := observe.Finding{Kind: observe.KindUnhealthy, Vanished: true, Message: "gone",
		Device: observe.Device{UUID: h.uuid(6), Index: "6"}}
	w.onUnhealthy(ctx, mig)
	w.onUnhealthy(ctx, gpu)
	c := testwait.Receive(t, states.cordons, "the vanished GPU's cordon")
	assert.Equal(t, h.uuid(6), c[0])
	select {
	case c := <-states.cordons:
		t.Fatalf("unexpected cordon %v", c)
	default:
	}
	forgot := 0
	w.settleUnhealthy(ctx, forgetting(func(string) bool { forgot++; return true }))
	assert.Zero(t, forgot, "the MIG instance is not taken for one the operator uncordoned")
	w.mu.Lock()
	assert.Len(t, w.unhealthy, 2, "both stay recorded as unhealthy")
	w.mu.Unlock()
}

// damageLedger makes every state file of g's ledger unreadable, so that
// only an empty start (AllowEmpty) recovers.
func damageLedger(t *testing.T, g *guard.Guard) {
	t.Helper()
	for _, n := range []string{"ledger.json", "ledger.json.prev", "ledger.journal", "ledger.journal.prev"} {
		p := filepath.Join(g.Ledger().Dir(), n)
		if _, err := os.Stat(p); err == nil {
			require.NoError(t, os.WriteFile(p, []byte("junk"), 0o600))
		}
	}
}

// operatorUncordon is `gpu-guard-ctl uncordon` of a device that is cordoned.
func operatorUncordon(t *testing.T, g *guard.Guard, uuid string) {
	t.Helper()
	_, was, err := g.Uncordon(context.Background(), uuid, "operator", nil)
	require.NoError(t, err)
	require.True(t, was)
}

// resetLedger is `gpu-guard-ctl recover --reset`: a new lineage, no cordon
// of the observer (only an operator's is kept).
func resetLedger(t *testing.T, g *guard.Guard) {
	t.Helper()
	_, err := g.Ledger().Reset(context.Background(), "the host's containers were all stopped")
	require.NoError(t, err)
}

// cordonedIn reports whether g's ledger holds a cordon on uuid.
func cordonedIn(t *testing.T, g *guard.Guard, uuid string) bool {
	t.Helper()
	st, err := g.Ledger().Snapshot(context.Background())
	require.NoError(t, err)
	for _, k := range st.Cordons {
		if k.Device.UUID == uuid {
			return true
		}
	}
	return false
}

// lineageCase is a change of the ledger between two passes of the
// observer's policy, after it wrote a cordon: whether the cordon is to be
// written again (lost with the state) or left lifted (the operator's), and
// whether the NRI plugin's fence refuses the first write again.
type lineageCase struct {
	name      string
	between   func(t *testing.T, g *guard.Guard, uuid string)
	recordon  bool
	fenceOnce bool
}

// lineageCases are the ways an observer's cordon goes missing.
func lineageCases() []lineageCase {
	return []lineageCase{
		{name: "operator uncordon", between: operatorUncordon},
		{name: "reset", recordon: true, between: func(t *testing.T, g *guard.Guard, _ string) { resetLedger(t, g) }},
		{name: "recovery from nothing (AllowEmpty)", recordon: true, between: func(t *testing.T, g *guard.Guard, _ string) {
			damageLedger(t, g)
			rep, err := g.Ledger().Recover(context.Background(), ledger.RecoverOptions{AllowEmpty: true, Reason: "NRI sync"})
			require.NoError(t, err)
			require.True(t, rep.Empty)
		}},
		{name: "reset, re-cordon refused until the plugin rebuilt", recordon: true, fenceOnce: true,
			between: func(t *testing.T, g *guard.Guard, _ string) {
				st, err := g.Ledger().Snapshot(context.Background())
				require.NoError(t, err)
				g.Ledger().RequireLineage(st.Lineage) // as the NRI plugin fences
				resetLedger(t, g)
			}},
		// Nothing tells this from a lost cordon: the safe side is a cordon
		// the operator lifts again.
		{name: "uncordon, then reset before the pass", recordon: true, between: func(t *testing.T, g *guard.Guard, uuid string) {
			operatorUncordon(t, g, uuid)
			resetLedger(t, g)
		}},
	}
}

// lastAudit is the last record of g's audit log.
// assertCordonedAgain checks that the cordon on uuid was written again
// because the ledger lost it: the log line, and the last audit record a
// cordon whose reason says why and carries the finding's detail.
func assertCordonedAgain(t *testing.T, g *guard.Guard, logs *syncBuffer, uuid, logLine, detail string) {
	t.Helper()
	assert.Contains(t, logs.String(), logLine)
	last := lastAudit(t, g)
	assert.Equal(t, ledger.OpCordon, last.Op)
	assert.Equal(t, []string{uuid}, last.Devices)
	assert.Contains(t, last.Reason, "cordoned again (the ledger was started afresh")
	assert.Contains(t, last.Reason, detail)
}

func lastAudit(t *testing.T, g *guard.Guard) ledger.AuditRecord {
	t.Helper()
	recs, err := ledger.ReadAudit(g.Ledger().AuditPath())
	require.NoError(t, err)
	require.NotEmpty(t, recs)
	return recs[len(recs)-1]
}

// watchOver is a Watch that decides with g, as after its Use, logging to
// logs when set.
func watchOver(g *guard.Guard, logs *syncBuffer) *Watch {
	w := NewWatch()
	if logs != nil {
		w.Logger = slog.New(slog.NewJSONHandler(logs, nil))
	}
	w.mu.Lock()
	w.g = g
	w.mu.Unlock()
	return w
}

// An unhealthy GPU's cordon that is missing at a pass was either lifted by
// the operator (forgotten: its next critical error cordons it again) or lost
// with the ledger state, which a reset, the NRI daemon's recovery from
// nothing (AllowEmpty) or a recovery that lost commits start afresh (a new
// lineage): then it is cordoned again, logged and audited as such (a broken
// GPU taking new claims because the ledger was rebuilt was the bug). Only a
// missing cordon in the lineage it was seen in force in counts as an
// uncordon.
func TestUnhealthyCordonKeptUntilOperatorUncordons(t *testing.T) {
	for _, tc := range lineageCases() {
		t.Run(tc.name, func(t *testing.T) { unhealthyCordonCase(t, tc, nil) })
	}
}

// unhealthyCordonCase runs tc on an unhealthy GPU whose cordon was written
// and seen in force, and checks that its cordon is written again or
// forgotten as tc says. restart, when set, restarts the observer over the
// watch's guard: before the change when before is true, after it
// otherwise.
func unhealthyCordonCase(t *testing.T, tc lineageCase, restart func(t *testing.T, w *Watch, before bool)) {
	const gpu = 3
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	uuid := h.uuid(gpu)
	logs := &syncBuffer{}
	w := watchOver(g, logs)
	m := metrics.New()
	w.Metrics = m
	gauge := func() map[string]float64 { t.Helper(); return gaugeByIndex(t, m, "nri_gpu_guard_unhealthy") }
	ctx := context.Background()
	forgot := 0
	settle := func() { w.settleUnhealthy(ctx, forgetting(func(string) bool { forgot++; return true })) }
	cordoned := func() bool { t.Helper(); return cordonedIn(t, g, uuid) }
	f := observe.Finding{Kind: observe.KindUnhealthy, Xid: 79, Message: "GPU 3 reported critical Xid 79",
		Device: observe.Device{UUID: uuid, Index: "3"}}
	w.onUnhealthy(ctx, f)
	require.True(t, cordoned())
	settle()
	require.True(t, cordoned())
	assert.Equal(t, map[string]float64{"3": 1}, gauge())

	if restart != nil {
		restart(t, w, true)
	}
	tc.between(t, g, uuid)
	if restart != nil {
		restart(t, w, false)
	}
	require.False(t, cordoned())
	settle()
	if tc.fenceOnce {
		assert.False(t, cordoned(), "the fence refuses writes until the plugin rebuilt")
		g.Ledger().RequireLineage("") // rebuilt
		settle()
	}
	w.mu.Lock()
	left := len(w.unhealthy)
	w.mu.Unlock()
	if !tc.recordon {
		assert.False(t, cordoned())
		assert.Equal(t, 1, forgot)
		assert.Zero(t, left)
		assert.Contains(t, logs.String(), "unhealthy device uncordoned by the operator")
		// The gauge follows: it used to show the device until the
		// daemon restarted.
		assert.Empty(t, gauge(), "an uncordoned device is no longer shown unhealthy")
		return
	}
	assert.Equal(t, map[string]float64{"3": 1}, gauge(), "still unhealthy")
	assert.True(t, cordoned(), "the unhealthy GPU is cordoned again")
	assert.Zero(t, forgot, "not taken for an operator's uncordon")
	assert.Equal(t, 1, left, "still known unhealthy")
	assertCordonedAgain(t, g, logs, uuid, "unhealthy device's cordon lost", "critical Xid 79")

	// The cordon written again is the one an uncordon now lifts.
	operatorUncordon(t, g, uuid)
	settle()
	assert.False(t, cordoned())
	assert.Equal(t, 1, forgot)
	assert.Empty(t, gauge())
}

// An unhealthy GPU whose cordon was written stays unhealthy when the
// observer restarts (another [observe] section, an inventory swap, NVML
// reopened), and its cordon is written again when the ledger loses it with
// its state, whether that happens after the restart or between the last
// pass and the restart. Only the devices whose cordon write had failed used
// to be carried over: the new observer knew of no other (NVML reports the
// Xid once), so a reset or a recovery afresh handed the broken GPU to
// containers again until its next critical Xid. The lineage the cordon was
// seen in is carried with it: an operator's uncordon, before or after the
// restart, is still told from a loss, and forgets the device.
func TestUnhealthyCordonKeptAcrossAnObserverRestart(t *testing.T) {
	restart := func(when bool) func(t *testing.T, w *Watch, before bool) {
		return func(t *testing.T, w *Watch, before bool) {
			t.Helper()
			if before != when {
				return
			}
			g := w.guard()
			cfg := g.Config()
			// Without NVML the new observer runs no pass: this test settles
			// by hand, and the carried state alone decides (a running
			// observer would also adopt the cordon still in the ledger:
			// see TestUnhealthyCordonInTheLedgerAdoptedByANewDaemon).
			stop := w.start(context.Background(), nil, watchKey{gpus: g.Inventory().GPUs, observe: cfg.Observe, dir: g.Ledger().Dir()}, cfg)
			stop()
			w.mu.Lock()
			defer w.mu.Unlock()
			require.Len(t, w.unhealthy, 1, "carried over to the new observer")
			assert.Equal(t, uint64(79), w.unhealthy[0].Xid)
		}
	}
	for _, tc := range lineageCases() {
		t.Run("restart, then "+tc.name, func(t *testing.T) { unhealthyCordonCase(t, tc, restart(true)) })
		t.Run(tc.name+", then restart", func(t *testing.T) { unhealthyCordonCase(t, tc, restart(false)) })
	}
}

// An unhealthy GPU's cordon in force in the ledger is adopted by the
// observer of a daemon started afresh (a new Watch, which holds no finding
// of its own): the device is shown unhealthy (gauge, observe.json), its
// cordon is written again when the ledger loses it, and an operator's
// uncordon forgets it. The daemon's restart used to leave the cordon
// unwatched: lost with the state, it was not written again until the next
// critical Xid. Cordons of other sources are not adopted, nor is a cordon
// on a device the inventory does not list.
func TestUnhealthyCordonInTheLedgerAdoptedByANewDaemon(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	ctx := context.Background()
	uuid := h.uuid(3)
	// The daemon that found GPU 3 unhealthy and GPU 6 too; GPU 4 cordoned
	// for an intruder, GPU 5 by the operator.
	first := watchOver(g, nil)
	first.onUnhealthy(ctx, observe.Finding{Kind: observe.KindUnhealthy, Xid: 79, Message: "GPU 3 reported critical Xid 79",
		Device: observe.Device{UUID: uuid, Index: "3"}})
	first.onUnhealthy(ctx, observe.Finding{Kind: observe.KindUnhealthy, Xid: 79, Message: "GPU 6 reported critical Xid 79",
		Device: observe.Device{UUID: h.uuid(6), Index: "6"}})
	require.NoError(t, g.CordonDevice(ctx, h.uuid(4), ledger.CordonIntruder, "pid 200 runs on it without a claim"))
	require.NoError(t, g.CordonDevice(ctx, h.uuid(5), ledger.CordonOperator, "maintenance"))

	// The daemon restarts; its inventory no longer lists GPU 6.
	logs := &syncBuffer{}
	w := watchOver(g, logs)
	m := metrics.New()
	w.Metrics = m
	w.ProcRoot, w.Interval = h.proc, time.Hour // passes find nothing to change
	gauge := func() map[string]float64 { t.Helper(); return gaugeByIndex(t, m, "nri_gpu_guard_unhealthy") }
	startWithout(t, w, g, h, 6)()

	assert.Equal(t, map[string]float64{"3": 1}, gauge(), "GPU 3 alone is adopted")
	file, err := observe.ReadFile(g.Ledger().Dir())
	require.NoError(t, err)
	require.Len(t, file.Unhealthy, 1)
	assert.Equal(t, uuid, file.Unhealthy[0].Device.UUID)
	assert.Equal(t, "3", file.Unhealthy[0].Device.Index)
	assert.Equal(t, "GPU 3 reported critical Xid 79", file.Unhealthy[0].Message)
	assert.Contains(t, logs.String(), "unhealthy device's cordon found in the ledger")

	forgot := 0
	settle := func() { w.settleUnhealthy(ctx, forgetting(func(string) bool { forgot++; return true })) }
	resetLedger(t, g)
	require.False(t, cordonedIn(t, g, uuid))
	settle()
	assert.True(t, cordonedIn(t, g, uuid), "the lost cordon is written again")
	assert.Zero(t, forgot)
	assertCordonedAgain(t, g, logs, uuid, "unhealthy device's cordon lost", "critical Xid 79")

	// Lost once more: its reason says so once.
	resetLedger(t, g)
	settle()
	last := lastAudit(t, g)
	assert.Equal(t, 1, strings.Count(last.Reason, "cordoned again"), last.Reason)

	operatorUncordon(t, g, uuid)
	settle()
	assert.False(t, cordonedIn(t, g, uuid))
	assert.Equal(t, 1, forgot, "the operator's uncordon forgets it")
	assert.Empty(t, gauge())
}

// TestUnhealthyGaugeFollowsANewObserver: an observer started afresh
// (another inventory or [observe] section) shows the unhealthy devices it
// carried over, as observe.json does, and no others: the gauge used to keep
// the old observer's devices until the daemon restarted, one the new
// inventory no longer lists included.
func TestUnhealthyGaugeFollowsANewObserver(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	w := watchOver(g, nil)
	m := metrics.New()
	w.Metrics = m
	w.States = func(*guard.Guard) DeviceStates { return newFakeStates() }
	ctx := context.Background()
	for _, i := range []int{5, 6} {
		w.onUnhealthy(ctx, observe.Finding{Kind: observe.KindUnhealthy, Xid: 79, Message: fmt.Sprintf("GPU %d reported critical Xid 79", i),
			Device: observe.Device{UUID: h.uuid(i), Index: fmt.Sprint(i)}})
	}
	require.Equal(t, map[string]float64{"5": 1, "6": 1}, gaugeByIndex(t, m, "nri_gpu_guard_unhealthy"))

	// The new observer's inventory no longer lists GPU 6.
	cfg := g.Config()
	gpus := slices.DeleteFunc(slices.Clone(g.Inventory().GPUs), func(d devices.GPU) bool { return d.UUID == h.uuid(6) })
	stop := w.start(ctx, nil, watchKey{gpus: gpus, observe: cfg.Observe, dir: g.Ledger().Dir()}, cfg)
	stop()
	assert.Equal(t, map[string]float64{"5": 1}, gaugeByIndex(t, m, "nri_gpu_guard_unhealthy"))
}

// An unhealthy device whose cordon could not be written is still cordoned
// after the observer restarts (another [observe] section, an inventory
// swap): the new observer knows of no unhealthy device and NVML reports
// the Xid only once, so the device used to read as healthy and take new
// claims. A device the new inventory no longer lists is not carried, and a
// device reported again by the new observer is listed once.
func TestUnhealthyCordonPendingSurvivesARestart(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, nil)
	states := newFakeStates()
	states.failing = 2 // both cordons below fail
	w := watchOver(g, nil)
	w.ProcRoot, w.Interval = h.proc, time.Millisecond
	w.States = func(*guard.Guard) DeviceStates { return states }
	ctx := context.Background()
	unhealthy := func(i int, xid uint64) observe.Finding {
		return observe.Finding{Kind: observe.KindUnhealthy, Xid: xid, Message: fmt.Sprintf("GPU %d reported critical Xid %d", i, xid),
			Device: observe.Device{UUID: h.uuid(i), Index: fmt.Sprint(i)}}
	}
	w.onUnhealthy(ctx, unhealthy(6, 79)) // first: it would be retried first
	w.onUnhealthy(ctx, unhealthy(5, 79))
	require.Empty(t, states.cordons, "both cordons failed")

	// The new observer's inventory no longer lists GPU 6.
	stop := startWithout(t, w, g, h, 6)
	c := testwait.Receive(t, states.cordons, "pending cordon written by the new observer")
	stop()
	assert.Equal(t, [2]string{h.uuid(5), "unhealthy"}, [2]string{c[0], c[1]})
	assert.Contains(t, c[2], "critical Xid 79")
	states.mu.Lock()
	assert.False(t, states.cordoned[h.uuid(6)], "a device no longer in the inventory is not carried")
	states.mu.Unlock()

	w.onUnhealthy(ctx, unhealthy(5, 48)) // the new observer's own report
	w.mu.Lock()
	defer w.mu.Unlock()
	require.Len(t, w.unhealthy, 1)
	assert.Equal(t, uint64(48), w.unhealthy[0].Xid)
}

// An intruder's cordon that could not be written (ledger lock busy, ledger
// being recovered) is retried at every pass while a process the guard did
// not admit is still reported on the device, and dropped once none is
// (before, the finding was new only once: its process ran on a device that
// took new claims).
func TestIntruderCordonRetriedWhileReported(t *testing.T) {
	type step struct {
		findings []observe.Finding
		// wantCordon: the pid named by the cordon written at this pass (0:
		// none written); attempts: the cordon writes tried so far.
		wantCordon int
		attempts   int
	}
	h := newGPUHost(t)
	intruder := func(pid int) observe.Finding {
		return observe.Finding{Kind: observe.KindIntruder, Device: observe.Device{UUID: h.uuid(2), Index: "2"},
			PID: pid, ContainerID: idB, Message: fmt.Sprintf("pid %d runs on GPU 2 without a claim", pid)}
	}
	for _, tc := range []struct {
		name    string
		failing int
		mode    config.OnIntruder
		steps   []step
	}{
		{name: "retried until written", failing: 2, mode: config.IntruderCordon, steps: []step{
			{findings: []observe.Finding{intruder(200)}, attempts: 1},
			{findings: []observe.Finding{intruder(200)}, attempts: 2},
			{findings: []observe.Finding{intruder(200)}, attempts: 3, wantCordon: 200},
			{findings: []observe.Finding{intruder(200)}, attempts: 3}, // written: not again
		}},
		{name: "dropped when the intruder left", failing: 1, mode: config.IntruderCordon, steps: []step{
			{findings: []observe.Finding{intruder(200)}, attempts: 1},
			{attempts: 1},
			{attempts: 1},
			{findings: []observe.Finding{intruder(200)}, attempts: 2, wantCordon: 200}, // new again
		}},
		{name: "another unadmitted process still on the device", failing: 1, mode: config.IntruderCordon, steps: []step{
			{findings: []observe.Finding{intruder(200), intruder(201)}, attempts: 1},
			{findings: []observe.Finding{intruder(201)}, attempts: 2, wantCordon: 201},
		}},
		{name: "on_intruder = report never cordons", failing: 1, mode: config.IntruderReport, steps: []step{
			{findings: []observe.Finding{intruder(200)}},
			{findings: []observe.Finding{intruder(200)}},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := guardFor(t, h, func(c *config.Config) { c.Observe.OnIntruder = tc.mode })
			states := newFakeStates()
			states.failing = tc.failing
			w := watchOver(g, nil)
			w.States = func(*guard.Guard) DeviceStates { return states }
			for i, st := range tc.steps {
				w.onReport(context.Background(), g.Config(), observe.Report{Time: time.Now(), Findings: st.findings})
				states.mu.Lock()
				attempts := states.attempts
				states.mu.Unlock()
				assert.Equal(t, st.attempts, attempts, "pass %d: cordon writes tried", i)
				select {
				case c := <-states.cordons:
					assert.Equal(t, h.uuid(2), c[0], "pass %d", i)
					assert.Equal(t, "intruder", c[1])
					assert.Contains(t, c[2], fmt.Sprintf("pid %d (container %s)", st.wantCordon, idB[:12]), "pass %d", i)
				default:
					assert.Zero(t, st.wantCordon, "pass %d: no cordon written", i)
				}
			}
		})
	}
}

// The same through the running observer: the cordon of an intruder first
// refused by the ledger is written at a later pass.
func TestIntruderCordonRetriedByTheObserver(t *testing.T) {
	h := newGPUHost(t)
	g := guardFor(t, h, func(c *config.Config) { c.Observe.OnIntruder = config.IntruderCordon })
	h.run(2, 200, idB) // no claim
	states := newFakeStates()
	states.failing = 1
	_, _, stop := runWatch(t, h, g, states, nil)
	defer stop()
	c := testwait.Receive(t, states.cordons, "the intruder cordon, retried")
	assert.Equal(t, [2]string{h.uuid(2), "intruder"}, [2]string{c[0], c[1]})
	states.mu.Lock()
	assert.Equal(t, 2, states.attempts)
	states.mu.Unlock()
}

// An intruder's cordon (on_intruder = "cordon") missing at a pass while a
// process the guard did not admit still runs on the device was either lifted
// by the operator (left lifted: the same finding does not cordon it again)
// or lost with the ledger state, which a reset or the NRI daemon's recovery
// from nothing start afresh (a new lineage): then it is written again,
// logged and audited as such. Before, only unhealthy cordons were checked:
// the finding was no longer new and only a failed write was retried, so the
// intruder ran on a device that took new claims. The lineage is the one read
// before the write, so an uncordon before any later pass ("at once") is the
// operator's too. Once no finding is left on the device, nothing of its
// cordon is remembered.
func TestIntruderCordonKeptWhileReportedUntilOperatorUncordons(t *testing.T) {
	const gpu = 2
	for _, tc := range lineageCases() {
		for _, seen := range []bool{true, false} {
			name := tc.name + "/seen in force"
			if !seen {
				name = tc.name + "/at once"
			}
			t.Run(name, func(t *testing.T) {
				h := newGPUHost(t)
				g := guardFor(t, h, func(c *config.Config) { c.Observe.OnIntruder = config.IntruderCordon })
				// The daemon acts on findings once it reconciled the ledger
				// with the runtime: the state has a lineage before the first
				// cordon (on a state without one yet, the cordon's own
				// commit starts one, and a missing cordon reads as lost).
				res, err := g.Reconcile(context.Background(), ledger.FrontEndNRI, nil)
				require.NoError(t, err)
				require.NotEmpty(t, res.Lineage)
				uuid := h.uuid(gpu)
				logs := &syncBuffer{}
				w := watchOver(g, logs)
				ctx := context.Background()
				f := observe.Finding{Kind: observe.KindIntruder, Device: observe.Device{UUID: uuid, Index: "2"},
					PID: 200, ContainerID: idB, Message: "pid 200 runs on GPU 2 without a claim"}
				// pass is one accounting pass, as the observer's OnReport.
				pass := func(fs ...observe.Finding) {
					w.onReport(ctx, g.Config(), observe.Report{Time: time.Now(), Findings: fs})
					w.settleUnhealthy(ctx, forgetting(func(string) bool { return true }))
				}
				cordoned := func() bool { t.Helper(); return cordonedIn(t, g, uuid) }

				pass(f)
				require.True(t, cordoned(), "the intruder's device is cordoned")
				if seen {
					pass(f)
					require.True(t, cordoned())
				}
				tc.between(t, g, uuid)
				require.False(t, cordoned())
				pass(f)
				if tc.fenceOnce {
					assert.False(t, cordoned(), "the fence refuses writes until the plugin rebuilt")
					g.Ledger().RequireLineage("") // rebuilt
					pass(f)
				}
				if !tc.recordon {
					assert.False(t, cordoned(), "the operator's uncordon is honoured")
					assert.Contains(t, logs.String(), "intruder cordon lifted by the operator")
					pass(f)
					assert.False(t, cordoned(), "the same finding does not cordon again")
				} else {
					assert.True(t, cordoned(), "the intruder still runs: its device is cordoned again")
					assertCordonedAgain(t, g, logs, uuid, "intruder cordon lost", "pid 200")

					// The cordon written again is the one an uncordon now lifts.
					operatorUncordon(t, g, uuid)
					pass(f)
					assert.False(t, cordoned())
					pass(f)
					assert.False(t, cordoned())
				}

				// The intruder left: nothing is remembered, and a reset then
				// cordons nothing.
				pass()
				w.mu.Lock()
				assert.Empty(t, w.cordonLineage)
				w.mu.Unlock()
				resetLedger(t, g)
				pass()
				assert.False(t, cordoned())
			})
		}
	}
}

// A device NVML could not list at a pass (DeviceReport.Error: nothing
// concluded about it) keeps its findings: no finding-cleared, no cordon
// lineage or cordon retry forgotten, the finding still in observe.json and
// the gauge, so the next pass that lists the same process neither takes it
// for a new finding nor cordons the device the operator had uncordoned.
// Before, a failed listing read as the process leaving.
func TestListingErrorKeepsFindings(t *testing.T) {
	h := newGPUHost(t)
	const gpu = 2
	uuid := h.uuid(gpu)
	dev := observe.Device{UUID: uuid, Index: "2"}
	f := observe.Finding{Kind: observe.KindIntruder, Device: dev, PID: 200, ContainerID: idB,
		Message: "pid 200 runs on GPU 2 without a claim"}
	good := observe.Report{Devices: []observe.DeviceReport{{Device: dev}}, Findings: []observe.Finding{f}}
	failed := observe.Report{Devices: []observe.DeviceReport{{Device: dev, Error: "list compute processes: ERROR_UNKNOWN"}}}

	setup := func(t *testing.T) (*Watch, *guard.Guard, *syncBuffer, *metrics.Metrics, func(observe.Report)) {
		g := guardFor(t, h, func(c *config.Config) { c.Observe.OnIntruder = config.IntruderCordon })
		_, err := g.Reconcile(context.Background(), ledger.FrontEndNRI, nil)
		require.NoError(t, err)
		logs := &syncBuffer{}
		m := metrics.New()
		w := watchOver(g, logs)
		w.Metrics = m
		pass := func(r observe.Report) { r.Time = time.Now(); w.onReport(context.Background(), g.Config(), r) }
		return w, g, logs, m, pass
	}
	ops := func(t *testing.T, g *guard.Guard) (out []string) {
		recs, err := ledger.ReadAudit(g.Ledger().AuditPath())
		require.NoError(t, err)
		for _, r := range recs {
			if r.Op == OpIntruder || r.Op == OpFindingCleared || r.Op == ledger.OpCordon || r.Op == ledger.OpUncordon {
				out = append(out, r.Op)
			}
		}
		return out
	}

	t.Run("operator uncordon stays", func(t *testing.T) {
		_, g, logs, m, pass := setup(t)
		pass(good)
		require.True(t, cordonedIn(t, g, uuid))
		operatorUncordon(t, g, uuid)
		pass(good)
		require.Contains(t, logs.String(), "intruder cordon lifted by the operator")

		pass(failed)
		assert.Equal(t, map[string]float64{"2": 1}, gaugeByIndex(t, m, "nri_gpu_guard_intruders"), "still counted")
		file, err := observe.ReadFile(g.Ledger().Dir())
		require.NoError(t, err)
		if assert.Len(t, file.Findings, 1, "still shown") {
			assert.Equal(t, 200, file.Findings[0].PID)
		}
		assert.Equal(t, []string{"GPU 2 (" + uuid + "): list compute processes: ERROR_UNKNOWN"}, file.Errors)
		// The same device as data, for status to match by UUID.
		assert.Equal(t, []observe.UnlistedDevice{{Device: dev, Error: "list compute processes: ERROR_UNKNOWN"}}, file.Unlisted)
		pass(failed)
		pass(good)
		file, err = observe.ReadFile(g.Ledger().Dir())
		require.NoError(t, err)
		assert.Empty(t, file.Errors, "listed again")
		assert.Empty(t, file.Unlisted, "listed again")
		assert.False(t, cordonedIn(t, g, uuid), "not cordoned again: the same process, the operator's uncordon")
		assert.Equal(t, []string{OpIntruder, ledger.OpCordon, ledger.OpUncordon}, ops(t, g))
		assert.NotContains(t, logs.String(), "GPU finding cleared")

		// Once a listing says the process left, it clears.
		pass(observe.Report{Devices: []observe.DeviceReport{{Device: dev}}})
		assert.Equal(t, []string{OpIntruder, ledger.OpCordon, ledger.OpUncordon, OpFindingCleared}, ops(t, g))
	})

	t.Run("cordon kept in its lineage", func(t *testing.T) {
		w, g, _, _, pass := setup(t)
		pass(good)
		pass(failed)
		w.mu.Lock()
		_, kept := w.cordonLineage[cordonKey{ledger.CordonIntruder, uuid}]
		w.mu.Unlock()
		assert.True(t, kept, "the cordon written for the finding is still known")
		assert.Equal(t, []string{OpIntruder, ledger.OpCordon}, ops(t, g))
	})

	t.Run("cordon retry kept", func(t *testing.T) {
		w, g, logs, _, pass := setup(t)
		states := newFakeStates()
		states.failing = 1
		w.States = func(*guard.Guard) DeviceStates { return states }
		pass(good) // the cordon write fails
		pass(failed)
		// onReport writes its cordons before it returns.
		select {
		case c := <-states.cordons:
			assert.Equal(t, uuid, c[0])
		default:
			t.Error("the cordon retry was dropped")
		}
		assert.NotContains(t, logs.String(), "intruder cordon no longer retried")
		pass(good)
		assert.Empty(t, states.cordons, "written once")
		assert.Equal(t, []string{OpIntruder}, ops(t, g))
	})

	t.Run("MIG instance of a lost GPU", func(t *testing.T) {
		_, g, _, _, pass := setup(t)
		gpu := observe.Device{UUID: uuid, Index: "2"}
		mig := observe.Device{UUID: "MIG-00000000-0000-4000-8000-0000000000a0", Index: "2:0", ParentUUID: uuid}
		fm := f
		fm.Device = mig
		pass(observe.Report{Devices: []observe.DeviceReport{{Device: mig}}, Findings: []observe.Finding{fm}})
		// A lost GPU: its instances are not listed at all.
		pass(observe.Report{Devices: []observe.DeviceReport{{Device: gpu, Error: "it is lost (fallen off the bus?): ERROR_GPU_IS_LOST"}}})
		file, err := observe.ReadFile(g.Ledger().Dir())
		require.NoError(t, err)
		if assert.Len(t, file.Findings, 1) {
			assert.Equal(t, mig.UUID, file.Findings[0].Device.UUID)
		}
		assert.NotContains(t, ops(t, g), OpFindingCleared)
	})
}

// startWatch runs a Watch over h's NVML mock and fake proc, with states as
// its device states and adjust applied before it runs, until ctx is done
// (then done is closed). reports gets a value after each handled report.
func startWatch(ctx context.Context, t *testing.T, h *gpuHost, g *guard.Guard, states *fakeStates, adjust func(*Watch),
	done chan struct{}) (*Watch, chan struct{}) {
	t.Helper()
	reports := make(chan struct{}, 64)
	w := NewWatch()
	w.ProcRoot, w.Interval = h.proc, time.Millisecond
	w.OpenNVML = func() (observe.Source, error) { return observe.OpenNVML(h.srv) }
	w.States = func(*guard.Guard) DeviceStates { return states }
	w.afterReport = func() {
		select {
		case reports <- struct{}{}:
		default:
		}
	}
	if adjust != nil {
		adjust(w)
	}
	go func() { w.Run(ctx); close(done) }()
	w.Use(g)
	return w, reports
}

// runWatch is startWatch with its own context; stop ends the watch and
// waits for it.
func runWatch(t *testing.T, h *gpuHost, g *guard.Guard, states *fakeStates, adjust func(*Watch)) (*Watch, chan struct{}, func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	w, reports := startWatch(ctx, t, h, g, states, adjust, done)
	return w, reports, func() { cancel(); <-done }
}

// holdings is holdingsAt without the epoch, for tests.
func (w *Watch) holdings(ctx context.Context) ([]observe.Holding, error) {
	hs, _, err := w.holdingsAt(ctx)
	return hs, err
}

// startWithout starts w's observer over g's inventory without GPU i (an
// inventory that no longer lists it) and h's NVML, and returns its stop.
func startWithout(t *testing.T, w *Watch, g *guard.Guard, h *gpuHost, i int) func() {
	t.Helper()
	return startWithoutUnder(t, w, g, h, i, g.Config())
}

// startWithoutUnder is startWithout with cfg as the configuration.
func startWithoutUnder(t *testing.T, w *Watch, g *guard.Guard, h *gpuHost, i int, cfg config.Config) func() {
	t.Helper()
	gpus := slices.DeleteFunc(slices.Clone(g.Inventory().GPUs), func(d devices.GPU) bool { return d.UUID == h.uuid(i) })
	src, err := observe.OpenNVML(h.srv)
	require.NoError(t, err)
	t.Cleanup(func() { _ = src.Close() })
	return w.start(context.Background(), src, watchKey{gpus: gpus, observe: cfg.Observe, dir: g.Ledger().Dir()}, cfg)
}

// reopen decides whether NVML, which failed to open, is tried again: only
// when the inventory lists GPUs after one that listed none, or after a
// provisional one (the cache a failed discovery fell back to) gave way to
// a discovered one. A reconnect, another [observe] section or the same
// inventory again say nothing new about NVML.
func TestReopenNVMLOnlyWhenTheInventoryTellsSomethingNew(t *testing.T) {
	gpus := []devices.GPU{{Index: 0, UUID: "GPU-6c1a2f2e-0000-4000-8000-000000000000"}}
	none := &watchKey{}
	listed := &watchKey{gpus: gpus}
	for _, tc := range []struct {
		name                  string
		prev                  *watchKey
		k                     watchKey
		wasProvisional, isNow bool
		want                  bool
	}{
		{name: "first observer", prev: nil, k: *listed},
		{name: "no GPU listed now", prev: none, k: *none},
		{name: "GPUs listed after none", prev: none, k: *listed, want: true},
		{name: "a provisional inventory swapped for a discovered one", prev: listed, k: *listed, wasProvisional: true, want: true},
		{name: "a reconnect over the same inventory", prev: listed, k: *listed},
		{name: "still provisional", prev: listed, k: *listed, wasProvisional: true, isNow: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, reopen(tc.prev, tc.k, tc.wasProvisional, tc.isNow))
		})
	}
}

// forgetting drives settleUnhealthy without an observer: no device fails
// again, and forget is called for each device forgotten.
type forgetting func(uuid string) bool

func (forgetting) HealthSeq(string) uint64 { return 0 }

func (f forgetting) ForgetHealth(uuid string, _ uint64) (observe.Finding, uint64, bool) {
	f(uuid)
	return observe.Finding{}, 0, false
}
