// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package observe

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
)

// countShutdowns makes the mock report each NVML shutdown on the returned
// channel.
func countShutdowns(h *mockHost) chan struct{} {
	ch := make(chan struct{}, 4)
	shutdown := h.srv.ShutdownFunc
	h.srv.ShutdownFunc = func() nvml.Return {
		ch <- struct{}{}
		return shutdown()
	}
	return ch
}

// noShutdownYet fails when NVML was already shut down.
func noShutdownYet(t *testing.T, ch chan struct{}) {
	t.Helper()
	select {
	case <-ch:
		t.Fatal("NVML was shut down while a query was still inside it")
	default:
	}
}

// TestRunStopsWhileNVMLHangsInEventWait: an NVML event wait that never
// returns does not keep Run from returning when its context ends, and
// closing the source then does not shut NVML down under the wait: the
// shutdown happens when the wait returns.
func TestRunStopsWhileNVMLHangsInEventWait(t *testing.T) {
	h := newMockA100(t)
	shutdowns := countShutdowns(h)
	entered, release := make(chan struct{}, 1), make(chan struct{})
	h.srv.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) {
		return &mock.EventSet{
			WaitFunc: func(uint32) (nvml.EventData, nvml.Return) {
				select {
				case entered <- struct{}{}:
				default:
				}
				<-release
				return nvml.EventData{}, nvml.ERROR_TIMEOUT
			},
			FreeFunc: func() nvml.Return { return nvml.SUCCESS },
		}, nvml.SUCCESS
	}
	src, err := OpenNVML(h.srv)
	require.NoError(t, err)
	o, err := New(Options{Source: src, GPUs: h.gpus, Ledger: &holdings{}, ProcRoot: newFakeProc(t, 1000).root,
		EventWait: 1e6})
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { o.Run(ctx); close(done) }()
	testwait.Receive(t, entered, "event wait")
	cancel()
	testwait.Receive(t, done, "Run to return while NVML hangs")

	require.NoError(t, src.Close())
	noShutdownYet(t, shutdowns)
	close(release)
	testwait.Receive(t, shutdowns, "shutdown once the wait returned")
	require.NoError(t, src.Close(), "a second Close does nothing")
}

// TestCloseWaitsForAListingInFlight: a listing the observer gave up on (its
// context ended) is still inside NVML; Close leaves NVML up until it returns,
// and later queries on the closed source fail instead of calling NVML.
func TestCloseWaitsForAListingInFlight(t *testing.T) {
	h := newMockA100(t)
	shutdowns := countShutdowns(h)
	release := make(chan struct{})
	h.mu.Lock()
	h.block[h.uuid(0)] = release
	h.mu.Unlock()
	src, err := OpenNVML(h.srv)
	require.NoError(t, err)
	o, err := New(Options{Source: src, GPUs: h.gpus, Ledger: &holdings{}, ProcRoot: newFakeProc(t, 1000).root})
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { _, err := o.Account(ctx); errc <- err }()
	testwait.Receive(t, h.entered, "listing inside NVML")
	cancel()
	require.ErrorIs(t, testwait.Receive(t, errc, "Account to give up"), ErrNVMLSlow)

	require.NoError(t, src.Close())
	noShutdownYet(t, shutdowns)
	close(release)
	testwait.Receive(t, shutdowns, "shutdown once the listing returned")

	// The slot is free again once the listing returned; the closed source
	// answers without NVML.
	h.mu.Lock()
	delete(h.block, h.uuid(0))
	h.mu.Unlock()
	r, err := o.Account(context.Background())
	require.NoError(t, err)
	require.NotEmpty(t, r.Devices)
	assert.Contains(t, r.Devices[0].Error, "NVML source is closed")
	assert.Empty(t, r.Problems(), "a closed source is an error, not a finding")
}

// TestNoGPUsDoesNotSpin: with no GPU to watch, the health watcher does not
// loop on NVML event waits (which NVML may answer at once for an empty set);
// it idles until its context ends.
func TestNoGPUsDoesNotSpin(t *testing.T) {
	h := newMockA100(t)
	var waits atomic.Int64
	created, freed := make(chan struct{}, 1), make(chan struct{}, 1)
	h.srv.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) {
		created <- struct{}{}
		return &mock.EventSet{
			WaitFunc: func(uint32) (nvml.EventData, nvml.Return) {
				waits.Add(1)
				return nvml.EventData{}, nvml.ERROR_TIMEOUT // at once
			},
			FreeFunc: func() nvml.Return { freed <- struct{}{}; return nvml.SUCCESS },
		}, nvml.SUCCESS
	}
	src, err := OpenNVML(h.srv)
	require.NoError(t, err)
	t.Cleanup(func() { _ = src.Close() })
	o, err := New(Options{Source: src, Ledger: &holdings{}, ProcRoot: newFakeProc(t, 1000).root})
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { o.Run(ctx); close(done) }()
	testwait.Receive(t, created, "event set")
	cancel()
	testwait.Receive(t, done, "Run to return")
	testwait.Receive(t, freed, "the watcher to leave")
	assert.Zero(t, waits.Load(), "no event wait on an empty set")
}

// signalHandler is a slog handler that sends each message on a channel.
type signalHandler struct{ ch chan string }

func (h signalHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h signalHandler) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool { b.WriteString(" " + a.String()); return true })
	select {
	case h.ch <- b.String():
	default:
	}
	return nil
}
func (h signalHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h signalHandler) WithGroup(string) slog.Handler      { return h }

// TestSlowCallbacksDoNotHoldUpTheObserver: while OnUnhealthy is stuck, the
// watcher keeps judging events (a second GPU becomes unhealthy); while
// OnReport is stuck, passes keep running; once unstuck, every unhealthy
// device is delivered, and the report delivered is a fresh one.
func TestSlowCallbacksDoNotHoldUpTheObserver(t *testing.T) {
	h := newMockA100(t)
	logs := make(chan string, 64)
	unhealthy := make(chan Finding, 8)
	unblock := make(chan struct{})
	// stuck is told when a callback has started to wait for unblock: from
	// then until close(unblock) the dispatcher is held up.
	stuck := make(chan struct{}, 1)
	block := func() {
		select {
		case stuck <- struct{}{}:
		default:
		}
		<-unblock
	}
	reports := make(chan Report, 8)
	passes := make(chan struct{}, 64)
	var holdingsCalls atomic.Int64
	o, _ := newObserver(t, h, newFakeProc(t, 1000), LedgerFunc(func() ([]Holding, error) {
		holdingsCalls.Add(1)
		select {
		case passes <- struct{}{}:
		default:
		}
		return nil, nil
	}), func(opts *Options) {
		opts.Logger = slog.New(signalHandler{logs})
		opts.Interval = 1e6
		opts.OnUnhealthy = func(f Finding) { block(); unhealthy <- f }
		opts.OnReport = func(r Report) { block(); reports <- r }
	})
	startRun(t, o)

	h.events <- xidEvent(h.srv.Devices[3], 79)
	h.events <- xidEvent(h.srv.Devices[6], 79)
	for {
		if m := testwait.Receive(t, logs, "log line"); strings.Contains(m, "GPU unhealthy") && strings.Contains(m, h.uuid(6)) {
			break
		}
	}
	_, ok := o.Health(h.uuid(6))
	assert.True(t, ok, "judged while the first callback is stuck")
	// Passes go on while a callback is stuck: five more than had run
	// when it was known stuck. (passes may still hold tokens of earlier
	// passes; if passes stopped, they run out and receive fails.)
	testwait.Receive(t, stuck, "a stuck callback")
	for before := holdingsCalls.Load(); holdingsCalls.Load() < before+5; {
		testwait.Receive(t, passes, "accounting pass")
	}
	close(unblock)
	assert.Equal(t, "3", testwait.Receive(t, unhealthy, "first unhealthy").Device.Index)
	assert.Equal(t, "6", testwait.Receive(t, unhealthy, "second unhealthy").Device.Index)
	testwait.Receive(t, reports, "a report")
}
