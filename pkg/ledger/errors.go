// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
)

// More sentinel errors (see also api.go).
var (
	// ErrUnsupportedFormat: the state file was written in a format version this
	// build does not know (a newer nri-gpu-guard). It is left untouched.
	ErrUnsupportedFormat = errors.New("ledger state written by a newer nri-gpu-guard")
	// ErrReadOnly: a mutation was attempted on a ledger opened with OpenReadOnly.
	ErrReadOnly = errors.New("ledger opened read-only")
	// ErrLockLost: the lock file was removed or replaced while this process
	// held the flock on it, so another process may hold a lock on the new
	// file at the same time; nothing was written.
	ErrLockLost = errors.New("ledger lock lost")
	// ErrInvalid: a request to the ledger is malformed (empty container id or
	// device UUID). It is a caller bug, never a user error.
	ErrInvalid = errors.New("invalid ledger request")
)

// CorruptError reports a state file (snapshot or journal) that did not
// parse or verify. It is left in place: every Update refuses, and every read
// reports it, until Ledger.Recover (gpu-guard-ctl recover) has rebuilt the
// state from the last good snapshot and the journal and moved the bad file
// aside for a human (Quarantined, set by Recover only).
type CorruptError struct {
	Path        string // the bad file
	Quarantined string // where Recover moved it, "" while it is in place
	Reason      string // why it did not verify
}

// Error says what was wrong, where the bad file is, and what to do.
func (e *CorruptError) Error() string {
	if e.Quarantined != "" {
		return fmt.Sprintf("ledger state %s was corrupt (%s); it was moved to %s for inspection", e.Path, e.Reason, e.Quarantined)
	}
	return fmt.Sprintf("ledger state %s is corrupt (%s): no GPU is admitted until it is recovered; "+
		"run `gpu-guard-ctl recover` (it replays the journal onto the last good snapshot, keeps the bad file "+
		"and reports what it recovered; the NRI daemon rebuilds from the runtime at its next sync)", e.Path, e.Reason)
}

// Unwrap makes errors.Is(err, ErrCorrupt) and errors.Is(err,
// ErrNeedsRecovery) hold.
func (e *CorruptError) Unwrap() []error { return []error{ErrCorrupt, ErrNeedsRecovery} }

// NeedsRecoveryError reports state that is not the last one committed in
// this boot although every file in place may verify: the state files are
// missing (deleted, or the state dir moved), replaced by another ledger's
// (another lineage, an earlier boot's) or rolled back (an older generation
// than this boot's marker records). Nothing is decided against it.
type NeedsRecoveryError struct {
	Path    string // the state dir or file at fault
	Problem string // what is wrong, for people
}

// Error says what is wrong and what the operator does.
func (e *NeedsRecoveryError) Error() string {
	return fmt.Sprintf("ledger state %s needs recovery: %s; no GPU is admitted until it is recovered: "+
		"if the state dir was moved or its files renamed, put them back; then run `gpu-guard-ctl recover` "+
		"(or `gpu-guard-ctl recover --reset` to start empty deliberately; the NRI daemon rebuilds from the "+
		"runtime at its next sync)", e.Path, e.Problem)
}

// Unwrap makes errors.Is(err, ErrNeedsRecovery) hold.
func (e *NeedsRecoveryError) Unwrap() error { return ErrNeedsRecovery }

// FormatError reports a state file in a format version this build cannot read.
// The file is never modified.
type FormatError struct {
	Path      string
	Version   int // found in the file
	Supported int // the newest this build reads
}

// Error tells the operator to upgrade (or remove the file deliberately).
func (e *FormatError) Error() string {
	return fmt.Sprintf("ledger state %s has format version %d, written by a newer nri-gpu-guard (this build reads up to %d): upgrade every nri-gpu-guard binary on this host; the file was left untouched", e.Path, e.Version, e.Supported)
}

// Unwrap makes errors.Is(err, ErrUnsupportedFormat) hold.
func (e *FormatError) Unwrap() error { return ErrUnsupportedFormat }

// LockError reports that the ledger lock was not obtained in time.
type LockError struct {
	Path      string        // the lock file
	HolderPid int           // the process holding it, 0 if unknown
	Waited    time.Duration // how long this call waited
	Cause     error         // the context error, if the caller's context ended
	// Commits is how many commits the ledger made while this call waited,
	// from the boot marker (read without the lock); CommitsKnown is false
	// when that cannot be told (no marker yet, one that did not read, a
	// ledger started afresh meanwhile). Commits mean a busy holder, none
	// a holder that keeps the lock without writing.
	Commits      uint64
	CommitsKnown bool
}

// Error names the lock file and the holder, and what to do: wait for a busy
// ledger, stop a stuck holder.
func (e *LockError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "ledger lock %s not acquired within %s", e.Path, e.Waited.Round(time.Millisecond))
	if e.HolderPid > 0 {
		fmt.Fprintf(&b, ": held by pid %d (see /proc/%d/cmdline)", e.HolderPid, e.HolderPid)
	} else {
		b.WriteString(": holder unknown (see /proc/locks)")
	}
	switch {
	case e.CommitsKnown && e.Commits > 0:
		fmt.Fprintf(&b, "; the ledger is busy, not stuck: %d commit(s) were made while this call waited, and its turn "+
			"did not come in time: retry it, and if this keeps happening raise [ledger] lock_timeout", e.Commits)
	case e.CommitsKnown:
		b.WriteString("; no commit was made while this call waited: a holder that keeps the lock without writing " +
			"is stuck and must be stopped (removing the lock file does not free it)")
	default:
		b.WriteString("; a holder that commits is busy (retry), one stuck with the lock must be stopped " +
			"(removing the lock file does not free it)")
	}
	if e.Cause != nil {
		fmt.Fprintf(&b, ": %v", e.Cause)
	}
	return b.String()
}

// Unwrap makes errors.Is work for ErrLockTimeout and for the context error.
func (e *LockError) Unwrap() []error {
	if e.Cause != nil {
		return []error{ErrLockTimeout, e.Cause}
	}
	return []error{ErrLockTimeout}
}

// DescribeDevice names a device in the ledger's own messages; the wording
// is package naming's, shared with every other message.
func DescribeDevice(d devices.Device) string { return naming.Device(d) }

// DescribeOwner names a holder in the ledger's own messages (see
// naming.Holder): the OCI hook's pod names are the container creator's own
// annotations, shown as unverified.
func DescribeOwner(o Owner) string {
	return naming.Holder(o.Namespace, o.Pod, o.Container, o.ContainerID, o.FrontEnd != FrontEndHook)
}

// ShortID is naming.ShortID, for the ledger's own messages.
func ShortID(id string) string { return naming.ShortID(id) }

func busyMessage(busy []BusyDevice) string {
	if len(busy) == 0 {
		return ErrBusy.Error()
	}
	parts := make([]string, 0, len(busy))
	for _, b := range busy {
		switch {
		case b.Holder != nil:
			via := ""
			if b.Holder.Device.UUID != b.Wanted.UUID {
				via = " through " + DescribeDevice(b.Holder.Device)
			}
			parts = append(parts, fmt.Sprintf("%s is held by %s%s since %s",
				DescribeDevice(b.Wanted), DescribeOwner(b.Holder.Owner), via, b.Holder.Since.UTC().Format(time.RFC3339)))
		case b.Reservation != nil:
			via := ""
			if b.Reservation.Device.UUID != b.Wanted.UUID {
				via = " through " + DescribeDevice(b.Reservation.Device)
			}
			parts = append(parts, fmt.Sprintf("%s is reserved for queued request %q%s until %s",
				DescribeDevice(b.Wanted), b.Reservation.For, via, b.Reservation.Until.UTC().Format(time.RFC3339)))
		case b.KeptFor != nil:
			parts = append(parts, fmt.Sprintf("%s is kept for queued request %q, first in line for %s",
				DescribeDevice(b.Wanted), b.KeptFor.Key, DescribeDevice(b.Through)))
		default:
			parts = append(parts, DescribeDevice(b.Wanted)+" is busy")
		}
	}
	return ErrBusy.Error() + ": " + strings.Join(parts, "; ")
}
