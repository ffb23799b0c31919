package ledger

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
)

// ErrLineageChanged is wrapped by a *LineageError: the state is not of the
// lineage the caller required (see RequireLineage).
var ErrLineageChanged = errors.New("ledger state was started afresh")

// newLineage returns a random lineage id (26 base32 characters, 130 bits):
// two states started independently never share one.
func newLineage() string { return rand.Text() }

type lineageKey struct{}

// RequireLineage returns a context under which Update refuses, with a
// *LineageError and without running its function, a state whose lineage is
// not lineage. An empty lineage removes the requirement.
//
// The NRI daemon uses it to fence its decisions: it learns the running
// holders only at the runtime's Synchronize, so a state started afresh by
// another process (which found the file corrupt, missing, or from an earlier
// boot) has forgotten them, and deciding on it could hand a held GPU to a
// newcomer. The check costs a string comparison: no extra read.
func RequireLineage(ctx context.Context, lineage string) context.Context {
	return context.WithValue(ctx, lineageKey{}, lineage)
}

func requiredLineage(ctx context.Context) string {
	s, _ := ctx.Value(lineageKey{}).(string)
	return s
}

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
	originNoFile    = "there is no state file (it was deleted, or moved aside as corrupt)"
	originOtherBoot = "its state was from an earlier boot and was discarded"
	originLegacy    = "the state file has no lineage (written by an older nri-gpu-guard, or restored from an old copy)"
)
