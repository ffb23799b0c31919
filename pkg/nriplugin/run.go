// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// Identity is how the plugin names itself to the runtime. Empty fields are
// left to the stub, which takes them from NRI_PLUGIN_NAME / NRI_PLUGIN_IDX
// (set by containerd for a launched plugin) or from the executable's name.
type Identity struct {
	Name   string
	Index  string
	Socket string
}

// Launched reports whether containerd started this process as a
// pre-installed plugin (the connection is an inherited fd named by
// NRI_PLUGIN_SOCKET).
func Launched() bool { return os.Getenv(api.PluginSocketEnvVar) != "" }

// stubOptions builds the stub options for one connection. An index is passed
// only when containerd did not set one: the stub refuses a second index.
func (p *Plugin) stubOptions(id Identity, onClose func()) []stub.Option {
	opts := []stub.Option{
		stub.WithLogger(slogAdapter{log: p.log}),
		// For runtimes that honour it (NRI >= v0.12.4): a plugin failure
		// fails the request instead of letting the container through, and a
		// slow answer does not get the plugin dropped.
		stub.WithFailurePolicy(&api.FailurePolicy{FailRequest: true, KeepConnected: true}),
		stub.WithOnClose(onClose),
	}
	if id.Name != "" {
		opts = append(opts, stub.WithPluginName(id.Name))
	}
	if id.Index != "" && os.Getenv(api.PluginIdxEnvVar) == "" {
		opts = append(opts, stub.WithPluginIdx(id.Index))
	}
	if id.Socket != "" && !Launched() {
		opts = append(opts, stub.WithSocketPath(id.Socket))
	}
	return opts
}

// WithDefaults fills what neither a flag nor containerd's environment set
// from the [nri] configuration.
func (id Identity) WithDefaults(cfg config.NRIConfig) Identity {
	if id.Name == "" && os.Getenv(api.PluginNameEnvVar) == "" {
		id.Name = cfg.PluginName
	}
	if id.Index == "" && os.Getenv(api.PluginIdxEnvVar) == "" {
		id.Index = cfg.PluginIndex
	}
	if id.Socket == "" {
		id.Socket = cfg.Socket
	}
	return id
}

// Backoff bounds for reconnecting to the runtime.
const (
	minBackoff = 500 * time.Millisecond
	maxBackoff = 5 * time.Second // while the guard is away, required_plugins refuses every creation
)

// Run connects the plugin to the runtime and serves it until ctx is done.
//
// Launched by containerd, it serves the inherited connection and returns when
// that closes (containerd never relaunches a plugin; the error says so).
// External, it dials id.Socket and reconnects with exponential backoff
// whenever the connection closes or cannot be made; every reconnect brings a
// full Synchronize. It returns nil once ctx is done (SIGTERM/SIGINT).
func (p *Plugin) Run(ctx context.Context, id Identity) error {
	// The retries of failed releases end with the plugin.
	defer p.halt()
	launched := Launched()
	p.inPlace.Store(launched || p.forceInPlace)
	if name := id.Name; name != "" {
		p.registeredName.Store(name)
	} else if name = os.Getenv(api.PluginNameEnvVar); name != "" {
		p.registeredName.Store(name)
	}
	backoff := minBackoff
	for {
		closed := make(chan struct{})
		var once sync.Once
		s, err := stub.New(p, p.stubOptions(id, func() { once.Do(func() { close(closed) }) })...)
		if err != nil {
			return fmt.Errorf("nri plugin: %w", err)
		}
		abandoned, err := startStub(ctx, s)
		if abandoned {
			// Not s.Stop(): it takes the lock the blocked Start holds.
			p.ready(false)
			return nil
		}
		if err == nil {
			backoff = minBackoff
			resync, err := p.serve(ctx, s, closed, launched, id)
			if err != nil || ctx.Err() != nil {
				return err
			}
			if resync {
				continue // at once: the ledger is empty until the next Synchronize
			}
		} else {
			p.ready(false)
			s.Stop()
			if ctx.Err() != nil {
				return nil
			}
			if launched {
				return fmt.Errorf("nri plugin: start: %w", err)
			}
			p.log.Warn("cannot register with the runtime; retrying", "socket", id.Socket,
				"retry_in", backoff.String(), "error", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, maxBackoff)
	}
}

// startStub is s.Start(ctx), abandoned (abandoned = true) once ctx is done.
// The stub's Start honours ctx while it dials and registers, but then waits
// for the runtime's Configure without looking at it: a runtime that accepted
// the registration and never configures (or a daemon told to stop in that
// instant) would keep SIGTERM from ending the process. An abandoned Start
// stays blocked, holding the stub's lock (so the stub must not be stopped);
// the process is about to exit.
func startStub(ctx context.Context, s stub.Stub) (abandoned bool, err error) {
	done := make(chan error, 1)
	go func() { done <- s.Start(ctx) }()
	select {
	case err := <-done:
		return false, err
	case <-ctx.Done():
		select {
		case err := <-done: // both ready: Start's own answer
			return false, err
		default:
			return true, ctx.Err()
		}
	}
}

// serve waits while one connection is up. It returns resync = true when it
// dropped the connection on purpose to get a fresh Synchronize, an error when
// a launched plugin lost its connection for good, and nothing when the
// connection closed (reconnect) or ctx is done.
func (p *Plugin) serve(ctx context.Context, s stub.Stub, closed <-chan struct{}, launched bool, id Identity) (resync bool, err error) {
	for {
		select {
		case <-ctx.Done():
			p.ready(false)
			p.drain(s, closed)
			s.Stop()
			return false, nil
		case <-closed:
			p.ready(false)
			if launched {
				return false, errors.New("nri plugin: the connection to containerd closed; a pre-installed plugin is only relaunched when containerd restarts")
			}
			p.log.Warn("connection to the runtime closed; reconnecting", "socket", id.Socket)
			return false, nil
		case <-p.resync:
			if p.inPlace.Load() {
				// Closing the inherited connection would end this process
				// for good: rebuild from the containers tracked instead.
				p.log.Warn("the GPU ledger must be rebuilt (it needs recovery, was started afresh by another process, the "+
					"Synchronize could not reconcile it, or the GPU discovery it waited for ended); rebuilding it from the containers this plugin tracks "+
					"(containers asking for a GPU are refused meanwhile)", "cause", p.rebuildingCause())
				p.rebuildInPlace(ctx, closed)
				continue
			}
			p.log.Warn("the GPU ledger needs recovery (damaged, missing or replaced), was started afresh by another process, or was not "+
				"reconciled yet (the GPU discovery ended after the Synchronize); reconnecting so that the runtime's "+
				"Synchronize rebuilds it from the running containers", "socket", id.Socket)
			p.setRebuilding(true, nil)
			p.ready(false)
			return p.reconnectWhenQuiet(ctx, s, closed)
		}
	}
}

// resyncQuiet is how long no handler may have run before the plugin drops
// its connection on purpose. A reply leaves within microseconds of its
// handler's return; a connection closed under a request in flight would make
// containerd drop the plugin and (before 2.2) create that container unchecked.
const resyncQuiet = 200 * time.Millisecond

// reconnectWhenQuiet closes the connection once no handler has run for
// resyncQuiet (meanwhile GPU containers are refused fast, see rebuilding).
//
// A request that arrives in the instant between that check and the close
// still meets a closed connection; the quiet period makes this unlikely, not
// impossible, and containerd's required_plugins validator refuses the
// creations that follow until the plugin is back.
func (p *Plugin) reconnectWhenQuiet(ctx context.Context, s stub.Stub, closed <-chan struct{}) (bool, error) {
	if !p.waitQuiet(ctx.Done(), closed) {
		if ctx.Err() != nil {
			p.drain(s, closed)
			s.Stop()
		}
		return false, nil // or the runtime closed it first: reconnect anyway
	}
	s.Stop()
	return true, nil
}

// drain lets the handlers in flight answer before a shutdown closes the
// connection (SIGTERM often comes while containerd is busy: a node drain).
// It waits at most one request timeout plus the quiet period: no handler
// runs longer than its request's deadline.
func (p *Plugin) drain(s stub.Stub, closed <-chan struct{}) {
	limit := s.RequestTimeout()
	if limit <= 0 {
		limit = api.DefaultPluginRequestTimeout
	}
	timeout := make(chan struct{})
	t := time.AfterFunc(limit+resyncQuiet, func() { close(timeout) })
	defer t.Stop()
	if !p.waitQuiet(timeout, closed) {
		select {
		case <-closed:
		default:
			p.log.Warn("shutting down with an NRI request still in flight", "waited", (limit + resyncQuiet).String())
		}
	}
}
