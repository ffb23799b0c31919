// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// TestRuncFailsClosedOnDamagedLedger: real runc containers whose hooks are
// the real binary. Two containers hold GPUs 0 and 1, three wait for them
// (their createRuntime hooks poll once a minute, so that they stay out of
// the way of the attack). Once the ledger is damaged or gone, `runc run` of
// a container asking for a GPU fails in its createRuntime hook (the runtime
// refuses it, its program never starts) with the guard's word that the
// ledger needs recovery and what to do; a container without GPUs runs. After
// recovery, the holders and the waiters are back and a new container for a
// held GPU is refused as busy. (The seven content damages of both files, the
// journal's included, and gpu-guard-ctl recover as a process are in
// cmd/nri-gpu-guard-hook's TestFailClosedThroughHookProcesses.)
func TestRuncFailsClosedOnDamagedLedger(t *testing.T) {
	for _, a := range []struct {
		name string
		do   func(t *testing.T, dir string)
		undo func(t *testing.T, dir string)
	}{
		{name: "flipped byte in ledger.json", do: func(t *testing.T, dir string) {
			p := filepath.Join(dir, "ledger.json")
			b, err := os.ReadFile(p)
			require.NoError(t, err)
			b[len(b)-10] ^= 0x20
			require.NoError(t, os.WriteFile(p, b, 0o600))
		}},
		{name: "state dir moved away", do: func(t *testing.T, dir string) {
			require.NoError(t, os.Rename(dir, dir+"-stolen"))
		}, undo: func(t *testing.T, dir string) {
			require.NoError(t, os.Rename(dir+"-stolen", dir))
		}},
		{name: "ledger.json deleted", do: func(t *testing.T, dir string) {
			require.NoError(t, os.Remove(filepath.Join(dir, "ledger.json")))
		}},
	} {
		t.Run(a.name, func(t *testing.T) {
			r := newRig(t, rigOpts{})
			idle := r.cfg
			idle.Hook.PollInterval = config.Duration{Duration: time.Minute}
			idlePath := r.writeConfig("idle.toml", idle)

			for i, id := range []string{"h1", "h2"} {
				r.start(id, ctrOpts{env: gpuEnv(i)})
				r.waitFor(id+" to start", func() bool { return r.started(id) })
			}
			for i, id := range []string{"w1", "w2", "w3"} {
				r.start(id, ctrOpts{env: gpuEnv(i % 2), cfgPath: idlePath})
				r.waitFor(id+" to queue", func() bool { return len(r.waiterKeys()) == i+1 })
			}
			wantHolders := map[string]string{gpuUUIDs[0]: "h1", gpuUUIDs[1]: "h2"}
			require.Equal(t, wantHolders, r.holders())

			dir := r.cfg.Ledger.Dir
			a.do(t, dir)
			for _, gpu := range []int{0, 2} {
				id := "intruder" + strconv.Itoa(gpu)
				_, err := r.run(id, ctrOpts{env: gpuEnv(gpu), mode: "exit", noWait: true})
				require.Error(t, err, "a container for GPU %d while the ledger needs recovery", gpu)
				assert.Contains(t, err.Error(), "GPU ledger needs recovery")
				assert.Contains(t, err.Error(), "gpu-guard-ctl recover")
				assert.False(t, r.started(id), "%s's program must not have started", id)
			}
			_, err := r.run("plain", ctrOpts{mode: "exit", noWait: true})
			require.NoError(t, err, "a container without GPUs")
			require.True(t, r.started("plain"))

			if a.undo != nil {
				a.undo(t, dir)
			}
			l, err := ledger.Open(dir, guard.LedgerOptions(r.cfg))
			require.NoError(t, err)
			rep, err := l.Recover(context.Background(), ledger.RecoverOptions{Reason: "test"})
			require.NoError(t, err)
			assert.True(t, rep.Complete, "lost: %s", rep.Lost)

			require.Equal(t, wantHolders, r.holders(), "both holders are back")
			require.Equal(t, []string{"w1", "w2", "w3"}, r.waiterKeys(), "the waiters are back, in order")
			_, err = r.run("late", ctrOpts{env: gpuEnv(0), mode: "exit", noWait: true})
			require.Error(t, err, "a new container for held GPU 0")
			assert.Contains(t, err.Error(), "is held by container h1")
			assert.False(t, r.started("late"))
		})
	}
}
