// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package ctl

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// TestPSNestedContainerIsTheHolders: a process of a container nested in the
// holder's cgroup (docker in docker) names its own container id in its
// path; the daemon's accounting takes it for the holder's (by the holder's
// cgroup, turned from the runtime's systemd cgroupsPath into the path the
// host shows), and so must ps, which says it is the same accounting.
func TestPSNestedContainerIsTheHolders(t *testing.T) {
	f := newFixture(t)
	h := newPSHost(t, f)
	o := ownTrainer
	o.Cgroup = "kubepods-besteffort-pod1.slice:cri-containerd:" + idTrainer
	f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
		claim(t, tx, o, "env", f.dev(t, h.srv.Devices[0].(*server.Device).UUID))
	})
	inner := strings.Repeat("ab", 32)
	h.run(t, 0, 100, "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/cri-containerd-"+
		idTrainer+".scope/docker/"+inner+"\n")
	// Beside it, a container that only shares the holder's pod: not below
	// the holder's cgroup, an intruder still.
	h.run(t, 0, 200, "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/cri-containerd-"+
		idRogue+".scope\n")

	r := f.runPS(t, h, "-o", "json")
	require.Equal(t, ExitAttention, r.code, r.stdout+r.stderr)
	var v psView
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	require.Len(t, v.Devices[0].Processes, 2)
	assert.Equal(t, verdictOK, v.Devices[0].Processes[0].Verdict, "a process below the holder's cgroup is the holder's")
	assert.Equal(t, verdictIntruder, v.Devices[0].Processes[1].Verdict)
	require.Len(t, v.Problems, 1)
	assert.Equal(t, 200, v.Problems[0].Pid)
	assert.Empty(t, v.Notes, "no exempt namespace is configured: nothing ps could not judge")

	h.procs[h.srv.Devices[0].(*server.Device).UUID] = h.procs[h.srv.Devices[0].(*server.Device).UUID][:1]
	r = f.runPS(t, h)
	require.Equal(t, ExitOK, r.code, r.stdout+r.stderr)
}

// TestPSKnowsExemptContainersFromTheAudit: the containers of exempt
// namespaces may use any GPU, and the daemon does not count their
// processes. ps knows them from their "exempt" audit records: their
// processes are exempt, not intruders. What it cannot know (a record the
// rotation dropped, a container nested in an exempt one) it says under the
// table when an intruder is left.
func TestPSKnowsExemptContainersFromTheAudit(t *testing.T) {
	f := newFixture(t)
	h := newPSHost(t, f)
	idAgent := strings.Repeat("9a", 32)
	cg := func(id string) string {
		return "0::/kubepods.slice/kubepods-pod9.slice/cri-containerd-" + id + ".scope\n"
	}
	h.run(t, 1, 300, cg(idAgent))

	// No exemption recorded: an intruder, and nothing to say about it.
	r := f.runPS(t, h, "-o", "json")
	require.Equal(t, ExitAttention, r.code, r.stdout+r.stderr)
	var v psView
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	assert.Equal(t, verdictIntruder, v.Devices[1].Processes[0].Verdict)
	assert.Empty(t, v.Notes)

	l, err := ledger.Open(f.dir, f.ledgerOpts(0))
	require.NoError(t, err)
	require.NoError(t, l.AppendAudit(context.Background(), ledger.AuditRecord{Op: guard.AuditExempt, ContainerID: idAgent,
		Namespace: "monitoring", Pod: "dcgm", Container: "agent", FrontEnd: string(ledger.FrontEndNRI),
		Reason: "policy exempt_namespaces lists namespace monitoring"}))
	r = f.runPS(t, h)
	require.Equal(t, ExitOK, r.code, r.stdout+r.stderr)
	assert.Regexp(t, `(?m)^1 +GPU-\S+ +300 +C +3072MiB +9a9a9a9a9a9a +- +exempt$`, r.stdout)
	assert.NotContains(t, r.stdout, "note:")

	// An intruder beside it: ps says what it cannot know.
	h.run(t, 1, 400, cg(idRogue))
	r = f.runPS(t, h)
	require.Equal(t, ExitAttention, r.code, r.stdout+r.stderr)
	assert.Regexp(t, `(?m)^1 +GPU-\S+ +400 +C +3072MiB +e5e5e5e5e5e5 +- +intruder$`, r.stdout)
	assert.Contains(t, r.stdout, "note: ps knows the containers of policy.exempt_namespaces, which may use any GPU, from "+
		"their \"exempt\" records in the audit log: an intruder above may be one whose record the log's rotation dropped, "+
		"or a container nested in one (the daemon learns them from the runtime through NRI")
	r = f.runPS(t, h, "-o", "json")
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	assert.Equal(t, verdictExempt, v.Devices[1].Processes[0].Verdict)
	assert.Equal(t, verdictIntruder, v.Devices[1].Processes[1].Verdict)
	require.Len(t, v.Notes, 1)
	require.Len(t, v.Problems, 1)
}
