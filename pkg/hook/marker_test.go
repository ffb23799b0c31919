// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// markerRig runs the hook in this process over a ledger and a marker dir of
// its own, counting how often the ledger is opened.
type markerRig struct {
	t      *testing.T
	cfg    config.Config
	e      env
	opened int
	dir    string
}

func newMarkerRig(t *testing.T) *markerRig {
	r := &markerRig{t: t, cfg: staticConfig(t), dir: filepath.Join(t.TempDir(), "markers")}
	r.e = testEnv(&r.opened)
	r.e.markerDir = r.dir
	return r
}

// bundle writes a bundle whose config.json sets env and returns the OCI
// state of container id (process pid) in it.
func (r *markerRig) bundle(id string, pid int, env ...string) (state string, bundle string) {
	st := stateFor(r.t, id, pid, env...)
	var s specs.State
	require.NoError(r.t, json.Unmarshal([]byte(st), &s))
	return st, s.Bundle
}

// edit rewrites the bundle's config.json with env (and podman's default
// capabilities, as stateFor).
func (r *markerRig) edit(bundle string, env ...string) {
	data, err := json.Marshal(specs.Spec{Version: specs.Version, Process: &specs.Process{Env: env, Capabilities: podmanCaps()}})
	require.NoError(r.t, err)
	require.NoError(r.t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
}

func (r *markerRig) hook(phase, state string, stderr io.Writer) error {
	return r.e.run(context.Background(), phase, r.cfg, strings.NewReader(state), stderr)
}

func (r *markerRig) markers() []string {
	entries, err := os.ReadDir(r.dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	require.NoError(r.t, err)
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

func (r *markerRig) holders() map[string]string {
	l, err := ledger.OpenReadOnly(r.cfg.Ledger.Dir, ledger.Options{})
	require.NoError(r.t, err)
	st, err := l.Snapshot(context.Background())
	require.NoError(r.t, err)
	out := map[string]string{}
	for _, c := range st.Claims {
		out[c.Device.UUID] = c.Owner.ContainerID
	}
	return out
}

// Plain runc (create, start, delete): the bundle's config.json is edited
// after create to name no GPU. poststop still releases the claim: the marker
// create-runtime left makes it read the ledger whatever config.json says now.
func TestPoststopReleasesAfterTheBundleWasEdited(t *testing.T) {
	for _, policy := range []config.ReleaseOn{config.ReleaseOnStop, config.ReleaseOnRemove} {
		t.Run(string(policy), func(t *testing.T) {
			r := newMarkerRig(t)
			r.cfg.Policy.ReleaseOn = policy
			pid, end := containerProcess(t)
			st, bundle := r.bundle("train", pid, "NVIDIA_VISIBLE_DEVICES=1")
			require.NoError(t, r.hook(PhaseCreateRuntime, st, io.Discard))
			require.Equal(t, map[string]string{gpuUUIDs[1]: "train"}, r.holders())
			require.Len(t, r.markers(), 1, "create-runtime left a marker")

			r.edit(bundle, "PATH=/bin")
			end()
			r.opened = 0
			require.NoError(t, r.hook(PhasePoststop, st, io.Discard))
			require.Equal(t, 1, r.opened, "the marker made poststop read the ledger")
			require.Empty(t, r.holders(), "released although config.json names no GPU any more")
			require.Empty(t, r.markers(), "the marker goes once the container is settled")
		})
	}
}

// A container whose spec names no GPU and that has no marker is answered
// without opening the ledger in either phase, and leaves no marker; a
// refused container leaves none either (it has nothing in the ledger, and
// under podman gets no poststop).
func TestMarkerOnlyForContainersInTheLedger(t *testing.T) {
	r := newMarkerRig(t)
	st, _ := r.bundle("plain", os.Getpid(), "PATH=/bin")
	require.NoError(t, r.hook(PhaseCreateRuntime, st, io.Discard))
	require.NoError(t, r.hook(PhasePoststop, st, io.Discard))
	require.Zero(t, r.opened, "no ledger for a no-GPU container without a marker")
	require.NoDirExists(t, r.dir, "nothing written for it")

	h, _ := r.bundle("holder", os.Getpid(), "NVIDIA_VISIBLE_DEVICES=2")
	require.NoError(t, r.hook(PhaseCreateRuntime, h, io.Discard))
	require.Len(t, r.markers(), 1)
	late, _ := r.bundle("late", os.Getpid(), "NVIDIA_VISIBLE_DEVICES=2")
	err := r.hook(PhaseCreateRuntime, late, io.Discard)
	require.ErrorIs(t, err, guard.ErrQueued, "GPU 2 is busy")
	unknown, _ := r.bundle("unknown", os.Getpid(), "NVIDIA_VISIBLE_DEVICES=GPU-00000000-0000-4000-8000-0000000000ff")
	require.ErrorIs(t, r.hook(PhaseCreateRuntime, unknown, io.Discard), guard.ErrRejected)
	require.Equal(t, []string{markerName("holder", bundleOf(t, h))}, r.markers(), "the refused containers left none")
}

func bundleOf(t *testing.T, state string) string {
	var s specs.State
	require.NoError(t, json.Unmarshal([]byte(state), &s))
	return s.Bundle
}

// A stale marker (its container's poststop never ran) costs the next
// poststop of that container id and bundle one ledger read, which removes
// it; it makes poststop release nothing that is not the container's: the
// release is the usual one, decided by incarnation under the ledger lock.
func TestStaleMarkerOnlyCostsARead(t *testing.T) {
	r := newMarkerRig(t)
	// Another container "train" (another runtime root) runs and holds GPU 0.
	other, end := containerProcess(t)
	ost, _ := r.bundle("train", other, "NVIDIA_VISIBLE_DEVICES=0")
	require.NoError(t, r.hook(PhaseCreateRuntime, ost, io.Discard))

	// This "train" names no GPU, and a marker for it was left behind.
	st, _ := r.bundle("train", os.Getpid(), "PATH=/bin")
	var s specs.State
	require.NoError(t, json.Unmarshal([]byte(st), &s))
	require.NoError(t, newMarker(r.dir, s, r.cfg.Ledger.Dir).write())
	r.opened = 0
	var stderr bytes.Buffer
	require.NoError(t, r.hook(PhasePoststop, st, &stderr))
	require.Equal(t, 1, r.opened, "the marker made poststop read the ledger")
	require.Equal(t, map[string]string{gpuUUIDs[0]: "train"}, r.holders(), "the other train's claim is kept: its process runs")
	require.Contains(t, stderr.String(), "another container with the same id")
	require.Contains(t, r.markers(), markerName("train", s.Bundle), "kept: the ledger still shows the id")

	// Once the other train is gone, the next poststop of the id settles it
	// and the marker goes.
	end()
	require.NoError(t, r.hook(PhasePoststop, st, io.Discard))
	require.Empty(t, r.holders())
	require.NotContains(t, r.markers(), markerName("train", s.Bundle))
}

// markerThief removes a container's marker just before create-runtime's
// ledger write, as a remover (SweepMarkers, or a poststop of the same id and
// bundle) can between its steps.
type markerThief struct {
	guardAPI
	steal func()
}

func (m *markerThief) AdmitIfFree(ctx context.Context, r guard.Request) (guard.Decision, error) {
	m.steal()
	return m.guardAPI.AdmitIfFree(ctx, r)
}

// The writer checks its marker after the claim's commit and puts it back if
// a remover took it in between.
func TestMarkerPutBackAfterTheClaim(t *testing.T) {
	r := newMarkerRig(t)
	st, bundle := r.bundle("c", os.Getpid(), "NVIDIA_VISIBLE_DEVICES=3")
	mk := filepath.Join(r.dir, markerName("c", bundle))
	stolen := false
	r.e.openGuard = func(cfg config.Config, inv *devices.Inventory) (guardAPI, func(), error) {
		g, closeGuard, err := openGuard(cfg, inv)
		return &markerThief{guardAPI: g, steal: func() {
			require.NoError(t, os.Remove(mk))
			stolen = true
		}}, closeGuard, err
	}
	require.NoError(t, r.hook(PhaseCreateRuntime, st, io.Discard))
	require.True(t, stolen)
	require.FileExists(t, mk, "put back after the commit")
}

// SweepMarkers (gpu-guard-ctl gc) removes the markers of containers the
// ledger does not show, and only of its own ledger.
func TestSweepMarkers(t *testing.T) {
	r := newMarkerRig(t)
	held, _ := r.bundle("held", os.Getpid(), "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, r.hook(PhaseCreateRuntime, held, io.Discard))
	write := func(id, ledgerDir string) string {
		s := specs.State{ID: id, Bundle: filepath.Join(t.TempDir(), id)}
		require.NoError(t, newMarker(r.dir, s, ledgerDir).write())
		return markerName(id, s.Bundle)
	}
	gone := write("gone", r.cfg.Ledger.Dir)
	foreign := write("foreign", "/var/lib/other-ledger")
	require.NoError(t, os.WriteFile(filepath.Join(r.dir, markerPrefix+"garbage"), []byte("{"), 0o600))

	l, err := ledger.OpenReadOnly(r.cfg.Ledger.Dir, ledger.Options{})
	require.NoError(t, err)
	n, err := SweepMarkers(context.Background(), r.dir, r.cfg.Ledger.Dir, l.Snapshot)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	ms := r.markers()
	require.NotContains(t, ms, gone)
	require.Contains(t, ms, foreign, "another ledger's marker is left alone")
	require.Contains(t, ms, markerName("held", bundleOf(t, held)), "a container in the ledger keeps its marker")
	require.Contains(t, ms, markerPrefix+"garbage")

	// A container that appears in the ledger between the sweep's read and
	// its removal gets its marker back (the sweep reads again after).
	late := write("late", r.cfg.Ledger.Dir)
	reads := 0
	snap := func(ctx context.Context) (ledger.State, error) {
		reads++
		st, err := l.Snapshot(ctx)
		if reads == 2 {
			st.Claims = append(st.Claims, ledger.Claim{Device: devices.Device{UUID: gpuUUIDs[3]}, Owner: ledger.Owner{ContainerID: "late"}})
		}
		return st, err
	}
	n, err = SweepMarkers(context.Background(), r.dir, r.cfg.Ledger.Dir, snap)
	require.NoError(t, err)
	require.Zero(t, n)
	require.Contains(t, r.markers(), late, "put back")
}

// Marked is one stat of the default marker dir, made by the hook binary
// before it loads its configuration.
func TestMarkedStatsOnly(t *testing.T) {
	r := newMarkerRig(t)
	prev := markerDir
	markerDir = r.dir
	t.Cleanup(func() { markerDir = prev })
	st, _ := r.bundle("c", os.Getpid(), "PATH=/bin")
	in := ReadInput(strings.NewReader(st))
	require.True(t, in.NeverClaims())
	require.False(t, Marked(in))
	require.NoError(t, newMarker("", in.state, r.cfg.Ledger.Dir).write())
	require.True(t, Marked(in))
}

func TestMarkerRecordRoundTrip(t *testing.T) {
	for _, rec := range []markerRecord{
		{ID: "c1", Bundle: "/run/containers/c1/userdata", Ledger: "/var/lib/nri-gpu-guard"},
		{ID: "x", Bundle: "/odd\nbundle path", Ledger: "/l"},
	} {
		got, ok := decodeMarkerRecord(rec.encode())
		require.True(t, ok)
		require.Equal(t, rec, got)
	}
	for _, bad := range []string{"", "{}", markerHeader, markerHeader + "ledger /l\nid \nbundle /b", markerHeader + "id c\nledger /l\nbundle /b"} {
		_, ok := decodeMarkerRecord([]byte(bad))
		require.False(t, ok, "%q", bad)
	}
}
