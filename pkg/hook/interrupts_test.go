// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/gofrs/flock"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// TestInterruptsArmedOnlyWhereTheHookBlocks: a hook sets up its signal
// handling (env.beforeWait) before it waits in the queue, for the turnstile
// or for a ledger lock another process holds, and not otherwise. Each wait
// here ends from inside the callback, which shows it ran before the wait.
func TestInterruptsArmedOnlyWhereTheHookBlocks(t *testing.T) {
	cfg := staticConfig(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var onWait func()
	calls := 0
	arm := func() {
		calls++
		if onWait != nil {
			onWait()
		}
	}
	e := defaultEnv()
	e.beforeWait = arm
	e.openGuard = func(cfg config.Config, inv *devices.Inventory) (guardAPI, func(), error) {
		return openGuardWith(cfg, inv, arm)
	}
	e.lockingEngine = func() (bool, string) { return false, "" }
	// Each container's process; ended before its poststop, as a runtime's is.
	procs := map[string]func(){}
	run := func(phase, id string, wait bool, env ...string) error {
		e.opts.Wait = wait
		pid := os.Getpid()
		if phase == PhaseCreateRuntime {
			var end func()
			pid, end = containerProcess(t)
			procs[id] = end
		} else if end, ok := procs[id]; ok {
			end()
		}
		return e.run(ctx, phase, cfg, strings.NewReader(stateFor(t, id, pid, env...)), io.Discard)
	}
	l, err := ledger.OpenReadOnly(cfg.Ledger.Dir, ledger.Options{})
	require.NoError(t, err)
	state := func() ledger.State {
		st, err := l.Snapshot(context.Background())
		require.NoError(t, err)
		return st
	}

	// Nothing contended: a free GPU is claimed, with --wait too, and released.
	require.NoError(t, run(PhaseCreateRuntime, "a", true, "NVIDIA_VISIBLE_DEVICES=0"))
	require.NoError(t, run(PhaseCreateRuntime, "b", false, "NVIDIA_VISIBLE_DEVICES=1"))
	require.NoError(t, run(PhasePoststop, "b", false, "NVIDIA_VISIBLE_DEVICES=1"))
	require.Equal(t, map[string]string{gpuUUIDs[0]: "a"}, holdersOf(state()))
	require.Zero(t, calls, "nothing waited")

	// The turnstile held by another hook.
	ts, err := os.OpenFile(filepath.Join(cfg.Ledger.Dir, turnstileName), os.O_RDWR, 0)
	require.NoError(t, err)
	require.NoError(t, syscall.Flock(int(ts.Fd()), syscall.LOCK_EX|syscall.LOCK_NB))
	onWait = func() { require.NoError(t, ts.Close()) }
	require.NoError(t, run(PhaseCreateRuntime, "c", false, "NVIDIA_VISIBLE_DEVICES=2"))
	require.Equal(t, 1, calls, "before waiting for the turnstile")

	// The ledger lock held by another process.
	lock := flock.New(filepath.Join(cfg.Ledger.Dir, "ledger.lock"))
	ok, err := lock.TryLock()
	require.NoError(t, err)
	require.True(t, ok)
	onWait = func() { require.NoError(t, lock.Unlock()) }
	require.NoError(t, run(PhasePoststop, "c", false, "NVIDIA_VISIBLE_DEVICES=2"))
	require.Equal(t, 2, calls, "before waiting for the ledger lock")
	require.Equal(t, map[string]string{gpuUUIDs[0]: "a"}, holdersOf(state()))

	// A busy GPU with --wait: armed before the request is queued (here the
	// hook is told to stop right then, and leaves without ever queueing).
	onWait = func() {
		require.Empty(t, state().Waiters, "armed before queueing")
		cancel()
	}
	err = run(PhaseCreateRuntime, "d", true, "NVIDIA_VISIBLE_DEVICES=0")
	require.ErrorIs(t, err, ErrCancelled)
	require.Equal(t, 3, calls)
	require.Empty(t, state().Waiters)
	require.Equal(t, map[string]string{gpuUUIDs[0]: "a"}, holdersOf(state()))
}

func holdersOf(st ledger.State) map[string]string {
	m := map[string]string{}
	for _, c := range st.Claims {
		m[c.Device.UUID] = c.Owner.ContainerID
	}
	return m
}

// An armed hook is cancelled by SIGTERM with the cause a waiter quotes; an
// arm after stop sets nothing up.
func TestInterruptsCancelWithTheSignal(t *testing.T) {
	ctx, irq := newInterrupts(context.Background())
	irq.arm()
	irq.arm() // once
	require.NoError(t, syscall.Kill(os.Getpid(), syscall.SIGTERM))
	<-ctx.Done()
	require.EqualError(t, context.Cause(ctx), "terminated signal received")
	irq.stop()

	ctx, irq = newInterrupts(context.Background())
	irq.stop()
	irq.arm()
	require.Nil(t, irq.sigs, "nothing armed after stop")
	require.ErrorIs(t, ctx.Err(), context.Canceled)
}
