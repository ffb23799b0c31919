// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// dirFiles reads every file of dir, by name.
func dirFiles(t testing.TB, dir string) map[string]string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	out := map[string]string{}
	for _, e := range entries {
		if !e.Type().IsRegular() {
			continue
		}
		data, err := os.ReadFile(filepath.Join(dir, e.Name()))
		require.NoError(t, err)
		out[e.Name()] = string(data)
	}
	return out
}

// runWithoutNVML runs gpu-guard-ctl as a process without NVML (the static
// release binary): handover stands in for ExecCompanion and sees what the
// process had printed and written when it was called.
func (f *fixture) runWithoutNVML(t *testing.T, handover func(why string, stdout, stderr *syncBuffer) error, args ...string) result {
	t.Helper()
	var stdout, stderr syncBuffer
	env := f.env(&stdout, &stderr)
	env.NeedNVML = func(why string) error { return handover(why, &stdout, &stderr) }
	code := Run(context.Background(), append([]string{"--config", f.config}, args...), env)
	return result{code: code, stdout: stdout.String(), stderr: stderr.String()}
}

// TestNeedNVMLHandsOverBeforeAnything: a gpu-guard-ctl without NVML hands
// every command that needs NVML over at the point it would initialise NVML,
// and by then has printed nothing and changed nothing, so that the process
// that replaces it runs the command from the start. When the handover fails,
// the command fails with that error: nothing stands in for NVML (no /proc
// discovery under "auto", no claimed-devices-only status).
func TestNeedNVMLHandsOverBeforeAnything(t *testing.T) {
	errRefused := errors.New("handover refused by the test")
	for _, tc := range []struct {
		name   string
		source string
		cache  bool // the daemon's inventory cache is there
		args   []string
		why    string
	}{
		{"ps", "auto", true, []string{"ps"}, "ps (the processes on the GPUs)"},
		{"ps json", "static", true, []string{"ps", "-o", "json"}, "ps (the processes on the GPUs)"},
		{"status, auto, no cache", "auto", false, []string{"status"}, `GPU discovery (devices.source = "auto")`},
		{"status json, nvml, no cache", "nvml", false, []string{"status", "-o", "json"}, `GPU discovery (devices.source = "nvml")`},
		{"devices, auto, no cache", "auto", false, []string{"devices"}, `GPU discovery (devices.source = "auto")`},
		{"devices --refresh, auto", "auto", true, []string{"devices", "--refresh"}, `GPU discovery (devices.source = "auto")`},
		{"devices --refresh, nvml", "nvml", true, []string{"devices", "--refresh"}, `GPU discovery (devices.source = "nvml")`},
		{"explain, nvml, no cache", "nvml", false, []string{"explain", "--env", "NVIDIA_VISIBLE_DEVICES=1"}, `GPU discovery (devices.source = "nvml")`},
		{"cordon, auto, no cache", "auto", false, []string{"cordon", "1", "--reason", "fan"}, `GPU discovery (devices.source = "auto")`},
		{"uncordon, nvml, no cache", "nvml", false, []string{"uncordon", "1"}, `GPU discovery (devices.source = "nvml")`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := nvmlFixture(t, tc.source, tc.cache)
			before := dirFiles(t, f.dir)
			var whys []string
			r := f.runWithoutNVML(t, func(why string, stdout, stderr *syncBuffer) error {
				whys = append(whys, why)
				assert.Empty(t, stdout.String(), "printed before the handover")
				assert.Empty(t, stderr.String(), "printed before the handover")
				assert.Equal(t, before, dirFiles(t, f.dir), "state dir changed before the handover")
				return errRefused
			}, tc.args...)
			assert.Equal(t, []string{tc.why}, whys, "handed over once, for NVML")
			require.Equal(t, ExitError, r.code, r.stderr)
			assert.Empty(t, r.stdout)
			assert.Regexp(t, `^error: (load the GPU inventory: )?`+regexp.QuoteMeta(tc.why+" needs NVML: "+errRefused.Error())+"\n$", r.stderr)
			assert.Equal(t, before, dirFiles(t, f.dir), "state dir changed after a failed handover")
		})
	}
}

// TestNeedNVMLOnlyForNVML: without NVML, every command that does not need it
// (a trusted cache, devices.source "static" or "proc", the ledger alone) runs
// in the process itself, with the same output as with NVML.
func TestNeedNVMLOnlyForNVML(t *testing.T) {
	for _, tc := range []struct {
		name   string
		source string
		cache  bool
		args   []string
	}{
		{"status, auto, cache", "auto", true, []string{"status", "-o", "json"}},
		{"status, static, no cache", "static", false, []string{"status"}},
		{"status, proc, no cache", "proc", false, []string{"status"}},
		{"devices, nvml, cache", "nvml", true, []string{"devices"}},
		{"devices --refresh, static", "static", true, []string{"devices", "--refresh"}},
		{"queue, nvml, no cache", "nvml", false, []string{"queue", "-o", "json"}},
		{"claims, nvml, no cache", "nvml", false, []string{"claims"}},
		{"explain, auto, cache", "auto", true, []string{"explain", "--env", "NVIDIA_VISIBLE_DEVICES=1"}},
		{"check-config", "nvml", false, []string{"check-config"}},
		{"version", "nvml", false, []string{"version"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := nvmlFixture(t, tc.source, tc.cache)
			want := f.run(t, tc.args...)
			if tc.args[0] == "devices" && len(tc.args) > 1 {
				// The refresh rewrote the cache: run the same again.
				want = f.run(t, tc.args...)
			}
			got := f.runWithoutNVML(t, func(why string, _, _ *syncBuffer) error {
				t.Errorf("handed over for %s", why)
				return errors.New("unexpected handover")
			}, tc.args...)
			assert.Equal(t, want, got)
		})
	}
}

// TestInterruptsOnlyWhereACommandWaitsOrWrites: a command that waits or
// changes the ledger runs under the context Env.Interrupts gives (canceled
// here, as by Ctrl-C: the command stops); a read that renders once never asks
// for it (no signal handling to set up) and runs to the end.
func TestInterruptsOnlyWhereACommandWaitsOrWrites(t *testing.T) {
	for _, tc := range []struct {
		args       []string
		interrupts bool
	}{
		{[]string{"status"}, false},
		{[]string{"queue", "-o", "json"}, false},
		{[]string{"claims"}, false},
		{[]string{"explain", "--env", "NVIDIA_VISIBLE_DEVICES=1"}, false},
		{[]string{"version"}, false},
		{[]string{"gc"}, true},
		{[]string{"release", "--container", idStale, "--reason", "stuck"}, true},
		{[]string{"cordon", "1", "--reason", "fan"}, true},
		{[]string{"audit", "--follow"}, true},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			f := newFixture(t)
			f.populate(t)
			before := dirFiles(t, f.dir)
			var stdout, stderr syncBuffer
			env := f.env(&stdout, &stderr)
			calls, stopped := 0, 0
			env.Interrupts = func(ctx context.Context) (context.Context, context.CancelFunc) {
				calls++
				ctx, cancel := context.WithCancel(ctx)
				cancel() // the operator pressed Ctrl-C at once
				return ctx, func() { stopped++ }
			}
			code := Run(context.Background(), append([]string{"--config", f.config}, tc.args...), env)
			if !tc.interrupts {
				assert.Zero(t, calls)
				assert.Contains(t, []int{ExitOK, ExitAttention}, code, stderr.String())
				assert.NotEmpty(t, stdout.String())
				return
			}
			assert.Equal(t, 1, calls)
			assert.Equal(t, 1, stopped, "signal handling stopped when the command ended")
			if tc.args[0] == "audit" {
				assert.Equal(t, ExitOK, code, stderr.String()) // --follow ends cleanly
				return
			}
			assert.Equal(t, ExitError, code)
			assert.Contains(t, stderr.String(), context.Canceled.Error())
			assert.Equal(t, before, dirFiles(t, f.dir), "an interrupted command changed the state dir")
		})
	}
}

// nvmlFixture is a populated fixture under devices.source source, with the
// daemon's inventory cache or without it.
func nvmlFixture(t *testing.T, source string, cache bool) *fixture {
	t.Helper()
	f := newFixture(t)
	f.populate(t)
	if source != "auto" {
		f.setSource(t, source)
	}
	if !cache {
		require.NoError(t, os.Remove(filepath.Join(f.dir, devices.CacheFile)))
	}
	return f
}
