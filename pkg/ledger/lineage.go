// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"crypto/rand"
	"errors"
	"fmt"
)

// ErrLineageChanged is wrapped by a *LineageError: the state is not of the
// lineage the caller required (see Ledger.RequireLineage).
var ErrLineageChanged = errors.New("ledger state was started afresh")

// newLineage returns a random lineage id (26 base32 characters, 130 bits):
// two states started independently never share one.
func newLineage() string { return rand.Text() }

// LineageError reports a state of another lineage than the one required: the
// ledger was started afresh since the caller last synchronized with it, and
// has forgotten the holders it knew. Nothing was changed.
type LineageError struct {
	Path     string // the state file
	Expected string // the lineage required
	Found    string // the lineage of the state file, "" if none was stored
	Why      string // how the state came to differ
}

// Error says what changed and what must happen before deciding again.
func (e *LineageError) Error() string {
	return fmt.Sprintf("ledger state %s is not the one last synchronized with the runtime (lineage %s): %s; "+
		"it no longer knows every running GPU holder and must be rebuilt from the runtime's containers "+
		"(the NRI plugin reconnects to containerd for a fresh Synchronize) before deciding again", e.Path, e.Expected, e.Why)
}

// Unwrap makes errors.Is(err, ErrLineageChanged) hold.
func (e *LineageError) Unwrap() error { return ErrLineageChanged }

// Why a state got a fresh lineage when it was loaded (origin of loadLocked).
const (
	originNoFile    = "there was no state: a fresh host, or the ledger was reset"
	originOtherBoot = "its state was from an earlier boot and was discarded"
	originLegacy    = "the state file has no lineage (written by an older nri-gpu-guard, or restored from an old copy)"
)
