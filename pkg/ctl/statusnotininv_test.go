// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// uuidNewMIG is a MIG instance of GPU 0 created after the daemon's
// inventory was discovered.
const uuidNewMIG = "MIG-a2a2a2a2-0000-4000-8000-00000000a002"

// notInInventoryFile is an observe.json as the daemon writes it after a
// pass that found a MIG instance its inventory lacks (0:2, with a host
// process on it: an intruder, which is GPU 0's), a critical Xid from a GPU NVML could not
// identify, and a GPU whose processes NVML could not list.
func notInInventoryFile(seen time.Time) observe.File {
	newMIG := observe.Device{Index: "0:2", UUID: uuidNewMIG, ParentUUID: uuidGPU0}
	unlisted := observe.UnlistedDevice{Device: observe.Device{Index: "2", UUID: uuidGPU2}, Error: "list compute processes: ERROR_UNKNOWN"}
	return observe.File{Time: seen, WrittenAt: seen, IntervalSeconds: 10,
		Findings: []observe.FileFinding{{Finding: observe.Finding{Kind: observe.KindIntruder,
			Device: observe.Device{Index: "0", UUID: uuidGPU0}, Instance: &newMIG, PID: 900, Time: seen,
			Message: "pid 900 (host process) runs on MIG 0:2 (" + uuidNewMIG + ") of GPU 0 (" + uuidGPU0 + "), an instance the inventory lacks, " +
				"which is free: it was not admitted by the guard (stop it, or run it through the guard); the guard does not kill it; " +
				"the finding is its GPU's, GPU 0 (" + uuidGPU0 + "): the GPU's claims cover the instance, " +
				"and a cordon for the finding is on the GPU; restart nri-gpu-guard so that its discovery lists the instance"}}},
		Errors:   []string{unlisted.String()},
		Unlisted: []observe.UnlistedDevice{unlisted},
		NotInInventory: []observe.NotInInventoryDevice{
			{Device: newMIG, Notice: "the MIG layout of GPU 0 (" + uuidGPU0 + ") changed since the inventory was discovered: instance " +
				uuidNewMIG + " is not in it; its processes are judged against the claims on the GPU, and it cannot be claimed until " +
				"the inventory is rebuilt (restart nri-gpu-guard; `sudo gpu-guard-ctl devices --refresh` refreshes the OCI hooks' cache)"},
			{Device: observe.Device{Index: "?"}, Notice: "reported critical Xid 79: NVML could not tell which GPU (its UUID: ERROR_GPU_IS_LOST), " +
				"so no GPU was cordoned and new claims may land on the failing one. Find it: run nvidia-smi (a GPU fallen off the bus is " +
				"missing or shows ERR!) and check the kernel log (dmesg | grep -i xid names its PCI bus id); then cordon it by hand: " +
				"sudo gpu-guard-ctl cordon GPU --reason \"Xid 79\". Reported until nri-gpu-guard restarts"},
		},
	}
}

// TestGoldenStatusNotInInventory: a device the daemon's inventory lacks is
// a problem of its own (not-in-inventory, exit 3) whose line says "not in
// the inventory" and what to do, never "could not list its processes":
// the processes of a MIG instance created since discovery were listed and
// judged (its intruder is shown), and the GPU of an unidentified critical
// Xid has none to list. Before, both came in observe.json's unlisted
// devices and status said the observer could not list their processes. A
// device NVML could not list is still unobserved.
func TestGoldenStatusNotInInventory(t *testing.T) {
	f := newFixture(t)
	seen := now.Add(-4 * time.Second)
	require.NoError(t, observe.WriteFile(f.dir, notInInventoryFile(seen)))
	for _, tc := range []struct{ name, output string }{
		{"status-notininv", "table"}, {"status-notininv-json", "json"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := f.run(t, "status", "-o", tc.output)
			require.Equal(t, ExitAttention, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			require.Empty(t, r.stderr)
			golden(t, tc.name, f.normalize(r.stdout))
		})
	}

	out := statusJSON(t, f, ExitAttention)
	byKind := map[string][]problem{}
	for _, p := range out.Problems {
		byKind[p.Kind] = append(byKind[p.Kind], p)
	}
	require.Len(t, byKind["not-in-inventory"], 2, "%+v", out.Problems)
	mig, xid := byKind["not-in-inventory"][0], byKind["not-in-inventory"][1]
	assert.Equal(t, uuidNewMIG, mig.Device)
	assert.Equal(t, "0:2", mig.Index)
	require.NotNil(t, mig.SeenAt)
	assert.True(t, mig.SeenAt.Equal(seen))
	assert.True(t, strings.HasPrefix(mig.Message, "MIG 0:2 ("+uuidNewMIG+"): not in the inventory: the MIG layout of GPU 0 ("),
		mig.Message)
	assert.Contains(t, mig.Message, "restart nri-gpu-guard")
	assert.True(t, strings.HasSuffix(mig.Message, "(seen 4s ago)"), mig.Message)
	assert.Empty(t, xid.Device)
	assert.Empty(t, xid.Index, "the unidentified GPU's \"?\" names no device")
	assert.True(t, strings.HasPrefix(xid.Message, "an unidentified GPU: not in the inventory: reported critical Xid 79: "), xid.Message)
	for _, want := range []string{"nvidia-smi", "dmesg", "sudo gpu-guard-ctl cordon"} {
		assert.Contains(t, xid.Message, want)
	}
	require.Len(t, byKind["unobserved"], 1, "only the device NVML could not list: %+v", out.Problems)
	assert.Equal(t, uuidGPU2, byKind["unobserved"][0].Device)
	require.Len(t, byKind["intruder"], 1)
	assert.Equal(t, uuidGPU0, byKind["intruder"][0].Device, "the finding is the instance's GPU's")
	assert.Equal(t, "0", byKind["intruder"][0].Index)
	assert.Contains(t, byKind["intruder"][0].Message, "MIG 0:2 ("+uuidNewMIG+") of GPU 0 ("+uuidGPU0+")")
	for _, p := range out.Problems {
		if p.Device != uuidGPU2 {
			assert.NotContains(t, p.Message, "could not list", "%+v", p)
		}
	}
}
