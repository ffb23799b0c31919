// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// A holder the runtime does not list at reconcile loses its claim only as
// the release rule says. containerd leaves out of Synchronize a running
// container it could not load after a restart (CRI state UNKNOWN: a shim
// that did not answer in time, a paused task); that container still uses
// its GPU, so its claim is kept while its processes run — under every
// release policy, draining included — and a request for the GPU is refused.
// One whose processes are gone (found now, or recorded as stopped under
// release_on = "remove": exited, not removed) is released, or drains under
// release_requires_idle; one that never started is gone (the runtime lists
// every created container) and is released too.
func TestReconcileUnlistedHolder(t *testing.T) {
	remove := func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove }
	idle := func(c *config.Config) {
		c.Observe.ReleaseRequiresIdle = true
		c.Observe.IdleGrace = config.Duration{Duration: time.Minute}
	}
	const (
		kept     = "kept"
		released = "released"
		draining = "draining"
	)
	for _, tc := range []struct {
		name    string
		mutate  func(*config.Config)
		started bool // its pid and cgroup are recorded
		exited  bool // the liveness check finds its processes gone
		stopped bool // its stop event came (release_on = "remove" keeps the claim)
		want    string
	}{
		{name: "running", started: true, want: kept},
		{name: "exited", started: true, exited: true, want: released},
		{name: "never started", want: released},
		{name: "running, release_on remove", mutate: remove, started: true, want: kept},
		{name: "stopped, not removed, release_on remove", mutate: remove, started: true, exited: true, stopped: true, want: released},
		{name: "exited without a stop event, release_on remove", mutate: remove, started: true, exited: true, want: released},
		{name: "running, release_requires_idle", mutate: idle, started: true, want: kept},
		{name: "exited, release_requires_idle", mutate: idle, started: true, exited: true, want: draining},
		{name: "never started, release_requires_idle", mutate: idle, want: draining},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, _ := newStateEnv(t, tc.mutate)
			holder := ctr("ml", "a", "main", "holder0000000001")
			require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
			if tc.started {
				require.NoError(t, e.g.Started(ctx, holder.ContainerID, 4242, "/k8s.io/"+holder.ContainerID))
			}
			e.live.exited[holder.ContainerID] = tc.exited
			if tc.stopped {
				require.NoError(t, e.g.Stopped(ctx, holder))
				require.Len(t, e.state().Claims, 1, "release_on = remove keeps it past its stop")
			}

			// The runtime lists another container, not the holder.
			other := ctr("ml", "o", "main", "other00000000001")
			res, err := e.g.Reconcile(ctx, ledger.FrontEndNRI, []guard.Request{{Owner: other, Spec: visible("2")}})
			require.NoError(t, err)
			st := e.state()
			var unlisted []ledger.AuditRecord
			for _, r := range auditOf(t, e.l) {
				if r.Op == ledger.OpUnlisted {
					unlisted = append(unlisted, r)
				}
			}

			switch tc.want {
			case kept:
				assert.Empty(t, res.Released)
				require.Equal(t, map[string]string{uuid(1): holder.ContainerID, uuid(2): other.ContainerID}, e.holders())
				for _, c := range st.Claims {
					assert.True(t, c.Owner.DrainingSince.IsZero(), "a running holder does not drain: %+v", c.Owner)
				}
				require.Len(t, unlisted, 1, "the kept claim is audited")
				assert.Equal(t, holder.ContainerID, unlisted[0].ContainerID)
				assert.Equal(t, []string{uuid(1)}, unlisted[0].Devices)
				assert.Contains(t, unlisted[0].Reason, "alive", "the liveness finding")

				req := ctr("ml", "b", "main", "req0000000000001")
				d := e.admit(req, visible("1"))
				require.NotEqual(t, guard.Admit, d.Result, "GPU 1 is still used by the unlisted holder")
				assert.Contains(t, d.Message, "ml/a/main")

				// Once its processes are gone the release rule frees the
				// GPU as for any holder: at the next request under
				// release_on = "stop"; under "remove" it is kept until its
				// removal, or until the next reconcile, which releases an
				// exited holder the runtime does not list; under
				// release_requires_idle it drains first.
				e.live.exited[holder.ContainerID] = true
				d = e.admit(req, visible("1"))
				switch {
				case e.cfg.Observe.ReleaseRequiresIdle:
					require.Equal(t, guard.Queue, d.Result, d.Message)
					draining, err := e.g.Draining(ctx)
					require.NoError(t, err)
					require.Len(t, draining, 1)
				case e.cfg.Policy.ReleaseOn == config.ReleaseOnRemove:
					require.Equal(t, guard.Queue, d.Result, d.Message)
					assert.Contains(t, d.Message, "kept until the container is removed")
					res, err := e.g.Reconcile(ctx, ledger.FrontEndNRI, []guard.Request{{Owner: other, Spec: visible("2")}})
					require.NoError(t, err)
					require.Len(t, res.Released, 1, "exited, and not listed: its GPU is free")
					require.Equal(t, guard.Admit, e.admit(req, visible("1")).Result)
				default:
					require.Equal(t, guard.Admit, d.Result, d.Message)
				}
			case released:
				require.Len(t, res.Released, 1)
				assert.Equal(t, holder.ContainerID, res.Released[0].Owner.ContainerID)
				assert.Equal(t, map[string]string{uuid(2): other.ContainerID}, e.holders())
				assert.Empty(t, unlisted)
				assert.Equal(t, guard.Admit, e.admit(ctr("ml", "b", "main", "req0000000000001"), visible("1")).Result)
			case draining:
				assert.Empty(t, res.Released)
				draining, err := e.g.Draining(ctx)
				require.NoError(t, err)
				require.Len(t, draining, 1)
				assert.Equal(t, holder.ContainerID, draining[0].Owner.ContainerID)
				assert.Empty(t, unlisted)
			}
		})
	}
}

// A container the runtime lists but that reaches no GPU now (exempted by
// the configuration since it was admitted) is no holder the liveness check
// speaks for: the list says it runs without the GPU, and its claim is
// released as one no longer on its device is.
func TestReconcileListedWithoutGPUReleases(t *testing.T) {
	e, _ := newStateEnv(t, nil)
	holder := ctr("kube-system", "dcgm", "exporter", "exempt0000000001")
	require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
	require.NoError(t, e.g.Started(ctx, holder.ContainerID, 4242, "/k8s.io/"+holder.ContainerID))

	e.cfg.Policy.ExemptNamespaces = []string{"kube-system"}
	g, err := guard.New(guard.Options{Config: e.cfg, Inventory: inventory(t), Ledger: e.l, Liveness: e.live,
		Now: e.clock.Now, Observer: e.obs})
	require.NoError(t, err)
	listed := holder
	listed.Pid, listed.Cgroup = 4242, "/k8s.io/"+holder.ContainerID
	res, err := g.Reconcile(ctx, ledger.FrontEndNRI, []guard.Request{{Owner: listed, Spec: visible("1")}})
	require.NoError(t, err)
	require.Len(t, res.Released, 1)
	assert.Empty(t, e.holders())
}
