// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gofrs/flock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	lv "github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

func uuid(i int) string { return fmt.Sprintf("GPU-00000000-0000-4000-8000-%012d", i) }
func migUUID(i int) string {
	return fmt.Sprintf("MIG-00000000-0000-4000-9000-%012d", i)
}

// inventory: GPUs 0-3 (minor = index); GPU 3 has two MIG instances 3:0, 3:1.
func inventory(t testing.TB) *devices.Inventory {
	t.Helper()
	var gpus []devices.GPU
	for i := 0; i < 4; i++ {
		g := devices.GPU{Index: i, UUID: uuid(i), Minor: i, Model: "Fake H100"}
		if i == 3 {
			g.MIG = []devices.MIG{
				{Index: 0, UUID: migUUID(0), GI: 1, CI: 0},
				{Index: 1, UUID: migUUID(1), GI: 2, CI: 0},
			}
		}
		gpus = append(gpus, g)
	}
	inv, err := devices.NewInventory("static", gpus)
	require.NoError(t, err)
	return inv
}

type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *clock) advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// liveness answers from a set of exited container ids and records which
// holders it was asked about. A holder is named by the last element of its
// cgroup path ("/k8s.io/<container id>"), as the tests record it.
type liveness struct {
	mu     sync.Mutex
	exited map[string]bool
	// only maps a cgroup (by its base name) to the one process left in it:
	// that cgroup counts as empty for a check that names that process as
	// the holder's successor (liveness.Process.Successor).
	only  map[string]int
	asked []string
}

func (l *liveness) Exited(p lv.Process) (bool, string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	id := path.Base(p.Cgroup)
	if p.Cgroup == "" {
		id = "pid:" + strconv.Itoa(p.Pid)
	}
	l.asked = append(l.asked, id)
	if l.exited[id] {
		return true, "cgroup /k8s.io/" + id + " has no processes"
	}
	if pid, ok := l.only[id]; ok && p.Successor > 0 && p.Successor == pid {
		return true, "cgroup /k8s.io/" + id + " has no process but pid " + strconv.Itoa(pid) + ", the restarted container's"
	}
	return false, "alive"
}

func (l *liveness) PidStart(pid int) (uint64, error) { return uint64(pid) * 10, nil }

type observer struct {
	mu        sync.Mutex
	decisions []guard.Decision
	released  map[string]int
	states    []ledger.State
}

func (o *observer) Decided(d guard.Decision, _ time.Duration) {
	o.mu.Lock()
	o.decisions = append(o.decisions, d)
	o.mu.Unlock()
}

func (o *observer) Released(reason string, claims []ledger.Claim) {
	o.mu.Lock()
	o.released[reason] += len(claims)
	o.mu.Unlock()
}

func (o *observer) StateChanged(st ledger.State) {
	o.mu.Lock()
	o.states = append(o.states, st)
	o.mu.Unlock()
}

type env struct {
	t     testing.TB
	cfg   config.Config
	g     *guard.Guard
	l     *ledger.Ledger
	clock *clock
	live  *liveness
	obs   *observer
}

func newEnv(t testing.TB, mutate func(*config.Config)) *env {
	t.Helper()
	cfg := config.Default()
	cfg.Ledger.Dir = filepath.Join(t.TempDir(), "state")
	cfg.Hook.RuntimeRoots = testRuntimeRoots(t)
	if mutate != nil {
		mutate(&cfg)
	}
	e := &env{t: t, cfg: cfg,
		clock: &clock{now: time.Date(2026, 5, 9, 8, 0, 0, 0, time.UTC)},
		live:  &liveness{exited: map[string]bool{}},
		obs:   &observer{released: map[string]int{}},
	}
	l, err := ledger.Open(cfg.Ledger.Dir, ledger.Options{
		LockTimeout: cfg.Ledger.LockTimeout.Duration, ReservationTTL: cfg.Policy.ReservationTTL.Duration,
		QueueTTL: cfg.Policy.QueueTTL.Duration, Now: e.clock.Now, BootID: "boot-1",
	})
	require.NoError(t, err)
	e.l = l
	e.g, err = guard.New(guard.Options{Config: cfg, Inventory: inventory(t), Ledger: l,
		Liveness: e.live, Now: e.clock.Now, Observer: e.obs})
	require.NoError(t, err)
	return e
}

// testRuntimeRoots are the runtime roots of a test: one that does not
// exist until a test says that the runtime knows a container (runtimeKnows),
// so that no test reads the host's /run/runc or /run/crun.
func testRuntimeRoots(t testing.TB) []string {
	return []string{filepath.Join(t.TempDir(), "run", "runc")}
}

// runtimeKnows makes the test's runtime root list container id, as runc
// does from its create until its delete.
func (e *env) runtimeKnows(id string) {
	e.t.Helper()
	require.NoError(e.t, os.MkdirAll(filepath.Join(e.cfg.Hook.RuntimeRoots[0], id), 0o700))
}

// ctr is a CRI container identity: pod UID "uid-<pod>".
func ctr(ns, pod, name, id string) ledger.Owner {
	return ledger.Owner{ContainerID: id, Namespace: ns, Pod: pod, PodUID: "uid-" + pod, Container: name,
		PodSandboxID: "sb-" + pod, FrontEnd: ledger.FrontEndNRI}
}

func visible(v string) devices.Request {
	return devices.Request{Env: []string{"PATH=/bin", "NVIDIA_VISIBLE_DEVICES=" + v}}
}

func (e *env) admit(o ledger.Owner, spec devices.Request) guard.Decision {
	e.t.Helper()
	d, err := e.g.Admit(context.Background(), guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: o, Spec: spec})
	require.NoError(e.t, err)
	return d
}

func (e *env) state() ledger.State {
	e.t.Helper()
	st, err := e.l.Snapshot(context.Background())
	require.NoError(e.t, err)
	return st
}

// holders maps device UUID → holding container id.
func (e *env) holders() map[string]string {
	out := map[string]string{}
	for _, c := range e.state().Claims {
		out[c.Device.UUID] = c.Owner.ContainerID
	}
	return out
}

func (e *env) waiters() []string {
	var out []string
	for _, w := range e.state().Waiters {
		out = append(out, w.Key)
	}
	return out
}

var ctx = context.Background()

func TestAdmitPolicies(t *testing.T) {
	a := ctr("ml", "a", "main", "aaaaaaaaaaaaaaaa01")
	b := ctr("ml", "b", "main", "bbbbbbbbbbbbbbbb02")
	for _, tc := range []struct {
		name   string
		mutate func(*config.Config)
		// first is admitted before the request under test (nil = none).
		first      devices.Request
		spec       devices.Request
		owner      ledger.Owner
		wantResult guard.Result
		wantReason string
		wantMsg    []string
		// wantHeld: device index → holder id after the decision.
		wantHeld map[int]string
	}{
		{
			name: "free GPU is claimed", spec: visible("1"), owner: b,
			wantResult: guard.Admit, wantReason: "free", wantHeld: map[int]string{1: b.ContainerID},
		},
		{
			name:  "busy GPU named by UUID while held by index: queued with the full message",
			first: visible("1"), spec: visible(uuid(1)), owner: b,
			wantResult: guard.Queue, wantReason: "busy",
			wantMsg: []string{"GPU 1 (" + uuid(1) + ") is held by ml/a/main (id aaaaaaaaaaaa)",
				"since 2026-05-09T08:00:00Z (0s ago)", "queued at position 1 of 1, waiting 0s",
				"admitted when the holder stops and its turn comes", "Free GPUs now: 0, 2, 3"},
			wantHeld: map[int]string{1: a.ContainerID},
		},
		{
			name:   "on_conflict=reject refuses without queueing",
			mutate: func(c *config.Config) { c.Policy.OnConflict = config.ConflictReject },
			first:  visible("1"), spec: visible("1"), owner: b,
			wantResult: guard.Reject, wantReason: "busy",
			wantMsg:  []string{"GPU 1 (" + uuid(1) + ") is held by ml/a/main", `on_conflict = "reject"`},
			wantHeld: map[int]string{1: a.ContainerID},
		},
		{
			name:  "a request over several GPUs is all or nothing",
			first: visible("2"), spec: visible("1,2"), owner: b,
			wantResult: guard.Queue, wantReason: "busy", wantMsg: []string{"GPU 2 (" + uuid(2) + ") is held by ml/a/main"},
			wantHeld: map[int]string{2: a.ContainerID},
		},
		{
			name:   "exempt namespace is never checked",
			mutate: func(c *config.Config) { c.Policy.ExemptNamespaces = []string{"monitoring"} },
			first:  visible("all"), spec: visible("all"), owner: ctr("monitoring", "dcgm", "exporter", "cccc"),
			wantResult: guard.Skip, wantReason: "exempt",
			wantHeld: map[int]string{0: a.ContainerID, 1: a.ContainerID, 2: a.ContainerID, 3: a.ContainerID},
		},
		{
			name: "no GPU requested", spec: devices.Request{Env: []string{"PATH=/bin"}}, owner: b,
			wantResult: guard.Skip, wantReason: "no-gpu", wantHeld: map[int]string{},
		},
		{
			name: "void requests nothing", spec: visible("void"), owner: b,
			wantResult: guard.Skip, wantReason: "no-gpu", wantHeld: map[int]string{},
		},
		{
			name: "unknown index is refused naming the host's GPUs", spec: visible("7"), owner: b,
			wantResult: guard.Reject, wantReason: "unknown-device",
			wantMsg:  []string{`"7"`, "GPUs here: 0 (" + uuid(0) + ")"},
			wantHeld: map[int]string{},
		},
		{
			name:   "unknown_device=ignore claims the known ones",
			mutate: func(c *config.Config) { c.Policy.UnknownDevice = config.UnknownIgnore },
			spec:   visible("2,7"), owner: b,
			wantResult: guard.Admit, wantReason: "free", wantHeld: map[int]string{2: b.ContainerID},
		},
		{
			name: "all takes part in conflicts (all_devices=claim)", first: visible("2"), spec: visible("all"), owner: b,
			wantResult: guard.Queue, wantReason: "busy", wantMsg: []string{"GPU 2 (" + uuid(2) + ") is held by ml/a/main"},
			wantHeld: map[int]string{2: a.ContainerID},
		},
		{
			name:   "all_devices=reject",
			mutate: func(c *config.Config) { c.Policy.AllDevices = config.AllReject },
			spec:   visible("all"), owner: b,
			wantResult: guard.Reject, wantReason: "policy-all", wantMsg: []string{`all_devices = "reject"`},
			wantHeld: map[int]string{},
		},
		{
			name:   "all_devices=ignore",
			mutate: func(c *config.Config) { c.Policy.AllDevices = config.AllIgnore },
			first:  visible("2"), spec: visible("all"), owner: b,
			wantResult: guard.Skip, wantReason: "no-gpu", wantHeld: map[int]string{2: a.ContainerID},
		},
		{
			name:   "privileged=all claims every GPU",
			mutate: func(c *config.Config) { c.Policy.Privileged = config.PrivilegedAll },
			spec:   devices.Request{Privileged: true}, owner: b,
			wantResult: guard.Admit, wantReason: "free",
			wantHeld: map[int]string{0: b.ContainerID, 1: b.ContainerID, 2: b.ContainerID, 3: b.ContainerID},
		},
		{
			name:   "privileged=all conflicts with any holder",
			mutate: func(c *config.Config) { c.Policy.Privileged = config.PrivilegedAll },
			first:  visible("0"), spec: devices.Request{Privileged: true}, owner: b,
			wantResult: guard.Queue, wantReason: "busy", wantMsg: []string{"GPU 0 (" + uuid(0) + ") is held by ml/a/main"},
			wantHeld: map[int]string{0: a.ContainerID},
		},
		{
			name:   "privileged=reject",
			mutate: func(c *config.Config) { c.Policy.Privileged = config.PrivilegedReject },
			spec:   devices.Request{Privileged: true}, owner: b,
			wantResult: guard.Reject, wantReason: "policy-privileged", wantHeld: map[int]string{},
		},
		{
			name:  "device node /dev/nvidia1 (195:1) conflicts with index 1",
			first: visible("1"),
			spec: devices.Request{Devices: []devices.LinuxDevice{
				{Path: "/dev/nvidiactl", Type: "c", Major: 195, Minor: 255},
				{Path: "/dev/nvidia1", Type: "c", Major: 195, Minor: 1}}},
			owner: b, wantResult: guard.Queue, wantReason: "busy", wantMsg: []string{"GPU 1 (" + uuid(1) + ")"},
			wantHeld: map[int]string{1: a.ContainerID},
		},
		{
			name: "CDI annotation conflicts with env", first: visible("2"),
			spec:  devices.Request{Annotations: map[string]string{"cdi.k8s.io/gpu": "nvidia.com/gpu=2"}},
			owner: b, wantResult: guard.Queue, wantReason: "busy", wantHeld: map[int]string{2: a.ContainerID},
		},
		{
			name: "full GPU against a held MIG instance", first: visible("3:0"), spec: visible("3"), owner: b,
			wantResult: guard.Queue, wantReason: "busy",
			wantMsg: []string{"GPU 3 (" + uuid(3) + ") is held by ml/a/main (id aaaaaaaaaaaa) through MIG 3:0 (" + migUUID(0) + ")"},
		},
		{
			name: "sibling MIG instances do not conflict", first: visible("3:0"), spec: visible("3:1"), owner: b,
			wantResult: guard.Admit, wantReason: "free",
		},
		{
			name: "the same container asking again is admitted", first: visible("1"), spec: visible("1"), owner: a,
			wantResult: guard.Admit, wantReason: "free", wantHeld: map[int]string{1: a.ContainerID},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, tc.mutate)
			if tc.first.Env != nil || tc.first.Annotations != nil {
				require.Equal(t, guard.Admit, e.admit(a, tc.first).Result)
			}
			d := e.admit(tc.owner, tc.spec)
			assert.Equal(t, tc.wantResult, d.Result, d.Message)
			assert.Equal(t, tc.wantReason, d.Reason, d.Message)
			// Only an on_conflict = "reject" refusal records itself (a
			// refusal by resolution is recorded by the front end).
			assert.Equal(t, tc.wantResult == guard.Reject && tc.wantReason == "busy", d.Audited, "Audited")
			for _, m := range tc.wantMsg {
				assert.Contains(t, d.Message, m)
			}
			switch tc.wantResult {
			case guard.Admit, guard.Skip:
				require.NoError(t, d.Err())
			case guard.Queue:
				require.ErrorIs(t, d.Err(), guard.ErrQueued)
				assert.Equal(t, d.Message, d.Err().Error())
			case guard.Reject:
				require.ErrorIs(t, d.Err(), guard.ErrRejected)
			}
			if tc.wantHeld != nil {
				want := map[string]string{}
				for idx, id := range tc.wantHeld {
					want[uuid(idx)] = id
				}
				assert.Equal(t, want, e.holders())
			}
			// Only a queued decision leaves a waiter, keyed by the requester.
			var wantWaiters []string
			if tc.wantResult == guard.Queue {
				wantWaiters = []string{guard.RequesterKey(tc.owner)}
			}
			assert.Equal(t, wantWaiters, e.waiters())
			if tc.wantReason == "busy" && tc.wantResult == guard.Reject {
				recs, err := ledger.ReadAudit(e.l.AuditPath())
				require.NoError(t, err)
				last := recs[len(recs)-1]
				assert.Equal(t, guard.AuditRefuse, last.Op)
				assert.Equal(t, tc.owner.ContainerID, last.ContainerID)
				assert.Contains(t, last.Reason, "held by "+a.ContainerID)
			}
			// Every decision is reported once to the observer.
			wantDecisions := 1
			if tc.first.Env != nil || tc.first.Annotations != nil {
				wantDecisions = 2
			}
			assert.Len(t, e.obs.decisions, wantDecisions)
		})
	}
}

func TestQueueFIFOAndReservation(t *testing.T) {
	e := newEnv(t, nil)
	holder := ctr("ml", "a", "main", "holder0000000001")
	first := ctr("ml", "b", "main", "first00000000001")
	second := ctr("ml", "c", "main", "second0000000001")
	require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)

	d := e.admit(first, visible("1"))
	require.Equal(t, guard.Queue, d.Result)
	assert.Equal(t, 1, d.Position)
	e.clock.advance(10 * time.Second)
	d = e.admit(second, visible("1"))
	require.Equal(t, guard.Queue, d.Result)
	assert.Contains(t, d.Message, "queued at position 2 of 2, waiting 0s")

	// A retry keeps its place (new container id, same requester key) and
	// reports how long it has waited.
	e.clock.advance(35 * time.Second)
	retry := first
	retry.ContainerID = "first00000000002"
	d = e.admit(retry, visible("1"))
	require.Equal(t, guard.Queue, d.Result)
	assert.Contains(t, d.Message, "queued at position 1 of 2, waiting 45s")

	// The refused attempt's Stop and Remove touch neither the holder nor the
	// queue (containerd sends both for every refused create).
	require.NoError(t, e.g.Stopped(ctx, first))
	require.NoError(t, e.g.Removed(ctx, first))
	assert.Equal(t, map[string]string{uuid(1): holder.ContainerID}, e.holders())
	assert.Equal(t, []string{"ml/uid-b/main", "ml/uid-c/main"}, e.waiters())

	// The holder stops: GPU 1 is reserved for the head; the second waiter
	// is refused as "reserved for" the head, by name.
	require.NoError(t, e.g.Stopped(ctx, holder))
	d = e.admit(second, visible("1"))
	require.Equal(t, guard.Queue, d.Result)
	assert.Equal(t, "reserved", d.Reason)
	assert.Contains(t, d.Message, "GPU 1 ("+uuid(1)+") is reserved for ml/b/main (id first0000000) (earlier in the queue) until 2026-05-09T08:06:45Z")
	// A newcomer is refused the same way and queues at the tail.
	d = e.admit(ctr("ml", "z", "main", "newcomer00000001"), visible("1"))
	assert.Equal(t, "reserved", d.Reason)
	assert.Contains(t, d.Message, "position 3 of 3")

	// The head's next retry is admitted, with its wait.
	e.clock.advance(5 * time.Second)
	retry.ContainerID = "first00000000003"
	d = e.admit(retry, visible("1"))
	require.Equal(t, guard.Admit, d.Result, d.Message)
	assert.Equal(t, 50*time.Second, d.Waited)
	assert.Equal(t, map[string]string{uuid(1): retry.ContainerID}, e.holders())
	assert.Equal(t, []string{"ml/uid-c/main", "ml/uid-z/main"}, e.waiters())
}

func TestHolderLiveness(t *testing.T) {
	holder := ctr("ml", "a", "main", "holder0000000001")
	req := ctr("ml", "b", "main", "req0000000000001")

	t.Run("started holder whose cgroup is empty is released", func(t *testing.T) {
		e := newEnv(t, nil)
		require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
		require.NoError(t, e.g.Started(ctx, holder.ContainerID, 4242, "/k8s.io/"+holder.ContainerID))
		st := e.state()
		require.Len(t, st.Claims, 1)
		assert.Equal(t, 4242, st.Claims[0].Owner.Pid)
		assert.Equal(t, uint64(42420), st.Claims[0].Owner.PidStart, "pid start time recorded against pid reuse")

		e.live.exited[holder.ContainerID] = true
		d := e.admit(req, visible("1"))
		require.Equal(t, guard.Admit, d.Result, d.Message)
		assert.Equal(t, "holder-exited", d.Reason)
		assert.Equal(t, map[string]string{uuid(1): req.ContainerID}, e.holders())
		assert.Equal(t, 1, e.obs.released[guard.ReasonHolderExited])

		recs, err := ledger.ReadAudit(e.l.AuditPath())
		require.NoError(t, err)
		found := false
		for _, r := range recs {
			if r.ContainerID == holder.ContainerID && strings.HasPrefix(r.Reason, "holder exited: cgroup /k8s.io/") {
				found = true
			}
		}
		assert.True(t, found, "audit records the release as holder exited")
	})

	t.Run("only the exited incarnation of a container id is released", func(t *testing.T) {
		// Two runc roots each run a container "train" (the OCI hook
		// records each one's init process); the one on GPU 1 exited.
		e := newEnv(t, nil)
		dead, live := ctr("ml", "a", "main", "train"), ctr("ml", "c", "main", "train")
		dead.FrontEnd, dead.Pid, dead.PidStart, dead.Cgroup = ledger.FrontEndHook, 100, 1000, "/root-a/train-a"
		live.FrontEnd, live.Pid, live.PidStart, live.Cgroup = ledger.FrontEndHook, 200, 2000, "/root-b/train-b"
		require.Equal(t, guard.Admit, e.admit(dead, visible("1")).Result)
		require.Equal(t, guard.Admit, e.admit(live, visible("2")).Result)
		e.live.exited["train-a"] = true
		d := e.admit(req, visible("1"))
		require.Equal(t, guard.Admit, d.Result, d.Message)
		assert.Equal(t, map[string]string{uuid(1): req.ContainerID, uuid(2): "train"}, e.holders(),
			"the running train keeps GPU 2")
		assert.Equal(t, []string{"train-a"}, e.live.asked)
	})

	t.Run("never-started holder is not checked and keeps its claim", func(t *testing.T) {
		e := newEnv(t, nil)
		require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
		e.live.exited[holder.ContainerID] = true // would be released if asked
		d := e.admit(req, visible("1"))
		require.Equal(t, guard.Queue, d.Result)
		assert.Empty(t, e.live.asked)
	})

	t.Run("alive holder keeps its claim", func(t *testing.T) {
		e := newEnv(t, nil)
		require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
		require.NoError(t, e.g.Started(ctx, holder.ContainerID, 4242, "/k8s.io/"+holder.ContainerID))
		d := e.admit(req, visible("1"))
		require.Equal(t, guard.Queue, d.Result)
		assert.Equal(t, []string{holder.ContainerID}, e.live.asked)
	})

	t.Run("explain shows the release but writes nothing", func(t *testing.T) {
		e := newEnv(t, nil)
		require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
		require.NoError(t, e.g.Started(ctx, holder.ContainerID, 4242, "/k8s.io/"+holder.ContainerID))
		e.live.exited[holder.ContainerID] = true
		before := e.state()
		d, err := e.g.Explain(ctx, guard.Request{Owner: req, Spec: visible("1")})
		require.NoError(t, err)
		assert.Equal(t, guard.Admit, d.Result)
		assert.Equal(t, before.Generation, e.state().Generation)
		assert.Equal(t, map[string]string{uuid(1): holder.ContainerID}, e.holders())
	})
}

func TestReleaseOnRemove(t *testing.T) {
	mutate := func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove }
	old := ctr("ml", "a", "main", "old0000000000001")
	restart := ctr("ml", "a", "main", "new0000000000001")
	other := ctr("ml", "b", "main", "other00000000001")

	t.Run("stop keeps the claim; another pod still conflicts; a restart takes over", func(t *testing.T) {
		e := newEnv(t, mutate)
		require.Equal(t, guard.Admit, e.admit(old, visible("1")).Result)
		require.NoError(t, e.g.Stopped(ctx, old))
		assert.Equal(t, map[string]string{uuid(1): old.ContainerID}, e.holders())
		assert.False(t, e.state().Claims[0].Owner.StoppedAt.IsZero())

		d := e.admit(other, visible("1"))
		require.Equal(t, guard.Queue, d.Result)
		assert.Contains(t, d.Message, `kept until the container is removed: policy release_on = "remove"`)
		require.NoError(t, e.g.Withdraw(ctx, "ml/uid-b/main", "test"))

		d = e.admit(restart, visible("1"))
		require.Equal(t, guard.Admit, d.Result, d.Message)
		assert.Equal(t, "takeover", d.Reason)
		assert.Equal(t, map[string]string{uuid(1): restart.ContainerID}, e.holders())

		// Removing the old container now releases nothing of the restart.
		require.NoError(t, e.g.Removed(ctx, old))
		assert.Equal(t, map[string]string{uuid(1): restart.ContainerID}, e.holders())
	})

	t.Run("exited holder without stop event is marked stopped, then taken over", func(t *testing.T) {
		e := newEnv(t, mutate)
		require.Equal(t, guard.Admit, e.admit(old, visible("1")).Result)
		require.NoError(t, e.g.Started(ctx, old.ContainerID, 77, "/k8s.io/"+old.ContainerID))
		e.live.exited[old.ContainerID] = true
		d := e.admit(other, visible("1"))
		require.Equal(t, guard.Queue, d.Result, "under release_on=remove an exited holder keeps its GPU")
		assert.False(t, e.state().Claims[0].Owner.StoppedAt.IsZero())
		require.NoError(t, e.g.Withdraw(ctx, "ml/uid-b/main", "test"))

		d = e.admit(restart, visible("1"))
		require.Equal(t, guard.Admit, d.Result, d.Message)
		assert.Equal(t, "takeover", d.Reason)
	})

	t.Run("a restart refused for another device leaves the predecessor's claim alone", func(t *testing.T) {
		e := newEnv(t, mutate)
		require.Equal(t, guard.Admit, e.admit(old, visible("1")).Result)
		require.Equal(t, guard.Admit, e.admit(other, visible("2")).Result)
		require.NoError(t, e.g.Stopped(ctx, old))

		refused := restart
		refused.ContainerID = "new0000000000000"
		d := e.admit(refused, visible("1,2"))
		require.Equal(t, guard.Queue, d.Result, d.Message)
		assert.Equal(t, map[string]string{uuid(1): old.ContainerID, uuid(2): other.ContainerID}, e.holders(),
			"no takeover without admission")
		// containerd stops and removes the refused create: the stopped
		// predecessor keeps its GPU until it is removed itself.
		require.NoError(t, e.g.Stopped(ctx, refused))
		require.NoError(t, e.g.Removed(ctx, refused))
		assert.Equal(t, old.ContainerID, e.holders()[uuid(1)])

		// Once GPU 2 is free, the restart's retry takes over GPU 1 and claims GPU 2.
		require.NoError(t, e.g.Removed(ctx, other))
		d = e.admit(restart, visible("1,2"))
		require.Equal(t, guard.Admit, d.Result, d.Message)
		assert.Equal(t, "takeover", d.Reason)
		assert.Equal(t, map[string]string{uuid(1): restart.ContainerID, uuid(2): restart.ContainerID}, e.holders())
	})

	t.Run("a restart that took over and is undone before it starts hands the claim back", func(t *testing.T) {
		e := newEnv(t, mutate)
		require.Equal(t, guard.Admit, e.admit(old, visible("1")).Result)
		require.NoError(t, e.g.Stopped(ctx, old))
		before := e.state().Claims[0]
		d := e.admit(restart, visible("1"))
		require.Equal(t, "takeover", d.Reason, d.Message)
		// A later plugin's adjustment makes the restart reach GPU 2 too:
		// refused at validation, and containerd undoes the create.
		v, err := e.g.Validate(ctx, guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: restart, Spec: visible("1,2")},
			guard.ValidateOptions{After: "95-injector"})
		require.NoError(t, err)
		require.Equal(t, guard.Reject, v.Result)
		require.NoError(t, e.g.Stopped(ctx, restart))
		require.NoError(t, e.g.Removed(ctx, restart))
		// The predecessor, stopped and not removed, holds GPU 1 as before.
		require.Len(t, e.state().Claims, 1)
		assert.Equal(t, before, e.state().Claims[0])
		assert.NotEqual(t, guard.Admit, e.admit(other, visible("1")).Result, "the GPU is still the stopped predecessor's")
		require.NoError(t, e.g.Withdraw(ctx, "ml/uid-b/main", "test"))
		// The next restart takes it over again; once it starts, its removal
		// releases the claim (the predecessor's removal ends nothing).
		again := restart
		again.ContainerID = "new0000000000002"
		require.Equal(t, "takeover", e.admit(again, visible("1")).Reason)
		require.NoError(t, e.g.Started(ctx, again.ContainerID, 88, "/k8s.io/"+again.ContainerID))
		require.NoError(t, e.g.Removed(ctx, old))
		require.NoError(t, e.g.Stopped(ctx, again))
		require.NoError(t, e.g.Removed(ctx, again))
		assert.Empty(t, e.holders())
	})

	t.Run("an undone restart whose predecessor was removed meanwhile releases the claim", func(t *testing.T) {
		e := newEnv(t, mutate)
		require.Equal(t, guard.Admit, e.admit(old, visible("1")).Result)
		require.NoError(t, e.g.Stopped(ctx, old))
		require.Equal(t, "takeover", e.admit(restart, visible("1")).Reason)
		require.NoError(t, e.g.Removed(ctx, old))
		require.NoError(t, e.g.Removed(ctx, restart))
		assert.Empty(t, e.holders(), "nobody is left to hand the claim back to")
	})

	t.Run("an undone restart hands back only to the predecessors that are still there", func(t *testing.T) {
		e := newEnv(t, mutate)
		first := ctr("ml", "a", "main", "old0000000000001")
		second := ctr("ml", "a", "main", "old0000000000002")
		require.Equal(t, guard.Admit, e.admit(first, visible("1")).Result)
		require.NoError(t, e.g.Stopped(ctx, first))
		require.Equal(t, "free", e.admit(second, visible("2")).Reason)
		require.NoError(t, e.g.Stopped(ctx, second))
		// The restart asks for both: it takes over from both predecessors.
		require.Equal(t, "takeover", e.admit(restart, visible("1,2")).Reason)
		require.NoError(t, e.g.Removed(ctx, first))
		require.NoError(t, e.g.Removed(ctx, restart))
		assert.Equal(t, map[string]string{uuid(2): second.ContainerID}, e.holders(),
			"GPU 2 back to the predecessor still there, GPU 1 to nobody")
	})

	t.Run("stop under release_on=stop releases", func(t *testing.T) {
		e := newEnv(t, nil)
		require.Equal(t, guard.Admit, e.admit(old, visible("1")).Result)
		require.NoError(t, e.g.Stopped(ctx, old))
		assert.Empty(t, e.holders())
	})
}

// An inventory that every source found empty while NVIDIA GPUs sit on the
// PCI bus (the driver not loaded yet) cannot say what "all" reaches: such a
// request is refused, not taken for one that reaches no GPU. A container
// that names no GPU is let through.
func TestAllOverAnInventoryMissingTheHostsGPUs(t *testing.T) {
	var inv devices.Inventory
	require.NoError(t, json.Unmarshal([]byte(`{"source":"nvml","gpus":[],"unlisted_gpus":2}`), &inv))
	e := newEnv(t, nil)
	g, err := guard.New(guard.Options{Config: e.cfg, Inventory: &inv, Ledger: e.l, Liveness: e.live, Now: e.clock.Now})
	require.NoError(t, err)
	admit := func(spec devices.Request) guard.Decision {
		t.Helper()
		d, err := g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: ctr("ml", "a", "main", "all0000000000001"), Spec: spec})
		require.NoError(t, err)
		return d
	}
	d := admit(visible("all"))
	assert.Equal(t, guard.Reject, d.Result)
	assert.Equal(t, "inventory-incomplete", d.Reason)
	assert.Contains(t, d.Message, "2 NVIDIA GPU(s) are on the PCI bus")
	assert.Equal(t, guard.Skip, admit(devices.Request{Env: []string{"PATH=/bin"}}).Result)
	assert.Equal(t, guard.Reject, admit(visible("0")).Result, "an index names no known GPU")
}

// A hook waiter (a --wait hook, a gpu-guard-ctl run ticket) kept a freed
// GPU reserved after its process died: the hook dropped it before asking,
// an NRI request did not and was refused "reserved" until reservation_ttl.
// Now every request drops it; a living one keeps its reservation.
func TestDeadHookReserverIsDroppedForAnyRequest(t *testing.T) {
	e := newEnv(t, nil)
	holder := ctr("ml", "h", "main", "holder0000000001")
	require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
	waiter := e.queueHookWaiter(visible("1"))
	require.NoError(t, e.g.Stopped(ctx, holder))
	require.Len(t, e.state().Reservations, 1, "GPU 1 is kept for the waiter")

	newcomer := ctr("ml", "n", "main", "newcomer00000001")
	d := e.admit(newcomer, visible("1"))
	require.Equal(t, guard.Queue, d.Result, "the waiter lives: its reservation stands")
	assert.Contains(t, d.Message, "reserved")

	e.live.exitPid(waiter.Pid)
	d = e.admit(newcomer, visible("1"))
	require.Equal(t, guard.Admit, d.Result, "%s", d.Message)
	st := e.state()
	assert.Empty(t, st.Reservations)
	for _, w := range st.Waiters {
		assert.NotEqual(t, waiter.ContainerID, w.Owner.ContainerID, "the dead waiter left the queue")
	}
	recs, err := ledger.ReadAudit(e.l.AuditPath())
	require.NoError(t, err)
	found := false
	for _, r := range recs {
		found = found || (r.Op == ledger.OpDequeue && strings.Contains(r.Reason, "waiter gone: its process 4242 exited"))
	}
	assert.True(t, found, "the drop is audited")
}

// queueHookWaiter queues an OCI hook waiter (a --wait hook, a ctl ticket)
// whose process is pid 4242, for spec's GPUs, which are busy.
func (e *env) queueHookWaiter(spec devices.Request) ledger.Owner {
	e.t.Helper()
	waiter := ledger.Owner{ContainerID: "hookwaiter000001", FrontEnd: ledger.FrontEndHook, Pid: 4242, PidStart: 42420}
	d, err := e.g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndHook, Owner: waiter, Spec: spec})
	require.NoError(e.t, err)
	require.Equal(e.t, guard.Queue, d.Result, d.Message)
	return waiter
}

// exitPid makes the process pid read as gone.
func (l *liveness) exitPid(pid int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.exited["pid:"+strconv.Itoa(pid)] = true
}

// A dead hook waiter at the head of the queue, asking for a GPU whole while
// one of its MIG instances is in use, holds no reservation but keeps the
// GPU's free instances (the keep of the queue's head): every request drops
// it, as a dead reserver, rather than be refused until queue_ttl.
func TestDeadHookHeadKeepsNoMIGInstance(t *testing.T) {
	e := newEnv(t, nil)
	holder := ctr("ml", "h", "main", "holder0000000001")
	require.Equal(t, guard.Admit, e.admit(holder, visible("3:0")).Result)
	waiter := e.queueHookWaiter(visible("3"))
	require.Empty(t, e.state().Reservations)

	newcomer := ctr("ml", "n", "main", "newcomer00000001")
	d := e.admit(newcomer, visible("3:1"))
	require.Equal(t, guard.Queue, d.Result, "the waiter lives: 3:1 is kept for it")
	assert.Contains(t, d.Message, "is kept for")

	e.live.exitPid(waiter.Pid)
	d = e.admit(newcomer, visible("3:1"))
	assert.Equal(t, guard.Admit, d.Result, "%s", d.Message)
	for _, w := range e.state().Waiters {
		assert.NotEqual(t, waiter.ContainerID, w.Owner.ContainerID, "the dead waiter left the queue")
	}
}

func TestPodGone(t *testing.T) {
	e := newEnv(t, nil)
	holder := ctr("ml", "a", "main", "holder0000000001")
	sidecar := ctr("ml", "a", "side", "side000000000001")
	w1 := ctr("ml", "b", "main", "w100000000000001")
	w2 := ctr("ml", "c", "main", "w200000000000001")
	require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
	require.Equal(t, guard.Admit, e.admit(sidecar, visible("2")).Result)
	require.Equal(t, guard.Queue, e.admit(w1, visible("1")).Result)
	require.Equal(t, guard.Queue, e.admit(w2, visible("1")).Result)
	// An OCI hook container whose annotations name the holder's pod.
	spoof := holder
	spoof.ContainerID, spoof.FrontEnd = "spoof00000000001", ledger.FrontEndHook
	_, err := e.g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndHook, Owner: spoof, Spec: visible("3")})
	require.NoError(t, err)

	// The first waiter's pod goes away: it leaves the queue.
	require.NoError(t, e.g.PodGone(ctx, ledger.FrontEndNRI, w1.PodUID, w1.PodSandboxID))
	assert.Equal(t, []string{"ml/uid-c/main"}, e.waiters())
	d := e.admit(w2, visible("1"))
	assert.Contains(t, d.Message, "position 1 of 1")

	// The holder's pod goes away: both its containers' claims go, and the
	// remaining waiter gets the GPU.
	require.NoError(t, e.g.PodGone(ctx, ledger.FrontEndNRI, holder.PodUID, ""))
	assert.Equal(t, map[string]string{uuid(3): spoof.ContainerID}, e.holders(),
		"a hook claim naming the pod in its annotations is not the pod's: it stays")
	assert.Equal(t, guard.Admit, e.admit(w2, visible("1")).Result)
	// The removed waiter never claims, even if it retries.
	require.Equal(t, guard.Queue, e.admit(w1, visible("1")).Result)
}

// A running container whose request the policy now refuses (an id the
// inventory lacks next to one it has, a privileged container under
// privileged = "reject") still reaches GPUs: Reconcile adopts what it
// reaches, or records it in conflict there, instead of leaving those GPUs
// looking free.
func TestReconcileAdoptsWhatAnUnresolvableContainerReaches(t *testing.T) {
	e := newEnv(t, func(c *config.Config) { c.Policy.Privileged = config.PrivilegedReject })
	holder := ctr("ml", "h", "main", "holder0000000001")
	require.Equal(t, guard.Admit, e.admit(holder, visible("0")).Result)

	partly := ctr("ml", "a", "main", "partly0000000001")
	sharing := ctr("ml", "b", "main", "sharing000000001")
	priv := ctr("ml", "p", "main", "priv000000000001")
	res, err := e.g.Reconcile(ctx, ledger.FrontEndNRI, []guard.Request{
		{Owner: holder, Spec: visible("0")},
		{Owner: partly, Spec: visible("1,9")},  // 9: no such GPU
		{Owner: sharing, Spec: visible("0,9")}, // on the holder's GPU
		{Owner: priv, Spec: devices.Request{Privileged: true}},
	})
	require.NoError(t, err)
	holders := e.holders()
	assert.Equal(t, holder.ContainerID, holders[uuid(0)], "the holder keeps its GPU")
	assert.Equal(t, partly.ContainerID, holders[uuid(1)], "the GPU it reaches is adopted, the unknown id skipped")
	assert.Equal(t, priv.ContainerID, holders[uuid(2)], "a privileged container reaches every GPU")
	conflicts := map[string][]string{}
	for _, c := range res.Conflicts {
		conflicts[c.Owner.ContainerID] = append(conflicts[c.Owner.ContainerID], c.Device.UUID)
	}
	assert.Equal(t, []string{uuid(0)}, conflicts[sharing.ContainerID], "sharing the holder's GPU is a conflict")
	assert.Contains(t, conflicts[priv.ContainerID], uuid(0))
	assert.Contains(t, conflicts[priv.ContainerID], uuid(1))

	// And the GPUs they reach are refused to a newcomer.
	for _, v := range []string{"1", "2"} {
		assert.NotEqual(t, guard.Admit, e.admit(ctr("ml", "n"+v, "main", "new0000000000"+v+"00"), visible(v)).Result, "GPU %s", v)
	}
}

func TestReconcile(t *testing.T) {
	e := newEnv(t, nil)
	gone := ctr("ml", "a", "main", "gone000000000001")
	kept := ctr("ml", "b", "main", "kept000000000001")
	hookClaim := ledger.Owner{ContainerID: "hook000000000001", FrontEnd: ledger.FrontEndHook}
	require.Equal(t, guard.Admit, e.admit(gone, visible("0")).Result)
	require.Equal(t, guard.Admit, e.admit(kept, visible("1")).Result)
	_, err := e.g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndHook, Owner: hookClaim, Spec: visible("3")})
	require.NoError(t, err)

	running := kept
	running.Pid, running.Cgroup = 99, "/k8s.io/"+running.ContainerID
	adopted := ctr("ml", "c", "main", "adopt00000000001")
	twin := ctr("ml", "d", "main", "twin000000000001")
	unresolvable := ctr("ml", "e", "main", "bad0000000000001")
	exempt := ctr("kube-system", "dcgm", "exporter", "exempt0000000001")
	e.cfg.Policy.ExemptNamespaces = []string{"kube-system"}
	g, err := guard.New(guard.Options{Config: e.cfg, Inventory: inventory(t), Ledger: e.l, Liveness: e.live,
		Now: e.clock.Now, Observer: e.obs})
	require.NoError(t, err)

	res, err := g.Reconcile(ctx, ledger.FrontEndNRI, []guard.Request{
		{Owner: running, Spec: visible("1")},
		{Owner: adopted, Spec: visible("2")},
		{Owner: twin, Spec: visible("1")},
		{Owner: unresolvable, Spec: visible("9")},
		{Owner: exempt, Spec: visible("all")},
	})
	require.NoError(t, err)
	require.Len(t, res.Released, 1)
	assert.Equal(t, gone.ContainerID, res.Released[0].Owner.ContainerID)
	require.Len(t, res.Adopted, 1)
	assert.Equal(t, adopted.ContainerID, res.Adopted[0].Owner.ContainerID)
	require.Len(t, res.Conflicts, 1)
	assert.Equal(t, twin.ContainerID, res.Conflicts[0].Owner.ContainerID)
	assert.Equal(t, uuid(1), res.Conflicts[0].Device.UUID)

	assert.Equal(t, map[string]string{
		uuid(1): kept.ContainerID, uuid(2): adopted.ContainerID, uuid(3): hookClaim.ContainerID,
	}, e.holders(), "hook claims are left alone; nothing goes to the exempt container")
	for _, c := range e.state().Claims {
		if c.Owner.ContainerID == kept.ContainerID {
			assert.Equal(t, 99, c.Owner.Pid, "pid filled in from the runtime")
			assert.Equal(t, uint64(990), c.Owner.PidStart)
		}
	}
	assert.Equal(t, 1, e.obs.released[guard.ReasonStale])
}

func TestReconcileKeepsClaimsOfUnresolvableContainers(t *testing.T) {
	e := newEnv(t, nil)
	holder := ctr("ml", "a", "main", "holder0000000001")
	require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
	// The policy changed since: "all" is now refused, so the container's
	// request no longer resolves. Its claim is kept (no release on doubt),
	// and the runtime gave it every GPU, which it is adopted on.
	e.cfg.Policy.AllDevices = config.AllReject
	g, err := guard.New(guard.Options{Config: e.cfg, Inventory: inventory(t), Ledger: e.l, Liveness: e.live, Now: e.clock.Now})
	require.NoError(t, err)
	res, err := g.Reconcile(ctx, ledger.FrontEndNRI, []guard.Request{{Owner: holder, Spec: visible("all")}})
	require.NoError(t, err)
	assert.Empty(t, res.Released)
	assert.Equal(t, map[string]string{uuid(0): holder.ContainerID, uuid(1): holder.ContainerID, uuid(2): holder.ContainerID,
		uuid(3): holder.ContainerID}, e.holders())

	// A request that resolves to nothing at all even so keeps its claim.
	_, err = g.Reconcile(ctx, ledger.FrontEndNRI, []guard.Request{{Owner: holder, Spec: visible("GPU-not-a-uuid,,x")}})
	require.NoError(t, err)
	assert.Equal(t, holder.ContainerID, e.holders()[uuid(1)])
}

func TestLedgerBusy(t *testing.T) {
	e := newEnv(t, func(c *config.Config) { c.Ledger.LockTimeout = config.Duration{Duration: 50 * time.Millisecond} })
	// The ledger lock is held by another process (an OCI hook, ctl).
	_, err := e.l.Snapshot(ctx) // make sure the dir exists
	require.NoError(t, err)
	lk := flock.New(e.l.LockPath())
	locked, err := lk.TryLock()
	require.NoError(t, err)
	require.True(t, locked)
	defer func() { _ = lk.Unlock() }()

	_, err = e.g.Admit(ctx, guard.Request{Owner: ctr("ml", "a", "main", "a1"), Spec: visible("1")})
	require.Error(t, err)
	assert.ErrorIs(t, err, ledger.ErrLockTimeout)
	assert.Contains(t, err.Error(), "GPU ledger busy")
	assert.Contains(t, err.Error(), "ml/a/main")

	// Requests without a GPU never touch the ledger and are not held up.
	d, err := e.g.Admit(ctx, guard.Request{Owner: ctr("ml", "a", "main", "a1"), Spec: devices.Request{}})
	require.NoError(t, err)
	assert.Equal(t, guard.Skip, d.Result)
}

func TestNewValidates(t *testing.T) {
	_, err := guard.New(guard.Options{Config: config.Default()})
	require.Error(t, err)
	_, err = guard.New(guard.Options{Config: config.Default(), Inventory: inventory(t)})
	require.Error(t, err)
}

func TestErrNilForAdmit(t *testing.T) {
	assert.NoError(t, guard.Decision{Result: guard.Admit}.Err())
	assert.NoError(t, guard.Decision{Result: guard.Skip}.Err())
	err := guard.Decision{Result: guard.Reject, Message: "m"}.Err()
	var de *guard.DecisionError
	require.True(t, errors.As(err, &de))
	assert.Equal(t, "m", de.Error())
}

// BenchmarkAdmit is one decision that claims and its release, in process
// (two ledger commits, each fsynced).
func BenchmarkAdmit(b *testing.B) {
	e := newEnv(b, nil)
	for i := 0; b.Loop(); i++ {
		o := ctr("ml", "bench", "main", fmt.Sprintf("bench%011d", i))
		d := e.admit(o, visible("1"))
		if d.Result != guard.Admit {
			b.Fatal(d.Message)
		}
		if err := e.g.Stopped(ctx, o); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRefuse is one refused (queued) request against a held GPU: the
// message is built and the waiter refreshed.
func BenchmarkRefuse(b *testing.B) {
	e := newEnv(b, nil)
	e.admit(ctr("ml", "holder", "main", "holder0000000001"), visible("1"))
	o := ctr("ml", "bench", "main", "bench0000000001")
	for b.Loop() {
		if d := e.admit(o, visible("1")); d.Result != guard.Queue {
			b.Fatal(d.Message)
		}
	}
}

// AdmitIfFree answers what Explain answers, in one locked transaction that
// records an admission as Admit does and writes nothing else: no queue
// entry, no audit record, no new generation for a busy request.
func TestAdmitIfFree(t *testing.T) {
	holder := ctr("ml", "a", "main", "holder0000000001")
	req := ctr("ml", "b", "main", "req0000000000001")
	e := newEnv(t, nil)
	d, err := e.g.AdmitIfFree(ctx, guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: holder, Spec: visible("1")})
	require.NoError(t, err)
	require.Equal(t, guard.Admit, d.Result, d.Message)
	assert.Equal(t, map[string]string{uuid(1): holder.ContainerID}, e.holders())
	require.NoError(t, e.g.Started(ctx, holder.ContainerID, 4242, "/k8s.io/"+holder.ContainerID))

	before := e.state()
	audit, err := ledger.ReadAudit(e.l.AuditPath())
	require.NoError(t, err)
	r := guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: req, Spec: visible("1")}
	want, err := e.g.Explain(ctx, r)
	require.NoError(t, err)
	d, err = e.g.AdmitIfFree(ctx, r)
	require.NoError(t, err)
	require.Equal(t, guard.Queue, d.Result)
	assert.Equal(t, want.Message, d.Message)
	assert.Equal(t, want.Position, d.Position)
	assert.ErrorIs(t, d.Err(), guard.ErrQueued)
	after := e.state()
	assert.Equal(t, before.Generation, after.Generation, "nothing written")
	assert.Empty(t, after.Waiters)
	again, err := ledger.ReadAudit(e.l.AuditPath())
	require.NoError(t, err)
	assert.Len(t, again, len(audit), "no audit record")

	// The holder exited: the same call releases it and claims, as Admit.
	e.live.exited[holder.ContainerID] = true
	d, err = e.g.AdmitIfFree(ctx, r)
	require.NoError(t, err)
	require.Equal(t, guard.Admit, d.Result, d.Message)
	assert.Equal(t, map[string]string{uuid(1): req.ContainerID}, e.holders())
	assert.Equal(t, 1, e.obs.released[guard.ReasonHolderExited])
}
