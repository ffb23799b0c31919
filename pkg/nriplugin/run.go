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

// withDefaults fills what neither a flag nor containerd's environment set
// from the [nri] configuration.
func (id Identity) withDefaults(cfg config.NRIConfig) Identity {
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
	maxBackoff = 30 * time.Second
)

// Run connects the plugin to the runtime and serves it until ctx is done.
//
// Launched by containerd, it serves the inherited connection and returns when
// that closes (containerd never relaunches a plugin; the error says so).
// External, it dials id.Socket and reconnects with exponential backoff
// whenever the connection closes or cannot be made; every reconnect brings a
// full Synchronize. It returns nil once ctx is done (SIGTERM/SIGINT).
func (p *Plugin) Run(ctx context.Context, id Identity) error {
	launched := Launched()
	backoff := minBackoff
	for {
		closed := make(chan struct{})
		var once sync.Once
		s, err := stub.New(p, p.stubOptions(id, func() { once.Do(func() { close(closed) }) })...)
		if err != nil {
			return fmt.Errorf("nri plugin: %w", err)
		}
		err = s.Start(ctx)
		if err == nil {
			backoff = minBackoff
			select {
			case <-ctx.Done():
				p.ready(false)
				s.Stop()
				return nil
			case <-closed:
				p.ready(false)
				if launched {
					return errors.New("nri plugin: the connection to containerd closed; a pre-installed plugin is only relaunched when containerd restarts")
				}
				p.log.Warn("connection to the runtime closed; reconnecting", "socket", id.Socket)
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
