// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// TestStatusStaleIncarnations: status reports a claim as stale exactly when
// gc would act on it: per incarnation (two containers of one id in two
// runtime roots are two holders, whichever is listed first), and under
// release_requires_idle too, where gc marks the claim draining instead of
// releasing it. status exits 3 exactly when gc --dry-run lists something.
func TestStatusStaleIncarnations(t *testing.T) {
	dead := ledger.Owner{ContainerID: "train", FrontEnd: ledger.FrontEndHook, Pid: 100, PidStart: 1, Cgroup: "/a/train", StartedAt: now.Add(-time.Hour)}
	alive := ledger.Owner{ContainerID: "train", FrontEnd: ledger.FrontEndHook, Pid: 200, PidStart: 2, Cgroup: "/b/train", StartedAt: now.Add(-time.Hour)}
	for _, tc := range []struct {
		name              string
		deadGPU, aliveGPU string
		exited            pidsExited
		drain             bool              // release_requires_idle
		stale             map[string]string // device UUID -> stale
		wantInMessage     string            // in every holder-exited problem
	}{
		{
			name: "exited incarnation listed second", deadGPU: uuidGPU2, aliveGPU: uuidGPU1,
			exited: pidsExited{100: "pid 100 gone"},
			stale:  map[string]string{uuidGPU2: "pid 100 gone"}, wantInMessage: "release it with `sudo gpu-guard-ctl gc`",
		},
		{
			name: "exited incarnation listed first", deadGPU: uuidGPU1, aliveGPU: uuidGPU2,
			exited: pidsExited{100: "pid 100 gone"},
			stale:  map[string]string{uuidGPU1: "pid 100 gone"}, wantInMessage: "release it with `sudo gpu-guard-ctl gc`",
		},
		{
			name: "both exited, each with its finding", deadGPU: uuidGPU1, aliveGPU: uuidGPU2,
			exited: pidsExited{100: "pid 100 gone", 200: "pid 200 gone"},
			stale:  map[string]string{uuidGPU1: "pid 100 gone", uuidGPU2: "pid 200 gone"},
		},
		{
			name: "none exited", deadGPU: uuidGPU1, aliveGPU: uuidGPU2,
			exited: pidsExited{},
			stale:  map[string]string{},
		},
		{
			name: "release_requires_idle: the exited one is stale, gc marks it draining", deadGPU: uuidGPU2, aliveGPU: uuidGPU1,
			exited: pidsExited{100: "pid 100 gone"}, drain: true,
			stale:         map[string]string{uuidGPU2: "pid 100 gone"},
			wantInMessage: "run `sudo gpu-guard-ctl gc` to mark its claim draining",
		},
		{
			name: "release_requires_idle: both exited", deadGPU: uuidGPU1, aliveGPU: uuidGPU2,
			exited: pidsExited{100: "pid 100 gone", 200: "pid 200 gone"}, drain: true,
			stale:         map[string]string{uuidGPU1: "pid 100 gone", uuidGPU2: "pid 200 gone"},
			wantInMessage: "to mark its claim draining",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			if tc.drain {
				appendConfig(t, f, "[observe]\nrelease_requires_idle = true\nidle_grace = \"10m\"\n")
			}
			f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
				claim(t, tx, dead, "env", f.dev(t, tc.deadGPU))
				claim(t, tx, alive, "env", f.dev(t, tc.aliveGPU))
			})

			r := runLive(f, tc.exited, "status", "-o", "json")
			wantCode := ExitOK
			if len(tc.stale) > 0 {
				wantCode = ExitAttention
			}
			require.Equal(t, wantCode, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			var v statusView
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
			stale := map[string]string{}
			for _, d := range v.Devices {
				if d.Stale != "" {
					stale[d.UUID] = d.Stale
				}
			}
			assert.Equal(t, tc.stale, stale, "stale devices")
			exited := map[string]bool{}
			for _, p := range v.Problems {
				require.Equal(t, problemHolderExited, p.Kind, p.Message)
				exited[p.Device] = true
				assert.Equal(t, "train", p.ContainerID)
				assert.Contains(t, p.Message, tc.stale[p.Device], "the problem gives its own incarnation's finding")
				assert.Contains(t, p.Message, tc.wantInMessage)
			}
			assert.Len(t, exited, len(tc.stale), "one holder-exited problem per stale claim: %v", v.Problems)

			// gc --dry-run lists exactly the stale claims, released or
			// kept draining.
			r = runLive(f, tc.exited, "gc", "--dry-run", "-o", "json")
			require.Equal(t, ExitOK, r.code, r.stderr)
			var gv releasedView
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &gv))
			listed := map[string]string{}
			for _, c := range append(gv.Released, gv.Draining...) {
				listed[c.Device] = c.Why
			}
			assert.Len(t, listed, len(tc.stale), "gc --dry-run: %s", r.stdout)
			for dev := range tc.stale {
				assert.Contains(t, listed, dev, "gc --dry-run lists what status calls stale")
			}
			if tc.drain {
				assert.Empty(t, gv.Released, "release_requires_idle: gc releases nothing")
			}
		})
	}
}
