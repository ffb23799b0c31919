// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"
)

const (
	testHook = "/usr/bin/nri-gpu-guard-hook"
	// The entries add-hooks writes for testHook without flags.
	createEntry   = `{"path":"/usr/bin/nri-gpu-guard-hook","args":["nri-gpu-guard-hook","create-runtime"],"env":["GOMAXPROCS=1"]}`
	poststopEntry = `{"path":"/usr/bin/nri-gpu-guard-hook","args":["nri-gpu-guard-hook","poststop"],"env":["GOMAXPROCS=1"]}`
	bothHooks     = `{"createRuntime":[` + createEntry + `],"poststop":[` + poststopEntry + `]}`
	// rlimits as docker writes them for --ulimit memlock=-1 (RLIM_INFINITY,
	// NGC's recommendation), and a number above 2^53 elsewhere: a decoder
	// into float64 (jq 1.6) rewrites both, and runc refuses the first.
	bigNumbers = `"process":{"rlimits":[{"type":"RLIMIT_MEMLOCK","hard":18446744073709551615,"soft":18446744073709551615}],` +
		`"env":["A=\u003cb\u003e"]},"linux":{"resources":{"memory":{"limit":9007199254740993}}}`
)

func testEntries() []hookEntry {
	return []hookEntry{
		{stage: "createRuntime", Path: testHook, Args: []string{program, "create-runtime"}, Env: []string{"GOMAXPROCS=1"}},
		{stage: "poststop", Path: testHook, Args: []string{program, "poststop"}, Env: []string{"GOMAXPROCS=1"}},
	}
}

// add-hooks changes the hooks object alone: every other byte of the file,
// its numbers, escapes, key order and white space, stays.
func TestAddHookEntries(t *testing.T) {
	for _, tc := range []struct {
		name, in, want string // want "": unchanged
	}{
		{"no hooks", `{"ociVersion":"1.2.0",` + bigNumbers + `}`,
			`{"ociVersion":"1.2.0",` + bigNumbers + `,"hooks":` + bothHooks + `}`},
		{"no hooks, indented, with a newline after", "{\n\t\"ociVersion\": \"1.2.0\",\n\t" + bigNumbers + "\n}\n",
			"{\n\t\"ociVersion\": \"1.2.0\",\n\t" + bigNumbers + `,"hooks":` + bothHooks + "\n}\n"},
		{"an empty spec", `{ }`, `{ "hooks":` + bothHooks + `}`},
		{"hooks null", `{"hooks":null,` + bigNumbers + `}`, `{"hooks":` + bothHooks + `,` + bigNumbers + `}`},
		{"hooks empty", `{"hooks":{},` + bigNumbers + `}`, `{"hooks":` + bothHooks + `,` + bigNumbers + `}`},
		{"other stages only", `{"hooks":{"prestart":[{"path":"/p","timeout":  5 }]}}`,
			`{"hooks":{"prestart":[{"path":"/p","timeout":  5 }],"createRuntime":[` + createEntry + `],"poststop":[` + poststopEntry + `]}}`},
		{"another createRuntime hook first", `{"hooks":{"createRuntime":[{"path":"/nvidia"}],"poststop":null}}`,
			`{"hooks":{"createRuntime":[{"path":"/nvidia"},` + createEntry + `],"poststop":[` + poststopEntry + `]}}`},
		{"empty lists", `{"hooks":{"createRuntime":[ ],"poststop":[]}}`,
			`{"hooks":{"createRuntime":[` + createEntry + `],"poststop":[` + poststopEntry + `]}}`},
		{"createRuntime there already (other args): poststop added", `{"hooks":{"createRuntime":[{"path":"/usr/bin/nri-gpu-guard-hook","args":["x","--wait"]}]}}`,
			`{"hooks":{"createRuntime":[{"path":"/usr/bin/nri-gpu-guard-hook","args":["x","--wait"]}],"poststop":[` + poststopEntry + `]}}`},
		{"both there: not written again", `{"hooks":{"poststop":[null,` + poststopEntry + `],"createRuntime":[` + createEntry + `]},` + bigNumbers + `}`, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := addHookEntries([]byte(tc.in), testEntries())
			require.NoError(t, err)
			if tc.want == "" {
				require.Nil(t, out)
				return
			}
			require.Equal(t, tc.want, string(out))
			var spec specs.Spec
			require.NoError(t, json.Unmarshal(out, &spec))
			again, err := addHookEntries(out, testEntries())
			require.NoError(t, err)
			require.Nil(t, again, "a second run adds nothing")
		})
	}
}

// A spec that runtimes read in two ways is refused as the hook refuses it:
// an edit by key would go into one of the two readings.
func TestAddHookEntriesRefuses(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"hooks twice", `{"hooks":{},"hooks":{"createRuntime":[]}}`, `ambiguous key "hooks": it appears twice in the top-level object`},
		{"linux twice", `{"linux":{"devices":[]},"linux":{}}`, `ambiguous key "linux"`},
		{"Hooks", `{"Hooks":{"createRuntime":[]}}`, `ambiguous key "Hooks" in the top-level object: it differs from the field "hooks" only in case`},
		{"Poststop", `{"hooks":{"Poststop":[]}}`, `ambiguous key "Poststop" in hooks`},
		{"createruntime", `{"hooks":{"createruntime":[]}}`, `ambiguous key "createruntime" in hooks`},
		{"Path", `{"hooks":{"poststop":[{"Path":"/usr/bin/nri-gpu-guard-hook"}]}}`, `ambiguous key "Path" in hooks.poststop[0]`},
		{"not JSON", `{"hooks":`, "not JSON"},
		{"trailing data", `{} {}`, "not JSON"},
		{"not an object", `[]`, "not an OCI runtime spec: not a JSON object"},
		{"hooks not an object", `{"hooks":[]}`, "hooks: not a JSON object"},
		{"a stage not a list", `{"hooks":{"poststop":{"path":"/x"}}}`, "hooks.poststop is not a list of hooks"},
		{"an entry not a hook", `{"hooks":{"createRuntime":["/x"]}}`, "hooks.createRuntime is not a list of hooks"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := addHookEntries([]byte(tc.in), testEntries())
			require.ErrorContains(t, err, tc.want)
		})
	}
}

func TestAddHooksCommand(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.json")
	orig := "{\n  \"ociVersion\": \"1.2.0\",\n  " + bigNumbers + "\n}\n"
	require.NoError(t, os.WriteFile(cfg, []byte(orig), 0o640))
	require.NoError(t, os.Chmod(cfg, 0o640)) // whatever the umask

	var stdout, stderr bytes.Buffer
	args := []string{cmdAddHooks, "--config", "/etc/gg/c.toml", "--state-dir", "/run/gg", "--wait", "--path", testHook, cfg}
	require.Equal(t, 0, run(args, strings.NewReader(""), &stdout, &stderr), stderr.String())
	require.Empty(t, stdout.String())
	require.Empty(t, stderr.String())
	data, err := os.ReadFile(cfg)
	require.NoError(t, err)
	require.Equal(t, "{\n  \"ociVersion\": \"1.2.0\",\n  "+bigNumbers+`,"hooks":{"createRuntime":[{"path":"/usr/bin/nri-gpu-guard-hook",`+
		`"args":["nri-gpu-guard-hook","create-runtime","--config","/etc/gg/c.toml","--state-dir","/run/gg","--wait"],"env":["GOMAXPROCS=1"]}],`+
		`"poststop":[{"path":"/usr/bin/nri-gpu-guard-hook","args":["nri-gpu-guard-hook","poststop","--config","/etc/gg/c.toml","--state-dir","/run/gg"],`+
		`"env":["GOMAXPROCS=1"]}]}`+"\n}\n", string(data))
	fi, err := os.Stat(cfg)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o640), fi.Mode().Perm(), "the mode is kept")
	ino := fi.Sys().(*syscall.Stat_t).Ino

	// Again: nothing to add, and the file is not rewritten.
	require.Equal(t, 0, run(args, strings.NewReader(""), &stdout, &stderr), stderr.String())
	fi, err = os.Stat(cfg)
	require.NoError(t, err)
	require.Equal(t, ino, fi.Sys().(*syscall.Stat_t).Ino, "not replaced")
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 1, "no temporary file left: %v", entries)

	// A refused spec is left as it was, and no temporary file stays.
	dup := `{"linux":{},"linux":{}}`
	require.NoError(t, os.WriteFile(cfg, []byte(dup), 0o600))
	stderr.Reset()
	require.Equal(t, 1, run([]string{cmdAddHooks, "--path", testHook, cfg}, strings.NewReader(""), &stdout, &stderr))
	require.Contains(t, stderr.String(), program+" add-hooks: "+cfg+`: ambiguous key "linux"`)
	data, err = os.ReadFile(cfg)
	require.NoError(t, err)
	require.Equal(t, dup, string(data))
	entries, err = os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 1)

	fifo := filepath.Join(dir, "fifo.json")
	require.NoError(t, syscall.Mkfifo(fifo, 0o600))
	for _, tc := range []struct {
		name string
		args []string
		want int
		err  string
	}{
		{"no file", []string{cmdAddHooks}, 2, "want one config.json, got 0 arguments"},
		{"two files", []string{cmdAddHooks, cfg, cfg}, 2, "want one config.json, got 2 arguments"},
		{"relative config", []string{cmdAddHooks, "--config", "c.toml", cfg}, 2, `--config "c.toml": want an absolute path`},
		{"relative path", []string{cmdAddHooks, "--path", "nri-gpu-guard-hook", cfg}, 2, `--path "nri-gpu-guard-hook": want an absolute path`},
		{"unknown flag", []string{cmdAddHooks, "--bogus", cfg}, 2, "usage: " + addHooksUsage},
		{"help", []string{cmdAddHooks, "--help"}, 0, "usage: " + addHooksUsage},
		{"missing file", []string{cmdAddHooks, filepath.Join(dir, "none.json")}, 1, "none.json: no such file"},
		{"a FIFO", []string{cmdAddHooks, fifo}, 1, "not a regular file (it is a named pipe (FIFO))"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			require.Equal(t, tc.want, run(tc.args, strings.NewReader(""), &stdout, &stderr), stderr.String())
			require.Contains(t, stderr.String(), tc.err)
		})
	}
}

// add-hooks --no-poststop, for a host whose configuration says [hook]
// poststop = false: the createRuntime hook alone, and the poststop too for a
// container annotated io.nri-gpu-guard.poststop=on (what the shipped hooks.d
// mask runs it for).
func TestAddHooksWithoutPoststop(t *testing.T) {
	for _, tc := range []struct {
		name, in, want string
	}{
		{"no annotation", `{"ociVersion":"1.2.0"}`, `{"ociVersion":"1.2.0","hooks":{"createRuntime":[` + createEntry + `]}}`},
		{"opted in", `{"annotations":{"io.nri-gpu-guard.poststop":"on"}}`,
			`{"annotations":{"io.nri-gpu-guard.poststop":"on"},"hooks":` + bothHooks + `}`},
		{"another value", `{"annotations":{"io.nri-gpu-guard.poststop":"yes"}}`,
			`{"annotations":{"io.nri-gpu-guard.poststop":"yes"},"hooks":{"createRuntime":[` + createEntry + `]}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := filepath.Join(t.TempDir(), "config.json")
			require.NoError(t, os.WriteFile(cfg, []byte(tc.in), 0o600))
			var stdout, stderr bytes.Buffer
			require.Equal(t, 0, run([]string{cmdAddHooks, "--no-poststop", "--path", testHook, cfg}, strings.NewReader(""), &stdout, &stderr),
				stderr.String())
			data, err := os.ReadFile(cfg)
			require.NoError(t, err)
			require.Equal(t, tc.want, string(data))
		})
	}
}

// With --relay (or the relay found beside the hook binary) the entries run
// the relay, told which hook binary to run itself when no server answers;
// an entry already there of either path counts as the hook.
func TestAddHooksThroughTheRelay(t *testing.T) {
	relay := filepath.Join(t.TempDir(), relayName)
	require.NoError(t, os.WriteFile(relay, nil, 0o755))
	relayCreate := `{"path":"` + relay + `","args":["nri-gpu-guard-hook-relay","--relay-hook=/usr/bin/nri-gpu-guard-hook","create-runtime","--config","/etc/gg/c.toml","--wait"],"env":["GOMAXPROCS=1"]}`
	relayPoststop := `{"path":"` + relay + `","args":["nri-gpu-guard-hook-relay","--relay-hook=/usr/bin/nri-gpu-guard-hook","poststop","--config","/etc/gg/c.toml"],"env":["GOMAXPROCS=1"]}`
	for _, tc := range []struct {
		name, in, want string // want "": unchanged
	}{
		{"no hooks", `{"ociVersion":"1.2.0"}`, `{"ociVersion":"1.2.0","hooks":{"createRuntime":[` + relayCreate + `],"poststop":[` + relayPoststop + `]}}`},
		{"the hook binary there directly", `{"hooks":` + bothHooks + `}`, ""},
		{"the relay there", `{"hooks":{"createRuntime":[{"path":"` + relay + `"}],"poststop":[{"path":"` + relay + `"}]}}`, ""},
		{"one stage of each", `{"hooks":{"createRuntime":[` + createEntry + `]}}`,
			`{"hooks":{"createRuntime":[` + createEntry + `],"poststop":[` + relayPoststop + `]}}`},
		{"another relay's path", `{"hooks":{"createRuntime":[{"path":"/usr/bin/nri-gpu-guard-hook-relay"}]}}`,
			`{"hooks":{"createRuntime":[{"path":"/usr/bin/nri-gpu-guard-hook-relay"},` + relayCreate + `],"poststop":[` + relayPoststop + `]}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := filepath.Join(t.TempDir(), "config.json")
			require.NoError(t, os.WriteFile(cfg, []byte(tc.in), 0o600))
			var stdout, stderr bytes.Buffer
			args := []string{cmdAddHooks, "--config", "/etc/gg/c.toml", "--wait", "--path", testHook, "--relay", relay, cfg}
			require.Equal(t, 0, run(args, strings.NewReader(""), &stdout, &stderr), stderr.String())
			data, err := os.ReadFile(cfg)
			require.NoError(t, err)
			if tc.want == "" {
				require.Equal(t, tc.in, string(data), "nothing added")
				return
			}
			require.Equal(t, tc.want, string(data))
			var spec specs.Spec
			require.NoError(t, json.Unmarshal(data, &spec))
		})
	}

	// Entries through the relay are the hook for an add-hooks that does
	// not run it (--no-relay, --path): not added a second time.
	dir := t.TempDir()
	hookBin := filepath.Join(dir, program)
	require.NoError(t, os.WriteFile(hookBin, nil, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, relayName), nil, 0o755))
	cfg := filepath.Join(t.TempDir(), "config.json")
	require.NoError(t, os.WriteFile(cfg, []byte(`{}`), 0o600))
	var stdout, stderr bytes.Buffer
	require.Equal(t, 0, run([]string{cmdAddHooks, "--path", hookBin, "--relay", filepath.Join(dir, relayName), cfg}, strings.NewReader(""), &stdout, &stderr),
		stderr.String())
	through, err := os.ReadFile(cfg)
	require.NoError(t, err)
	require.Contains(t, string(through), `"path":"`+filepath.Join(dir, relayName)+`"`)
	for _, args := range [][]string{{"--path", hookBin}, {"--path", hookBin, "--no-relay"}} {
		require.Equal(t, 0, run(append(append([]string{cmdAddHooks}, args...), cfg), strings.NewReader(""), &stdout, &stderr), stderr.String())
		again, err := os.ReadFile(cfg)
		require.NoError(t, err)
		require.Equal(t, string(through), string(again), "%v: nothing added", args)
	}

	for _, tc := range []struct {
		name string
		args []string
		err  string
	}{
		{"both", []string{cmdAddHooks, "--relay", relay, "--no-relay", cfg}, "--relay and --no-relay: give one"},
		{"relative relay", []string{cmdAddHooks, "--relay", "nri-gpu-guard-hook-relay", cfg}, `--relay "nri-gpu-guard-hook-relay": want an absolute path`},
		{"no relay there", []string{cmdAddHooks, "--relay", filepath.Join(dir, "none"), cfg}, "none: not an executable regular file"},
		{"--path the relay", []string{cmdAddHooks, "--path", relay, "--relay", relay, cfg}, "is the relay itself; with --relay, --path names the hook binary"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			require.Equal(t, 2, run(tc.args, strings.NewReader(""), &stdout, &stderr))
			require.Contains(t, stderr.String(), tc.err)
			data, err := os.ReadFile(cfg)
			require.NoError(t, err)
			require.Equal(t, string(through), string(data))
		})
	}
}

// Which relay the entries run, and which other paths count as the hook.
func TestChooseRelay(t *testing.T) {
	dir := t.TempDir()
	hookBin := filepath.Join(dir, program)
	beside := filepath.Join(dir, relayName)
	require.NoError(t, os.WriteFile(beside, nil, 0o755))
	lone := filepath.Join(t.TempDir(), program) // no relay beside it
	other := filepath.Join(t.TempDir(), "relay")
	require.NoError(t, os.WriteFile(other, nil, 0o755))
	notExec := filepath.Join(t.TempDir(), "relay")
	require.NoError(t, os.WriteFile(notExec, nil, 0o644))
	for _, tc := range []struct {
		name      string
		hook      string
		flag      string
		pathGiven bool
		noRelay   bool
		relay     string
		also      []string
		err       string
	}{
		{name: "the relay beside", hook: hookBin, relay: beside},
		{name: "none beside", hook: lone},
		{name: "--no-relay", hook: hookBin, noRelay: true, also: []string{beside}},
		{name: "--path", hook: hookBin, pathGiven: true, also: []string{beside}},
		{name: "--path, --relay", hook: hookBin, pathGiven: true, flag: other, relay: other, also: []string{beside}},
		{name: "--relay over the one beside", hook: hookBin, flag: other, relay: other, also: []string{beside}},
		{name: "--relay, none beside", hook: lone, flag: other, relay: other},
		{name: "--relay not executable", hook: hookBin, flag: notExec, err: "not an executable regular file"},
		{name: "--relay a directory", hook: hookBin, flag: dir, err: "not an executable regular file"},
		{name: "--relay and --no-relay", hook: hookBin, flag: other, noRelay: true, err: "give one"},
		{name: "--path the relay, --relay", hook: beside, pathGiven: true, flag: other, err: "is the relay itself"},
		{name: "--path the relay (the older form)", hook: beside, pathGiven: true, also: []string{beside}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			relay, also, err := chooseRelay(tc.hook, tc.flag, tc.pathGiven, tc.noRelay)
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.relay, relay)
			require.Equal(t, tc.also, also)
		})
	}
}

// The relay counts as installed beside the hook binary only as an
// executable regular file (a symlink to one included).
func TestRelayBeside(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, path string)
		found bool
	}{
		{"none", func(*testing.T, string) {}, false},
		{"executable", func(t *testing.T, p string) { require.NoError(t, os.WriteFile(p, nil, 0o755)) }, true},
		{"not executable", func(t *testing.T, p string) { require.NoError(t, os.WriteFile(p, nil, 0o644)) }, false},
		{"a directory", func(t *testing.T, p string) { require.NoError(t, os.Mkdir(p, 0o755)) }, false},
		{"a symlink to an executable", func(t *testing.T, p string) {
			target := filepath.Join(t.TempDir(), "relay")
			require.NoError(t, os.WriteFile(target, nil, 0o755))
			require.NoError(t, os.Symlink(target, p))
		}, true},
		{"a dangling symlink", func(t *testing.T, p string) { require.NoError(t, os.Symlink("/nonexistent/relay", p)) }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			relay := filepath.Join(dir, relayName)
			tc.setup(t, relay)
			got := relayBeside(filepath.Join(dir, program))
			if tc.found {
				require.Equal(t, relay, got)
			} else {
				require.Empty(t, got)
			}
		})
	}
}
