// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"crypto/rand"
	"strings"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// A ticket is the requester (and, once admitted, the claim owner) of a
// `gpu-guard-ctl run`: TicketPrefix and 26 base32 letters (130 random bits,
// not guessable by another container). The format lives here, not in
// pkg/hook which makes and hands tickets over, because the release rule must
// recognise a ticket's claim: its process is the ctl, which never uses the
// GPU, and no container, stop or remove event will ever end it.
const (
	TicketPrefix = "ticket-"
	ticketLen    = len(TicketPrefix) + 26
)

// NewTicketID returns a fresh ticket id.
func NewTicketID() string { return TicketPrefix + strings.ToLower(rand.Text()) }

// ValidTicket reports whether s has the form of a ticket id.
func ValidTicket(s string) bool {
	if len(s) != ticketLen || !strings.HasPrefix(s, TicketPrefix) {
		return false
	}
	for _, c := range s[len(TicketPrefix):] {
		if (c < 'a' || c > 'z') && (c < '2' || c > '7') {
			return false
		}
	}
	return true
}

// IsTicket reports whether o is the owner a ticket of `gpu-guard-ctl run`
// records (AcquireTicket in pkg/hook): the hook front end and a ticket id.
// Once a container takes the ticket over, the claim's owner is that
// container and no longer a ticket.
func IsTicket(o ledger.Owner) bool {
	return o.FrontEnd == ledger.FrontEndHook && ValidTicket(o.ContainerID)
}
