// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// BenchmarkStatus runs `status` end to end (configuration, inventory cache,
// ledger read with the queue mechanics, liveness, rendering) on a host with 64
// GPUs, 32 of them held, and 1,000 waiters.
func BenchmarkStatus(b *testing.B) {
	for _, output := range []string{outputTable, outputJSON} {
		b.Run(output, func(b *testing.B) {
			f := newFixture(b)
			inv := benchInventory(b)
			require.NoError(b, devices.SaveCache(filepath.Join(f.dir, devices.CacheFile), inv, bootID))
			devs := inv.Devices()

			f.update(b, now.Add(-time.Hour), func(tx *ledger.Tx) {
				for i := range 32 {
					o := owner(fmt.Sprintf("%064x", i+1), "ns", fmt.Sprintf("holder-%d", i), "main", ledger.FrontEndNRI)
					claim(b, tx, o, "env", devs[i])
				}
			})
			f.update(b, now.Add(-time.Minute), func(tx *ledger.Tx) {
				for i := range 1000 {
					o := owner(fmt.Sprintf("%064x", 10_000+i), "ns", fmt.Sprintf("waiter-%d", i), "main", ledger.FrontEndNRI)
					tx.Enqueue(key(o), o, []devices.Device{devs[i%32], devs[(i+1)%32]})
				}
			})
			if st, err := os.Stat(filepath.Join(f.dir, "ledger.json")); err == nil {
				b.ReportMetric(float64(st.Size()), "ledger-bytes")
			}
			env := f.env(&syncBuffer{}, &syncBuffer{})
			env.Stdout = io.Discard
			args := []string{"--config", f.config, "status", "-o", output}
			b.ResetTimer()
			for b.Loop() {
				if code := Run(context.Background(), args, env); code != ExitOK {
					b.Fatalf("status exited %d", code)
				}
			}
		})
	}
}

// BenchmarkStatusRender is the part of status that is gpu-guard-ctl's own:
// joining a state of 32 claims and 1,000 waiters with a 64-GPU inventory and
// rendering it (the rest of BenchmarkStatus is reading and decoding files).
func BenchmarkStatusRender(b *testing.B) {
	f := newFixture(b)
	inv, st := benchState(b, 0)
	for b.Loop() {
		v := buildStatus(&st, headWait{}, inv, inventoryInfo{Origin: "cache"}, guard.NewReleaseRule(config.Default(), f.liveness), true)
		if err := v.render(io.Discard, outputTable, now); err != nil {
			b.Fatal(err)
		}
	}
}

// benchInventory is the benchmarks' host: 64 H100s.
func benchInventory(b *testing.B) *devices.Inventory {
	gpus := make([]devices.GPU, 64)
	for i := range gpus {
		gpus[i] = devices.GPU{Index: i, UUID: fmt.Sprintf("GPU-%08x-0000-4000-8000-000000000000", i), Minor: i, Model: "NVIDIA H100 80GB HBM3"}
	}
	inv, err := devices.NewInventory("nvml", gpus)
	require.NoError(b, err)
	return inv
}

// benchState is the render benchmarks' state on benchInventory: GPUs 0-31
// held for an hour (the first `draining` of them draining for a minute) and
// 1,000 waiters, each for two of the held GPUs.
func benchState(b *testing.B, draining int) (*devices.Inventory, ledger.State) {
	inv := benchInventory(b)
	devs := inv.Devices()
	var st ledger.State
	for i := range 32 {
		o := owner(fmt.Sprintf("%064x", i+1), "ns", fmt.Sprintf("holder-%d", i), "main", ledger.FrontEndNRI)
		if i < draining {
			o.DrainingSince = now.Add(-time.Minute)
		}
		st.Claims = append(st.Claims, ledger.Claim{Device: devs[i], Owner: o, Source: "env", Since: now.Add(-time.Hour)})
	}
	for i := range 1000 {
		o := owner(fmt.Sprintf("%064x", 10_000+i), "ns", fmt.Sprintf("waiter-%d", i), "main", ledger.FrontEndNRI)
		st.Waiters = append(st.Waiters, ledger.Waiter{Key: key(o), Seq: uint64(i), Owner: o,
			Devices: []devices.Device{devs[i%32], devs[(i+1)%32]}, FirstSeen: now.Add(-time.Minute), LastSeen: now})
	}
	return inv, st
}
