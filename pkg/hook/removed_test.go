// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
)

// Under release_on = "remove", a container whose create fails after its
// create-runtime hook admitted it (a later createRuntime or createContainer
// hook fails, a missing executable) is deleted without a poststop under
// podman and crun: nothing told the ledger, and the next container on
// its GPU was refused, naming a container no engine knew any more. Its
// process gone and its id in none of the runtime roots, it was removed: the
// next create-runtime releases its claim. One its runtime still lists
// (stopped, not deleted) keeps it.
func TestCreateRuntimeReleasesHolderRemovedWithoutPoststop(t *testing.T) {
	for _, deleted := range []bool{true, false} {
		name := "deleted by its runtime"
		if !deleted {
			name = "still listed by its runtime"
		}
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			cfg := staticConfig(t)
			cfg.Policy.ReleaseOn = config.ReleaseOnRemove
			run := t.TempDir()
			runc := filepath.Join(run, "runc")
			cfg.Hook.RuntimeRoots = []string{runc, filepath.Join(run, "crun")} // crun: not used here
			opened := 0
			e := testEnv(&opened)

			// runc makes <root>/<id> before it runs the createRuntime hooks.
			require.NoError(t, os.MkdirAll(filepath.Join(runc, "failed"), 0o700))
			pid, end := containerProcess(t)
			require.NoError(t, e.run(ctx, PhaseCreateRuntime, cfg, strings.NewReader(stateFor(t, "failed", pid, "NVIDIA_VISIBLE_DEVICES=1")), io.Discard))
			// A later hook fails: the runtime kills the container's process
			// and, unless it is only stopped, deletes its state; no poststop.
			end()
			if deleted {
				require.NoError(t, os.RemoveAll(filepath.Join(runc, "failed")))
			}

			next, _ := containerProcess(t)
			var stderr bytes.Buffer
			err := e.run(ctx, PhaseCreateRuntime, cfg, strings.NewReader(stateFor(t, "next", next, "NVIDIA_VISIBLE_DEVICES=1")), &stderr)
			holders := ledgerHolders(t, cfg)
			if deleted {
				require.NoError(t, err, stderr.String())
				require.Equal(t, map[string]string{gpuUUIDs[1]: "next"}, holders)
				return
			}
			require.ErrorIs(t, err, guard.ErrQueued)
			require.ErrorContains(t, err, `kept until the container is removed: policy release_on = "remove"; runtime root `+runc+
				" still has its container: if its engine no longer lists it, delete it from the runtime (`sudo runc --root "+runc+
				" delete --force failed`)")
			require.Equal(t, map[string]string{gpuUUIDs[1]: "failed"}, holders)
		})
	}
}

// ledgerHolders maps each claimed device UUID of cfg's ledger to its
// holder's container id.
func ledgerHolders(t *testing.T, cfg config.Config) map[string]string {
	t.Helper()
	g, _, err := openGuard(cfg, emptyInventory())
	require.NoError(t, err)
	st, err := g.Ledger().Snapshot(context.Background())
	require.NoError(t, err)
	out := map[string]string{}
	for _, c := range st.Claims {
		out[c.Device.UUID] = c.Owner.ContainerID
	}
	return out
}
