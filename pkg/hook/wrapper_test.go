// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
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

// buildHookBinary builds nri-gpu-guard-hook (the wrapper runs its
// add-hooks) into dir.
func buildHookBinary(t *testing.T, dir string) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("the wrapper runs the hook binary, built with the go command: %v", err)
	}
	root, err := moduleRoot()
	require.NoError(t, err)
	bin := filepath.Join(dir, "nri-gpu-guard-hook")
	cmd := exec.Command(goBin, "build", "-tags", "nri_no_wasm", "-o", bin, "./cmd/nri-gpu-guard-hook")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0") // as the release builds it
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

// The runc wrapper of docs/hook.md adds the guard's hooks to the bundle of
// every runc subcommand that runs createRuntime hooks: create, run, and
// restore (a container restored from a checkpoint; containerd writes its
// bundle afresh), and leaves the others alone. Every other byte of
// config.json stays: docker writes --ulimit memlock=-1 as an rlimit of
// 2^64-1, which an edit through float64 (jq 1.6) turned into a number runc
// refuses.
func TestDocWrapperAddsTheHooks(t *testing.T) {
	if _, err := exec.LookPath("sh"); err != nil {
		t.Skipf("the wrapper needs sh: %v", err)
	}
	wrapper := docWrapper(t)
	guardBin := buildHookBinary(t, t.TempDir())
	const rlimits = `"rlimits":[{"type":"RLIMIT_MEMLOCK","hard":18446744073709551615,"soft":18446744073709551615},` +
		`{"type":"RLIMIT_NOFILE","hard":1048576,"soft":1048576}]`
	spec := "{\n  \"ociVersion\": \"" + specs.Version + "\",\n  \"process\": {\"env\": [\"NVIDIA_VISIBLE_DEVICES=1\", \"X=\\u003c\"], " +
		`"capabilities":{"bounding":["CAP_KILL"]},` + rlimits + "},\n" +
		`  "linux": {"resources": {"memory": {"limit": 9007199254740993, "swap": 9223372036854775807}}}` + "\n}\n"
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
			cfgPath := filepath.Join(bundle, "config.json")
			require.NoError(t, os.WriteFile(cfgPath, []byte(spec), 0o600))
			// The runc the wrapper runs records its arguments.
			fake := filepath.Join(dir, "runc")
			require.NoError(t, os.WriteFile(fake, []byte("#!/bin/sh\necho \"$@\" >"+filepath.Join(dir, "args")+"\n"), 0o755))

			cmd := exec.Command(wrapper, tc.args(bundle)...)
			cmd.Dir = dir
			cmd.Env = append(os.Environ(), "RUNC_GPU_GUARD_RUNC="+fake, "RUNC_GPU_GUARD_BIN="+guardBin)
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "%s", out)
			require.Empty(t, out, "the wrapper says nothing")
			args, err := os.ReadFile(filepath.Join(dir, "args"))
			require.NoError(t, err)
			require.Equal(t, strings.Join(tc.args(bundle), " ")+"\n", string(args), "runc gets the arguments unchanged")

			data, err := os.ReadFile(cfgPath)
			require.NoError(t, err)
			if !tc.hooks {
				require.Equal(t, spec, string(data), "config.json left alone")
				return
			}
			// Every value but the hooks byte for byte, the numbers above
			// 2^53 included.
			members := func(data []byte) map[string]string {
				var m map[string]json.RawMessage
				require.NoError(t, json.Unmarshal(data, &m))
				out := map[string]string{}
				for k, v := range m {
					out[k] = string(v)
				}
				return out
			}
			after := members(data)
			require.Contains(t, after, "hooks", "the hooks were added")
			delete(after, "hooks")
			require.Equal(t, members([]byte(spec)), after)
			require.Contains(t, string(data), rlimits)
			require.Contains(t, string(data), `"limit": 9007199254740993, "swap": 9223372036854775807`)

			var got specs.Spec
			require.NoError(t, json.Unmarshal(data, &got), "runc reads it")
			require.Equal(t, uint64(18446744073709551615), got.Process.Rlimits[0].Hard)
			require.Equal(t, []specs.Hook{{Path: guardBin, Args: []string{"nri-gpu-guard-hook", PhaseCreateRuntime}, Env: RuntimeEnv()}},
				got.Hooks.CreateRuntime)
			require.Equal(t, []specs.Hook{{Path: guardBin, Args: []string{"nri-gpu-guard-hook", PhasePoststop}, Env: RuntimeEnv()}},
				got.Hooks.Poststop)

			// A second create over the same bundle adds nothing.
			cmd = exec.Command(wrapper, tc.args(bundle)...)
			cmd.Dir = dir
			cmd.Env = append(os.Environ(), "RUNC_GPU_GUARD_RUNC="+fake, "RUNC_GPU_GUARD_BIN="+guardBin)
			out, err = cmd.CombinedOutput()
			require.NoError(t, err, "%s", out)
			again, err := os.ReadFile(cfgPath)
			require.NoError(t, err)
			require.Equal(t, string(data), string(again))
		})
	}
}

// A config.json that runtimes read in two ways fails the wrapper before
// runc runs: the container is not created, and the file is left as it was.
func TestDocWrapperRefusesAmbiguousSpec(t *testing.T) {
	if _, err := exec.LookPath("sh"); err != nil {
		t.Skipf("the wrapper needs sh: %v", err)
	}
	wrapper := docWrapper(t)
	guardBin := buildHookBinary(t, t.TempDir())
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "config.json")
	spec := `{"linux":{"devices":[{"path":"/dev/nvidia1","type":"c","major":195,"minor":1}]},"linux":{"devices":[]}}`
	require.NoError(t, os.WriteFile(cfgPath, []byte(spec), 0o600))
	fake := filepath.Join(dir, "runc")
	require.NoError(t, os.WriteFile(fake, []byte("#!/bin/sh\ntouch "+filepath.Join(dir, "ran")+"\n"), 0o755))
	cmd := exec.Command(wrapper, "create", "--bundle", dir, "c1")
	cmd.Env = append(os.Environ(), "RUNC_GPU_GUARD_RUNC="+fake, "RUNC_GPU_GUARD_BIN="+guardBin)
	out, err := cmd.CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), `add-hooks: `+cfgPath+`: ambiguous key "linux": it appears twice in the top-level object`)
	require.NoFileExists(t, filepath.Join(dir, "ran"), "runc did not run")
	data, err := os.ReadFile(cfgPath)
	require.NoError(t, err)
	require.Equal(t, spec, string(data))
}

// TestRuncDocWrapperRunsTheRelay: the wrapper of docs/hook.md, with the
// relay installed beside the hook binary as the packages install it, runs
// real runc containers whose hooks are the relay (add-hooks names it, and
// the hook binary behind it). With a hook server listening on the relay's
// socket, the server answers (a waiting container's hook process is the
// relay itself, and the server logs no fallback); with none, each relay
// runs the Go hook itself (the waiting hook process is the Go hook, under
// the relay's pid). Either way the guard admits, queues, refuses and
// releases as with the Go hook named directly. The relay is built with
// the rig's socket as its default: the host's own (a server of an
// installed package) never answers these containers.
func TestRuncDocWrapperRunsTheRelay(t *testing.T) {
	if _, err := exec.LookPath("sh"); err != nil {
		t.Skipf("the wrapper needs sh: %v", err)
	}
	for _, tc := range []struct {
		name     string
		opts     rigOpts
		hookArg0 string
	}{
		{"no server", rigOpts{direct: true}, hookArgv0},
		{"the server answers", rigOpts{relay: true}, relayArgv0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, tc.opts)
			if relaySkip != "" {
				t.Skip(relaySkip)
			}
			require.NoError(t, relayErr)
			// The hook binary by a path of its own (a symlink, as the
			// wrapper's $GUARD may be), the relay built beside it.
			dir := t.TempDir()
			guard := filepath.Join(dir, "nri-gpu-guard-hook")
			require.NoError(t, os.Symlink(hookBin, guard))
			relay := filepath.Join(dir, "nri-gpu-guard-hook-relay")
			root, err := moduleRoot()
			require.NoError(t, err)
			skip, err := buildRelay(root, relay, `-DRELAY_DEFAULT_SOCKET="`+r.sock+`"`)
			require.Empty(t, skip)
			require.NoError(t, err)
			if !r.relay {
				require.NoFileExists(t, r.sock, "no server")
			}
			// --config and --wait after add-hooks, as docs/hook.md says
			// for another configuration file (and plain runc's waiting).
			wrapper := docWrapper(t)
			script, err := os.ReadFile(wrapper)
			require.NoError(t, err)
			const call = `"$GUARD" add-hooks "`
			require.Contains(t, string(script), call)
			script = []byte(strings.Replace(string(script), call, `"$GUARD" add-hooks --wait --config '`+r.cfgPath+`' "`, 1))
			require.NoError(t, os.WriteFile(wrapper, script, 0o755))
			via := func(o ctrOpts) ctrOpts {
				o.runtime, o.runtimeEnv = wrapper, []string{"RUNC_GPU_GUARD_BIN=" + guard}
				return o
			}

			h := r.start("h", via(ctrOpts{env: gpuEnv(0)}))
			r.waitFor("h to start", func() bool { return r.started("h") || !h.running() })
			require.True(t, r.started("h"), "h admitted: %s", h.out.String())
			data, err := os.ReadFile(filepath.Join(r.base, "b", "h", "config.json"))
			require.NoError(t, err)
			var spec specs.Spec
			require.NoError(t, json.Unmarshal(data, &spec))
			relayed := func(phase string, wait ...string) []specs.Hook {
				args := append([]string{"nri-gpu-guard-hook-relay", "--relay-hook=" + guard, phase, "--config", r.cfgPath}, wait...)
				return []specs.Hook{{Path: relay, Args: args, Env: RuntimeEnv()}}
			}
			require.Equal(t, relayed(PhaseCreateRuntime, "--wait"), spec.Hooks.CreateRuntime)
			require.Equal(t, relayed(PhasePoststop), spec.Hooks.Poststop)
			require.Equal(t, map[string]string{gpuUUIDs[0]: "h"}, r.holders())

			c, err := r.run("unknown", via(ctrOpts{env: gpuEnv(7), mode: "exit"}))
			require.Error(t, err, "GPU 7 is not in the inventory")
			require.Contains(t, hookVerdict(t, c.out.String()), "exit status "+strconv.Itoa(ExitPolicy))
			require.False(t, r.started("unknown"))

			w := r.start("w", via(ctrOpts{env: gpuEnv(0)}))
			r.waitFor("w to queue", func() bool { return slices.Contains(r.waiterKeys(), "w") || !w.running() })
			require.True(t, w.running(), "w's runc returned: %s", w.out.String())
			require.Equal(t, tc.hookArg0, r.hookOf(w).argv0, "w's hook process")
			r.release("h")
			require.NoError(t, h.wait(t))
			r.waitFor("w to start", func() bool { return r.started("w") || !w.running() })
			require.True(t, r.started("w"), "w admitted after h: %s", w.out.String())
			r.release("w")
			require.NoError(t, w.wait(t))
			require.Empty(t, r.holders(), "the poststops released GPU 0")

			// h's claim ended at its poststop or at w's poll, whichever
			// came first (only the former reserves GPU 0 for w).
			var ops []string
			for _, x := range r.audit() {
				if (x.ContainerID == "h" && x.Op == ledger.OpRelease) || x.Op == ledger.OpReserve {
					continue
				}
				ops = append(ops, x.ContainerID+" "+x.Op)
			}
			require.Equal(t, []string{"h claim", "unknown refuse", "w enqueue", "w claim", "w release"}, ops)
			if r.relay {
				require.Empty(t, r.serverLog(), "no relay fell back")
			}
		})
	}
}
