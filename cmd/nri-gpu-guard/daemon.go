// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/daemon"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/metrics"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/nriplugin"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// daemonOptions configure runDaemon.
type daemonOptions struct {
	// Config is the configuration from file/flags.
	Config config.Config
	// Identity names the plugin and the socket to dial.
	Identity nriplugin.Identity
	// Logger; nil = discard.
	Logger *slog.Logger
	// OpenNVML overrides how the GPU observer opens NVML (tests); nil = the
	// host's library.
	OpenNVML func() (observe.Source, error)
	// ProcRoot holds the host's proc/ for the observer; "" = "/".
	ProcRoot string
	// MetricsRetry is the first wait before the metrics endpoint is tried
	// again after it failed (tests); 0 = metricsMinBackoff.
	MetricsRetry time.Duration
}

// Bounds of the wait between two attempts to serve the metrics endpoint.
const (
	metricsMinBackoff = time.Second
	metricsMaxBackoff = 10 * time.Second
)

// serveMetrics serves the metrics endpoint on listen until ctx is done. An
// endpoint that cannot listen (the port is taken, the address not there yet)
// or that fails is logged and tried again with backoff, forever: it never
// stops the plugin. Enforcement does not depend on it, and ending the daemon
// for it would leave GPU containers unchecked: an external daemon would
// crash-loop, and containerd never relaunches a plugin it launched.
func serveMetrics(ctx context.Context, m *metrics.Metrics, listen string, log *slog.Logger, first time.Duration) {
	if first <= 0 {
		first = metricsMinBackoff
	}
	backoff := first
	for {
		started := time.Now()
		err := m.Serve(ctx, listen, log)
		if ctx.Err() != nil {
			return
		}
		if time.Since(started) > metricsMaxBackoff {
			backoff = first // it served for a while: a new failure
		}
		log.Error("metrics endpoint failed; the guard keeps enforcing without it (no /metrics, /healthz or /readyz meanwhile), retrying",
			"listen", listen, "retry_in", backoff.String(), "error", err)
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(backoff*2, metricsMaxBackoff)
	}
}

// runDaemon is the whole NRI daemon: it builds the guard, serves metrics when
// [metrics] listen is set (retrying while it cannot, see serveMetrics), runs
// the GPU observer (when NVML is there) on the guard of the latest setup, and
// runs the plugin until ctx is done.
//
// An external daemon builds the guard once up front, so a broken
// configuration, an unsafe ledger dir or a missing inventory fail at start,
// not at registration. A plugin launched by containerd gets its configuration
// only with Configure (the conf.d file; it has no flags and a bare
// environment), so it builds the guard there, and starts the metrics endpoint
// from that configuration once the first setup succeeded.
func runDaemon(ctx context.Context, opts daemonOptions) error {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	b := &daemon.Builder{Logger: log}
	launched := nriplugin.Launched()
	// Decisions are counted from the start; the endpoint serves them once a
	// configuration names [metrics] listen.
	m := metrics.New()
	b.Observer = m
	var first *guard.Guard
	if !launched {
		g, err := b.Setup(ctx, opts.Config)
		if err != nil {
			return err
		}
		first = g
	}
	ctx, cancel := context.WithCancel(ctx)
	// The background goroutines (the watch, the rediscovery, the metrics
	// endpoint) stop with the plugin: cancel, then wait for them.
	var background sync.WaitGroup
	defer background.Wait()
	defer cancel()
	// The observer runs beside admission, never in its path: Use only hands
	// over the guard, the watch does its NVML work in its own goroutines.
	watch := daemon.NewWatch()
	watch.Logger, watch.Metrics = log.With("component", "observe"), m
	watch.OpenNVML, watch.ProcRoot = opts.OpenNVML, opts.ProcRoot
	watch.SetReady(false) // until the first Synchronize
	background.Go(func() { watch.Run(ctx) })
	if first != nil {
		watch.Use(first)
	}
	// An inventory that lists no GPU (the NVIDIA driver came up after the
	// daemon, as a GPU Operator's driver container does) is discovered
	// again in the background and swapped into the guards; the observer
	// then restarts over the GPUs it lists.
	background.Go(func() { b.Rediscover(ctx, watch.Use) })
	var serveOnce sync.Once
	serve := func(listen string) {
		if listen == "" {
			return
		}
		serveOnce.Do(func() {
			background.Go(func() { serveMetrics(ctx, m, listen, log, opts.MetricsRetry) })
		})
	}
	setup := func(ctx context.Context, cfg config.Config) (*guard.Guard, error) {
		g, err := b.Setup(ctx, cfg)
		if err == nil {
			watch.Use(g)
			if launched {
				serve(cfg.Metrics.Listen)
			}
		}
		return g, err
	}
	if !launched {
		serve(opts.Config.Metrics.Listen)
	}
	popts := nriplugin.Options{Config: opts.Config, Setup: setup, Logger: log,
		Ready: func(ready bool) { m.SetReady(ready); watch.SetReady(ready) }, Exempt: watch, Gauges: m}
	p, err := nriplugin.New(popts)
	if err == nil {
		m.SetStateSource(func(ctx context.Context) (ledger.State, error) {
			g := p.Guard()
			if g == nil {
				return ledger.State{}, errors.New("not configured yet")
			}
			return g.Ledger().Snapshot(ctx)
		})
	}
	if err != nil {
		return err
	}
	return p.Run(ctx, opts.Identity.WithDefaults(opts.Config.NRI))
}
