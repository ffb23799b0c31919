// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

func TestTicketID(t *testing.T) {
	id := guard.NewTicketID()
	assert.True(t, guard.ValidTicket(id), id)
	assert.Len(t, id, len(guard.TicketPrefix)+26)
	assert.NotEqual(t, id, guard.NewTicketID())
	for _, bad := range []string{"", guard.TicketPrefix, "ticket-ABCDEFGHIJKLMNOPQRSTUVWXYZ",
		"ticket-abcdefghijklmnopqrstuvwxy1", "ticket-abcdefghijklmnopqrstuvwxyz2", "tickets" + id[7:]} {
		assert.False(t, guard.ValidTicket(bad), bad)
	}
	o := ledger.Owner{ContainerID: id, FrontEnd: ledger.FrontEndHook}
	assert.True(t, guard.IsTicket(o))
	o.FrontEnd = ledger.FrontEndNRI
	assert.False(t, guard.IsTicket(o), "only the hook front end makes tickets")
}

// ticketOwner is what AcquireTicket records for `gpu-guard-ctl run`: the
// ctl's pid, no cgroup.
func ticketOwner(id string, pid int) ledger.Owner {
	return ledger.Owner{ContainerID: id, Container: "gpu-guard-ctl run", FrontEnd: ledger.FrontEndHook,
		Pid: pid, PidStart: uint64(pid) * 10}
}

func (e *env) admitHook(o ledger.Owner, spec devices.Request) guard.Decision {
	e.t.Helper()
	d, err := e.g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndHook, Owner: o, Key: o.ContainerID, Spec: spec})
	require.NoError(e.t, err)
	return d
}

// A killed `gpu-guard-ctl run` leaves its ticket's claim with the ctl's pid
// as process. No container runs under a ticket id, so no stop or remove
// event ever ends it: under release_on = "remove" (or release_requires_idle)
// the rule used to mark it stopped (or draining) and keep it forever, and
// every later request for the GPU waited behind it. A ticket whose process
// is gone is released whatever the policy says.
func TestKilledTicketIsReleasedWhateverThePolicy(t *testing.T) {
	policies := map[string]func(*config.Config){
		"release_on=stop":       nil,
		"release_on=remove":     func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove },
		"release_requires_idle": func(c *config.Config) { c.Observe.ReleaseRequiresIdle = true },
		"remove and requires_idle": func(c *config.Config) {
			c.Policy.ReleaseOn = config.ReleaseOnRemove
			c.Observe.ReleaseRequiresIdle = true
		},
	}
	for name, mutate := range policies {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, mutate)
			ticket := ticketOwner(guard.NewTicketID(), 4242)
			require.Equal(t, guard.Admit, e.admitHook(ticket, visible("1")).Result)
			require.Equal(t, 4242, e.state().Claims[0].Owner.Pid, "the ticket's process is the ctl")

			// Alive, the ticket keeps its GPU.
			next := ctr("ml", "b", "main", "next000000000001")
			require.Equal(t, guard.Queue, e.admit(next, visible("1")).Result)
			require.NoError(t, e.g.Withdraw(ctx, "ml/uid-b/main", "test"))

			e.live.exited["pid:4242"] = true
			cfg := e.cfg
			v := guard.NewReleaseRule(cfg, e.live).Check(e.state().Claims[0].Owner)
			assert.Equal(t, guard.ReleaseNow, v.Action, v.Why)
			assert.Contains(t, v.Why, ticket.ContainerID)

			d := e.admit(next, visible("1"))
			require.Equal(t, guard.Admit, d.Result, d.Message)
			assert.Equal(t, map[string]string{uuid(1): next.ContainerID}, e.holders())
		})
	}
}

// A ticket that an earlier version marked stopped (release_on = "remove")
// or draining is released by the next request: its process was found gone.
func TestTicketRecordedStoppedIsReleased(t *testing.T) {
	e := newEnv(t, func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove })
	ticket := ticketOwner(guard.NewTicketID(), 4242)
	require.Equal(t, guard.Admit, e.admitHook(ticket, visible("1")).Result)
	require.NoError(t, e.l.Update(ctx, func(tx *ledger.Tx) error {
		require.True(t, tx.MarkStopped(ticket.ContainerID))
		return nil
	}))
	v := e.g.Releasable(e.state().Claims[0].Owner)
	require.Equal(t, guard.ReleaseNow, v.Action)
	assert.True(t, strings.Contains(v.Why, "exited earlier"), v.Why)
	next := ctr("ml", "b", "main", "next000000000001")
	d := e.admit(next, visible("1"))
	require.Equal(t, guard.Admit, d.Result, d.Message)
}

// The rule stays as it was for a hook container that is not a ticket: under
// release_on = "remove" its exited holder is kept until removal.
func TestNonTicketHookHolderKeptUntilRemoval(t *testing.T) {
	e := newEnv(t, func(c *config.Config) { c.Policy.ReleaseOn = config.ReleaseOnRemove })
	o := ticketOwner("0123456789abcdef", 4242)
	o.Container = "train"
	require.Equal(t, guard.Admit, e.admitHook(o, visible("1")).Result)
	e.runtimeKnows(o.ContainerID) // stopped, not deleted
	e.live.exited["pid:4242"] = true
	next := ctr("ml", "b", "main", "next000000000001")
	require.Equal(t, guard.Queue, e.admit(next, visible("1")).Result)
	assert.False(t, e.state().Claims[0].Owner.StoppedAt.IsZero(), "marked stopped, kept until removal")
}
