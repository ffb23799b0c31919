// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// TestCloneSharesNothing: changing any slice of a clone leaves the original
// as it was, down to a waiter's device list.
func TestCloneSharesNothing(t *testing.T) {
	gpu := devices.Device{UUID: "GPU-0", Index: "0", Kind: devices.KindGPU}
	orig := State{
		Claims:       []Claim{{Device: gpu, Owner: Owner{ContainerID: "a"}}},
		Waiters:      []Waiter{{Key: "w", Devices: []devices.Device{gpu}}},
		Reservations: []Reservation{{Device: gpu, For: "w"}},
		Conflicts:    []Conflict{{Device: gpu, Owner: Owner{ContainerID: "b"}}},
		Generation:   7,
	}
	c := orig.Clone()
	assert.Equal(t, orig, c)
	c.Claims[0].Owner.ContainerID = "x"
	c.Waiters[0].Devices[0].UUID = "GPU-x"
	c.Reservations[0].For = "x"
	c.Conflicts[0].Owner.ContainerID = "x"
	assert.Equal(t, "a", orig.Claims[0].Owner.ContainerID)
	assert.Equal(t, "GPU-0", orig.Waiters[0].Devices[0].UUID)
	assert.Equal(t, "w", orig.Reservations[0].For)
	assert.Equal(t, "b", orig.Conflicts[0].Owner.ContainerID)
	var nilState *State
	assert.Equal(t, State{}, nilState.Clone())

	// The copies' device lists share one allocation: an append to one
	// leaves the next as it was; nil and empty lists stay what they were.
	other := devices.Device{UUID: "GPU-1", Index: "1", Kind: devices.KindGPU}
	orig.Waiters = []Waiter{{Key: "a", Devices: []devices.Device{gpu}}, {Key: "b", Devices: []devices.Device{other}},
		{Key: "c"}, {Key: "d", Devices: []devices.Device{}}}
	c = orig.Clone()
	assert.Equal(t, orig, c)
	grown := append(c.Waiters[0].Devices, other)
	grown[0].UUID = "GPU-y"
	assert.Equal(t, "GPU-1", c.Waiters[1].Devices[0].UUID)
	assert.Equal(t, "GPU-0", orig.Waiters[0].Devices[0].UUID)
	assert.Nil(t, c.Waiters[2].Devices)
	assert.NotNil(t, c.Waiters[3].Devices)
	assert.Empty(t, c.Waiters[3].Devices)
}

// Owners names every container the state knows, a holder's entry over a
// conflict's over a waiter's, and skips waiters without a container id.
func TestStateOwners(t *testing.T) {
	held := Owner{ContainerID: "a", Pod: "holder"}
	st := State{
		Claims:    []Claim{{Device: gpu(0), Owner: held}},
		Conflicts: []Conflict{{Device: gpu(0), Owner: Owner{ContainerID: "a", Pod: "conflict"}}, {Device: gpu(1), Owner: Owner{ContainerID: "b", Pod: "conflict"}}},
		Waiters:   []Waiter{{Key: "k1", Owner: Owner{ContainerID: "b", Pod: "waiter"}}, {Key: "k2", Owner: Owner{ContainerID: "c", Pod: "waiter"}}, {Key: "k3"}},
	}
	got := st.Owners()
	assert.Len(t, got, 3)
	assert.Equal(t, "holder", got["a"].Pod)
	assert.Equal(t, "conflict", got["b"].Pod)
	assert.Equal(t, "waiter", got["c"].Pod)
}

// TestReadStateIsTheTxState: ReadState is the state State copies, as the Tx
// changes it, in an Update and in a View (with the queue mechanics applied).
func TestReadStateIsTheTxState(t *testing.T) {
	l := openTest(t, nil)
	update(t, l, func(tx *Tx) {
		assert.Equal(t, *tx.State(), *tx.ReadState())
		_, err := tx.Claim("", owner("a"), devs(gpu(0)), "env")
		require.NoError(t, err)
		tx.Enqueue("ns/uid-b/ctr", owner("b"), devs(gpu(0), gpu(1)))
		assert.Equal(t, *tx.State(), *tx.ReadState())
		assert.Len(t, tx.ReadState().Claims, 1)
		assert.Len(t, tx.ReadState().Waiters, 1)
	})
	update(t, l, func(tx *Tx) { tx.Release("a", "stop") })
	require.NoError(t, l.View(context.Background(), func(tx *Tx) error {
		// The released GPU and the free one are reserved for the waiter.
		assert.Equal(t, *tx.State(), *tx.ReadState())
		assert.Len(t, tx.ReadState().Reservations, 2) // both of its GPUs are free
		return nil
	}))
}
