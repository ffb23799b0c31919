// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gofrs/flock"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// ticketRig is a ledger with a ticket of gpu-guard-ctl run admitted on some
// GPUs (held by this test process, as the ctl holds them).
type ticketRig struct {
	t   *testing.T
	cfg config.Config
	e   env
	id  string
}

func newTicketRig(t *testing.T, gpus string) *ticketRig {
	t.Helper()
	cfg := staticConfig(t)
	opened := 0
	tk, err := AcquireTicket(context.Background(), cfg, devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=" + gpus}}, TicketOptions{})
	require.NoError(t, err)
	return &ticketRig{t: t, cfg: cfg, e: testEnv(&opened), id: tk.ID}
}

// create runs the create-runtime hook of container id asking for gpus and
// carrying the ticket.
func (r *ticketRig) create(id, gpus string, stderr io.Writer) error {
	st := stateFor(r.t, id, os.Getpid(), "NVIDIA_VISIBLE_DEVICES="+gpus, TicketEnv+"="+r.id)
	return r.e.run(context.Background(), PhaseCreateRuntime, r.cfg, strings.NewReader(st), stderr)
}

func (r *ticketRig) state() ledger.State {
	r.t.Helper()
	l, err := ledger.OpenReadOnly(r.cfg.Ledger.Dir, ledger.Options{})
	require.NoError(r.t, err)
	st, err := l.Snapshot(context.Background())
	require.NoError(r.t, err)
	return st
}

// holders maps each held GPU's index to its holder's container id.
func (r *ticketRig) holders() map[int]string {
	out := map[int]string{}
	for _, c := range r.state().Claims {
		for i, u := range gpuUUIDs {
			if c.Device.UUID == u {
				out[i] = c.Owner.ContainerID
			}
		}
	}
	return out
}

func (r *ticketRig) audit() []ledger.AuditRecord {
	r.t.Helper()
	l, err := ledger.OpenReadOnly(r.cfg.Ledger.Dir, ledger.Options{})
	require.NoError(r.t, err)
	recs, err := ledger.ReadAudit(l.AuditPath())
	require.NoError(r.t, err)
	return recs
}

func (r *ticketRig) cordon(gpu int, source, reason string) {
	r.t.Helper()
	l, err := ledger.Open(r.cfg.Ledger.Dir, guard.LedgerOptions(r.cfg))
	require.NoError(r.t, err)
	require.NoError(r.t, l.Update(context.Background(), func(tx *ledger.Tx) error {
		_, _, err := tx.Cordon(devices.Device{Index: string(rune('0' + gpu)), UUID: gpuUUIDs[gpu]}, source, reason, "test")
		return err
	}))
}

// refusals are the refuse records of container id.
func (r *ticketRig) refusals(id string) []ledger.AuditRecord {
	var out []ledger.AuditRecord
	for _, rec := range r.audit() {
		if rec.Op == guard.AuditRefuse && rec.ContainerID == id {
			out = append(out, rec)
		}
	}
	return out
}

// A GPU cordoned after the ticket was admitted (the observer found it
// unhealthy, or an operator took it out) is not handed over: the container
// is refused as any new claim on a cordoned GPU is (exit 77, a refuse
// record, the cordon named), and the ticket keeps its claims until its
// gpu-guard-ctl run ends, which then releases them.
func TestTicketHandoverRefusesCordonedGPU(t *testing.T) {
	for _, source := range []string{ledger.CordonUnhealthy, ledger.CordonOperator} {
		t.Run(source, func(t *testing.T) {
			r := newTicketRig(t, "1,2")
			r.cordon(2, source, "Xid 79")

			err := r.create("c", "1,2", io.Discard)
			require.Error(t, err, "a cordoned GPU must not reach the container")
			require.ErrorIs(t, err, guard.ErrRejected)
			require.Equal(t, ExitPolicy, ExitCode(err))
			for _, s := range []string{"container c refused", "ticket " + r.id, "GPU 2 (" + gpuUUIDs[2] + ") is cordoned", "Xid 79",
				"gpu-guard-ctl uncordon 2", "keeps its GPUs until its gpu-guard-ctl run ends"} {
				require.Contains(t, err.Error(), s)
			}
			require.Equal(t, map[int]string{1: r.id, 2: r.id}, r.holders(), "nothing moved: the ticket keeps its claims")

			recs := r.refusals("c")
			require.Len(t, recs, 1, "one refuse record")
			require.Equal(t, r.id, recs[0].Key, "keyed by the ticket, for gpu-guard-ctl run to quote")
			require.Equal(t, string(ledger.FrontEndHook), recs[0].FrontEnd)
			require.Contains(t, recs[0].Reason, "refused (cordoned): ")
			require.Contains(t, recs[0].Reason, "is cordoned")
			cause, ok := TicketRefusal(r.cfg, r.id)
			require.True(t, ok)
			require.Contains(t, cause, "container c was refused")
			require.Contains(t, cause, "is cordoned")

			rel, err := ReleaseTicket(context.Background(), r.cfg, r.id)
			require.NoError(t, err)
			require.Len(t, rel, 2, "the ctl's end releases the ticket's claims")
			require.Empty(t, r.holders())

			// A container that asks only for the GPU that is not cordoned
			// gets it from a fresh ticket.
			r2 := newTicketRig(t, "1")
			require.NoError(t, r2.create("d", "1", io.Discard))
			require.Equal(t, map[int]string{1: "d"}, r2.holders())
		})
	}
}

// A container that asks for a GPU its ticket does not hold is refused by
// policy (exit 77) and leaves a refuse record, as every refusal does.
func TestTicketMismatchIsAuditedRefusal(t *testing.T) {
	r := newTicketRig(t, "1")
	err := r.create("c", "1,2", io.Discard)
	require.Error(t, err)
	require.ErrorIs(t, err, guard.ErrRejected)
	require.Equal(t, ExitPolicy, ExitCode(err))
	for _, s := range []string{"container c refused", "its ticket " + r.id, "holds GPU 1 (" + gpuUUIDs[1] + ")",
		"also asks for GPU 2 (" + gpuUUIDs[2] + ")", "name the same GPUs"} {
		require.Contains(t, err.Error(), s)
	}
	require.Equal(t, map[int]string{1: r.id}, r.holders())
	recs := r.refusals("c")
	require.Len(t, recs, 1, "the refusal leaves a refuse record")
	require.Equal(t, r.id, recs[0].Key)
	require.Contains(t, recs[0].Reason, "refused (ticket-mismatch): ")
	require.ElementsMatch(t, []string{gpuUUIDs[1], gpuUUIDs[2]}, recs[0].Devices)

	cause, ok := TicketRefusal(r.cfg, r.id)
	require.True(t, ok)
	require.Contains(t, cause, "container c was refused")
	require.Contains(t, cause, "also asks for GPU 2")
}

// A container that asks for part of its ticket's GPUs takes those over; the
// others are released (audited) at once rather than held idle for the
// container's life.
func TestTicketHandoverOfASubset(t *testing.T) {
	r := newTicketRig(t, "0,1,2")
	var stderr bytes.Buffer
	require.NoError(t, r.create("c", "1", &stderr))
	require.Equal(t, map[int]string{1: "c"}, r.holders(), "c holds what it asked for; GPUs 0 and 2 are free again")
	require.Contains(t, stderr.String(), "released GPU 0 ("+gpuUUIDs[0]+"), GPU 2 ("+gpuUUIDs[2]+") of the ticket, which the container does not ask for")

	var released []string
	for _, rec := range r.audit() {
		if rec.Op == ledger.OpRelease && rec.ContainerID == r.id {
			require.Contains(t, rec.Reason, "handed over to container c, which does not ask for this GPU")
			released = append(released, rec.Devices...)
		}
	}
	require.ElementsMatch(t, []string{gpuUUIDs[0], gpuUUIDs[2]}, released)
	rel, err := ReleaseTicket(context.Background(), r.cfg, r.id)
	require.NoError(t, err)
	require.Empty(t, rel)
	_, ok := TicketRefusal(r.cfg, r.id)
	require.False(t, ok, "nothing refused")
}

// A container may not take the id of a ticket: the release rule ends a
// ticket's claim as soon as its process is gone, whatever release_on and
// release_requires_idle say (guard.IsTicket), so such a container's claim
// would skip both. One that names no GPU is let through as any other.
func TestContainerWithATicketIDIsRefused(t *testing.T) {
	cfg := staticConfig(t)
	opened := 0
	e := testEnv(&opened)
	id := guard.NewTicketID()
	st := stateFor(t, id, os.Getpid(), "NVIDIA_VISIBLE_DEVICES=1")
	err := e.run(context.Background(), PhaseCreateRuntime, cfg, strings.NewReader(st), io.Discard)
	require.Error(t, err)
	require.ErrorContains(t, err, "reserved for the tickets of gpu-guard-ctl run")
	require.Equal(t, ExitPolicy, ExitCode(err), "refused by policy")
	l, err := ledger.OpenReadOnly(cfg.Ledger.Dir, ledger.Options{})
	require.NoError(t, err)
	snap, err := l.Snapshot(context.Background())
	require.NoError(t, err)
	require.Empty(t, snap.Claims, "nothing claimed")
	recs, err := ledger.ReadAudit(l.AuditPath())
	require.NoError(t, err)
	refused := false
	for _, rec := range recs {
		refused = refused || (rec.Op == guard.AuditRefuse && rec.ContainerID == id && strings.Contains(rec.Reason, "reserved-id"))
	}
	require.True(t, refused, "the refusal leaves a refuse record, as every refusal does (crun shows only the exit code)")

	st = stateFor(t, id, os.Getpid(), "NVIDIA_VISIBLE_DEVICES=void")
	require.NoError(t, e.run(context.Background(), PhaseCreateRuntime, cfg, strings.NewReader(st), io.Discard))
}

// specWith writes a bundle whose config.json carries env and the guard's
// createRuntime hook (args) with a timeout of timeoutSec, and returns the
// OCI state of container id in it.
func specWith(t *testing.T, id string, args []string, timeoutSec int, env ...string) string {
	t.Helper()
	bundle := t.TempDir()
	spec := specs.Spec{Version: specs.Version, Process: &specs.Process{Env: env, Capabilities: podmanCaps()}, Hooks: &specs.Hooks{
		CreateRuntime: []specs.Hook{{Path: "/usr/bin/nri-gpu-guard-hook", Args: args, Timeout: &timeoutSec}},
	}}
	data, err := json.Marshal(spec)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
	st, err := json.Marshal(specs.State{Version: specs.Version, ID: id, Status: specs.StateCreating, Pid: os.Getpid(), Bundle: bundle})
	require.NoError(t, err)
	return string(st)
}

// lockClock is the hook's clock in the hand-over tests below: it stands
// still but for each wait for a ledger lock another process holds
// (ledger.Options.BeforeLockWait), which moves it to the next of steps, or,
// past the last, an hour on. So the hook's deadlines pass after a known
// number of lock waits, however long a wait takes in real time.
type lockClock struct {
	fakeClock
	steps []time.Time
	// began is the clock's time at the start of each wait.
	began []time.Time
}

func (c *lockClock) lockWait() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.began = append(c.began, c.t)
	if n := len(c.began); n <= len(c.steps) {
		c.t = c.steps[n-1]
	} else {
		c.t = c.t.Add(time.Hour)
	}
}

// waitsBefore counts the lock waits that began before t.
func (c *lockClock) waitsBefore(t time.Time) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, b := range c.began {
		if b.Before(t) {
			n++
		}
	}
	return n
}

func (c *lockClock) waits() []time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.began)
}

// String tells when the first waits began, after t0.
func (c *lockClock) String() string {
	w := c.waits()
	var b strings.Builder
	fmt.Fprintf(&b, "%d lock waits, begun at t0", len(w))
	for i, at := range w[:min(len(w), 5)] {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, " +%s", at.Sub(t0))
	}
	return b.String()
}

// handoverClock is the clock of a create-runtime hook started at t0 whose
// timeout in config.json is timeout (1 h: a deadline on this clock is never
// reached in real time, so only the hook's reading of its clock ends the
// hand-over): the hand-over's first lock wait takes it to the middle of
// its time, the second to its deadline (decideBy, hookAnswerMargin before
// the kill), a third (the refusal's record) one second on, still before the
// kill. The hook's guard calls it before each lock wait.
func handoverClock(r *ticketRig, timeout time.Duration) *lockClock {
	decideBy := t0.Add(timeout - hookAnswerMargin)
	c := &lockClock{fakeClock: fakeClock{t: t0}, steps: []time.Time{t0.Add(timeout / 2), decideBy, decideBy.Add(time.Second)}}
	r.e.now = c.now
	r.e.openGuard = func(cfg config.Config, inv *devices.Inventory) (guardAPI, func(), error) {
		return openGuardWith(cfg, inv, c.lockWait)
	}
	return c
}

// A ticket's hand-over is a ledger write like any other of the hook: with
// the ledger lock held elsewhere it is retried only until the hook's own
// deadline (its timeout in config.json less the answer margin, counted from
// the hook's start, on the hook's clock), and the container is refused in
// the guard's words before the runtime kills the hook, with or without
// --wait. The refuse record that cannot be written meanwhile is dropped,
// and said so.
func TestTicketHandoverEndsBeforeTheHookIsKilled(t *testing.T) {
	for _, wait := range []bool{true, false} {
		t.Run(fmt.Sprintf("wait=%v", wait), func(t *testing.T) {
			r := newTicketRig(t, "1")
			r.cfg.Ledger.LockTimeout = config.Duration{Duration: 50 * time.Millisecond}
			args := []string{"nri-gpu-guard-hook", "create-runtime"}
			if wait {
				args = append(args, "--wait")
			}
			const timeout = time.Hour
			st := specWith(t, "c", args, int(timeout/time.Second), "NVIDIA_VISIBLE_DEVICES=1", TicketEnv+"="+r.id)
			clock := handoverClock(r, timeout)
			r.e.opts = Options{Wait: wait, Started: t0}
			r.e.lockingEngine = func() (bool, string) { return false, "" }

			lock := flock.New(filepath.Join(r.cfg.Ledger.Dir, "ledger.lock"))
			require.NoError(t, lock.Lock())
			var stderr bytes.Buffer
			err := r.e.run(context.Background(), PhaseCreateRuntime, r.cfg, strings.NewReader(st), &stderr)
			answered := r.e.now()
			require.NoError(t, lock.Unlock())

			require.Error(t, err)
			require.Contains(t, err.Error(), "its ticket "+r.id+" could not be handed over before the timeout of this hook in the container's config.json (1h0m0s, less 2s to answer)")
			require.ErrorIs(t, err, ledger.ErrLockTimeout)
			require.Equal(t, ExitRefused, ExitCode(err))
			decideBy := t0.Add(timeout - hookAnswerMargin)
			require.Equal(t, 2, clock.waitsBefore(decideBy), "the hand-over waits for the lock until its deadline, and no more: %s", clock)
			require.LessOrEqual(t, len(clock.waits()), 3, "past its deadline only the refusal's record waits for the lock: %s", clock)
			require.True(t, answered.Before(t0.Add(timeout)), "answered %s after the hook's start, the runtime kills it at %s",
				answered.Sub(t0), timeout)
			require.Contains(t, stderr.String(), "the refusal is not in the audit log")
			require.Equal(t, map[int]string{1: r.id}, r.holders(), "the ticket keeps its GPU until its gpu-guard-ctl run ends")
		})
	}
}

// A hand-over that fails leaves a refuse record keyed by the ticket when the
// ledger takes it, so that gpu-guard-ctl run says why no container took its
// ticket over.
func TestTicketHandoverFailureIsAudited(t *testing.T) {
	r := newTicketRig(t, "1")
	r.cfg.Ledger.LockTimeout = config.Duration{Duration: 50 * time.Millisecond}
	const timeout = time.Hour
	st := specWith(t, "c", []string{"nri-gpu-guard-hook", "create-runtime"}, int(timeout/time.Second), "NVIDIA_VISIBLE_DEVICES=1", TicketEnv+"="+r.id)
	clock := handoverClock(r, timeout)
	r.e.opts = Options{Started: t0}
	// The lock is held through the hand-over's deadline and let go once the
	// hook tries to record its refusal: the record gets in.
	lock := flock.New(filepath.Join(r.cfg.Ledger.Dir, "ledger.lock"))
	require.NoError(t, lock.Lock())
	decideBy := t0.Add(timeout - hookAnswerMargin)
	openLocked := r.e.openGuard
	r.e.openGuard = func(cfg config.Config, inv *devices.Inventory) (guardAPI, func(), error) {
		g, closeGuard, err := openLocked(cfg, inv)
		return unlockOnAudit{guardAPI: g, lock: lock, deadline: decideBy, now: r.e.now}, closeGuard, err
	}
	err := r.e.run(context.Background(), PhaseCreateRuntime, r.cfg, strings.NewReader(st), io.Discard)
	require.ErrorContains(t, err, "could not be handed over before the timeout of this hook")
	require.Equal(t, []time.Time{t0, t0.Add(timeout / 2)}, clock.waits(), "two waits reach the deadline; the record finds the lock free: %s", clock)
	recs := r.refusals("c")
	require.Len(t, recs, 1)
	require.Equal(t, r.id, recs[0].Key)
	require.Contains(t, recs[0].Reason, "refused (handover-failed): its ticket "+r.id+" could not be handed over")
	cause, ok := TicketRefusal(r.cfg, r.id)
	require.True(t, ok)
	require.Contains(t, cause, "container c was refused (handover-failed)")
}

// unlockOnAudit lets go of lock when the hook, past deadline, reads the
// ledger for a write of its own: its refusal's record.
type unlockOnAudit struct {
	guardAPI
	lock     *flock.Flock
	deadline time.Time
	now      func() time.Time
}

func (u unlockOnAudit) Ledger() *ledger.Ledger {
	if !u.now().Before(u.deadline) && u.lock.Locked() {
		_ = u.lock.Unlock()
	}
	return u.guardAPI.Ledger()
}

// A container that carries a ticket but asks for no GPU releases the
// ticket's GPUs (audited) instead of leaving them idle for its life, both
// when its spec can reach no GPU at all (the fast path, which then reads no
// inventory) and when the configuration makes what it names no GPU. It is
// admitted whatever comes of that, and gpu-guard-ctl run finds nothing left
// to release. Its poststop still skips the ledger: nothing of it is there.
func TestTicketCarrierWithoutGPUReleasesTheTicket(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  string
		cfg  func(*config.Config)
	}{
		{"reaches no GPU", "PATH=/bin", nil},
		{"names none the configuration counts", "NVIDIA_VISIBLE_DEVICES=7", func(c *config.Config) { c.Policy.UnknownDevice = config.UnknownIgnore }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newTicketRig(t, "0,1")
			if tc.cfg != nil {
				tc.cfg(&r.cfg)
			}
			opened := 0
			r.e = testEnv(&opened)
			r.e.markerDir = t.TempDir()
			st := stateFor(t, "c", os.Getpid(), tc.env, TicketEnv+"="+r.id)
			in := ReadInput(strings.NewReader(st))
			require.False(t, in.NeverClaims(), "a hook binary does not answer it before loading the configuration")
			var stderr bytes.Buffer
			require.NoError(t, r.e.run(context.Background(), PhaseCreateRuntime, r.cfg, strings.NewReader(st), &stderr))
			require.Empty(t, r.holders(), "the ticket's GPUs are free again")
			require.Contains(t, stderr.String(), "container c carries ticket "+r.id+" but asks for no GPU; released GPU 0 ("+gpuUUIDs[0]+"), GPU 1 ("+gpuUUIDs[1]+") of the ticket")
			var released []string
			for _, rec := range r.audit() {
				if rec.Op == ledger.OpRelease && rec.ContainerID == r.id {
					require.Contains(t, rec.Reason, "carried by container c, which asks for no GPU")
					released = append(released, rec.Devices...)
				}
			}
			require.ElementsMatch(t, []string{gpuUUIDs[0], gpuUUIDs[1]}, released)
			rel, err := ReleaseTicket(context.Background(), r.cfg, r.id)
			require.NoError(t, err)
			require.Empty(t, rel, "nothing left for gpu-guard-ctl run to release")

			if tc.cfg == nil {
				opened = 0
				require.NoError(t, r.e.run(context.Background(), PhasePoststop, r.cfg, strings.NewReader(st), io.Discard))
				require.Zero(t, opened, "its poststop does not open the ledger")
			}
		})
	}
}
