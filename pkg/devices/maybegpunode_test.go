// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// MayBeGPUNode reads an entry's major as written and as the runtime makes
// the node of it: a major past 12 bits whose low bits are NVIDIA's (or a
// dynamic one) may be a GPU or capability node, whatever it looks like.
func TestMayBeGPUNode(t *testing.T) {
	for _, tc := range []struct {
		name string
		d    LinuxDevice
		want bool
	}{
		{"NVIDIA's major", LinuxDevice{Path: "/dev/x", Type: "c", Major: 195, Minor: 0}, true},
		{"a dynamic major", LinuxDevice{Path: "/dev/x", Type: "c", Major: 508, Minor: 31}, true},
		{"named /dev/nvidia*", LinuxDevice{Path: "/dev/nvidia-uvm", Type: "c", Major: 1, Minor: 3}, true},
		{"a fixed major", LinuxDevice{Path: "/dev/null", Type: "c", Major: 1, Minor: 3}, false},
		{"a block device", LinuxDevice{Path: "/dev/sda", Type: "b", Major: 195, Minor: 0}, false},
		{"made as 195 (major 4291)", LinuxDevice{Path: "/dev/x", Type: "c", Major: 4291, Minor: 0}, true},
		{"made as 195 (2^32 + 195)", LinuxDevice{Path: "/dev/x", Type: "c", Major: 4294967491, Minor: 0}, true},
		{"made as a dynamic major (negative)", LinuxDevice{Path: "/dev/x", Type: "c", Major: -4294966788, Minor: 31}, true},
		{"written past 12 bits, made as a fixed major (4097)", LinuxDevice{Path: "/dev/x", Type: "c", Major: 4097, Minor: 3}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, MayBeGPUNode(tc.d))
		})
	}
}
