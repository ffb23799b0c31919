// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// inPrivateHost runs this test binary as nri-gpu-guard with args in a mount
// namespace of its own where /etc, /var/lib and /run are empty tmpfs (the
// host's are untouched, and a run on the built-in defaults writes no ledger
// of the host's), after setup (a shell script) prepared /etc there. It
// returns the exit code, stdout and stderr.
func inPrivateHost(t *testing.T, setup, stdin string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	self, err := os.Executable()
	require.NoError(t, err)
	script := "mount -t tmpfs gg /etc && mount -t tmpfs gg /var/lib && mount -t tmpfs gg /run && " + setup + ` && exec "$@"`
	// The watchdog only keeps a broken build from hanging the suite.
	ctx, cancel := context.WithTimeout(t.Context(), sigtermWatchdog)
	defer cancel()
	cmd := exec.CommandContext(ctx, "unshare", append([]string{"--mount", "--propagation", "private", "sh", "-c", script, "sh", self}, args...)...)
	cmd.Env = append(os.Environ(), runMainEnv+"=1")
	// The default path is what is tested: nothing may name another.
	cmd.Env = append(cmd.Env, "NRI_GPU_GUARD_CONFIG=")
	cmd.Stdin = strings.NewReader(stdin)
	var out, errOut strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err = cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("run %v: %v\n%s", args, err, errOut.String())
	}
	return cmd.ProcessState.ExitCode(), out.String(), errOut.String()
}

// TestDefaultConfigLinkLeadingNowhere: with no --config, a symbolic link at
// /etc/nri-gpu-guard/config.toml (or at /etc/nri-gpu-guard) whose target is
// gone is not "no configuration file": the daemon does not start, the hook
// refuses a GPU container, and gpu-guard-ctl (check-config, and a command
// that reads the ledger) reports the link, instead of all of them running
// on the built-in defaults, whose other ledger directory lets two
// containers hold one GPU.
func TestDefaultConfigLinkLeadingNowhere(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounts a private /etc in a mount namespace: root only")
	}
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skip("needs unshare(1): ", err)
	}
	gpuState := hookState(t, "NVIDIA_VISIBLE_DEVICES=0")
	for _, layout := range []struct{ name, setup, link, target string }{
		{"the file is a link", "mkdir /etc/nri-gpu-guard && ln -s /srv/cm/gpu.toml /etc/nri-gpu-guard/config.toml",
			"/etc/nri-gpu-guard/config.toml", "/srv/cm/gpu.toml"},
		{"the directory is a link", "ln -s /srv/cm/nri-gpu-guard /etc/nri-gpu-guard",
			"/etc/nri-gpu-guard", "/srv/cm/nri-gpu-guard"},
	} {
		wantLink := layout.link + " is a symbolic link to " + layout.target + ", which does not exist"
		t.Run(layout.name, func(t *testing.T) {
			for _, tc := range []struct {
				name  string
				args  []string
				stdin string
			}{
				{"daemon", nil, ""},
				{"hook create-runtime, a GPU container", []string{"hook", "create-runtime"}, gpuState},
				{"ctl status", []string{"ctl", "status"}, ""},
				{"ctl check-config", []string{"ctl", "check-config"}, ""},
			} {
				t.Run(tc.name, func(t *testing.T) {
					code, stdout, stderr := inPrivateHost(t, layout.setup, tc.stdin, tc.args...)
					assert.Equal(t, 1, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
					assert.Contains(t, stdout+stderr, wantLink)
					assert.NotContains(t, stdout+stderr, "built-in defaults apply\n")
				})
			}
			// A container that can reach no GPU is answered before the
			// configuration is read, as for any configuration error.
			code, stdout, stderr := inPrivateHost(t, layout.setup, hookState(t, "PATH=/bin"), "hook", "create-runtime")
			assert.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
			assert.Empty(t, stderr)

			code, stdout, stderr = inPrivateHost(t, layout.setup, "", "ctl", "check-config", "-o", "json")
			require.Equal(t, 1, code, stderr)
			var v struct {
				Path     string   `json:"path"`
				Valid    bool     `json:"valid"`
				Defaults bool     `json:"defaults"`
				Errors   []string `json:"errors"`
			}
			require.NoError(t, json.Unmarshal([]byte(stdout), &v), stdout)
			assert.False(t, v.Valid)
			assert.False(t, v.Defaults)
			assert.Equal(t, "/etc/nri-gpu-guard/config.toml", v.Path)
			require.Len(t, v.Errors, 1)
			assert.Contains(t, v.Errors[0], wantLink)
		})
	}
	// Nothing at all at the default path is still the built-in defaults.
	code, stdout, stderr := inPrivateHost(t, "true", "", "ctl", "check-config")
	require.Equal(t, 0, code, stderr)
	assert.Contains(t, stdout, "no configuration file at /etc/nri-gpu-guard/config.toml: the built-in defaults apply")
}

// hookState writes a bundle whose config.json sets env and returns the OCI
// state of container c1 in it, as a runtime hands it to a hook.
func hookState(t *testing.T, env ...string) string {
	t.Helper()
	bundle := t.TempDir()
	data, err := json.Marshal(specs.Spec{Version: specs.Version, Process: &specs.Process{Env: env, Capabilities: podmanCaps()}})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
	st, err := json.Marshal(specs.State{Version: specs.Version, ID: "c1", Status: specs.StateCreating, Bundle: bundle})
	require.NoError(t, err)
	return string(st)
}

// podmanCaps is podman's default capability set (no CAP_MKNOD): a spec
// without a capabilities object counts as holding every capability, which
// a container the runtime gives no device cgroup (these tests' states name
// no process in one) turns into a claim of every GPU.
func podmanCaps() *specs.LinuxCapabilities {
	caps := []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_NET_BIND_SERVICE",
		"CAP_SETFCAP", "CAP_SETGID", "CAP_SETPCAP", "CAP_SETUID", "CAP_SYS_CHROOT"}
	return &specs.LinuxCapabilities{Bounding: caps, Effective: caps, Permitted: caps}
}
