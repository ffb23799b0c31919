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
	// ErrInvalid: a request to the ledger is malformed (empty container id or
	// device UUID). It is a caller bug, never a user error.
	ErrInvalid = errors.New("invalid ledger request")
)

// CorruptError reports a state file that did not parse or verify. A writable
// ledger moved it aside to Quarantined (empty for a read-only ledger, which
// never moves anything); the next Update starts from an empty state.
type CorruptError struct {
	Path        string // the state file
	Quarantined string // where it was moved, "" if it was left in place
	Reason      string // why it did not verify
}

// Error says what was wrong, where the bad file is, and what to do.
func (e *CorruptError) Error() string {
	if e.Quarantined == "" {
		return fmt.Sprintf("ledger state %s is corrupt (%s); a writer will move it aside and rebuild from the runtime's state", e.Path, e.Reason)
	}
	return fmt.Sprintf("ledger state %s was corrupt (%s) and was moved to %s for inspection; the ledger starts empty and is rebuilt from the runtime's state — retry", e.Path, e.Reason, e.Quarantined)
}

// Unwrap makes errors.Is(err, ErrCorrupt) hold.
func (e *CorruptError) Unwrap() error { return ErrCorrupt }

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
}

// Error names the lock file and the holder, and what to check.
func (e *LockError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "ledger lock %s not acquired within %s", e.Path, e.Waited.Round(time.Millisecond))
	if e.HolderPid > 0 {
		fmt.Fprintf(&b, ": held by pid %d (see /proc/%d/cmdline; a stuck holder must be stopped)", e.HolderPid, e.HolderPid)
	} else {
		b.WriteString(": holder unknown (see /proc/locks)")
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
// naming.Container).
func DescribeOwner(o Owner) string {
	return naming.Container(o.Namespace, o.Pod, o.Container, o.ContainerID)
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
		default:
			parts = append(parts, DescribeDevice(b.Wanted)+" is busy")
		}
	}
	return ErrBusy.Error() + ": " + strings.Join(parts, "; ")
}
