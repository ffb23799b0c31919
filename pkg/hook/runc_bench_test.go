// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/benchab"
)

// BenchmarkRuncHook measures `runc run` of a trivial container, interleaved
// in one run so that the ratios compare like with like: without hooks
// ("plain"), with the guard's hooks for a container naming no GPU ("nogpu"),
// with the hooks claiming and releasing a GPU ("gpu"), and two floors with
// both hooks replaced by a static Go program: one that only reads its stdin
// ("floorhooks", the floor of any hook) and one that also makes one durable
// commit each (flock, append a journal-sized record, fdatasync, unlock, in a
// state dir on the ledger's file system: "durablefloor", the floor of any
// hook that records a claim and its release durably). The guard's hooks run
// with the environment the shipped definitions give them (RuntimeEnv) and,
// as "-inherit", with runc's; the floors with runc's and, as "-1p", with
// RuntimeEnv. When HOOK_BASELINE names one, the nogpu and gpu cases run with
// another build of the hook too. Where a C compiler can link static
// programs, the two floors run as C programs as well ("cfloor",
// "cdurable", testdata/cfloor): no language runtime starts in them, so they
// are the floor of a hook written in any language, what runc's way of
// running a hook costs by itself. The one-hook configuration ([hook]
// poststop = false, the createRuntime hook alone) runs as "nogpu-1hook" and
// "gpu-1hook", beside "cfloor-1hook", one C floor process per container.
// The hook relay (cmd/nri-gpu-guard-hook-relay, what hooks.d names: a static
// C program that forwards each hook run to `nri-gpu-guard-hook serve`,
// started once for the whole benchmark) runs as "relay-nogpu" and
// "relay-gpu" (both hooks, the shipped shape) and "relay-nogpu-1hook" and
// "relay-gpu-1hook" (the createRuntime hook alone); its --relay-hook names
// no file, so a relay that fell back instead of being answered by the
// server would fail its container, and the benchmark. It reports the
// median and p99 of each and their ratios to plain, and the hook cases'
// ratios to their floors (both environments of the floor, and the C
// floors), and what each costs per container beyond plain, paired round by
// round ("-plain-ms"), and beyond its C floor and its Go hook for the
// relay ("relay-nogpu-cfloor-ms", "relay-gpu-gpu-ms", ...); run it with
// -benchtime=60x -count=3 (hack/bench-process.sh does).
func BenchmarkRuncHook(b *testing.B) {
	// The relay rig starts the server; the variants that name a hook
	// binary (hookBin) run it directly, as before.
	r := newRig(b, rigOpts{relay: true})
	r.relayBin = benchab.MustInstall(b, relayBin)
	noFallback := filepath.Join(r.base, "no-such-hook")
	floorBin := buildFloor(b, "readstdin")
	durableBin := buildFloor(b, "durablefloor")
	// Every hook program runs from a copy written in one pass, as a
	// package installs it (benchab.Installed).
	guardBin := benchab.MustInstall(b, hookBin)
	floorDir := filepath.Join(r.base, "floor") // same file system as the ledger
	oneHookCfg := oneHookConfig(b, r)
	i := 0
	variant := func(name string, o ctrOpts) benchab.Variant {
		return benchab.Variant{Name: name, Run: func() (time.Duration, error) {
			i++
			id := fmt.Sprintf("bench-%s-%d", name, i)
			bundle := r.bundle(id, o)
			defer func() { _ = os.RemoveAll(bundle) }()
			start := time.Now()
			out, err := exec.Command(runcBin, "--root", r.runcRoot, "run", "--bundle", bundle, id).CombinedOutput()
			d := time.Since(start)
			if err != nil {
				return 0, fmt.Errorf("runc run %s: %w: %s", id, err, out)
			}
			return d, nil
		}}
	}
	variants := []benchab.Variant{
		variant("plain", ctrOpts{mode: "exit", noHooks: true}),
		variant("nogpu", ctrOpts{mode: "exit", hookBin: guardBin}),
		variant("gpu", ctrOpts{mode: "exit", env: gpuEnv(0), hookBin: guardBin}),
		// The floors as a definition without "env" runs them (runc's own
		// environment), and under the environment the shipped definitions
		// give the guard's hooks (RuntimeEnv).
		variant("floorhooks", ctrOpts{mode: "exit", hookBin: floorBin, inheritEnv: true}),
		variant("durablefloor", ctrOpts{mode: "exit", hookBin: durableBin, hookArgs: []string{"--state-dir", floorDir}, inheritEnv: true}),
		variant("floorhooks-1p", ctrOpts{mode: "exit", hookBin: floorBin}),
		variant("durablefloor-1p", ctrOpts{mode: "exit", hookBin: durableBin, hookArgs: []string{"--state-dir", floorDir}}),
		// The guard's hooks without the shipped environment.
		variant("nogpu-inherit", ctrOpts{mode: "exit", hookBin: guardBin, inheritEnv: true}),
		// The createRuntime hook alone ([hook] poststop = false): the claim
		// of each gpu-1hook container ends when the next one's hook finds
		// it exited, in the transaction that admits it. GPU 1, so that
		// the two-hook rounds on GPU 0 never meet such a claim.
		variant("nogpu-1hook", ctrOpts{mode: "exit", hookBin: guardBin, noPoststop: true, cfgPath: oneHookCfg}),
		variant("gpu-1hook", ctrOpts{mode: "exit", env: gpuEnv(1), hookBin: guardBin, noPoststop: true, cfgPath: oneHookCfg}),
		variant("gpu-inherit", ctrOpts{mode: "exit", env: gpuEnv(0), hookBin: guardBin, inheritEnv: true}),
		// The relay, answered by the server. relay-gpu-1hook shares GPU 1
		// with gpu-1hook: each one's request ends the other's exited
		// claim, as two of its own would.
		variant("relay-nogpu", ctrOpts{mode: "exit", relayHook: noFallback}),
		variant("relay-gpu", ctrOpts{mode: "exit", env: gpuEnv(0), relayHook: noFallback}),
		variant("relay-nogpu-1hook", ctrOpts{mode: "exit", relayHook: noFallback, noPoststop: true, cfgPath: oneHookCfg}),
		variant("relay-gpu-1hook", ctrOpts{mode: "exit", env: gpuEnv(1), relayHook: noFallback, noPoststop: true, cfgPath: oneHookCfg}),
	}
	cFloor, cDurable := buildCFloor(b, "readstdin.c"), buildCFloor(b, "durable.c")
	if cFloor != "" && cDurable != "" {
		variants = append(variants,
			variant("cfloor", ctrOpts{mode: "exit", hookBin: cFloor, inheritEnv: true}),
			variant("cfloor-1hook", ctrOpts{mode: "exit", hookBin: cFloor, inheritEnv: true, noPoststop: true}),
			variant("cdurable", ctrOpts{mode: "exit", hookBin: cDurable, hookArgs: []string{"--state-dir", floorDir}, inheritEnv: true}))
	}
	// HOOK_BASELINE names another build of the hook binary (an earlier
	// commit's) to run as the hooks in the same rounds: a before/after.
	base := os.Getenv("HOOK_BASELINE")
	if base != "" {
		base = benchab.MustInstall(b, base)
		// The baseline claims in a ledger of its own: on a shared one,
		// whichever build compacts sooner would pay every compaction and
		// hand the other the shorter journal.
		baseCfg := r.cfg
		baseCfg.Ledger.Dir = filepath.Join(r.base, "ledger-base")
		baseCfgPath := r.writeConfig("config-base.toml", baseCfg)
		variants = append(variants,
			variant("base-nogpu", ctrOpts{mode: "exit", hookBin: base, cfgPath: baseCfgPath}),
			variant("base-gpu", ctrOpts{mode: "exit", env: gpuEnv(0), hookBin: base, cfgPath: baseCfgPath}))
	}
	samples := benchab.Run(b, variants)
	samples.ReportRatio(b, "gpu", "durablefloor")
	samples.ReportRatio(b, "nogpu", "floorhooks")
	samples.ReportRatio(b, "gpu", "durablefloor-1p")
	samples.ReportRatio(b, "nogpu", "floorhooks-1p")
	samples.ReportRatio(b, "nogpu", "cfloor")
	samples.ReportRatio(b, "gpu", "cdurable")
	if cFloor != "" {
		samples.ReportRatio(b, "nogpu-1hook", "cfloor-1hook")
		samples.ReportRatio(b, "relay-nogpu", "cfloor")
		samples.ReportRatio(b, "relay-nogpu-1hook", "cfloor-1hook")
	}
	if base != "" {
		samples.ReportRatio(b, "base-gpu", "durablefloor")
	}
	// What each costs per container beyond plain `runc run`, paired round
	// by round (benchab.ReportDiff): the figure that does not move with
	// how fast `runc run` is on the day.
	for _, v := range []string{"nogpu", "gpu", "nogpu-1hook", "gpu-1hook", "floorhooks", "durablefloor", "cfloor", "cfloor-1hook", "cdurable",
		"relay-nogpu", "relay-gpu", "relay-nogpu-1hook", "relay-gpu-1hook", "base-nogpu", "base-gpu"} {
		samples.ReportDiff(b, v, "plain")
	}
	samples.ReportDiff(b, "nogpu-1hook", "cfloor-1hook")
	samples.ReportDiff(b, "relay-nogpu-1hook", "cfloor-1hook")
	samples.ReportDiff(b, "relay-nogpu", "cfloor")
	// What the relay saves over the Go hook, container for container.
	for _, v := range []string{"nogpu", "gpu", "nogpu-1hook", "gpu-1hook"} {
		samples.ReportDiff(b, "relay-"+v, v)
	}
	// Left: at most the last gpu-1hook or relay-gpu-1hook container's
	// claim, which no poststop ended and no later request found exited.
	st := r.state()
	for _, c := range st.Claims {
		id := c.Owner.ContainerID
		if c.Device.UUID != gpuUUIDs[1] || !strings.HasPrefix(id, "bench-gpu-1hook-") && !strings.HasPrefix(id, "bench-relay-gpu-1hook-") {
			b.Fatalf("claim of %s on %s left after the runs", c.Owner.ContainerID, c.Device.UUID)
		}
	}
	if len(st.Claims) > 1 || len(st.Waiters) != 0 {
		b.Fatalf("the ledger is not empty after the runs: %d claims, %d waiters", len(st.Claims), len(st.Waiters))
	}
	if fi, err := os.Stat(filepath.Join(floorDir, "floor.journal")); err != nil || fi.Size() == 0 {
		b.Fatalf("the durable floor wrote no record (%v)", err)
	}
	if cDurable != "" {
		if fi, err := os.Stat(filepath.Join(floorDir, "cfloor.journal")); err != nil || fi.Size() == 0 {
			b.Fatalf("the C durable floor wrote no record (%v)", err)
		}
	}
}

// oneHookConfig writes the rig's configuration with [hook] poststop = false
// (the createRuntime hook alone) and returns its path.
func oneHookConfig(b *testing.B, r *rig) string {
	b.Helper()
	data, err := os.ReadFile(r.cfgPath)
	if err != nil {
		b.Fatal(err)
	}
	text := strings.Replace(string(data), "[hook]\n", "[hook]\npoststop = false\n", 1)
	if text == string(data) {
		b.Fatalf("no [hook] table in %s", r.cfgPath)
	}
	path := filepath.Join(r.base, "config-1hook.toml")
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		b.Fatal(err)
	}
	return path
}

// buildCFloor builds one of the C floor programs of
// cmd/nri-gpu-guard-hook/testdata/cfloor as a static binary, or returns ""
// (and says why) where no C compiler or no static C library is installed:
// the C floors are a reference, not what the benchmark measures.
func buildCFloor(b *testing.B, src string) string {
	b.Helper()
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	bin := filepath.Join(b.TempDir(), strings.TrimSuffix(src, ".c"))
	out, err := exec.Command(cc, "-O2", "-static", "-o", bin, "../../cmd/nri-gpu-guard-hook/testdata/cfloor/"+src).CombinedOutput()
	if err != nil {
		b.Logf("no C floor %s (%s -static: %v): %s", src, cc, err, out)
		return ""
	}
	return benchab.MustInstall(b, bin)
}

// buildFloor builds one of the floor programs of cmd/nri-gpu-guard-hook's
// testdata as the release builds the hook: static, -trimpath, stripped.
func buildFloor(b *testing.B, name string) string {
	b.Helper()
	bin := filepath.Join(b.TempDir(), name)
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, "../../cmd/nri-gpu-guard-hook/testdata/"+name)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("go build %s: %v\n%s", name, err, out)
	}
	return benchab.MustInstall(b, bin)
}
