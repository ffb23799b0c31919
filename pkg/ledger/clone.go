// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"slices"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// Clone returns a deep copy of s: no slice of the copy shares storage with
// s, so the copy may be kept and modified after the transaction or snapshot
// it came from. A nil s clones to the zero State. This is the one deep copy
// of a State; callers that keep a state past a transaction use it.
func (s *State) Clone() State {
	if s == nil {
		return State{}
	}
	c := *s
	c.Claims = slices.Clone(s.Claims)
	c.Reservations = slices.Clone(s.Reservations)
	c.Conflicts = slices.Clone(s.Conflicts)
	c.Cordons = slices.Clone(s.Cordons)
	c.Waiters = slices.Clone(s.Waiters)
	// The waiters' device lists go into one slab, each capped at its
	// length (an append to one copies it): one allocation, not one per
	// waiter (a read of thousands of waiters clones them all).
	n := 0
	for i := range s.Waiters {
		n += len(s.Waiters[i].Devices)
	}
	slab := make([]devices.Device, 0, n)
	for i := range c.Waiters {
		d := c.Waiters[i].Devices
		switch {
		case d == nil:
		case len(d) == 0:
			c.Waiters[i].Devices = []devices.Device{}
		default:
			start := len(slab)
			slab = append(slab, d...)
			c.Waiters[i].Devices = slab[start:len(slab):len(slab)]
		}
	}
	return c
}

// Owners maps the container ids the state knows to their owners: holders,
// containers in conflict records and waiters (a holder's entry wins over a
// conflict's, which wins over a waiter's). It is how a process found on a
// GPU is named by the container it belongs to.
func (s *State) Owners() map[string]Owner {
	out := make(map[string]Owner, len(s.Claims)+len(s.Conflicts)+len(s.Waiters))
	for _, w := range s.Waiters {
		if w.Owner.ContainerID != "" {
			out[w.Owner.ContainerID] = w.Owner
		}
	}
	for _, c := range s.Conflicts {
		out[c.Owner.ContainerID] = c.Owner
	}
	for _, c := range s.Claims {
		out[c.Owner.ContainerID] = c.Owner
	}
	return out
}
