// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gofrs/flock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

func claimedBy(st ledger.State, id string) []string {
	var out []string
	for _, c := range st.Claims {
		if c.Owner.ContainerID == id {
			out = append(out, c.Device.UUID)
		}
	}
	return out
}

func releaseRecords(recs []ledger.AuditRecord, id string) []ledger.AuditRecord {
	var out []ledger.AuditRecord
	for _, r := range recs {
		if r.Op == ledger.OpRelease && r.ContainerID == id {
			out = append(out, r)
		}
	}
	return out
}

// TestRelease force-releases claims end to end on a real ledger and checks the
// audit record, and every refusal with its exit code.
func TestRelease(t *testing.T) {
	for _, tc := range []struct {
		name      string
		uid       int
		args      []string
		code      int
		stderr    string // substring of the error
		stderrAll []string
		released  string // container id whose claims must be gone
		stdout    string
		drain     bool // the exited holder of GPU 2 drains (release_requires_idle)
		idle      bool // release_requires_idle, the exited holder of GPU 2 not marked draining yet
		noStderr  []string
	}{
		{name: "by container prefix", args: []string{"release", "--container", idTrainer[:12], "--reason", "node drained", "--force"},
			code: ExitOK, released: idTrainer, stdout: "released GPU 1 (" + uuidGPU1 + ") held by team-a/trainer-0/main",
			stderrAll: []string{"warning: --force: GPU 1 (" + uuidGPU1 + ") is held by team-a/trainer-0/main (id a1a1a1a1a1a1), which is still running (pid 4242); " +
				"released anyway: it keeps using the GPU, and the next container will share it"}},
		{name: "a running holder is refused without --force", args: []string{"release", "--container", idTrainer[:12], "--reason", "node drained"},
			code: ExitError, stderrAll: []string{"release refused: GPU 1 (" + uuidGPU1 + ") is held by team-a/trainer-0/main (id a1a1a1a1a1a1), " +
				"which is still running (pid 4242); stop it first, or add --force"}},
		{name: "a running holder by device is refused without --force", args: []string{"release", "--device", "1", "--reason", "x"},
			code: ExitError, stderr: "GPU 1 (" + uuidGPU1 + ") is held by team-a/trainer-0/main (id a1a1a1a1a1a1), which is still running (pid 4242)"},
		{name: "a running holder by device, forced", args: []string{"release", "--device", uuidGPU1, "--reason", "x", "--force"},
			code: ExitOK, released: idTrainer},
		{name: "a holder that never started is released with a note", args: []string{"release", "--container", idHook, "--reason", "x"},
			code: ExitOK, released: idHook, stderrAll: []string{"note: MIG 0:1 (" + uuidMIG1 + ") is held by container " + idHook[:12] + ", which never started"}},
		{name: "by full container id", args: []string{"release", "--container", idHook, "--reason", "x"},
			code: ExitOK, released: idHook, stdout: "released MIG 0:1"},
		{name: "by device uuid, any case", args: []string{"release", "--device", strings.ToLower(uuidGone), "--reason", "GPU removed"},
			code: ExitOK, released: idGhost, stdout: "released GPU 7"},
		{name: "by device index", args: []string{"release", "--device", "2", "--reason", "stuck"},
			code: ExitOK, released: idStale},
		// A draining holder exited already: "stop it first" is no advice;
		// its processes leaving the GPU, or --force, end the claim.
		{name: "a draining claim is refused without --force", drain: true, args: []string{"release", "--device", "2", "--reason", "x"},
			code: ExitError, stderrAll: []string{"release refused: GPU 2 (" + uuidGPU2 + ") is held by team-c/batch/job (id c3c3c3c3c3c3), which exited, " +
				"but its claim drains until its processes leave the GPU (release_requires_idle); its processes may still use the GPU: " +
				"wait for the claim to end by itself (when the GPU observer sees them gone, at the latest after idle_grace), " +
				"or add --force if you know they are gone"}, noStderr: []string{"stop it first"}},
		{name: "a draining claim, forced", drain: true, args: []string{"release", "--device", "2", "--reason", "processes gone", "--force"},
			code: ExitOK, released: idStale, stderrAll: []string{"warning: --force: GPU 2 (" + uuidGPU2 + ") is held by team-c/batch/job (id c3c3c3c3c3c3), which exited"}},
		// Found exited, but not marked draining yet: its processes may
		// be on the GPU all the same, and gc (not idle_grace) ends it.
		{name: "an exited holder under release_requires_idle is refused without --force", idle: true,
			args: []string{"release", "--device", "2", "--reason", "x"},
			code: ExitError, stderrAll: []string{"release refused: GPU 2 (" + uuidGPU2 + ") is held by team-c/batch/job (id c3c3c3c3c3c3), which exited " +
				"(cgroup k8s.io/" + idStale + " has no processes), but its claim is kept until its processes leave the GPU (release_requires_idle); " +
				"its processes may still use the GPU: run `sudo gpu-guard-ctl gc` to mark its claim draining",
				"or add --force if you know they are gone"}, noStderr: []string{"stop it first"}},
		{name: "an exited holder under release_requires_idle, dry run", idle: true, uid: 1000,
			args: []string{"release", "--container", idStale, "--reason", "x", "--dry-run"},
			code: ExitError, stderr: "run `sudo gpu-guard-ctl gc` to mark its claim draining"},
		{name: "an exited holder under release_requires_idle, forced", idle: true,
			args: []string{"release", "--device", "2", "--reason", "processes gone", "--force"},
			code: ExitOK, released: idStale, stderrAll: []string{"warning: --force: GPU 2 (" + uuidGPU2 + ") is held by team-c/batch/job (id c3c3c3c3c3c3), " +
				"which exited (cgroup k8s.io/" + idStale + " has no processes), but its claim is kept until its processes leave the GPU (release_requires_idle); " +
				"released anyway"}},
		{name: "no reason", args: []string{"release", "--container", idTrainer}, code: ExitUsage, stderr: "--reason is required"},
		{name: "blank reason", args: []string{"release", "--container", idTrainer, "--reason", "  "}, code: ExitUsage, stderr: "--reason is required"},
		{name: "neither target", args: []string{"release", "--reason", "x"}, code: ExitUsage, stderr: "exactly one of"},
		{name: "both targets", args: []string{"release", "--container", idTrainer, "--device", "1", "--reason", "x"}, code: ExitUsage, stderr: "exactly one of"},
		{name: "not root", uid: 1000, args: []string{"release", "--container", idTrainer, "--reason", "x"}, code: ExitError, stderr: "needs root"},
		{name: "unknown container", args: []string{"release", "--container", "0123456789ab", "--reason", "x"}, code: ExitError, stderr: `no claim is held by container "0123456789ab"`},
		{name: "unknown device", args: []string{"release", "--device", "0:0", "--reason", "x"}, code: ExitError, stderr: `no claim on device "0:0"`},
		{name: "dry run changes nothing, no root needed", uid: 1000, args: []string{"release", "--container", idTrainer[:6], "--reason", "x", "--dry-run", "--force"},
			code: ExitOK, stdout: "would release GPU 1 (" + uuidGPU1 + ")", stderr: "warning: --force"},
		{name: "dry run refuses what the release refuses", uid: 1000, args: []string{"release", "--container", idTrainer[:6], "--reason", "x", "--dry-run"},
			code: ExitError, stderr: "which is still running (pid 4242); stop it first, or add --force"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.populate(t)
			if tc.drain || tc.idle {
				appendConfig(t, f, "[observe]\nrelease_requires_idle = true\nidle_grace = \"10m\"\n")
			}
			if tc.drain {
				f.updateDraining(t, now, func(tx *ledger.Tx) {
					require.Len(t, tx.MarkDraining(idStale, "holder exited"), 1)
				})
			}
			f.uid = tc.uid
			before := f.state(t)
			auditBefore := len(f.audit(t))
			r := f.run(t, tc.args...)
			require.Equal(t, tc.code, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			if tc.stderr != "" {
				assert.Contains(t, r.stderr, tc.stderr)
			}
			for _, s := range tc.stderrAll {
				assert.Contains(t, r.stderr, s)
			}
			for _, s := range tc.noStderr {
				assert.NotContains(t, r.stderr, s)
			}
			if tc.stdout != "" {
				assert.Contains(t, r.stdout, tc.stdout)
			}
			if tc.released == "" {
				require.Equal(t, before, f.state(t), "a refused or dry release must not change the ledger")
				require.Len(t, f.audit(t), auditBefore)
				return
			}
			after := f.state(t)
			require.NotEmpty(t, claimedBy(before, tc.released))
			assert.Empty(t, claimedBy(after, tc.released))
			for _, c := range before.Claims {
				if c.Owner.ContainerID != tc.released {
					assert.Contains(t, claimedBy(after, c.Owner.ContainerID), c.Device.UUID, "only that holder's claims go")
				}
			}
			recs := releaseRecords(f.audit(t)[auditBefore:], tc.released)
			require.NotEmpty(t, recs, "the release is audited")
			reasonFlag := tc.args[slices.Index(tc.args, "--reason")+1]
			assert.Contains(t, recs[0].Reason, reasonFlag)
			assert.Contains(t, recs[0].Reason, "uid 0")
			assert.Equal(t, claimedBy(before, tc.released), recs[0].Devices)
		})
	}
}

// TestReleaseAmbiguousPrefix: a prefix matching two holders is refused and
// names both.
func TestReleaseAmbiguousPrefix(t *testing.T) {
	f := newFixture(t)
	other := owner("a1ff"+strings.Repeat("0", 60), "team-q", "q", "q", ledger.FrontEndHook)
	f.update(t, now, func(tx *ledger.Tx) {
		claim(t, tx, ownTrainer, "env", f.dev(t, uuidGPU1))
		claim(t, tx, other, "env", f.dev(t, uuidGPU2))
	})
	before := f.state(t)
	r := f.run(t, "release", "--container", "a1", "--reason", "x")
	require.Equal(t, ExitError, r.code)
	assert.Contains(t, r.stderr, "ambiguous")
	assert.Contains(t, r.stderr, idTrainer)
	assert.Contains(t, r.stderr, other.ContainerID)
	require.Equal(t, before, f.state(t))
}

// TestReleaseHandsOver: a force-released GPU goes where a stop would send
// it: to the container recorded as using it anyway (conflict), else to the
// head of its queue.
func TestReleaseHandsOver(t *testing.T) {
	f := newFixture(t)
	f.populate(t)
	r := f.run(t, "release", "--container", idTrainer, "--reason", "hung", "-o", "json", "--force")
	require.Equal(t, ExitOK, r.code, r.stderr)
	var v releasedView
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	assert.False(t, v.DryRun)
	require.Len(t, v.Released, 1)
	assert.Equal(t, uuidGPU1, v.Released[0].Device)
	assert.Equal(t, idTrainer, v.Released[0].ContainerID)
	assert.Equal(t, []string{uuidGPU1}, claimedBy(f.state(t), idRogue))

	f = newFixture(t)
	f.update(t, now.Add(-time.Minute), func(tx *ledger.Tx) {
		claim(t, tx, ownStale, "env", f.dev(t, uuidGPU2))
		tx.Enqueue(key(ownW1), ownW1, []devices.Device{f.dev(t, uuidGPU2)})
	})
	r = f.run(t, "release", "--device", "2", "--reason", "hung")
	require.Equal(t, ExitOK, r.code, r.stderr)
	st := f.state(t)
	require.Len(t, st.Reservations, 1)
	assert.Equal(t, uuidGPU2, st.Reservations[0].Device.UUID)
	assert.Equal(t, key(ownW1), st.Reservations[0].For)
}

// gc removes the hook's container markers of its ledger that the ledger
// does not explain, and keeps the others.
func TestGCSweepsHookMarkers(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the container markers are in " + hook.DefaultMarkerDir + " (root only)")
	}
	f := newFixture(t)
	f.populate(t)
	require.NoError(t, os.MkdirAll(hook.DefaultMarkerDir, 0o700))
	write := func(name, id, ledgerDir string) string {
		p := filepath.Join(hook.DefaultMarkerDir, name)
		// As pkg/hook writes them (see hook.SweepMarkers).
		data := "nri-gpu-guard hook container marker v1\nledger " + ledgerDir + "\nid " + id + "\nbundle /b/" + id
		require.NoError(t, os.WriteFile(p, []byte(data), 0o600))
		t.Cleanup(func() { _ = os.Remove(p) })
		return p
	}
	base := "c-gctest" + strconv.Itoa(os.Getpid())
	gone := write(base+"gone", "never-in-the-ledger", f.dir)
	held := write(base+"held", f.state(t).Claims[0].Owner.ContainerID, f.dir)
	other := write(base+"other", "never-in-the-ledger", f.dir+"-another")

	r := f.run(t, "gc")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.NotContains(t, r.stderr, "markers")
	assert.NoFileExists(t, gone)
	assert.FileExists(t, held, "its container holds a GPU")
	assert.FileExists(t, other, "another ledger's")
}

// TestGC releases the claims of exited holders only, with the finding in the
// audit log.
func TestGC(t *testing.T) {
	f := newFixture(t)
	f.populate(t)

	// Not root: refused, nothing changes.
	f.uid = 1000
	before := f.state(t)
	r := f.run(t, "gc")
	require.Equal(t, ExitError, r.code)
	assert.Contains(t, r.stderr, "needs root")
	require.Equal(t, before, f.state(t))

	// Dry run: lists, changes nothing.
	r = f.run(t, "gc", "--dry-run")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "would release GPU 2 ("+uuidGPU2+") held by team-c/batch/job")
	assert.Contains(t, r.stdout, "has no processes")
	assert.NotContains(t, r.stdout, "GPU 1 (")
	require.Equal(t, before, f.state(t))

	f.uid = 0
	auditBefore := len(f.audit(t))
	r = f.run(t, "gc", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	var v releasedView
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	require.Len(t, v.Released, 1)
	assert.Equal(t, idStale, v.Released[0].ContainerID)
	assert.Contains(t, v.Released[0].Why, "holder exited")

	after := f.state(t)
	assert.Empty(t, claimedBy(after, idStale))
	assert.Len(t, after.Claims, len(before.Claims)-1)
	recs := releaseRecords(f.audit(t)[auditBefore:], idStale)
	require.Len(t, recs, 1)
	assert.Contains(t, recs[0].Reason, "holder exited")

	// Nothing left to collect: status is down to the conflict and the
	// unknown device, gc releases nothing more.
	r = f.run(t, "gc")
	require.Equal(t, ExitOK, r.code)
	assert.Equal(t, "nothing to release\n", r.stdout)
}

// TestGCRealLiveness wires the real liveness checker through Env.CgroupRoot
// and ProcRoot: a holder whose cgroup v2 is unpopulated is collected, one
// whose cgroup has processes is kept.
func TestGCRealLiveness(t *testing.T) {
	f := newFixture(t)
	cg := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(cg, "cgroup.controllers"), []byte("cpu memory pids\n"), 0o644))
	for id, populated := range map[string]string{idTrainer: "1", idStale: "0"} {
		dir := filepath.Join(cg, "k8s.io", id)
		require.NoError(t, os.MkdirAll(dir, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "cgroup.events"), []byte("populated "+populated+"\nfrozen 0\n"), 0o644))
	}
	f.update(t, now, func(tx *ledger.Tx) {
		claim(t, tx, ownTrainer, "env", f.dev(t, uuidGPU1))
		claim(t, tx, ownStale, "env", f.dev(t, uuidGPU2))
		claim(t, tx, ownOld, "env", f.dev(t, uuidGPU3)) // never started: alive
		require.True(t, tx.SetStarted(idTrainer, 10, 0, "/k8s.io/"+idTrainer))
		require.True(t, tx.SetStarted(idStale, 11, 0, "/k8s.io/"+idStale))
	})
	var stdout, stderr syncBuffer
	env := f.env(&stdout, &stderr)
	env.Liveness = nil
	env.CgroupRoot, env.ProcRoot = cg, t.TempDir()
	code := Run(t.Context(), []string{"--config", f.config, "gc"}, env)
	require.Equal(t, ExitOK, code, stderr.String())
	assert.Contains(t, stdout.String(), "holder exited: cgroup /k8s.io/"+idStale+" has no processes")
	st := f.state(t)
	assert.Empty(t, claimedBy(st, idStale))
	assert.NotEmpty(t, claimedBy(st, idTrainer))
	assert.NotEmpty(t, claimedBy(st, idOld))
}

// pidsExited reports the listed pids as exited, with the finding.
type pidsExited map[int]string

func (p pidsExited) Exited(o liveness.Process) (bool, string) {
	why, ok := p[o.Pid]
	return ok, why
}

// TestGCIncarnations: two containers of one id (two runtime roots) are two
// holders, told apart by their recorded processes. gc checks each one, and
// the dry run lists exactly what the real run then releases (or keeps
// draining): the claims of the incarnations that exited, each with its own
// finding, never those of a live one, whichever sorts first.
func TestGCIncarnations(t *testing.T) {
	dead := ledger.Owner{ContainerID: "train", FrontEnd: ledger.FrontEndHook, Pid: 100, PidStart: 1, Cgroup: "/a/train", StartedAt: now.Add(-time.Hour)}
	alive := ledger.Owner{ContainerID: "train", FrontEnd: ledger.FrontEndHook, Pid: 200, PidStart: 2, Cgroup: "/b/train", StartedAt: now.Add(-time.Hour)}
	const gone100, gone200 = "holder exited: pid 100 gone", "holder exited: pid 200 gone"
	for _, tc := range []struct {
		name               string
		deadGPU, aliveGPU  string
		exited             pidsExited
		drain              bool              // release_requires_idle
		released, draining map[string]string // device UUID -> why
		held               map[string]int    // device UUID -> pid, after gc
	}{
		{
			name: "exited incarnation sorts second", deadGPU: uuidGPU2, aliveGPU: uuidGPU1,
			exited:   pidsExited{100: "pid 100 gone"},
			released: map[string]string{uuidGPU2: gone100},
			held:     map[string]int{uuidGPU1: 200},
		},
		{
			name: "exited incarnation sorts first", deadGPU: uuidGPU1, aliveGPU: uuidGPU2,
			exited:   pidsExited{100: "pid 100 gone"},
			released: map[string]string{uuidGPU1: gone100},
			held:     map[string]int{uuidGPU2: 200},
		},
		{
			name: "both exited, each with its finding", deadGPU: uuidGPU2, aliveGPU: uuidGPU1,
			exited:   pidsExited{100: "pid 100 gone", 200: "pid 200 gone"},
			released: map[string]string{uuidGPU2: gone100, uuidGPU1: gone200},
			held:     map[string]int{},
		},
		{
			name: "none exited", deadGPU: uuidGPU1, aliveGPU: uuidGPU2,
			exited: pidsExited{},
			held:   map[string]int{uuidGPU1: 100, uuidGPU2: 200},
		},
		{
			name: "release_requires_idle: only the exited one drains", deadGPU: uuidGPU2, aliveGPU: uuidGPU1,
			exited: pidsExited{100: "pid 100 gone"}, drain: true,
			draining: map[string]string{uuidGPU2: gone100},
			held:     map[string]int{uuidGPU1: 200, uuidGPU2: 100},
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
			f.uid = 0
			byDevice := func(rs []releasedJSON) map[string]string {
				out := map[string]string{}
				for _, r := range rs {
					out[r.Device] = r.Why
				}
				return out
			}
			for _, args := range [][]string{{"gc", "--dry-run", "-o", "json"}, {"gc", "-o", "json"}} {
				r := runLive(f, tc.exited, args...)
				require.Equal(t, ExitOK, r.code, r.stderr)
				var v releasedView
				require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
				assert.Equal(t, len(args) == 4, v.DryRun)
				assert.Equal(t, nonNil(tc.released), byDevice(v.Released), "%v: released", args)
				assert.Equal(t, nonNil(tc.draining), byDevice(v.Draining), "%v: draining", args)
			}
			held, draining, wantDraining := map[string]int{}, map[string]bool{}, map[string]bool{}
			for _, c := range f.state(t).Claims {
				held[c.Device.UUID] = c.Owner.Pid
				draining[c.Device.UUID] = !c.Owner.DrainingSince.IsZero()
				wantDraining[c.Device.UUID] = tc.draining[c.Device.UUID] != ""
			}
			assert.Equal(t, tc.held, held, "the GPUs each incarnation holds after gc")
			assert.Equal(t, wantDraining, draining)
			r := runLive(f, tc.exited, "gc", "--dry-run")
			require.Equal(t, ExitOK, r.code, r.stderr)
			assert.Equal(t, "nothing to release\n", r.stdout, "nothing left to collect")
		})
	}
}

func nonNil(m map[string]string) map[string]string {
	if m == nil {
		return map[string]string{}
	}
	return m
}

// TestSameIncarnation: gc's finding applies only to the process it checked,
// whatever another incarnation of the same container id holds.
func TestSameIncarnation(t *testing.T) {
	checked := ledger.Owner{ContainerID: "x", Pid: 10, PidStart: 5, Cgroup: "/k8s.io/x"}
	other := ledger.Owner{ContainerID: "x", Pid: 20, PidStart: 6, Cgroup: "/other/x"}
	restarted := checked
	restarted.Pid = 11
	for _, tc := range []struct {
		name   string
		owners []ledger.Owner // claims, in ledger order
		want   bool
	}{
		{"still held", []ledger.Owner{checked}, true},
		{"held after another incarnation's claim", []ledger.Owner{other, checked}, true},
		{"held before another incarnation's claim", []ledger.Owner{checked, other}, true},
		{"started again", []ledger.Owner{restarted}, false},
		{"started again, another incarnation runs", []ledger.Owner{other, restarted}, false},
		{"released meanwhile", nil, false},
		{"released meanwhile, another incarnation holds", []ledger.Owner{other}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := &ledger.State{}
			for _, o := range tc.owners {
				st.Claims = append(st.Claims, ledger.Claim{Owner: o})
			}
			assert.Equal(t, tc.want, sameIncarnation(st, checked))
		})
	}
}

// TestSameHolder: release --device refuses a device that changed hands
// between the operator's look and the transaction.
func TestSameHolder(t *testing.T) {
	st := &ledger.State{Claims: []ledger.Claim{{Device: devices.Device{UUID: uuidGPU1, Index: "1", Kind: devices.KindGPU}, Owner: ownW1}}}
	require.NoError(t, sameHolder(st, uuidGPU1, ownW1.ContainerID))
	require.NoError(t, sameHolder(st, uuidGPU2, ownW1.ContainerID), "released meanwhile: ReleaseDevice reports not found")
	err := sameHolder(st, uuidGPU1, idTrainer)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "GPU 1 ("+uuidGPU1+") changed hands")
	assert.Contains(t, err.Error(), "team-f/w1/main")
}

// TestReleaseConflictOnly: a container recorded only in a conflict can be
// named; its conflict records are cleared, the output says so (the dry run
// first, and the JSON lists them), and status no longer needs attention for
// it.
func TestReleaseConflictOnly(t *testing.T) {
	f := newFixture(t)
	f.populate(t)
	r := f.run(t, "release", "--container", idRogue[:12], "--reason", "rogue stopped", "--dry-run")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Equal(t, "would clear the conflict record(s) of container "+idRogue+" on GPU 1 ("+uuidGPU1+
		") (it was found using them while another container held them; check that it no longer runs there)\n", r.stdout)
	require.Len(t, f.state(t).Conflicts, 1, "a dry run changes nothing")
	// The record names no process (reconcile found it created, not
	// started): nothing to check, as for a holder that never started.
	assert.Contains(t, r.stderr, "note: team-x/rogue/cuda (id e5e5e5e5e5e5) runs on GPU 1 ("+uuidGPU1+
		"), which team-a/trainer-0/main (id a1a1a1a1a1a1) holds (a conflict record: the device becomes its claim once free), "+
		"and records no process (no pid, no cgroup): nothing to check")

	r = f.run(t, "release", "--container", idRogue[:12], "--reason", "rogue stopped", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	var v struct {
		DryRun           bool              `json:"dry_run"`
		Released         []json.RawMessage `json:"released"`
		ConflictsCleared []struct {
			Device, Index, ContainerID string
		} `json:"conflicts_cleared"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v), r.stdout)
	assert.False(t, v.DryRun)
	assert.Empty(t, v.Released)
	require.Len(t, v.ConflictsCleared, 1, r.stdout)
	assert.Equal(t, uuidGPU1, v.ConflictsCleared[0].Device)
	assert.Equal(t, "1", v.ConflictsCleared[0].Index)
	assert.Contains(t, r.stdout, `"container_id": "`+idRogue+`"`)

	st := f.state(t)
	assert.Empty(t, st.Conflicts)
	assert.Equal(t, []string{uuidGPU1}, claimedBy(st, idTrainer))
	r = f.run(t, "status", "-o", "json")
	assert.NotContains(t, r.stdout, `"kind": "conflict"`)
}

// conflictFixture: the trainer holds GPU 1 (running, pid 4242), and
// reconcile found rogue running on it too (pid 5555): a conflict record.
func conflictFixture(t *testing.T) *fixture {
	t.Helper()
	f := newFixture(t)
	gpu1 := f.dev(t, uuidGPU1)
	rogue, trainer := ownRogue, ownTrainer
	rogue.Pid, rogue.Cgroup = 5555, "/k8s.io/"+idRogue
	trainer.Pid, trainer.Cgroup = 4242, "/k8s.io/"+idTrainer
	f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
		claim(t, tx, trainer, "env", gpu1)
		tx.Reconcile(ledger.FrontEndNRI, []ledger.Holding{
			{Owner: trainer, Devices: []devices.Device{gpu1}, Source: "reconcile"},
			{Owner: rogue, Devices: []devices.Device{gpu1}, Source: "reconcile"},
		})
	})
	require.Len(t, f.state(t).Conflicts, 1)
	f.uid = 0
	return f
}

// TestReleaseConflictRecord: release --container of a container recorded
// only in a conflict (running on a GPU another holds) applies the release
// rule to it as to a holder: the record becomes its claim once the holder
// stops, so clearing it while it runs would leave the GPU free in the
// ledger with the container on it. Before, such a record was cleared
// without a check.
func TestReleaseConflictRecord(t *testing.T) {
	const on = "team-x/rogue/cuda (id e5e5e5e5e5e5) runs on GPU 1 (" + uuidGPU1 + "), which team-a/trainer-0/main (id a1a1a1a1a1a1) holds " +
		"(a conflict record: the device becomes its claim once free)"
	for _, tc := range []struct {
		name    string
		args    []string
		exited  bool // the rogue's cgroup is empty
		idle    bool // release_requires_idle
		code    int
		stderr  []string
		cleared bool
	}{
		{name: "running: refused", args: []string{"--reason", "cleanup"}, code: ExitError,
			stderr: []string{"release refused: " + on + ", and is still running (pid 5555); stop it first, or add --force"}},
		{name: "running, dry run: refused", args: []string{"--reason", "cleanup", "--dry-run"}, code: ExitError,
			stderr: []string{"release refused: " + on + ", and is still running (pid 5555)"}},
		{name: "running, forced", args: []string{"--reason", "cleanup", "--force"}, code: ExitOK, cleared: true,
			stderr: []string{"warning: --force: " + on + ", and is still running (pid 5555); released anyway"}},
		{name: "exited", exited: true, args: []string{"--reason", "cleanup"}, code: ExitOK, cleared: true},
		{name: "exited under release_requires_idle: refused", exited: true, idle: true, args: []string{"--reason", "cleanup"}, code: ExitError,
			stderr: []string{"release refused: " + on + ", and exited (cgroup gone), but under release_requires_idle its processes are not known " +
				"to have left the GPU; leave the record", "or add --force if you know they are gone"}},
		{name: "exited under release_requires_idle, forced", exited: true, idle: true, args: []string{"--reason", "cleanup", "--force"},
			code: ExitOK, cleared: true, stderr: []string{"warning: --force: " + on + ", and exited (cgroup gone)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := conflictFixture(t)
			if tc.idle {
				appendConfig(t, f, "[observe]\nrelease_requires_idle = true\nidle_grace = \"10m\"\n")
			}
			if tc.exited {
				f.liveness[idRogue] = "cgroup gone"
			}
			before := f.state(t)
			r := f.run(t, append([]string{"release", "--container", idRogue[:12]}, tc.args...)...)
			require.Equal(t, tc.code, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			for _, s := range tc.stderr {
				assert.Contains(t, r.stderr, s)
			}
			if !tc.cleared {
				require.Equal(t, before, f.state(t), "a refused or dry release changes nothing")
				// The trainer stops: the rogue, still running, holds GPU 1.
				f.update(t, now, func(tx *ledger.Tx) { tx.Release(idTrainer, "stop") })
				assert.Equal(t, []string{uuidGPU1}, claimedBy(f.state(t), idRogue))
				return
			}
			assert.Empty(t, f.state(t).Conflicts)
			assert.Contains(t, r.stdout, "cleared the conflict record(s) of container "+idRogue)
		})
	}
}

// A conflict record that changed between the check and the release (the
// container recorded on another device, or another incarnation of it) is
// not cleared.
func TestConflictsUnchanged(t *testing.T) {
	gpu1 := devices.Device{UUID: uuidGPU1, Index: "1", Kind: devices.KindGPU}
	gpu2 := devices.Device{UUID: uuidGPU2, Index: "2", Kind: devices.KindGPU}
	rogue := ownRogue
	rogue.Pid = 5555
	restarted := rogue
	restarted.Pid = 6666
	checked := []ledger.Conflict{{Device: gpu1, Owner: rogue}}
	require.NoError(t, conflictsUnchanged(checked, checked))
	require.NoError(t, conflictsUnchanged(nil, checked), "cleared meanwhile: nothing left to clear")
	for _, now := range [][]ledger.Conflict{
		{{Device: gpu1, Owner: rogue}, {Device: gpu2, Owner: rogue}},
		{{Device: gpu1, Owner: restarted}},
	} {
		err := conflictsUnchanged(now, checked)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "team-x/rogue/cuda")
		assert.Contains(t, err.Error(), "changed since it was checked")
	}
}

// TestStoppedHolderIsNotStale: under release_on = "remove" a holder the
// daemon saw stop keeps its claim by policy: status needs no attention and gc
// leaves it alone.
func TestStoppedHolderIsNotStale(t *testing.T) {
	f := newFixture(t)
	f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
		claim(t, tx, ownTrainer, "env", f.dev(t, uuidGPU1))
		require.True(t, tx.SetStarted(idTrainer, 10, 0, "/k8s.io/"+idTrainer))
		require.True(t, tx.MarkStopped(idTrainer))
	})
	f.liveness[idTrainer] = "cgroup gone"
	r := f.run(t, "status", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stdout)
	assert.Contains(t, r.stdout, `"stopped_at": "2026-03-01T11:00:00Z"`)
	r = f.run(t, "gc")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Equal(t, "nothing to release\n", r.stdout)
	assert.Equal(t, []string{uuidGPU1}, claimedBy(f.state(t), idTrainer))
}

// TestLockedLedger: while another process holds the ledger lock, reads still
// answer (they never take it) and a release fails after lock_timeout with an
// error naming the lock, changing nothing.
func TestLockedLedger(t *testing.T) {
	f := newFixture(t)
	f.populate(t)
	cfg, err := os.ReadFile(f.config)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(f.config, []byte(strings.Replace(string(cfg), "[ledger]\n", "[ledger]\nlock_timeout = \"20ms\"\n", 1)), 0o600))
	lock := flock.New(filepath.Join(f.dir, "ledger.lock"))
	locked, err := lock.TryLock()
	require.NoError(t, err)
	require.True(t, locked)
	defer func() { _ = lock.Unlock() }()

	for cmd, want := range map[string]string{"status": idTrainer[:12], "claims": idTrainer[:12], "queue": "team-f/w1/main"} {
		r := f.run(t, cmd)
		require.NotEqual(t, ExitError, r.code, "%s: %s", cmd, r.stderr)
		assert.Contains(t, r.stdout, want, cmd)
	}
	before := f.state(t)
	r := f.run(t, "release", "--container", idTrainer, "--reason", "x", "--force")
	require.Equal(t, ExitError, r.code)
	assert.Contains(t, r.stderr, "ledger lock")
	assert.Contains(t, r.stderr, "retry in a moment")
	require.Equal(t, before, f.state(t))
}

// gc's finding about an exited incarnation keeps a claim of the same id
// that records no process start (created and not started yet, or a pid
// without its start time): it may be another container, and the release
// rule keeps such a holder. The dry run says the same.
func TestGCKeepsAnIncarnationWithoutARecordedProcess(t *testing.T) {
	dead := ledger.Owner{ContainerID: "train", FrontEnd: ledger.FrontEndHook, Pid: 100, PidStart: 1, Cgroup: "/a/train", StartedAt: now.Add(-time.Hour)}
	for _, tc := range []struct {
		name  string
		other ledger.Owner
	}{
		{"not started", ledger.Owner{ContainerID: "train", FrontEnd: ledger.FrontEndHook}},
		{"no pid start time", ledger.Owner{ContainerID: "train", FrontEnd: ledger.FrontEndHook, Pid: 200, Cgroup: "/b/train", StartedAt: now.Add(-time.Hour)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
				claim(t, tx, tc.other, "env", f.dev(t, uuidGPU1))
				claim(t, tx, dead, "env", f.dev(t, uuidGPU2))
			})
			f.uid = 0
			dry := runLive(f, pidsExited{100: "pid 100 gone"}, "gc", "--dry-run")
			require.Equal(t, ExitOK, dry.code, dry.stderr)
			assert.NotContains(t, dry.stdout, "GPU 1 ", "the dry run lists only the exited incarnation's claims")
			r := runLive(f, pidsExited{100: "pid 100 gone"}, "gc")
			require.Equal(t, ExitOK, r.code, r.stderr)
			held := map[string]bool{}
			for _, c := range f.state(t).Claims {
				held[c.Device.UUID] = true
			}
			assert.Equal(t, map[string]bool{uuidGPU1: true}, held, "GPU 2 released, GPU 1 kept")
		})
	}
}

// TestReleaseDeviceAmbiguousIndex: an index that names two claimed devices
// (a stale claim on a MIG instance gone with a layout change keeps the index
// a live instance has now) is refused, dry run or not, naming both devices
// and holders; each UUID still releases only its own claim.
func TestReleaseDeviceAmbiguousIndex(t *testing.T) {
	gone := devices.Device{UUID: uuidGoneMIG, Index: "0:1", Kind: devices.KindMIG, Parent: uuidGPU0}
	for _, tc := range []struct {
		name     string
		args     []string
		code     int
		stderr   []string
		released string // device UUID whose claim must be gone
	}{
		{name: "index", args: []string{"release", "--device", "0:1", "--reason", "x"}, code: ExitUsage,
			stderr: []string{`device index "0:1" names 2 claimed devices`, "MIG 0:1 (" + uuidGoneMIG + ") held by container f6f6f6f6f6f6 (team-z/ghost/app by its own annotations, unverified)",
				"MIG 0:1 (" + uuidMIG1 + ") held by container " + idHook[:12], "give the UUID"}},
		{name: "index, dry run", args: []string{"release", "--device", "0:1", "--reason", "x", "--dry-run"}, code: ExitUsage,
			stderr: []string{`device index "0:1" names 2 claimed devices`, uuidGoneMIG, uuidMIG1, "give the UUID"}},
		{name: "index, dry run, json", args: []string{"release", "--device", "0:1", "--reason", "x", "--dry-run", "-o", "json"}, code: ExitUsage,
			stderr: []string{`device index "0:1" names 2 claimed devices`}},
		{name: "the stale claim's UUID", args: []string{"release", "--device", uuidGoneMIG, "--reason", "MIG layout changed"},
			code: ExitOK, released: uuidGoneMIG},
		{name: "the live claim's UUID", args: []string{"release", "--device", strings.ToLower(uuidMIG1), "--reason", "x"},
			code: ExitOK, released: uuidMIG1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
				claim(t, tx, ownGhost, "cdi", gone)
				claim(t, tx, ownHook, "cdi", f.dev(t, uuidMIG1))
			})
			before := f.state(t)
			r := f.run(t, tc.args...)
			require.Equal(t, tc.code, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			for _, s := range tc.stderr {
				assert.Contains(t, r.stderr, s)
			}
			after := map[string]bool{}
			for _, c := range f.state(t).Claims {
				after[c.Device.UUID] = true
			}
			for _, c := range before.Claims {
				assert.Equal(t, c.Device.UUID != tc.released, after[c.Device.UUID], "claim on %s", c.Device.UUID)
			}
		})
	}
}
