// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build integration

package integration

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestHarnessRunsContainers checks the harness itself, without the guard: a
// pod and a container run on the shared containerd, each way of reaching a
// fake GPU lands in the container's OCI spec as the /dev/nvidiaN node the
// guard must see (so the guard tests below can only pass through the guard's
// own decisions), and a graceful stop ends the test image with exit code 0.
func TestHarnessRunsContainers(t *testing.T) {
	c := SharedContainerd(t)
	p := c.RunPod(t, PodSpec{Name: "harness"})
	t.Cleanup(func() { p.Remove(t) })

	id := p.Run(t, ContainerSpec{
		Name:        "worker",
		Env:         GPUEnv("GPU-test"),
		Annotations: map[string]string{"cdi.k8s.io/gpu": "nvidia.com/gpu=1"},
		Devices:     []DeviceMapping{{ContainerPath: "/dev/nvidia2", HostPath: c.DevicePath(2), Permissions: "rw"}},
	})
	assert.Equal(t, "CONTAINER_RUNNING", c.ContainerState(t, id))

	out, err := c.Crictl("inspect", id)
	require.NoError(t, err)
	var info struct {
		Info struct {
			Pid         int `json:"pid"`
			RuntimeSpec struct {
				Process struct {
					Env []string `json:"env"`
				} `json:"process"`
				Linux struct {
					Devices []struct {
						Path  string `json:"path"`
						Type  string `json:"type"`
						Major int64  `json:"major"`
						Minor int64  `json:"minor"`
					} `json:"devices"`
				} `json:"linux"`
			} `json:"runtimeSpec"`
		} `json:"info"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &info))
	assert.Positive(t, info.Info.Pid)
	devs := map[string]string{}
	for _, d := range info.Info.RuntimeSpec.Linux.Devices {
		devs[d.Path] = fmt.Sprintf("%s %d:%d", d.Type, d.Major, d.Minor)
	}
	assert.Equal(t, "c 195:1", devs["/dev/nvidia1"], "CDI device nvidia.com/gpu=1 injected from the test's CDI dir")
	assert.Equal(t, "c 195:2", devs["/dev/nvidia2"], "CRI device mapping")
	assert.Contains(t, info.Info.RuntimeSpec.Process.Env, "NVIDIA_VISIBLE_DEVICES=GPU-test")
	assert.Contains(t, info.Info.RuntimeSpec.Process.Env, "GPU_GUARD_TEST_CDI_DEVICE=1", "CDI container edits applied")

	c.StopContainer(t, id)
	out, err = c.Crictl("inspect", "--output", "go-template", "--template", "{{.status.state}} {{.status.exitCode}}", id)
	require.NoError(t, err)
	assert.Equal(t, "CONTAINER_EXITED 0", strings.TrimSpace(out), "the test image exits 0 on SIGTERM")
}
