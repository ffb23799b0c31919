// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package observe

import (
	"context"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
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
	return joinErrors(l.failed)
}

// errorList is errors read as one: "; " between them.
type errorList []error

func (e errorList) Error() string {
	msgs := make([]string, len(e))
	for i, err := range e {
		msgs[i] = err.Error()
	}
	return strings.Join(msgs, "; ")
}

func (e errorList) Unwrap() []error { return e }

// joinErrors is errs as one error (errors.Join on one line); nil for none.
func joinErrors(errs []error) error {
	switch len(errs) {
	case 0:
		return nil
	case 1:
		return errs[0]
	}
	return errorList(errs)
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
// is a Device of its own (unknownMIG set) that the claims on gpu cover, and
// its intruder and out-of-bounds findings are gpu's (Finding.Instance). A
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
		}, gpu: gpu}
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
		// handles: the GPUs registered and the NVML handle of each. An
		// event names its device by one of them: an event whose device
		// NVML cannot read the UUID of is still matched to its GPU.
		handles []watched
	)
	for _, d := range devs {
		if d.IsMIG() {
			continue // registered on the GPU; instances are told apart by GI/CI
		}
		gpus++
		h, err := register(s.lib, d, set, w.emit)
		switch {
		case err == nil:
			registered++
			handles = append(handles, watched{device: d, handle: h})
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
		retry = registerDue(s.lib, set, retry, time.Now(), w, &handles)
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
		t := eventDevices(ev, devs, handles)
		critical := w.xids[ev.EventData]
		switch {
		case t.outside != "":
			w.log.Warn("Xid event from a device outside the inventory", "xid", ev.EventData, "device", t.outside)
			continue
		case len(t.devices) == 0 && !critical:
			w.log.Info("Xid not in observe.xids from a device NVML cannot identify; ignored", "xid", ev.EventData, "error", t.unread)
			continue
		case len(t.devices) == 0:
			w.unidentified(unidentifiedFinding(ev.EventData, t.unread), t.ident)
			continue
		case t.by != "":
			w.log.Warn("Xid event from a device whose UUID NVML cannot read; matched to the inventory by "+t.by,
				"device", t.devices[0].String(), "xid", ev.EventData, "error", t.unread)
		}
		hit := t.devices
		if !critical {
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
// adds each registered to handles, and returns those still pending.
// Retries between waits cost one NVML call per due GPU; the back-off keeps
// a GPU that never accepts from costing more.
func registerDue(lib nvml.Interface, set nvml.EventSet, pending []*pendingGPU, now time.Time, w watchOpts, handles *[]watched) []*pendingGPU {
	left := pending[:0]
	for _, p := range pending {
		if now.Before(p.next) {
			left = append(left, p)
			continue
		}
		h, err := register(lib, p.device, set, w.emit)
		if err == nil {
			*handles = append(*handles, watched{device: p.device, handle: h})
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

// watched is a GPU registered for Xid events and the NVML handle it was
// registered by.
type watched struct {
	device Device
	handle nvml.Device
}

// register subscribes set to d's critical Xid events and returns the handle
// it did so by. A lost device is emitted as unhealthy; any failure leaves d
// unwatched (the error says why).
func register(lib nvml.Interface, d Device, set nvml.EventSet, emit func(Finding)) (nvml.Device, error) {
	fail := func(ret nvml.Return, what string) error {
		if lost := lostError(ret); lost != nil {
			emit(Finding{Kind: KindUnhealthy, Device: d,
				Message: fmt.Sprintf("%s is unhealthy: %v; no new claims until it is back (check nvidia-smi and the kernel log; a reset or reboot may be needed)", d, lost)})
		}
		return fmt.Errorf("%s: %s: %w", d, what, ret)
	}
	h, ret := lib.DeviceGetHandleByUUID(d.UUID)
	if ret != nvml.SUCCESS {
		return nil, fail(ret, "get the NVML handle")
	}
	mask := uint64(nvml.EventTypeXidCriticalError)
	supported, ret := h.GetSupportedEventTypes()
	if ret != nvml.SUCCESS {
		return nil, fail(ret, "get the supported event types")
	}
	if mask&supported == 0 {
		return nil, fail(nvml.ERROR_NOT_SUPPORTED, "register for Xid events")
	}
	if ret := h.RegisterEvents(mask, set); ret != nvml.SUCCESS {
		return nil, fail(ret, "register for Xid events")
	}
	return h, nil
}

// eventTarget is what an event's device was found to be.
type eventTarget struct {
	// devices are the inventory devices the event concerns (instanceDevices).
	devices []Device
	// by says how the device was matched when NVML could not read its
	// UUID ("its NVML handle", "its PCI bus id …", "its minor number …").
	by string
	// outside is what was read of a device no inventory device is (its
	// UUID, or an identity every GPU of the inventory records).
	outside string
	// unread is why NVML could not read the device's UUID; with no
	// devices and no outside, why it could not be identified at all.
	unread error
	// ident is what NVML read of a device it could not identify: its PCI
	// bus id, else its minor number ("" when neither could be read). Two
	// such devices that report the same Xid are told apart by it.
	ident string
}

// eventDevices finds the devices of the inventory (devs) an event concerns.
// The event's device is found by its UUID; when NVML cannot read it (a GPU
// fallen off the bus, Xid 79, is the likeliest to have such an event), by
// the handle the GPU was registered for events by (handles: NVML names the
// device of an event by that handle), else by its PCI bus id or its minor
// number, each where one GPU of the inventory and one only has it. A device
// whose UUID, or another identity every GPU records, matches none is
// outside the inventory; one that nothing could be read of, or whose
// identities the inventory cannot tell, is unidentified (no devices, no
// outside): the caller must not take it for a stranger.
func eventDevices(ev nvml.EventData, devs []Device, handles []watched) eventTarget {
	if ev.Device == nil {
		return eventTarget{unread: errors.New("the event names no device")}
	}
	uuid, ret := ev.Device.GetUUID()
	if ret == nvml.SUCCESS {
		for _, d := range devs {
			if d.UUID == uuid {
				return eventTarget{devices: instanceDevices(ev, d, devs)}
			}
		}
		return eventTarget{outside: "UUID " + uuid}
	}
	errs := []error{fmt.Errorf("its UUID: %w", ret)}
	found := func(d Device, by string) eventTarget {
		return eventTarget{devices: instanceDevices(ev, d, devs), by: by, unread: errs[0]}
	}
	for _, w := range handles {
		if sameHandle(w.handle, ev.Device) {
			return found(w.device, "its NVML handle")
		}
	}
	outside := "" // an identity read that every GPU records and none has
	ident := ""   // what was read of the device, should it stay unidentified
	switch pci, ret := ev.Device.GetPciInfo(); {
	case ret != nvml.SUCCESS:
		errs = append(errs, fmt.Errorf("its PCI bus id: %w", ret))
	default:
		raw := busIDString(pci.BusId)
		bus, ok := devices.NormaliseBusID(raw)
		if raw != "" {
			ident = "PCI bus id " + raw
		}
		if ok {
			ident = "PCI bus id " + bus
		}
		if !ok {
			errs = append(errs, fmt.Errorf("its PCI bus id: NVML gave %q", raw))
			break
		}
		d, n, all := gpuWith(devs, func(d Device) bool { return d.busID == bus }, func(d Device) bool { return d.busID != "" })
		switch {
		case n == 1:
			return found(d, "its PCI bus id "+bus)
		case n > 1:
			errs = append(errs, fmt.Errorf("its PCI bus id %s: more than one GPU of the inventory has it", bus))
		case all:
			outside = "PCI bus id " + bus
		default:
			errs = append(errs, fmt.Errorf("its PCI bus id %s: no GPU of the inventory has it, and some have none recorded", bus))
		}
	}
	switch minor, ret := ev.Device.GetMinorNumber(); {
	case ret != nvml.SUCCESS:
		errs = append(errs, fmt.Errorf("its minor number: %w", ret))
	default:
		if ident == "" {
			ident = fmt.Sprintf("minor number %d", minor)
		}
		d, n, _ := gpuWith(devs, func(d Device) bool { return d.minor == minor }, nil)
		switch {
		case n == 1:
			return found(d, fmt.Sprintf("its minor number %d", minor))
		case n > 1:
			errs = append(errs, fmt.Errorf("its minor number %d: more than one GPU of the inventory has it", minor))
		case outside == "":
			outside = fmt.Sprintf("minor number %d", minor)
		}
	}
	if outside != "" {
		return eventTarget{outside: outside, unread: errs[0]}
	}
	return eventTarget{unread: joinErrors(errs), ident: ident}
}

// gpuWith returns the GPU of devs that match (the last one when several
// do), how many do, and whether every GPU of devs records the identity
// (recorded; nil: every GPU does).
func gpuWith(devs []Device, match, recorded func(Device) bool) (d Device, n int, all bool) {
	all = true
	for _, g := range devs {
		if g.IsMIG() {
			continue
		}
		if recorded != nil && !recorded(g) {
			all = false
		}
		if match(g) {
			d, n = g, n+1
		}
	}
	return d, n, all
}

// sameHandle reports whether a and b are the same NVML device handle:
// go-nvml's handle is a comparable value wrapping NVML's pointer, which is
// the same for a device as long as NVML runs (a mock's is a pointer).
// Handles of types that cannot be compared are never the same.
func sameHandle(a, b nvml.Device) bool {
	if a == nil || b == nil {
		return false
	}
	ta := reflect.TypeOf(a)
	return ta == reflect.TypeOf(b) && ta.Comparable() && a == b
}

// busIDString is NVML's NUL-terminated PCI bus id as a string. A bus id is
// ASCII: a byte outside it ends the string, which then reads as no bus id.
func busIDString(raw [32]int8) string {
	b := make([]byte, 0, len(raw))
	for _, c := range raw {
		if c <= 0 {
			break
		}
		b = append(b, byte(c))
	}
	return string(b)
}

// instanceDevices maps an event of device d to the devices it concerns. An
// event of a GPU in MIG mode names a GPU instance and a compute instance:
// the MIG device of that pair, or, with compute instance noInstance (the
// fault is the GPU instance's, NVML cannot pin it on one compute
// instance), every MIG device of that GPU instance, since they share its
// memory and engines. With GPU instance noInstance, or ids no MIG device of
// the inventory has, it is the GPU's: the GPU is unhealthy, and so each of
// its instances (Health).
func instanceDevices(ev nvml.EventData, d Device, devs []Device) []Device {
	if d.IsMIG() {
		return []Device{d} // a driver that reports the instance itself
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
	return out
}

// unidentifiedFinding is the unhealthy finding of a critical Xid whose
// device could not be identified (why): no device can be cordoned, so the
// operator is told to find it and cordon it by hand.
func unidentifiedFinding(xid uint64, why error) Finding {
	return Finding{Kind: KindUnhealthy, Device: unidentifiedDevice, Xid: xid,
		Message: fmt.Sprintf("%s reported critical Xid %d: NVML could not tell which GPU (%v), so no GPU was cordoned and "+
			"new claims may land on the failing one. Find it: run nvidia-smi (a GPU fallen off the bus is missing or shows ERR!) "+
			"and check the kernel log (dmesg | grep -i xid names its PCI bus id); then cordon it by hand: "+
			"sudo gpu-guard-ctl cordon GPU --reason \"Xid %d\". Reported until nri-gpu-guard restarts",
			unidentifiedName, xid, why, xid)}
}
