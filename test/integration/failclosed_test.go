// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build integration

package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/BurntSushi/toml"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// dropInPath is the containerd drop-in the packages ship: it enables NRI's
// default validator with required_plugins = ["gpu-guard"].
const dropInPath = "packaging/containerd/nri-gpu-guard.toml"

// TestGuardAbsentFailsClosed: with the shipped drop-in imported into
// containerd's config, containers are refused while the guard is not
// registered (before it first starts and after it crashed), GPU or not, and
// admitted again once it is back. Release lines before 2.2 have no default
// validator: there the test reports the capability as not supported.
func TestGuardAbsentFailsClosed(t *testing.T) {
	RequireCapability(t, CapDefaultValidator)
	dropIn := filepath.Join(RepoRoot, dropInPath)
	_, err := os.Stat(dropIn)
	require.NoError(t, err, "the packaging's containerd drop-in")
	c := StartContainerd(t, ContainerdOptions{Imports: []string{dropIn}})

	// The import must not have replaced the harness's NRI paths (containerd
	// merges imported plugin tables key by key).
	dump, err := runTool(c.env(), filepath.Join(ContainerdDir, "containerd"), "--config", c.ConfigPath, "config", "dump")
	require.NoError(t, err)
	var effective struct {
		Plugins struct {
			NRI struct {
				Disable          bool   `toml:"disable"`
				SocketPath       string `toml:"socket_path"`
				DefaultValidator struct {
					Enable          bool     `toml:"enable"`
					RequiredPlugins []string `toml:"required_plugins"`
				} `toml:"default_validator"`
			} `toml:"io.containerd.nri.v1.nri"`
		} `toml:"plugins"`
	}
	_, err = toml.Decode(dump, &effective)
	require.NoError(t, err, "containerd config dump")
	nri := effective.Plugins.NRI
	assert.False(t, nri.Disable)
	assert.Equal(t, c.NRISocket, nri.SocketPath)
	assert.True(t, nri.DefaultValidator.Enable)
	assert.Equal(t, []string{guardPluginName}, nri.DefaultValidator.RequiredPlugins)

	p := c.RunPod(t, PodSpec{Name: "failclosed"})
	gpuSpec := ContainerSpec{Name: "gpu", Env: GPUEnv("0")}
	plainSpec := ContainerSpec{Name: "plain"}
	assertRefusedForAbsentGuard := func(when string) {
		t.Helper()
		for _, spec := range []ContainerSpec{gpuSpec, plainSpec} {
			msg := p.Refused(t, spec)
			assert.Contains(t, msg, guardPluginName, "%s: container %s: the refusal names the missing plugin", when, spec.Name)
		}
	}
	assertRefusedForAbsentGuard("before the guard started")

	g := StartGuard(t, c, GuardOptions{})
	first := p
	gpuID := p.Run(t, gpuSpec)
	assert.Equal(t, gpuID, g.Holder(t, 0))

	from := c.logOffset()
	g.Kill(t)
	c.waitLog(t, from, fmt.Sprintf("connection to plugin %q closed", guardPluginIndex+"-"+guardPluginName), waitTimeout)
	// containerd 2.2 (NRI v0.11) drops a closed plugin only at the end of
	// the next NRI request; a CreateContainer that is that request still
	// counts the dead plugin as present for the validator and is admitted
	// unchecked (fixed in NRI v0.12, which skips closed plugins). Any other
	// NRI event closes the window: here a pod sandbox start.
	p = c.RunPod(t, PodSpec{Name: "failclosed-after-crash"})
	assertRefusedForAbsentGuard("after the guard crashed")

	g.Start(t)
	plainID := p.Run(t, plainSpec)
	assert.Equal(t, "CONTAINER_RUNNING", c.ContainerState(t, plainID))
	// And the guard checks again: GPU 0 is still held.
	msg := p.Refused(t, gpuSpec)
	assert.Contains(t, msg, gpuName(c.GPUs[0])+" is held by "+first.Owner("gpu"))
}
