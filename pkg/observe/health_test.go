// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package observe

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// xidEvent is a critical-Xid event on GPU dev (all instances).
func xidEvent(dev nvml.Device, xid uint64) nvml.EventData {
	return nvml.EventData{Device: dev, EventType: nvml.EventTypeXidCriticalError, EventData: xid,
		GpuInstanceId: noInstance, ComputeInstanceId: noInstance}
}

func unhealthyChan(o *Options) chan Finding {
	ch := make(chan Finding, 16)
	o.OnUnhealthy = func(f Finding) { ch <- f }
	return ch
}

func TestCriticalXidMarksUnhealthy(t *testing.T) {
	h := newMockA100(t)
	var ch chan Finding
	o, logs := newObserver(t, h, newFakeProc(t, 1000), &holdings{}, func(o *Options) { ch = unhealthyChan(o) })
	startRun(t, o)

	// Events are handled in order by one goroutine: by the time the Xid 79
	// finding arrives, the two events before it have been judged.
	h.events <- xidEvent(h.srv.Devices[4], 13) // application error: not in xids
	h.events <- nvml.EventData{Device: h.srv.Devices[4], EventType: nvml.EventTypeSingleBitEccError}
	h.events <- xidEvent(h.srv.Devices[3], 79)
	f := testwait.Receive(t, ch, "unhealthy finding")
	assert.Equal(t, KindUnhealthy, f.Kind)
	assert.Equal(t, "3", f.Device.Index)
	assert.Equal(t, h.uuid(3), f.Device.UUID)
	assert.EqualValues(t, 79, f.Xid)
	assert.Equal(t, 2026, f.Time.Year(), "stamped with the observer's clock")
	assert.Contains(t, f.Message, "GPU 3 ("+h.uuid(3)+") reported critical Xid 79")
	assert.Contains(t, f.Message, "its holder keeps its claim")

	_, ok := o.Health(h.uuid(4))
	assert.False(t, ok, "non-critical Xid 13 is ignored")
	assert.Contains(t, logs.String(), "Xid not in observe.xids")
	got, ok := o.Health(h.uuid(3))
	require.True(t, ok)
	assert.EqualValues(t, 79, got.Xid)
	require.Len(t, o.Unhealthy(), 1)

	// A second critical Xid on the same GPU keeps the first reason and does
	// not notify again; another GPU is notified.
	h.events <- xidEvent(h.srv.Devices[3], 48)
	h.events <- xidEvent(h.srv.Devices[6], 95)
	f = testwait.Receive(t, ch, "second unhealthy finding")
	assert.Equal(t, "6", f.Device.Index)
	got, _ = o.Health(h.uuid(3))
	assert.EqualValues(t, 79, got.Xid)
}

func TestXidOnMIGInstance(t *testing.T) {
	h := newMockH100MIG(t)
	var ch chan Finding
	o, _ := newObserver(t, h, newFakeProc(t, 1000), &holdings{}, func(o *Options) { ch = unhealthyChan(o) })
	startRun(t, o)

	ev := xidEvent(h.srv.Devices[1], 48)
	ev.GpuInstanceId, ev.ComputeInstanceId = 2, 0 // the second instance: MIG 1:1
	h.events <- ev
	f := testwait.Receive(t, ch, "unhealthy MIG")
	assert.Equal(t, "1:1", f.Device.Index)
	assert.Equal(t, h.migUUID(1, 1), f.Device.UUID)
	_, ok := o.Health(h.migUUID(1, 0))
	assert.False(t, ok, "a sibling instance stays healthy")

	// An event for the whole GPU in MIG mode marks the GPU, and so every
	// instance of it.
	h.events <- xidEvent(h.srv.Devices[1], 79)
	f = testwait.Receive(t, ch, "unhealthy GPU")
	assert.Equal(t, "1", f.Device.Index)
	_, ok = o.Health(h.migUUID(1, 3))
	assert.True(t, ok)
}

// An Xid of a GPU instance as a whole (compute instance "all") makes every
// compute instance of it unhealthy, and no other GPU instance.
func TestXidOfAGPUInstanceMarksEachComputeInstance(t *testing.T) {
	h := newMockH100MIG(t)
	// MIG 1:0 and 1:1 are compute instances 0 and 1 of GPU instance 1;
	// 1:3 is GPU instance 3's.
	h.gpus[1].MIG[1].GI, h.gpus[1].MIG[1].CI = 1, 1
	var ch chan Finding
	o, _ := newObserver(t, h, newFakeProc(t, 1000), &holdings{}, func(o *Options) { ch = unhealthyChan(o) })
	startRun(t, o)

	ev := xidEvent(h.srv.Devices[1], 48)
	ev.GpuInstanceId = 1 // ComputeInstanceId stays noInstance
	h.events <- ev
	got := map[string]bool{}
	for range 2 {
		f := testwait.Receive(t, ch, "unhealthy compute instance")
		assert.EqualValues(t, 48, f.Xid)
		got[f.Device.Index] = true
	}
	assert.Equal(t, map[string]bool{"1:0": true, "1:1": true}, got)
	for _, n := range []int{0, 1} {
		_, ok := o.Health(h.migUUID(1, n))
		assert.True(t, ok, "MIG 1:%d", n)
	}
	_, ok := o.Health(h.migUUID(1, 3))
	assert.False(t, ok, "another GPU instance stays healthy")
	_, ok = o.Health(h.uuid(0))
	assert.False(t, ok)
}

func TestEventDevices(t *testing.T) {
	gpu, other := "GPU-00000000-0000-4000-8000-000000000001", "GPU-00000000-0000-4000-8000-000000000002"
	mig := func(n int) string { return fmt.Sprintf("MIG-00000000-0000-4000-8000-0000000000a%d", n) }
	gpus := []devices.GPU{
		{Index: 0, UUID: gpu, BusID: "0000:07:00.0", MIG: []devices.MIG{
			{Index: 0, UUID: mig(0), GI: 1, CI: 0},
			{Index: 1, UUID: mig(1), GI: 1, CI: 1},
			{Index: 2, UUID: mig(2), GI: 2, CI: 0},
		}},
		{Index: 1, UUID: other, Minor: 1, BusID: "0000:08:00.0"},
	}
	devs := DevicesOf(gpus)
	dev := func(uuid string) nvml.Device {
		return &mock.Device{GetUUIDFunc: func() (string, nvml.Return) { return uuid, nvml.SUCCESS }}
	}
	// lost is a device NVML cannot read the UUID of (fallen off the bus);
	// bus "" and minor < 0: those cannot be read either.
	lost := func(bus string, minor int) nvml.Device {
		return &mock.Device{
			GetUUIDFunc: func() (string, nvml.Return) { return "", nvml.ERROR_GPU_IS_LOST },
			GetPciInfoFunc: func() (nvml.PciInfo, nvml.Return) {
				if bus == "" {
					return nvml.PciInfo{}, nvml.ERROR_GPU_IS_LOST
				}
				var p nvml.PciInfo
				for i, c := range bus {
					p.BusId[i] = int8(c)
				}
				return p, nvml.SUCCESS
			},
			GetMinorNumberFunc: func() (int, nvml.Return) {
				if minor < 0 {
					return 0, nvml.ERROR_GPU_IS_LOST
				}
				return minor, nvml.SUCCESS
			},
		}
	}
	registered := lost("", -1) // the handle GPU 0 was registered by
	handles := []watched{{device: devs[0], handle: registered}}
	for _, tc := range []struct {
		name    string
		dev     nvml.Device
		gi, ci  uint32
		want    []string // device indices
		by      string   // how a device whose UUID is unreadable was matched
		outside string   // not in the inventory: what was read of it
	}{
		{name: "one compute instance", dev: dev(gpu), gi: 1, ci: 1, want: []string{"0:1"}},
		{name: "a GPU instance: each of its compute instances", dev: dev(gpu), gi: 1, ci: noInstance, want: []string{"0:0", "0:1"}},
		{name: "a GPU instance of one compute instance", dev: dev(gpu), gi: 2, ci: noInstance, want: []string{"0:2"}},
		{name: "the whole GPU", dev: dev(gpu), gi: noInstance, ci: noInstance, want: []string{"0"}},
		{name: "ids no instance has: the GPU", dev: dev(gpu), gi: 7, ci: noInstance, want: []string{"0"}},
		{name: "a GPU not in MIG mode", dev: dev(other), gi: noInstance, ci: noInstance, want: []string{"1"}},
		{name: "a MIG handle", dev: dev(mig(2)), gi: 2, ci: 0, want: []string{"0:2"}},
		{name: "not in the inventory", dev: dev("GPU-00000000-0000-4000-8000-0000000000ff"), gi: noInstance, ci: noInstance,
			outside: "UUID GPU-00000000-0000-4000-8000-0000000000ff"},
		{name: "UUID unreadable: the handle it was registered by", dev: registered, gi: 1, ci: 1,
			want: []string{"0:1"}, by: "its NVML handle"},
		{name: "UUID unreadable: its PCI bus id", dev: lost("00000000:08:00.0", -1), gi: noInstance, ci: noInstance,
			want: []string{"1"}, by: "its PCI bus id 0000:08:00.0"},
		{name: "UUID unreadable: its minor number", dev: lost("", 1), gi: noInstance, ci: noInstance,
			want: []string{"1"}, by: "its minor number 1"},
		{name: "UUID unreadable, PCI bus id of no GPU", dev: lost("0000:0a:00.0", -1), gi: noInstance, ci: noInstance,
			outside: "PCI bus id 0000:0a:00.0"},
		{name: "UUID unreadable, minor number of no GPU", dev: lost("", 9), gi: noInstance, ci: noInstance,
			outside: "minor number 9"},
		{name: "nothing readable", dev: lost("", -1), gi: noInstance, ci: noInstance},
		{name: "no device", gi: noInstance, ci: noInstance},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ev := nvml.EventData{Device: tc.dev, EventType: nvml.EventTypeXidCriticalError, EventData: 48,
				GpuInstanceId: tc.gi, ComputeInstanceId: tc.ci}
			got := eventDevices(ev, devs, handles)
			var idx []string
			for _, d := range got.devices {
				idx = append(idx, d.Index)
			}
			assert.Equal(t, tc.want, idx)
			assert.Equal(t, tc.by, got.by)
			assert.Equal(t, tc.outside, got.outside)
			if tc.want == nil && tc.outside == "" {
				assert.Error(t, got.unread, "unidentified: it says why")
			}
		})
	}

	// An identity some GPUs of the inventory do not record proves nothing
	// when it matches none: the device is unidentified, not a stranger.
	gpus[0].BusID = ""
	got := eventDevices(nvml.EventData{Device: lost("0000:0a:00.0", -1), EventType: nvml.EventTypeXidCriticalError,
		EventData: 79, GpuInstanceId: noInstance, ComputeInstanceId: noInstance}, DevicesOf(gpus), nil)
	assert.Empty(t, got.devices)
	assert.Empty(t, got.outside)
	assert.ErrorContains(t, got.unread, "its UUID: ERROR_GPU_IS_LOST; its PCI bus id 0000:0a:00.0: no GPU of the inventory has it, and some have none recorded; its minor number: ERROR_GPU_IS_LOST")
}

func TestHealthWatcherRetriesNVMLErrors(t *testing.T) {
	h := newMockA100(t)
	h.createOK = 3 // EventSetCreate fails twice
	var ch chan Finding
	o, logs := newObserver(t, h, newFakeProc(t, 1000), &holdings{}, func(o *Options) { ch = unhealthyChan(o) })
	startRun(t, o)

	h.events <- xidEvent(h.srv.Devices[2], 79)
	f := testwait.Receive(t, ch, "unhealthy after retries")
	assert.Equal(t, "2", f.Device.Index)
	h.mu.Lock()
	assert.Equal(t, 3, h.creates)
	h.mu.Unlock()
	assert.Contains(t, logs.String(), "NVML health events failed; retrying")
	assert.Contains(t, logs.String(), "create an NVML event set: ERROR_UNKNOWN")

	// A failed wait frees the set and starts over with a new one.
	h.waitErr <- nvml.ERROR_UNKNOWN
	h.events <- xidEvent(h.srv.Devices[5], 79)
	f = testwait.Receive(t, ch, "unhealthy after a failed wait")
	assert.Equal(t, "5", f.Device.Index)
	h.mu.Lock()
	assert.Equal(t, 4, h.creates)
	assert.GreaterOrEqual(t, h.frees, 1)
	h.mu.Unlock()
	assert.Contains(t, logs.String(), "wait for NVML events: ERROR_UNKNOWN")
}

// The back-off of the health watcher starts over after a watch that ran: a
// failure after a working watch is retried after RetryMin, not after the
// back-off that failures before it had reached.
func TestHealthWatcherBackoffStartsOverAfterAWatchRan(t *testing.T) {
	h := newMockA100(t)
	h.createOK = 3 // EventSetCreate fails twice: back-off 1ms, 2ms, then 4ms (RetryMax)
	var ch chan Finding
	o, logs := newObserver(t, h, newFakeProc(t, 1000), &holdings{}, func(o *Options) { ch = unhealthyChan(o) })
	startRun(t, o)

	h.events <- xidEvent(h.srv.Devices[2], 79)
	testwait.Receive(t, ch, "unhealthy from a working watch")
	h.waitErr <- nvml.ERROR_UNKNOWN
	// The next watch has started once it reports: the retry was logged.
	h.events <- xidEvent(h.srv.Devices[5], 79)
	testwait.Receive(t, ch, "unhealthy after the failed wait")
	var retries []string
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, "NVML health events failed; retrying") {
			retries = append(retries, line)
		}
	}
	require.Len(t, retries, 3, "%s", logs.String())
	assert.Contains(t, retries[0], "retry_in=1ms")
	assert.Contains(t, retries[1], "retry_in=2ms")
	assert.Contains(t, retries[2], "wait for NVML events: ERROR_UNKNOWN")
	assert.Contains(t, retries[2], "retry_in=1ms", "the watch ran: the back-off starts over")
}

// A GPU whose registration for Xid events failed is registered again while
// the other GPUs are watched (the watch is not restarted for it), with
// back-off; one that does not support Xid events is not.
func TestFailedXidRegistrationIsRetried(t *testing.T) {
	h := newMockA100(t)
	calls, registered := 0, make(chan struct{})
	h.srv.Devices[2].(*mockDevice).RegisterEventsFunc = func(uint64, nvml.EventSet) nvml.Return {
		// Called from the watcher goroutine only.
		calls++
		if calls < 3 {
			return nvml.ERROR_UNKNOWN // transient
		}
		close(registered)
		return nvml.SUCCESS
	}
	unsupported := 0
	h.srv.Devices[3].(*mockDevice).RegisterEventsFunc = func(uint64, nvml.EventSet) nvml.Return {
		unsupported++
		return nvml.ERROR_NOT_SUPPORTED
	}
	var ch chan Finding
	o, logs := newObserver(t, h, newFakeProc(t, 1000), &holdings{}, func(o *Options) { ch = unhealthyChan(o) })
	startRun(t, o)

	testwait.Receive(t, registered, "GPU 2 registered again")
	// GPU 3 would have been retried with GPU 2's first retry (same
	// back-off), which returned before this one started.
	h.events <- xidEvent(h.srv.Devices[2], 79)
	f := testwait.Receive(t, ch, "Xid on the GPU registered late")
	assert.Equal(t, "2", f.Device.Index)
	assert.Equal(t, 1, unsupported, "a GPU without Xid events is not retried")
	h.mu.Lock()
	assert.Equal(t, 1, h.creates, "the watch was not restarted for it")
	h.mu.Unlock()
	assert.Contains(t, logs.String(), "GPU health is not watched; retrying")
	assert.Contains(t, logs.String(), "GPU health is still not watched; retrying")
	assert.Contains(t, logs.String(), "GPU health is watched again")
	assert.Contains(t, logs.String(), "GPU health is not watched: the GPU does not support Xid events")
}

func TestLostDeviceAtRegistrationIsUnhealthy(t *testing.T) {
	h := newMockA100(t)
	h.set(h.lost, h.uuid(7), nvml.ERROR_GPU_IS_LOST)
	h.srv.Devices[2].(*mockDevice).RegisterEventsFunc = func(uint64, nvml.EventSet) nvml.Return {
		return nvml.ERROR_NOT_SUPPORTED
	}
	var ch chan Finding
	o, logs := newObserver(t, h, newFakeProc(t, 1000), &holdings{}, func(o *Options) { ch = unhealthyChan(o) })
	startRun(t, o)

	f := testwait.Receive(t, ch, "lost GPU")
	assert.Equal(t, "7", f.Device.Index)
	assert.Zero(t, f.Xid)
	assert.Contains(t, f.Message, "ERROR_GPU_IS_LOST")
	// GPU 2 cannot be watched: logged, not unhealthy; the others are watched.
	h.events <- xidEvent(h.srv.Devices[0], 79)
	f = testwait.Receive(t, ch, "Xid on a watched GPU")
	assert.Equal(t, "0", f.Device.Index)
	_, ok := o.Health(h.uuid(2))
	assert.False(t, ok)
	assert.Contains(t, logs.String(), "GPU health is not watched")
}

func TestRunReportsEveryInterval(t *testing.T) {
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	fp.addIn(200, 20, idB)
	h.run(h.uuid(1), 200, 0)
	reports := make(chan Report, 4)
	o, logs := newObserver(t, h, fp, &holdings{}, func(o *Options) {
		o.Interval = 1e6 // 1ms
		o.OnReport = func(r Report) {
			select {
			case reports <- r:
			default:
			}
		}
	})
	startRun(t, o)
	r := testwait.Receive(t, reports, "first report")
	require.Len(t, r.Problems(), 1)
	assert.Equal(t, KindIntruder, r.Problems()[0].Kind)
	testwait.Receive(t, reports, "second report")
	assert.Contains(t, logs.String(), "GPU process not explained by the ledger")
	assert.Contains(t, logs.String(), "pid=200")
}

func TestXidFromMIGHandleAndUnknownDevice(t *testing.T) {
	h := newMockH100MIG(t)
	var ch chan Finding
	o, logs := newObserver(t, h, newFakeProc(t, 1000), &holdings{}, func(o *Options) { ch = unhealthyChan(o) })
	startRun(t, o)

	stranger := &mockDevice{}
	stranger.GetUUIDFunc = func() (string, nvml.Return) { return "GPU-00000000-0000-4000-8000-0000000000ff", nvml.SUCCESS }
	h.events <- xidEvent(stranger, 79)
	h.events <- xidEvent(h.migs[h.uuid(1)][2], 95) // the MIG handle of 1:3
	f := testwait.Receive(t, ch, "unhealthy MIG")
	assert.Equal(t, "1:3", f.Device.Index)
	assert.Contains(t, logs.String(), "Xid event from a device outside the inventory")
	assert.Len(t, o.Unhealthy(), 1, "an unknown device marks nothing")
}

// A GPU fallen off the bus (Xid 79) may no longer tell NVML its UUID: its
// Xid event is still matched to the inventory's GPU, by the handle the GPU
// was registered for events by, else by its PCI bus id, and the GPU is
// unhealthy, named by the inventory's index and UUID.
func TestXidFromADeviceWhoseUUIDIsUnreadable(t *testing.T) {
	h := newMockA100(t)
	for i := range h.gpus {
		h.gpus[i].BusID = h.srv.Devices[i].(*mockDevice).PciBusID
	}
	h.srv.Devices[3].(*mockDevice).GetUUIDFunc = func() (string, nvml.Return) { return "", nvml.ERROR_GPU_IS_LOST }
	// Another handle of GPU 5 than the one it was registered by, which can
	// tell its PCI bus id only.
	other := &mockDevice{}
	other.GetUUIDFunc = func() (string, nvml.Return) { return "", nvml.ERROR_GPU_IS_LOST }
	other.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) {
		var p nvml.PciInfo
		for i, c := range "00000000:05:00.0" {
			p.BusId[i] = int8(c)
		}
		return p, nvml.SUCCESS
	}
	var ch chan Finding
	o, logs := newObserver(t, h, newFakeProc(t, 1000), &holdings{}, func(o *Options) { ch = unhealthyChan(o) })
	startRun(t, o)

	h.events <- xidEvent(h.srv.Devices[3], 79)
	f := testwait.Receive(t, ch, "unhealthy GPU 3")
	assert.Equal(t, "3", f.Device.Index)
	assert.Equal(t, h.uuid(3), f.Device.UUID)
	assert.EqualValues(t, 79, f.Xid)
	assert.Contains(t, f.Message, "GPU 3 ("+h.uuid(3)+") reported critical Xid 79")
	h.events <- xidEvent(other, 79)
	f = testwait.Receive(t, ch, "unhealthy GPU 5")
	assert.Equal(t, "5", f.Device.Index)
	assert.Equal(t, h.uuid(5), f.Device.UUID)

	for _, n := range []int{3, 5} {
		_, ok := o.Health(h.uuid(n))
		assert.True(t, ok, "GPU %d takes no new claims", n)
	}
	assert.NotContains(t, logs.String(), "outside the inventory")
	assert.Contains(t, logs.String(), "matched to the inventory by its NVML handle")
	assert.Contains(t, logs.String(), "matched to the inventory by its PCI bus id 0000:05:00.0")
}

// A critical Xid from a device nothing can be read of (no UUID, no PCI bus
// id, no minor number) and whose handle is none the watch registered is no
// stranger's: it is an unhealthy finding on an unidentified device in every
// report, its device's notice (NotInInventory, not Error: no listing
// failed) saying what to do, and an error in the log.
// No device is marked unhealthy: there is none to cordon.
func TestXidFromAnUnidentifiedDevice(t *testing.T) {
	h := newMockA100(t)
	unknown := &mockDevice{}
	unknown.GetUUIDFunc = func() (string, nvml.Return) { return "", nvml.ERROR_GPU_IS_LOST }
	unknown.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) { return nvml.PciInfo{}, nvml.ERROR_GPU_IS_LOST }
	unknown.GetMinorNumberFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_GPU_IS_LOST }
	var ch chan Finding
	o, logs := newObserver(t, h, newFakeProc(t, 1000), &holdings{}, func(o *Options) { ch = unhealthyChan(o) })
	startRun(t, o)

	h.events <- xidEvent(unknown, 79)
	h.events <- xidEvent(unknown, 79) // the same Xid again: one entry
	h.events <- xidEvent(unknown, 13) // not critical: ignored
	// Events are handled in order: once GPU 0's finding arrives, those
	// before it have been.
	h.events <- xidEvent(h.srv.Devices[0], 48)
	assert.Equal(t, "0", testwait.Receive(t, ch, "unhealthy GPU 0").Device.Index)

	r, err := o.Account(context.Background())
	require.NoError(t, err)
	var un []Finding
	for _, f := range r.Problems() {
		if f.Device.UUID == "" {
			un = append(un, f)
		}
	}
	require.Len(t, un, 1, "%+v", r.Problems())
	f := un[0]
	assert.Equal(t, KindUnhealthy, f.Kind)
	assert.EqualValues(t, 79, f.Xid)
	assert.Equal(t, 2026, f.Time.Year(), "stamped with the observer's clock")
	assert.Contains(t, f.Message, "an unidentified GPU reported critical Xid 79")
	assert.Contains(t, f.Message, "its UUID: ERROR_GPU_IS_LOST")
	var dr []DeviceReport
	for _, d := range r.Devices {
		if d.Device.UUID == "" {
			dr = append(dr, d)
		}
	}
	require.Len(t, dr, 1)
	assert.Equal(t, "an unidentified GPU", dr[0].Device.String())
	assert.True(t, strings.HasPrefix(dr[0].NotInInventory, "reported critical Xid 79: "), "read after the device's name: %s", dr[0].NotInInventory)
	for _, want := range []string{"critical Xid 79", "no GPU was cordoned", "nvidia-smi", "dmesg", "sudo gpu-guard-ctl cordon"} {
		assert.Contains(t, dr[0].NotInInventory, want, "the report says what to do")
	}
	assert.Empty(t, dr[0].Error, "no listing failed: it is no device NVML could not list")
	assert.Equal(t, []string{h.uuid(0)}, uuidsOf(o.Unhealthy()), "only an identified device is marked unhealthy")

	assert.NotContains(t, logs.String(), "outside the inventory")
	var errs []string
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, "level=ERROR") && strings.Contains(line, "cannot identify") {
			errs = append(errs, line)
		}
	}
	require.Len(t, errs, 2, "each event is logged as an error:\n%s", logs.String())
	assert.Contains(t, errs[0], "xid=79")
	assert.Contains(t, errs[0], "gpu-guard-ctl cordon")
	assert.Contains(t, logs.String(), "Xid not in observe.xids from a device NVML cannot identify")

	// Every report lists it.
	r, err = o.Account(context.Background())
	require.NoError(t, err)
	require.NotEmpty(t, r.Findings)
	assert.Empty(t, r.Findings[0].Device.UUID)
	assert.EqualValues(t, 79, r.Findings[0].Xid)
}

// A critical Xid from a device NVML cannot identify is handed to
// OnUnidentified, once per Xid code (the first event of each), whatever the
// interval: the caller records it (the daemon audits it), as nothing else
// outlives the observer. No device is marked unhealthy for it.
func TestUnidentifiedXidCalledBackOncePerCode(t *testing.T) {
	h := newMockA100(t)
	unknown := &mockDevice{}
	unknown.GetUUIDFunc = func() (string, nvml.Return) { return "", nvml.ERROR_GPU_IS_LOST }
	unknown.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) { return nvml.PciInfo{}, nvml.ERROR_GPU_IS_LOST }
	unknown.GetMinorNumberFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_GPU_IS_LOST }
	got := make(chan Finding, 16)
	var unhealthy chan Finding
	o, _ := newObserver(t, h, newFakeProc(t, 1000), &holdings{}, func(o *Options) {
		o.Interval = 0 // health only: no report ever
		unhealthy = unhealthyChan(o)
		o.OnUnidentified = func(f Finding) { got <- f }
	})
	startRun(t, o)

	h.events <- xidEvent(unknown, 79)
	h.events <- xidEvent(unknown, 79) // the same Xid again: not again
	h.events <- xidEvent(unknown, 13) // not critical: ignored
	h.events <- xidEvent(unknown, 48)
	f := testwait.Receive(t, got, "the unidentified Xid 79")
	assert.EqualValues(t, 79, f.Xid)
	assert.Equal(t, KindUnhealthy, f.Kind)
	assert.Empty(t, f.Device.UUID)
	assert.Contains(t, f.Message, "an unidentified GPU reported critical Xid 79")
	assert.Contains(t, f.Message, "sudo gpu-guard-ctl cordon")
	// Callbacks come in the order found: the second 79 would precede 48.
	assert.EqualValues(t, 48, testwait.Receive(t, got, "the unidentified Xid 48").Xid)
	h.events <- xidEvent(h.srv.Devices[0], 48)
	assert.Equal(t, "0", testwait.Receive(t, unhealthy, "unhealthy GPU 0").Device.Index)
	select {
	case f := <-got:
		t.Fatalf("unexpected callback %+v", f)
	default:
	}
	assert.Equal(t, []string{h.uuid(0)}, uuidsOf(o.Unhealthy()), "only an identified device is marked unhealthy")
}

func uuidsOf(fs []Finding) []string {
	var out []string
	for _, f := range fs {
		out = append(out, f.Device.UUID)
	}
	return out
}
