// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// hookCtr is what a hook reads from a spec its creator wrote: the CRI
// annotations name any pod they like.
func hookCtr(ns, pod, name, id string) ledger.Owner {
	o := ctr(ns, pod, name, id)
	o.FrontEnd = ledger.FrontEndHook
	return o
}

func (e *env) admitAs(fe ledger.FrontEnd, o ledger.Owner, spec devices.Request) guard.Decision {
	e.t.Helper()
	d, err := e.g.Admit(ctx, guard.Request{FrontEnd: fe, Owner: o, Spec: spec})
	require.NoError(e.t, err)
	return d
}

func (e *env) audit(op string) []ledger.AuditRecord {
	e.t.Helper()
	recs, err := ledger.ReadAudit(e.l.AuditPath())
	require.NoError(e.t, err)
	var out []ledger.AuditRecord
	for _, r := range recs {
		if r.Op == op {
			out = append(out, r)
		}
	}
	return out
}

// A hook container annotated with an exempt namespace is checked like any
// other: under podman, --annotation io.kubernetes.pod.namespace=... is the
// user's to set.
func TestHookCannotClaimExemption(t *testing.T) {
	e := newEnv(t, func(c *config.Config) { c.Policy.ExemptNamespaces = []string{"gpu-monitoring"} })
	holder := ctr("ml", "a", "main", "holder0000000001")
	require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)

	spoof := hookCtr("gpu-monitoring", "dcgm", "exporter", "spoof00000000001")
	d := e.admitAs(ledger.FrontEndHook, spoof, visible("1"))
	assert.Equal(t, guard.Queue, d.Result, d.Message)
	assert.Equal(t, "busy", d.Reason)
	assert.Equal(t, map[string]string{uuid(1): holder.ContainerID}, e.holders())
	assert.Empty(t, e.audit(guard.AuditExempt))

	// The same identity through NRI (containerd's CRI metadata) is exempt,
	// and the exemption is audited with the devices it reaches.
	nri := ctr("gpu-monitoring", "dcgm", "exporter", "dcgm000000000001")
	d = e.admit(nri, visible("1"))
	assert.Equal(t, guard.Skip, d.Result)
	assert.Equal(t, "exempt", d.Reason)
	recs := e.audit(guard.AuditExempt)
	require.Len(t, recs, 1)
	assert.Equal(t, []string{uuid(1)}, recs[0].Devices)
	assert.Equal(t, nri.ContainerID, recs[0].ContainerID)
	assert.Equal(t, "gpu-monitoring", recs[0].Namespace)
	assert.Equal(t, string(ledger.FrontEndNRI), recs[0].FrontEnd)
	assert.Equal(t, map[string]string{uuid(1): holder.ContainerID}, e.holders(), "an exemption claims nothing")

	// An exempt container that reaches no GPU is no exemption: no record.
	d = e.admit(ctr("gpu-monitoring", "web", "nginx", "web0000000000001"), devices.Request{Env: []string{"PATH=/bin"}})
	assert.Equal(t, "no-gpu", d.Reason)
	assert.Len(t, e.audit(guard.AuditExempt), 1)

	// Explain (a dry run) writes nothing.
	_, err := e.g.Explain(ctx, guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: nri, Spec: visible("2")})
	require.NoError(t, err)
	assert.Len(t, e.audit(guard.AuditExempt), 1)
}

// An exemption that cannot be audited is not granted: not on a read-only
// ledger, and not when the audit log cannot be written, even when the same
// ledger transaction would also have changed state (a waiter expiring), whose
// commit could only log a failed audit append.
func TestExemptionFailsClosedWithoutAudit(t *testing.T) {
	exempt := func(c *config.Config) { c.Policy.ExemptNamespaces = []string{"gpu-monitoring"} }
	dcgm := ctr("gpu-monitoring", "dcgm", "exporter", "dcgm000000000001")

	t.Run("read-only ledger", func(t *testing.T) {
		e := newEnv(t, exempt)
		ro, err := ledger.OpenReadOnly(e.cfg.Ledger.Dir, ledger.Options{})
		require.NoError(t, err)
		g, err := guard.New(guard.Options{Config: e.cfg, Inventory: inventory(t), Ledger: ro, Liveness: e.live})
		require.NoError(t, err)
		_, err = g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: dcgm, Spec: visible("1")})
		require.ErrorIs(t, err, ledger.ErrReadOnly)
	})

	t.Run("audit log unwritable while state changes", func(t *testing.T) {
		e := newEnv(t, exempt)
		holder := ctr("ml", "a", "main", "holder0000000001")
		require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
		require.Equal(t, guard.Queue, e.admit(ctr("ml", "b", "main", "waiter0000000001"), visible("1")).Result)
		// The waiter is not seen again for queue_ttl: the next transaction
		// drops it, a state change that commits.
		e.clock.advance(e.cfg.Policy.QueueTTL.Duration + time.Minute)
		before, err := ledger.ReadAudit(e.l.AuditPath())
		require.NoError(t, err)
		// A real condition, as a full disk or a planted file would make it:
		// audit.log is a directory, so no append can succeed.
		aside := e.l.AuditPath() + ".moved"
		require.NoError(t, os.Rename(e.l.AuditPath(), aside))
		require.NoError(t, os.Mkdir(e.l.AuditPath(), 0o700))

		_, err = e.g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: dcgm, Spec: visible("1")})
		require.Error(t, err, "an exemption without its audit record must be refused")
		assert.Contains(t, err.Error(), e.l.AuditPath())
		assert.Contains(t, err.Error(), "an exemption is granted only once its audit record is on disk")

		require.NoError(t, os.Remove(e.l.AuditPath()))
		require.NoError(t, os.Rename(aside, e.l.AuditPath()))
		after, err := ledger.ReadAudit(e.l.AuditPath())
		require.NoError(t, err)
		assert.Equal(t, before, after, "nothing was recorded, and nothing was admitted")
		assert.Equal(t, map[string]string{uuid(1): holder.ContainerID}, e.holders())

		// With the audit log back, the exemption is granted and recorded,
		// durably and stamped with the current generation.
		d := e.admit(dcgm, visible("1"))
		require.Equal(t, guard.Skip, d.Result)
		recs := e.audit(guard.AuditExempt)
		require.Len(t, recs, 1)
		assert.Equal(t, dcgm.ContainerID, recs[0].ContainerID)
		assert.Equal(t, []string{uuid(1)}, recs[0].Devices)
		st, err := e.l.Snapshot(ctx)
		require.NoError(t, err)
		assert.Equal(t, st.Generation, recs[0].Generation)
		assert.Equal(t, e.clock.Now(), recs[0].Time.UTC())
	})

	t.Run("ledger needs recovery", func(t *testing.T) {
		e := newEnv(t, exempt)
		require.Equal(t, guard.Admit, e.admit(ctr("ml", "a", "main", "holder0000000001"), visible("1")).Result)
		require.NoError(t, os.WriteFile(e.l.StatePath(), []byte("garbage"), 0o600))
		_, err := e.g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: dcgm, Spec: visible("1")})
		require.ErrorIs(t, err, ledger.ErrNeedsRecovery)
		assert.Empty(t, e.audit(guard.AuditExempt))
	})
}

// Under release_on = "remove" a restart in the same pod takes over its
// stopped predecessor's claim; the pod uid and container name a hook reads
// from annotations must never make it the "restart".
func TestHookCannotTakeOverAClaim(t *testing.T) {
	mutate := func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove }

	t.Run("hook request naming an NRI holder's pod", func(t *testing.T) {
		e := newEnv(t, mutate)
		old := ctr("ml", "a", "main", "old0000000000001")
		require.Equal(t, guard.Admit, e.admit(old, visible("1")).Result)
		require.NoError(t, e.g.Stopped(ctx, old))

		spoof := hookCtr("ml", "a", "main", "spoof00000000001")
		d := e.admitAs(ledger.FrontEndHook, spoof, visible("1"))
		assert.Equal(t, guard.Queue, d.Result, d.Message)
		assert.Equal(t, map[string]string{uuid(1): old.ContainerID}, e.holders())
		assert.Empty(t, e.audit(ledger.OpTakeover))
		assert.Equal(t, []string{spoof.ContainerID}, e.waiters(), "a hook requester is keyed by its container id")
	})

	t.Run("hook restart of a hook holder", func(t *testing.T) {
		e := newEnv(t, mutate)
		old := hookCtr("ml", "a", "main", "old0000000000001")
		require.Equal(t, guard.Admit, e.admitAs(ledger.FrontEndHook, old, visible("1")).Result)
		require.NoError(t, e.g.Stopped(ctx, old))
		e.runtimeKnows(old.ContainerID) // stopped, not deleted
		d := e.admitAs(ledger.FrontEndHook, hookCtr("ml", "a", "main", "new0000000000001"), visible("1"))
		assert.Equal(t, guard.Queue, d.Result, d.Message)
		assert.Equal(t, map[string]string{uuid(1): old.ContainerID}, e.holders())
	})

	t.Run("NRI restart of a hook holder that named its pod", func(t *testing.T) {
		e := newEnv(t, mutate)
		squatter := hookCtr("ml", "a", "main", "squat00000000001")
		require.Equal(t, guard.Admit, e.admitAs(ledger.FrontEndHook, squatter, visible("1")).Result)
		require.NoError(t, e.g.Stopped(ctx, squatter))
		e.runtimeKnows(squatter.ContainerID) // stopped, not deleted
		d := e.admit(ctr("ml", "a", "main", "new0000000000001"), visible("1"))
		assert.Equal(t, guard.Queue, d.Result, d.Message)
		assert.Equal(t, map[string]string{uuid(1): squatter.ContainerID}, e.holders())
	})
}

// A hook request naming a queued NRI requester's pod and container must not
// take its place in the queue or the reservation made for it.
func TestHookCannotTakeAReservation(t *testing.T) {
	e := newEnv(t, nil)
	holder := ctr("ml", "a", "main", "holder0000000001")
	waiter := ctr("ml", "b", "main", "waiter0000000001")
	require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
	require.Equal(t, guard.Queue, e.admit(waiter, visible("1")).Result)
	require.NoError(t, e.g.Removed(ctx, holder))

	for _, key := range []string{"", guard.RequesterKey(waiter)} {
		spoof := hookCtr("ml", "b", "main", "spoof00000000001")
		d, err := e.g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndHook, Owner: spoof, Key: key, Spec: visible("1")})
		require.NoError(t, err)
		assert.Equal(t, guard.Queue, d.Result, "key %q: %s", key, d.Message)
		assert.Equal(t, "reserved", d.Reason)
		assert.Empty(t, e.holders())
	}
	assert.Equal(t, guard.Admit, e.admit(waiter, visible("1")).Result)
}

// Whatever a front end passes, the ledger and the messages get bounded,
// control-free names: a 16 MiB pod name once went whole into a refusal.
func TestOwnerStringsAreBounded(t *testing.T) {
	e := newEnv(t, nil)
	huge := strings.Repeat("p", 16<<20)
	big := ledger.Owner{ContainerID: "big0000000000001", Namespace: "ml\x1b[31m", Pod: huge, PodUID: huge,
		Container: huge, PodSandboxID: huge, Cgroup: "/" + huge, Pid: 7, FrontEnd: ledger.FrontEndNRI}
	require.Equal(t, guard.Admit, e.admit(big, visible("1")).Result)
	st := e.state()
	require.Len(t, st.Claims, 1)
	o := st.Claims[0].Owner
	assert.Equal(t, "ml[31m", o.Namespace)
	for _, s := range []string{o.Pod, o.PodUID, o.Container, o.PodSandboxID} {
		assert.Len(t, s, guard.MaxLabelLen)
	}
	assert.Empty(t, o.Cgroup, "a cgroup path too long to be real is dropped, not cut to another cgroup's")

	d := e.admit(ctr("ml", "b", "main", "other00000000001"), visible("1"))
	require.Equal(t, guard.Queue, d.Result)
	assert.Less(t, len(d.Message), 4096, "the refusal quotes bounded names")
}

func TestBoundLabel(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"ml", "ml"},
		{"a\nb\x00c\u0085", "abc"},
		{strings.Repeat("é", 200), strings.Repeat("é", guard.MaxLabelLen/2)}, // cut on a rune boundary
	} {
		assert.Equal(t, tc.want, guard.BoundLabel(tc.in))
	}
	assert.Equal(t, "/k8s.io/abc", guard.BoundCgroup("/k8s.io/abc"))
	assert.Empty(t, guard.BoundCgroup("/k8s.io/a\nb"))
	assert.Empty(t, guard.BoundCgroup("/"+strings.Repeat("a", guard.MaxCgroupLen)))
}

func TestTrustsIdentity(t *testing.T) {
	assert.True(t, guard.TrustsIdentity(ledger.FrontEndNRI))
	assert.True(t, guard.TrustsIdentity(ledger.FrontEndCtl))
	assert.False(t, guard.TrustsIdentity(ledger.FrontEndHook))
	assert.False(t, guard.TrustsIdentity(""))
}
