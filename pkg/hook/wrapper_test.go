// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"
)

// docWrapper is the runc wrapper docs/hook.md gives for Docker and
// containerd without NRI, written to an executable file.
func docWrapper(t *testing.T) string {
	t.Helper()
	root, err := moduleRoot()
	require.NoError(t, err)
	doc, err := os.ReadFile(filepath.Join(root, "docs", "hook.md"))
	require.NoError(t, err)
	const start = "`/usr/local/bin/runc-gpu-guard` (mode 0755):\n\n```sh\n"
	i := strings.Index(string(doc), start)
	require.GreaterOrEqual(t, i, 0, "docs/hook.md shows the wrapper")
	body := string(doc)[i+len(start):]
	body = body[:strings.Index(body, "\n```")+1]
	path := filepath.Join(t.TempDir(), "runc-gpu-guard")
	require.NoError(t, os.WriteFile(path, []byte(body), 0o755))
	return path
}

// The runc wrapper of docs/hook.md adds the guard's hooks to the bundle of
// every runc subcommand that runs createRuntime hooks: create, run, and
// restore (a container restored from a checkpoint; containerd writes its
// bundle afresh), and leaves the others alone.
func TestDocWrapperAddsTheHooks(t *testing.T) {
	// CI installs both (.ci/run): there a missing one is a broken setup
	// that would silently leave the documented wrapper untested.
	ci, _ := strconv.ParseBool(os.Getenv("CI"))
	for _, tool := range []string{"sh", "jq"} {
		if _, err := exec.LookPath(tool); err != nil {
			if ci {
				t.Fatalf("the wrapper needs %s, which CI installs: %v", tool, err)
			}
			t.Skipf("the wrapper needs %s: %v", tool, err)
		}
	}
	wrapper := docWrapper(t)
	for _, tc := range []struct {
		name  string
		args  func(bundle string) []string
		hooks bool
	}{
		{"create", func(b string) []string { return []string{"--root", "/run/r", "create", "--bundle", b, "c1"} }, true},
		{"run", func(b string) []string { return []string{"run", "-b", b, "--detach", "c1"} }, true},
		{"restore", func(b string) []string {
			return []string{"--root", "/run/r", "restore", "--image-path", "/ckpt", "--work-path", "/work", "--bundle", b, "c1"}
		}, true},
		{"restore, -b=", func(b string) []string { return []string{"restore", "-b=" + b, "--detach", "c1"} }, true},
		{"start", func(b string) []string { return []string{"start", "c1"} }, false},
		{"delete", func(b string) []string { return []string{"--root", "/run/r", "delete", "--force", "c1"} }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			bundle := filepath.Join(dir, "bundle")
			require.NoError(t, os.Mkdir(bundle, 0o755))
			data, err := json.Marshal(specs.Spec{Version: specs.Version, Process: &specs.Process{Env: []string{"NVIDIA_VISIBLE_DEVICES=1"}}})
			require.NoError(t, err)
			cfgPath := filepath.Join(bundle, "config.json")
			require.NoError(t, os.WriteFile(cfgPath, data, 0o600))
			// The runc the wrapper runs records its arguments.
			fake := filepath.Join(dir, "runc")
			require.NoError(t, os.WriteFile(fake, []byte("#!/bin/sh\necho \"$@\" >"+filepath.Join(dir, "args")+"\n"), 0o755))

			cmd := exec.Command(wrapper, tc.args(bundle)...)
			cmd.Dir = dir
			cmd.Env = append(os.Environ(), "RUNC_GPU_GUARD_RUNC="+fake, "RUNC_GPU_GUARD_BIN=/usr/bin/nri-gpu-guard-hook")
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "%s", out)
			args, err := os.ReadFile(filepath.Join(dir, "args"))
			require.NoError(t, err)
			require.Equal(t, strings.Join(tc.args(bundle), " ")+"\n", string(args), "runc gets the arguments unchanged")

			data, err = os.ReadFile(cfgPath)
			require.NoError(t, err)
			var spec specs.Spec
			require.NoError(t, json.Unmarshal(data, &spec))
			if !tc.hooks {
				require.Nil(t, spec.Hooks, "config.json left alone")
				return
			}
			require.NotNil(t, spec.Hooks, "the hooks were added")
			require.Equal(t, []specs.Hook{{Path: "/usr/bin/nri-gpu-guard-hook", Args: []string{"nri-gpu-guard-hook", PhaseCreateRuntime}, Env: RuntimeEnv()}},
				spec.Hooks.CreateRuntime)
			require.Equal(t, []specs.Hook{{Path: "/usr/bin/nri-gpu-guard-hook", Args: []string{"nri-gpu-guard-hook", PhasePoststop}, Env: RuntimeEnv()}},
				spec.Hooks.Poststop)
		})
	}
}
