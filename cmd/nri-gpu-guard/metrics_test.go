// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/nri/pkg/adaptation"
	"github.com/containerd/nri/pkg/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/nriplugin"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// lineWriter hands each write (one JSON log line) to a channel; lines nobody
// reads are dropped.
type lineWriter chan string

func (w lineWriter) Write(p []byte) (int, error) {
	select {
	case w <- string(p):
	default:
	}
	return len(p), nil
}

// A metrics endpoint that cannot listen (its port is taken) must not stop
// the guard: the external daemon used to exit (and crash-loop under its
// supervisor), a launched one was never relaunched, and GPU containers went
// unchecked meanwhile. It logs the error, keeps enforcing, and serves the
// endpoint once the port is free.
func TestMetricsEndpointFailureKeepsEnforcing(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = taken.Close() }()
	addr := taken.Addr().String()

	dir, err := os.MkdirTemp("", "gg-met-") // unix socket paths are short
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	socket := filepath.Join(dir, "nri.sock")
	synced := make(chan struct{}, 4)
	r, err := adaptation.New("containerd", "v2.2.1",
		func(ctx context.Context, cb adaptation.SyncCB) error {
			_, err := cb(ctx, nil, nil)
			if err == nil {
				synced <- struct{}{}
			}
			return err
		},
		func(context.Context, []*api.ContainerUpdate) ([]*api.ContainerUpdate, error) { return nil, nil },
		adaptation.WithPluginPath(filepath.Join(dir, "plugins")), adaptation.WithPluginConfigPath(filepath.Join(dir, "conf.d")),
		adaptation.WithSocketPath(socket))
	require.NoError(t, err)
	require.NoError(t, r.Start())
	t.Cleanup(r.Stop)
	<-synced // Start's own sync, of the pre-installed plugins (none)

	cfg := config.Default()
	cfg.Ledger.Dir = filepath.Join(dir, "state")
	cfg.Devices.Source = config.SourceStatic
	cfg.Devices.ProcRoot = dir // fake GPUs: no driver tree to check the list against
	cfg.Devices.Static = []config.StaticGPU{{Index: 0, UUID: gpuUUID(0), Minor: 0}}
	cfg.Metrics.Listen = addr
	require.NoError(t, cfg.Validate())
	lines := make(lineWriter, 4096)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		done <- runDaemon(ctx, daemonOptions{Config: cfg, Logger: slog.New(slog.NewJSONHandler(lines, nil)),
			Identity:     nriplugin.Identity{Name: "gpu-guard", Index: "90", Socket: socket},
			OpenNVML:     func() (observe.Source, error) { return nil, errors.New("no NVML in this test") },
			MetricsRetry: 50 * time.Millisecond})
	}()
	waitFor := func(what string, ok func(line string) bool) {
		t.Helper()
		deadline := time.After(condWait)
		for {
			select {
			case l := <-lines:
				if ok(l) {
					return
				}
			case err := <-done:
				t.Fatalf("the daemon exited (%v) while waiting for %s", err, what)
			case <-deadline:
				t.Fatalf("%s: not within %s", what, condWait)
			}
		}
	}
	waitFor("the failed endpoint logged", func(l string) bool {
		return strings.Contains(l, "metrics endpoint failed") && strings.Contains(l, "retrying")
	})
	select {
	case <-synced:
	case err := <-done:
		t.Fatalf("the daemon exited: %v", err)
	case <-time.After(condWait):
		t.Fatalf("the plugin did not synchronize within %s", condWait)
	}
	r.BlockPluginSync().Unblock() // registered
	pod := &api.PodSandbox{Id: "sb-a", Name: "a", Uid: "uid-a", Namespace: "ml"}
	create := func(id string) error {
		_, err := r.CreateContainer(context.Background(), &api.CreateContainerRequest{Pod: pod,
			Container: &api.Container{Id: id, PodSandboxId: pod.Id, Name: id, Env: []string{"NVIDIA_VISIBLE_DEVICES=0"}}})
		return err
	}
	require.NoError(t, create("holder-1"))
	require.ErrorContains(t, create("second-1"), "is held by ml/a/holder-1", "the guard enforces without its endpoint")

	require.NoError(t, taken.Close())
	waitFor("the endpoint served once the port is free", func(l string) bool {
		return strings.Contains(l, "metrics endpoint listening")
	})
	resp, err := http.Get("http://" + addr + "/readyz")
	require.NoError(t, err)
	_ = resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode, "registered with the runtime")

	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(condWait):
		t.Fatalf("the daemon did not end within %s of its context", condWait)
	}
}
