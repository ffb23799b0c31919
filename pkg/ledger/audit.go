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
// A commit's records may be appended by a later writer, after an
// OpAuditLate record, still in generation order (see auditLog).
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

// Audit operations of the audit log itself: a commit's records that its
// writer did not append, appended by a later writer.
const (
	// OpAuditLate precedes the records of a commit (its Generation) that a
	// later writer (Pid) appended from the commit's journal record: the
	// process that committed it stopped before it appended them (killed,
	// or its append failed). The records that follow are the commit's own,
	// with its time and its writer's pid.
	OpAuditLate = "audit-late"
	// OpAuditLost says that the audit log has no record of some
	// generations (Reason names them; Generation is the last of them) and
	// will not get them: no journal holds them any more, or appending them
	// from the journals failed and the records that follow leave them
	// behind. What they changed is in the state.
	OpAuditLost = "audit-lost"
)

// auditFileMode is the mode of audit.log and its rotation.
const auditFileMode = 0o600

// auditTailRead is how much of the end of audit.log a writer reads to find
// its last record: several records' worth.
const auditTailRead = 2 << 10

// stageAuditCaughtUp is the failpoint stage right after a writer appended
// the records of earlier commits that audit.log lacked (auditLog.catchUp).
const stageAuditCaughtUp = "audit-caught-up"

// auditLog is audit.log open for appending by a writer that holds the
// ledger lock, so that nobody else appends meanwhile.
//
// Every writer, before it appends its own records, appends those of the
// commits audit.log lacks (catchUp): the generation of the log's last
// record says how far it got, and the journal records of the commits after
// it carry their audit records. A commit's record is durable before its
// audit records are appended, so a writer stopped in between (killed, or
// its append failed) leaves them only there; the next writer to append
// anything puts them in the log, in generation order, before its own.
type auditLog struct {
	dir      string
	maxBytes int64
	f        *os.File
	// cut is how many bytes of an unfinished last line were cut off,
	// reported by the next write (OpAuditTorn); unended, that the file
	// ends inside a line too long to be a torn record of ours, which our
	// records must not be glued to (ReadAudit would take them for part of
	// it).
	cut     int64
	unended bool
	// lost is the OpAuditLost record of the generations a failed catchUp
	// could not append, written ahead of the writer's own records.
	lost *AuditRecord
	// size is the length of audit.log: read when it was opened, lowered by
	// a cut and raised by each write (the lock is held, so nobody else
	// changes it).
	size int64
	// last is the generation of the log's last record (of audit.log, or of
	// audit.log.1 while audit.log is empty). lastKnown is false when the
	// last line is not a record: how far the log got is then unknown, and
	// nothing is caught up. none: the log has no record at all (a fresh
	// host, a log removed by hand, a state dir restored without it).
	last      uint64
	lastKnown bool
	none      bool
}

// openAuditLog opens audit.log in dir for appending (creating it), cuts off
// the unfinished line a writer killed while appending left, and reads the
// generation of its last record.
func openAuditLog(dir string, maxBytes int64) (*auditLog, error) {
	p := filepath.Join(dir, auditName)
	f, size, err := openAudit(p)
	if err != nil {
		return nil, err
	}
	a := &auditLog{dir: dir, maxBytes: maxBytes, f: f, size: size}
	if err := a.readTail(); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("read the end of %s: %w", p, err)
	}
	return a, nil
}

// readTail reads the end of the log: one read of its last few records in
// the common case.
func (a *auditLog) readTail() error {
	var tail []byte
	if a.size > 0 {
		var err error
		if tail, err = readTail(a.f, a.size, auditTailRead); err != nil {
			return err
		}
		if tail[len(tail)-1] != '\n' {
			// A writer killed inside its write(2) can leave the start of
			// a line without its newline (the kernel copies a write page
			// by page and stops at a fatal signal). Appending after it
			// would glue our first record to it and make both unreadable:
			// cut the fragment off first (the lock is held, so nobody is
			// writing it) and say so in the log itself.
			cut, unended, err := cutTornTail(a.f, a.size, tail)
			if err != nil {
				return err
			}
			if unended {
				a.unended = true
				return nil // the last line is not a record: how far the log got is unknown
			}
			a.cut, a.size = cut, a.size-cut
			// What was read of the rest ends in its last newline.
			tail = tail[:max(int64(len(tail))-cut, 0)]
		}
	}
	if a.size == 0 {
		a.last, a.lastKnown, a.none = lastAuditedIn(filepath.Join(a.dir, auditRotated))
		return nil
	}
	line, ok, err := lastLineOf(a.f, a.size, tail)
	if err != nil || !ok {
		return err
	}
	a.last, a.lastKnown = auditedGeneration(line)
	return nil
}

// readTail reads the last n bytes of the first size bytes of f (all of
// them if fewer).
func readTail(f *os.File, size, n int64) ([]byte, error) {
	n = min(n, size)
	buf := make([]byte, n)
	if _, err := f.ReadAt(buf, size-n); err != nil {
		return nil, err
	}
	return buf, nil
}

// lastLineOf returns the last line of the first size bytes of f, which end
// in a newline, without it; ok is false when that line is longer than a
// record can be. tail is what was read of the end of those bytes already
// (empty: nothing): it is looked in first, and more is read only when it
// holds no line whole.
func lastLineOf(f *os.File, size int64, tail []byte) (line []byte, ok bool, err error) {
	if len(tail) == 0 {
		if tail, err = readTail(f, size, auditTailRead); err != nil {
			return nil, false, err
		}
	}
	for {
		n := int64(len(tail))
		if i := bytes.LastIndexByte(tail[:n-1], '\n'); i >= 0 || n == size {
			return tail[i+1 : n-1], true, nil
		}
		if n > maxAuditLine {
			return nil, false, nil
		}
		if tail, err = readTail(f, size, min(size, 16*n, maxAuditLine+1)); err != nil {
			return nil, false, err
		}
	}
}

// lastAuditedIn is the generation of the last record of the audit log at p
// (the rotated one, read while audit.log is empty); none when it has none.
func lastAuditedIn(p string) (gen uint64, known, none bool) {
	f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0) //nolint:gosec // fixed name in the operator's state dir
	if errors.Is(err, fs.ErrNotExist) {
		return 0, true, true
	}
	if err != nil {
		return 0, false, false
	}
	defer func() { _ = f.Close() }()
	fi, err := f.Stat()
	switch {
	case err != nil || !fi.Mode().IsRegular():
		return 0, false, false
	case fi.Size() == 0:
		return 0, true, true
	}
	tail, err := readTail(f, fi.Size(), auditTailRead)
	if err != nil || tail[len(tail)-1] != '\n' {
		return 0, false, false // it ended inside a line when it was rotated
	}
	line, ok, err := lastLineOf(f, fi.Size(), tail)
	if err != nil || !ok {
		return 0, false, false
	}
	gen, known = auditedGeneration(line)
	return gen, known, false
}

// auditedGeneration is the generation of the audit record line, ok false
// if it is not one (as ReadAudit would not take it: no op). appendAuditLine
// ends every line with `,"generation":G,"pid":P}`, read from the end (a
// string cannot hold those quotes unescaped); anything else is left to
// encoding/json.
func auditedGeneration(line []byte) (uint64, bool) {
	digits := func(b []byte) int { // how many digits b ends with
		n := 0
		for n < len(b) && b[len(b)-1-n] >= '0' && b[len(b)-1-n] <= '9' {
			n++
		}
		return n
	}
	if b, ok := bytes.CutSuffix(line, []byte("}")); ok && !bytes.Contains(line, []byte(`"op":""`)) {
		b = b[:len(b)-digits(b)]
		b = bytes.TrimSuffix(b, []byte("-"))
		if b, ok = bytes.CutSuffix(b, []byte(`,"pid":`)); ok {
			n := digits(b)
			num := b[len(b)-n:]
			if _, ok = bytes.CutSuffix(b[:len(b)-n], []byte(`,"generation":`)); ok && n > 0 && n <= 19 {
				var g uint64
				for _, c := range num {
					g = g*10 + uint64(c-'0')
				}
				return g, true
			}
		}
	}
	var rec struct {
		Op         string  `json:"op"`
		Generation *uint64 `json:"generation"`
	}
	if json.Unmarshal(line, &rec) != nil || rec.Op == "" || rec.Generation == nil {
		return 0, false
	}
	return *rec.Generation, true
}

// catchUp appends, ahead of the writer's own records, those of the
// commits up to generation through that the log lacks (the generations
// after its last record; see lateAudit). It runs before the writer's
// commit, while the journals still hold every commit since the compaction
// before the last: a writer stopped right after it leaves them appended,
// one stopped before it leaves them where the next one finds them. A log
// without any record gets those the journals hold, but no OpAuditLost for
// the generations before: it was never kept here (a state dir restored
// without it) or was removed, which is no commit's loss to report. A
// failure does not fail the writer (the commits stand), but its own records
// would then put the log's last generation past the gap, and no later
// writer would see it: they are preceded by an OpAuditLost record naming
// it (see write). A writer that appends nothing leaves the gap to the next.
func (a *auditLog) catchUp(l *Ledger, through uint64) {
	if !a.lastKnown || a.last >= through {
		return
	}
	now, pid := l.now(), os.Getpid()
	recs := l.lateAudit(a.last+1, through, !a.none, now, pid)
	if len(recs) > 0 {
		l.log.Warn("ledger: appending audit records the audit log lacks (their writer stopped before it appended them)",
			"generations", fmt.Sprintf("%d-%d", a.last+1, through), "records", len(recs))
		if err := a.write(recs, nil, false); err != nil {
			l.log.Error("ledger: could not append the audit records the audit log lacks; an audit-lost record names them",
				"generations", fmt.Sprintf("%d-%d", a.last+1, through), "error", err)
			note := lostNote(a.last+1, through, now, pid, fmt.Sprintf("appending them from their journal records failed "+
				"(%v), and the records after this one leave them behind, where no later writer looks; what they "+
				"changed is in the state (gpu-guard-ctl status)", err))
			a.lost = &note
			return
		}
		reachStage(stageAuditCaughtUp)
	}
	a.last = through
}

// write appends recs in one write(2) (lines: their rendering, or nil to
// render them), after the note of a torn tail cut off, rotating audit.log
// to audit.log.1 first when it would grow past maxBytes. With durable, the
// records (and a rotation) are on disk when it returns nil: the file is
// fsynced, and the dir after a rotation.
func (a *auditLog) write(recs []AuditRecord, lines []byte, durable bool) error {
	if len(recs) == 0 {
		return nil
	}
	p := filepath.Join(a.dir, auditName)
	if a.f == nil {
		return fmt.Errorf("append to %s: not open (a rotation failed)", p)
	}
	if lines == nil {
		var err error
		if lines, err = appendAuditLines(nil, recs); err != nil {
			return err
		}
	}
	payload := lines
	if a.cut > 0 || a.lost != nil {
		var notes []AuditRecord
		if a.cut > 0 {
			notes = append(notes, AuditRecord{Time: recs[0].Time, Op: OpAuditTorn, Generation: recs[0].Generation, Pid: recs[0].Pid,
				Reason: fmt.Sprintf("%d bytes of an unfinished record (a writer killed while appending) were cut off", a.cut)})
		}
		if a.lost != nil {
			notes = append(notes, *a.lost)
		}
		note, err := appendAuditLines(nil, notes)
		if err != nil {
			return err
		}
		payload = append(note, lines...)
	}
	if a.size > 0 && a.size+int64(len(payload)) > a.maxBytes {
		_ = a.f.Close()
		a.f = nil
		if err := os.Rename(p, filepath.Join(a.dir, auditRotated)); err != nil { //nolint:gosec // fixed names in the operator's state dir
			return fmt.Errorf("rotate %s: %w", p, err)
		}
		f, size, err := openAudit(p)
		if err != nil {
			return err
		}
		a.f, a.size = f, size
		a.unended = false // the line left unended went with the rotation
		if durable {
			if err := syncDir(a.dir); err != nil {
				return fmt.Errorf("rotate %s: %w", p, err)
			}
		}
	}
	if a.unended {
		// A line without its end that is too long to be a torn record of
		// ours stays as it is, but our records must not be glued to it
		// (ReadAudit would take them for part of it): they start a line.
		payload = append([]byte{'\n'}, payload...)
	}
	// One write: appends of one write call are not interleaved with others.
	n, err := a.f.Write(payload)
	a.size += int64(n)
	if err != nil {
		return fmt.Errorf("append to %s: %w", p, err)
	}
	a.cut, a.unended, a.lost = 0, false, nil
	if durable {
		if err := a.f.Sync(); err != nil {
			return fmt.Errorf("fsync %s: %w", p, err)
		}
	}
	return nil
}

// close closes the log.
func (a *auditLog) close() error {
	if a.f == nil {
		return nil
	}
	err := a.f.Close()
	a.f = nil
	if err != nil {
		return fmt.Errorf("close %s: %w", filepath.Join(a.dir, auditName), err)
	}
	return nil
}

// appendAuditLines renders recs, one line each.
func appendAuditLines(b []byte, recs []AuditRecord) ([]byte, error) {
	for i := range recs {
		var err error
		if b, err = appendAuditLine(b, &recs[i]); err != nil {
			return nil, fmt.Errorf("encode audit record: %w", err)
		}
	}
	return b, nil
}

// appendAudit appends recs (lines: their rendering, or nil) to the audit
// log under the ledger lock, after the records it lacks of the commits up
// to generation through (catchUp); durable as auditLog.write.
func (l *Ledger) appendAudit(recs []AuditRecord, lines []byte, through uint64, durable bool) error {
	a, err := openAuditLog(l.dir, l.opts.AuditMaxBytes)
	if err != nil {
		return err
	}
	a.catchUp(l, through)
	err = a.write(recs, lines, durable)
	return errors.Join(err, a.close())
}

// openAuditCaughtUp opens audit.log for a writer about to write a state
// after generation through, and appends first what the log lacks of the
// commits up to it (catchUp). nil, logged, when it cannot be opened:
// finishAudit then tries again for the writer's own records.
func (l *Ledger) openAuditCaughtUp(through uint64) *auditLog {
	a, err := openAuditLog(l.dir, l.opts.AuditMaxBytes)
	if err != nil {
		l.log.Error("ledger: cannot open the audit log", "error", err)
		return nil
	}
	a.catchUp(l, through)
	return a
}

// finishAudit appends a writer's own records (lines: their rendering, or
// nil) once its state is written, to a from openAuditCaughtUp(through), and
// closes it. With a nil (that open failed), appendAudit opens it now and
// catches it up through the same generation first: appended straight away,
// the writer's records would move the log's last generation past a gap
// that nothing would ever name.
func (l *Ledger) finishAudit(a *auditLog, through uint64, recs []AuditRecord, lines []byte) error {
	if a == nil {
		return l.appendAudit(recs, lines, through, false)
	}
	err := a.write(recs, lines, false)
	return errors.Join(err, a.close())
}

// AppendAudit writes recs to the audit log under the ledger lock, stamped
// with the generation of the current state, and returns only once they are
// on disk (fsync). It changes no state and commits nothing: it is for a
// decision whose only trace is its audit record (an exemption), which must
// not be acted on if the record is lost. Unlike the records of a commit, an
// error here is returned, never only logged. A state that needs recovery
// (or any error reading it) fails it, as it fails Update. Records of
// earlier commits that the log lacks are appended first (catchUp).
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
	return l.appendAudit(recs, nil, ld.st.Generation, true)
}

// cutTornTail truncates f (open for appending, under the ledger lock, size
// bytes long) after its last newline, and returns how many bytes it cut.
// tail is what was read of the end of f: not empty, and not ending in a
// newline. The fragment is at most one record long: a longer one is not a
// torn append, and is left for ReadAudit to report (unended: the file then
// ends inside that line).
func cutTornTail(f *os.File, size int64, tail []byte) (cut int64, unended bool, err error) {
	if int64(len(tail)) < size && !bytes.Contains(tail, []byte{'\n'}) {
		// The fragment is longer than what was read: read as far back as
		// a record can reach.
		if tail, err = readTail(f, size, maxAuditLine); err != nil {
			return 0, false, err
		}
	}
	window := int64(len(tail))
	keep := int64(bytes.LastIndexByte(tail, '\n')) + 1 + size - window
	if keep == size-window && window == maxAuditLine {
		return 0, true, nil // no newline within a record's length: not ours to cut
	}
	if err := f.Truncate(keep); err != nil {
		return 0, false, err
	}
	return size - keep, false, nil
}

// openAudit opens the audit log at p for appending (creating it), and
// returns its size.
func openAudit(p string) (*os.File, int64, error) {
	// O_NONBLOCK: a FIFO planted in its place fails at once instead of
	// blocking the commit forever.
	f, err := os.OpenFile(p, os.O_RDWR|os.O_APPEND|os.O_CREATE|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, auditFileMode) //nolint:gosec // fixed name in the operator's state dir
	if err != nil {
		return nil, 0, fmt.Errorf("open audit log %s: %w", p, err)
	}
	fi, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, 0, fmt.Errorf("open audit log %s: %w", p, err)
	}
	if !fi.Mode().IsRegular() {
		_ = f.Close()
		return nil, 0, fmt.Errorf("%w: audit log %s is not a regular file (%s); remove it", ErrUnsafeDir, p, fi.Mode().Type())
	}
	return f, fi.Size(), nil
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
