// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// runtimeHost is the fixture plus runtime state roots (runc's and crun's
// formats, from files the real runtimes wrote) whose containers' init
// processes are real processes of this test.
type runtimeHost struct {
	*fixture
	t                  *testing.T
	runcRoot, crunRoot string
	bundles            string
}

func newRuntimeHost(t *testing.T) *runtimeHost {
	f := newFixture(t)
	base := t.TempDir()
	h := &runtimeHost{fixture: f, t: t, runcRoot: filepath.Join(base, "runc"), crunRoot: filepath.Join(base, "crun"),
		bundles: filepath.Join(base, "bundles")}
	cfg, err := os.ReadFile(f.config)
	require.NoError(t, err)
	next := regexp.MustCompile(`(?m)^runtime_roots = .*$`).ReplaceAllString(string(cfg),
		`runtime_roots = ["`+h.runcRoot+`", "`+h.crunRoot+`"]`)
	require.NotEqual(t, string(cfg), next, "the fixture's configuration has a runtime_roots line")
	require.NoError(t, os.WriteFile(f.config, []byte(next), 0o600))
	return h
}

// process starts a process standing for a container's init; it is killed
// when the test ends.
func (h *runtimeHost) process() (int, uint64) {
	cmd := exec.Command("sleep", "3600")
	require.NoError(h.t, cmd.Start())
	h.t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	start, err := liveness.PidStart("/proc", cmd.Process.Pid)
	require.NoError(h.t, err)
	return cmd.Process.Pid, start
}

// container writes the state of container id (runtime "runc" or "crun",
// created or running) with a bundle whose spec sets env. The spec carries
// podman's default capabilities (no CAP_MKNOD): one without a capabilities
// object counts as holding every capability, and its process (this test's
// child, in no cgroup of its own) is fenced by no device cgroup, so it
// would reach every GPU.
func (h *runtimeHost) container(runtime, id string, pid int, start uint64, created bool, env ...string) {
	t := h.t
	bundle := filepath.Join(h.bundles, id)
	require.NoError(t, os.MkdirAll(bundle, 0o700))
	caps := []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_NET_BIND_SERVICE",
		"CAP_SETFCAP", "CAP_SETGID", "CAP_SETPCAP", "CAP_SETUID", "CAP_SYS_CHROOT"}
	spec, err := json.Marshal(specs.Spec{Version: specs.Version,
		Process: &specs.Process{Env: env, Capabilities: &specs.LinuxCapabilities{Bounding: caps, Effective: caps, Permitted: caps}},
		Linux:   &specs.Linux{CgroupsPath: "/k8s.io/" + id}})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), spec, 0o600))

	var m map[string]any
	var root, name string
	switch runtime {
	case "runc":
		root, name = h.runcRoot, "state.json"
		require.NoError(t, json.Unmarshal(readTestdata(t, "runc.state.json"), &m))
		m["id"], m["init_process_pid"], m["init_process_start"] = id, pid, start
		m["config"].(map[string]any)["labels"] = []string{"bundle=" + bundle}
	case "crun":
		root, name = h.crunRoot, "status"
		require.NoError(t, json.Unmarshal(readTestdata(t, "crun.status"), &m))
		m["pid"], m["process-start-time"], m["bundle"] = pid, start, bundle
	}
	data, err := json.Marshal(m)
	require.NoError(t, err)
	dir := filepath.Join(root, id)
	require.NoError(t, os.MkdirAll(dir, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(dir, name), data, 0o600))
	if created {
		require.NoError(t, syscall.Mkfifo(filepath.Join(dir, "exec.fifo"), 0o622))
	}
}

// readTestdata reads a state file the real runtimes wrote (kept with
// package runtimestate).
func readTestdata(t *testing.T, name string) []byte {
	data, err := os.ReadFile(filepath.Join("..", "runtimestate", "testdata", name))
	require.NoError(t, err)
	return data
}

// claim commits, in a transaction of its own, a claim on the device uuid
// for container id as the OCI hook records one.
func (h *runtimeHost) claim(id string, pid int, start uint64, uuid string) {
	t := h.t
	o := ledger.Owner{ContainerID: id, FrontEnd: ledger.FrontEndHook, Pid: pid, PidStart: start, Cgroup: "/k8s.io/" + id}
	h.update(t, now, func(tx *ledger.Tx) {
		_, err := tx.Claim("", o, []devices.Device{h.dev(t, uuid)}, "env")
		require.NoError(t, err)
	})
}

// adopts is the audit log's adopt records.
func (h *runtimeHost) adopts() []ledger.AuditRecord {
	var out []ledger.AuditRecord
	for _, rec := range h.audit(h.t) {
		if rec.Op == ledger.OpAdopt {
			out = append(out, rec)
		}
	}
	return out
}

// TestRecoverAdoptsFromRuntimeState: on a hook host whose journal lost the
// newest commit (h2 claimed GPU 2), recover finds h2 running in runc's
// state and gives its claim back; h1 keeps GPU 1 although the liveness
// check calls it exited, because crun runs it; x, which runs on GPU 1 too,
// is a conflict; a container whose pid was reused is stopped and adopts
// nothing. --dry-run shows the same and writes nothing; --no-runtime does
// none of it.
func TestRecoverAdoptsFromRuntimeState(t *testing.T) {
	h := newRuntimeHost(t)
	p1, s1 := h.process()
	p2, s2 := h.process()
	px, sx := h.process()
	pr, _ := h.process()
	h.container("crun", "h1", p1, s1, false, "NVIDIA_VISIBLE_DEVICES=1")
	h.container("runc", "h2", p2, s2, true, "NVIDIA_VISIBLE_DEVICES=2")
	h.container("runc", "x", px, sx, false, "NVIDIA_VISIBLE_DEVICES=1")
	h.container("runc", "reused", pr, 12345, false, "NVIDIA_VISIBLE_DEVICES=3")
	h.liveness["h1"] = "cgroup has no processes" // wrong, as a liveness check can be

	h.claim("h1", p1, s1, uuidGPU1)
	h.claim("h2", p2, s2, uuidGPU2)
	journal := filepath.Join(h.dir, "ledger.journal")
	data, err := os.ReadFile(journal)
	require.NoError(t, err)
	data[len(data)-10] ^= 0x20 // inside h2's record
	require.NoError(t, os.WriteFile(journal, data, 0o600))

	r := h.run(t, "recover", "--dry-run", "--no-runtime")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "released (holder exited): GPU 1")
	assert.NotContains(t, r.stdout, "adopt")

	r = h.run(t, "recover", "--dry-run")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "would adopt (running without a claim): GPU 2")
	assert.Contains(t, r.stdout, "container h2")
	assert.Contains(t, r.stdout, "CONFLICT: container x runs on GPU 1")
	assert.Contains(t, r.stdout, "held by container h1")
	assert.NotContains(t, r.stdout, "released")
	assert.Contains(t, r.stdout, "runtime state read: "+h.runcRoot+", "+h.crunRoot+": 3 running or created container(s)")
	require.Equal(t, ExitError, h.run(t, "status").code, "a dry run leaves the ledger to recover")

	r = h.run(t, "recover", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	var out struct {
		Lost     string          `json:"lost"`
		Adopted  []ledger.Claim  `json:"adopted"`
		Conflict []ledger.Claim  `json:"conflicts"`
		Released []ledger.Claim  `json:"released"`
		Claims   []ledger.Claim  `json:"claims"`
		Runtime  json.RawMessage `json:"runtime"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &out), r.stdout)
	assert.NotEmpty(t, out.Lost, "recover says commits were lost")
	require.Len(t, out.Adopted, 1)
	assert.Equal(t, "h2", out.Adopted[0].Owner.ContainerID)
	assert.Equal(t, uuidGPU2, out.Adopted[0].Device.UUID)
	assert.Equal(t, p2, out.Adopted[0].Owner.Pid)
	assert.Equal(t, s2, out.Adopted[0].Owner.PidStart, "the start time the runtime recorded, against pid reuse")
	assert.Equal(t, ledger.FrontEndHook, out.Adopted[0].Owner.FrontEnd)
	assert.Contains(t, out.Adopted[0].Source, "NVIDIA_VISIBLE_DEVICES")
	require.Len(t, out.Conflict, 1)
	assert.Equal(t, "x", out.Conflict[0].Owner.ContainerID)
	assert.Empty(t, out.Released)
	var scan struct {
		Live int `json:"live"`
	}
	require.NoError(t, json.Unmarshal(out.Runtime, &scan))
	assert.Equal(t, 3, scan.Live)

	st := h.state(t)
	got := map[string]string{}
	for _, c := range st.Claims {
		got[c.Device.UUID] = c.Owner.ContainerID
	}
	assert.Equal(t, map[string]string{uuidGPU1: "h1", uuidGPU2: "h2"}, got)
	require.Len(t, st.Conflicts, 1)

	adopts := h.adopts()
	require.Len(t, adopts, 1)
	assert.Equal(t, "recover: found created in runc state ("+h.runcRoot+")", adopts[0].Reason)
	assert.Equal(t, "h2", adopts[0].ContainerID)

	// The ledger is healthy again; status shows the conflict for an operator.
	r = h.run(t, "status")
	require.Equal(t, ExitAttention, r.code, r.stdout+r.stderr)
	assert.Contains(t, r.stdout, "x (x) uses it too")
}

// TestRecoverRuntimeScanNeedsTheInventory: running containers whose GPUs
// cannot be told because the inventory does not load make recover refuse
// (a lost claim would stay lost), saying how to go on.
func TestRecoverRuntimeScanNeedsTheInventory(t *testing.T) {
	h := newRuntimeHost(t)
	pid, start := h.process()
	h.container("runc", "h2", pid, start, false, "NVIDIA_VISIBLE_DEVICES=2")
	h.claim("h1", pid, start, uuidGPU1)
	require.NoError(t, os.WriteFile(filepath.Join(h.dir, "ledger.json"), []byte("garbage"), 0o600))
	h.setSource(t, "nvml") // no NVML here: the inventory does not load
	require.NoError(t, os.Remove(filepath.Join(h.dir, "inventory.json")))

	r := h.run(t, "recover")
	require.Equal(t, ExitError, r.code, r.stdout)
	assert.Contains(t, r.stderr, "the runtimes run 1 container(s)")
	assert.Contains(t, r.stderr, "--no-runtime")
	require.Equal(t, ExitError, h.run(t, "status").code, "nothing was written")
	assert.True(t, strings.Contains(h.run(t, "recover", "--no-runtime").stdout, "recovered"), "--no-runtime recovers without the scan")
}

// TestResetAdoptsFromRuntimeState: when nothing verifies, --reset starts
// from the containers the runtimes run instead of nothing: h2 holds GPU 2
// again, and the audit says where it was found.
func TestResetAdoptsFromRuntimeState(t *testing.T) {
	h := newRuntimeHost(t)
	pid, start := h.process()
	h.container("runc", "h2", pid, start, false, "NVIDIA_VISIBLE_DEVICES=2")
	h.claim("h2", pid, start, uuidGPU2)
	for _, name := range []string{"ledger.json", "ledger.journal"} {
		require.NoError(t, os.WriteFile(filepath.Join(h.dir, name), []byte("garbage"), 0o600))
	}
	r := h.run(t, "recover")
	require.Equal(t, ExitError, r.code, "nothing verifies: %s", r.stdout)

	r = h.run(t, "recover", "--reset", "--reason", "test")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "reset to the containers the runtimes run")
	assert.Contains(t, r.stdout, "adopted (running without a claim): GPU 2")
	st := h.state(t)
	require.Len(t, st.Claims, 1)
	assert.Equal(t, "h2", st.Claims[0].Owner.ContainerID)
	assert.Equal(t, uuidGPU2, st.Claims[0].Device.UUID)
	adopts := h.adopts()
	require.Len(t, adopts, 1)
	assert.Equal(t, "reset: found running in runc state ("+h.runcRoot+")", adopts[0].Reason)

	// The ledger is healthy now: a reset takes --force, and keeps the
	// claim of h2, which still runs, even with --no-runtime (the ledger's
	// own record, read under its lock, says so).
	r = h.run(t, "recover", "--reset", "--no-runtime", "--force")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "kept (holder running, not yet started or draining): GPU 2")
	require.Len(t, h.state(t).Claims, 1)

	// h2's spec names /k8s.io/h2, but its process (the test's sleep) is
	// not in that cgroup: the adopted claim records none, and liveness
	// goes by its pid.
	assert.Empty(t, h.state(t).Claims[0].Owner.Cgroup)
	assert.Equal(t, pid, h.state(t).Claims[0].Owner.Pid)

	// Once h2 exited, --no-runtime starts empty, as before.
	h.liveness["pid:"+strconv.Itoa(pid)] = "process gone"
	r = h.run(t, "recover", "--reset", "--no-runtime", "--force")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "reset: empty")
	assert.Empty(t, h.state(t).Claims)
}

// TestRecoverHealthyLedgerReadsNoRuntime: on a healthy ledger recover does
// nothing, even where reading the runtimes would fail for want of an
// inventory.
func TestRecoverHealthyLedgerReadsNoRuntime(t *testing.T) {
	h := newRuntimeHost(t)
	pid, start := h.process()
	h.container("runc", "h2", pid, start, false, "NVIDIA_VISIBLE_DEVICES=2")
	h.claim("h1", pid, start, uuidGPU1)
	h.setSource(t, "nvml")
	require.NoError(t, os.Remove(filepath.Join(h.dir, "inventory.json")))
	r := h.run(t, "recover", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.NotContains(t, r.stdout, `"runtime"`)
	assert.NotContains(t, r.stdout, `"adopted"`)
	assert.Contains(t, r.stdout, `"waiters": []`, "lists are present, [] when empty")
	assert.NotContains(t, r.stdout, "null")
}

// TestRecoverDoesNotAdoptATicketFormID: a running container whose id has the
// form of a gpu-guard-ctl run ticket (admitted before the hook refused such
// ids, or run without the hook) is not adopted: its claim would be taken for
// a ticket's and released as soon as its process is gone, whatever
// release_on says. It is listed as unresolved: a claim it holds is kept.
func TestRecoverDoesNotAdoptATicketFormID(t *testing.T) {
	h := newRuntimeHost(t)
	p1, s1 := h.process()
	pt, st := h.process()
	h.container("runc", "h1", p1, s1, false, "NVIDIA_VISIBLE_DEVICES=1")
	ticketForm := guard.NewTicketID()
	h.container("runc", ticketForm, pt, st, false, "NVIDIA_VISIBLE_DEVICES=3")
	h.claim("h1", p1, s1, uuidGPU1)
	journal := filepath.Join(h.dir, "ledger.journal")
	data, err := os.ReadFile(journal)
	require.NoError(t, err)
	data[len(data)-10] ^= 0x20
	require.NoError(t, os.WriteFile(journal, data, 0o600))

	r := h.run(t, "recover")
	require.Equal(t, ExitOK, r.code, r.stdout+r.stderr)
	assert.Contains(t, r.stdout+r.stderr, "runc container "+ledger.ShortID(ticketForm)+" runs")
	assert.Contains(t, r.stdout+r.stderr, "form of a gpu-guard-ctl run ticket")
	for _, c := range h.state(t).Claims {
		assert.NotEqual(t, ticketForm, c.Owner.ContainerID, "not adopted")
	}
}
