// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// drainGrace is the fixture's [observe] idle_grace.
const drainGrace = 10 * time.Minute

// uuidGoneMIG is a MIG instance cordoned by an operator that is no longer in
// the inventory (its GPU's layout changed).
const uuidGoneMIG = "MIG-dead0000-0000-4000-8000-00000000d000"

// updateDraining is fixture.update with the configured idle_grace, so that
// the ledger keeps draining claims as the daemon does.
func (f *fixture) updateDraining(t testing.TB, at time.Time, fn func(tx *ledger.Tx)) {
	t.Helper()
	f.clock = at
	opts := f.ledgerOpts(0)
	opts.DrainGrace = drainGrace
	l, err := ledger.Open(f.dir, opts)
	require.NoError(t, err)
	require.NoError(t, l.Update(context.Background(), func(tx *ledger.Tx) error {
		fn(tx)
		return nil
	}))
	f.clock = now
}

func cordon(t testing.TB, tx *ledger.Tx, d devices.Device, source, reason, by string) {
	t.Helper()
	_, _, err := tx.Cordon(d, source, reason, by)
	require.NoError(t, err)
}

// newCordonDrainFixture: under release_requires_idle, with
//   - GPU 0: MIG 0:1 held by the hook container and cordoned unhealthy (so
//     GPU 0 is cordoned through it, MIG 0:0 is free);
//   - GPU 1: held by the trainer and cordoned by an operator;
//   - GPU 2: draining (team-c/batch/job stopped 4 minutes ago);
//   - GPU 3: cordoned intruder, free;
//   - a MIG instance no longer in the inventory, cordoned by an operator.
func newCordonDrainFixture(t *testing.T) *fixture {
	t.Helper()
	f := newFixture(t)
	appendConfig(t, f, "[observe]\nrelease_requires_idle = true\nidle_grace = \"10m\"\n")
	gone := devices.Device{UUID: uuidGoneMIG, Index: "5:0", Kind: devices.KindMIG, Parent: "GPU-dead0000-0000-4000-8000-00000000000d"}
	f.updateDraining(t, now.Add(-2*time.Hour), func(tx *ledger.Tx) {
		claim(t, tx, ownTrainer, `env NVIDIA_VISIBLE_DEVICES="1"`, f.dev(t, uuidGPU1))
		claim(t, tx, ownHook, `annotation cdi.k8s.io/gpu="nvidia.com/mig=0:1"`, f.dev(t, uuidMIG1))
		claim(t, tx, ownStale, `env NVIDIA_VISIBLE_DEVICES="2"`, f.dev(t, uuidGPU2))
		cordon(t, tx, gone, ledger.CordonOperator, "MIG layout change", "uid 0 via gpu-guard-ctl")
	})
	f.updateDraining(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
		cordon(t, tx, f.dev(t, uuidGPU1), ledger.CordonOperator, "ECC errors, RMA 4711", "uid 0 (sudo user alice) via gpu-guard-ctl")
		cordon(t, tx, f.dev(t, uuidGPU3), ledger.CordonIntruder, "pid 4242 (host process) not admitted by the guard", "nri-gpu-guard observer")
	})
	f.updateDraining(t, now.Add(-10*time.Minute), func(tx *ledger.Tx) {
		cordon(t, tx, f.dev(t, uuidMIG1), ledger.CordonUnhealthy, "critical Xid 79", "nri-gpu-guard observer")
	})
	f.updateDraining(t, now.Add(-4*time.Minute), func(tx *ledger.Tx) {
		require.Len(t, tx.MarkDraining(idStale, "stopped"), 1)
	})
	return f
}

// statusOut is status -o json as a script reads it.
type statusOut struct {
	Devices []struct {
		Index       string `json:"index"`
		UUID        string `json:"uuid"`
		Kind        string `json:"kind"`
		State       string `json:"state"`
		HeldVia     string `json:"held_via"`
		InInventory bool   `json:"in_inventory"`
		Holder      *struct {
			ContainerID   string     `json:"container_id"`
			Namespace     string     `json:"namespace"`
			Pod           string     `json:"pod"`
			Container     string     `json:"container"`
			DrainingSince *time.Time `json:"draining_since"`
			DrainingUntil *time.Time `json:"draining_until"`
		} `json:"holder"`
		Cordon         *cordonJSON `json:"cordon"`
		CordonedVia    string      `json:"cordoned_via"`
		UnhealthySince *time.Time  `json:"unhealthy_since"`
	} `json:"devices"`
	Problems []problem     `json:"problems"`
	Summary  statusSummary `json:"summary"`
}

func statusJSON(t *testing.T, f *fixture, wantCode int) statusOut {
	t.Helper()
	r := f.run(t, "status", "-o", "json")
	require.Equal(t, wantCode, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	var out statusOut
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &out))
	return out
}

// TestGoldenCordonDrain renders status on the cordon and draining fixture
// in every format.
func TestGoldenCordonDrain(t *testing.T) {
	f := newCordonDrainFixture(t)
	for _, tc := range []struct{ name, output string }{
		{"status-cordon", "table"}, {"status-cordon-wide", "wide"}, {"status-cordon-json", "json"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := f.run(t, "status", "-o", tc.output)
			// The intruder and the unhealthy cordon are problems; the
			// operator's cordons and the draining claim are not.
			require.Equal(t, ExitAttention, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			require.Empty(t, r.stderr)
			golden(t, tc.name, f.normalize(r.stdout))
		})
	}
}

// TestStatusCordonDrainFields checks the JSON fields of every row of the
// fixture, independently of the golden rendering.
func TestStatusCordonDrainFields(t *testing.T) {
	f := newCordonDrainFixture(t)
	out := statusJSON(t, f, ExitAttention)
	type row struct{ state, cordonOn, via, holder string }
	got := map[string]row{}
	for _, d := range out.Devices {
		r := row{state: d.State, via: d.CordonedVia}
		if d.Cordon != nil {
			r.cordonOn = d.Cordon.Source + " " + d.Cordon.Index
		}
		if d.Holder != nil {
			r.holder = d.Holder.ContainerID[:4]
		}
		got[d.Index] = r
	}
	assert.Equal(t, map[string]row{
		"0":   {stateCordoned, "unhealthy 0:1", uuidMIG1, "b2b2"}, // held via 0:1, cordoned through it
		"0:0": {stateFree, "", "", ""},                            // a sibling MIG instance is not covered
		"0:1": {stateCordoned, "unhealthy 0:1", "", "b2b2"},       // held and cordoned: the holder keeps it
		"1":   {stateCordoned, "operator 1", "", "a1a1"},
		"2":   {stateDraining, "", "", "c3c3"},
		"3":   {stateCordoned, "intruder 3", "", ""},
		"5:0": {stateCordoned, "operator 5:0", "", ""}, // not in the inventory, still listed
	}, got)

	for _, d := range out.Devices {
		switch d.Index {
		case "1":
			k := d.Cordon
			assert.Equal(t, uuidGPU1, k.Device)
			assert.Equal(t, "gpu", k.Kind)
			assert.Equal(t, "ECC errors, RMA 4711", k.Reason)
			assert.Equal(t, "uid 0 (sudo user alice) via gpu-guard-ctl", k.By)
			assert.True(t, k.Since.Equal(now.Add(-time.Hour)), "%v", k.Since)
		case "2":
			require.NotNil(t, d.Holder.DrainingSince)
			assert.True(t, d.Holder.DrainingSince.Equal(now.Add(-4*time.Minute)))
			require.NotNil(t, d.Holder.DrainingUntil)
			assert.True(t, d.Holder.DrainingUntil.Equal(now.Add(-4*time.Minute+drainGrace)))
		case "5:0":
			assert.False(t, d.InInventory)
			assert.Equal(t, "mig", d.Cordon.Kind)
		}
		if d.State != stateDraining && d.Holder != nil {
			assert.Nil(t, d.Holder.DrainingSince, d.Index)
		}
	}
	assert.Equal(t, statusSummary{Devices: 7, Free: 1, Draining: 1, Cordoned: 5}, out.Summary)

	// One problem per observer cordon, on the cordoned device, none for
	// the operator's cordons or the draining claim.
	var kinds []string
	for _, p := range out.Problems {
		kinds = append(kinds, p.Kind+" "+p.Index)
	}
	assert.ElementsMatch(t, []string{"cordoned 0:1", "cordoned 3"}, kinds)
	for _, p := range out.Problems {
		switch p.Index {
		case "3":
			for _, s := range []string{"GPU 3 (" + uuidGPU3 + ") is cordoned (intruder", "pid 4242", "sudo gpu-guard-ctl ps", "sudo gpu-guard-ctl uncordon 3"} {
				assert.Contains(t, p.Message, s)
			}
		case "0:1":
			for _, s := range []string{"MIG 0:1 (" + uuidMIG1 + ") is cordoned (unhealthy", "critical Xid 79", "nvidia-smi -q -i " + uuidGPU0,
				"sudo gpu-guard-ctl uncordon 0:1", "a reboot drops this cordon too"} {
				assert.Contains(t, p.Message, s)
			}
		}
	}

	// The table says the same for people.
	r := f.run(t, "status")
	require.Equal(t, ExitAttention, r.code)
	for _, re := range []string{
		`(?m)^0 +GPU-0a0a0a0a .* cordoned,held +b2b2b2b2b2b2 \(via 0:1\) `,
		`(?m)^0:0 +MIG-a0a0a0a0 .* free +- `,
		`(?m)^1 +GPU-1b1b1b1b .* cordoned,held +team-a/trainer-0/main `,
		`(?m)^2 +GPU-2c2c2c2c .* draining +team-c/batch/job `,
		`(?m)^3 +GPU-3d3d3d3d .* cordoned +- `,
		`(?m)^7 devices: 1 free, 1 draining, 5 cordoned$`,
		`(?m)^CORDONS \(4\):$`,
		`GPU 1 \(` + uuidGPU1 + `\): operator cordon by uid 0 \(sudo user alice\) via gpu-guard-ctl since 2026-03-01T11:00:00Z \(1h ago\): ECC errors, RMA 4711`,
		`MIG 5:0 \(` + uuidGoneMIG + `\): operator cordon .*not in the inventory any more: lift it with ` + "`sudo gpu-guard-ctl uncordon " + uuidGoneMIG + "`",
		`(?m)^DRAINING CLAIMS \(1\):$`,
		`GPU 2 \(` + uuidGPU2 + `\): held by team-c/batch/job \(c3c3c3c3c3c3\), stopped; draining for 4m, waiting for its processes to leave the GPU \(released at the latest in 6m: idle_grace\)`,
		`(?m)^ATTENTION \(2\):$`,
	} {
		assert.Regexp(t, re, r.stdout)
	}
}

// TestStatusCordonCoverage: each cordon source on a GPU and on a MIG
// instance: which rows it covers, which row carries it as a problem, and
// that status agrees with cordonOf (the rule uncordon and the guard use).
func TestStatusCordonCoverage(t *testing.T) {
	for _, source := range []string{ledger.CordonOperator, ledger.CordonIntruder, ledger.CordonUnhealthy} {
		for _, tc := range []struct {
			on      string            // cordoned device
			covered map[string]string // row index → cordoned_via ("" = the cordon's own row)
		}{
			{uuidGPU0, map[string]string{"0": "", "0:0": uuidGPU0, "0:1": uuidGPU0}}, // a GPU cordon covers its MIG instances
			{uuidMIG0, map[string]string{"0": uuidMIG0, "0:0": ""}},                  // a MIG cordon blocks its GPU, not its sibling
		} {
			t.Run(source+" "+tc.on[:3], func(t *testing.T) {
				f := newFixture(t)
				f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
					claim(t, tx, ownHook, "cdi", f.dev(t, uuidMIG1))
					cordon(t, tx, f.dev(t, tc.on), source, "why", "who")
				})
				want := ExitAttention
				if source == ledger.CordonOperator {
					want = ExitOK // intentional: shown, not a problem
				}
				out := statusJSON(t, f, want)
				st := f.state(t)
				covered := map[string]string{}
				for _, d := range out.Devices {
					dev, ok := f.inv.Lookup(d.UUID)
					require.True(t, ok)
					k := cordonOf(st, dev)
					if d.Cordon == nil {
						assert.Nil(t, k, "status and cordonOf disagree on %s", d.Index)
						continue
					}
					require.NotNil(t, k, "status and cordonOf disagree on %s", d.Index)
					assert.Equal(t, k.Device.UUID, d.Cordon.Device, d.Index)
					assert.Equal(t, source, d.Cordon.Source)
					assert.Equal(t, stateCordoned, d.State, d.Index)
					covered[d.Index] = d.CordonedVia
				}
				assert.Equal(t, tc.covered, covered)
				var problems []string
				for _, p := range out.Problems {
					problems = append(problems, p.Kind+" "+p.Device)
				}
				if source == ledger.CordonOperator {
					assert.Empty(t, problems)
				} else {
					assert.Equal(t, []string{problemCordoned + " " + tc.on}, problems, "one problem per cordon")
				}
				assert.Equal(t, len(tc.covered), out.Summary.Cordoned)
			})
		}
	}
}

// TestStatusMarksUnhealthy: the observer's unhealthy GPU marks its row and
// its MIG instances' (not from a stale report).
func TestStatusMarksUnhealthy(t *testing.T) {
	f := newFixture(t)
	sick := now.Add(-2 * time.Minute)
	of := observe.File{Time: now.Add(-4 * time.Second), WrittenAt: now.Add(-4 * time.Second), IntervalSeconds: 10,
		Unhealthy: []observe.Finding{{Kind: observe.KindUnhealthy, Device: observe.Device{Index: "0", UUID: uuidGPU0}, Xid: 79,
			Time: sick, Message: "GPU 0 (" + uuidGPU0 + ") reported critical Xid 79"}}}
	require.NoError(t, observe.WriteFile(f.dir, of))
	out := statusJSON(t, f, ExitAttention)
	marked := map[string]bool{}
	for _, d := range out.Devices {
		if d.UnhealthySince != nil {
			assert.True(t, d.UnhealthySince.Equal(sick))
			marked[d.Index] = true
		}
	}
	assert.Equal(t, map[string]bool{"0": true, "0:0": true, "0:1": true}, marked)
	assert.Equal(t, 3, out.Summary.Unhealthy)
	r := f.run(t, "status")
	assert.Regexp(t, `(?m)^0:0 +MIG-a0a0a0a0 .* free,unhealthy `, r.stdout)
	assert.Contains(t, r.stdout, "6 devices: 6 free; 3 unhealthy")

	// A stale report marks nothing.
	of.Time, of.WrittenAt = now.Add(-time.Hour), now.Add(-time.Hour)
	require.NoError(t, observe.WriteFile(f.dir, of))
	out = statusJSON(t, f, ExitAttention)
	for _, d := range out.Devices {
		assert.Nil(t, d.UnhealthySince, d.Index)
	}
	assert.Zero(t, out.Summary.Unhealthy)
}

// TestStatusGPUStateViaMIG: a GPU whose MIG instances are claimed takes its
// state from them: draining (neither is a problem) only when every claim on
// it drains, held while any running container holds one of its instances,
// whichever the ledger lists first. Before, the GPU showed the first claim
// of its instances: draining (it ends by itself) while a running container
// still held MIG 0:1.
func TestStatusGPUStateViaMIG(t *testing.T) {
	for _, tc := range []struct {
		name     string
		claims   map[string]ledger.Owner // MIG UUID → holder
		draining []string                // container ids that stopped
		states   map[string]string       // index → state
		holder   string                  // GPU 0's holder
		summary  statusSummary
	}{
		{name: "one instance draining",
			claims: map[string]ledger.Owner{uuidMIG1: ownHook}, draining: []string{idHook},
			states:  map[string]string{"0": stateDraining, "0:0": stateFree, "0:1": stateDraining},
			holder:  idHook,
			summary: statusSummary{Devices: 6, Free: 4, Draining: 2}},
		{name: "the first instance draining, the other held",
			claims:   map[string]ledger.Owner{uuidMIG0: ownHook, uuidMIG1: ownTrainer},
			draining: []string{idHook},
			states:   map[string]string{"0": stateHeld, "0:0": stateDraining, "0:1": stateHeld},
			holder:   idTrainer,
			summary:  statusSummary{Devices: 6, Free: 3, Held: 2, Draining: 1}},
		{name: "the first instance held, the other draining",
			claims:   map[string]ledger.Owner{uuidMIG0: ownTrainer, uuidMIG1: ownHook},
			draining: []string{idHook},
			states:   map[string]string{"0": stateHeld, "0:0": stateHeld, "0:1": stateDraining},
			holder:   idTrainer,
			summary:  statusSummary{Devices: 6, Free: 3, Held: 2, Draining: 1}},
		{name: "both instances draining",
			claims:   map[string]ledger.Owner{uuidMIG0: ownTrainer, uuidMIG1: ownHook},
			draining: []string{idHook, idTrainer},
			states:   map[string]string{"0": stateDraining, "0:0": stateDraining, "0:1": stateDraining},
			holder:   idTrainer,
			summary:  statusSummary{Devices: 6, Free: 3, Draining: 3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			appendConfig(t, f, "[observe]\nrelease_requires_idle = true\nidle_grace = \"10m\"\n")
			f.updateDraining(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
				for mig, o := range tc.claims {
					claim(t, tx, o, "cdi", f.dev(t, mig))
				}
			})
			f.updateDraining(t, now.Add(-time.Minute), func(tx *ledger.Tx) {
				for _, id := range tc.draining {
					require.Len(t, tx.MarkDraining(id, "stopped"), 1)
				}
			})
			out := statusJSON(t, f, ExitOK)
			states := map[string]string{}
			for _, d := range out.Devices {
				states[d.Index] = d.State
				if d.Index == "0" {
					require.NotNil(t, d.Holder)
					assert.Equal(t, tc.holder, d.Holder.ContainerID, "GPU 0's holder")
					assert.NotEmpty(t, d.HeldVia)
				}
			}
			for index, want := range tc.states {
				assert.Equal(t, want, states[index], "device %s", index)
			}
			assert.Equal(t, tc.summary, out.Summary)
			r := f.run(t, "status")
			assert.Equal(t, len(tc.draining), strings.Count(r.stdout, "waiting for its processes to leave the GPU"),
				"listed once, on the claimed device: %s", r.stdout)
			assert.Regexp(t, `(?m)^0 +GPU-0a0a0a0a +\S.* `+tc.states["0"]+` `, r.stdout)
		})
	}
}

// TestStatusAndExplainAgree: on one ledger, every device status shows
// cordoned is refused as cordoned by explain (through the same cordon),
// every held or draining one is busy with the same holder (draining said
// so), and every free one is admitted.
func TestStatusAndExplainAgree(t *testing.T) {
	f := newCordonDrainFixture(t)
	out := statusJSON(t, f, ExitAttention)
	checked := 0
	for _, d := range out.Devices {
		if !d.InInventory {
			continue
		}
		r := f.run(t, "explain", "--env", "NVIDIA_VISIBLE_DEVICES="+d.UUID, "-o", "json")
		require.Equal(t, ExitOK, r.code, r.stderr)
		var x explainView
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &x))
		require.Len(t, x.Devices, 1, r.stdout)
		require.Equal(t, d.UUID, x.Devices[0].UUID)
		switch d.State {
		case stateCordoned:
			assert.Equal(t, "reject", string(x.Decision), d.Index)
			assert.Equal(t, "cordoned", x.Reason, d.Index)
			assert.Contains(t, x.Message, d.Cordon.Device, d.Index)
			assert.Contains(t, x.Message, d.Cordon.Reason, d.Index)
		case stateHeld, stateDraining:
			assert.Equal(t, "queue", string(x.Decision), d.Index)
			assert.Equal(t, "busy", x.Reason, d.Index)
			assert.Contains(t, x.Message, d.Holder.Namespace+"/"+d.Holder.Pod+"/"+d.Holder.Container, d.Index)
			assert.Equal(t, d.State == stateDraining, strings.Contains(x.Message, "waiting for its processes to leave the GPU"), d.Index)
		case stateFree:
			assert.Equal(t, "admit", string(x.Decision), d.Index)
		default:
			t.Fatalf("%s: state %s not expected in this fixture", d.Index, d.State)
		}
		checked++
	}
	assert.Equal(t, 6, checked)
}

// TestStatusCordonJSONFieldsDocumented is TestJSONFieldsDocumented for the
// fields only cordons, draining claims and the observer's unhealthy devices
// bring.
func TestStatusCordonJSONFieldsDocumented(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "ctl-json.md"))
	require.NoError(t, err)
	f := newCordonDrainFixture(t)
	require.NoError(t, observe.WriteFile(f.dir, observe.File{Time: now, WrittenAt: now, IntervalSeconds: 10,
		Unhealthy: []observe.Finding{{Kind: observe.KindUnhealthy, Device: observe.Device{Index: "3", UUID: uuidGPU3}, Time: now}}}))
	r := f.run(t, "status", "-o", "json")
	require.Equal(t, ExitAttention, r.code, r.stderr)
	var v any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	keys := map[string]bool{}
	jsonKeys(v, keys)
	for _, k := range []string{"cordon", "cordoned_via", "draining_since", "draining_until", "unhealthy_since", "summary", "source", "by"} {
		require.True(t, keys[k], "the fixture shows %q", k)
	}
	for k := range keys {
		assert.True(t, strings.Contains(string(doc), `"`+k+`"`) || strings.Contains(string(doc), "`"+k+"`"),
			"status prints field %q, which docs/ctl-json.md does not document", k)
	}
}

// BenchmarkStatusRenderCordons is BenchmarkStatusRender with 16 of the 64
// GPUs cordoned (every source) and 8 claims draining: the cordon and drain
// columns cost map lookups, not a scan of the cordons per row.
func BenchmarkStatusRenderCordons(b *testing.B) {
	f := newFixture(b)
	inv, st := benchState(b, 8)
	devs := inv.Devices()
	sources := []string{ledger.CordonOperator, ledger.CordonIntruder, ledger.CordonUnhealthy}
	for i := 24; i < 40; i++ {
		st.Cordons = append(st.Cordons, ledger.Cordon{Device: devs[i], Source: sources[i%3], Reason: "why", By: "who", Since: now.Add(-time.Hour)})
	}
	rule := guard.NewReleaseRule(config.Default(), f.liveness)
	for b.Loop() {
		v := buildStatus(&st, headWait{}, inv, inventoryInfo{Origin: "cache"}, rule, true)
		v.setDrainDeadlines(drainGrace)
		if err := v.render(io.Discard, outputTable, now); err != nil {
			b.Fatal(err)
		}
	}
}

// TestOperatorCordonSurvivesRebootInStatus: after a reboot, before anything
// wrote the ledger, status and explain already see the operator's cordon
// (and nothing else of the earlier boot: no claim, no observer cordon).
func TestOperatorCordonSurvivesRebootInStatus(t *testing.T) {
	f := cordonFixture(t) // the trainer holds GPU 1
	r := f.run(t, "cordon", "1", "--reason", "ECC errors, RMA 4711")
	require.Equal(t, ExitOK, r.code, r.stderr)
	f.update(t, now.Add(-time.Minute), func(tx *ledger.Tx) {
		cordon(t, tx, f.dev(t, uuidGPU3), ledger.CordonIntruder, "pid 4242", "observer")
	})
	before := statusJSON(t, f, ExitAttention) // the intruder cordon is a problem
	require.Len(t, before.Problems, 1)

	rebooted := func(args ...string) result {
		var stdout, stderr syncBuffer
		env := f.env(&stdout, &stderr)
		env.BootID = "after-reboot"
		code := Run(context.Background(), append([]string{"--config", f.config}, args...), env)
		return result{code: code, stdout: stdout.String(), stderr: stderr.String()}
	}
	r = rebooted("status", "-o", "json")
	require.Equal(t, ExitOK, r.code, "an operator's cordon is no problem: %s %s", r.stdout, r.stderr)
	var out statusOut
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &out))
	for _, d := range out.Devices {
		switch d.Index {
		case "1":
			assert.Equal(t, stateCordoned, d.State)
			assert.Nil(t, d.Holder, "the earlier boot's claim is gone")
			require.NotNil(t, d.Cordon)
			assert.Equal(t, ledger.CordonOperator, d.Cordon.Source)
			assert.Equal(t, "ECC errors, RMA 4711", d.Cordon.Reason)
			assert.True(t, d.Cordon.Since.Equal(now))
		default:
			assert.Equal(t, stateFree, d.State, d.Index)
		}
	}
	r = rebooted("explain", "--env", "NVIDIA_VISIBLE_DEVICES=1", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, `"reason": "cordoned"`)
	r = rebooted("explain", "--env", "NVIDIA_VISIBLE_DEVICES=3", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, `"decision": "admit"`)
}

// TestReadersLeaveTheStateAsRead: status and queue build their views from
// the Tx's own state (Tx.ReadState, no copy), which may share storage with
// the ledger's cache: building and rendering them in every output format
// must leave every byte of it as it was.
func TestReadersLeaveTheStateAsRead(t *testing.T) {
	f := newFixture(t)
	f.populate(t)
	// A draining holder and a cordon too: every state status can show.
	f.update(t, now.Add(-time.Minute), func(tx *ledger.Tx) {
		require.NotEmpty(t, tx.MarkDraining(idStale, "stopped"))
		_, _, err := tx.Cordon(f.dev(t, uuidGPU0), ledger.CordonOperator, "fan", "ops")
		require.NoError(t, err)
	})
	l, err := ledger.OpenReadOnly(f.dir, f.ledgerOpts(0))
	require.NoError(t, err)
	rule := guard.NewReleaseRule(config.Default(), f.liveness)
	require.NoError(t, l.View(context.Background(), func(tx *ledger.Tx) error {
		before := tx.State().Clone()
		require.NotEmpty(t, before.Waiters)
		require.NotEmpty(t, before.Reservations)
		require.NotEmpty(t, before.Conflicts)
		require.NotEmpty(t, before.Cordons)
		for _, output := range []string{outputTable, outputWide, outputJSON} {
			v := buildStatus(tx.ReadState(), headOf(tx), f.inv, inventoryInfo{Origin: "cache"}, rule, true)
			v.setDrainDeadlines(time.Minute)
			require.NoError(t, v.render(io.Discard, output, now))
			q := buildQueue(tx, now)
			require.NoError(t, q.render(io.Discard, output, now))
		}
		require.Equal(t, before, *tx.ReadState())
		return nil
	}))
}
