// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package observe

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A MIG instance created after the inventory was discovered (nvidia-smi mig
// -cgi/-cci by root or a MIG manager, beside busy instances) is observed
// from the layout NVML reports at each pass: its processes are judged
// against the claims on its GPU, the report says the inventory lacks it
// (DeviceReport.NotInInventory) and that is no listing error (Error empty:
// its processes were listed; before, the notice was put in Error, so that
// readers took it for a device NVML could not list), and Idle counts them.
// The GPU itself is still never listed (enableMIG fails the test if it is).
func TestMIGInstanceCreatedAfterDiscovery(t *testing.T) {
	const newUUID = "MIG-00000001-0000-4000-8000-000000000005"
	for _, tc := range []struct {
		name    string
		holder  string // the container holding GPU 1 whole; "" none
		pid     int
		cgroup  string // of pid
		kind    Kind   // the finding on the new instance; "" none
		inMsg   string
		idleFor string // Idle of this container's claim on GPU 1 must be false
	}{
		{
			name: "host process on the GPU held whole", holder: idA,
			pid: 900, cgroup: "0::/user.slice/user-0.slice/session-3.scope\n",
			kind: KindIntruder, inMsg: "held by container " + shortID(idA),
		},
		{
			name: "host process on a free GPU",
			pid:  900, cgroup: "0::/user.slice/user-0.slice/session-3.scope\n",
			kind: KindIntruder, inMsg: "which is free",
		},
		{
			name: "holder of another GPU", holder: idA,
			pid: 300, cgroup: "", kind: KindOutOfBounds, inMsg: "claimed only",
		},
		{
			name: "whole-GPU holder's process, draining", holder: idA,
			pid: 100, idleFor: idA,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMockH100MIG(t)
			fp := newFakeProc(t, 1000)
			fp.addIn(100, 10, idA)
			fp.addIn(300, 30, idB)
			if tc.cgroup != "" {
				fp.add(tc.pid, 20, tc.cgroup)
			}
			h.addMIG(5, newUUID)
			h.run(newUUID, uint32(tc.pid), 1<<30)
			ledger := &holdings{{DeviceUUID: h.uuid(3), ContainerID: idB}}
			if tc.holder != "" {
				*ledger = append(*ledger, Holding{DeviceUUID: h.uuid(1), ContainerID: tc.holder})
			}
			o, logs := newObserver(t, h, fp, ledger, nil)
			r, err := o.Account(context.Background())
			require.NoError(t, err)

			var dr *DeviceReport
			for i := range r.Devices {
				if r.Devices[i].Device.UUID == newUUID {
					dr = &r.Devices[i]
				}
			}
			require.NotNil(t, dr, "the new instance is in the report")
			assert.Equal(t, "1:5", dr.Device.Index)
			assert.Equal(t, h.uuid(1), dr.Device.ParentUUID)
			require.Len(t, dr.Processes, 1)
			assert.Equal(t, tc.pid, dr.Processes[0].PID)
			assert.Equal(t, tc.holder, dr.Holder, "a claim on the GPU covers the instance")
			assert.Contains(t, dr.NotInInventory, "is not in it", "the report says the inventory lacks it")
			assert.Contains(t, dr.NotInInventory, "restart nri-gpu-guard")
			assert.Empty(t, dr.Error, "its processes were listed: no listing error")
			assert.Contains(t, logs.String(), "MIG instance not in the inventory")
			assert.Contains(t, logs.String(), newUUID)

			// The only process on a device is on the new instance: its
			// finding, if any, is the GPU's (Finding.Instance).
			found := r.Problems()
			if tc.kind == "" {
				assert.Empty(t, found, "the whole-GPU holder may use the instance")
			} else {
				require.Len(t, found, 1)
				f := found[0]
				assert.Equal(t, tc.kind, f.Kind)
				assert.Equal(t, tc.pid, f.PID)
				assert.Equal(t, h.uuid(1), f.Device.UUID, "the finding is on the instance's GPU")
				if assert.NotNil(t, f.Instance) {
					assert.Equal(t, newUUID, f.Instance.UUID)
				}
				assert.Equal(t, tc.holder, f.Holder)
				assert.Contains(t, f.Message, tc.inMsg)
				assert.Contains(t, f.Message, "MIG 1:5 ("+newUUID+") of GPU 1 ("+h.uuid(1)+")",
					"the device is named by its GPU's index and UUID and its own UUID")
			}

			if tc.idleFor != "" {
				res, err := o.Idle(context.Background(), Holding{DeviceUUID: h.uuid(1), ContainerID: tc.idleFor})
				require.NoError(t, err)
				assert.False(t, res.Idle, "the holder still runs on the new instance")
				require.Len(t, res.Processes, 1)
				assert.Equal(t, tc.pid, res.Processes[0].PID)
			}

			// Logged once, reported at every pass.
			_, err = o.Account(context.Background())
			require.NoError(t, err)
			assert.Equal(t, 1, strings.Count(logs.String(), "MIG instance not in the inventory"))
		})
	}
}

// A MIG instance of the inventory that NVML reports at another MIG index
// (instances destroyed and created beside it since discovery) is still the
// inventory's instance: found by its UUID, its processes are listed and
// judged, it is not taken for vanished, and the instance now at its old
// index, one the inventory lacks, is listed as such.
func TestMIGInstanceAtAnotherIndexIsStillObserved(t *testing.T) {
	const newUUID = "MIG-00000001-0000-4000-8000-0000000000aa"
	h := newMockH100MIG(t) // GPU 1: instances at MIG indices 0, 1, 3
	fp := newFakeProc(t, 1000)
	fp.addIn(100, 10, idA)
	fp.add(900, 20, "0::/user.slice/user-0.slice/session-3.scope\n")
	fp.add(901, 21, "0::/user.slice/user-0.slice/session-3.scope\n")
	moved1, moved3 := h.migUUID(1, 1), h.migUUID(1, 3)
	h.moveMIG(1, 5) // another instance is at index 1 now,
	h.addMIG(1, newUUID)
	h.moveMIG(3, 6)           // and none at index 3
	h.run(moved1, 900, 1<<30) // a host process: an intruder
	h.run(moved3, 100, 1<<30) // the holder's own
	h.run(newUUID, 901, 0)
	ledger := &holdings{{DeviceUUID: moved3, ContainerID: idA}}
	o, logs := newObserver(t, h, fp, ledger, nil)

	r, err := o.Account(context.Background())
	require.NoError(t, err)
	byUUID := map[string]DeviceReport{}
	for _, dr := range r.Devices {
		byUUID[dr.Device.UUID] = dr
	}
	for _, tc := range []struct {
		uuid, index string
		pid         int
	}{{moved1, "1:1", 900}, {moved3, "1:3", 100}} {
		dr, ok := byUUID[tc.uuid]
		require.True(t, ok, "MIG %s is in the report", tc.index)
		assert.Equal(t, tc.index, dr.Device.Index, "named as the inventory names it")
		assert.Empty(t, dr.Error, "MIG %s is observed", tc.index)
		require.Len(t, dr.Processes, 1, "MIG %s: its processes are listed", tc.index)
		assert.Equal(t, tc.pid, dr.Processes[0].PID)
		_, sick := o.Health(tc.uuid)
		assert.False(t, sick, "MIG %s is not taken for vanished", tc.index)
	}
	assert.Equal(t, idA, byUUID[moved3].Holder)
	assert.Contains(t, byUUID[newUUID].NotInInventory, "is not in it", "the instance now at index 1 is not the inventory's")
	assert.Empty(t, byUUID[newUUID].Error, "its processes were listed")
	for _, tc := range []string{moved1, moved3} {
		assert.Empty(t, byUUID[tc].NotInInventory, "the inventory has %s", tc)
	}

	var onMoved []Finding
	for _, f := range r.Problems() {
		assert.NotEqual(t, KindUnhealthy, f.Kind, "%+v", f)
		if f.Device.UUID == moved1 || f.Device.UUID == moved3 {
			onMoved = append(onMoved, f)
		}
	}
	require.Len(t, onMoved, 1, "%+v", r.Problems())
	assert.Equal(t, KindIntruder, onMoved[0].Kind)
	assert.Equal(t, 900, onMoved[0].PID)
	assert.Equal(t, moved1, onMoved[0].Device.UUID)

	res, err := o.Idle(context.Background(), Holding{DeviceUUID: moved3, ContainerID: idA})
	require.NoError(t, err)
	assert.False(t, res.Idle, "the holder still runs on its instance, wherever NVML lists it")

	assert.Contains(t, logs.String(), "MIG instance is at another MIG index than at discovery")
	assert.Contains(t, logs.String(), "index_now=1:5")
	_, err = o.Account(context.Background())
	require.NoError(t, err)
	assert.Equal(t, 2, strings.Count(logs.String(), "MIG instance is at another MIG index than at discovery"),
		"logged once per instance")
}

// A MIG instance missing from its index is vanished only when the layout of
// its GPU was read whole: an index NVML would not tell about may hold it.
func TestMIGInstanceNotFoundInAPartlyReadLayoutIsNotVanished(t *testing.T) {
	h := newMockH100MIG(t)
	h.moveMIG(3, 6)
	sd := h.srv.Devices[1].(*mockDevice)
	byIdx := sd.GetMigDeviceHandleByIndexFunc
	sd.GetMigDeviceHandleByIndexFunc = func(n int) (nvml.Device, nvml.Return) {
		if n == 6 {
			return nil, nvml.ERROR_UNKNOWN
		}
		return byIdx(n)
	}
	o, _ := newObserver(t, h, newFakeProc(t, 1000), &holdings{}, nil)
	r, err := o.Account(context.Background())
	require.NoError(t, err)
	assert.Empty(t, r.Problems(), "nothing is concluded")
	var dr *DeviceReport
	for i := range r.Devices {
		if r.Devices[i].Device.UUID == h.migUUID(1, 3) {
			dr = &r.Devices[i]
		}
	}
	require.NotNil(t, dr)
	assert.Contains(t, dr.Error, "MIG index 6: ERROR_UNKNOWN")
}

// A MIG instance the inventory lacks whose processes NVML cannot list is
// both: not in the inventory (NotInInventory) and not checked (Error), and
// nothing on it is judged. The instances of the inventory say neither.
func TestMIGInstanceNotInInventoryThatCannotBeListed(t *testing.T) {
	const newUUID = "MIG-00000001-0000-4000-8000-000000000005"
	h := newMockH100MIG(t)
	fp := newFakeProc(t, 1000)
	fp.add(900, 20, "0::/user.slice/user-0.slice/session-3.scope\n")
	h.addMIG(5, newUUID)
	h.run(newUUID, 900, 1<<30)
	h.set(h.listErr, newUUID, nvml.ERROR_UNKNOWN)
	o, _ := newObserver(t, h, fp, &holdings{}, nil)
	r, err := o.Account(context.Background())
	require.NoError(t, err)
	var dr *DeviceReport
	for i := range r.Devices {
		d := &r.Devices[i]
		if d.Device.UUID == newUUID {
			dr = d
			continue
		}
		assert.Empty(t, d.NotInInventory, "%s is in the inventory", d.Device)
	}
	require.NotNil(t, dr, "the new instance is in the report")
	assert.Contains(t, dr.NotInInventory, "is not in it")
	assert.Contains(t, dr.Error, "list compute processes: ERROR_UNKNOWN")
	assert.Empty(t, dr.Processes)
	assert.Empty(t, r.Problems(), "nothing is concluded about it")
}

// An intruder or out-of-bounds finding on a MIG instance the inventory
// lacks is its GPU's: Device is the GPU as the inventory lists it (the
// device whose claims cover the instance, and the one the daemon's cordon
// can name: the guard knows only the inventory's devices), and Instance
// (in the JSON of observe.json and the daemon's carry file too) is the
// instance. Before, the finding was on the instance, which the daemon then
// failed to cordon at every pass, leaving the GPU open to claims. The
// message names both and says to restart nri-gpu-guard. A finding on an
// instance of the inventory is on that instance, as before, and a pid
// that could not be attributed (gone) is on the instance NVML listed it
// on: it is no problem, nothing acts on it.
func TestFindingOnAnInstanceNotInTheInventoryIsItsGPUs(t *testing.T) {
	const newUUID = "MIG-00000001-0000-4000-8000-000000000005"
	h := newMockH100MIG(t)
	fp := newFakeProc(t, 1000)
	host := "0::/user.slice/user-0.slice/session-3.scope\n"
	fp.add(900, 20, host)  // on the new instance: an intruder
	fp.addIn(300, 30, idB) // holds GPU 3, on the new instance: out of bounds
	fp.add(800, 20, host)  // on the inventory's instance 1:1
	h.addMIG(5, newUUID)
	h.run(newUUID, 900, 1<<30)
	h.run(newUUID, 300, 1<<30)
	h.run(newUUID, 700, 1<<30) // no /proc entry: gone
	known := h.migUUID(1, 1)
	h.run(known, 800, 1<<30)
	o, _ := newObserver(t, h, fp, &holdings{{DeviceUUID: h.uuid(3), ContainerID: idB}}, nil)
	r, err := o.Account(context.Background())
	require.NoError(t, err)

	byPID := map[int]Finding{}
	for _, f := range r.Findings {
		byPID[f.PID] = f
	}
	gpu := h.uuid(1)
	for pid, kind := range map[int]Kind{900: KindIntruder, 300: KindOutOfBounds} {
		f, ok := byPID[pid]
		require.True(t, ok, "pid %d: %+v", pid, r.Findings)
		assert.Equal(t, kind, f.Kind)
		assert.Equal(t, gpu, f.Device.UUID, "pid %d: the finding is on the instance's GPU", pid)
		assert.Equal(t, "1", f.Device.Index)
		assert.False(t, f.Device.IsMIG())
		assert.Contains(t, f.Message, "MIG 1:5 ("+newUUID+") of GPU 1 ("+gpu+"), an instance the inventory lacks")
		assert.Contains(t, f.Message, "the finding is its GPU's, GPU 1 ("+gpu+")")
		assert.Contains(t, f.Message, "restart nri-gpu-guard")
		var wire struct {
			Device   Device  `json:"device"`
			Instance *Device `json:"instance"`
		}
		data, err := json.Marshal(f)
		require.NoError(t, err)
		require.NoError(t, json.Unmarshal(data, &wire))
		assert.Equal(t, gpu, wire.Device.UUID)
		if assert.NotNil(t, wire.Instance, "pid %d: the finding names the instance: %s", pid, data) {
			assert.Equal(t, Device{Index: "1:5", UUID: newUUID, ParentUUID: gpu}, *wire.Instance)
		}
	}
	if f, ok := byPID[700]; assert.True(t, ok, "%+v", r.Findings) {
		assert.Equal(t, KindGone, f.Kind)
		assert.Equal(t, newUUID, f.Device.UUID, "a gone pid stays on the instance it was listed on")
	}
	if f, ok := byPID[800]; assert.True(t, ok, "%+v", r.Findings) {
		assert.Equal(t, KindIntruder, f.Kind)
		assert.Equal(t, known, f.Device.UUID, "a finding on an instance of the inventory is on it")
		assert.Equal(t, "1:1", f.Device.Index)
		data, err := json.Marshal(f)
		require.NoError(t, err)
		assert.NotContains(t, string(data), `"instance"`)
		assert.NotContains(t, f.Message, "restart nri-gpu-guard")
	}
	assert.Len(t, r.Findings, 4)
}
