// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseSMI(t *testing.T) {
	const (
		g0 = "GPU-5ba12cd1-0000-4000-8000-000000000000"
		g1 = "GPU-6ca12cd1-0000-4000-8000-000000000001"
		m0 = "MIG-c6d4f1ef-0000-4000-8000-000000000000"
		m1 = "MIG-cba663e8-0000-4000-8000-000000000001"
	)
	query := "0, " + g0 + ", 3, 00000000:07:00.0\n1, " + g1 + ", [N/A], 00000000:0F:00.0\n"
	list := "GPU 0: NVIDIA H200 (UUID: " + g0 + ")\n" +
		"  MIG 1g.18gb     Device  0: (UUID: " + m0 + ")\n" +
		"  MIG 3g.71gb     Device  2: (UUID: " + m1 + ")\n" +
		"GPU 1: NVIDIA H200 (UUID: " + g1 + ")\n"
	gpus, err := parseSMI(query, list)
	require.NoError(t, err)
	assert.Equal(t, []smiGPU{
		{index: 0, uuid: g0, minor: "3", bus: "00000000:07:00.0", migs: []smiMIG{{0, m0}, {2, m1}}},
		{index: 1, uuid: g1, minor: "[N/A]", bus: "00000000:0F:00.0"},
	}, gpus)

	_, err = parseSMI("0, "+g0+", 3\n", "")
	require.Error(t, err, "a short line is refused")
	_, err = parseSMI(query, "GPU 0: NVIDIA H200 (UUID: "+g1+")\n")
	require.ErrorContains(t, err, "disagree")
}

func TestBusKey(t *testing.T) {
	assert.Equal(t, busKey("00000000:3B:00.0"), busKey("0000:3b:00.0"))
	assert.NotEqual(t, busKey("0000:3b:00.0"), busKey("0000:3c:00.0"))
}

func TestParseComputeApps(t *testing.T) {
	const g0 = "GPU-5ba12cd1-0000-4000-8000-000000000000"
	apps, err := parseComputeApps("4242, " + g0 + ", 1024 MiB\n77, " + g0 + ", [N/A]\n")
	require.NoError(t, err)
	assert.Equal(t, []computeApp{{4242, g0, "1024 MiB"}, {77, g0, "[N/A]"}}, apps)

	apps, err = parseComputeApps("No running processes found\n")
	require.NoError(t, err)
	assert.Empty(t, apps)

	_, err = parseComputeApps("x, " + g0 + ", 1 MiB\n")
	require.ErrorContains(t, err, "unexpected pid")
	_, err = parseComputeApps("1, 2\n")
	require.ErrorContains(t, err, "unexpected nvidia-smi --query-compute-apps line")
}
