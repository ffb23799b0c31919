// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// takeoverCases: the stopped container "init" holds held; the container
// "app" asks for want and takes over what stands in its way, exactly the
// claims of init that conflict with want (a whole GPU against one of its
// MIG instances included), and those that conflict with a claim so moved.
var takeoverCases = []struct {
	name  string
	held  []devices.Device
	want  []devices.Device
	moved []devices.Device // in device order
}{
	{name: "the same GPUs: everything moves", held: devs(gpu(0), gpu(1)), want: devs(gpu(0), gpu(1)), moved: devs(gpu(0), gpu(1))},
	{name: "fewer GPUs: only those move", held: devs(gpu(0), gpu(1)), want: devs(gpu(1)), moved: devs(gpu(1))},
	{name: "a GPU the predecessor does not hold: nothing moves", held: devs(gpu(0)), want: devs(gpu(2))},
	{name: "part held, part free", held: devs(gpu(0), gpu(1)), want: devs(gpu(1), gpu(2)), moved: devs(gpu(1))},
	{name: "the GPU whole takes the instances held on it", held: devs(mig(0, 0), mig(0, 1), gpu(1)), want: devs(gpu(0)),
		moved: devs(mig(0, 0), mig(0, 1))},
	{name: "an instance takes the claim on its GPU whole", held: devs(gpu(0), gpu(1)), want: devs(mig(0, 1)), moved: devs(gpu(0))},
	{name: "an instance leaves its sibling instance", held: devs(mig(0, 0), mig(0, 1)), want: devs(mig(0, 1)), moved: devs(mig(0, 1))},
	{name: "two GPUs asked for, one held as an instance", held: devs(mig(0, 0), gpu(1)), want: devs(gpu(0), gpu(1)),
		moved: devs(gpu(1), mig(0, 0))},
	// init holds GPU 0 and one of its instances (it took the instance
	// over asking for the GPU): the GPU's claim moves for the other
	// instance, and the instance held with it follows, or init and app
	// would hold one GPU.
	{name: "what conflicts with a claim that moves moves too", held: devs(gpu(0), mig(0, 0)), want: devs(mig(0, 1)),
		moved: devs(gpu(0), mig(0, 0))},
	{name: "a GPU and its instance held, another GPU asked for", held: devs(gpu(0), mig(0, 0)), want: devs(gpu(1))},
}

// setUpTakeover commits init's claims on held, init stopped, and returns
// them as they are then.
func setUpTakeover(t *testing.T, l *Ledger, held []devices.Device) []Claim {
	t.Helper()
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("init"), held, "env")
		require.NoError(t, err)
		require.True(t, tx.SetStarted("init", 1001, 10010, "/k8s.io/init"))
		require.True(t, tx.MarkStopped("init"))
	})
	return snapshot(t, l).Claims
}

// noConflictingHolders fails when two containers hold conflicting devices.
func noConflictingHolders(t *testing.T, st State) {
	t.Helper()
	for i, a := range st.Claims {
		for _, b := range st.Claims[i+1:] {
			if a.Owner.ContainerID != b.Owner.ContainerID && devices.Conflicts(a.Device, b.Device) {
				t.Errorf("%s holds %s and %s holds %s", a.Owner.ContainerID, DescribeDevice(a.Device), b.Owner.ContainerID, DescribeDevice(b.Device))
			}
		}
	}
}

func TestTakeOverMovesWhatStandsInTheWay(t *testing.T) {
	for _, tc := range takeoverCases {
		t.Run(tc.name, func(t *testing.T) {
			c := newClock()
			l := openTest(t, c)
			before := setUpTakeover(t, l, tc.held)
			app := owner("app")
			update(t, l, func(tx *Tx) {
				got := tx.TakeOver("init", app, tc.want, "container init of the same pod has stopped")
				assert.Equal(t, uuids(tc.moved, plainDevice), uuids(got, claimDevice), "what moved")
				for _, m := range got {
					assert.Equal(t, app, m.Owner)
					assert.Equal(t, c.Now(), m.Since)
				}
				_, err := tx.Claim("", app, tc.want, "env")
				require.NoError(t, err, "nothing init kept stands in the way")
			})
			st := snapshot(t, l)
			noConflictingHolders(t, st)
			want := map[string]string{}
			for _, d := range tc.held {
				want[d.UUID] = "init"
			}
			for _, d := range append(slices.Clone(tc.moved), tc.want...) {
				want[d.UUID] = "app"
			}
			assert.Equal(t, want, holders(st))
			for _, cl := range st.Claims {
				if cl.Owner.ContainerID == "init" {
					i := slices.IndexFunc(before, func(b Claim) bool { return b.Device.UUID == cl.Device.UUID })
					require.GreaterOrEqual(t, i, 0)
					assert.Equal(t, before[i], cl, "what init keeps is untouched (still stopped, its process recorded)")
				}
			}

			recs, err := ReadAudit(l.AuditPath())
			require.NoError(t, err)
			var took []AuditRecord
			for _, r := range recs {
				if r.Op == OpTakeover {
					took = append(took, r)
				}
			}
			if len(tc.moved) == 0 {
				assert.Empty(t, took, "nothing moved, nothing audited")
				return
			}
			require.Len(t, took, 1)
			assert.Equal(t, "app", took[0].ContainerID)
			assert.Equal(t, uuids(tc.moved, plainDevice), took[0].Devices, "the record names what moved")
			kept := slices.DeleteFunc(slices.Clone(tc.held), func(d devices.Device) bool {
				return slices.ContainsFunc(tc.moved, func(m devices.Device) bool { return m.UUID == d.UUID })
			})
			if len(kept) == 0 {
				assert.NotContains(t, took[0].Reason, "keeps")
			}
			for _, d := range kept {
				assert.Contains(t, took[0].Reason, "container init keeps")
				assert.Contains(t, took[0].Reason, DescribeDevice(d))
			}
		})
	}
}

// BusyAfterTakeOver is the dry run of TakeOver: the same claims move. The
// head of the queue waits for GPU 0 whole and GPU 1; what Busy reports once
// the claims really moved is what BusyAfterTakeOver said, and it moved
// nothing.
func TestBusyAfterTakeOverMovesWhatTakeOverMoves(t *testing.T) {
	for _, tc := range takeoverCases {
		t.Run(tc.name, func(t *testing.T) {
			l := openTest(t, newClock())
			setUpTakeover(t, l, tc.held)
			update(t, l, func(tx *Tx) { tx.Enqueue("h", owner("h"), devs(gpu(0), gpu(1))) })
			app := owner("app")
			update(t, l, func(tx *Tx) {
				dry := tx.BusyAfterTakeOver("", app, tc.want, []string{"init"})
				assert.False(t, tx.Changed(), "nothing moved")
				tx.TakeOver("init", app, tc.want, "test")
				assert.Equal(t, tx.Busy("", app, tc.want), dry)
			})
		})
	}
}

// A takeover undone before the new container started (its create refused
// at validation, failed in the runtime) hands back what moved, as it was;
// what the predecessor kept is its own all along. Handed the predecessor's
// claims as they were before the takeover, all of them, HandBack gives back
// only what moved.
func TestHandBackGivesBackWhatMoved(t *testing.T) {
	for _, tc := range takeoverCases {
		t.Run(tc.name, func(t *testing.T) {
			c := newClock()
			l := openTest(t, c)
			before := setUpTakeover(t, l, tc.held)
			app := owner("app")
			c.Advance(time.Minute)
			var moved []Claim
			update(t, l, func(tx *Tx) {
				moved = tx.TakeOver("init", app, tc.want, "test")
				_, err := tx.Claim("", app, tc.want, "env")
				require.NoError(t, err)
			})
			var originals []Claim
			for _, b := range before {
				if slices.ContainsFunc(moved, func(m Claim) bool { return m.Device.UUID == b.Device.UUID }) {
					originals = append(originals, b)
				}
			}
			for _, given := range [][]Claim{originals, before} {
				var back []Claim
				require.NoError(t, l.View(context.Background(), func(tx *Tx) error {
					back = tx.HandBack("app", given, "the create was undone")
					tx.Release("app", "removed")
					assert.Equal(t, before, tx.State().Claims, "init holds what it held, as it was")
					return nil
				}))
				assert.Equal(t, originals, back)
			}
			// Alone in its transaction: what app claimed itself on a GPU
			// handed back ends with it (the guard releases the rest in
			// the next one).
			update(t, l, func(tx *Tx) { tx.HandBack("app", before, "the create was undone") })
			st := snapshot(t, l)
			noConflictingHolders(t, st)
			want := map[string]string{}
			var ended []string // app's own claims on a GPU handed back
			for _, d := range tc.want {
				switch {
				case !slices.ContainsFunc(tc.moved, func(m devices.Device) bool { return devices.Conflicts(m, d) }):
					want[d.UUID] = "app"
				case !slices.ContainsFunc(tc.moved, func(m devices.Device) bool { return m.UUID == d.UUID }):
					ended = append(ended, d.UUID)
				}
			}
			for _, d := range tc.held {
				want[d.UUID] = "init"
			}
			assert.Equal(t, want, holders(st))
			recs, err := ReadAudit(l.AuditPath())
			require.NoError(t, err)
			var handed, released []AuditRecord
			for _, r := range recs {
				switch {
				case r.Op == OpTakeover && r.ContainerID == "init":
					handed = append(handed, r)
				case r.Op == OpRelease && r.ContainerID == "app":
					released = append(released, r)
				}
			}
			if len(ended) == 0 {
				assert.Empty(t, released)
			} else {
				require.Len(t, released, 1)
				assert.Equal(t, ended, released[0].Devices)
				assert.Contains(t, released[0].Reason, "conflicts with what was handed back")
			}
			if len(tc.moved) == 0 {
				assert.Empty(t, handed)
				return
			}
			require.Len(t, handed, 1)
			assert.Equal(t, uuids(tc.moved, plainDevice), handed[0].Devices)
			assert.Contains(t, handed[0].Reason, "handed back from container app")
		})
	}
}
