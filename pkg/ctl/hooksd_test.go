// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestCheckConfigComparesPoststopWithHooksD: check-config warns when
// [hook] poststop disagrees with the guard's hooks.d definitions in the
// default directories (the shipped files, read from packaging/): poststop
// = false while the packaged poststop still runs for every container (the
// process the setting means to save), or poststop = true while
// create-runtime runs for every container and no poststop does (each exited
// container's claim is then a status problem until the next request). The
// shipped mask in /etc (masking by file name), a host without the guard's
// hooks, other hooks and files that do not parse say nothing.
func TestCheckConfigComparesPoststopWithHooksD(t *testing.T) {
	shipped := func(name string) []byte {
		data, err := os.ReadFile(filepath.Join("..", "..", "packaging", "oci-hooks.d", name))
		require.NoError(t, err)
		return data
	}
	create, stop, mask := shipped("nri-gpu-guard-create-runtime.json"), shipped("nri-gpu-guard-poststop.json"),
		shipped(filepath.Join("one-hook", "nri-gpu-guard-poststop.json"))
	legacyStop, err := json.Marshal(map[string]any{"version": "1.0.0",
		"hook":   map[string]any{"path": "/usr/bin/nri-gpu-guard", "args": []string{"nri-gpu-guard", "hook", "poststop"}},
		"when":   map[string]any{"always": true},
		"stages": []string{"poststop"}})
	require.NoError(t, err)
	other := []byte(`{"version": "1.0.0", "hook": {"path": "/usr/bin/other-hook", "args": ["other-hook", "poststop"]}, "when": {"always": true}, "stages": ["poststop"]}`)

	type files map[string][]byte
	for _, tc := range []struct {
		name     string
		usr, etc files
		poststop bool
		want     string // "" = no warning
	}{
		{name: "packaged, poststop = true", usr: files{"nri-gpu-guard-create-runtime.json": create, "nri-gpu-guard-poststop.json": stop}, poststop: true},
		{name: "packaged, poststop = false", usr: files{"nri-gpu-guard-create-runtime.json": create, "nri-gpu-guard-poststop.json": stop},
			want: "hook.poststop: false, but {usr}/nri-gpu-guard-poststop.json runs `nri-gpu-guard-hook poststop` for every container"},
		{name: "masked in /etc, poststop = false", usr: files{"nri-gpu-guard-create-runtime.json": create, "nri-gpu-guard-poststop.json": stop},
			etc: files{"nri-gpu-guard-poststop.json": mask}},
		{name: "masked in /etc, poststop = true", usr: files{"nri-gpu-guard-create-runtime.json": create, "nri-gpu-guard-poststop.json": stop},
			etc: files{"nri-gpu-guard-poststop.json": mask}, poststop: true,
			want: "hook.poststop: true, but no hooks.d definition in {usr} and {etc} runs `nri-gpu-guard-hook poststop` for every container " +
				"while {usr}/nri-gpu-guard-create-runtime.json runs create-runtime for every one"},
		{name: "create-runtime alone, poststop = true", usr: files{"nri-gpu-guard-create-runtime.json": create}, poststop: true,
			want: "hook.poststop: true, but no hooks.d definition"},
		{name: "create-runtime alone, poststop = false", usr: files{"nri-gpu-guard-create-runtime.json": create}},
		{name: "no hooks of the guard (an NRI host), poststop = true", usr: files{"other.json": other}, poststop: true},
		{name: "the daemon's hook entry counts", usr: files{"nri-gpu-guard-create-runtime.json": create, "legacy.json": legacyStop},
			want: "{usr}/legacy.json runs `nri-gpu-guard-hook poststop`"},
		{name: "a file that does not parse is left to the engine", usr: files{"nri-gpu-guard-create-runtime.json": create,
			"nri-gpu-guard-poststop.json": []byte("{")}, poststop: true, want: "hook.poststop: true, but no hooks.d definition"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := t.TempDir()
			usr, etc := filepath.Join(base, "usr"), filepath.Join(base, "etc")
			for dir, fs := range map[string]files{usr: tc.usr, etc: tc.etc} {
				require.NoError(t, os.MkdirAll(dir, 0o755))
				for name, data := range fs {
					require.NoError(t, os.WriteFile(filepath.Join(dir, name), data, 0o644))
				}
			}
			cfg := filepath.Join(base, "config.toml")
			doc := "version = 1\n[ledger]\ndir = \"/var/lib/nri-gpu-guard\"\n[hook]\npoststop = false\n"
			if tc.poststop {
				doc = "version = 1\n[ledger]\ndir = \"/var/lib/nri-gpu-guard\"\n"
			}
			require.NoError(t, os.WriteFile(cfg, []byte(doc), 0o600))
			f := newFixture(t)
			var stdout, stderr syncBuffer
			env := f.env(&stdout, &stderr)
			env.HooksDirs = []string{usr, etc}
			code := Run(t.Context(), []string{"check-config", "-o", "json", cfg}, env)
			require.Equal(t, ExitOK, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
			var v checkConfigView
			require.NoError(t, json.Unmarshal([]byte(stdout.String()), &v))
			var ours []string
			for _, w := range v.Warnings {
				if strings.HasPrefix(w, "hook.poststop") {
					ours = append(ours, w)
				}
			}
			if tc.want == "" {
				assert.Empty(t, ours)
				return
			}
			require.Len(t, ours, 1)
			want := tc.want
			for k, v := range map[string]string{"{usr}": usr, "{etc}": etc} {
				want = strings.ReplaceAll(want, k, v)
			}
			assert.Contains(t, ours[0], want)
		})
	}
}
