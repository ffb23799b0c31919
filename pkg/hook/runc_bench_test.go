// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/benchab"
)

// BenchmarkRuncHook measures `runc run` of a trivial container, interleaved
// in one run so that the ratios compare like with like: without hooks
// ("plain"), with the guard's hooks for a container naming no GPU ("nogpu"),
// with the hooks claiming and releasing a GPU ("gpu"), and, as the floor of
// any hook, with both hooks replaced by a static Go program that only reads
// its stdin ("floorhooks"), and, when HOOK_BASELINE names one, the same
// two cases with another build of the hook. It reports the median and p99
// of each and their ratios to plain; run it with -benchtime=200x -count=3
// (hack/bench-process.sh does).
func BenchmarkRuncHook(b *testing.B) {
	r := newRig(b, rigOpts{})
	floorBin := filepath.Join(b.TempDir(), "readstdin")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", floorBin, "../../cmd/nri-gpu-guard-hook/testdata/readstdin")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("go build readstdin: %v\n%s", err, out)
	}
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
		variant("nogpu", ctrOpts{mode: "exit"}),
		variant("gpu", ctrOpts{mode: "exit", env: gpuEnv(0)}),
		variant("floorhooks", ctrOpts{mode: "exit", hookBin: floorBin}),
	}
	// HOOK_BASELINE names another build of the hook binary (an earlier
	// commit's) to run as the hooks in the same rounds: a before/after.
	if base := os.Getenv("HOOK_BASELINE"); base != "" {
		variants = append(variants,
			variant("base-nogpu", ctrOpts{mode: "exit", hookBin: base}),
			variant("base-gpu", ctrOpts{mode: "exit", env: gpuEnv(0), hookBin: base}))
	}
	benchab.Run(b, variants)
	if st := r.state(); len(st.Claims) != 0 || len(st.Waiters) != 0 {
		b.Fatalf("the ledger is not empty after the runs: %d claims, %d waiters", len(st.Claims), len(st.Waiters))
	}
}
