// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build integration

package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
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
	// containerd 2.2–2.4 (NRI v0.11–v0.12.3) drops a closed plugin only at
	// the end of the next NRI request. A CreateContainer that is that
	// request still lists the dead plugin for the default validator, but
	// asks it to validate too, which fails ("ttrpc: closed"), and the
	// create is refused by that (TestCreateAfterGuardDiedIsRefused). What
	// this test checks is the default validator's refusal once the plugin
	// is gone, so another NRI event removes it first: a pod sandbox start.
	p = c.RunPod(t, PodSpec{Name: "failclosed-after-crash"})
	assertRefusedForAbsentGuard("after the guard crashed")

	g.Start(t)
	plainID := p.Run(t, plainSpec)
	assert.Equal(t, "CONTAINER_RUNNING", c.ContainerState(t, plainID))
	// And the guard checks again: GPU 0 is still held.
	msg := p.Refused(t, gpuSpec)
	assert.Contains(t, msg, gpuName(c.GPUs[0])+" is held by "+first.Owner("gpu"))
}

// TestCreateAfterGuardDiedIsRefused: the guard is killed, and the next NRI
// request is a container creation. containerd (2.2–2.4, NRI v0.11–v0.12.3)
// still lists the dead plugin then (it drops closed plugins at the end of a
// request), and asks it to validate the container: the call fails with
// "ttrpc: closed" and the create is refused, with no drop-in. Only the
// creates after that request depend on the drop-in (TestGuardAbsentFailsClosed).
// Release lines before 2.2 do not validate: there this request is created
// unchecked, and the test reports the capability as not supported.
func TestCreateAfterGuardDiedIsRefused(t *testing.T) {
	RequireCapability(t, CapAdjustmentValidation)
	if closedPluginsSkipped(t) {
		t.Skip("this NRI skips a closed plugin: a create after the guard died is refused by the drop-in's default validator alone (TestGuardAbsentFailsClosed)")
	}
	env := NewGuardEnv(t, GuardOptions{})
	c, g := env.C, env.G
	// The pod first: its start is an NRI request, which would drop the
	// dead plugin.
	p := c.RunPod(t, PodSpec{Name: "guard-died"})
	from := c.logOffset()
	g.Kill(t)
	c.waitLog(t, from, fmt.Sprintf("connection to plugin %q closed", guardPluginIndex+"-"+guardPluginName), waitTimeout)

	msg := p.Refused(t, ContainerSpec{Name: "gpu", Env: GPUEnv("0")})
	t.Logf("refusal seen by crictl: %s", msg)
	assert.Contains(t, msg, "validator plugin "+guardPluginIndex+"-"+guardPluginName+" failed")
	assert.Contains(t, msg, "ttrpc: closed")
}

// TestCreateOverrunningRequestTimeoutIsRefused: the guard is stopped
// (SIGSTOP) and cannot answer a CreateContainer within containerd's
// plugin_request_timeout. containerd (2.2–2.4) closes the plugin, goes on
// without its answer, then asks it to validate the container: that fails
// ("ttrpc: closed"), and the create is refused. A later NRI (v0.12.4 on)
// honours the guard's failure policy instead: the create fails and the
// plugin stays registered. Before 2.2 the container is created unchecked.
func TestCreateOverrunningRequestTimeoutIsRefused(t *testing.T) {
	RequireCapability(t, CapAdjustmentValidation)
	env := NewGuardEnv(t, GuardOptions{})
	c, g := env.C, env.G
	p := c.RunPod(t, PodSpec{Name: "guard-stalled"})
	pid := g.Pid()
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			assert.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
		}
	}
	t.Cleanup(resume)

	msg := p.Refused(t, ContainerSpec{Name: "gpu", Env: GPUEnv("0")})
	resume()
	t.Logf("refusal seen by crictl: %s", msg)
	if closedPluginsSkipped(t) {
		assert.Contains(t, msg, "failed to handle CreateContainer request")
		return
	}
	assert.Contains(t, msg, "validator plugin "+guardPluginIndex+"-"+guardPluginName+" failed")
	assert.Contains(t, msg, "ttrpc: closed")
}

// closedPluginsSkipped reports whether the NRI the runtime under test is
// built with is later than v0.12.3: such an NRI skips a closed plugin, in
// CreateContainer and in validation alike, and honours the guard's failure
// policy (a request it fails or overruns fails the create). Every released
// line the matrix runs has v0.12.3 or earlier.
func closedPluginsSkipped(t testing.TB) bool {
	t.Helper()
	v, err := runtimeNRIVersion(filepath.Join(ContainerdDir, "containerd"))
	require.NoError(t, err)
	var major, minor, patch int
	_, err = fmt.Sscanf(strings.TrimPrefix(v, "v"), "%d.%d.%d", &major, &minor, &patch)
	require.NoError(t, err, "the runtime's NRI version %q", v)
	return major > 0 || minor > 12 || minor == 12 && patch > 3
}
