// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/benchab"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// BenchmarkHookProcess times whole processes, interleaved: the hook binary
// as the release builds it (static, -trimpath, stripped) for a container that
// names no GPU, against a static Go program that only reads its stdin, and
// the same request through the daemon binary's `nri-gpu-guard hook` (as
// `make build` builds it) for comparison, and, when HOOK_BASELINE names one,
// another build of the hook. The GPU path is timed as a pair: create-runtime
// --wait claiming GPU 0 then poststop releasing it ("gpu-pair", two durable
// commits), against the same two phases of a static program that makes one
// durable commit each (flock, append a journal-sized record, fdatasync,
// unlock: "durable-pair", the floor of any hook that records a claim
// durably). The hook runs with the environment the shipped hook definitions
// give it (hook.RuntimeEnv) and, as "create-inherit", with this process's
// (and as "create-128p" with GOMAXPROCS=128, a 128-CPU node's default);
// each floor with this process's and, as "-1p", with hook.RuntimeEnv. The
// ratios are what counts; run it with -benchtime=300x -count=3
// (hack/bench-process.sh does).
func BenchmarkHookProcess(b *testing.B) {
	dir := b.TempDir()
	bins := map[string]string{}
	for _, bld := range []struct {
		name, pkg string
		env       []string
		flags     []string
	}{
		{"hook", ".", []string{"CGO_ENABLED=0"}, []string{"-trimpath", "-ldflags=-s -w"}},
		{"stdin", "./testdata/readstdin", []string{"CGO_ENABLED=0"}, []string{"-trimpath", "-ldflags=-s -w"}},
		{"durable", "./testdata/durablefloor", []string{"CGO_ENABLED=0"}, []string{"-trimpath", "-ldflags=-s -w"}},
		{"daemon", "../nri-gpu-guard", nil, []string{"-ldflags=-s -w"}},
	} {
		out := filepath.Join(dir, bld.name)
		args := append([]string{"build", "-tags", "nri_no_wasm", "-o", out}, bld.flags...)
		cmd := exec.Command("go", append(args, bld.pkg)...)
		cmd.Env = append(os.Environ(), bld.env...)
		if msg, err := cmd.CombinedOutput(); err != nil {
			b.Skipf("go build %s: %v\n%s", bld.pkg, err, msg)
		}
		bins[bld.name] = benchab.MustInstall(b, out)
	}

	// A host: a configuration with one static GPU over its own ledger, and a
	// bundle whose spec carries env.
	host := func(name string, env ...string) (cfg, state, bundle string) {
		cfg, state, bundle = filepath.Join(dir, name+".toml"), filepath.Join(dir, name+"state"), filepath.Join(dir, name+"bundle")
		writeFile(b, cfg, fmt.Sprintf("[ledger]\ndir = %q\n[devices]\nsource = \"static\"\nproc_root = %q\n"+
			"[[devices.static]]\nindex = 0\nuuid = \"GPU-6c1a2f2e-0000-4000-8000-000000000000\"\nminor = 0\n", state, filepath.Join(dir, "no-driver")))
		spec, err := json.Marshal(specs.Spec{Version: specs.Version, Process: &specs.Process{
			Args: []string{"/app"}, Env: append([]string{"PATH=/usr/bin:/bin", "HOME=/root"}, env...), Capabilities: podmanCaps()}})
		if err != nil {
			b.Fatal(err)
		}
		writeFile(b, filepath.Join(bundle, "config.json"), string(spec))
		return cfg, state, bundle
	}
	cfg, state, bundle := host("nogpu", "TERM=xterm")
	stdin, err := json.Marshal(specs.State{Version: specs.Version, ID: "bench", Status: specs.StateCreating, Pid: os.Getpid(), Bundle: bundle})
	if err != nil {
		b.Fatal(err)
	}
	// timed runs one process with env as its environment: hook.RuntimeEnv()
	// as the shipped hook definitions set it, or nil for this process's (as a
	// runtime runs a hook whose definition sets none).
	timed := func(env []string, in []byte, bin string, args ...string) (time.Duration, error) {
		cmd := exec.Command(bin, args...)
		cmd.Env = env
		cmd.Stdin = bytes.NewReader(in)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		start := time.Now()
		err := cmd.Run()
		d := time.Since(start)
		if err != nil {
			return 0, fmt.Errorf("%s %v: %w: %s", bin, args, err, stderr.String())
		}
		return d, nil
	}
	shipped := hook.RuntimeEnv()
	run := func(env []string, bin string, args ...string) func() (time.Duration, error) {
		return func() (time.Duration, error) { return timed(env, stdin, bin, args...) }
	}

	// The GPU pair: its own configuration, ledger and bundle (GPU 0 named),
	// a new container id per pair; the pid is a child's that runs through
	// create-runtime and is ended before poststop, as a container's is
	// (poststop spares a claim whose recorded process still runs). Starting
	// and ending it is not timed.
	gpuCfg, gpuState, gpuBundle := host("gpu", "NVIDIA_VISIBLE_DEVICES=0")
	// The baseline's pairs keep a ledger of their own: on a shared one,
	// whichever build compacts sooner would pay every compaction and hand
	// the other the shorter journal.
	baseCfg, _, _ := host("gpubase", "NVIDIA_VISIBLE_DEVICES=0")
	floorDir := filepath.Join(dir, "floorstate") // same file system as the ledger
	pairs := 0
	pairWith := func(cfgPath string, env []string, bin string, extra ...string) func() (time.Duration, error) {
		return func() (time.Duration, error) {
			pairs++
			ctr := exec.Command("sleep", "3600")
			if err := ctr.Start(); err != nil {
				return 0, err
			}
			end := func() { _ = ctr.Process.Kill(); _ = ctr.Wait() }
			defer end()
			in, err := json.Marshal(specs.State{Version: specs.Version, ID: fmt.Sprintf("pair-%d", pairs),
				Status: specs.StateCreating, Pid: ctr.Process.Pid, Bundle: gpuBundle})
			if err != nil {
				return 0, err
			}
			var total time.Duration
			for i, args := range [][]string{{"create-runtime", "--config", cfgPath, "--wait"}, {"poststop", "--config", cfgPath}} {
				if i == 1 {
					end()
				}
				d, err := timed(env, in, bin, append(args, extra...)...)
				if err != nil {
					return 0, err
				}
				total += d
			}
			return total, nil
		}
	}
	pair := func(env []string, bin string, extra ...string) func() (time.Duration, error) {
		return pairWith(gpuCfg, env, bin, extra...)
	}
	variants := []benchab.Variant{
		{Name: "stdin", Run: run(nil, bins["stdin"])},
		{Name: "stdin-1p", Run: run(shipped, bins["stdin"])},
		{Name: "create", Run: run(shipped, bins["hook"], "create-runtime", "--config", cfg)},
		{Name: "poststop", Run: run(shipped, bins["hook"], "poststop", "--config", cfg)},
		{Name: "create-inherit", Run: run(nil, bins["hook"], "create-runtime", "--config", cfg)},
		// What a definition without the variable costs on a 128-CPU node.
		{Name: "create-128p", Run: run([]string{"GOMAXPROCS=128"}, bins["hook"], "create-runtime", "--config", cfg)},
		{Name: "daemon-create", Run: run(nil, bins["daemon"], "hook", "create-runtime", "--config", cfg)},
		{Name: "gpu-pair", Run: pair(shipped, bins["hook"])},
		{Name: "durable-pair", Run: pair(nil, bins["durable"], "--state-dir", floorDir)},
		{Name: "durable-pair-1p", Run: pair(shipped, bins["durable"], "--state-dir", floorDir)},
	}
	// HOOK_BASELINE names another build of the hook binary (an earlier
	// commit's) to time in the same rounds, in the same environment: a
	// before/after on one machine under one load.
	base := os.Getenv("HOOK_BASELINE")
	if base != "" {
		base = benchab.MustInstall(b, base)
		variants = append(variants,
			benchab.Variant{Name: "baseline-create", Run: run(shipped, base, "create-runtime", "--config", cfg)},
			benchab.Variant{Name: "baseline-poststop", Run: run(shipped, base, "poststop", "--config", cfg)},
			benchab.Variant{Name: "baseline-gpu-pair", Run: pairWith(baseCfg, shipped, base)})
	}
	samples := benchab.Run(b, variants)
	samples.ReportRatio(b, "create", "stdin-1p")
	samples.ReportRatio(b, "gpu-pair", "durable-pair")
	samples.ReportRatio(b, "gpu-pair", "durable-pair-1p")
	if base != "" {
		samples.ReportRatio(b, "baseline-gpu-pair", "durable-pair")
	}
	if _, err := os.Stat(state); err == nil {
		b.Fatalf("a request that names no GPU created the ledger %s", state)
	}
	led, err := ledger.OpenReadOnly(gpuState, ledger.Options{})
	if err != nil {
		b.Fatal(err)
	}
	if st, err := led.Snapshot(context.Background()); err != nil || len(st.Claims) != 0 || len(st.Waiters) != 0 {
		b.Fatalf("the GPU ledger is not empty after the pairs (every poststop releases): %d claims, %d waiters, %v",
			len(st.Claims), len(st.Waiters), err)
	}
}

func writeFile(b *testing.B, path, data string) {
	b.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		b.Fatal(err)
	}
}
