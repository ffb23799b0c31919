// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// hookConfig rewrites f's [hook] section with runtime_roots = roots and,
// unless poststop, poststop = false, then appends extra (other sections):
// the fixture's [hook] is its last section, and TOML allows a table once.
func hookConfig(t *testing.T, f *fixture, roots []string, poststop bool, extra string) {
	t.Helper()
	cfg, err := os.ReadFile(f.config)
	require.NoError(t, err)
	if roots == nil {
		roots = []string{} // none: not null, which TOML has not
	}
	list, err := json.Marshal(roots)
	require.NoError(t, err)
	hook := "runtime_roots = " + string(list)
	if !poststop {
		hook += "\npoststop = false"
	}
	line := regexp.MustCompile(`(?m)^runtime_roots = .*$`)
	require.Regexp(t, line, string(cfg), "the fixture's configuration has a runtime_roots line")
	next := line.ReplaceAllLiteralString(string(cfg), hook)
	require.NoError(t, os.WriteFile(f.config, []byte(next+extra), 0o600))
}

// Under [hook] poststop = false no poststop releases an OCI hook
// container's claim: the next request for its GPU (or gc) does, once it
// finds the holder's processes gone. status used to call every such claim
// a holder-exited problem and exit 3 until then, for what is that host's
// normal state. It now shows the row held,exited and lists the claim under
// EXITED, NO POSTSTOP, with the JSON field exited, and exits
// 0. What nothing on such a host would end stays a problem: an NRI
// holder's claim (containerd's stop event ends it), a killed `gpu-guard-ctl
// run` ticket's, and one whose removal cannot be told. With a poststop
// nothing changes. gc still releases (or marks draining) every one found
// exited.
func TestStatusExitedHookHolderWithoutPoststop(t *testing.T) {
	ticket := ledger.Owner{ContainerID: guard.NewTicketID(), Container: "gpu-guard-ctl run", FrontEnd: ledger.FrontEndHook}
	hookWho := idHook[:12] + " (" + idHook[:12] + ")"
	for _, tc := range []struct {
		name     string
		owner    ledger.Owner
		poststop bool
		// roots are runtime_roots, under a fresh dir; extra is appended
		// TOML (other sections).
		roots  func(dir string) []string
		extra  string
		exited bool // the holder's processes are gone
		// exited is the row's Exited ("" Why: nil), note its line under
		// EXITED, NO POSTSTOP.
		want *exitedJSON
		note string
		// problem is the one problem status shows, "" for none; gc
		// says whether gc --dry-run lists the claim.
		problem string
		gc      bool
		// cordon: an operator cordoned the claimed device.
		cordon bool
	}{
		{name: "hook holder exited", owner: ownHook, exited: true,
			want: &exitedJSON{Why: "pid 4242 is gone", Ends: endsNextRequest},
			note: "held by " + hookWho + ", which has exited (pid 4242 is gone); its claim ends at the next request for the device " +
				"or with `sudo gpu-guard-ctl gc` ([hook] poststop = false)",
			gc: true},
		{name: "hook holder exited, release_requires_idle", owner: ownHook, exited: true,
			extra: "[observe]\nrelease_requires_idle = true\nidle_grace = \"10m\"\n",
			want:  &exitedJSON{Why: "pid 4242 is gone", Ends: endsNextRequest, Drains: true},
			note: "held by " + hookWho + ", which has exited (pid 4242 is gone); its claim is marked draining at the next request " +
				"for the device or by `sudo gpu-guard-ctl gc`, then released once its processes leave the GPU (release_requires_idle, " +
				"at the latest after idle_grace) ([hook] poststop = false)",
			gc: true},
		{name: "hook holder exited and removed, release_on remove", owner: ownHook, exited: true,
			roots: func(dir string) []string { return []string{dir} }, extra: "[policy]\nrelease_on = \"remove\"\n",
			want: &exitedJSON{Ends: endsNextRequest}, gc: true},
		{name: "hook holder running", owner: ownHook},
		{name: "NRI holder exited", owner: ownTrainer, exited: true, problem: problemHolderExited, gc: true},
		{name: "ticket exited", owner: ticket, exited: true, problem: problemHolderExited, gc: true},
		{name: "hook holder exited, removal unknown", owner: ownHook, exited: true,
			roots: func(dir string) []string { return []string{filepath.Join(dir, "none")} },
			extra: "[policy]\nrelease_on = \"remove\"\n", problem: problemRemovalUnknown},
		{name: "poststop: hook holder exited", owner: ownHook, poststop: true, exited: true, problem: problemHolderExited, gc: true},
		// A cordon refuses every request before any holder is settled:
		// only gc ends the claim there.
		{name: "hook holder exited on a cordoned device", owner: ownHook, exited: true, cordon: true,
			want: &exitedJSON{Why: "pid 4242 is gone", Ends: endsGC},
			note: "held by " + hookWho + ", which has exited (pid 4242 is gone); its claim ends with `sudo gpu-guard-ctl gc` " +
				"(the device is cordoned: no request is admitted to it) ([hook] poststop = false)",
			gc: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			var roots []string
			if tc.roots != nil {
				roots = tc.roots(t.TempDir())
			}
			hookConfig(t, f, roots, tc.poststop, tc.extra)
			f.update(t, now.Add(-time.Minute), func(tx *ledger.Tx) {
				claim(t, tx, tc.owner, `env NVIDIA_VISIBLE_DEVICES="1"`, f.dev(t, uuidGPU1))
				require.True(t, tx.SetStarted(tc.owner.ContainerID, 4242, 42, ""))
				if tc.cordon {
					_, _, err := tx.Cordon(f.dev(t, uuidGPU1), ledger.CordonOperator, "RMA 4711", "uid 0 via gpu-guard-ctl")
					require.NoError(t, err)
				}
			})
			if tc.exited {
				f.liveness["pid:4242"] = "pid 4242 is gone"
			}

			r := f.run(t, "status", "-o", "json")
			code := ExitOK
			if tc.problem != "" {
				code = ExitAttention
			}
			require.Equal(t, code, r.code, r.stdout+r.stderr)
			var view statusView
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &view), r.stdout)
			if tc.problem == "" {
				assert.Empty(t, view.Problems)
			} else if assert.Len(t, view.Problems, 1, r.stdout) {
				assert.Equal(t, tc.problem, view.Problems[0].Kind)
				assert.Equal(t, uuidGPU1, view.Problems[0].Device)
			}
			row := keptRow(t, r.stdout)
			wantState := stateHeld
			if tc.cordon {
				wantState = stateCordoned
			}
			assert.Equal(t, wantState, row.State, "the state a script selects on is unchanged")
			if tc.want == nil {
				assert.Nil(t, row.Exited, r.stdout)
			} else if assert.NotNil(t, row.Exited, r.stdout) {
				got := *row.Exited
				if tc.want.Why == "" {
					// The runtimes' words for the removal: only that it
					// is said matters here.
					assert.Contains(t, got.Why, "pid 4242 is gone; removed: ")
					got.Why = ""
				}
				assert.Equal(t, *tc.want, got)
				assert.Empty(t, row.Stale, "stale is what the holder-exited problem reports")
			}

			r = f.run(t, "status")
			require.Equal(t, code, r.code, r.stdout+r.stderr)
			label := "held"
			if tc.want != nil {
				label = "held,exited"
			}
			if tc.cordon {
				label = "cordoned," + label
			}
			assert.Regexp(t, `(?m)^1 +GPU-1b1b1b1b +\S.* `+regexp.QuoteMeta(label)+` +`, r.stdout)
			if tc.want == nil {
				assert.NotContains(t, r.stdout, "EXITED, NO POSTSTOP")
			} else {
				assert.Contains(t, r.stdout, "\nEXITED, NO POSTSTOP (1):\n  - GPU 1 ("+uuidGPU1+"): held by "+hookWho+
					", which has exited (pid 4242 is gone")
				if tc.note != "" {
					assert.Contains(t, r.stdout, "\nEXITED, NO POSTSTOP (1):\n  - GPU 1 ("+uuidGPU1+"): "+tc.note+"\n")
				}
			}
			assert.Equal(t, tc.problem != "", strings.Contains(r.stdout, "ATTENTION"), r.stdout)

			// gc still ends what the next request would.
			r = f.run(t, "gc", "--dry-run", "-o", "json")
			require.Equal(t, ExitOK, r.code, r.stderr)
			var gv releasedView
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &gv))
			assert.Equal(t, tc.gc, len(gv.Released)+len(gv.Draining) == 1, r.stdout)
		})
	}
}

// TestGoldenNoPoststop renders status on a host without the hook's
// poststop: an exited OCI hook holder on a MIG instance (listed, its GPU's
// row held via it), a running NRI holder and an exited NRI one (still the
// problem, exit 3).
func TestGoldenNoPoststop(t *testing.T) {
	f := newFixture(t)
	hookConfig(t, f, nil, false, "")
	f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
		claim(t, tx, ownHook, `annotation cdi.k8s.io/gpu="nvidia.com/mig=0:1"`, f.dev(t, uuidMIG1))
		claim(t, tx, ownTrainer, `env NVIDIA_VISIBLE_DEVICES="1"`, f.dev(t, uuidGPU1))
		claim(t, tx, ownStale, `env NVIDIA_VISIBLE_DEVICES="2"`, f.dev(t, uuidGPU2))
		require.True(t, tx.SetStarted(idHook, 4242, 42, ""))
		require.True(t, tx.SetStarted(idTrainer, 4343, 43, ""))
		require.True(t, tx.SetStarted(idStale, 4444, 44, ""))
	})
	f.liveness["pid:4242"] = "pid 4242 is gone"
	f.liveness["pid:4444"] = "pid 4444 is gone"
	for _, tc := range []struct{ name, output string }{
		{"status-no-poststop", "table"}, {"status-no-poststop-json", "json"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := f.run(t, "status", "-o", tc.output)
			require.Equal(t, ExitAttention, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			require.Empty(t, r.stderr)
			golden(t, tc.name, f.normalize(r.stdout))
		})
	}
}

// The fields exited brings are in docs/ctl-json.md, as every field status
// prints (TestStatusCordonJSONFieldsDocumented).
func TestStatusExitedJSONFieldsDocumented(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "ctl-json.md"))
	require.NoError(t, err)
	f := newFixture(t)
	hookConfig(t, f, nil, false, "[observe]\nrelease_requires_idle = true\nidle_grace = \"10m\"\n")
	f.update(t, now.Add(-time.Minute), func(tx *ledger.Tx) {
		claim(t, tx, ownHook, `env NVIDIA_VISIBLE_DEVICES="1"`, f.dev(t, uuidGPU1))
		require.True(t, tx.SetStarted(idHook, 4242, 42, ""))
	})
	f.liveness["pid:4242"] = "pid 4242 is gone"
	r := f.run(t, "status", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stdout+r.stderr)
	var v any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	keys := map[string]bool{}
	jsonKeys(v, keys)
	for _, k := range []string{"exited", "why", "ends", "drains"} {
		require.True(t, keys[k], "the fixture shows %q", k)
		assert.True(t, strings.Contains(string(doc), `"`+k+`"`) || strings.Contains(string(doc), "`"+k+"`"),
			"status prints field %q, which docs/ctl-json.md does not document", k)
	}
}

// An exited hook holder's claim ends with gc alone where a cordon refuses
// every request that could meet it: a cordon on the claimed device or on
// its GPU. A cordon on one MIG instance of a GPU claimed whole, or on a
// sibling of a claimed MIG instance, leaves requests for the other
// instances, the first of which ends the claim (the guard settles the
// holder before it admits): "next-request" there.
func TestStatusExitedEndsWithGCOnlyWhereNoRequestCanMeetIt(t *testing.T) {
	for _, tc := range []struct {
		name            string
		claimed, cordon string
		want            string
	}{
		{"the claimed GPU cordoned", uuidGPU1, uuidGPU1, endsGC},
		{"a claimed MIG instance's GPU cordoned", uuidMIG1, uuidGPU0, endsGC},
		{"a claimed MIG instance cordoned", uuidMIG1, uuidMIG1, endsGC},
		{"one MIG instance of a GPU claimed whole cordoned", uuidGPU0, uuidMIG0, endsNextRequest},
		{"a sibling of a claimed MIG instance cordoned", uuidMIG1, uuidMIG0, endsNextRequest},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			hookConfig(t, f, nil, false, "")
			f.update(t, now.Add(-time.Minute), func(tx *ledger.Tx) {
				claim(t, tx, ownHook, `env NVIDIA_VISIBLE_DEVICES="x"`, f.dev(t, tc.claimed))
				require.True(t, tx.SetStarted(idHook, 4242, 42, ""))
				_, _, err := tx.Cordon(f.dev(t, tc.cordon), ledger.CordonOperator, "RMA 4711", "uid 0 via gpu-guard-ctl")
				require.NoError(t, err)
			})
			f.liveness["pid:4242"] = "pid 4242 is gone"
			r := f.run(t, "status", "-o", "json")
			require.Equal(t, ExitOK, r.code, r.stdout+r.stderr)
			var view statusView
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &view), r.stdout)
			var row *statusDevice
			for i := range view.Devices {
				if view.Devices[i].UUID == tc.claimed {
					row = &view.Devices[i]
				}
			}
			require.NotNil(t, row)
			require.NotNil(t, row.Exited, r.stdout)
			assert.Equal(t, tc.want, row.Exited.Ends)
		})
	}
}
