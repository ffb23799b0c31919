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
