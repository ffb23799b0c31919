// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// hookHolder is a container the OCI hook admitted: its process recorded
// by pid and start time, no cgroup.
func hookHolder(id string, pid int) ledger.Owner {
	return ledger.Owner{ContainerID: id, FrontEnd: ledger.FrontEndHook, Pid: pid, PidStart: uint64(pid) * 10}
}

// removeOn is release_on = "remove" over the given runtime roots.
func removeOn(roots ...string) func(*config.Config) {
	return func(c *config.Config) {
		c.Policy.ReleaseOn = config.ReleaseOnRemove
		c.Hook.RuntimeRoots = roots
	}
}

// Under release_on = "remove" a container whose create failed after its
// createRuntime hook admitted it (a later hook failed, a missing
// executable) is deleted without a poststop under podman and crun: the hook
// front end never learns of its removal. Its claim used to be kept forever: the
// next container on the GPU was refused naming a container no engine
// knew. Once its process is gone and no runtime root lists its id, it has
// been removed, and the next request releases its claim.
func TestRemovedHookHolderReleasedUnderRemove(t *testing.T) {
	run := t.TempDir()
	runc, crun := filepath.Join(run, "runc"), filepath.Join(run, "crun")
	require.NoError(t, os.MkdirAll(runc, 0o700))
	// crun is not used on this host: its root does not exist.
	e := newEnv(t, removeOn(runc, crun))
	gone := hookHolder("failedcreate0001", 4242)
	require.Equal(t, guard.Admit, e.admitHook(gone, visible("1")).Result)
	e.live.exited["pid:4242"] = true

	next := hookHolder("next000000000001", 4343)
	d := e.admitHook(next, visible("1"))
	require.Equal(t, guard.Admit, d.Result, d.Message)
	assert.Equal(t, "holder-exited", d.Reason)
	assert.Equal(t, map[string]string{uuid(1): next.ContainerID}, e.holders())
	rel := e.audit(ledger.OpRelease)
	require.Len(t, rel, 1)
	assert.Equal(t, gone.ContainerID, rel[0].ContainerID)
	assert.Contains(t, rel[0].Reason, "no runtime knows container failedcreate0001 any more ("+runc+")")
	assert.Equal(t, 1, e.obs.released[guard.ReasonHolderExited])
}

// A hook holder first found exited while its runtime still listed it
// (stopped, not deleted) is marked stopped and kept; once the runtime
// deleted it, the next request releases its claim.
func TestStoppedHookHolderReleasedOnceDeleted(t *testing.T) {
	root := t.TempDir()
	e := newEnv(t, removeOn(root))
	held := hookHolder("stopped000000001", 4242)
	require.Equal(t, guard.Admit, e.admitHook(held, visible("1")).Result)
	e.runtimeKnows(held.ContainerID)
	e.live.exited["pid:4242"] = true

	d := e.admitHook(hookHolder("next000000000001", 4343), visible("1"))
	require.Equal(t, guard.Queue, d.Result, d.Message)
	assert.False(t, e.state().Claims[0].Owner.StoppedAt.IsZero(), "marked stopped, kept until removal")
	assert.Contains(t, d.Message, `kept until the container is removed: policy release_on = "remove"; runtime root `+root+
		" still has its container")
	assert.NotContains(t, d.Message, "cannot be told", "its runtime still lists it")

	require.NoError(t, os.Remove(filepath.Join(root, held.ContainerID)))
	d = e.admitHook(hookHolder("next000000000001", 4343), visible("1"))
	require.Equal(t, guard.Admit, d.Result, d.Message)
	assert.Equal(t, map[string]string{uuid(1): "next000000000001"}, e.holders())
}

// What keeps the claim of an exited hook holder under release_on =
// "remove": a runtime that still lists its id (in any root), a root that
// cannot be read (doubt), no root at all; and the rule leaves a running
// holder and other front ends' holders alone. Where the removal cannot be
// told, the refusal says why and how to end the claim by hand.
func TestExitedHookHolderKeptUnlessKnownRemoved(t *testing.T) {
	type layout struct {
		roots []string
		// known: the holder's id is listed in this root.
		known string
	}
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, dir string) layout
		// fe is the holder's front end (default hook); running: its
		// process still runs.
		fe      ledger.FrontEnd
		running bool
		unsure  string // the refusal says its removal cannot be told, and why
	}{
		{name: "listed by its runtime (stopped, not deleted)", setup: func(t *testing.T, dir string) layout {
			return layout{roots: []string{filepath.Join(dir, "runc")}, known: filepath.Join(dir, "runc")}
		}},
		{name: "the same id listed in a second root", setup: func(t *testing.T, dir string) layout {
			mkdir(t, filepath.Join(dir, "runc"))
			return layout{roots: []string{filepath.Join(dir, "runc"), filepath.Join(dir, "crun")}, known: filepath.Join(dir, "crun")}
		}},
		{name: "a root that is a symlink", setup: func(t *testing.T, dir string) layout {
			mkdir(t, filepath.Join(dir, "real"))
			require.NoError(t, os.Symlink(filepath.Join(dir, "real"), filepath.Join(dir, "runc")))
			return layout{roots: []string{filepath.Join(dir, "runc")}}
		}, unsure: "is a symlink: not followed"},
		{name: "a root that is not a directory", setup: func(t *testing.T, dir string) layout {
			require.NoError(t, os.WriteFile(filepath.Join(dir, "runc"), nil, 0o600))
			return layout{roots: []string{filepath.Join(dir, "runc")}}
		}, unsure: "is not a directory"},
		{name: "a root that cannot be read", setup: func(t *testing.T, dir string) layout {
			// Below a file: lstat fails with ENOTDIR, not ENOENT (root
			// ignores a permission bit, not this).
			require.NoError(t, os.WriteFile(filepath.Join(dir, "file"), nil, 0o600))
			mkdir(t, filepath.Join(dir, "crun"))
			return layout{roots: []string{filepath.Join(dir, "crun"), filepath.Join(dir, "file", "runc")}}
		}, unsure: "cannot be read: not a directory"},
		{name: "no root exists", setup: func(t *testing.T, dir string) layout {
			return layout{roots: []string{filepath.Join(dir, "runc"), filepath.Join(dir, "crun")}}
		}, unsure: "none of hook.runtime_roots"},
		{name: "no root configured", setup: func(t *testing.T, dir string) layout {
			return layout{roots: nil}
		}, unsure: "hook.runtime_roots is empty"},
		{name: "its process still runs", setup: func(t *testing.T, dir string) layout {
			mkdir(t, filepath.Join(dir, "runc"))
			return layout{roots: []string{filepath.Join(dir, "runc")}}
		}, running: true},
		{name: "an NRI holder", setup: func(t *testing.T, dir string) layout {
			mkdir(t, filepath.Join(dir, "runc"))
			return layout{roots: []string{filepath.Join(dir, "runc")}}
		}, fe: ledger.FrontEndNRI},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := tc.setup(t, t.TempDir())
			e := newEnv(t, removeOn(l.roots...))
			held := hookHolder("held000000000001", 4242)
			if tc.fe != "" {
				held.FrontEnd = tc.fe
			}
			require.Equal(t, guard.Admit, e.admitAs(held.FrontEnd, held, visible("1")).Result)
			if l.known != "" {
				mkdir(t, filepath.Join(l.known, held.ContainerID))
			}
			e.live.exited["pid:4242"] = !tc.running

			d := e.admitHook(hookHolder("next000000000001", 4343), visible("1"))
			require.Equal(t, guard.Queue, d.Result, d.Message)
			assert.Equal(t, map[string]string{uuid(1): held.ContainerID}, e.holders())
			assert.Equal(t, !tc.running, !e.state().Claims[0].Owner.StoppedAt.IsZero(), "marked stopped once exited")
			if tc.unsure == "" {
				assert.NotContains(t, d.Message, "cannot be told")
				return
			}
			assert.Contains(t, d.Message, "whether it was removed cannot be told: ")
			assert.Contains(t, d.Message, tc.unsure)
			assert.Contains(t, d.Message, "if its engine no longer lists it, end its claim with "+
				"`sudo gpu-guard-ctl release --container held000000000001 --reason \"container removed\"`")
			// Asked again, already stopped: still kept, still said.
			d = e.admitHook(hookHolder("next000000000001", 4343), visible("1"))
			require.Equal(t, guard.Queue, d.Result)
			assert.Contains(t, d.Message, tc.unsure)
		})
	}
}

// Under release_requires_idle the claim of a removed hook holder drains,
// as a removal's does (only the GPU can tell its processes left it), and
// the refusal says it was removed.
func TestRemovedHookHolderDrainsUnderReleaseRequiresIdle(t *testing.T) {
	root := t.TempDir()
	e, _ := newStateEnv(t, func(c *config.Config) {
		removeOn(root)(c)
		c.Observe.ReleaseRequiresIdle = true
	})
	gone := hookHolder("failedcreate0001", 4242)
	require.Equal(t, guard.Admit, e.admitHook(gone, visible("1")).Result)
	e.live.exited["pid:4242"] = true

	d := e.admitHook(hookHolder("next000000000001", 4343), visible("1"))
	require.Equal(t, guard.Queue, d.Result, d.Message)
	require.Len(t, e.state().Claims, 1)
	assert.False(t, e.state().Claims[0].Owner.DrainingSince.IsZero(), "draining")
	assert.Contains(t, d.Message, "(exited and removed: no runtime knows its container any more; draining since")
}

// The rule that gc, status and a waiting hook apply (guard.ReleaseRule)
// gives the guard's answer: a removed hook holder's claim is released.
func TestReleaseRuleReleasesRemovedHookHolder(t *testing.T) {
	root := t.TempDir()
	cfg := config.Default()
	removeOn(root)(&cfg)
	live := &liveness{exited: map[string]bool{"pid:4242": true}}
	held := hookHolder("failedcreate0001", 4242)

	v := guard.NewReleaseRule(cfg, live).Check(held)
	assert.Equal(t, guard.ReleaseNow, v.Action)
	assert.True(t, v.Deleted)
	assert.Contains(t, v.Why, "no runtime knows container failedcreate0001 any more")

	held.StoppedAt = time.Date(2026, 5, 9, 7, 0, 0, 0, time.UTC)
	v = guard.NewReleaseRule(cfg, live).Check(held)
	assert.Equal(t, guard.ReleaseNow, v.Action, "recorded as stopped earlier")

	mkdir(t, filepath.Join(root, held.ContainerID))
	v = guard.NewReleaseRule(cfg, live).Check(held)
	assert.Equal(t, guard.KeepStopped, v.Action)
	assert.Empty(t, v.Unsure)
	assert.Equal(t, root, v.Listed, "the root that still has the container")
}

func mkdir(t *testing.T, dir string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(dir, 0o700))
}

// An exited hook holder whose container its runtime still has (the engine
// lost it: podman after its conmon was killed, then `podman rm -f`) keeps
// its claim for good under release_on = "remove". The refusal used to name
// it as a container kept until its removal, with no way out, and to say it
// exited at the moment of each refusal: a refusal that does not wait
// (AdmitIfFree) commits nothing, so its own transaction found the holder
// exited, stamped it with its own time, and the next one did so again.
// Now it says when the holder exited only once that was recorded, and
// names the runtime root that still has the container and how to end the
// claim.
func TestKeptHookHolderRefusalSaysWhatEndsIt(t *testing.T) {
	root := filepath.Join(t.TempDir(), "runc")
	mkdir(t, root)
	e := newEnv(t, removeOn(root))
	held := hookHolder("e8d984eddd4e0001", 4242)
	require.Equal(t, guard.Admit, e.admitHook(held, visible("1")).Result)
	e.runtimeKnows(held.ContainerID)
	e.live.exited["pid:4242"] = true
	next := hookHolder("next000000000001", 4343)
	remedy := "runtime root " + root + " still has its container: if its engine no longer lists it, delete it from the runtime " +
		"(`sudo runc --root " + root + " delete --force e8d984eddd4e0001`), then run `sudo gpu-guard-ctl gc`, or end its claim with " +
		"`sudo gpu-guard-ctl release --container e8d984eddd4e0001 --reason \"container removed\"`"

	for range 2 {
		e.clock.advance(6 * time.Second)
		d, err := e.g.AdmitIfFree(ctx, guard.Request{FrontEnd: ledger.FrontEndHook, Owner: next, Key: next.ContainerID, Spec: visible("1")})
		require.NoError(t, err)
		require.Equal(t, guard.Queue, d.Result, d.Message)
		assert.Contains(t, d.Message, `(has exited, kept until the container is removed: policy release_on = "remove"; `+remedy+")")
		assert.NotContains(t, d.Message, "exited 2026", "no stop was recorded: its time is not known")
		assert.True(t, e.state().Claims[0].Owner.StoppedAt.IsZero(), "a refusal that does not wait records nothing")
	}

	// A decision that commits records the stop; the next one says when.
	stoppedAt := e.clock.Now()
	require.Equal(t, guard.Queue, e.admitHook(next, visible("1")).Result)
	require.Equal(t, stoppedAt, e.state().Claims[0].Owner.StoppedAt)
	e.clock.advance(6 * time.Second)
	d := e.admitHook(next, visible("1"))
	require.Equal(t, guard.Queue, d.Result, d.Message)
	assert.Contains(t, d.Message, "(exited "+stoppedAt.Format(time.RFC3339)+" (6s ago), kept until the container is removed: "+
		`policy release_on = "remove"; `+remedy+")")

	// Deleted from the runtime as told, the claim ends at the next request.
	require.NoError(t, os.Remove(filepath.Join(root, held.ContainerID)))
	require.Equal(t, guard.Admit, e.admitHook(next, visible("1")).Result)
	assert.Equal(t, map[string]string{uuid(1): next.ContainerID}, e.holders())
}
