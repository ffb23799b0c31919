// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/containerd/nri/pkg/adaptation"
	"github.com/containerd/nri/pkg/api"
	nrilog "github.com/containerd/nri/pkg/log"
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
	self, err := os.Executable()
	require.NoError(t, err)
	dir, err := os.MkdirTemp("", "gg-launch-") // unix socket paths are short
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	plugins, confd, state := filepath.Join(dir, "plugins"), filepath.Join(dir, "conf.d"), filepath.Join(dir, "state")
	require.NoError(t, os.MkdirAll(plugins, 0o755))
	require.NoError(t, os.MkdirAll(confd, 0o755))
	require.NoError(t, os.Symlink(self, filepath.Join(plugins, "90-gpu-guard")))
	conf := fmt.Sprintf("[ledger]\ndir = %q\n[devices]\nsource = \"static\"\n", state)
	for i := 0; i < 2; i++ {
		conf += fmt.Sprintf("[[devices.static]]\nindex = %d\nuuid = %q\nminor = %d\n", i, gpuUUID(i), i)
	}
	require.NoError(t, os.WriteFile(filepath.Join(confd, "90-gpu-guard.conf"), []byte(conf), 0o600))

	r, err := adaptation.New("containerd", "v2.2.1",
		func(ctx context.Context, cb adaptation.SyncCB) error { _, err := cb(ctx, nil, nil); return err },
		func(context.Context, []*api.ContainerUpdate) ([]*api.ContainerUpdate, error) { return nil, nil },
		adaptation.WithPluginPath(plugins), adaptation.WithPluginConfigPath(confd),
		adaptation.WithSocketPath(filepath.Join(dir, "nri.sock")), adaptation.WithDisabledExternalConnections())
	require.NoError(t, err)
	require.NoError(t, r.Start()) // launches, registers and synchronizes the plugin
	t.Cleanup(r.Stop)

	pod := &api.PodSandbox{Id: "sb-a", Name: "a", Uid: "uid-a", Namespace: "ml"}
	create := func(id, env string) error {
		_, err := r.CreateContainer(context.Background(), &api.CreateContainerRequest{Pod: pod,
			Container: &api.Container{Id: id, PodSandboxId: pod.Id, Name: id, Env: []string{env}}})
		return err
	}
	require.NoError(t, create("holder-1", "NVIDIA_VISIBLE_DEVICES=1"))
	err = create("second-1", "NVIDIA_VISIBLE_DEVICES="+gpuUUID(1))
	require.Error(t, err, "the launched plugin is not enforcing")
	assert.Contains(t, err.Error(), "is held by ml/a/holder-1")

	l, err := ledger.OpenReadOnly(state, ledger.Options{})
	require.NoError(t, err)
	st, err := l.Snapshot(context.Background())
	require.NoError(t, err)
	require.Len(t, st.Claims, 1, "the claim is in the ledger dir named by conf.d")
	assert.Equal(t, "holder-1", st.Claims[0].Owner.ContainerID)
}
