// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package observe

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A MIG instance created after the inventory was discovered (nvidia-smi mig
// -cgi/-cci by root or a MIG manager, beside busy instances) is observed
// from the layout NVML reports at each pass: its processes are judged
// against the claims on its GPU, the report says the inventory lacks it,
// and Idle counts them. The GPU itself is still never listed (enableMIG
// fails the test if it is).
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
			assert.Contains(t, dr.Error, "is not in it", "the report says the inventory lacks it")
			assert.Contains(t, dr.Error, "restart nri-gpu-guard")
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
