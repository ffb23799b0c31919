// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// TestStatusObserverTime: observer.time is the last accounting pass, and is
// omitted, not the zero time, when the report carries none (before the
// daemon's first pass, or under interval = 0); age_seconds then counts from
// when the report was written.
func TestStatusObserverTime(t *testing.T) {
	written := now.Add(-3 * time.Second)
	for _, tc := range []struct {
		name     string
		file     observe.File
		wantTime string // "" = omitted
		wantAge  float64
	}{
		{name: "a pass ran", file: observe.File{Time: now.Add(-4 * time.Second), WrittenAt: written, IntervalSeconds: 10},
			wantTime: "2026-03-01T11:59:56Z", wantAge: 4},
		{name: "before the first pass", file: observe.File{WrittenAt: written, IntervalSeconds: 10}, wantAge: 3},
		{name: "accounting off (interval 0)", file: observe.File{WrittenAt: written}, wantAge: 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			require.NoError(t, observe.WriteFile(f.dir, tc.file))
			r := f.run(t, "status", "-o", "json")
			require.Equal(t, ExitOK, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			var v struct {
				Observer map[string]any `json:"observer"`
			}
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
			require.NotNil(t, v.Observer, r.stdout)
			if tc.wantTime == "" {
				assert.NotContains(t, v.Observer, "time", "an unknown time is omitted, not zero")
			} else {
				assert.Equal(t, tc.wantTime, v.Observer["time"])
			}
			assert.InDelta(t, tc.wantAge, v.Observer["age_seconds"], 0.001)
		})
	}
}

// TestStatusObserverTimesAreUTC: the daemon writes observe.json in its
// host's zone; status -o json gives its times in UTC, as every other time
// it prints (docs/ctl-json.md). Before, seen_at, observer.time and
// unhealthy_since came out as "…+01:00".
func TestStatusObserverTimesAreUTC(t *testing.T) {
	cet := time.FixedZone("CET", 3600)
	seen := now.Add(-4 * time.Second).In(cet)
	f := newFixture(t)
	require.NoError(t, observe.WriteFile(f.dir, observe.File{Time: seen, WrittenAt: seen, IntervalSeconds: 10,
		Findings: []observe.FileFinding{{Finding: observe.Finding{Kind: observe.KindIntruder,
			Device: observe.Device{Index: "1", UUID: uuidGPU1}, PID: 7, Time: seen, Message: "pid 7 runs on GPU 1"}}},
		Unhealthy: []observe.Finding{{Kind: observe.KindUnhealthy, Device: observe.Device{Index: "3", UUID: uuidGPU3},
			Time: seen, Message: "GPU 3 reported critical Xid 79"}},
		Errors: []string{"GPU 2 (" + uuidGPU2 + "): list compute processes: ERROR_UNKNOWN"}}))
	r := f.run(t, "status", "-o", "json")
	require.Equal(t, ExitAttention, r.code, r.stderr)
	var v struct {
		Devices []struct {
			Index          string `json:"index"`
			UnhealthySince string `json:"unhealthy_since"`
		} `json:"devices"`
		Problems []struct {
			Kind   string `json:"kind"`
			SeenAt string `json:"seen_at"`
		} `json:"problems"`
		Observer struct {
			Time string `json:"time"`
		} `json:"observer"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	const want = "2026-03-01T11:59:56Z"
	assert.Equal(t, want, v.Observer.Time)
	require.NotEmpty(t, v.Problems)
	for _, p := range v.Problems {
		assert.Equal(t, want, p.SeenAt, p.Kind)
	}
	for _, d := range v.Devices {
		if d.Index == "3" {
			assert.Equal(t, want, d.UnhealthySince)
		}
	}
	assert.NotRegexp(t, `"\d{4}-\d\d-\d\dT[0-9:.]+[+-]\d\d:\d\d"`, r.stdout, "no time outside UTC")
}
