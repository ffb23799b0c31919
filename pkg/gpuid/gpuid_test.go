// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package gpuid

import "testing"

func TestUUIDs(t *testing.T) {
	for _, tc := range []struct {
		s        string
		gpu, mig bool
	}{
		{"GPU-6c1a2f2e-0000-4000-8000-000000000001", true, false},
		{"GPU-6C1A2F2E-0000-4000-8000-00000000000F", true, false},
		{"MIG-6c1a2f2e-0000-4000-8000-000000000001", false, true},
		{"gpu-6c1a2f2e-0000-4000-8000-000000000001", false, false},  // prefix is case-sensitive
		{"GPU-6c1a2f2e-0000-4000-8000-00000000000", false, false},   // one digit short
		{"GPU-6c1a2f2e-0000-4000-8000-0000000000001", false, false}, // one digit long
		{"GPU-6c1a2f2e00000-4000-8000-000000000001", false, false},  // dash missing
		{"GPU-6c1a2f2g-0000-4000-8000-000000000001", false, false},  // not hex
		{"MIG-GPU-6c1a2f2e-0000-4000-8000-000000000001/1/0", false, false},
		{"", false, false},
	} {
		if got := IsGPUUUID(tc.s); got != tc.gpu {
			t.Errorf("IsGPUUUID(%q) = %v, want %v", tc.s, got, tc.gpu)
		}
		if got := IsMIGUUID(tc.s); got != tc.mig {
			t.Errorf("IsMIGUUID(%q) = %v, want %v", tc.s, got, tc.mig)
		}
	}
}

func TestMinors(t *testing.T) {
	for minor, want := range map[int]bool{-1: false, 0: true, 253: true, 254: false, 255: false} {
		if got := IsGPUMinor(minor); got != want {
			t.Errorf("IsGPUMinor(%d) = %v, want %v", minor, got, want)
		}
	}
}
