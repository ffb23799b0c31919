// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package daemon

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// BenchmarkAdmitWithObserver is one admission (claim, then stop) on the
// daemon's guard over a real ledger, with the observer off, at its default
// interval (10s), and at a stress interval (10ms) on go-nvml's DGX A100 mock
// with every GPU held and two processes on each: the observer reads the
// ledger without its lock and queries NVML in its own goroutines, so
// admission latency must not move.
func BenchmarkAdmitWithObserver(b *testing.B) {
	for _, tc := range []struct {
		name     string
		interval time.Duration
	}{{"observer=off", 0}, {"observer=10s", 10 * time.Second}, {"observer=10ms", 10 * time.Millisecond}} {
		b.Run(tc.name, func(b *testing.B) {
			h := newGPUHost(b)
			g := guardFor(b, h, nil)
			// GPUs 1-7 held by running containers; GPU 0 is the one
			// admitted in the loop.
			for i := 1; i < len(h.srv.Devices); i++ {
				id := strings.Repeat(fmt.Sprintf("%02x", i), 32)
				d, err := g.Admit(context.Background(), guard.Request{FrontEnd: ledger.FrontEndNRI,
					Owner: ledger.Owner{ContainerID: id, Namespace: "ml", Pod: fmt.Sprint("p", i), PodUID: fmt.Sprint("u", i), Container: "c", FrontEnd: ledger.FrontEndNRI},
					Spec:  devices.Request{Env: []string{fmt.Sprint("NVIDIA_VISIBLE_DEVICES=", i)}}})
				if err != nil || d.Result != guard.Admit {
					b.Fatal(err, d.Message)
				}
				h.run(i, 1000+2*i, id)
				h.run(i, 1001+2*i, id)
			}
			if tc.interval > 0 {
				w := NewWatch()
				w.Interval = tc.interval
				w.ProcRoot = h.proc
				w.OpenNVML = func() (observe.Source, error) { return observe.OpenNVML(h.srv) }
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan struct{})
				go func() { w.Run(ctx); close(done) }()
				defer func() { cancel(); <-done }()
				w.Use(g)
			}
			ctx := context.Background()
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				o := ledger.Owner{ContainerID: fmt.Sprintf("bench%059d", i), Namespace: "ml", Pod: "bench", PodUID: "ub",
					Container: "main", FrontEnd: ledger.FrontEndNRI}
				d, err := g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: o,
					Spec: devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=0"}}})
				if err != nil || d.Result != guard.Admit {
					b.Fatal(err, d.Message)
				}
				if err := g.Stopped(ctx, o); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkDaemonPass is one whole periodic pass of the daemon's observer on
// go-nvml's DGX A100 mock (8 GPUs, each held, two processes each, plus one
// intruder): the ledger snapshot, the NVML listing, the /proc mapping, the
// comparison, the policy (nothing new to log or audit after the first pass),
// the metrics and the observe.json rewrite. cpu-%-at-10s is the share of one
// core it takes at the default interval.
func BenchmarkDaemonPass(b *testing.B) {
	h := newGPUHost(b)
	g := guardFor(b, h, nil)
	for i := range h.srv.Devices {
		id := strings.Repeat(fmt.Sprintf("%02x", i+1), 32)
		d, err := g.Admit(context.Background(), guard.Request{FrontEnd: ledger.FrontEndNRI,
			Owner: ledger.Owner{ContainerID: id, Namespace: "ml", Pod: fmt.Sprint("p", i), PodUID: fmt.Sprint("u", i), Container: "c", FrontEnd: ledger.FrontEndNRI},
			Spec:  devices.Request{Env: []string{fmt.Sprint("NVIDIA_VISIBLE_DEVICES=", i)}}})
		if err != nil || d.Result != guard.Admit {
			b.Fatal(err, d.Message)
		}
		h.run(i, 1000+2*i, id)
		h.run(i, 1001+2*i, id)
	}
	h.run(7, 5000, "")
	src, err := observe.OpenNVML(h.srv)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = src.Close() }()
	w := NewWatch()
	w.g, w.reported, w.interval = g, map[string]observe.FileFinding{}, 10*time.Second
	w.Metrics = nopMetrics{}
	ctx := context.Background()
	o, err := observe.New(observe.Options{Source: src, GPUs: g.Inventory().GPUs, ProcRoot: h.proc,
		Ledger: observe.LedgerFunc(func() ([]observe.Holding, error) { return w.holdings(ctx) })})
	if err != nil {
		b.Fatal(err)
	}
	cfg := g.Config()
	pass := func() {
		r, err := o.Account(ctx)
		if err != nil || len(r.Problems()) != 1 {
			b.Fatal(err, r.Findings)
		}
		w.onReport(ctx, cfg, r)
	}
	pass() // the first pass logs and audits the intruder
	cpu0 := cpuTime(b)
	for b.Loop() {
		pass()
	}
	perPass := (cpuTime(b) - cpu0) / time.Duration(b.N)
	b.ReportMetric(float64(perPass.Microseconds()), "cpu-µs/pass")
	b.ReportMetric(100*perPass.Seconds()/10, "cpu-%-at-10s")
}

type nopMetrics struct{}

func (nopMetrics) ObserverReport(observe.Report)      {}
func (nopMetrics) UnhealthyDevices([]observe.Finding) {}

func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
