// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// removedHookFixture is a host under release_on = "remove" whose runtime
// roots are roots (runtime_roots), with one claim: ownHook's on GPU 1,
// admitted by the OCI hook with process 4242, which is gone.
func removedHookFixture(t *testing.T, roots ...string) *fixture {
	t.Helper()
	f := newFixture(t)
	cfg, err := os.ReadFile(f.config)
	require.NoError(t, err)
	list, err := json.Marshal(roots)
	require.NoError(t, err)
	next := regexp.MustCompile(`(?m)^runtime_roots = .*$`).ReplaceAllString(string(cfg), "runtime_roots = "+string(list))
	require.NotEqual(t, string(cfg), next, "the fixture's configuration has a runtime_roots line")
	next += "[policy]\nrelease_on = \"remove\"\n"
	require.NoError(t, os.WriteFile(f.config, []byte(next), 0o600))
	f.update(t, now.Add(-10*time.Minute), func(tx *ledger.Tx) {
		claim(t, tx, ownHook, `env NVIDIA_VISIBLE_DEVICES="1"`, f.dev(t, uuidGPU1))
		require.True(t, tx.SetStarted(idHook, 4242, 42, ""))
	})
	f.liveness["pid:4242"] = "pid 4242 is gone"
	return f
}

// problemsOfKind are the problems of `status -o json` (stdout) of kind.
func problemsOfKind(t *testing.T, stdout, kind string) []problem {
	t.Helper()
	var view struct {
		Problems []problem `json:"problems"`
	}
	require.NoError(t, json.Unmarshal([]byte(stdout), &view))
	var out []problem
	for _, p := range view.Problems {
		if p.Kind == kind {
			out = append(out, p)
		}
	}
	return out
}

// A container whose create failed after the OCI hook admitted it is deleted
// by its runtime without a poststop. Under release_on = "remove" its claim
// used to be kept for good: gc said "nothing to release" and status showed
// the GPU held with no problem. Its process gone and no runtime root
// listing it, it has been removed: status says so with the remedy, and gc
// releases the claim.
func TestGCReleasesRemovedHookHolder(t *testing.T) {
	runc := filepath.Join(t.TempDir(), "runc")
	require.NoError(t, os.MkdirAll(runc, 0o700))
	f := removedHookFixture(t, runc, filepath.Join(t.TempDir(), "crun"))

	r := f.run(t, "status")
	require.Equal(t, ExitAttention, r.code, r.stdout+r.stderr)
	assert.Contains(t, r.stdout, "ATTENTION (1):")
	assert.Contains(t, r.stdout, "whose processes are gone and whose container was removed (pid 4242 is gone; removed: "+
		"no runtime knows container "+idHook+" any more ("+runc+")); release it with `sudo gpu-guard-ctl gc`")
	r = f.run(t, "status", "-o", "json")
	require.Len(t, problemsOfKind(t, r.stdout, problemHolderExited), 1, r.stdout)

	r = f.run(t, "gc", "--dry-run")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, uuidGPU1)

	r = f.run(t, "gc")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Empty(t, r.stderr)
	assert.Empty(t, claimedBy(f.state(t), idHook), r.stdout)
	rel := releaseRecords(f.audit(t), idHook)
	require.Len(t, rel, 1)
	assert.Contains(t, rel[0].Reason, "removed: no runtime knows container "+idHook+" any more")

	r = f.run(t, "status")
	assert.Equal(t, ExitOK, r.code, r.stdout)
}

// A hook holder that exited but that its runtime still lists (stopped, not
// deleted) keeps its claim under release_on = "remove", and that is no
// problem: its removal will end it.
func TestGCKeepsStoppedHookHolderItsRuntimeLists(t *testing.T) {
	runc := filepath.Join(t.TempDir(), "runc")
	require.NoError(t, os.MkdirAll(filepath.Join(runc, idHook), 0o700))
	f := removedHookFixture(t, runc)

	r := f.run(t, "status")
	assert.Equal(t, ExitOK, r.code, r.stdout)
	r = f.run(t, "gc")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Equal(t, "nothing to release\n", r.stdout)
	assert.Empty(t, r.stderr)
	assert.Equal(t, []string{uuidGPU1}, claimedBy(f.state(t), idHook))
}

// A runtime root that cannot be read leaves the removal of an exited hook
// holder unknown: its claim is kept (fail closed), and status and gc say
// why and how to end it by hand.
func TestRemovalUnknownIsReported(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "file"), nil, 0o600))
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "crun"), 0o700))
	bad := filepath.Join(dir, "file", "runc") // lstat: not a directory
	f := removedHookFixture(t, filepath.Join(dir, "crun"), bad)

	remedy := "`sudo gpu-guard-ctl release --container " + idHook + ` --reason "container removed"` + "`"
	r := f.run(t, "status")
	require.Equal(t, ExitAttention, r.code, r.stdout+r.stderr)
	assert.Contains(t, r.stdout, "whether it was removed cannot be told: runtime root "+bad+" cannot be read: not a directory")
	assert.Contains(t, r.stdout, remedy)
	r = f.run(t, "status", "-o", "json")
	require.Len(t, problemsOfKind(t, r.stdout, problemRemovalUnknown), 1, r.stdout)
	assert.Empty(t, problemsOfKind(t, r.stdout, problemHolderExited))

	r = f.run(t, "gc")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Equal(t, "nothing to release\n", r.stdout)
	assert.Contains(t, r.stderr, "whether it was removed cannot be told: runtime root "+bad+" cannot be read: not a directory")
	assert.Contains(t, r.stderr, remedy)
	assert.Equal(t, []string{uuidGPU1}, claimedBy(f.state(t), idHook))
}
