// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// stateInCgroup is stateFor with the spec's linux.cgroupsPath set to
// cgroupsPath.
func stateInCgroup(t *testing.T, id string, pid int, cgroupsPath string, env ...string) string {
	t.Helper()
	bundle := t.TempDir()
	data, err := json.Marshal(specs.Spec{Version: specs.Version, Process: &specs.Process{Env: env, Capabilities: podmanCaps()},
		Linux: &specs.Linux{CgroupsPath: cgroupsPath}})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o600))
	st, err := json.Marshal(specs.State{Version: specs.Version, ID: id, Status: specs.StateCreating, Pid: pid, Bundle: bundle})
	require.NoError(t, err)
	return string(st)
}

// The spec's cgroupsPath is written by whoever creates the container; it is
// recorded as the holder's cgroup only when the container's process is in
// it (or, for a cgroup named after the container, below it: crun's systemd
// driver), compared on the hierarchy the liveness check reads. Otherwise
// the process's own cgroup is recorded by the rule for a spec that names
// none, or nothing.
func TestSpecCgroupRecordedOnlyWhenTheProcessIsInIt(t *testing.T) {
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	const podSlice = "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice"
	for _, tc := range []struct {
		name, spec, cgroup string // cgroup: file of pid 4242; "" = unreadable
		want               string
	}{
		{"cgroupfs, placed", "/k8s.io/train", "0::/k8s.io/train\n", "/k8s.io/train"},
		{"cgroupfs relative, placed", "k8s.io/train", "0::/k8s.io/train\n", "k8s.io/train"},
		{"systemd, placed", "kubepods-besteffort-pod1.slice:cri-containerd:train",
			"0::" + podSlice + "/cri-containerd-train.scope\n", "kubepods-besteffort-pod1.slice:cri-containerd:train"},
		{"crun systemd, in the scope's sub-cgroup", "machine.slice:libpod:train",
			"0::/machine.slice/libpod-train.scope/container\n", "machine.slice:libpod:train"},
		{"cgroup v1, placed", "/k8s.io/train", "12:pids:/k8s.io/train\n11:memory:/k8s.io/train\n0::/system.slice/containerd.service\n",
			"/k8s.io/train"},
		{"not placed: an empty cgroup of the host named", "/sys-kernel-debug.mount", session, ""},
		{"not placed, but in a cgroup of its own", "/sys-kernel-debug.mount", "0::/train\n", "/train"},
		{"a shared cgroup above the process named", "/user.slice", session, ""},
		{"a cgroup whose name only begins like the process's", "/k8s.io/train", "0::/k8s.io/trainer\n", ""},
		{"cgroup v1, named in another hierarchy only", "/k8s.io/train",
			"12:pids:/user.slice\n11:memory:/user.slice\n0::/k8s.io/train\n", ""},
		{"the process's cgroup unreadable", "/k8s.io/train", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			fakeProc(t, root, 4242, 4000, "app")
			if tc.cgroup != "" {
				require.NoError(t, os.WriteFile(filepath.Join(root, "4242", "cgroup"), []byte(tc.cgroup), 0o644))
			}
			fakeProc(t, root, 4000, 1, "runc")
			require.NoError(t, os.WriteFile(filepath.Join(root, "4000", "cgroup"), []byte(session), 0o644))
			cfg := staticConfig(t)
			opened := 0
			e := testEnv(&opened)
			e.procRoot = root
			e.getppid = func() int { return 4000 }
			require.NoError(t, e.run(t.Context(), PhaseCreateRuntime, cfg,
				strings.NewReader(stateInCgroup(t, "train", 4242, tc.spec, "NVIDIA_VISIBLE_DEVICES=1")), io.Discard))
			st := ledgerState(t, cfg)
			require.Len(t, st.Claims, 1)
			require.Equal(t, tc.want, st.Claims[0].Owner.Cgroup)
		})
	}
}

// A container whose runtime left it in its caller's cgroup, and whose
// cgroupsPath names an existing cgroup without processes, keeps its GPU
// while its process runs: the liveness check, reading the real checker over
// a fake cgroup v2 tree and procfs, goes by the pid, and a second container
// asking for the GPU is refused rather than admitted onto it.
func TestRunningHolderNamingAnEmptyCgroupKeepsItsGPU(t *testing.T) {
	cgRoot, procRoot := t.TempDir(), t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(cgRoot, "cgroup.controllers"), []byte("cpu memory\n"), 0o644))
	empty := filepath.Join(cgRoot, "sys-kernel-debug.mount")
	require.NoError(t, os.MkdirAll(empty, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(empty, "cgroup.events"), []byte("populated 0\nfrozen 0\n"), 0o644))
	const session = "0::/user.slice/user-0.slice/session-1.scope\n"
	for _, pid := range []int{4000, 4242, 4343} {
		fakeProc(t, procRoot, pid, 4000, "app")
		require.NoError(t, os.WriteFile(filepath.Join(procRoot, strconv.Itoa(pid), "cgroup"), []byte(session), 0o644))
	}

	cfg := staticConfig(t)
	checker := liveness.New(cgRoot, procRoot)
	e := defaultEnv()
	e.procRoot = procRoot
	e.getppid = func() int { return 4000 }
	e.openGuard = func(cfg config.Config, inv *devices.Inventory) (guardAPI, func(), error) {
		led, err := ledger.Open(cfg.Ledger.Dir, guard.LedgerOptions(cfg))
		if err != nil {
			return nil, nil, err
		}
		g, err := guard.New(guard.Options{Config: cfg, Inventory: inv, Ledger: led, Liveness: checker})
		return g, func() {}, err
	}

	require.NoError(t, e.run(t.Context(), PhaseCreateRuntime, cfg,
		strings.NewReader(stateInCgroup(t, "victim", 4242, "/sys-kernel-debug.mount", "NVIDIA_VISIBLE_DEVICES=1")), io.Discard))
	exited, why := checker.Exited(liveness.Process{Pid: 4242, PidStart: 12345, Cgroup: ownerOf(t, cfg, "victim").Cgroup})
	require.False(t, exited, "the holder runs: %s", why)

	err := e.run(t.Context(), PhaseCreateRuntime, cfg,
		strings.NewReader(stateInCgroup(t, "other", 4343, "/sys-kernel-debug.mount", "NVIDIA_VISIBLE_DEVICES=1")), io.Discard)
	require.ErrorIs(t, err, guard.ErrQueued)
	require.Equal(t, "victim", ownerOf(t, cfg, "victim").ContainerID, "the running holder keeps its claim")
}

// ownerOf returns the owner of container id's claim in cfg's ledger.
func ownerOf(t *testing.T, cfg config.Config, id string) ledger.Owner {
	t.Helper()
	st := ledgerState(t, cfg)
	for _, c := range st.Claims {
		if c.Owner.ContainerID == id {
			return c.Owner
		}
	}
	require.Failf(t, "no claim", "container %s holds nothing", id)
	return ledger.Owner{}
}

// A state without a pid gives no process to verify the spec's cgroupsPath
// by: none is recorded, and the liveness check keeps the claim ("never
// started") rather than reading a cgroup someone else may own.
func TestNoPidRecordsNoCgroup(t *testing.T) {
	cfg := staticConfig(t)
	opened := 0
	e := testEnv(&opened)
	e.procRoot = t.TempDir()
	require.NoError(t, e.run(t.Context(), PhaseCreateRuntime, cfg,
		strings.NewReader(stateInCgroup(t, "train", 0, "/sys-kernel-debug.mount", "NVIDIA_VISIBLE_DEVICES=1")), io.Discard))
	require.Empty(t, ownerOf(t, cfg, "train").Cgroup)
}
