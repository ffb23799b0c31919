// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestNewInventoryRejectsInconsistentLists(t *testing.T) {
	for _, tc := range []struct {
		name   string
		source string
		mutate func(g []GPU) []GPU
		want   string
	}{
		{name: "empty source", source: " ", want: "no source"},
		{name: "duplicate UUID", mutate: func(g []GPU) []GPU { g[2].UUID = g[0].UUID; return g }, want: "listed twice"},
		{name: "duplicate UUID differing in case", mutate: func(g []GPU) []GPU {
			g[2].UUID = "GPU-C0000000-0000-4000-8000-000000000000"
			return g
		}, want: "listed twice"},
		{name: "duplicate index", mutate: func(g []GPU) []GPU { g[2].Index = 0; return g }, want: "index 0 is used by"},
		{name: "duplicate minor", mutate: func(g []GPU) []GPU { g[2].Minor = 0; return g }, want: "minor number 0 is used by"},
		{name: "minor 254 is nvidia-modeset", mutate: func(g []GPU) []GPU { g[0].Minor = 254; return g }, want: "outside 0-253"},
		{name: "negative minor", mutate: func(g []GPU) []GPU { g[0].Minor = -1; return g }, want: "outside 0-253"},
		{name: "negative index", mutate: func(g []GPU) []GPU { g[0].Index = -1; return g }, want: "negative index"},
		{name: "malformed GPU UUID", mutate: func(g []GPU) []GPU { g[0].UUID = "GPU-xyz"; return g }, want: "not of the form GPU-<uuid>"},
		{name: "MIG UUID as GPU", mutate: func(g []GPU) []GPU { g[0].UUID = migUUID(9, 9); return g }, want: "not of the form GPU-<uuid>"},
		{name: "malformed MIG UUID", mutate: func(g []GPU) []GPU { g[1].MIG[0].UUID = "MIG-1"; return g }, want: "not of the form MIG-<uuid>"},
		{name: "MIG names another parent", mutate: func(g []GPU) []GPU { g[1].MIG[0].ParentUUID = g[0].UUID; return g }, want: "names parent"},
		{name: "MIG names another parent index", mutate: func(g []GPU) []GPU { g[1].MIG[0].ParentIndex = 3; return g }, want: "names parent index 3"},
		{name: "duplicate MIG index", mutate: func(g []GPU) []GPU { g[1].MIG[1].Index = 0; return g }, want: "MIG index 1:0 is listed twice"},
		{name: "duplicate GI/CI", mutate: func(g []GPU) []GPU { g[1].MIG[1].GI = 1; return g }, want: "GPU instance 1 / compute instance 0"},
		{name: "MIG UUID reused", mutate: func(g []GPU) []GPU { g[1].MIG[1].UUID = g[1].MIG[0].UUID; return g }, want: "listed twice"},
		{name: "bad bus id", mutate: func(g []GPU) []GPU { g[0].BusID = "3b.0"; return g }, want: "PCI bus id"},
		{name: "duplicate bus id in two spellings", mutate: func(g []GPU) []GPU {
			g[0].BusID, g[1].BusID = "00000000:3B:00.0", "0000:3b:00.0"
			return g
		}, want: "listed twice"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpus := testGPUs()
			if tc.mutate != nil {
				gpus = tc.mutate(gpus)
			}
			source := "static"
			if tc.source != "" {
				source = tc.source
			}
			_, err := NewInventory(source, gpus)
			require.ErrorIs(t, err, ErrInvalidInventory)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
}

func TestNewInventoryRejectsInconsistentCaps(t *testing.T) {
	for _, tc := range []struct {
		name string
		caps []MIGCap
		want string
	}{
		{"duplicate minor", []MIGCap{{Minor: 1, Kind: CapConfig}, {Minor: 1, Kind: CapMonitor}}, "listed twice"},
		{"unknown GPU minor", []MIGCap{{Minor: 5, Kind: CapGIAccess, GPUMinor: 9, GI: 1}}, "GPU minor 9"},
		{"unknown instance", []MIGCap{{Minor: 5, Kind: CapCIAccess, GPUMinor: 3, GI: 1, CI: 7}}, "gi1/ci7"},
		{"GPU without MIG", []MIGCap{{Minor: 5, Kind: CapGIAccess, GPUMinor: 0, GI: 1}}, "gi1"},
		{"unknown kind", []MIGCap{{Minor: 5, Kind: "other"}}, "unknown kind"},
		{"negative minor", []MIGCap{{Minor: -5, Kind: CapConfig}}, "negative"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := newInventory(Inventory{Source: "nvml", GPUs: testGPUs(), MIGCaps: tc.caps})
			require.ErrorIs(t, err, ErrInvalidInventory)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
}

func TestInventoryLookups(t *testing.T) {
	gpus := testGPUs()
	// Out of order input: the inventory sorts by index.
	gpus[0], gpus[3] = gpus[3], gpus[0]
	gpus[1].MIG[0], gpus[1].MIG[2] = gpus[1].MIG[2], gpus[1].MIG[0]
	inv, err := NewInventory("nvml", gpus)
	require.NoError(t, err)

	var order []string
	for _, d := range inv.Devices() {
		order = append(order, d.Index)
	}
	assert.Equal(t, []string{"0", "1", "1:0", "1:1", "1:2", "2", "3"}, order)

	d, ok := inv.ByIndex("1:2")
	require.True(t, ok)
	assert.Equal(t, Device{UUID: migUUID(1, 2), Index: "1:2", Kind: KindMIG, Parent: gpuUUID(1)}, d)

	// Minor 3 is GPU index 1, not GPU 3.
	d, ok = inv.ByMinor(3)
	require.True(t, ok)
	assert.Equal(t, Device{UUID: gpuUUID(1), Index: "1", Kind: KindGPU}, d)
	_, ok = inv.ByMinor(4)
	assert.False(t, ok)

	d, ok = inv.Lookup(migUUID(1, 1))
	require.True(t, ok)
	assert.Equal(t, "1:1", d.Index)
	d, ok = inv.Lookup("GPU-A0000001-0000-4000-8000-000000000001") // upper case of gpuUUID(1)
	require.True(t, ok)
	assert.Equal(t, gpuUUID(1), d.UUID)
	_, ok = inv.Lookup("GPU-00000000-0000-4000-8000-000000000000")
	assert.False(t, ok)

	_, ok = inv.ByIndex("01")
	assert.False(t, ok, "ByIndex takes canonical spellings only")

	g, ok := inv.GPUOf(migUUID(1, 0))
	require.True(t, ok)
	assert.Equal(t, gpuUUID(1), g.UUID)
	assert.Equal(t, 3, g.Minor)
	require.Len(t, g.MIG, 3)
	assert.Equal(t, gpuUUID(1), g.MIG[0].ParentUUID, "parent UUID is filled in")
	assert.Equal(t, 1, g.MIG[0].ParentIndex, "parent index is filled in")

	assert.Equal(t, "MIG 1:0 ("+migUUID(1, 0)+") of GPU 1", inv.Describe(migUUID(1, 0)))
	assert.Equal(t, "GPU 2 ("+gpuUUID(2)+")", inv.Describe(gpuUUID(2)))
}

func TestInventoryIsImmutable(t *testing.T) {
	gpus := testGPUs()
	inv, err := NewInventory("static", gpus)
	require.NoError(t, err)
	gpus[0].UUID = gpuUUID(9)
	gpus[1].MIG[0].UUID = migUUID(9, 9)
	g, _ := inv.GPUOf(gpuUUID(1))
	g.MIG[0].UUID = migUUID(8, 8)

	assert.Equal(t, gpuUUID(0), inv.GPUs[0].UUID)
	assert.Equal(t, migUUID(1, 0), inv.GPUs[1].MIG[0].UUID)
	d, ok := inv.ByIndex("1:0")
	require.True(t, ok)
	assert.Equal(t, migUUID(1, 0), d.UUID)
}

func TestZeroInventoryIsEmpty(t *testing.T) {
	var inv *Inventory
	assert.Nil(t, inv.Devices())
	_, ok := inv.Lookup(gpuUUID(0))
	assert.False(t, ok)
	_, ok = (&Inventory{}).ByMinor(0)
	assert.False(t, ok)
	_, ok = (&Inventory{}).ByIndex("0")
	assert.False(t, ok)
	_, ok = (&Inventory{}).GPUOf(gpuUUID(0))
	assert.False(t, ok)
}

func TestInventoryJSONRoundTripRebuildsIndexes(t *testing.T) {
	inv := testInventory(t)
	data, err := json.Marshal(inv)
	require.NoError(t, err)

	var back Inventory
	require.NoError(t, json.Unmarshal(data, &back))
	assert.Equal(t, inv.GPUs, back.GPUs)
	assert.Equal(t, inv.MIGCaps, back.MIGCaps)
	assert.Equal(t, inv.CapsMajor, back.CapsMajor)
	d, ok := back.ByMinor(3)
	require.True(t, ok, "the minor index is rebuilt")
	assert.Equal(t, gpuUUID(1), d.UUID)
	d, ok = back.ByIndex("1:1")
	require.True(t, ok, "the index map is rebuilt")
	assert.Equal(t, migUUID(1, 1), d.UUID)
	assert.Equal(t, inv.Devices(), back.Devices())

	// The decoded inventory resolves like the original.
	req := Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=1:1,0"}, Devices: []LinuxDevice{{Path: "/dev/nvidia1", Type: "c", Major: 195, Minor: 1}}}
	want, err := NewResolver(inv, defaultPolicy()).Resolve(req)
	require.NoError(t, err)
	got, err := NewResolver(&back, defaultPolicy()).Resolve(req)
	require.NoError(t, err)
	assert.Equal(t, want, got)
}

func TestInventoryJSONValidates(t *testing.T) {
	for _, doc := range []string{
		`{"source":"nvml","gpus":[{"index":0,"uuid":"GPU-c0000000-0000-4000-8000-000000000000","minor":0},{"index":1,"uuid":"GPU-a0000001-0000-4000-8000-000000000001","minor":0}]}`,
		`{"source":"","gpus":[]}`,
		`{"source":"nvml","gpus":[{"index":0,"uuid":"nope","minor":0}]}`,
		`{"source":"nvml","gpus":[],"mig_caps":[{"minor":3,"kind":"gi","gpu_minor":0,"gi":1}]}`,
	} {
		var inv Inventory
		err := json.Unmarshal([]byte(doc), &inv)
		require.ErrorIs(t, err, ErrInvalidInventory, doc)
	}
	var inv Inventory
	require.Error(t, json.Unmarshal([]byte(`{"source":`), &inv))
}

func TestNormaliseBusID(t *testing.T) {
	for in, want := range map[string]string{
		"0000:3b:00.0":     "0000:3b:00.0",
		"00000000:3B:00.0": "0000:3b:00.0",
		"0:3b:0.0":         "0000:3b:00.0",
		"0001:c1:1f.7":     "0001:c1:1f.7",
	} {
		got, ok := NormaliseBusID(in)
		assert.True(t, ok, in)
		assert.Equal(t, want, got, in)
	}
	for _, in := range []string{"", "3b:00.0", "0000:3b:00", "0000:3b:20.0", "0000:3b:00.8", "0000:xx:00.0", "000000000:3b:00.0", "0000:3b:00.0.0"} {
		_, ok := NormaliseBusID(in)
		assert.False(t, ok, in)
	}
}

func TestSummaryIsBounded(t *testing.T) {
	gpus := make([]GPU, 16)
	for i := range gpus {
		gpus[i] = GPU{Index: i, UUID: gpuUUID(i), Minor: i}
	}
	gpus[15].Index = 20 // a gap, as when a display GPU is skipped
	inv, err := NewInventory("nvml", gpus)
	require.NoError(t, err)
	assert.Contains(t, inv.idx.known, "known: 0-14, 20 / GPU-c0000000…, GPU-a0000001…")
	assert.Contains(t, inv.idx.known, "(8 more)")
	assert.Equal(t, "known minors: 0-15", inv.idx.knownMinors)
}
