// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build integration

package integration

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// injectAnnotation names the device node testdata/injector adds.
const injectAnnotation = "test.nri-gpu-guard.io/inject-device"

// startInjector builds and runs testdata/injector, an NRI plugin with index
// 95 (the guard's is 90) that adds the device node a container's annotation
// names, as containerd's device-injector sample does, and waits until
// containerd consults it: it creates probe containers in pod until the
// injector reports one (a plugin's first Synchronize comes before
// containerd adds it to the plugins it asks).
func startInjector(t *testing.T, c *Containerd, pod *Pod) {
	t.Helper()
	startInjectorAt(t, c, pod, "95")
}

// unsetAnnotation names the env variable testdata/injector removes.
const unsetAnnotation = "test.nri-gpu-guard.io/unset-env"

// setAnnotation is NAME=VALUE, the env variable testdata/injector sets.
const setAnnotation = "test.nri-gpu-guard.io/set-env"

// startInjectorAt is startInjector with the injector at index idx.
func startInjectorAt(t *testing.T, c *Containerd, pod *Pod, idx string) {
	t.Helper()
	dir := t.TempDir()
	bin := filepath.Join(dir, "injector")
	build := exec.Command("go", "build", "-tags", "nri_no_wasm", "-o", bin, "./testdata/injector")
	build.Dir = filepath.Join(RepoRoot, "test", "integration")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "building the injector: %s", out)
	logPath := filepath.Join(dir, "injector.log")
	p, err := startProcess("injector", logPath, os.Environ(), bin, "-socket", c.NRISocket, "-idx", idx,
		"-annotation", injectAnnotation, "-unset-annotation", unsetAnnotation,
		"-set-annotation", setAnnotation)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.stop(10 * time.Second) })
	probes := 0
	waitFor(t, time.Minute, "containerd to consult the injector", func() (bool, string) {
		probes++
		name := fmt.Sprintf("probe-%d", probes)
		id, err := pod.Create(ContainerSpec{Name: name})
		if err != nil {
			return false, err.Error()
		}
		_, _ = c.Crictl("rm", "--force", id)
		log, _ := os.ReadFile(logPath)
		return strings.Contains(string(log), "injector: saw "+name), string(log)
	})
}

// TestLaterPluginCannotAddAnUncheckedGPU: an NRI plugin that runs after the
// guard (index 95) adds /dev/nvidia<minor> of GPU 1 to a container that
// asked for no GPU; containerd (2.2 and later) validates the container as
// every plugin leaves it, and the guard refuses it there, naming the GPU and
// the plugin, with nothing left claimed. Before, the container was created
// with the GPU node and no claim. The same node added to a container that
// asked for GPU 1 itself is its own claim, and it runs.
func TestLaterPluginCannotAddAnUncheckedGPU(t *testing.T) {
	RequireCapability(t, CapAdjustmentValidation)
	env := NewGuardEnv(t, GuardOptions{})
	c, g := env.C, env.G
	gpu1 := c.GPUs[1]
	pod := c.RunPod(t, PodSpec{Name: "later-plugin"})
	startInjector(t, c, pod)

	node := fmt.Sprintf("/dev/nvidia%d:195:%d", gpu1.Minor, gpu1.Minor)
	msg := pod.Refused(t, ContainerSpec{Name: worker, Annotations: map[string]string{injectAnnotation: node}})
	t.Logf("refusal seen by crictl: %s", msg)
	assert.Contains(t, msg, gpuName(gpu1))
	assert.Contains(t, msg, "an NRI plugin that runs after nri-gpu-guard (95-injector)")
	assert.Empty(t, g.Claims(t), "containerd's undo released what the create claimed")

	id := pod.Run(t, ContainerSpec{Name: worker, Env: GPUEnv("1"), Annotations: map[string]string{injectAnnotation: node}})
	assert.Equal(t, map[string][]string{id: {gpu1.UUID}}, g.ClaimsByContainer(t))
}

// TestEarlierPluginsEnvRemovalIsValidated: an NRI plugin that runs before
// the guard (index 10) removes NVIDIA_VISIBLE_DEVICES from a container that
// names GPU 1 while another container holds it. NRI shows the guard the
// container without the variable, but containerd creates it as the
// adjustment says, and the adjustment carries no removal: the container
// would reach GPU 1 with no claim. The validation resolves the container as
// created and refuses it, naming the plugin that ran before the guard.
func TestEarlierPluginsEnvRemovalIsValidated(t *testing.T) {
	RequireCapability(t, CapAdjustmentValidation)
	env := NewGuardEnv(t, GuardOptions{})
	c, g := env.C, env.G
	gpu1 := c.GPUs[1]
	pod := c.RunPod(t, PodSpec{Name: "earlier-plugin"})
	startInjectorAt(t, c, pod, "10")

	holder := pod.Run(t, ContainerSpec{Name: "holder", Env: GPUEnv("1")})
	msg := pod.Refused(t, ContainerSpec{Name: worker, Env: GPUEnv("1"),
		Annotations: map[string]string{unsetAnnotation: "NVIDIA_VISIBLE_DEVICES"}})
	t.Logf("refusal seen by crictl: %s", msg)
	assert.Contains(t, msg, gpuName(gpu1))
	assert.Contains(t, msg, "before nri-gpu-guard: 10-injector")
	assert.Equal(t, map[string][]string{holder: {gpu1.UUID}}, g.ClaimsByContainer(t))
}

// TestEarlierPluginsEnvSetOverDuplicatesIsValidated: the container's spec
// holds NVIDIA_VISIBLE_DEVICES=1 twice (containerd appends the CRI env to
// the image's without removing duplicates, as with a CUDA image's =all and
// the device plugin's id), GPU 1 is held by another container, and an NRI
// plugin that runs before the guard (index 10) sets the variable to void.
// NRI shows the guard the container with void alone; containerd applies the
// adjustment to the first copy, which the second then overwrites: the
// container is created with NVIDIA_VISIBLE_DEVICES=1. Before, it was
// admitted with no claim; the validation resolves it as created and
// refuses it, naming the plugin.
func TestEarlierPluginsEnvSetOverDuplicatesIsValidated(t *testing.T) {
	RequireCapability(t, CapAdjustmentValidation)
	env := NewGuardEnv(t, GuardOptions{})
	c, g := env.C, env.G
	gpu1 := c.GPUs[1]
	pod := c.RunPod(t, PodSpec{Name: "earlier-plugin-dup"})
	startInjectorAt(t, c, pod, "10")

	holder := pod.Run(t, ContainerSpec{Name: "holder", Env: GPUEnv("1")})
	msg := pod.Refused(t, ContainerSpec{Name: worker, Env: append(GPUEnv("1"), GPUEnv("1")...),
		Annotations: map[string]string{setAnnotation: "NVIDIA_VISIBLE_DEVICES=void"}})
	t.Logf("refusal seen by crictl: %s", msg)
	assert.Contains(t, msg, gpuName(gpu1))
	assert.Contains(t, msg, `env NVIDIA_VISIBLE_DEVICES="1"`)
	assert.Contains(t, msg, "before nri-gpu-guard: 10-injector")
	assert.Equal(t, map[string][]string{holder: {gpu1.UUID}}, g.ClaimsByContainer(t))

	// With one copy the plugin's value is what containerd creates: void
	// reaches no GPU, and the container runs.
	id := pod.Run(t, ContainerSpec{Name: "single", Env: GPUEnv("1"),
		Annotations: map[string]string{setAnnotation: "NVIDIA_VISIBLE_DEVICES=void"}})
	assert.Equal(t, map[string][]string{holder: {gpu1.UUID}}, g.ClaimsByContainer(t), "container %s holds nothing", id)
}
