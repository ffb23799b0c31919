// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/benchab"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

var (
	ctlBinOnce sync.Once
	ctlBin     string
	ctlBinErr  error
)

// buildCtl builds gpu-guard-ctl as `make build` does (no cgo, stripped).
func buildCtl(b *testing.B) string {
	ctlBinOnce.Do(func() {
		dir, err := os.MkdirTemp("", "ctlbin")
		if err != nil {
			ctlBinErr = err
			return
		}
		ctlBin = filepath.Join(dir, "gpu-guard-ctl")
		cmd := exec.Command("go", "build", "-tags", "nri_no_wasm", "-trimpath", "-ldflags=-s -w", "-o", ctlBin, "../../cmd/gpu-guard-ctl")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			ctlBinErr = fmt.Errorf("go build gpu-guard-ctl: %w\n%s", err, out)
			return
		}
		// Timed from a copy written in one pass, as a package installs it
		// (benchab.Installed).
		inst, err := os.MkdirTemp("", "ctlinst")
		if err == nil {
			ctlBin, err = benchab.Installed(ctlBin, inst)
		}
		ctlBinErr = err
	})
	if ctlBinErr != nil {
		b.Skip(ctlBinErr)
	}
	return ctlBin
}

// BenchmarkCtlProcess times whole gpu-guard-ctl processes (start, configuration,
// ledger read, output) on a host of 64 GPUs, 32 of them held, and 1,000 or
// 4,000 waiters, interleaved with `cat` of the ledger's files (every file of
// the state dir named ledger*, but the lock), the floor of any reader, and,
// when CTL_BASELINE names one, another build of gpu-guard-ctl. Run it with
// -benchtime=100x -count=3 (hack/bench-process.sh does).
func BenchmarkCtlProcess(b *testing.B) {
	bin := buildCtl(b)
	catBin, err := exec.LookPath("cat")
	if err != nil {
		b.Skip("needs cat: ", err)
	}
	for _, tc := range []struct {
		name    string
		waiters int
		args    []string
		shows   string // in the output when the ledger is read as written
	}{
		{"status-1k", 1000, []string{"status"}, "holder-31"},
		{"queue-json-1k", 1000, []string{"queue", "-o", "json"}, `"waiter-999"`},
		{"queue-json-4k", 4000, []string{"queue", "-o", "json"}, `"waiter-3999"`},
	} {
		b.Run(tc.name, func(b *testing.B) {
			f := newFixture(b)
			gpus := make([]devices.GPU, 64)
			for i := range gpus {
				gpus[i] = devices.GPU{Index: i, UUID: fmt.Sprintf("GPU-%08x-0000-4000-8000-000000000000", i), Minor: i, Model: "NVIDIA H100 80GB HBM3"}
			}
			inv, err := devices.NewInventory("static", gpus)
			require.NoError(b, err)
			devs := inv.Devices()
			// proc_root: fake GPUs, no driver tree to check the list against.
			cfg := "version = 1\n[ledger]\ndir = \"" + f.dir + "\"\n[devices]\nsource = \"static\"\nproc_root = \"" + b.TempDir() + "\"\n" + staticTOML(gpus)
			require.NoError(b, os.WriteFile(f.config, []byte(cfg), 0o600))
			// Written under this boot's id (not the fixture's): gpu-guard-ctl
			// shows the state of an earlier boot as empty, so it would
			// neither list the waiters nor render the holders.
			l, err := ledger.Open(f.dir, ledger.Options{})
			require.NoError(b, err)
			update := func(fn func(tx *ledger.Tx)) {
				require.NoError(b, l.Update(b.Context(), func(tx *ledger.Tx) error {
					fn(tx)
					return nil
				}))
			}
			update(func(tx *ledger.Tx) {
				for i := range 32 {
					o := owner(fmt.Sprintf("%064x", i+1), "ns", fmt.Sprintf("holder-%d", i), "main", ledger.FrontEndNRI)
					claim(b, tx, o, "env", devs[i])
				}
			})
			update(func(tx *ledger.Tx) {
				for i := range tc.waiters {
					o := owner(fmt.Sprintf("%064x", 10_000+i), "ns", fmt.Sprintf("waiter-%d", i), "main", ledger.FrontEndNRI)
					tx.Enqueue(key(o), o, []devices.Device{devs[i%32], devs[(i+1)%32]})
				}
			})
			var files []string
			var size int64
			entries, err := os.ReadDir(f.dir)
			require.NoError(b, err)
			for _, e := range entries {
				if strings.HasPrefix(e.Name(), "ledger") && !strings.HasSuffix(e.Name(), ".lock") && e.Type().IsRegular() {
					files = append(files, filepath.Join(f.dir, e.Name()))
					fi, err := e.Info()
					require.NoError(b, err)
					size += fi.Size()
				}
			}
			require.NotEmpty(b, files, "ledger files in %s", f.dir)
			b.ReportMetric(float64(size), "ledger-bytes")

			run := func(name string, args ...string) func() (time.Duration, error) {
				return func() (time.Duration, error) {
					cmd := exec.Command(name, args...)
					var stdout, stderr bytes.Buffer
					cmd.Stdout, cmd.Stderr = &stdout, &stderr
					start := time.Now()
					err := cmd.Run()
					d := time.Since(start)
					if err != nil {
						return 0, fmt.Errorf("%s: %w: %s", name, err, stderr.String())
					}
					if stdout.Len() == 0 {
						return 0, fmt.Errorf("%s printed nothing", name)
					}
					return d, nil
				}
			}
			out, err := exec.Command(bin, append([]string{"--config", f.config}, tc.args...)...).Output()
			require.NoError(b, err)
			require.Contains(b, string(out), tc.shows, "gpu-guard-ctl shows the ledger it is timed on")
			variants := []benchab.Variant{
				{Name: "cat", Run: run(catBin, files...)},
				{Name: "ctl", Run: run(bin, append([]string{"--config", f.config}, tc.args...)...)},
			}
			// CTL_BASELINE names another build of gpu-guard-ctl (an earlier
			// commit's) to time in the same rounds: a before/after on one
			// machine under one load.
			if base := os.Getenv("CTL_BASELINE"); base != "" {
				base, err := benchab.Installed(base, b.TempDir())
				if err != nil {
					b.Fatal(err)
				}
				variants = append(variants, benchab.Variant{Name: "baseline", Run: run(base, append([]string{"--config", f.config}, tc.args...)...)})
			}
			benchab.Run(b, variants)
		})
	}
}
