// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package observe

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// mockHost is a go-nvml mock server whose process lists, lost devices and
// event stream the test controls.
type mockHost struct {
	t    testing.TB
	srv  *server.Server
	gpus []devices.GPU

	mu      sync.Mutex
	compute map[string][]nvml.ProcessInfo // by device UUID
	graph   map[string][]nvml.ProcessInfo
	listErr map[string]nvml.Return // process listing fails with this
	lost    map[string]nvml.Return // handle lookup fails with this
	block   map[string]chan struct{}
	entered chan string // a blocked listing has started

	events   chan nvml.EventData
	waitErr  chan nvml.Return // next Wait returns this instead of an event
	createOK int              // EventSetCreate fails until this many calls were made
	creates  int
	frees    int
	migs     map[string][]*mock.Device // MIG handles by parent UUID
	// addMIG creates a MIG instance at NVML MIG index n of the MIG-mode
	// GPU (enableMIG) that the inventory does not know.
	addMIG func(n int, uuid string)
	// moveMIG moves the instance at NVML MIG index from to index to (its
	// UUID and process lists stay), leaving from empty: NVML's MIG
	// indices of the instances that stay after others were destroyed and
	// created.
	moveMIG func(from, to int)
}

// newMockA100 is go-nvml's DGX A100 mock: 8 GPUs, no MIG.
func newMockA100(t testing.TB) *mockHost { return newMockHost(t, dgxa100.New()) }

func newMockHost(t testing.TB, srv *server.Server) *mockHost {
	h := &mockHost{
		t: t, srv: srv,
		compute: map[string][]nvml.ProcessInfo{}, graph: map[string][]nvml.ProcessInfo{},
		listErr: map[string]nvml.Return{}, lost: map[string]nvml.Return{},
		block: map[string]chan struct{}{}, entered: make(chan string, 8),
		events: make(chan nvml.EventData, 8), waitErr: make(chan nvml.Return, 8),
		migs: map[string][]*mock.Device{},
	}
	for i, d := range srv.Devices {
		sd := d.(*server.Device)
		h.gpus = append(h.gpus, devices.GPU{Index: i, UUID: sd.UUID, Minor: i})
		h.instrument(sd.UUID, &sd.Device)
		sd.GetSupportedEventTypesFunc = func() (uint64, nvml.Return) {
			return nvml.EventTypeXidCriticalError | nvml.EventTypeSingleBitEccError, nvml.SUCCESS
		}
		sd.RegisterEventsFunc = func(uint64, nvml.EventSet) nvml.Return { return nvml.SUCCESS }
	}
	byUUID := srv.DeviceGetHandleByUUIDFunc
	srv.DeviceGetHandleByUUIDFunc = func(uuid string) (nvml.Device, nvml.Return) {
		h.mu.Lock()
		ret, lost := h.lost[uuid]
		h.mu.Unlock()
		if lost {
			return nil, ret
		}
		return byUUID(uuid)
	}
	srv.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.creates++
		if h.creates < h.createOK {
			return nil, nvml.ERROR_UNKNOWN
		}
		return &mock.EventSet{
			WaitFunc: h.wait,
			FreeFunc: func() nvml.Return {
				h.mu.Lock()
				h.frees++
				h.mu.Unlock()
				return nvml.SUCCESS
			},
		}, nvml.SUCCESS
	}
	return h
}

// instrument makes d's process lists come from the host's tables.
func (h *mockHost) instrument(uuid string, d *mock.Device) {
	list := func(table map[string][]nvml.ProcessInfo) func() ([]nvml.ProcessInfo, nvml.Return) {
		return func() ([]nvml.ProcessInfo, nvml.Return) {
			h.mu.Lock()
			block := h.block[uuid]
			h.mu.Unlock()
			if block != nil {
				h.entered <- uuid
				<-block
			}
			h.mu.Lock()
			defer h.mu.Unlock()
			if ret, ok := h.listErr[uuid]; ok {
				return nil, ret
			}
			return append([]nvml.ProcessInfo(nil), table[uuid]...), nvml.SUCCESS
		}
	}
	d.GetComputeRunningProcessesFunc = list(h.compute)
	d.GetGraphicsRunningProcessesFunc = list(h.graph)
}

func (h *mockHost) wait(timeoutMs uint32) (nvml.EventData, nvml.Return) {
	select { // a queued failure comes before queued events
	case ret := <-h.waitErr:
		return nvml.EventData{}, ret
	default:
	}
	select {
	case ret := <-h.waitErr:
		return nvml.EventData{}, ret
	case ev := <-h.events:
		return ev, nvml.SUCCESS
	case <-time.After(time.Duration(timeoutMs) * time.Millisecond):
		return nvml.EventData{}, nvml.ERROR_TIMEOUT
	}
}

func (h *mockHost) uuid(i int) string { return h.gpus[i].UUID }

// run puts pid on device uuid as a compute process.
func (h *mockHost) run(uuid string, pid uint32, mem uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.compute[uuid] = append(h.compute[uuid], nvml.ProcessInfo{Pid: pid, UsedGpuMemory: mem})
}

func (h *mockHost) runGraphics(uuid string, pid uint32) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.graph[uuid] = append(h.graph[uuid], nvml.ProcessInfo{Pid: pid, UsedGpuMemory: ^uint64(0)})
}

func (h *mockHost) clear(uuid string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.compute, uuid)
	delete(h.graph, uuid)
}

func (h *mockHost) set(m map[string]nvml.Return, uuid string, ret nvml.Return) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if ret == nvml.SUCCESS {
		delete(m, uuid)
		return
	}
	m[uuid] = ret
}

// enableMIG gives GPU gpu MIG instances at NVML MIG indices idx (GI = CI+1 =
// position), each a MIG device handle with its own process lists.
func (h *mockHost) enableMIG(gpu int, idx ...int) {
	sd := h.srv.Devices[gpu].(*server.Device)
	handles := map[int]*mock.Device{}
	for pos, n := range idx {
		uuid := fmt.Sprintf("MIG-%08x-0000-4000-8000-%012x", gpu, n)
		m := &mock.Device{
			GetUUIDFunc:           func() (string, nvml.Return) { return uuid, nvml.SUCCESS },
			IsMigDeviceHandleFunc: func() (bool, nvml.Return) { return true, nvml.SUCCESS },
		}
		h.instrument(uuid, m)
		handles[n] = m
		h.migs[sd.UUID] = append(h.migs[sd.UUID], m)
		h.gpus[gpu].MIG = append(h.gpus[gpu].MIG, devices.MIG{Index: n, UUID: uuid, GI: pos + 1, CI: 0, ParentUUID: sd.UUID, ParentIndex: gpu})
	}
	sd.GetMigDeviceHandleByIndexFunc = func(n int) (nvml.Device, nvml.Return) {
		h.mu.Lock()
		defer h.mu.Unlock()
		if m, ok := handles[n]; ok {
			return m, nvml.SUCCESS
		}
		return nil, nvml.ERROR_NOT_FOUND
	}
	sd.GetMaxMigDeviceCountFunc = func() (int, nvml.Return) { return 7, nvml.SUCCESS } // H100
	h.addMIG = func(n int, uuid string) {
		m := &mock.Device{
			GetUUIDFunc:           func() (string, nvml.Return) { return uuid, nvml.SUCCESS },
			IsMigDeviceHandleFunc: func() (bool, nvml.Return) { return true, nvml.SUCCESS },
		}
		h.instrument(uuid, m)
		h.mu.Lock()
		handles[n] = m
		h.mu.Unlock()
	}
	h.moveMIG = func(from, to int) {
		h.mu.Lock()
		defer h.mu.Unlock()
		m, ok := handles[from]
		if !ok {
			h.t.Fatalf("no MIG instance at index %d of GPU %d to move", from, gpu)
		}
		delete(handles, from)
		handles[to] = m
	}
	// Processes of a MIG-mode GPU are listed on its instances, never on
	// the GPU itself.
	fail := func() ([]nvml.ProcessInfo, nvml.Return) {
		h.t.Errorf("processes listed on MIG-mode GPU %d instead of its instances", gpu)
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	sd.GetComputeRunningProcessesFunc = fail
	sd.GetGraphicsRunningProcessesFunc = fail
}

func (h *mockHost) migUUID(gpu, n int) string {
	for _, m := range h.gpus[gpu].MIG {
		if m.Index == n {
			return m.UUID
		}
	}
	h.t.Fatalf("no MIG %d:%d", gpu, n)
	return ""
}

// newMockH100MIG is go-nvml's DGX H100 mock with GPU 1 in MIG mode.
func newMockH100MIG(t testing.TB) *mockHost {
	h := newMockHost(t, dgxh100.New())
	h.enableMIG(1, 0, 1, 3)
	return h
}

func (p *fakeProc) remove(pid int) {
	p.t.Helper()
	require.NoError(p.t, os.RemoveAll(filepath.Join(p.root, "proc", fmt.Sprint(pid))))
}

type holdings []Holding

func (hs *holdings) Holdings() ([]Holding, error) { return append([]Holding(nil), (*hs)...), nil }

// logBuffer is a slog logger writing text into a buffer, safe to read while
// the observer logs.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// newObserver opens the mock as NVML and builds an Observer over it.
func newObserver(t testing.TB, h *mockHost, fp *fakeProc, ledger Ledger, edit func(*Options)) (*Observer, *logBuffer) {
	t.Helper()
	src, err := OpenNVML(h.srv)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, src.Close()) })
	logs := &logBuffer{}
	opts := Options{
		Source: src, GPUs: h.gpus, Ledger: ledger, ProcRoot: fp.root,
		Xids:      []int{48, 79, 95},
		Logger:    slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		EventWait: 5 * time.Millisecond, RetryMin: time.Millisecond, RetryMax: 4 * time.Millisecond,
		Now: func() time.Time { return time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC) },
	}
	if edit != nil {
		edit(&opts)
	}
	o, err := New(opts)
	require.NoError(t, err)
	return o, logs
}

// startRun runs o.Run until the test ends.
func startRun(t testing.TB, o *Observer) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { o.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
}

// mockDevice is the mock server's GPU.
type mockDevice = server.Device
