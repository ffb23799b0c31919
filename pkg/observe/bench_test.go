// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package observe

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"
)

// BenchmarkAccountingPass measures one accounting pass on go-nvml's DGX A100
// mock (8 GPUs), each GPU held by one container running two processes, plus
// one intruder: 17 pids, each mapped through a fake /proc tree on disk (three
// file reads per pid, as on a host). The reported cpu-%-at-10s is the share
// of one core the observer takes at the default interval.
func BenchmarkAccountingPass(b *testing.B) {
	h := newMockA100(b)
	fp := newFakeProc(b, 1000)
	var ledger holdings
	pid := uint32(1000)
	for i := range h.gpus {
		id := strings.Repeat(fmt.Sprintf("%02x", i+1), 32)
		ledger = append(ledger, Holding{DeviceUUID: h.uuid(i), ContainerID: id})
		for range 2 {
			fp.addIn(int(pid), 10, id)
			h.run(h.uuid(i), pid, 1<<30)
			pid++
		}
	}
	fp.add(int(pid), 10, "0::/user.slice/user-0.slice/session-1.scope\n")
	h.run(h.uuid(7), pid, 1<<20)
	o, _ := newObserver(b, h, fp, &ledger, nil)
	ctx := context.Background()

	r, err := o.Account(ctx)
	if err != nil || len(r.Problems()) != 1 {
		b.Fatalf("setup: %v, %+v", err, r.Findings)
	}
	b.ReportAllocs()
	cpu0 := cpuTime(b)
	for b.Loop() {
		if _, err := o.Account(ctx); err != nil {
			b.Fatal(err)
		}
	}
	// CPU time (user + system, this process), not wall time: what the
	// pass takes from the machine, whatever else runs on it.
	perPass := (cpuTime(b) - cpu0) / time.Duration(b.N)
	b.ReportMetric(float64(perPass.Microseconds()), "cpu-µs/pass")
	b.ReportMetric(100*perPass.Seconds()/(10*time.Second).Seconds(), "cpu-%-at-10s")
}

func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
