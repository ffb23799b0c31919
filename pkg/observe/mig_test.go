// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package observe

import (
	"context"
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

			var found []Finding
			for _, f := range r.Problems() {
				if f.Device.UUID == newUUID {
					found = append(found, f)
				}
			}
			if tc.kind == "" {
				assert.Empty(t, found, "the whole-GPU holder may use the instance")
			} else {
				require.Len(t, found, 1)
				f := found[0]
				assert.Equal(t, tc.kind, f.Kind)
				assert.Equal(t, tc.pid, f.PID)
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
