// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
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

// TestStatusShowsUnobservedDevices: a device whose processes the observer's
// last pass could not list (observe.json "unlisted", and "errors" as text)
// was not checked, and that is a problem (kind unobserved, exit 3), named
// in the table's ATTENTION list with its index, UUID, holder and the error:
// a pass that fails on every device still completes, so the report stays
// fresh, and before, status exited 0 with the errors in its JSON only,
// which a check on exit codes read as "no intruder". A device the report
// calls unhealthy (a lost GPU, and so its MIG instances) is that problem
// only. A device is matched to its row by UUID; in the file of an older
// daemon, which has the errors as text only, by the observer's label. Before
// "unlisted", a device the daemon numbered otherwise than the inventory
// status reads matched no row.
func TestStatusShowsUnobservedDevices(t *testing.T) {
	seen := now.Add(-4 * time.Second)
	const listErr = "list compute processes: ERROR_UNKNOWN"
	dev := func(i, uuid, parent string) observe.UnlistedDevice {
		return observe.UnlistedDevice{Device: observe.Device{Index: i, UUID: uuid, ParentUUID: parent}, Error: listErr}
	}
	lost := observe.Finding{Kind: observe.KindUnhealthy, Device: observe.Device{Index: "0", UUID: uuidGPU0}, Time: seen,
		Message: "GPU 0 (" + uuidGPU0 + ") is unhealthy: it is lost (fallen off the bus?): ERROR_GPU_IS_LOST"}
	lostErr := dev("0", uuidGPU0, "")
	lostErr.Error = "it is lost (fallen off the bus?): ERROR_GPU_IS_LOST"
	const gpu9 = "GPU-99999999-0000-4000-8000-000000000009"
	for _, tc := range []struct {
		name      string
		unlisted  []observe.UnlistedDevice
		unhealthy []observe.Finding
		want      map[string]string // index → what its problem says; "?" for a device matching no row
		// wantText is want for the file of an older daemon, where it differs.
		wantText map[string]string
		code     int
	}{
		{name: "no error", code: ExitOK},
		{name: "every device", code: ExitAttention,
			unlisted: []observe.UnlistedDevice{dev("0", uuidGPU0, ""), dev("1", uuidGPU1, ""), dev("2", uuidGPU2, ""), dev("3", uuidGPU3, "")},
			want: map[string]string{
				"0": "GPU 0 (" + uuidGPU0 + ") was not checked: the GPU observer could not list its processes in its last pass, 4s ago (list compute processes: ERROR_UNKNOWN)",
				"1": "GPU 1 (" + uuidGPU1 + "), held by team-a/trainer-0/main (a1a1a1a1a1a1), was not checked",
				"2": "GPU 2 (" + uuidGPU2 + ") was not checked", "3": "GPU 3 (" + uuidGPU3 + ") was not checked"}},
		{name: "a MIG instance", code: ExitAttention,
			unlisted: []observe.UnlistedDevice{dev("0:1", uuidMIG1, uuidGPU0)},
			want:     map[string]string{"0:1": "MIG 0:1 (" + uuidMIG1 + ") was not checked"}},
		{name: "a device the inventory does not list", code: ExitAttention,
			unlisted: []observe.UnlistedDevice{dev("9", gpu9, "")},
			want:     map[string]string{"?": "a device was not checked: the GPU observer could not list its processes in its last pass, 4s ago (GPU 9 (" + gpu9 + "): list compute processes: ERROR_UNKNOWN)"}},
		{name: "a device the daemon numbers otherwise", code: ExitAttention,
			unlisted: []observe.UnlistedDevice{dev("7", uuidGPU1, "")},
			want:     map[string]string{"1": "GPU 1 (" + uuidGPU1 + "), held by team-a/trainer-0/main (a1a1a1a1a1a1), was not checked: the GPU observer could not list its processes in its last pass, 4s ago (list compute processes: ERROR_UNKNOWN)"},
			wantText: map[string]string{"?": "a device was not checked: the GPU observer could not list its processes in its last pass, 4s ago (GPU 7 (" + uuidGPU1 + "): list compute processes: ERROR_UNKNOWN)"}},
		{name: "a lost GPU and its instances are unhealthy only", code: ExitAttention,
			unlisted:  []observe.UnlistedDevice{lostErr, dev("0:0", uuidMIG0, uuidGPU0), dev("2", uuidGPU2, "")},
			unhealthy: []observe.Finding{lost},
			want:      map[string]string{"2": "GPU 2 (" + uuidGPU2 + ") was not checked"}},
	} {
		for _, older := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/older daemon=%v", tc.name, older), func(t *testing.T) {
				f := newFixture(t)
				f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
					claim(t, tx, ownTrainer, "env", f.dev(t, uuidGPU1))
				})
				file := observe.File{Time: seen, WrittenAt: seen, IntervalSeconds: 10, Unhealthy: tc.unhealthy}
				for _, u := range tc.unlisted {
					file.Errors = append(file.Errors, u.String())
				}
				want := tc.want
				if older {
					if tc.wantText != nil {
						want = tc.wantText
					}
				} else {
					file.Unlisted = tc.unlisted
				}
				require.NoError(t, observe.WriteFile(f.dir, file))
				out := statusJSON(t, f, tc.code)
				got := map[string]string{}
				for _, p := range out.Problems {
					if p.Kind != "unobserved" {
						assert.Equal(t, "unhealthy", p.Kind, "the only other problem: %+v", p)
						continue
					}
					require.NotNil(t, p.SeenAt)
					assert.True(t, p.SeenAt.Equal(seen))
					index := p.Index
					if index == "" {
						index = "?"
						assert.Empty(t, p.Device)
					} else {
						assert.Equal(t, f.dev(t, p.Device).Index, index, "device and index agree")
					}
					assert.NotContains(t, got, index, "one problem per device")
					got[index] = p.Message
				}
				require.Len(t, got, len(want), "%v", got)
				for index, w := range want {
					assert.Contains(t, got[index], w, "device %s", index)
					assert.Contains(t, got[index], "`sudo gpu-guard-ctl ps` asks NVML now")
				}

				r := f.run(t, "status")
				require.Equal(t, tc.code, r.code, r.stdout)
				for _, w := range want {
					assert.Contains(t, r.stdout, w, "in the table's ATTENTION list")
				}
			})
		}
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
