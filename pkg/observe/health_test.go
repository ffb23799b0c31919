// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package observe

import (
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
	devs := DevicesOf([]devices.GPU{
		{Index: 0, UUID: gpu, MIG: []devices.MIG{
			{Index: 0, UUID: mig(0), GI: 1, CI: 0},
			{Index: 1, UUID: mig(1), GI: 1, CI: 1},
			{Index: 2, UUID: mig(2), GI: 2, CI: 0},
		}},
		{Index: 1, UUID: other, Minor: 1},
	})
	dev := func(uuid string) nvml.Device {
		return &mock.Device{GetUUIDFunc: func() (string, nvml.Return) { return uuid, nvml.SUCCESS }}
	}
	for _, tc := range []struct {
		name   string
		dev    nvml.Device
		gi, ci uint32
		want   []string // device indices; nil: not in the inventory
	}{
		{"one compute instance", dev(gpu), 1, 1, []string{"0:1"}},
		{"a GPU instance: each of its compute instances", dev(gpu), 1, noInstance, []string{"0:0", "0:1"}},
		{"a GPU instance of one compute instance", dev(gpu), 2, noInstance, []string{"0:2"}},
		{"the whole GPU", dev(gpu), noInstance, noInstance, []string{"0"}},
		{"ids no instance has: the GPU", dev(gpu), 7, noInstance, []string{"0"}},
		{"a GPU not in MIG mode", dev(other), noInstance, noInstance, []string{"1"}},
		{"a MIG handle", dev(mig(2)), 2, 0, []string{"0:2"}},
		{"not in the inventory", dev("GPU-00000000-0000-4000-8000-0000000000ff"), noInstance, noInstance, nil},
		{"no device", nil, noInstance, noInstance, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ev := nvml.EventData{Device: tc.dev, EventType: nvml.EventTypeXidCriticalError, EventData: 48,
				GpuInstanceId: tc.gi, ComputeInstanceId: tc.ci}
			got, ok := eventDevices(ev, devs)
			assert.Equal(t, tc.want != nil, ok)
			var idx []string
			for _, d := range got {
				idx = append(idx, d.Index)
			}
			assert.Equal(t, tc.want, idx)
		})
	}
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
