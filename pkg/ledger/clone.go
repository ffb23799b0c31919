// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import "slices"

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
	for i := range c.Waiters {
		c.Waiters[i].Devices = slices.Clone(c.Waiters[i].Devices)
	}
	return c
}
