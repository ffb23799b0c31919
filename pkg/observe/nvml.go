// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package observe

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// NVMLInterface is the NVML API the observer uses: go-nvml's nvml.Interface
// in cgo builds (the real library or a go-nvml mock). Builds without cgo
// have no NVML; there it is an empty interface and only nil is meaningful.
type NVMLInterface = nvml.Interface

// ErrNVMLUnavailable is wrapped when NVML cannot be initialised.
var ErrNVMLUnavailable = errors.New("NVML is not available")

// noInstance is NVML's "all instances" GPU/compute instance id in events.
const noInstance = 0xFFFFFFFF

// nvmlSource is NVML as the observer's Source. A query that outlived its
// context (the Observer stops waiting for it) may still be inside NVML when
// the caller closes the source: Close therefore never shuts NVML down under
// a query in flight. It marks the source closed and the last query to leave
// NVML shuts it down; queries started after Close fail at once.
type nvmlSource struct {
	lib nvml.Interface

	mu     sync.Mutex
	active int  // queries (list, watch) inside NVML
	closed bool // Close was called; Shutdown runs when active reaches 0
	down   bool // Shutdown has run
	// closing is closed by Close: a watch with nothing to wait on in NVML
	// waits on it.
	closing chan struct{}
}

// errClosed is returned by queries on a closed source.
var errClosed = errors.New("NVML source is closed")

// enter registers a query; false when the source is closed.
func (s *nvmlSource) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.active++
	return true
}

// leave ends a query and shuts NVML down if it was the last one after Close.
func (s *nvmlSource) leave() {
	s.mu.Lock()
	s.active--
	last := s.closed && s.active == 0 && !s.down
	if last {
		s.down = true
	}
	s.mu.Unlock()
	if last {
		// Nobody is left to hear a failed shutdown; the process is
		// stopping NVML use either way.
		_ = s.lib.Shutdown()
	}
}

// isClosed reports whether Close was called (a running watch stops).
func (s *nvmlSource) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// OpenNVML initialises NVML and returns it as the observer's Source. lib nil
// means the host's libnvidia-ml.so.1. Close shuts NVML down again.
func OpenNVML(lib NVMLInterface) (Source, error) {
	if lib == nil {
		lib = nvml.New()
	}
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("%w: initialise: %w", ErrNVMLUnavailable, ret)
	}
	return &nvmlSource{lib: lib, closing: make(chan struct{})}, nil
}

// Close shuts NVML down, at once when no query is inside NVML, else as soon
// as the last one returns (then it returns nil without waiting). A second
// Close does nothing.
func (s *nvmlSource) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.closing)
	now := s.active == 0
	s.down = now
	s.mu.Unlock()
	if !now {
		return nil
	}
	if ret := s.lib.Shutdown(); ret != nvml.SUCCESS {
		return fmt.Errorf("NVML shutdown: %w", ret)
	}
	return nil
}

// lostError turns the NVML returns that mean "this device is gone or needs
// a reset" into the reason it is unhealthy; other returns are not fatal.
func lostError(ret nvml.Return) error {
	switch ret {
	case nvml.ERROR_NOT_FOUND:
		return fmt.Errorf("it vanished from NVML: %w: %w", ErrVanished, ret)
	case nvml.ERROR_GPU_IS_LOST:
		return fmt.Errorf("it is lost (fallen off the bus?): %w", ret)
	case nvml.ERROR_RESET_REQUIRED:
		return fmt.Errorf("it needs a reset: %w", ret)
	}
	return nil
}

// handle finds GPU d by UUID.
func (s *nvmlSource) handle(d Device) (nvml.Device, nvml.Return) {
	return s.lib.DeviceGetHandleByUUID(d.UUID)
}

// migSlot is a MIG instance as NVML reports it now on its GPU.
type migSlot struct {
	index  int
	uuid   string
	handle nvml.Device
}

// migLayout is the MIG layout NVML reports now on one GPU in MIG mode,
// walked once per pass: the instances by UUID, whatever their MIG index.
type migLayout struct {
	slots  []migSlot
	byUUID map[string]int // position in slots
	// err: the walk failed as a whole (its count); failed: the MIG
	// indices NVML would not tell about. Either way an instance missing
	// from slots is not known to be gone.
	err    error
	failed []error
}

// walkMIG reads the MIG layout NVML reports now on the GPU of handle h.
func walkMIG(h nvml.Device) *migLayout {
	l := &migLayout{byUUID: map[string]int{}}
	n, ret := h.GetMaxMigDeviceCount()
	if ret != nvml.SUCCESS {
		l.err = fmt.Errorf("count its MIG instances: %w", ret)
		return l
	}
	for j := range n {
		m, ret := h.GetMigDeviceHandleByIndex(j)
		if ret == nvml.ERROR_NOT_FOUND || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue // no instance at this index
		}
		if ret != nvml.SUCCESS {
			l.failed = append(l.failed, fmt.Errorf("get the handle of MIG index %d: %w", j, ret))
			continue
		}
		uuid, ret := m.GetUUID()
		if ret != nvml.SUCCESS {
			l.failed = append(l.failed, fmt.Errorf("get the UUID of MIG index %d: %w", j, ret))
			continue
		}
		l.byUUID[uuid] = len(l.slots)
		l.slots = append(l.slots, migSlot{index: j, uuid: uuid, handle: m})
	}
	return l
}

// incomplete says why an instance missing from l may still be there; nil
// when l is the whole layout.
func (l *migLayout) incomplete() error {
	if l.err != nil {
		return l.err
	}
	return errors.Join(l.failed...)
}

// migHandle finds MIG instance d by its UUID: at the MIG index the
// inventory has for it, or, when another instance or none is there now,
// wherever the layout of its GPU has it (destroying and creating instances
// moves the MIG indices of those that stay). at is its MIG index now.
// layouts caches the layout of each GPU for the pass. An instance missing
// from a layout read whole has vanished (lost); one missing from a layout
// NVML would not tell whole is an error (nothing concluded).
func (s *nvmlSource) migHandle(d Device, layouts map[string]*migLayout) (h nvml.Device, at int, lost, err error) {
	parent, ret := s.lib.DeviceGetHandleByUUID(d.ParentUUID)
	if ret != nvml.SUCCESS {
		if lost = lostError(ret); lost == nil {
			err = fmt.Errorf("get the NVML handle: %w", ret)
		}
		return nil, 0, lost, err
	}
	m, ret := parent.GetMigDeviceHandleByIndex(d.migIndex)
	switch ret {
	case nvml.SUCCESS:
		if uuid, ret := m.GetUUID(); ret == nvml.SUCCESS && uuid == d.UUID {
			return m, d.migIndex, nil, nil
		}
	case nvml.ERROR_GPU_IS_LOST, nvml.ERROR_RESET_REQUIRED:
		return nil, 0, lostError(ret), nil
	}
	// Not at its index (or its index cannot be read): look for its UUID
	// in the layout NVML reports now.
	l := layouts[d.ParentUUID]
	if l == nil {
		l = walkMIG(parent)
		layouts[d.ParentUUID] = l
	}
	if i, ok := l.byUUID[d.UUID]; ok {
		return l.slots[i].handle, l.slots[i].index, nil, nil
	}
	if why := l.incomplete(); why != nil {
		return nil, 0, nil, fmt.Errorf("not at MIG index %d, and the MIG layout of its GPU cannot be read whole to find it: %w", d.migIndex, why)
	}
	// The MIG layout changed under the inventory: the instance the guard
	// knows is gone.
	return nil, 0, lostError(nvml.ERROR_NOT_FOUND), nil
}

func (s *nvmlSource) list(devs []Device) []listing {
	out := make([]listing, 0, len(devs))
	if !s.enter() {
		for _, d := range devs {
			out = append(out, listing{device: d, err: errClosed})
		}
		return out
	}
	defer s.leave()
	lostGPU := map[string]bool{}
	layouts := map[string]*migLayout{} // by GPU UUID, walked once per pass
	for _, d := range devs {
		if d.IsMIG() && lostGPU[d.ParentUUID] {
			continue
		}
		l := listing{device: d}
		if d.IsMIG() {
			h, at, lost, err := s.migHandle(d, layouts)
			if lost != nil || err != nil {
				l.lost, l.err = lost, err
				out = append(out, l)
				continue
			}
			if at != d.migIndex {
				l.nowAt = fmt.Sprintf("%d:%d", d.gpuIndex, at)
			}
			l.procs, l.lost, l.err = processes(h)
			out = append(out, l)
			continue
		}
		h, ret := s.handle(d)
		if ret != nvml.SUCCESS {
			if l.lost = lostError(ret); l.lost == nil {
				l.err = fmt.Errorf("get the NVML handle: %w", ret)
			} else {
				lostGPU[d.UUID] = true
			}
			out = append(out, l)
			continue
		}
		if d.hasMIG {
			// In MIG mode processes run on instances; they are listed
			// there, once each (never on the GPU, whose list aggregates
			// them). The inventory's instances are listed as devs has
			// them, found by UUID wherever they are now; an instance
			// created since discovery is listed from the MIG layout
			// NVML reports now.
			layout := walkMIG(h)
			layouts[d.UUID] = layout
			out = append(out, unknownMIG(d, layout, devs)...)
			continue
		}
		l.procs, l.lost, l.err = processes(h)
		out = append(out, l)
	}
	return out
}

// unknownMIG lists the processes of the MIG instances of layout, the MIG
// layout NVML reports now on gpu, that are not among devs (by UUID, at any
// MIG index): instances created after the inventory was discovered. Each
// is a Device of its own (unknownMIG set) that the claims on gpu cover. A
// walk NVML refuses, whole or at an index, is a listing of gpu with the
// error: its instances are not known to be all observed.
func unknownMIG(gpu Device, layout *migLayout, devs []Device) []listing {
	if layout.err != nil {
		return []listing{{device: gpu, err: layout.err}}
	}
	known := map[string]bool{}
	for _, d := range devs {
		if d.ParentUUID == gpu.UUID {
			known[d.UUID] = true
		}
	}
	var out []listing
	for _, err := range layout.failed {
		out = append(out, listing{device: gpu, err: err})
	}
	for _, m := range layout.slots {
		if known[m.uuid] {
			continue
		}
		l := listing{device: Device{
			Index: fmt.Sprintf("%d:%d", gpu.gpuIndex, m.index), UUID: m.uuid, ParentUUID: gpu.UUID,
			gpuIndex: gpu.gpuIndex, migIndex: m.index, gi: -1, ci: -1, unknownMIG: true,
		}}
		l.procs, l.lost, l.err = processes(m.handle)
		if l.lost != nil {
			// Gone between the walk and the listing: nothing to judge,
			// and nothing the inventory holds to call unhealthy.
			continue
		}
		out = append(out, l)
	}
	return out
}

// processes lists the compute and graphics processes on h, merged by pid.
func processes(h nvml.Device) (procs []Process, lost, err error) {
	compute, ret := h.GetComputeRunningProcesses()
	if ret != nvml.SUCCESS {
		if lost = lostError(ret); lost == nil || ret == nvml.ERROR_NOT_FOUND {
			return nil, nil, fmt.Errorf("list compute processes: %w", ret)
		}
		return nil, lost, nil
	}
	graphics, ret := h.GetGraphicsRunningProcesses()
	switch {
	case ret == nvml.ERROR_NOT_SUPPORTED:
		graphics = nil // compute-only GPUs have no graphics engine
	case ret != nvml.SUCCESS:
		if lost = lostError(ret); lost == nil || ret == nvml.ERROR_NOT_FOUND {
			return nil, nil, fmt.Errorf("list graphics processes: %w", ret)
		}
		return nil, lost, nil
	}
	byPID := map[uint32]int{}
	add := func(infos []nvml.ProcessInfo, typ string) {
		for _, pi := range infos {
			if i, ok := byPID[pi.Pid]; ok {
				procs[i].Type = "C+G"
				procs[i].UsedMemoryBytes = max(procs[i].UsedMemoryBytes, usedMemory(pi))
				continue
			}
			byPID[pi.Pid] = len(procs)
			procs = append(procs, Process{PID: int(pi.Pid), Type: typ, UsedMemoryBytes: usedMemory(pi)})
		}
	}
	add(compute, "C")
	add(graphics, "G")
	return procs, nil, nil
}

// usedMemory is the process's GPU memory; NVML reports "not available"
// (without permission, or under some vGPU modes) as all ones.
func usedMemory(pi nvml.ProcessInfo) uint64 {
	if pi.UsedGpuMemory == ^uint64(0) {
		return 0
	}
	return pi.UsedGpuMemory
}

func (s *nvmlSource) watch(ctx context.Context, devs []Device, w watchOpts) error {
	if !s.enter() {
		return errClosed
	}
	defer s.leave()
	set, ret := s.lib.EventSetCreate()
	if ret != nvml.SUCCESS {
		return fmt.Errorf("create an NVML event set: %w", ret)
	}
	defer func() { _ = set.Free() }() // nothing to do about a failed free
	var (
		gpus, registered int
		// retry: GPUs whose registration failed for a reason that may
		// pass (not ERROR_NOT_SUPPORTED). They are registered again while
		// the set is watched: a GPU left out would have its Xids missed
		// for as long as the other GPUs keep the watch running.
		retry []*pendingGPU
	)
	for _, d := range devs {
		if d.IsMIG() {
			continue // registered on the GPU; instances are told apart by GI/CI
		}
		gpus++
		err := register(s.lib, d, set, w.emit)
		switch {
		case err == nil:
			registered++
		case errors.Is(err, nvml.ERROR_NOT_SUPPORTED):
			w.log.Warn("GPU health is not watched: the GPU does not support Xid events", "device", d.String(), "error", err)
		default:
			p := &pendingGPU{device: d, backoff: w.retryMin, next: time.Now().Add(w.retryMin)}
			retry = append(retry, p)
			w.log.Warn("GPU health is not watched; retrying", "device", d.String(), "error", err, "retry_in", p.backoff)
		}
	}
	if gpus > 0 && registered == 0 {
		return errors.New("no GPU accepted registration for Xid events")
	}
	if gpus == 0 {
		// Nothing to wait for: NVML may answer a wait on an empty set at
		// once, which would spin this loop. Idle until told to stop.
		select {
		case <-ctx.Done():
			return nil
		case <-s.closing:
			return errClosed
		}
	}
	ms := w.wait.Milliseconds()
	if ms < 1 {
		ms = 1
	}
	if ms > math.MaxUint32 {
		ms = math.MaxUint32
	}
	for ctx.Err() == nil {
		if s.isClosed() {
			return errClosed
		}
		retry = registerDue(s.lib, set, retry, time.Now(), w)
		ev, ret := set.Wait(uint32(ms))
		switch ret {
		case nvml.SUCCESS:
			w.ran()
		case nvml.ERROR_TIMEOUT:
			w.ran()
			continue
		default:
			return fmt.Errorf("wait for NVML events: %w", ret)
		}
		if ev.EventType&nvml.EventTypeXidCriticalError == 0 {
			continue
		}
		hit, ok := eventDevices(ev, devs)
		if !ok {
			w.log.Warn("Xid event from a device outside the inventory", "xid", ev.EventData)
			continue
		}
		if !w.xids[ev.EventData] {
			w.log.Info("Xid not in observe.xids; device stays healthy", "device", hit[0].String(), "xid", ev.EventData)
			continue
		}
		for _, d := range hit {
			w.emit(Finding{Kind: KindUnhealthy, Device: d, Xid: ev.EventData,
				Message: fmt.Sprintf("%s reported critical Xid %d; no new claims on it, its holder keeps its claim (see the kernel log, dmesg | grep Xid, and NVIDIA's Xid catalogue; a reset or reboot is usually needed)", d, ev.EventData)})
		}
	}
	return nil
}

// pendingGPU is a GPU whose registration for Xid events failed: it is tried
// again at next, with back-off between retryMin and retryMax.
type pendingGPU struct {
	device  Device
	next    time.Time
	backoff time.Duration
}

// registerDue registers the pending GPUs whose retry is due at now on set,
// and returns those still pending. Retries between waits cost one NVML call
// per due GPU; the back-off keeps a GPU that never accepts from costing more.
func registerDue(lib nvml.Interface, set nvml.EventSet, pending []*pendingGPU, now time.Time, w watchOpts) []*pendingGPU {
	left := pending[:0]
	for _, p := range pending {
		if now.Before(p.next) {
			left = append(left, p)
			continue
		}
		err := register(lib, p.device, set, w.emit)
		if err == nil {
			w.log.Info("GPU health is watched again: registered for Xid events", "device", p.device.String())
			continue
		}
		p.backoff = min(2*p.backoff, w.retryMax)
		p.next = now.Add(p.backoff)
		left = append(left, p)
		// Debug: the first failure was logged at warning level, and the
		// GPU stays unwatched until a line says it is watched again.
		w.log.Debug("GPU health is still not watched; retrying", "device", p.device.String(), "error", err, "retry_in", p.backoff)
	}
	return left
}

// register subscribes set to d's critical Xid events. A lost device is
// emitted as unhealthy; any failure leaves d unwatched (the error says why).
func register(lib nvml.Interface, d Device, set nvml.EventSet, emit func(Finding)) error {
	fail := func(ret nvml.Return, what string) error {
		if lost := lostError(ret); lost != nil {
			emit(Finding{Kind: KindUnhealthy, Device: d,
				Message: fmt.Sprintf("%s is unhealthy: %v; no new claims until it is back (check nvidia-smi and the kernel log; a reset or reboot may be needed)", d, lost)})
		}
		return fmt.Errorf("%s: %s: %w", d, what, ret)
	}
	h, ret := lib.DeviceGetHandleByUUID(d.UUID)
	if ret != nvml.SUCCESS {
		return fail(ret, "get the NVML handle")
	}
	mask := uint64(nvml.EventTypeXidCriticalError)
	supported, ret := h.GetSupportedEventTypes()
	if ret != nvml.SUCCESS {
		return fail(ret, "get the supported event types")
	}
	if mask&supported == 0 {
		return fail(nvml.ERROR_NOT_SUPPORTED, "register for Xid events")
	}
	if ret := h.RegisterEvents(mask, set); ret != nvml.SUCCESS {
		return fail(ret, "register for Xid events")
	}
	return nil
}

// eventDevices maps an event to the devices it concerns. An event of a GPU
// in MIG mode names a GPU instance and a compute instance: the MIG device
// of that pair, or, with compute instance noInstance (the fault is the GPU
// instance's, NVML cannot pin it on one compute instance), every MIG device
// of that GPU instance, since they share its memory and engines. With GPU
// instance noInstance, or ids no MIG device of the inventory has, it is the
// GPU's: the GPU is unhealthy, and so each of its instances (Health).
func eventDevices(ev nvml.EventData, devs []Device) ([]Device, bool) {
	if ev.Device == nil {
		return nil, false
	}
	uuid, ret := ev.Device.GetUUID()
	if ret != nvml.SUCCESS {
		return nil, false
	}
	for _, d := range devs {
		if d.UUID != uuid {
			continue
		}
		if d.IsMIG() {
			return []Device{d}, true // a driver that reports the instance itself
		}
		var out []Device
		if d.hasMIG && ev.GpuInstanceId != noInstance {
			for _, m := range devs {
				if m.ParentUUID == d.UUID && int64(m.gi) == int64(ev.GpuInstanceId) &&
					(ev.ComputeInstanceId == noInstance || int64(m.ci) == int64(ev.ComputeInstanceId)) {
					out = append(out, m)
				}
			}
		}
		if len(out) == 0 {
			out = []Device{d}
		}
		return out, true
	}
	return nil, false
}
