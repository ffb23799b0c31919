// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package observe

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
)

// findings returns the report's findings of kind k, by pid.
func findings(r Report, k Kind) map[int]Finding {
	out := map[int]Finding{}
	for _, f := range r.Findings {
		if f.Kind == k {
			out[f.PID] = f
		}
	}
	return out
}

// cancelOnWait is a context that ends the moment someone waits on it: a
// query holding it gives up exactly when it would start to wait.
type cancelOnWait struct {
	context.Context
	once sync.Once
	ch   chan struct{}
	done atomic.Bool
}

func newCancelOnWait() *cancelOnWait {
	return &cancelOnWait{Context: context.Background(), ch: make(chan struct{})}
}

func (c *cancelOnWait) Done() <-chan struct{} {
	c.once.Do(func() { c.done.Store(true); close(c.ch) })
	return c.ch
}

func (c *cancelOnWait) Err() error {
	if c.done.Load() {
		return context.Canceled
	}
	return nil
}

func TestIntruderOnHeldGPU(t *testing.T) {
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	fp.addIn(100, 10, idA) // the holder's own process
	fp.addIn(200, 20, idB) // a container the guard never admitted
	fp.add(300, 30, "0::/user.slice/user-0.slice/session-2.scope\n")
	h.run(h.uuid(0), 100, 1<<30)
	h.run(h.uuid(0), 200, 2<<30)
	h.runGraphics(h.uuid(0), 300)
	ledger := &holdings{{DeviceUUID: h.uuid(0), ContainerID: idA, Name: "ml/trainer-0/main"}}
	o, _ := newObserver(t, h, fp, ledger, nil)

	r, err := o.Account(context.Background())
	require.NoError(t, err)
	require.Len(t, r.Findings, 2, "%+v", r.Findings)
	in := findings(r, KindIntruder)
	require.Contains(t, in, 200)
	f := in[200]
	assert.Equal(t, idB, f.ContainerID)
	assert.Equal(t, idA, f.Holder)
	assert.Equal(t, "0", f.Device.Index)
	assert.Equal(t, h.uuid(0), f.Device.UUID)
	assert.Contains(t, f.Message, "pid 200 (container "+idB[:12]+")")
	assert.Contains(t, f.Message, "GPU 0 ("+h.uuid(0)+")")
	assert.Contains(t, f.Message, "held by ml/trainer-0/main (container "+idA[:12]+")")
	assert.Contains(t, f.Message, "does not kill")
	assert.EqualValues(t, 20, f.StartTicks, "the finding names its process's start, not only its pid")
	require.Contains(t, in, 300)
	assert.Empty(t, in[300].ContainerID)
	assert.EqualValues(t, 30, in[300].StartTicks)
	assert.Contains(t, in[300].Message, "pid 300 (host process)")

	// The device report shows all three, typed and mapped.
	d0 := r.Devices[0]
	assert.Equal(t, idA, d0.Holder)
	byPID := map[int]Process{}
	for _, p := range d0.Processes {
		byPID[p.PID] = p
	}
	assert.Equal(t, "C", byPID[100].Type)
	assert.EqualValues(t, 1<<30, byPID[100].UsedMemoryBytes)
	assert.Equal(t, idA, byPID[100].ContainerID)
	assert.Equal(t, "G", byPID[300].Type)
	assert.Zero(t, byPID[300].UsedMemoryBytes, "NVML's 'not available' is not 16 EiB")
	for _, d := range r.Devices[1:] {
		assert.Empty(t, d.Processes, "%s", d.Device)
	}
}

func TestIntruderOnFreeGPU(t *testing.T) {
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	fp.addIn(200, 20, idB)
	h.run(h.uuid(3), 200, 0)
	h.runGraphics(h.uuid(3), 200) // one process on both engines is one finding
	o, _ := newObserver(t, h, fp, &holdings{}, nil)

	r, err := o.Account(context.Background())
	require.NoError(t, err)
	require.Len(t, r.Findings, 1)
	f := r.Findings[0]
	assert.Equal(t, KindIntruder, f.Kind)
	assert.Empty(t, f.Holder)
	assert.Equal(t, "3", f.Device.Index)
	assert.Contains(t, f.Message, "GPU 3 ("+h.uuid(3)+"), which is free")
	assert.Equal(t, "C+G", r.Devices[3].Processes[0].Type)
}

// A container of an exempt namespace (AnyDevice) may use any GPU without a
// claim: its processes are no finding, on a free or a held GPU; another
// container's are.
func TestExemptContainerIsNoIntruder(t *testing.T) {
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	fp.addIn(200, 20, idB) // the exempt monitoring agent
	fp.addIn(300, 30, idC)
	h.run(h.uuid(3), 200, 0)
	h.run(h.uuid(1), 200, 0) // held by A
	h.run(h.uuid(2), 300, 0)
	ledger := &holdings{
		{DeviceUUID: h.uuid(1), ContainerID: idA},
		{ContainerID: idB, AnyDevice: true},
	}
	o, _ := newObserver(t, h, fp, ledger, nil)
	r, err := o.Account(context.Background())
	require.NoError(t, err)
	require.Len(t, r.Findings, 1, "%+v", r.Findings)
	assert.Equal(t, KindIntruder, r.Findings[0].Kind)
	assert.Equal(t, 300, r.Findings[0].PID)
	assert.Equal(t, idA, r.Devices[1].Holder, "an exempt container holds no device")
	assert.Empty(t, r.Devices[3].Holder)
}

func TestOutOfBoundsHolder(t *testing.T) {
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	fp.addIn(100, 10, idA)
	fp.addIn(101, 11, idA)
	h.run(h.uuid(1), 100, 0) // held by C
	h.run(h.uuid(2), 101, 0) // free
	ledger := &holdings{
		{DeviceUUID: h.uuid(0), ContainerID: idA},
		{DeviceUUID: h.uuid(1), ContainerID: idC},
	}
	o, _ := newObserver(t, h, fp, ledger, nil)

	r, err := o.Account(context.Background())
	require.NoError(t, err)
	oob := findings(r, KindOutOfBounds)
	require.Len(t, oob, 2)
	assert.Empty(t, findings(r, KindIntruder), "a holder out of bounds is not an anonymous intruder")
	assert.Equal(t, idC, oob[100].Holder)
	assert.Contains(t, oob[100].Message, "pid 100 of container "+idA[:12]+" runs on GPU 1 ("+h.uuid(1)+"), held by container "+idC[:12])
	assert.Contains(t, oob[100].Message, "claimed only "+h.uuid(0))
	assert.Empty(t, oob[101].Holder)
	assert.Contains(t, oob[101].Message, "which is free")
}

func TestHolderMatchedByCgroup(t *testing.T) {
	// The hook front end may know the holder's cgroup; a process in it (or
	// below it) whose path names no container id is still the holder's.
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	fp.add(100, 10, "0::/custom/job-7/worker\n")
	fp.add(101, 11, "0::/custom/job-70\n")
	h.run(h.uuid(0), 100, 0)
	h.run(h.uuid(0), 101, 0)
	ledger := &holdings{{DeviceUUID: h.uuid(0), ContainerID: idA, CgroupPath: "/custom/job-7"}}
	o, _ := newObserver(t, h, fp, ledger, nil)

	r, err := o.Account(context.Background())
	require.NoError(t, err)
	in := findings(r, KindIntruder)
	assert.NotContains(t, in, 100)
	assert.Contains(t, in, 101, "a sibling cgroup with a common prefix is not the holder's")
}

func TestMIGInstances(t *testing.T) {
	h := newMockH100MIG(t)
	fp := newFakeProc(t, 1000)
	fp.addIn(100, 10, idA)
	fp.addIn(101, 10, idA)
	fp.addIn(200, 20, idB)
	fp.addIn(300, 30, idC)
	m0, m1, m3 := h.migUUID(1, 0), h.migUUID(1, 1), h.migUUID(1, 3)
	h.run(m0, 100, 0) // A on its own instance
	h.run(m1, 101, 0) // A on B's instance: out of bounds
	h.run(m1, 200, 0) // B on its own instance
	h.run(m3, 300, 0) // C on a free instance: intruder
	ledger := &holdings{
		{DeviceUUID: m0, ContainerID: idA},
		{DeviceUUID: m1, ContainerID: idB},
	}
	o, _ := newObserver(t, h, fp, ledger, nil)

	r, err := o.Account(context.Background())
	require.NoError(t, err)
	require.Len(t, r.Findings, 2, "%+v", r.Findings)
	oob := findings(r, KindOutOfBounds)[101]
	assert.Equal(t, "1:1", oob.Device.Index)
	assert.Equal(t, m1, oob.Device.UUID)
	assert.Equal(t, idB, oob.Holder)
	assert.Contains(t, oob.Message, "MIG 1:1 ("+m1+")")
	in := findings(r, KindIntruder)[300]
	assert.Equal(t, "1:3", in.Device.Index)
	assert.Empty(t, in.Holder)

	// The MIG-mode GPU itself is not listed; its instances are.
	var indices []string
	for _, d := range r.Devices {
		indices = append(indices, d.Device.Index)
	}
	assert.Equal(t, []string{"0", "1:0", "1:1", "1:3", "2", "3", "4", "5", "6", "7"}, indices)

	// A claim on the whole GPU covers its instances.
	*ledger = holdings{{DeviceUUID: h.uuid(1), ContainerID: idA}}
	h.clear(m1)
	h.clear(m3)
	r, err = o.Account(context.Background())
	require.NoError(t, err)
	assert.Empty(t, r.Findings)
	assert.Equal(t, idA, r.Devices[1].Holder)
}

func TestGonePidIsNotAnIntruder(t *testing.T) {
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	h.run(h.uuid(0), 404, 0) // exited before its cgroup could be read
	o, _ := newObserver(t, h, fp, &holdings{}, nil)

	r, err := o.Account(context.Background())
	require.NoError(t, err)
	require.Len(t, r.Findings, 1)
	assert.Equal(t, KindGone, r.Findings[0].Kind)
	assert.Contains(t, r.Findings[0].Message, "pid 404 on GPU 0 ("+h.uuid(0)+") exited or was reused")
	assert.Empty(t, r.Problems(), "a gone pid is not a problem")
	assert.True(t, r.Devices[0].Processes[0].Gone)
}

func TestPidReuseIsNotMisattributed(t *testing.T) {
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	// NVML listed pid 500 (then a process of A); by the time /proc is read
	// the pid belongs to a process of B that started after the listing.
	fp.addIn(500, 100000+200, idB)
	h.run(h.uuid(0), 500, 0)
	ledger := &holdings{{DeviceUUID: h.uuid(0), ContainerID: idA}}
	o, _ := newObserver(t, h, fp, ledger, nil)

	r, err := o.Account(context.Background())
	require.NoError(t, err)
	require.Len(t, r.Findings, 1)
	assert.Equal(t, KindGone, r.Findings[0].Kind, "B is not blamed for A's old pid")
	assert.Empty(t, r.Findings[0].ContainerID)

	// The same pid, started before the listing, is B's and is reported.
	fp.addIn(500, 50, idB)
	r, err = o.Account(context.Background())
	require.NoError(t, err)
	require.Len(t, r.Problems(), 1)
	assert.Equal(t, KindIntruder, r.Problems()[0].Kind)
	assert.Equal(t, idB, r.Problems()[0].ContainerID)
}

func TestNVMLListingErrorIsReportedNotGuessed(t *testing.T) {
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	fp.addIn(200, 20, idB)
	h.run(h.uuid(2), 200, 0)
	h.run(h.uuid(4), 200, 0)
	h.set(h.listErr, h.uuid(2), nvml.ERROR_NO_PERMISSION)
	o, logs := newObserver(t, h, fp, &holdings{}, nil)

	r, err := o.Account(context.Background())
	require.NoError(t, err, "one device failing does not fail the pass")
	assert.Contains(t, r.Devices[2].Error, "list compute processes")
	assert.Contains(t, r.Devices[2].Error, "ERROR_NO_PERMISSION")
	require.Len(t, r.Findings, 1, "GPU 2 is not judged; GPU 4 is")
	assert.Equal(t, "4", r.Findings[0].Device.Index)
	assert.Empty(t, o.Unhealthy(), "a permission error does not make a GPU unhealthy")
	assert.Contains(t, logs.String(), "cannot list the processes of a device")
	assert.Contains(t, logs.String(), h.uuid(2))

	// The next pass retries and succeeds.
	h.set(h.listErr, h.uuid(2), nvml.SUCCESS)
	r, err = o.Account(context.Background())
	require.NoError(t, err)
	assert.Empty(t, r.Devices[2].Error)
	assert.Len(t, r.Findings, 2)
}

func TestGraphicsNotSupportedIsEmpty(t *testing.T) {
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	fp.addIn(100, 10, idA)
	h.run(h.uuid(0), 100, 0)
	h.srv.Devices[0].(*mockDevice).GetGraphicsRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) {
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	o, _ := newObserver(t, h, fp, &holdings{{DeviceUUID: h.uuid(0), ContainerID: idA}}, nil)
	r, err := o.Account(context.Background())
	require.NoError(t, err)
	assert.Empty(t, r.Devices[0].Error)
	assert.Len(t, r.Devices[0].Processes, 1)
}

func TestSlowNVMLNeverBlocks(t *testing.T) {
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	release := make(chan struct{})
	h.mu.Lock()
	h.block[h.uuid(0)] = release
	h.mu.Unlock()
	o, _ := newObserver(t, h, fp, &holdings{}, nil)

	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { _, err := o.Account(ctx); errc <- err }()
	testwait.Receive(t, h.entered, "NVML call")
	cancel()
	err := testwait.Receive(t, errc, "Account result")
	require.ErrorIs(t, err, ErrNVMLSlow)
	require.ErrorIs(t, err, context.Canceled)

	// While NVML is still stuck, later queries give up with their own
	// context, and the health view answers at once.
	_, err = o.Idle(ctx, Holding{DeviceUUID: h.uuid(1), ContainerID: idA})
	require.ErrorIs(t, err, ErrNVMLSlow, "an ended context is not even queued")
	_, err = o.Idle(newCancelOnWait(), Holding{DeviceUUID: h.uuid(1), ContainerID: idA})
	require.ErrorIs(t, err, ErrNVMLSlow)
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorContains(t, err, "an earlier NVML query has not returned yet")
	assert.Empty(t, o.Unhealthy())

	close(release)
	h.mu.Lock()
	delete(h.block, h.uuid(0))
	h.mu.Unlock()
	_, err = o.Account(context.Background())
	require.NoError(t, err, "once NVML answers, accounting works again")
}

func TestVanishedDeviceIsUnhealthy(t *testing.T) {
	h := newMockH100MIG(t)
	fp := newFakeProc(t, 1000)
	fp.addIn(100, 10, idA)
	h.run(h.uuid(5), 100, 0)
	h.set(h.lost, h.uuid(5), nvml.ERROR_GPU_IS_LOST)
	h.set(h.lost, h.uuid(6), nvml.ERROR_NOT_FOUND)
	var notified chan Finding
	o, _ := newObserver(t, h, fp, &holdings{{DeviceUUID: h.uuid(5), ContainerID: idA}}, func(o *Options) {
		notified = unhealthyChan(o)
	})

	r, err := o.Account(context.Background())
	require.NoError(t, err)
	un := r.Problems()
	require.Len(t, un, 2)
	assert.Equal(t, KindUnhealthy, un[0].Kind)
	byIndex := map[string]Finding{un[0].Device.Index: un[0], un[1].Device.Index: un[1]}
	assert.Contains(t, byIndex["5"].Message, "GPU 5 ("+h.uuid(5)+") is unhealthy: it is lost")
	assert.Contains(t, byIndex["5"].Message, "ERROR_GPU_IS_LOST")
	assert.Contains(t, byIndex["6"].Message, "vanished from NVML")
	assert.True(t, byIndex["6"].Vanished, "a device NVML no longer knows is marked so")
	assert.False(t, byIndex["5"].Vanished, "a lost GPU is still known")
	assert.Equal(t, idA, byIndex["5"].Holder, "the holder is named; it keeps its claim")
	f, ok := o.Health(h.uuid(5))
	require.True(t, ok)
	assert.Equal(t, KindUnhealthy, f.Kind)
	// Notifications found before Run are delivered once it runs.
	startRun(t, o)
	got := map[string]bool{}
	for range 2 {
		got[testwait.Receive(t, notified, "unhealthy notification").Device.Index] = true
	}
	assert.Equal(t, map[string]bool{"5": true, "6": true}, got)

	// A second pass does not notify again: the next notification is the
	// next new device (the dispatcher delivers in order).
	_, err = o.Account(context.Background())
	require.NoError(t, err)

	// A MIG instance that is no longer where the inventory says (the
	// layout changed) is gone too, and its GPU reports it.
	sd := h.srv.Devices[1].(*mockDevice)
	byIdx := sd.GetMigDeviceHandleByIndexFunc
	sd.GetMigDeviceHandleByIndexFunc = func(n int) (nvml.Device, nvml.Return) {
		if n == 3 {
			return nil, nvml.ERROR_NOT_FOUND
		}
		return byIdx(n)
	}
	_, err = o.Account(context.Background())
	require.NoError(t, err)
	assert.Equal(t, "1:3", testwait.Receive(t, notified, "unhealthy MIG").Device.Index)
	f, ok = o.Health(h.migUUID(1, 3))
	require.True(t, ok)
	assert.Equal(t, "1:3", f.Device.Index)
	_, ok = o.Health(h.uuid(1))
	assert.True(t, ok, "a GPU with an unhealthy instance is not offered whole")
	_, ok = o.Health(h.migUUID(1, 0))
	assert.False(t, ok, "sibling instances stay healthy")

	require.True(t, o.ClearHealth(h.uuid(5)))
	_, ok = o.Health(h.uuid(5))
	assert.False(t, ok)
	assert.False(t, o.ClearHealth(h.uuid(5)))
}

// On a hybrid host (see hybridCgroup) a holder's, and an exempt agent's,
// processes are theirs: no intruder, and the holder's draining claim is not
// idle while its process is on the GPU.
func TestHybridCgroupHost(t *testing.T) {
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	fp.add(100, 10, hybridCgroup(idA))
	fp.add(200, 20, hybridCgroup(idB)) // the exempt monitoring agent
	fp.add(300, 30, hybridCgroup(idC))
	h.run(h.uuid(0), 100, 1<<30)
	h.run(h.uuid(0), 200, 0)
	h.run(h.uuid(2), 300, 0)
	holder := Holding{DeviceUUID: h.uuid(0), ContainerID: idA, CgroupPath: hybridPath(idA)}
	o, _ := newObserver(t, h, fp, &holdings{holder, {ContainerID: idB, AnyDevice: true}}, nil)

	r, err := o.Account(context.Background())
	require.NoError(t, err)
	require.Len(t, r.Problems(), 1, "%+v", r.Problems())
	assert.Equal(t, KindIntruder, r.Problems()[0].Kind)
	assert.Equal(t, 300, r.Problems()[0].PID)
	assert.Equal(t, idC, r.Problems()[0].ContainerID, "a container, not a host process")
	assert.Equal(t, hybridPath(idA), r.Devices[0].Processes[0].Cgroup)

	res, err := o.Idle(context.Background(), holder)
	require.NoError(t, err)
	assert.False(t, res.Idle, "pid 100 is the holder's and still on the GPU")
	// Matched by cgroup alone too (a holder the hook recorded by its cgroup).
	res, err = o.Idle(context.Background(), Holding{DeviceUUID: h.uuid(0), ContainerID: "job", CgroupPath: hybridPath(idA)})
	require.NoError(t, err)
	assert.False(t, res.Idle)
}

func TestIdle(t *testing.T) {
	h := newMockH100MIG(t)
	fp := newFakeProc(t, 1000)
	fp.addIn(100, 10, idA)
	fp.addIn(200, 20, idB)
	h.run(h.uuid(0), 100, 4<<30)
	h.run(h.uuid(0), 200, 0) // another container's process does not keep A draining
	holder := Holding{DeviceUUID: h.uuid(0), ContainerID: idA}
	o, _ := newObserver(t, h, fp, &holdings{}, nil)
	ctx := context.Background()

	res, err := o.Idle(ctx, holder)
	require.NoError(t, err)
	assert.False(t, res.Idle)
	require.Len(t, res.Processes, 1)
	assert.Equal(t, 100, res.Processes[0].PID)
	assert.EqualValues(t, 4<<30, res.Processes[0].UsedMemoryBytes)

	// The process exits: NVML still lists it for a moment, /proc does not.
	fp.remove(100)
	res, err = o.Idle(ctx, holder)
	require.NoError(t, err)
	assert.True(t, res.Idle, "a gone pid does not keep a claim draining")
	h.clear(h.uuid(0))
	res, err = o.Idle(ctx, holder)
	require.NoError(t, err)
	assert.True(t, res.Idle)

	// A whole MIG-mode GPU is idle only when all its instances are.
	fp.addIn(101, 10, idA)
	h.run(h.migUUID(1, 3), 101, 0)
	res, err = o.Idle(ctx, Holding{DeviceUUID: h.uuid(1), ContainerID: idA})
	require.NoError(t, err)
	assert.False(t, res.Idle)

	// NVML errors are errors, never "idle".
	h.set(h.listErr, h.uuid(0), nvml.ERROR_UNKNOWN)
	_, err = o.Idle(ctx, holder)
	require.ErrorContains(t, err, "GPU 0 ("+h.uuid(0)+")")
	require.ErrorContains(t, err, "ERROR_UNKNOWN")
	h.set(h.lost, h.uuid(0), nvml.ERROR_GPU_IS_LOST)
	_, err = o.Idle(ctx, holder)
	require.ErrorContains(t, err, "it is lost")

	_, err = o.Idle(ctx, Holding{DeviceUUID: "GPU-nope", ContainerID: idA})
	require.ErrorContains(t, err, "GPU-nope is not in the inventory")
}

// TestIdleUnattributableProcessIsNotIdle: a listed process whose /proc entry
// exists but cannot be read (here its cgroup file is a directory: EISDIR) may
// be the holder's. Idle returns an error, so the claim stays draining until
// the check can tell or observe.idle_grace ends; it used to read the process
// as gone and the device as idle, releasing the claim on doubt. Accounting
// still does not blame it (a gone finding naming the error).
func TestIdleUnattributableProcessIsNotIdle(t *testing.T) {
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	fp.addIn(100, 10, idA)
	cg := filepath.Join(fp.root, "proc", "100", "cgroup")
	require.NoError(t, os.Remove(cg))
	require.NoError(t, os.Mkdir(cg, 0o755))
	h.run(h.uuid(0), 100, 4<<30)
	holder := Holding{DeviceUUID: h.uuid(0), ContainerID: idA}
	o, _ := newObserver(t, h, fp, &holdings{holder}, nil)
	ctx := context.Background()

	_, err := o.Idle(ctx, holder)
	require.ErrorIs(t, err, syscall.EISDIR)
	require.ErrorContains(t, err, "pid 100 cannot be attributed")
	require.ErrorContains(t, err, "GPU 0 ("+h.uuid(0)+")")

	r, err := o.Account(ctx)
	require.NoError(t, err)
	assert.Empty(t, r.Problems(), "an unreadable process is not blamed")
	gone := findings(r, KindGone)
	require.Contains(t, gone, 100)
	assert.Contains(t, gone[100].Message, "could not be attributed")

	// Once readable again, the check answers.
	require.NoError(t, os.Remove(cg))
	fp.addIn(100, 10, idA)
	res, err := o.Idle(ctx, holder)
	require.NoError(t, err)
	assert.False(t, res.Idle)
}

func TestLedgerErrorFailsThePass(t *testing.T) {
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	boom := errors.New("ledger locked")
	o, _ := newObserver(t, h, fp, LedgerFunc(func() ([]Holding, error) { return nil, boom }), nil)
	_, err := o.Account(context.Background())
	require.ErrorIs(t, err, boom)
}

// A report carries the epoch of the ledger view its pass read (the daemon
// drops a report read before the plugin's last Synchronize); a ledger not
// ready yet skips the pass quietly, with a report that says only that.
func TestLedgerEpochAndNotReady(t *testing.T) {
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	o, _ := newObserver(t, h, fp, EpochLedgerFunc(func() ([]Holding, uint64, error) { return nil, 7, nil }), nil)
	r, err := o.Account(context.Background())
	require.NoError(t, err)
	assert.EqualValues(t, 7, r.LedgerEpoch)

	reads := make(chan struct{}, 1)
	reports := make(chan Report, 1)
	o, logs := newObserver(t, h, fp, EpochLedgerFunc(func() ([]Holding, uint64, error) {
		select {
		case reads <- struct{}{}:
		default:
		}
		return nil, 0, fmt.Errorf("%w: not synchronized", ErrLedgerNotReady)
	}), func(opts *Options) {
		opts.Interval = time.Millisecond
		opts.OnReport = func(r Report) {
			select {
			case reports <- r:
			default:
			}
		}
	})
	startRun(t, o)
	for range 3 {
		testwait.Receive(t, reads, "a pass")
	}
	// OnReport hears of the skipped passes, with nothing judged: the
	// daemon settles its unhealthy devices on them.
	r = testwait.Receive(t, reports, "a skipped pass's report")
	assert.True(t, r.Skipped)
	assert.Empty(t, r.Devices)
	assert.Empty(t, r.Findings)
	assert.NotContains(t, logs.String(), "level=WARN")
	assert.Contains(t, logs.String(), "accounting skipped: the ledger is not ready")
}

func TestNewRejectsBadOptions(t *testing.T) {
	h := newMockA100(t)
	src, err := OpenNVML(h.srv)
	require.NoError(t, err)
	defer func() { _ = src.Close() }()
	_, err = New(Options{Ledger: &holdings{}})
	require.ErrorContains(t, err, "no NVML source")
	_, err = New(Options{Source: src})
	require.ErrorContains(t, err, "no ledger")
	_, err = New(Options{Source: src, Ledger: &holdings{}, Xids: []int{0}})
	require.ErrorContains(t, err, "invalid Xid 0")
	_, err = New(Options{Source: src, Ledger: &holdings{}, Interval: -1})
	require.ErrorContains(t, err, "negative interval")

	h.srv.InitFunc = func() nvml.Return { return nvml.ERROR_DRIVER_NOT_LOADED }
	_, err = OpenNVML(h.srv)
	require.ErrorIs(t, err, ErrNVMLUnavailable)
}
