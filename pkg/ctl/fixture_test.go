// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"flag"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/syncbuf"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata")

// now is the fixed "current time" of every test.
var now = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

const bootID = "7d0f3c52-boot-test"

// Devices of the fixture inventory.
const (
	uuidGPU0 = "GPU-0a0a0a0a-0000-4000-8000-000000000000"
	uuidGPU1 = "GPU-1b1b1b1b-0000-4000-8000-000000000001"
	uuidGPU2 = "GPU-2c2c2c2c-0000-4000-8000-000000000002"
	uuidGPU3 = "GPU-3d3d3d3d-0000-4000-8000-000000000003"
	uuidMIG0 = "MIG-a0a0a0a0-0000-4000-8000-00000000a000"
	uuidMIG1 = "MIG-a1a1a1a1-0000-4000-8000-00000000a001"
	// uuidGone is claimed but not in the inventory (a GPU that was removed).
	uuidGone = "GPU-deadbeef-0000-4000-8000-0000000000ff"
)

// Container ids of the fixture.
var (
	idTrainer = strings.Repeat("a1", 32) // team-a/trainer-0/main on GPU 1 (running)
	idHook    = strings.Repeat("b2", 32) // hook container on MIG 0:1
	idStale   = strings.Repeat("c3", 32) // team-c/batch/job on GPU 2 (exited)
	idOld     = strings.Repeat("d4", 32) // team-d/old/app, released: GPU 3 reserved
	idRogue   = strings.Repeat("e5", 32) // team-x/rogue/cuda, found on GPU 1 at reconcile
	idGhost   = strings.Repeat("f6", 32) // holds the GPU that is gone
)

func fixtureGPUs() []devices.GPU {
	return []devices.GPU{
		{Index: 0, UUID: uuidGPU0, Minor: 0, Model: "NVIDIA A100-SXM4-80GB", MemoryMiB: 81920, BusID: "00000000:07:00.0",
			MIG: []devices.MIG{
				{Index: 0, UUID: uuidMIG0, GI: 1, CI: 0, ParentUUID: uuidGPU0, ParentIndex: 0, MemoryMiB: 9856},
				{Index: 1, UUID: uuidMIG1, GI: 2, CI: 0, ParentUUID: uuidGPU0, ParentIndex: 0, Model: "NVIDIA A100-SXM4-80GB MIG 1g.10gb", MemoryMiB: 9856},
			}},
		{Index: 1, UUID: uuidGPU1, Minor: 1, Model: "NVIDIA A100-SXM4-80GB", MemoryMiB: 81920, BusID: "00000000:0F:00.0"},
		{Index: 2, UUID: uuidGPU2, Minor: 2, Model: "NVIDIA A100-SXM4-80GB", MemoryMiB: 81920, BusID: "00000000:47:00.0"},
		{Index: 3, UUID: uuidGPU3, Minor: 4, Model: "NVIDIA A100-SXM4-80GB", MemoryMiB: 81920, BusID: "00000000:4E:00.0"},
	}
}

// fakeLiveness reports the listed container ids as exited; a holder is named
// by the last element of its cgroup path ("/k8s.io/<container id>"), or,
// when it records no cgroup, by "pid:<pid>".
type fakeLiveness map[string]string

func (f fakeLiveness) Exited(p liveness.Process) (bool, string) {
	key := path.Base(p.Cgroup)
	if p.Cgroup == "" {
		key = "pid:" + strconv.Itoa(p.Pid)
	}
	why, ok := f[key]
	return ok, why
}

// fixture is a state dir with a configuration, an inventory cache and a
// ledger, and the Env to run gpu-guard-ctl against them.
type fixture struct {
	dir      string // state dir
	config   string // configuration file
	inv      *devices.Inventory
	clock    time.Time
	liveness fakeLiveness
	uid      int
	getenv   map[string]string
}

// newFixture writes the configuration and the inventory cache; the ledger
// starts empty.
func newFixture(t testing.TB) *fixture {
	t.Helper()
	base := t.TempDir()
	f := &fixture{
		dir:      filepath.Join(base, "state"),
		config:   filepath.Join(base, "config.toml"),
		clock:    now,
		liveness: fakeLiveness{},
		getenv:   map[string]string{},
	}
	require.NoError(t, os.Mkdir(f.dir, 0o700))
	// The host of a default configuration (source "auto") whose daemon
	// enumerated the GPUs through NVML and wrote the cache. proc_root has no
	// /proc/driver/nvidia, so that a test without the cache never finds the
	// GPUs of the machine it runs on there.
	cfg := "version = 1\n[ledger]\ndir = \"" + f.dir + "\"\n[devices]\nsource = \"auto\"\nproc_root = \"" +
		filepath.Join(base, "proc") + "\"\n" + staticTOML(fixtureGPUs()) +
		// No runtime state: recover must not adopt the containers of the
		// machine the tests run on.
		"[hook]\nruntime_roots = []\n"
	require.NoError(t, os.WriteFile(f.config, []byte(cfg), 0o600))
	inv, err := devices.NewInventory("nvml", fixtureGPUs())
	require.NoError(t, err)
	f.inv = inv
	cache := filepath.Join(f.dir, devices.CacheFile)
	require.NoError(t, devices.SaveCache(cache, inv, bootID))
	require.NoError(t, os.Chtimes(cache, now.Add(-26*time.Hour), now.Add(-26*time.Hour)))
	return f
}

// staticTOML lists gpus as [[devices.static]] entries.
func staticTOML(gpus []devices.GPU) string {
	var b strings.Builder
	for _, g := range gpus {
		b.WriteString("[[devices.static]]\n")
		b.WriteString("index = " + strconv.Itoa(g.Index) + "\nuuid = \"" + g.UUID + "\"\nminor = " + strconv.Itoa(g.Minor) + "\n")
		b.WriteString("model = \"" + g.Model + "\"\n")
		for _, m := range g.MIG {
			b.WriteString("  [[devices.static.mig]]\n  index = " + strconv.Itoa(m.Index) + "\n  uuid = \"" + m.UUID + "\"\n  gi = " + strconv.Itoa(m.GI) + "\n  ci = " + strconv.Itoa(m.CI) + "\n")
		}
	}
	return b.String()
}

// setSource rewrites the fixture's devices.source.
func (f *fixture) setSource(t testing.TB, source string) {
	t.Helper()
	cfg, err := os.ReadFile(f.config)
	require.NoError(t, err)
	next := regexp.MustCompile(`(?m)^source = "[a-z]*"$`).ReplaceAllString(string(cfg), `source = "`+source+`"`)
	require.NotEqual(t, string(cfg), next, "the fixture's configuration names a source")
	require.NoError(t, os.WriteFile(f.config, []byte(next), 0o600))
}

// ledgerOpts are the options every test ledger is opened with.
func (f *fixture) ledgerOpts(cfgAuditMax int64) ledger.Options {
	return ledger.Options{
		Now:           func() time.Time { return f.clock },
		BootID:        bootID,
		AuditMaxBytes: cfgAuditMax,
	}
}

// update runs fn in one ledger transaction at time at.
func (f *fixture) update(t testing.TB, at time.Time, fn func(tx *ledger.Tx)) {
	t.Helper()
	f.clock = at
	l, err := ledger.Open(f.dir, f.ledgerOpts(0))
	require.NoError(t, err)
	require.NoError(t, l.Update(context.Background(), func(tx *ledger.Tx) error {
		fn(tx)
		return nil
	}))
	f.clock = now
}

func (f *fixture) dev(t testing.TB, uuid string) devices.Device {
	t.Helper()
	d, ok := f.inv.Lookup(uuid)
	require.True(t, ok, uuid)
	return d
}

func owner(id, ns, pod, ctr string, fe ledger.FrontEnd) ledger.Owner {
	o := ledger.Owner{ContainerID: id, Namespace: ns, Pod: pod, Container: ctr, FrontEnd: fe}
	if pod != "" {
		o.PodUID = "uid-" + pod
	}
	return o
}

func key(o ledger.Owner) string {
	if o.PodUID != "" {
		return o.Namespace + "/" + o.PodUID + "/" + o.Container
	}
	return o.ContainerID
}

// Owners of the fixture.
var (
	ownTrainer = owner(idTrainer, "team-a", "trainer-0", "main", ledger.FrontEndNRI)
	ownHook    = owner(idHook, "", "", "", ledger.FrontEndHook)
	ownStale   = owner(idStale, "team-c", "batch", "job", ledger.FrontEndNRI)
	ownOld     = owner(idOld, "team-d", "old", "app", ledger.FrontEndNRI)
	ownRogue   = owner(idRogue, "team-x", "rogue", "cuda", ledger.FrontEndNRI)
	ownGhost   = owner(idGhost, "team-z", "ghost", "app", ledger.FrontEndHook)
	ownNext    = owner(strings.Repeat("17", 32), "team-e", "next", "train", ledger.FrontEndNRI)
	ownW1      = owner(strings.Repeat("27", 32), "team-f", "w1", "main", ledger.FrontEndNRI)
	ownW2      = owner(strings.Repeat("37", 32), "team-g", "w2", "main", ledger.FrontEndNRI)
)

func claim(t testing.TB, tx *ledger.Tx, o ledger.Owner, source string, devs ...devices.Device) {
	t.Helper()
	_, err := tx.Claim(key(o), o, devs, source)
	require.NoError(t, err)
}

// populate writes the standard fixture state: every device state and every
// problem status can show.
func (f *fixture) populate(t testing.TB) {
	t.Helper()
	gpu1, gpu2, gpu3 := f.dev(t, uuidGPU1), f.dev(t, uuidGPU2), f.dev(t, uuidGPU3)
	mig1 := f.dev(t, uuidMIG1)
	gone := devices.Device{UUID: uuidGone, Index: "7", Kind: devices.KindGPU}

	f.update(t, now.Add(-3*time.Hour), func(tx *ledger.Tx) {
		claim(t, tx, ownStale, `env NVIDIA_VISIBLE_DEVICES="2"`, gpu2)
	})
	f.update(t, now.Add(-2*time.Hour), func(tx *ledger.Tx) {
		claim(t, tx, ownTrainer, `env NVIDIA_VISIBLE_DEVICES="1"`, gpu1)
	})
	f.update(t, now.Add(-90*time.Minute), func(tx *ledger.Tx) {
		claim(t, tx, ownGhost, `env NVIDIA_VISIBLE_DEVICES="`+uuidGone+`"`, gone)
	})
	f.update(t, now.Add(-50*time.Minute), func(tx *ledger.Tx) {
		claim(t, tx, ownHook, `annotation cdi.k8s.io/gpu="nvidia.com/mig=0:1"`, mig1)
	})
	f.update(t, now.Add(-30*time.Minute), func(tx *ledger.Tx) {
		claim(t, tx, ownOld, `device /dev/nvidia4 (195:4)`, gpu3)
	})
	f.update(t, now.Add(-20*time.Minute), func(tx *ledger.Tx) {
		tx.Enqueue(key(ownNext), ownNext, []devices.Device{gpu3})
	})
	f.update(t, now.Add(-14*time.Minute), func(tx *ledger.Tx) {
		tx.Enqueue(key(ownW1), ownW1, []devices.Device{gpu1})
	})
	f.update(t, now.Add(-10*time.Minute), func(tx *ledger.Tx) {
		tx.Enqueue(key(ownW2), ownW2, []devices.Device{f.dev(t, uuidGPU0), gpu1})
	})
	// containerd reconnected: every NRI container is listed, and one that
	// uses GPU 1 without a claim is recorded as a conflict.
	f.update(t, now.Add(-5*time.Minute), func(tx *ledger.Tx) {
		tx.Reconcile(ledger.FrontEndNRI, []ledger.Holding{
			{Owner: ownStale, Devices: []devices.Device{gpu2}, Source: "reconcile"},
			{Owner: ownTrainer, Devices: []devices.Device{gpu1}, Source: "reconcile"},
			{Owner: ownOld, Devices: []devices.Device{gpu3}, Source: "reconcile"},
			{Owner: ownRogue, Devices: []devices.Device{gpu1}, Source: "reconcile"},
		})
		require.True(t, tx.SetStarted(idTrainer, 4242, 0, "/k8s.io/"+idTrainer))
		require.True(t, tx.SetStarted(idStale, 999, 0, "/k8s.io/"+idStale))
	})
	f.update(t, now.Add(-3*time.Minute), func(tx *ledger.Tx) {
		tx.Enqueue(key(ownNext), ownNext, []devices.Device{gpu3})
		tx.Enqueue(key(ownW1), ownW1, []devices.Device{gpu1})
	})
	f.update(t, now.Add(-2*time.Minute), func(tx *ledger.Tx) {
		require.Len(t, tx.Release(idOld, "stop"), 1)
	})
	f.liveness[idStale] = "cgroup k8s.io/" + idStale + " has no processes"
}

// result is one run of gpu-guard-ctl.
type result struct {
	code           int
	stdout, stderr string
}

func (f *fixture) env(stdout, stderr *syncBuffer) Env {
	return Env{
		Stdout:         stdout,
		Stderr:         stderr,
		Now:            func() time.Time { return now },
		Getuid:         func() int { return f.uid },
		Getenv:         func(k string) string { return f.getenv[k] },
		Liveness:       f.liveness,
		BootID:         bootID,
		FollowInterval: time.Millisecond,
		HooksDirs:      []string{}, // not the host's
	}
}

// run runs gpu-guard-ctl with --config pointing at the fixture.
func (f *fixture) run(t testing.TB, args ...string) result {
	t.Helper()
	var stdout, stderr syncBuffer
	code := Run(context.Background(), append([]string{"--config", f.config}, args...), f.env(&stdout, &stderr))
	return result{code: code, stdout: stdout.String(), stderr: stderr.String()}
}

// state reads the ledger as the daemon would.
func (f *fixture) state(t testing.TB) ledger.State {
	t.Helper()
	l, err := ledger.OpenReadOnly(f.dir, f.ledgerOpts(0))
	require.NoError(t, err)
	st, err := l.Snapshot(context.Background())
	require.NoError(t, err)
	return st
}

// audit reads the ledger's audit log.
func (f *fixture) audit(t testing.TB) []ledger.AuditRecord {
	t.Helper()
	recs, err := ledger.ReadAudit(filepath.Join(f.dir, "audit.log"))
	require.NoError(t, err)
	return recs
}

// syncBuffer is the tests' shared output buffer (internal/syncbuf).
type syncBuffer = syncbuf.Buffer

// normalize replaces what differs between runs (temp dirs, the writer's pid
// in audit records) so that output can be compared with a golden file.
func (f *fixture) normalize(s string) string {
	s = strings.ReplaceAll(s, f.dir, "$STATE_DIR")
	s = strings.ReplaceAll(s, f.config, "$CONFIG")
	return s
}

// normalizeAuditPids replaces the writer pid of audit records (this test
// process) in JSON output.
func normalizeAuditPids(s string) string {
	return auditPidJSON.ReplaceAllString(s, `"pid": 1000`)
}

var auditPidJSON = regexp.MustCompile(`"pid": \d+`)

// golden compares got with testdata/<name>.golden, rewriting it under -update.
func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		require.NoError(t, os.MkdirAll("testdata", 0o755))
		require.NoError(t, os.WriteFile(path, []byte(got), 0o644))
		return
	}
	want, err := os.ReadFile(path)
	require.NoError(t, err, "missing golden file; run go test ./pkg/ctl -run %s -update", t.Name())
	require.Equal(t, string(want), got, "output differs from %s; if the change is intended, run with -update and review the diff", path)
}
