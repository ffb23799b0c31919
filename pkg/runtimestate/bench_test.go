// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package runtimestate

import (
	"fmt"
	"testing"
)

// BenchmarkScan: one root of 100 live runc containers (a busy podman host),
// each with the real state.json runc wrote (about 6 KiB) and a bundle, and
// 100 stopped ones (their state only, no bundle read).
func BenchmarkScan(b *testing.B) {
	h := newHost(b)
	root := h.root("runc")
	for i := range 200 {
		id := fmt.Sprintf("ctr%03d", i)
		pid := 1000 + i
		if i%2 == 0 {
			h.process(pid, uint64(pid), 'S')
		}
		h.runc(root, id, pid, uint64(pid), h.bundle(id, []string{"NVIDIA_VISIBLE_DEVICES=1"}, nil), false)
	}
	for b.Loop() {
		res := h.scan(root)
		if len(res.Live()) != 100 || len(res.Problems) != 0 {
			b.Fatalf("live %d, problems %v", len(res.Live()), res.Problems)
		}
	}
}
