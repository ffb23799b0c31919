// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"time"
)

// AuditRecord is one line of audit.log. Every committed mutation writes at
// least one, stamped with the generation it produced, so that replaying the
// claim-changing records in order reproduces the claims of the state file.
type AuditRecord struct {
	Time        time.Time `json:"time"`
	Op          string    `json:"op"`
	Devices     []string  `json:"devices,omitempty"` // device UUIDs
	ContainerID string    `json:"container_id,omitempty"`
	Key         string    `json:"key,omitempty"` // requester key (queue records)
	Namespace   string    `json:"namespace,omitempty"`
	Pod         string    `json:"pod,omitempty"`
	Container   string    `json:"container,omitempty"`
	FrontEnd    string    `json:"front_end,omitempty"`
	Reason      string    `json:"reason,omitempty"`
	Generation  uint64    `json:"generation"`
	Pid         int       `json:"pid"` // of the process that wrote the record
}

// Audit operations. Claim-changing ones: OpClaim, OpAdopt, OpPromote and
// OpTakeover give Devices to ContainerID; OpRelease takes Devices from
// ContainerID; OpDiscard and OpCorrupt drop every claim.
const (
	OpClaim              = "claim"               // a request was admitted
	OpRelease            = "release"             // claims ended (Reason: stop, stale, holder exited, force: …)
	OpAdopt              = "adopt"               // reconcile found a running container without a claim
	OpPromote            = "promote"             // a conflict record became the claim once the device was free
	OpTakeover           = "takeover"            // a restarted container took its predecessor's claims
	OpConflict           = "conflict"            // reconcile found a container on a device another holds
	OpConflictCleared    = "conflict-cleared"    // a conflict record ended without a claim
	OpEnqueue            = "enqueue"             // a new waiter joined the queue
	OpRefresh            = "refresh"             // a waiter retried (its last_seen moved)
	OpDequeue            = "dequeue"             // a waiter left the queue (Reason says why)
	OpExpired            = "expired"             // a waiter was not seen for queue_ttl
	OpReserve            = "reserve"             // all of a waiter's devices were free and are reserved for it
	OpUnreserve          = "unreserve"           // a reservation ended without being used
	OpReservationExpired = "reservation-expired" // the head did not come back within reservation_ttl
	OpStarted            = "started"             // pid/cgroup of a holder recorded
	OpStopped            = "stopped"             // a holder exited; claim kept until removal
	OpDiscard            = "discard"             // state from an earlier boot dropped
	OpCorrupt            = "corrupt"             // a bad state file moved aside
	OpAuditTorn          = "audit-torn"          // the unfinished last line of a writer killed mid-append was cut off
	OpLineage            = "lineage"             // a reconcile stored the ledger's new lineage, as it does even when it changes nothing else (Reason says why it is new)
)

// auditFileMode is the mode of audit.log and its rotation.
const auditFileMode = 0o600

// appendAudit writes records as JSON lines with O_APPEND, rotating
// audit.log to audit.log.1 when it would grow past maxBytes. Called with the
// lock held, so rotation never races another writer.
func appendAudit(dir string, maxBytes int64, recs []AuditRecord) error {
	return writeAudit(dir, maxBytes, recs, false)
}

// writeAudit is appendAudit; with durable, the records (and a rotation) are
// on disk when it returns nil: the file is fsynced, and the dir after a
// rotation.
func writeAudit(dir string, maxBytes int64, recs []AuditRecord, durable bool) error {
	if len(recs) == 0 {
		return nil
	}
	var payload []byte
	for i := range recs {
		var err error
		if payload, err = appendAuditLine(payload, &recs[i]); err != nil {
			return fmt.Errorf("encode audit record: %w", err)
		}
	}
	p := filepath.Join(dir, auditName)
	f, err := openAudit(p)
	if err != nil {
		return err
	}
	// A writer killed inside its write(2) can leave the start of a line
	// without its newline (the kernel copies a write page by page and stops
	// at a fatal signal). Appending after it would glue our first record to
	// it and make both unreadable: cut the fragment off first (the lock is
	// held, so nobody is writing it) and say so in the log itself.
	cut, unended, err := cutTornTail(f)
	if err != nil {
		_ = f.Close()
		return fmt.Errorf("repair the torn end of %s: %w", p, err)
	}
	if cut > 0 {
		torn := AuditRecord{Time: recs[0].Time, Op: OpAuditTorn, Generation: recs[0].Generation, Pid: recs[0].Pid,
			Reason: fmt.Sprintf("%d bytes of an unfinished record (a writer killed while appending) were cut off", cut)}
		note, err := appendAuditLine(nil, &torn)
		if err != nil {
			_ = f.Close()
			return fmt.Errorf("encode audit record: %w", err)
		}
		payload = append(note, payload...)
	}
	if fi, err := f.Stat(); err == nil && fi.Size() > 0 && fi.Size()+int64(len(payload)) > maxBytes {
		_ = f.Close()
		if err := os.Rename(p, filepath.Join(dir, auditRotated)); err != nil { //nolint:gosec // fixed names in the operator's state dir
			return fmt.Errorf("rotate %s: %w", p, err)
		}
		if f, err = openAudit(p); err != nil {
			return err
		}
		unended = false // the line left unended went with the rotation
		if durable {
			if err := syncDir(dir); err != nil {
				_ = f.Close()
				return fmt.Errorf("rotate %s: %w", p, err)
			}
		}
	}
	if unended {
		// A line without its end that is too long to be a torn record of
		// ours stays as it is, but our records must not be glued to it
		// (ReadAudit would take them for part of it): they start a line.
		payload = append([]byte{'\n'}, payload...)
	}
	// One write: appends of one write call are not interleaved with others.
	if _, err := f.Write(payload); err != nil {
		_ = f.Close()
		return fmt.Errorf("append to %s: %w", p, err)
	}
	if durable {
		if err := f.Sync(); err != nil {
			_ = f.Close()
			return fmt.Errorf("fsync %s: %w", p, err)
		}
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("close %s: %w", p, err)
	}
	return nil
}

// AppendAudit writes recs to the audit log under the ledger lock, stamped
// with the generation of the current state, and returns only once they are
// on disk (fsync). It changes no state and commits nothing: it is for a
// decision whose only trace is its audit record (an exemption), which must
// not be acted on if the record is lost. Unlike the records of a commit, an
// error here is returned, never only logged. A state that needs recovery
// (or any error reading it) fails it, as it fails Update.
func (l *Ledger) AppendAudit(ctx context.Context, recs ...AuditRecord) error {
	unlock, _, err := l.lockForWrite(ctx, "audit", false)
	if err != nil {
		return err
	}
	defer unlock()
	ld, err := l.current()
	if err != nil {
		return err
	}
	now, pid := l.now(), os.Getpid()
	recs = slices.Clone(recs)
	for i := range recs {
		if recs[i].Op == "" {
			return fmt.Errorf("audit record %d has no op (a bug; nothing was written)", i)
		}
		if recs[i].Time.IsZero() {
			recs[i].Time = now
		}
		recs[i].Generation, recs[i].Pid = ld.st.Generation, pid
	}
	return writeAudit(l.dir, l.opts.AuditMaxBytes, recs, true)
}

// cutTornTail truncates f (open for appending, under the ledger lock) after
// its last newline when its last byte is not one, and returns how many bytes
// it cut. The fragment is at most one record long: a longer one is not a
// torn append, and is left for ReadAudit to report (unended: the file then
// ends inside that line).
func cutTornTail(f *os.File) (cut int64, unended bool, err error) {
	fi, err := f.Stat()
	if err != nil || fi.Size() == 0 {
		return 0, false, err
	}
	size := fi.Size()
	var last [1]byte
	if _, err := f.ReadAt(last[:], size-1); err != nil {
		return 0, false, err
	}
	if last[0] == '\n' {
		return 0, false, nil
	}
	window := min(size, maxAuditLine)
	tail := make([]byte, window)
	if _, err := f.ReadAt(tail, size-window); err != nil {
		return 0, false, err
	}
	keep := int64(bytes.LastIndexByte(tail, '\n')) + 1 + size - window
	if keep == size-window && window == maxAuditLine {
		return 0, true, nil // no newline within a record's length: not ours to cut
	}
	if err := f.Truncate(keep); err != nil {
		return 0, false, err
	}
	return size - keep, false, nil
}

func openAudit(p string) (*os.File, error) {
	// O_NONBLOCK: a FIFO planted in its place fails at once instead of
	// blocking the commit forever.
	f, err := os.OpenFile(p, os.O_RDWR|os.O_APPEND|os.O_CREATE|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, auditFileMode) //nolint:gosec // fixed name in the operator's state dir
	if err != nil {
		return nil, fmt.Errorf("open audit log %s: %w", p, err)
	}
	if fi, err := f.Stat(); err == nil && !fi.Mode().IsRegular() {
		_ = f.Close()
		return nil, fmt.Errorf("%w: audit log %s is not a regular file (%s); remove it", ErrUnsafeDir, p, fi.Mode().Type())
	}
	return f, nil
}

// AuditLineError reports lines of the audit log that did not decode.
type AuditLineError struct {
	Path  string
	Line  int
	Cause error
}

// Error names the file and line.
func (e *AuditLineError) Error() string {
	return fmt.Sprintf("audit log %s line %d: %v", e.Path, e.Line, e.Cause)
}

// Unwrap returns the decode error.
func (e *AuditLineError) Unwrap() error { return e.Cause }

// maxAuditLine bounds one audit line; ours are a few hundred bytes.
const maxAuditLine = 1 << 20

// ReadAudit reads the audit log at path (normally Ledger.AuditPath()) and its
// rotation path+".1", oldest first. Lines that do not decode are not skipped
// silently: every good record is returned together with an error that joins
// one *AuditLineError per bad line; a line too long to be a record is one
// of them (named by its byte offset too), and the records after it are read.
// Missing files are no error.
func ReadAudit(path string) ([]AuditRecord, error) {
	var recs []AuditRecord
	var errs []error
	for _, p := range []string{path + ".1", path} {
		f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0) //nolint:gosec // the audit log the operator names
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("open audit log: %w", err))
			continue
		}
		if fi, err := f.Stat(); err == nil && !fi.Mode().IsRegular() {
			_ = f.Close()
			errs = append(errs, fmt.Errorf("%w: audit log %s is not a regular file (%s)", ErrUnsafeDir, p, fi.Mode().Type()))
			continue
		}
		recs, errs = readAuditFile(f, p, recs, errs)
		_ = f.Close()
	}
	return recs, errors.Join(errs...)
}

// readAuditFile appends the records of one audit file to recs, and one error
// per bad line to errs.
func readAuditFile(f *os.File, p string, recs []AuditRecord, errs []error) ([]AuditRecord, []error) {
	r := bufio.NewReaderSize(f, 64<<10)
	var (
		line int
		off  int64
		buf  []byte
	)
	for {
		start := off
		buf = buf[:0]
		long := false
		var err error
		for {
			var chunk []byte
			chunk, err = r.ReadSlice('\n')
			off += int64(len(chunk))
			// A line longer than a record can be is not kept whole (a
			// zero-filled tail after a power cut can be any length):
			// only its length is counted.
			if !long && len(buf)+len(chunk) > maxAuditLine {
				long, buf = true, buf[:0]
			}
			if !long {
				buf = append(buf, chunk...)
			}
			if !errors.Is(err, bufio.ErrBufferFull) {
				break
			}
		}
		if off == start {
			if err != nil && !errors.Is(err, io.EOF) {
				errs = append(errs, &AuditLineError{Path: p, Line: line + 1, Cause: err})
			}
			return recs, errs
		}
		line++
		switch b := bytes.TrimSpace(buf); {
		case long:
			n := off - start
			if err == nil {
				n-- // its newline
			}
			errs = append(errs, &AuditLineError{Path: p, Line: line, Cause: fmt.Errorf("a line of %d bytes at byte offset %d, "+
				"longer than any record (under %d bytes): skipped, the records after it are read", n, start, maxAuditLine)})
		case len(b) == 0:
		default:
			var rec AuditRecord
			if err := json.Unmarshal(b, &rec); err != nil {
				errs = append(errs, &AuditLineError{Path: p, Line: line, Cause: err})
				break
			}
			if rec.Op == "" {
				errs = append(errs, &AuditLineError{Path: p, Line: line, Cause: errors.New("record has no op")})
				break
			}
			recs = append(recs, rec)
		}
		if err != nil {
			if !errors.Is(err, io.EOF) {
				errs = append(errs, &AuditLineError{Path: p, Line: line + 1, Cause: err})
			}
			return recs, errs
		}
	}
}
