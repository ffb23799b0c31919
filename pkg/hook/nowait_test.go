// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// TestRuncDefaultRefusesAtOnce: without --wait (the shipped hooks.d file) a
// container whose GPU is busy is refused at once with who holds it, how many
// wait and how to wait instead; it leaves no queue entry and writes nothing
// to the queue. Another GPU is admitted meanwhile.
func TestRuncDefaultRefusesAtOnce(t *testing.T) {
	r := newRig(t, rigOpts{})
	h := r.start("h", ctrOpts{env: gpuEnv(1), noWait: true})
	r.waitFor("h to start", func() bool { return r.started("h") })

	w, err := r.run("w", ctrOpts{env: gpuEnv(1), noWait: true})
	require.Error(t, err, "w must be refused")
	msg := w.out.String()
	for _, s := range []string{"container w refused", "GPU 1 (" + gpuUUIDs[1] + ") is held by container h", "no other request waits for it",
		"Not queued: the hook does not wait inside the engine", "gpu-guard-ctl run --", "Free GPUs now: 0, 2, 3"} {
		require.Contains(t, msg, s)
	}
	require.NotContains(t, msg, "Kubernetes")
	require.False(t, r.started("w"))
	require.Empty(t, r.state().Waiters)
	var refusals int
	for _, rec := range r.audit() {
		if rec.Key != "w" {
			continue
		}
		require.Equal(t, "refuse", rec.Op, "a refusal that does not wait writes no queue record: %+v", rec)
		require.Contains(t, rec.Reason, "is held by container h", "the audit log keeps the reason (crun shows only the exit code)")
		refusals++
	}
	require.Equal(t, 1, refusals)

	o := r.start("o", ctrOpts{env: gpuEnv(2), noWait: true})
	r.waitFor("o to start on GPU 2", func() bool { return r.started("o") })
	r.release("o")
	require.NoError(t, o.wait(t))
	r.release("h")
	require.NoError(t, h.wait(t))
	require.Empty(t, r.holders())
}

// TestHookBurst: 40 create-runtime hooks for one held GPU at once, waiting
// (--wait, hook.wait_timeout 2s) and not. Every hook ends refused as busy,
// none fails on the ledger lock, and no waiter stays behind. lock_timeout
// is a minute, so that no machine is too slow for it: a lock timeout here
// is a lock held for good, not congestion. How the burst fares at the
// default lock_timeout is a matter of speed: BenchmarkHookBurst.
func TestHookBurst(t *testing.T) {
	for _, wait := range []bool{false, true} {
		t.Run(burstName(wait), func(t *testing.T) {
			r := newRig(t, rigOpts{})
			cfg := r.config(2 * time.Second)
			cfg.Ledger.LockTimeout = config.Duration{Duration: time.Minute}
			path := r.writeConfig("burst.toml", cfg)
			h := r.start("h", ctrOpts{env: gpuEnv(1), noWait: true})
			r.waitFor("h to start", func() bool { return r.started("h") })
			proc := standIn(t, r)

			start := time.Now()
			outs := hookBurst(t, r, path, proc, "burst", wait)
			elapsed := time.Since(start)
			lockTimeouts := 0
			for i, out := range outs {
				if strings.Contains(out, "ledger lock") {
					lockTimeouts++
					t.Logf("hook %d: %s", i, out)
				}
			}
			st := r.state()
			t.Logf("%d hooks ended in %s: %d lock timeouts, %d waiters left", len(outs), elapsed.Round(time.Millisecond), lockTimeouts, len(st.Waiters))
			require.Zero(t, lockTimeouts, "no hook may fail on the ledger lock")
			require.Empty(t, st.Waiters, "every hook left the queue")
			require.Equal(t, map[string]string{gpuUUIDs[1]: "h"}, r.holders())
			r.release("h")
			require.NoError(t, h.wait(t))
			require.Empty(t, r.state().Reservations, "nothing reserved for a hook that is gone")
		})
	}
}

// BenchmarkHookBurst measures TestHookBurst's burst of 40 hooks for one
// held GPU at the default lock_timeout: the time of a burst, and how many
// of its hooks failed on the ledger lock (lock-timeouts/op) and stayed
// queued (waiters-left/op), which a loaded machine may make nonzero.
func BenchmarkHookBurst(b *testing.B) {
	for _, wait := range []bool{false, true} {
		b.Run(burstName(wait), func(b *testing.B) {
			r := newRig(b, rigOpts{})
			cfg := r.config(2 * time.Second)
			cfg.Ledger.LockTimeout = config.Default().Ledger.LockTimeout
			path := r.writeConfig("burst.toml", cfg)
			r.start("h", ctrOpts{env: gpuEnv(1), noWait: true})
			r.waitFor("h to start", func() bool { return r.started("h") })
			proc := standIn(b, r)

			lockTimeouts, waitersLeft := 0, 0
			b.ResetTimer()
			for i := range b.N {
				prefix := fmt.Sprintf("burst%d-", i)
				outs := hookBurst(b, r, path, proc, prefix, wait)
				for _, out := range outs {
					if strings.Contains(out, "ledger lock") {
						lockTimeouts++
					}
				}
				b.StopTimer()
				for _, w := range r.state().Waiters {
					if strings.HasPrefix(w.Key, prefix) {
						waitersLeft++
					}
				}
				b.StartTimer()
			}
			b.ReportMetric(float64(lockTimeouts)/float64(b.N), "lock-timeouts/op")
			b.ReportMetric(float64(waitersLeft)/float64(b.N), "waiters-left/op")
		})
	}
}

func burstName(wait bool) string {
	if wait {
		return "wait"
	}
	return "no-wait"
}

// standIn starts one stand-in container process for all the hooks of a
// burst: they only read it.
func standIn(tb testing.TB, r *rig) int {
	tb.Helper()
	proc := exec.Command(ctrProg, r.shared, "stand-in", "wait")
	require.NoError(tb, proc.Start())
	tb.Cleanup(func() { _ = proc.Process.Kill(); _ = proc.Wait() })
	return proc.Process.Pid
}

// burstSize is how many create-runtime hooks a burst starts at once.
const burstSize = 40

// hookBurst runs burstSize create-runtime hooks at once, for containers
// named with prefix that want GPU 1 (held), each with --wait or not, and
// returns what each wrote on stderr once all have ended. Each must end
// refused as busy (exit code ExitBusy).
func hookBurst(tb testing.TB, r *rig, path string, pid int, prefix string, wait bool) []string {
	tb.Helper()
	var wg sync.WaitGroup
	outs := make([]string, burstSize)
	errs := make([]error, burstSize)
	for i := range burstSize {
		id := prefix + strings.Repeat("x", i%3) + string(rune('a'+i%26)) + string(rune('a'+i/26))
		bundle := r.bundle(id, ctrOpts{env: gpuEnv(1)})
		st, err := json.Marshal(specs.State{Version: specs.Version, ID: id, Status: specs.StateCreating,
			Pid: pid, Bundle: bundle})
		require.NoError(tb, err)
		args := []string{PhaseCreateRuntime, "--config", path}
		if wait {
			args = append(args, "--wait")
		}
		cmd := exec.Command(hookBin, args...)
		cmd.Stdin = bytes.NewReader(st)
		var out bytes.Buffer
		cmd.Stderr = &out
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = cmd.Run()
			outs[i] = out.String()
		}()
	}
	wg.Wait()
	for i := range burstSize {
		var ee *exec.ExitError
		require.ErrorAs(tb, errs[i], &ee, "GPU 1 is held: every hook is refused")
		require.Equal(tb, ExitBusy, ee.ExitCode(), "exit code of a busy refusal: %s", outs[i])
	}
	return outs
}

// TestDeadWaiterDoesNotBlockFreedGPU: a waiting hook killed with SIGKILL
// together with its container process cannot leave the queue; when the GPU
// is freed it would get the reservation and keep it idle. The next request
// for that GPU drops it (its process is gone) and is admitted.
func TestDeadWaiterDoesNotBlockFreedGPU(t *testing.T) {
	r := newRig(t, rigOpts{})
	h := r.start("h", ctrOpts{env: gpuEnv(1), noWait: true})
	r.waitFor("h to start", func() bool { return r.started("h") })

	proc := exec.Command(ctrProg, r.shared, "stand-in", "wait")
	require.NoError(t, proc.Start())
	hook := r.runHook("ghost", proc.Process.Pid, gpuEnv(1))
	r.waitFor("ghost to queue", func() bool { return slices.Contains(r.waiterKeys(), "ghost") })
	require.NoError(t, hook.cmd.Process.Kill())
	_ = hook.wait(t)
	require.NoError(t, proc.Process.Kill())
	_ = proc.Wait()
	require.Equal(t, []string{"ghost"}, r.waiterKeys(), "a hook killed with SIGKILL cannot withdraw")

	r.release("h")
	require.NoError(t, h.wait(t))
	n := r.start("n", ctrOpts{env: gpuEnv(1), noWait: true})
	r.waitFor("n to start", func() bool { return r.started("n") })
	require.Empty(t, r.state().Waiters, "the dead waiter was dropped")
	var dropped bool
	for _, rec := range r.audit() {
		if rec.Key == "ghost" && rec.Op == ledger.OpDequeue && strings.Contains(rec.Reason, "waiter gone") {
			dropped = true
		}
	}
	require.True(t, dropped, "the audit trail says why the waiter left")
	r.release("n")
	require.NoError(t, n.wait(t))
}

// TestTicketHandover: gpu-guard-ctl run's ticket queues outside any engine,
// is admitted when the holder stops, and the container that carries it takes
// the claim over; a container carrying a used ticket is decided as usual.
func TestTicketHandover(t *testing.T) {
	r := newRig(t, rigOpts{})
	h := r.start("h", ctrOpts{env: gpuEnv(1), noWait: true})
	r.waitFor("h to start", func() bool { return r.started("h") })

	ctx := context.Background()
	type result struct {
		t   Ticket
		err error
	}
	got := make(chan result, 1)
	var progress syncBuffer
	go func() {
		tk, err := AcquireTicket(ctx, r.cfg, devices.Request{Env: gpuEnv(1)}, TicketOptions{Stderr: &progress})
		got <- result{tk, err}
	}()
	r.waitFor("the ticket to queue", func() bool { return len(r.waiterKeys()) == 1 })
	key := r.waiterKeys()[0]
	require.True(t, guard.ValidTicket(key), "the waiter is the ticket: %q", key)

	// A plain create meanwhile is refused: the ticket waits before it.
	w, err := r.run("w", ctrOpts{env: gpuEnv(1), noWait: true})
	require.Error(t, err)
	require.Contains(t, w.out.String(), "1 request waits for it before this one")

	r.release("h")
	require.NoError(t, h.wait(t))
	res := <-got
	require.NoError(t, res.err)
	require.Equal(t, key, res.t.ID)
	require.Equal(t, map[string]string{gpuUUIDs[1]: key}, r.holders())
	require.Contains(t, progress.String(), "gpu-guard-ctl run ("+key+") waiting")

	c := r.start("c", ctrOpts{env: append(gpuEnv(1), TicketEnv+"="+key), noWait: true})
	r.waitFor("c to start", func() bool { return r.started("c") })
	require.Equal(t, map[string]string{gpuUUIDs[1]: "c"}, r.holders(), "c took the ticket's claim over")
	rel, err := ReleaseTicket(ctx, r.cfg, key)
	require.NoError(t, err)
	require.Empty(t, rel, "nothing left to release once handed over")

	again, err := r.run("again", ctrOpts{env: append(gpuEnv(1), TicketEnv+"="+key), noWait: true})
	require.Error(t, err, "a used ticket gives nothing")
	require.Contains(t, again.out.String(), "is held by container c")
	r.release("c")
	require.NoError(t, c.wait(t))
	require.Empty(t, r.holders())
}
