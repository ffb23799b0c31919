// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package ctl

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// TestPSUnobservedDevices: a device NVML cannot list the processes of was not
// checked, and ps says so as a problem (kind unobserved, exit 3) naming its
// index, UUID and the error, as it exits 3 for a lost one (unhealthy, and
// that problem only). Before, ps showed "error: …" rows and exited 0 when
// NVML failed on every device: a check on its exit code read "no intruder"
// while nothing was looked at.
func TestPSUnobservedDevices(t *testing.T) {
	for _, tc := range []struct {
		name string
		fail map[int]nvml.Return // mock device → what listing its processes returns
		code int
		// kinds counts the problems by kind.
		kinds map[string]int
	}{
		{name: "every device listed", code: ExitOK, kinds: map[string]int{}},
		{name: "one device", code: ExitAttention, fail: map[int]nvml.Return{3: nvml.ERROR_UNKNOWN},
			kinds: map[string]int{"unobserved": 1}},
		{name: "every device", code: ExitAttention,
			fail: map[int]nvml.Return{0: nvml.ERROR_UNKNOWN, 1: nvml.ERROR_UNKNOWN, 2: nvml.ERROR_UNKNOWN, 3: nvml.ERROR_UNKNOWN,
				4: nvml.ERROR_UNKNOWN, 5: nvml.ERROR_UNKNOWN, 6: nvml.ERROR_UNKNOWN, 7: nvml.ERROR_UNKNOWN},
			kinds: map[string]int{"unobserved": 8}},
		{name: "a lost device is unhealthy only", code: ExitAttention,
			fail:  map[int]nvml.Return{2: nvml.ERROR_GPU_IS_LOST, 5: nvml.ERROR_UNKNOWN},
			kinds: map[string]int{"unhealthy": 1, "unobserved": 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			h := newPSHost(t, f)
			holder := h.srv.Devices[0].(*server.Device).UUID
			f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
				claim(t, tx, ownTrainer, "env", f.dev(t, holder))
			})
			for i, ret := range tc.fail {
				h.srv.Devices[i].(*server.Device).GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) {
					return nil, ret
				}
			}
			r := f.runPS(t, h, "-o", "json")
			require.Equal(t, tc.code, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			var v psView
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
			kinds := map[string]int{}
			for _, p := range v.Problems {
				kinds[p.Kind]++
				if p.Kind != "unobserved" {
					continue
				}
				i, found := 0, false
				for i = range h.srv.Devices {
					if found = h.srv.Devices[i].(*server.Device).UUID == p.Device; found {
						break
					}
				}
				require.True(t, found, "the problem names a device of the host: %+v", p)
				assert.Equal(t, nvml.ERROR_UNKNOWN, tc.fail[i], "only a device NVML could not list: %+v", p)
				assert.Equal(t, f.dev(t, p.Device).Index, p.Index)
				held := ""
				if p.Device == holder {
					held = ", held by team-a/trainer-0/main (a1a1a1a1a1a1),"
				}
				assert.Contains(t, p.Message, "GPU "+p.Index+" ("+p.Device+")"+held+" was not checked: NVML could not list its processes (list compute processes: ERROR_UNKNOWN)")
			}
			assert.Equal(t, tc.kinds, kinds)

			r = f.runPS(t, h)
			require.Equal(t, tc.code, r.code)
			for _, p := range v.Problems {
				assert.Contains(t, r.stdout, p.Message, "in the table's ATTENTION list")
			}
		})
	}
}

// TestPSRefusesADirWithoutLedger: against a --state-dir that holds no
// ledger, every process would be judged an intruder of free GPUs; ps
// refuses it as the other read commands do.
func TestPSRefusesADirWithoutLedger(t *testing.T) {
	f := newFixture(t)
	h := newPSHost(t, f)
	empty := filepath.Join(filepath.Dir(f.dir), "not-the-ledger")
	require.NoError(t, os.Mkdir(empty, 0o700))
	r := f.runPS(t, h, "--state-dir", empty)
	require.Equal(t, ExitError, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	assert.Empty(t, r.stdout)
	assert.Contains(t, r.stderr, "error: --state-dir "+empty+": no ledger here")
}

// TestPSTimeIsUTC: ps's time comes from the host's clock, in its zone; the
// JSON gives it in UTC, as every time ctl prints (docs/ctl-json.md).
func TestPSTimeIsUTC(t *testing.T) {
	at := now.In(time.FixedZone("CET", 3600))
	v := buildPS(observe.Report{Time: at}, &ledger.State{}, nil)
	b, err := json.Marshal(v)
	require.NoError(t, err)
	assert.True(t, strings.HasPrefix(string(b), `{"time":"2026-03-01T12:00:00Z",`), string(b))
}
