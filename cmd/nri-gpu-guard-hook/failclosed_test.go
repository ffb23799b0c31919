// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"hash/crc32"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
)

// State file names of ledger format 2 (see pkg/ledger's doc.go).
const (
	snapshotFile = "ledger.json"
	journalFile  = "ledger.journal"
)

// busyHost is a hook-only host with two holders (h1 on GPU 0, h2 on GPU 1)
// and three waiting hooks (w1 and w3 for GPU 0, w2 for GPU 1), every one a
// real process: the hooks were run as runc runs them, and each container's
// pid is a live process. The waiting hooks poll once a minute (see
// host.waitCfgPath): queued, they leave the ledger to the test.
type busyHost struct {
	*host
	holderCtr map[string]*exec.Cmd
	waiting   []*proc
}

func newBusyHost(t *testing.T) *busyHost {
	t.Helper()
	h := &busyHost{host: newHost(t), holderCtr: map[string]*exec.Cmd{}}
	for i, id := range []string{"h1", "h2"} {
		h.holderCtr[id] = h.ctrCmd()
		r := h.hook(hook.PhaseCreateRuntime, id, h.holderCtr[id].Process.Pid, gpuEnv(i))
		require.Equal(t, 0, r.code, "holder %s: %s", id, r)
	}
	for i, id := range []string{"w1", "w2", "w3"} {
		p := startProc(t, h.state(id, h.ctrProcess(), gpuEnv(i%2)), hookBin, hook.PhaseCreateRuntime, "--config", h.waitCfgPath, "--wait")
		h.waiting = append(h.waiting, p)
		// One at a time: the queue order is the order of arrival.
		h.waitFor(id+" queued", func() bool {
			st, err := h.snapshot()
			return err == nil && len(st.Waiters) == i+1
		})
	}
	h.requireBusy("set up")
	return h
}

// requireBusy checks the ledger holds both holders and the three waiters in
// order, status says so with exit 0, and a new request for a held GPU is
// refused as busy.
func (h *busyHost) requireBusy(when string) {
	t := h.t
	t.Helper()
	st, err := h.snapshot()
	require.NoError(t, err, when)
	require.Equal(t, map[string]string{"0": "h1", "1": "h2"}, h.holders(st), "%s: both holders", when)
	require.Equal(t, []string{"w1", "w2", "w3"}, waiterKeys(st), "%s: the waiters, in order", when)
	r := h.ctl("status")
	require.Equal(t, 0, r.code, "%s: status: %s", when, r)
	r = h.hook(hook.PhaseCreateRuntime, "late", h.ctrProcess(), gpuEnv(0))
	require.Equal(t, hook.ExitBusy, r.code, "%s: a new request for held GPU 0: %s", when, r)
	assert.Contains(t, r.stderr, "is held by container h1", when)
}

// requireQueueWorks ends holder h1: GPU 0 is reserved for w1, the head of
// its queue, and a newcomer is still refused.
func (h *busyHost) requireQueueWorks() {
	t := h.t
	t.Helper()
	end(t, h.holderCtr["h1"])
	r := h.hook(hook.PhasePoststop, "h1", 0, gpuEnv(0))
	require.Equal(t, 0, r.code, "poststop of h1: %s", r)
	st, err := h.snapshot()
	require.NoError(t, err)
	require.Len(t, st.Reservations, 1, "GPU 0 is reserved for the head of its queue")
	assert.Equal(t, "w1", st.Reservations[0].For)
	assert.Equal(t, gpuUUIDs[0], st.Reservations[0].Device.UUID)
	r = h.hook(hook.PhaseCreateRuntime, "late2", h.ctrProcess(), gpuEnv(0))
	require.Equal(t, hook.ExitBusy, r.code, "a newcomer for GPU 0, reserved for w1: %s", r)
}

// requireFailsClosed checks that while the ledger needs recovery, no GPU
// container is admitted (for a held GPU or a free one), each refusal saying
// what is wrong and what to do; a container that reaches no GPU is admitted
// (the hook decides that before reading the inventory or the ledger: it
// needs no GPU bookkeeping); and status exits non-zero saying so.
func (h *busyHost) requireFailsClosed() {
	t := h.t
	t.Helper()
	for _, gpu := range []int{0, 2} {
		r := h.hook(hook.PhaseCreateRuntime, "intruder"+strconv.Itoa(gpu), h.ctrProcess(), gpuEnv(gpu))
		require.Equal(t, hook.ExitRefused, r.code, "GPU %d must be refused: %s", gpu, r)
		assert.Contains(t, r.stderr, "GPU ledger needs recovery", "GPU %d", gpu)
		assert.Contains(t, r.stderr, "NO container gets a GPU until it is recovered", "GPU %d", gpu)
		assert.Contains(t, r.stderr, "gpu-guard-ctl recover", "GPU %d: what the operator does", gpu)
	}
	r := h.hook(hook.PhaseCreateRuntime, "plain", h.ctrProcess())
	require.Equal(t, 0, r.code, "a container without GPUs: %s", r)

	r = h.ctl("status")
	require.NotEqual(t, 0, r.code, "status of a ledger that needs recovery: %s", r)
	assert.Contains(t, r.stderr, "NO container gets a GPU until the ledger is recovered")
	assert.Contains(t, r.stderr, "gpu-guard-ctl recover")
}

// recoverLedger runs `gpu-guard-ctl recover` and checks its report: whether
// it found a problem, and whether every commit came back.
func (h *busyHost) recoverLedger(wantProblem, wantComplete bool) {
	t := h.t
	t.Helper()
	r := h.ctl("recover", "-o", "json")
	require.Equal(t, 0, r.code, "recover: %s", r)
	var rep struct {
		Problem  string `json:"problem"`
		Complete bool   `json:"complete"`
		Lost     string `json:"lost"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &rep), r.stdout)
	require.Equal(t, wantProblem, rep.Problem != "", "recover's problem: %q", rep.Problem)
	require.Equal(t, wantComplete, rep.Complete, "recover complete (lost: %q)", rep.Lost)
	if !wantComplete {
		assert.NotEmpty(t, rep.Lost, "recover says what was lost")
	}
}

// rewrite replaces a state file with mangle(its bytes).
func rewrite(name string, mangle func(b []byte) []byte) func(t *testing.T, dir string) {
	return func(t *testing.T, dir string) {
		p := filepath.Join(dir, name)
		b, err := os.ReadFile(p)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(p, mangle(bytes.Clone(b)), 0o600))
	}
}

// contentDamage is the seven ways of the fail-open report to damage a file's
// content; twoHolders is the seventh, which needs the file's format.
func contentDamage(name string, twoHolders func(t *testing.T, dir string)) []attack {
	return []attack{
		{name: name + " empty", do: rewrite(name, func([]byte) []byte { return nil })},
		{name: name + " truncated", do: rewrite(name, func(b []byte) []byte { return b[:len(b)*2/3] })},
		{name: name + " garbage", do: rewrite(name, func([]byte) []byte { return []byte("\x7fELF garbage\x00\x00 not a ledger") })},
		{name: name + " NUL-filled", do: rewrite(name, func(b []byte) []byte { return make([]byte, len(b)) })},
		{name: name + " over-size", do: func(t *testing.T, dir string) {
			require.NoError(t, os.Truncate(filepath.Join(dir, name), 65<<20)) // sparse: cheap
		}},
		{name: name + " flipped byte", do: rewrite(name, func(b []byte) []byte { b[len(b)-10] ^= 0x20; return b })},
		{name: name + " two holders of GPU 0, valid checksum", do: twoHolders},
	}
}

// intruderClaim is a claim on a MIG instance of GPU 0, which h1 holds whole:
// a second holder of GPU 0.
var intruderClaim = map[string]any{
	"device": map[string]any{"uuid": "MIG-6c1a2f2e-0000-4000-8000-0000000000f0", "index": "0:0", "kind": "mig", "parent": gpuUUIDs[0]},
	"owner":  map[string]any{"container_id": "intruder", "front_end": "hook"},
	"source": "env", "since": "2026-01-01T00:00:00Z",
}

// snapshotTwoHolders rewrites ledger.json with the intruder's claim added
// and a header whose checksum and length match: only the content says it
// is wrong.
func snapshotTwoHolders(t *testing.T, dir string) {
	p := filepath.Join(dir, snapshotFile)
	b, err := os.ReadFile(p)
	require.NoError(t, err)
	hdrLine, body, ok := bytes.Cut(b, []byte("\n"))
	require.True(t, ok)
	var hdr, st map[string]any
	dec := json.NewDecoder(bytes.NewReader(hdrLine))
	dec.UseNumber()
	require.NoError(t, dec.Decode(&hdr))
	dec = json.NewDecoder(bytes.NewReader(bytes.TrimSuffix(body, []byte("\n"))))
	dec.UseNumber()
	require.NoError(t, dec.Decode(&st))
	claims, _ := st["claims"].([]any)
	st["claims"] = append(claims, intruderClaim)
	nb, err := json.Marshal(st)
	require.NoError(t, err)
	sum := sha256.Sum256(nb)
	hdr["checksum"] = "sha256:" + hex.EncodeToString(sum[:])
	hdr["bytes"] = len(nb)
	nh, err := json.Marshal(hdr)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p, append(append(append(nh, '\n'), nb...), '\n'), 0o600))
}

// journalTwoHolders appends a record that gives the intruder a MIG instance
// of GPU 0, framed like a real one (the next generation, a valid CRC-32C).
func journalTwoHolders(t *testing.T, dir string) {
	p := filepath.Join(dir, journalFile)
	b, err := os.ReadFile(p)
	require.NoError(t, err)
	lines := bytes.Split(bytes.TrimSuffix(b, []byte("\n")), []byte("\n"))
	var last map[string]any
	dec := json.NewDecoder(bytes.NewReader(lines[len(lines)-1][9:]))
	dec.UseNumber()
	require.NoError(t, dec.Decode(&last))
	g, err := last["g"].(json.Number).Int64()
	require.NoError(t, err, "the last journal line is a record")
	rec, err := json.Marshal(map[string]any{"g": g + 1, "t": last["t"], "seq": last["seq"], "c": []any{intruderClaim}})
	require.NoError(t, err)
	var crc [4]byte
	binary.BigEndian.PutUint32(crc[:], crc32.Checksum(rec, crc32.MakeTable(crc32.Castagnoli)))
	line := append(append([]byte(hex.EncodeToString(crc[:])+" "), rec...), '\n')
	require.NoError(t, os.WriteFile(p, append(b, line...), 0o600))
}

type attack struct {
	name string
	do   func(t *testing.T, dir string)
	// undo is what the operator does before recovering (put back what was
	// moved).
	undo func(t *testing.T, dir string)
	// journal: the attack is on the journal of commits made after the
	// snapshot holding the holders and waiters; those commits are lost.
	journal bool
}

// TestFailClosedThroughHookProcesses is the fail-open report's attack, done
// with the real binaries on a hook-only host with 2 holders and 3 waiters:
// every content damage of the snapshot and of the journal, the state dir
// moved away, ledger.json deleted. Each time the next create-runtime for a
// GPU (held or free) is refused with a message that says the ledger needs
// recovery and what to do, a container without GPUs is still admitted, and
// status exits non-zero; after `gpu-guard-ctl recover` both holders and the
// waiters are back, and a new request for a held GPU is refused as busy.
func TestFailClosedThroughHookProcesses(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("gpu-guard-ctl recover is root only")
	}
	attacks := contentDamage(snapshotFile, snapshotTwoHolders)
	for _, a := range contentDamage(journalFile, journalTwoHolders) {
		a.journal = true
		attacks = append(attacks, a)
	}
	attacks = append(attacks,
		attack{name: "state dir moved away", do: func(t *testing.T, dir string) {
			require.NoError(t, os.Rename(dir, dir+"-stolen"))
		}, undo: func(t *testing.T, dir string) {
			require.NoError(t, os.Rename(dir+"-stolen", dir))
		}},
		attack{name: "ledger.json deleted", do: func(t *testing.T, dir string) {
			require.NoError(t, os.Remove(filepath.Join(dir, snapshotFile)))
		}},
	)
	for _, a := range attacks {
		t.Run(a.name, func(t *testing.T) {
			h := newBusyHost(t)
			if a.journal {
				// The holders and waiters into the snapshot (a recovery
				// writes one), then commits into the journal: a scratch
				// container claims GPU 2 and ends.
				rewrite(snapshotFile, func([]byte) []byte { return nil })(t, h.stateDir)
				h.recoverLedger(true, true)
				scratch := h.ctrCmd()
				r := h.hook(hook.PhaseCreateRuntime, "scratch", scratch.Process.Pid, gpuEnv(2))
				require.Equal(t, 0, r.code, "scratch: %s", r)
				end(t, scratch)
				r = h.hook(hook.PhasePoststop, "scratch", 0, gpuEnv(2))
				require.Equal(t, 0, r.code, "scratch poststop: %s", r)
				j, err := os.ReadFile(filepath.Join(h.stateDir, journalFile))
				require.NoError(t, err)
				require.GreaterOrEqual(t, bytes.Count(j, []byte("\n")), 3, "the journal holds a header and the scratch commits")
			}
			a.do(t, h.stateDir)
			h.requireFailsClosed()
			if a.undo != nil {
				a.undo(t, h.stateDir)
			}
			// A damaged journal loses some of the commits it held (the
			// scratch claim or release: a claim that comes back is
			// released, its holder having exited); recover says so. A
			// forged record appended after the real ones loses nothing; a
			// state dir put back needs no recovery.
			lossy := a.journal && a.name != journalFile+" two holders of GPU 0, valid checksum"
			h.recoverLedger(a.undo == nil, !lossy)
			h.requireBusy("after recovery")
			h.requireQueueWorks()
		})
	}
}
