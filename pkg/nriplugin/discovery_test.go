// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/containerd/nri/pkg/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/daemon"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// gatedNVML is an NVML enumeration that lasts until the test releases it,
// as nvmlInit does for seconds on a multi-GPU host without persistence mode.
type gatedNVML struct {
	release chan struct{}
	loads   atomic.Int32
}

func (*gatedNVML) Name() string { return "nvml" }

func (n *gatedNVML) Load() ([]devices.GPU, error) {
	n.loads.Add(1)
	<-n.release
	var out []devices.GPU
	for i := 0; i < 4; i++ {
		out = append(out, devices.GPU{Index: i, UUID: gpuUUID(i), Minor: i, Model: "Fake GPU"})
	}
	return out, nil
}

// runningUnchecked lists, at the plugin's Synchronize, a container of pod
// that runs on GPU visible, created while the plugin was away (the ledger
// knows nothing of it), its cgroup holding its process.
func (rt *runtime) runningUnchecked(pod *api.PodSandbox, name, id, visible string, pid uint32) *api.Container {
	rt.t.Helper()
	c := container(pod, name, id, "NVIDIA_VISIBLE_DEVICES="+visible)
	c.State, c.Pid = api.ContainerState_CONTAINER_RUNNING, pid
	cg := filepath.Join(rt.cgroupRoot, c.Linux.CgroupsPath)
	require.NoError(rt.t, os.MkdirAll(cg, 0o755))
	require.NoError(rt.t, os.WriteFile(filepath.Join(cg, "cgroup.procs"), fmt.Appendf(nil, "%d\n", pid), 0o644))
	rt.listedAtSync(c)
	return c
}

// A plugin builds its guard in Configure, which containerd awaits for its
// request timeout only (2s by default): a plugin that answers late is
// dropped (a launched one for good), and containers are then created
// unchecked, or all refused by the validator. The GPU enumeration is not
// waited for past the deadline: Configure answers while it still runs (the
// enumeration here ends only when the test says so), the Synchronize that
// follows is answered too, GPU containers are refused meanwhile, saying the
// discovery is in progress, and the others are let through. Once the
// enumeration ends, the ledger is reconciled with the runtime's containers:
// the container that ran on GPU 1 unchecked is adopted (it would otherwise
// read as free), and GPU requests are decided again.
func TestConfigureAnswersWhileDiscoveryRuns(t *testing.T) {
	for _, launched := range []bool{true, false} {
		t.Run(map[bool]string{true: "launched", false: "external"}[launched], func(t *testing.T) {
			rt := newRuntime(t, func(c *config.Config) { c.Devices.Source = config.SourceAuto })
			podA, podB := rt.addPod("a"), rt.addPod("b")
			rt.runningUnchecked(podA, "main", "old-1", "1", 3000)
			nvml := &gatedNVML{release: make(chan struct{})}
			released := false
			t.Cleanup(func() {
				if !released {
					close(nvml.release)
				}
			})
			rt.syncs = make(chan error, 16)
			waitReady, _ := runPluginOn(t, rt, &daemon.Builder{NVML: nvml}, func(p *Plugin) { p.forceInPlace = launched })

			require.NoError(t, syncResult(t, rt), "Configure and Synchronize are answered while the enumeration runs")
			rt.registered()
			assert.Empty(t, rt.holders(), "nothing is reconciled over an inventory that knows no GPU")

			err := rt.create(podB, container(podB, "main", "b-1", "NVIDIA_VISIBLE_DEVICES=2"))
			require.Error(t, err, "no GPU container is decided before the GPUs are known")
			assert.Contains(t, err.Error(), "still discovering this host's GPUs")
			assert.Contains(t, err.Error(), "retrying is automatic")
			require.NoError(t, rt.create(podB, container(podB, "web", "web-1")), "a container without a GPU is let through")

			close(nvml.release)
			released = true
			waitReady(true)
			assert.Equal(t, map[string]string{"1": "old-1"}, rt.holders(),
				"the container running on GPU 1 is adopted once the GPUs are known")
			err = rt.create(podB, container(podB, "main", "b-2", "NVIDIA_VISIBLE_DEVICES=1"))
			require.Error(t, err)
			assert.Contains(t, err.Error(), "is held by ml/a/main")
			require.NoError(t, rt.create(podB, container(podB, "main", "b-3", "NVIDIA_VISIBLE_DEVICES=2")))
			assert.Equal(t, int32(1), nvml.loads.Load(), "a reconnect enumerates nothing again")
		})
	}
}
