// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/nri/pkg/adaptation"
	"github.com/containerd/nri/pkg/api"
	nrilog "github.com/containerd/nri/pkg/log"
	"github.com/gofrs/flock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testtmp"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// TestMain lets the test binary play the plugin: containerd launches a
// pre-installed plugin with an empty environment but for NRI_PLUGIN_NAME,
// NRI_PLUGIN_IDX and NRI_PLUGIN_SOCKET (the connection on fd 3), and no
// arguments.
func TestMain(m *testing.M) {
	if os.Getenv(api.PluginSocketEnvVar) != "" {
		os.Exit(run(nil, os.Stdin, os.Stdout, os.Stderr))
	}
	// The signal tests run the binary as nri-gpu-guard with its arguments.
	if os.Getenv(runMainEnv) == "1" {
		os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
	}
	nrilog.Set(quietLog{}) // the NRI runtime's own log lines
	os.Exit(testtmp.Main(m))
}

type quietLog struct{}

func (quietLog) Debugf(context.Context, string, ...any) {}
func (quietLog) Infof(context.Context, string, ...any)  {}
func (quietLog) Warnf(context.Context, string, ...any)  {}
func (quietLog) Errorf(context.Context, string, ...any) {}

func gpuUUID(i int) string { return fmt.Sprintf("GPU-6c1a2f2e-0000-4000-8000-%012d", i) }

// The binary launched by the NRI runtime as plugins/90-gpu-guard, configured
// only through conf.d: it must take its index from NRI_PLUGIN_IDX (the stub
// refuses a second one), talk over fd 3, and build the guard from the
// configuration Configure carries (here, the ledger dir and the GPUs).
func TestLaunchedByRuntime(t *testing.T) {
	var state string
	create, _ := launchPlugin(t, "", func(dir string) { state = dir })
	require.NoError(t, create("holder-1", "NVIDIA_VISIBLE_DEVICES=1"))
	err := create("second-1", "NVIDIA_VISIBLE_DEVICES="+gpuUUID(1))
	require.Error(t, err, "the launched plugin is not enforcing")
	assert.Contains(t, err.Error(), "is held by ml/a/holder-1")

	l, err := ledger.OpenReadOnly(state, ledger.Options{})
	require.NoError(t, err)
	st, err := l.Snapshot(context.Background())
	require.NoError(t, err)
	require.Len(t, st.Claims, 1, "the claim is in the ledger dir named by conf.d")
	assert.Equal(t, "holder-1", st.Claims[0].Owner.ContainerID)
}

// launchPlugin starts an NRI runtime (containerd's side, no external
// connections) that launches the test binary as the pre-installed plugin
// 90-gpu-guard, configured by conf.d with a ledger dir, two static GPUs and
// extraConf. before, when set, runs with the ledger dir before the runtime
// starts (and so before the plugin's Synchronize). It returns a function
// creating a container of one pod with one env entry, and the plugin's log
// lines (closed once the plugin exited).
func launchPlugin(t *testing.T, extraConf string, before func(state string)) (create func(id, env string) error, lines <-chan string) {
	t.Helper()
	self, err := os.Executable()
	require.NoError(t, err)
	dir, err := os.MkdirTemp("", "gg-launch-") // unix socket paths are short
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	plugins, confd, state := filepath.Join(dir, "plugins"), filepath.Join(dir, "conf.d"), filepath.Join(dir, "state")
	require.NoError(t, os.MkdirAll(plugins, 0o755))
	require.NoError(t, os.MkdirAll(confd, 0o755))
	// containerd gives a launched plugin no stderr of its own: the plugin's
	// log goes to a fifo the test reads line by line.
	fifo := filepath.Join(dir, "plugin.log")
	require.NoError(t, syscall.Mkfifo(fifo, 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(plugins, "90-gpu-guard"),
		[]byte("#!/bin/sh\nexec '"+self+"' 2>'"+fifo+"'\n"), 0o755))
	out := make(chan string, 4096)
	go func() {
		// Closed once the plugin exited (or the test could not read).
		defer close(out)
		f, err := os.Open(fifo) // blocks until the plugin opens its end
		if err != nil {
			return
		}
		defer func() { _ = f.Close() }()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			select {
			case out <- sc.Text():
			default: // nobody reads: drop
			}
		}
	}()
	conf := fmt.Sprintf("[ledger]\ndir = %q\n[devices]\nsource = \"static\"\nproc_root = %q\n", state, t.TempDir())
	for i := 0; i < 2; i++ {
		conf += fmt.Sprintf("[[devices.static]]\nindex = %d\nuuid = %q\nminor = %d\n", i, gpuUUID(i), i)
	}
	require.NoError(t, os.WriteFile(filepath.Join(confd, "90-gpu-guard.conf"), []byte(conf+extraConf), 0o600))
	if before != nil {
		before(state)
	}
	r, err := adaptation.New("containerd", "v2.2.1",
		func(ctx context.Context, cb adaptation.SyncCB) error { _, err := cb(ctx, nil, nil); return err },
		func(context.Context, []*api.ContainerUpdate) ([]*api.ContainerUpdate, error) { return nil, nil },
		adaptation.WithPluginPath(plugins), adaptation.WithPluginConfigPath(confd),
		adaptation.WithSocketPath(filepath.Join(dir, "nri.sock")), adaptation.WithDisabledExternalConnections())
	require.NoError(t, err)
	require.NoError(t, r.Start()) // launches, registers and synchronizes the plugin
	t.Cleanup(r.Stop)
	pod := &api.PodSandbox{Id: "sb-a", Name: "a", Uid: "uid-a", Namespace: "ml"}
	return func(id, env string) error {
		_, err := r.CreateContainer(context.Background(), &api.CreateContainerRequest{Pod: pod,
			Container: &api.Container{Id: id, PodSandboxId: pod.Id, Name: id, Env: []string{env}}})
		return err
	}, out
}

// waitLogLine waits for a line of lines containing want.
func waitLogLine(t *testing.T, lines <-chan string, want string) {
	t.Helper()
	deadline := time.After(condWait)
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("the plugin exited before logging %q", want)
			}
			if strings.Contains(l, want) {
				return
			}
		case <-deadline:
			t.Fatalf("no plugin log line with %q within %s", want, condWait)
		}
	}
}

// The ledger lock is held (a gpu-guard-ctl command, a hook) while
// containerd starts, longer than the plugin's Synchronize may wait for it.
// containerd stops a pre-installed plugin whose Synchronize fails and never
// relaunches it: the plugin must answer, refuse GPU containers until it has
// rebuilt the ledger, and enforce once the lock is free.
func TestLaunchedPluginSurvivesLedgerLockedAtSync(t *testing.T) {
	var lk *flock.Flock
	create, lines := launchPlugin(t, "", func(state string) {
		require.NoError(t, os.MkdirAll(state, 0o700))
		lk = flock.New(filepath.Join(state, "ledger.lock"))
		locked, err := lk.TryLock()
		require.NoError(t, err)
		require.True(t, locked)
	})
	err := create("early-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.Error(t, err, "a GPU container was created unchecked: containerd dropped the plugin")
	assert.Contains(t, err.Error(), "being rebuilt")
	require.NoError(t, create("web-1", "PATH=/usr/bin"), "a container without a GPU is let through meanwhile")

	require.NoError(t, lk.Unlock())
	waitLogLine(t, lines, "GPU ledger rebuilt: containers asking for a GPU are decided again")
	require.NoError(t, create("holder-1", "NVIDIA_VISIBLE_DEVICES=1"))
	err = create("second-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.Error(t, err, "the plugin enforces once the ledger is rebuilt")
	assert.Contains(t, err.Error(), "is held by ml/a/holder-1")
}

// A launched plugin whose [metrics] listen cannot be served (the port is
// taken) keeps enforcing: it used to exit, and containerd never relaunches
// it.
func TestLaunchedPluginKeepsEnforcingWithoutMetrics(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = taken.Close() }()
	create, lines := launchPlugin(t, fmt.Sprintf("[metrics]\nlisten = %q\n", taken.Addr().String()), nil)
	waitLogLine(t, lines, "metrics endpoint failed")
	require.NoError(t, create("holder-1", "NVIDIA_VISIBLE_DEVICES=1"))
	err = create("second-1", "NVIDIA_VISIBLE_DEVICES=1")
	require.Error(t, err, "a second container was admitted on GPU 1: the plugin is gone")
	assert.Contains(t, err.Error(), "is held by ml/a/holder-1")
}
