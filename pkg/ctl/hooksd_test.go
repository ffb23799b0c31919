// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestCheckConfigComparesPoststopWithHooksD: check-config warns when
// [hook] poststop disagrees with the guard's hooks.d definitions in the
// hooks directories (here named outright; the shipped files, read from
// packaging/): poststop
// = false while the packaged poststop still runs for every container (the
// process the setting means to save), or poststop = true while
// create-runtime runs for every container and no poststop does (each exited
// container's claim is then a status problem until the next request). The
// shipped mask in a later directory (masking by file name), a host without the guard's
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
	// The relay with options of its own before the hook's arguments, and
	// the Go hook named directly (as releases before the relay shipped).
	relayStop := []byte(`{"version": "1.0.0", "hook": {"path": "/usr/local/bin/nri-gpu-guard-hook-relay", "args": ["nri-gpu-guard-hook-relay", ` +
		`"--relay-socket=/run/x.sock", "--relay-hook=/usr/local/bin/nri-gpu-guard-hook", "poststop", "--config", "/etc/x.toml"]}, "when": {"always": true}, "stages": ["poststop"]}`)
	goStop := []byte(`{"version": "1.0.0", "hook": {"path": "/usr/bin/nri-gpu-guard-hook", "args": ["nri-gpu-guard-hook", "poststop"]}, "when": {"always": true}, "stages": ["poststop"]}`)
	// An option of the relay's whose value names the phase is not the phase.
	// The relay hands "--relay-typo=1" to the hook as its phase: no poststop runs.
	relayTypo := []byte(`{"version": "1.0.0", "hook": {"path": "/usr/bin/nri-gpu-guard-hook-relay", "args": ["nri-gpu-guard-hook-relay", ` +
		`"--relay-typo=1", "poststop"]}, "when": {"always": true}, "stages": ["poststop"]}`)
	relayNoPhase := []byte(`{"version": "1.0.0", "hook": {"path": "/usr/bin/nri-gpu-guard-hook-relay", "args": ["nri-gpu-guard-hook-relay", ` +
		`"--relay-hook=poststop"]}, "when": {"always": true}, "stages": ["poststop"]}`)

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
			want: "hook.poststop: true, but no hooks.d definition in {usr}, {etc} (podman's hooks directories, [engine] hooks_dir) " +
				"runs `nri-gpu-guard-hook poststop` for every container while {usr}/nri-gpu-guard-create-runtime.json runs create-runtime for every one"},
		{name: "create-runtime alone, poststop = true", usr: files{"nri-gpu-guard-create-runtime.json": create}, poststop: true,
			want: "hook.poststop: true, but no hooks.d definition"},
		{name: "create-runtime alone, poststop = false", usr: files{"nri-gpu-guard-create-runtime.json": create}},
		{name: "no hooks of the guard (an NRI host), poststop = true", usr: files{"other.json": other}, poststop: true},
		{name: "the daemon's hook entry counts", usr: files{"nri-gpu-guard-create-runtime.json": create, "legacy.json": legacyStop},
			want: "{usr}/legacy.json runs `nri-gpu-guard-hook poststop`"},
		{name: "the relay with options of its own counts", usr: files{"nri-gpu-guard-create-runtime.json": create, "relay.json": relayStop},
			want: "{usr}/relay.json runs `nri-gpu-guard-hook poststop`"},
		{name: "the Go hook named directly counts", usr: files{"nri-gpu-guard-create-runtime.json": create, "direct.json": goStop},
			want: "{usr}/direct.json runs `nri-gpu-guard-hook poststop`"},
		{name: "a relay option is not the phase", usr: files{"nri-gpu-guard-create-runtime.json": create, "relay.json": relayNoPhase}},
		{name: "an option the relay does not know is the hook's first argument", usr: files{"nri-gpu-guard-create-runtime.json": create, "relay.json": relayTypo},
			poststop: true, want: "hook.poststop: true, but no hooks.d definition"},
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

// podmanHooksDirs reads the hooks directories as podman does: its default
// (/usr/share/containers/oci/hooks.d alone: /etc/containers/oci/hooks.d is
// read only when [engine] hooks_dir names it), replaced by the hooks_dir of
// the last containers.conf that sets one, drop-ins in name order. A file
// that does not parse, or is no regular file (a FIFO would block a plain
// open), is skipped.
func TestPodmanHooksDirs(t *testing.T) {
	base := t.TempDir()
	usr, etc, dropins := filepath.Join(base, "usr.conf"), filepath.Join(base, "etc.conf"), filepath.Join(base, "conf.d")
	require.NoError(t, os.Mkdir(dropins, 0o755))
	confs := []string{usr, etc, filepath.Join(dropins, "*.conf")}
	write := func(p, doc string) {
		t.Helper()
		require.NoError(t, os.WriteFile(p, []byte(doc), 0o644))
	}
	assert.Equal(t, []string{defaultHooksDir}, podmanHooksDirs(confs), "no file: podman's default")
	write(usr, "[engine]\n# hooks_dir = [\"/usr/share/containers/oci/hooks.d\"]\n")
	assert.Equal(t, []string{defaultHooksDir}, podmanHooksDirs(confs), "commented out")
	write(etc, "[engine]\nhooks_dir = [\"/usr/share/containers/oci/hooks.d\", \"/etc/containers/oci/hooks.d\"]\n")
	assert.Equal(t, []string{defaultHooksDir, "/etc/containers/oci/hooks.d"}, podmanHooksDirs(confs))
	write(filepath.Join(dropins, "10-a.conf"), "[engine]\nhooks_dir = [\"/a\"]\n")
	write(filepath.Join(dropins, "20-b.conf"), "[containers]\nnetns = \"none\"\n")
	write(filepath.Join(dropins, "30-broken.conf"), "[engine\nhooks_dir = [\"/broken\"]\n")
	require.NoError(t, syscall.Mkfifo(filepath.Join(dropins, "40-fifo.conf"), 0o600))
	assert.Equal(t, []string{"/a"}, podmanHooksDirs(confs), "the last file that sets it wins; others are skipped")
}

// check-config goes by the directories podman reads: a mask in
// /etc/containers/oci/hooks.d does nothing while hooks_dir leaves that
// directory out (podman's default), and check-config says the poststop
// still runs; named after the packaged directory, the mask counts. A FIFO
// named *.json in a hooks directory is skipped, never waited on.
func TestCheckConfigReadsPodmansHooksDirs(t *testing.T) {
	shipped := func(name string) []byte {
		data, err := os.ReadFile(filepath.Join("..", "..", "packaging", "oci-hooks.d", name))
		require.NoError(t, err)
		return data
	}
	base := t.TempDir()
	usr, etc := filepath.Join(base, "usr"), filepath.Join(base, "etc")
	for dir, files := range map[string]map[string][]byte{
		usr: {"nri-gpu-guard-create-runtime.json": shipped("nri-gpu-guard-create-runtime.json"),
			"nri-gpu-guard-poststop.json": shipped("nri-gpu-guard-poststop.json")},
		etc: {"nri-gpu-guard-poststop.json": shipped(filepath.Join("one-hook", "nri-gpu-guard-poststop.json"))},
	} {
		require.NoError(t, os.MkdirAll(dir, 0o755))
		for name, data := range files {
			require.NoError(t, os.WriteFile(filepath.Join(dir, name), data, 0o644))
		}
	}
	require.NoError(t, syscall.Mkfifo(filepath.Join(usr, "zz-fifo.json"), 0o600))
	cfg := filepath.Join(base, "config.toml")
	require.NoError(t, os.WriteFile(cfg, []byte("version = 1\n[hook]\npoststop = false\n"), 0o600))
	conf := filepath.Join(base, "containers.conf")
	for _, tc := range []struct {
		name, hooksDir string
		warns          bool
	}{
		{name: "hooks_dir names the packaged directory alone: the mask is not read", hooksDir: `["` + usr + `"]`, warns: true},
		{name: "hooks_dir names both, the mask's last", hooksDir: `["` + usr + `", "` + etc + `"]`},
		{name: "hooks_dir names both, the mask's first: masked by the packaged file", hooksDir: `["` + etc + `", "` + usr + `"]`, warns: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.NoError(t, os.WriteFile(conf, []byte("[engine]\nhooks_dir = "+tc.hooksDir+"\n"), 0o644))
			f := newFixture(t)
			var stdout, stderr syncBuffer
			env := f.env(&stdout, &stderr)
			env.HooksDirs, env.ContainersConfs = nil, []string{conf}
			require.Equal(t, ExitOK, Run(t.Context(), []string{"check-config", cfg}, env), stderr.String())
			warned := strings.Contains(stdout.String(), "warning: hook.poststop: false, but "+filepath.Join(usr, "nri-gpu-guard-poststop.json"))
			assert.Equal(t, tc.warns, warned, stdout.String())
		})
	}
}

// A definition runs for every container when every condition it sets
// matches any container, as podman and CRI-O match "when": NVIDIA's own
// definition ("always" with "commands": [".*"]) does; one that names a
// command, an annotation or bind mounts, or sets "always" false, does not.
func TestHookDefinitionForEveryContainer(t *testing.T) {
	for _, tc := range []struct {
		when string
		want bool
	}{
		{`{"always": true}`, true},
		{`{"always": true, "commands": [".*"]}`, true},
		{`{"commands": [".*"]}`, true},
		{`{"always": true, "commands": [""]}`, true},
		{`{"always": true, "commands": ["^/bin/sh$", "^"]}`, true},
		{`{"always": true, "commands": ["^/usr/bin/python3?$"]}`, false},
		{`{"always": true, "commands": [".+"]}`, false}, // not an empty args[0]
		{`{"always": true, "commands": ["("]}`, false},  // does not compile: the engine refuses it
		{`{"always": false}`, false},
		{`{"always": false, "commands": [".*"]}`, false},
		{`{"always": true, "hasBindMounts": true}`, false},
		{`{"always": true, "hasBindMounts": false}`, false},
		{`{"always": true, "annotations": {"^a$": ".*"}}`, false},
		{`{}`, false},
	} {
		var h hookDefinition
		require.NoError(t, json.Unmarshal([]byte(`{"when": `+tc.when+`}`), &h))
		assert.Equal(t, tc.want, h.forEveryContainer(), tc.when)
	}
}
