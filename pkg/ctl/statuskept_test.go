// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// keptRow is the row of the claimed GPU 1 of `status -o json` (stdout).
func keptRow(t *testing.T, stdout string) statusDevice {
	t.Helper()
	var view statusView
	require.NoError(t, json.Unmarshal([]byte(stdout), &view), stdout)
	for _, d := range view.Devices {
		if d.UUID == uuidGPU1 {
			return d
		}
	}
	require.FailNow(t, "no row for GPU 1", stdout)
	return statusDevice{}
}

// Under release_on = "remove", podman loses track of a container whose
// conmon was killed: `podman rm -f` forgets it but never deletes it from
// runc's root, and the exited hook holder's claim stays for good, as the
// runtime's state says the container exists. status used to show its GPU
// plainly held, like a running container's. It now marks the row exited,
// lists the claim under KEPT UNTIL REMOVED with the runtime root that has
// the container and how to end the claim, and gives both in the JSON. It
// stays no problem (exit 0): the policy keeps a stopped container's claim
// on purpose, and nothing tells a lost container from a stopped one.
func TestStatusShowsExitedHookHolderKeptUntilRemoved(t *testing.T) {
	runc := filepath.Join(t.TempDir(), "runc")
	require.NoError(t, os.MkdirAll(filepath.Join(runc, idHook), 0o700))
	f := removedHookFixture(t, runc)
	short := idHook[:12]
	remedy := "runtime root " + runc + " still has its container: if its engine no longer lists it, delete it from the runtime " +
		"(`sudo runc --root " + runc + " delete --force " + idHook + "`), then run `sudo gpu-guard-ctl gc`, or end its claim with " +
		"`sudo gpu-guard-ctl release --container " + idHook + " --reason \"container removed\"`"

	for _, tc := range []struct {
		name    string
		stopped time.Time // when its stop was recorded; zero: not recorded
		exited  string
		why     string
	}{
		{name: "found exited, stop not recorded", exited: "has exited (pid 4242 is gone; its stop is not recorded yet)",
			why: "pid 4242 is gone"},
		{name: "stop recorded", stopped: now.Add(-5 * time.Minute), exited: "exited at 2026-03-01T11:55:00Z (5m ago)",
			why: "it exited at 2026-03-01T11:55:00Z"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !tc.stopped.IsZero() {
				f.update(t, tc.stopped, func(tx *ledger.Tx) { require.True(t, tx.MarkStopped(idHook)) })
			}
			r := f.run(t, "status")
			require.Equal(t, ExitOK, r.code, r.stdout+r.stderr)
			assert.Regexp(t, `(?m)^1 +GPU-1b1b1b1b +\S.* held,exited +`+short+` +`+short, r.stdout)
			assert.Contains(t, r.stdout, "\nKEPT UNTIL REMOVED (1):\n  - GPU 1 ("+uuidGPU1+"): held by "+short+" ("+short+"), which "+
				tc.exited+` and keeps its claim until its container is removed (release_on = "remove"); `+remedy+"\n")
			assert.NotContains(t, r.stdout, "ATTENTION")

			r = f.run(t, "status", "-o", "json")
			require.Equal(t, ExitOK, r.code, r.stdout+r.stderr)
			row := keptRow(t, r.stdout)
			assert.Equal(t, stateHeld, row.State, "the state a script selects on is unchanged")
			require.NotNil(t, row.Kept, r.stdout)
			assert.Equal(t, keptJSON{Why: tc.why, RuntimeRoot: runc}, *row.Kept)
		})
	}

	// Deleted from the runtime as the line says, gc ends the claim.
	require.NoError(t, os.Remove(filepath.Join(runc, idHook)))
	r := f.run(t, "gc")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Empty(t, claimedBy(f.state(t), idHook), r.stdout)
}

// An NRI holder kept until its removal is listed too, without a runtime
// root (containerd's removal ends it); a running holder, a stale one and one
// whose removal cannot be told are not.
func TestStatusKeptOnlyForHoldersKeptUntilRemoved(t *testing.T) {
	for _, tc := range []struct {
		name string
		// roots are runtime_roots; exited: the holder's process is gone.
		roots  func(dir string) []string
		owner  ledger.Owner
		exited bool
		kept   bool
		// code is status's exit; problem the one problem it shows, of
		// the held device ("" for none).
		code    int
		problem string
	}{
		{name: "NRI holder, exited", owner: ownTrainer, exited: true, kept: true, code: ExitOK,
			roots: func(dir string) []string { return []string{dir} }},
		{name: "hook holder, running", owner: ownHook, code: ExitOK,
			roots: func(dir string) []string { return []string{dir} }},
		{name: "hook holder, removed", owner: ownHook, exited: true, code: ExitAttention, problem: problemHolderExited,
			roots: func(dir string) []string { return []string{dir} }},
		{name: "hook holder, removal unknown", owner: ownHook, exited: true, code: ExitAttention, problem: problemRemovalUnknown,
			roots: func(dir string) []string { return []string{filepath.Join(dir, "none")} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := removedHookFixture(t, tc.roots(t.TempDir())...)
			f.update(t, now.Add(-time.Minute), func(tx *ledger.Tx) {
				require.Len(t, tx.Release(idHook, "test"), 1)
				claim(t, tx, tc.owner, `env NVIDIA_VISIBLE_DEVICES="1"`, f.dev(t, uuidGPU1))
				require.True(t, tx.SetStarted(tc.owner.ContainerID, 4242, 42, ""))
			})
			if !tc.exited {
				delete(f.liveness, "pid:4242")
			}
			r := f.run(t, "status", "-o", "json")
			require.Equal(t, tc.code, r.code, r.stdout+r.stderr)
			var problems struct {
				Problems []problem `json:"problems"`
			}
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &problems))
			if tc.problem == "" {
				assert.Empty(t, problems.Problems)
			} else {
				assert.Len(t, problems.Problems, 1, r.stdout)
				got := problemsOfKind(t, r.stdout, tc.problem)
				if assert.Len(t, got, 1, r.stdout) {
					assert.Equal(t, uuidGPU1, got[0].Device)
				}
			}
			row := keptRow(t, r.stdout)
			if !tc.kept {
				assert.Nil(t, row.Kept, r.stdout)
				assert.NotContains(t, f.run(t, "status").stdout, "KEPT UNTIL REMOVED")
				return
			}
			require.NotNil(t, row.Kept, r.stdout)
			assert.Equal(t, keptJSON{Why: "pid 4242 is gone"}, *row.Kept)
			r = f.run(t, "status")
			assert.Contains(t, r.stdout, "\nKEPT UNTIL REMOVED (1):\n  - GPU 1 ("+uuidGPU1+"): held by team-a/trainer-0/main ("+
				idTrainer[:12]+"), which has exited (pid 4242 is gone; its stop is not recorded yet) and keeps its claim until its "+
				"container is removed (release_on = \"remove\")\n")
		})
	}
}
