// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// ociHookFile is the hooks.d schema version 1.0.0 read by podman and CRI-O
// (containers/common pkg/hooks): unknown fields are a mistake there too.
type ociHookFile struct {
	Version string     `json:"version"`
	Hook    specs.Hook `json:"hook"`
	When    struct {
		Always        *bool             `json:"always,omitempty"`
		Annotations   map[string]string `json:"annotations,omitempty"`
		Commands      []string          `json:"commands,omitempty"`
		HasBindMounts *bool             `json:"hasBindMounts,omitempty"`
	} `json:"when"`
	Stages []string `json:"stages"`
}

// readOCIHookFile decodes the hooks.d file at path, refusing unknown fields.
func readOCIHookFile(t *testing.T, path string) ociHookFile {
	t.Helper()
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var h ociHookFile
	require.NoError(t, dec.Decode(&h))
	return h
}

// TestShippedOCIHooks checks packaging/oci-hooks.d: one file per stage, each
// running the installed binary with the phase Run accepts for that stage, for
// every container (environment variables cannot be matched by `when`, and
// NVIDIA_VISIBLE_DEVICES is the most common way to reach a GPU), and with a
// runtime timeout that lets the hook give up by itself first.
func TestShippedOCIHooks(t *testing.T) {
	root, err := moduleRoot()
	require.NoError(t, err)
	files, err := filepath.Glob(filepath.Join(root, "packaging", "oci-hooks.d", "*.json"))
	require.NoError(t, err)
	nfpm, err := os.ReadFile(filepath.Join(root, "packaging", "nfpm.yaml"))
	require.NoError(t, err)

	phaseOf := map[string]string{"createRuntime": PhaseCreateRuntime, "poststop": PhasePoststop}
	seen := map[string]string{}
	for _, path := range files {
		t.Run(filepath.Base(path), func(t *testing.T) {
			h := readOCIHookFile(t, path)

			require.Equal(t, "1.0.0", h.Version)
			require.Len(t, h.Stages, 1, "one stage per file: each stage runs another phase")
			stage := h.Stages[0]
			phase, ok := phaseOf[stage]
			require.True(t, ok, "stage %q", stage)
			seen[stage] = filepath.Base(path)

			require.True(t, filepath.IsAbs(h.Hook.Path))
			require.Contains(t, string(nfpm), "dst: "+h.Hook.Path, "the hook runs the binary the package installs")
			require.Equal(t, []string{filepath.Base(h.Hook.Path), phase}, h.Hook.Args)
			require.Equal(t, "/usr/bin/nri-gpu-guard-hook-relay", h.Hook.Path,
				"the static C relay, which hands the run to the hook server or runs nri-gpu-guard-hook itself")
			// Exactly RuntimeEnv: nothing else is read from the environment
			// (the configuration comes from the default path or --config).
			require.Equal(t, RuntimeEnv(), h.Hook.Env, "the hook's environment")

			require.NotNil(t, h.When.Always)
			require.True(t, *h.When.Always, "the hook must see every container")

			require.NotNil(t, h.Hook.Timeout, "a hook without timeout can hang the runtime forever")
			timeout := time.Duration(*h.Hook.Timeout) * time.Second
			if stage == "createRuntime" {
				// The shipped hook does not wait (no --wait: podman and
				// CRI-O hold the container's lock while it runs). Its
				// worst case is a congested ledger: the admission and a
				// withdrawal, each retried for withdrawTimeout.
				require.NotContains(t, h.Hook.Args, "--wait")
				require.GreaterOrEqual(t, timeout, 2*withdrawTimeout(config.Default()),
					"the runtime must not kill the hook while it retries a congested ledger")
				require.Less(t, timeout, 240*time.Second, "below podman's fixed 240s create timeout")
			}
		})
	}
	stages := make([]string, 0, len(seen))
	for s := range seen {
		stages = append(stages, s)
	}
	slices.Sort(stages)
	require.Equal(t, []string{"createRuntime", "poststop"}, stages, "files: %s", strings.Join(files, ", "))
}

// TestShippedOneHookMask checks the poststop definition for hosts that run
// the createRuntime hook alone (packaging/oci-hooks.d/one-hook, docs/hook.md):
// named as the packaged poststop file, so that a copy in
// /etc/containers/oci/hooks.d masks it; the same hook, so that a container
// that opts in gets the usual poststop; and run only for a container
// annotated io.nri-gpu-guard.poststop=on, never for every container.
func TestShippedOneHookMask(t *testing.T) {
	root, err := moduleRoot()
	require.NoError(t, err)
	const name = "nri-gpu-guard-poststop.json"
	packaged := readOCIHookFile(t, filepath.Join(root, "packaging", "oci-hooks.d", name))
	mask := readOCIHookFile(t, filepath.Join(root, "packaging", "oci-hooks.d", "one-hook", name))
	require.Equal(t, packaged.Version, mask.Version)
	require.Equal(t, packaged.Stages, mask.Stages)
	require.Equal(t, packaged.Hook, mask.Hook, "the same hook as the packaged poststop")
	require.Nil(t, mask.When.Always, "not for every container")
	require.Empty(t, mask.When.Commands)
	require.Nil(t, mask.When.HasBindMounts)
	require.Len(t, mask.When.Annotations, 1)
	for key, value := range mask.When.Annotations {
		k, v := regexp.MustCompile(key), regexp.MustCompile(value)
		require.True(t, k.MatchString(PoststopAnnotation))
		require.False(t, k.MatchString("io.nri-gpu-guard.poststop2"))
		require.False(t, k.MatchString("ioXnri-gpu-guard.poststop"), "dots are literal")
		require.True(t, v.MatchString("on"))
		require.False(t, v.MatchString("off"))
		require.False(t, v.MatchString(""))
	}
	nfpm, err := os.ReadFile(filepath.Join(root, "packaging", "nfpm.yaml"))
	require.NoError(t, err)
	require.Contains(t, string(nfpm), "src: packaging/oci-hooks.d/one-hook/"+name)
	require.Contains(t, string(nfpm), "dst: /usr/share/nri-gpu-guard/one-hook/"+name)
}
