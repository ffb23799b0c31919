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
	OpAuditTorn          = "audit-torn"          // an unfinished record (a write cut short) precedes this one on a line of its own, left as it was
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

// auditWrite is the write(2) of an append to audit.log. Only tests replace
// it (before any ledger is used), to make a write stop partway as a full
// disk or an I/O error does; production code never does.
var auditWrite = (*os.File).Write

// auditRunRead bounds how much of the end of audit.log is read to find the
// records of the generation a cut write was appending (auditLog.runOf):
// all of one commit's records, as its journal record holds them, and more.
const auditRunRead = 4 * maxJournalAudit

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
//
// The log is only ever appended to: nothing in it is cut or rewritten, so
// that a reader following it (gpu-guard-ctl audit -f, a log shipper) keeps
// its place. A write cut short (a writer killed inside its write(2), a full
// disk, an I/O error) leaves an unfinished line, without its newline, at
// the end: the next write starts with a newline, so that its first record
// starts a line of its own instead of being glued to that one (which would
// make both one bad line, and lose the record), and notes the unfinished
// record (OpAuditTorn). The unfinished line stays as it was, and ReadAudit
// reports it, by line and byte offset.
type auditLog struct {
	dir      string
	maxBytes int64
	f        *os.File
	// midLine: the file ends inside a line (a write cut short, or a line
	// of unknown origin too long to be a record of ours): the next write
	// starts with a newline. torn is the length of the unfinished record
	// the next write notes (OpAuditTorn) ahead of its records: one cut
	// short at the end, or ended since by a newline whose write was cut
	// short in turn; 0 for none, or for a long line, which is not ours.
	midLine bool
	torn    int64
	// tornGen: a write was cut short after the log's last record, and may
	// have carried more records of its generation (last), which the log
	// then lacks: catchUp appends those of them its journal record holds
	// (see runOf). recEnd is where the log's last record line ends
	// (including its newline); tailRec that record when the cut write did
	// not reach its newline (it is the unfinished line, and whole).
	tornGen bool
	recEnd  int64
	tailRec []byte
	// lost is the OpAuditLost record of the generations a failed catchUp
	// could not append, written ahead of the writer's own records.
	lost *AuditRecord
	// size is the length of audit.log: read when it was opened and raised
	// by each write (the lock is held, so nobody else changes it).
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

// openAuditLog opens audit.log in dir for appending (creating it), and
// reads the generation of its last record, and whether it ends inside a
// line that a write cut short left.
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
// the common case. A log that ends inside a line (a write cut short) is
// read further back, past that line, to its last record; so is a last line
// that is an unfinished record ended by a newline (the next write was cut
// short in turn, right after the newline it starts with). Neither counts as
// a record: what the cut write carried is looked for by catchUp.
func (a *auditLog) readTail() error {
	if a.size == 0 {
		a.last, a.lastKnown, a.none = lastAuditedIn(filepath.Join(a.dir, auditRotated))
		return nil
	}
	tail, err := readTail(a.f, a.size, auditTailRead)
	if err != nil {
		return err
	}
	end := a.size // the part of the log looked at: it ends a line
	if tail[len(tail)-1] != '\n' {
		// A writer killed inside its write(2) can leave the start of a
		// line without its newline (the kernel copies a write page by
		// page and stops at a fatal signal), and so can a write that
		// failed partway (a full disk). Appending straight after it would
		// glue our first record to it and make both unreadable.
		frag, long, err := unfinishedLine(a.f, a.size, tail)
		if err != nil {
			return err
		}
		a.midLine = true
		if long {
			return nil // not a record of ours: how far the log got is unknown
		}
		a.tornGen = true
		if g, ok := auditedGeneration(frag); ok && json.Valid(frag) {
			// Whole: the write stopped right before its newline.
			a.last, a.lastKnown, a.recEnd, a.tailRec = g, true, a.size-int64(len(frag)), frag
			return nil
		}
		a.torn = int64(len(frag))
		end -= int64(len(frag))
		tail = tail[:max(len(tail)-len(frag), 0)]
	}
	for range 4 {
		if end == 0 {
			break
		}
		line, ok, err := lastLineOf(a.f, end, tail)
		if err != nil || !ok {
			return err
		}
		if g, ok := auditedGeneration(line); ok {
			a.last, a.lastKnown, a.recEnd = g, true, end
			return nil
		}
		if !unfinishedRecord(line) {
			return nil // not a record: how far the log got is unknown
		}
		// An unfinished record ended by the newline a later write starts
		// with, a write cut short right after it: nothing notes it yet.
		if a.torn == 0 {
			a.torn = int64(len(line))
		}
		a.tornGen = true
		end -= int64(len(line)) + 1
		tail = tail[:max(len(tail)-len(line)-1, 0)]
	}
	if end > 0 {
		return nil // more unfinished lines than a few writes cut short leave
	}
	// No record in audit.log: audit.log.1 says how far the log got. What a
	// cut write carried is not looked for there.
	a.tornGen = false
	a.last, a.lastKnown, a.none = lastAuditedIn(filepath.Join(a.dir, auditRotated))
	return nil
}

// unfinishedLine returns the line f (size bytes long) ends inside, after
// its last newline. tail is what was read of the end of f: not empty, and
// not ending in a newline. The line is at most one record long: a longer
// one is not a write of ours cut short (long; line is then nil), and is
// left for ReadAudit to report.
func unfinishedLine(f *os.File, size int64, tail []byte) (line []byte, long bool, err error) {
	if int64(len(tail)) < size && !bytes.Contains(tail, []byte{'\n'}) {
		// The line is longer than what was read: read as far back as a
		// record can reach.
		if tail, err = readTail(f, size, maxAuditLine); err != nil {
			return nil, false, err
		}
	}
	i := bytes.LastIndexByte(tail, '\n')
	if i < 0 && int64(len(tail)) == maxAuditLine {
		return nil, true, nil // no newline within a record's length: not ours
	}
	return tail[i+1:], false, nil
}

// unfinishedRecord says whether line is the start of a record whose write
// was cut short: it starts as appendAuditLine starts a record, and is JSON
// that is whole as far as it goes, and ends too soon.
func unfinishedRecord(line []byte) bool {
	start := []byte(`{"time":`)
	if len(line) == 0 || !bytes.HasPrefix(line, start) && !bytes.HasPrefix(start, line) {
		return false
	}
	var se *json.SyntaxError
	return errors.As(json.Unmarshal(line, new(any)), &se) && se.Offset == int64(len(line))
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
//
// After a write cut short (tornGen), the generation of the log's last
// record is not known to be all there: the cut write may have been
// appending its records, one by one, when it stopped. Those of them its
// journal record holds and the log lacks are appended too (runOf says
// which the log has), never one it has: the unfinished line is none.
func (a *auditLog) catchUp(l *Ledger, through uint64) {
	if !a.lastKnown || a.last > through || (a.last == through && !a.tornGen) {
		return
	}
	from := a.last + 1
	var have func([]AuditRecord) int
	if a.tornGen {
		from, have = a.last, a.present
	}
	now, pid := l.now(), os.Getpid()
	recs := l.lateAudit(from, through, !a.none, now, pid, have)
	if len(recs) > 0 {
		l.log.Warn("ledger: appending audit records the audit log lacks (their writer stopped before it appended them)",
			"generations", fmt.Sprintf("%d-%d", from, through), "records", len(recs))
		size := a.size
		if err := a.write(recs, nil, false); err != nil {
			l.log.Error("ledger: could not append the audit records the audit log lacks; an audit-lost record names them",
				"generations", fmt.Sprintf("%d-%d", from, through), "error", err)
			why := fmt.Sprintf("appending them from their journal records failed (%v)", err)
			if a.size > size {
				why = fmt.Sprintf("appending them from their journal records failed partway (%v): those of them before "+
					"the unfinished line above are what it appended", err)
			}
			note := lostNote(from, through, now, pid, why+", and the records after this one leave them behind, where "+
				"no later writer looks; what they changed is in the state (gpu-guard-ctl status)")
			a.lost = &note
			return
		}
		reachStage(stageAuditCaughtUp)
	}
	a.last, a.tornGen = through, false
}

// present says how many of recs, the records of the log's last generation
// as its journal record holds them, the log has already (a prefix of them:
// they are appended in order, in one write): all of them when they are
// there whole, or when what the log has of that generation is not what a
// cut write of them leaves (it is not known which are missing, and none is
// appended twice).
func (a *auditLog) present(recs []AuditRecord) int {
	run, ok := a.runOf(a.last)
	if !ok {
		return len(recs)
	}
	key := func(r *AuditRecord) string {
		b, err := appendAuditLine(nil, r)
		if err != nil {
			return ""
		}
		return string(b)
	}
	want := make([]string, len(recs))
	for i := range recs {
		want[i] = key(&recs[i])
	}
	have := make([]string, len(run))
	for i := range run {
		if run[i].Op == OpAuditLost {
			return len(recs) // what the log lacks of it is named already
		}
		have[i] = key(&run[i])
	}
	for i := 0; i+len(want) <= len(have); i++ {
		if slices.Equal(have[i:i+len(want)], want) {
			return len(recs)
		}
	}
	// The cut write was appending them: the log ends with the first m.
	for m := min(len(have), len(want)-1); m > 0; m-- {
		if slices.Equal(have[len(have)-m:], want[:m]) {
			return m
		}
	}
	if slices.Contains(have, want[0]) {
		return len(recs)
	}
	return 0
}

// runOf returns the records of generation g at the end of audit.log, in
// order, up to its last record (recEnd, and tailRec): the lines before it
// are read back to the first of another generation. Lines that are not
// records (an unfinished one) are passed over. ok is false when the run
// is not found whole: longer than auditRunRead, or reaching the start of
// audit.log while audit.log.1 exists (it may go on there).
func (a *auditLog) runOf(g uint64) (run []AuditRecord, ok bool) {
	var last []AuditRecord
	if a.tailRec != nil {
		var r AuditRecord
		if json.Unmarshal(a.tailRec, &r) == nil && r.Generation == g {
			last = append(last, r)
		}
	}
	for n := min(a.recEnd, 64<<10); ; n = min(a.recEnd, 8*n, auditRunRead) {
		buf, err := readTail(a.f, a.recEnd, n)
		if err != nil {
			return nil, false
		}
		whole := int64(len(buf)) == a.recEnd
		lines := bytes.Split(bytes.TrimSuffix(buf, []byte{'\n'}), []byte{'\n'})
		if !whole {
			lines = lines[1:] // cut by where the read began
		}
		var rev []AuditRecord
		found := false
		for i := len(lines) - 1; i >= 0 && !found; i-- {
			var r AuditRecord
			switch {
			case json.Unmarshal(lines[i], &r) != nil || r.Op == "":
			case r.Generation != g:
				found = true
			default:
				rev = append(rev, r)
			}
		}
		if found || whole {
			if !found {
				if _, err := os.Lstat(filepath.Join(a.dir, auditRotated)); !errors.Is(err, fs.ErrNotExist) {
					return nil, false
				}
			}
			slices.Reverse(rev)
			return append(rev, last...), true
		}
		if n >= auditRunRead {
			return nil, false
		}
	}
}

// write appends recs in one write(2) (lines: their rendering, or nil to
// render them), after the notes of an unfinished record (OpAuditTorn) and
// of generations a catch-up lost, rotating audit.log to audit.log.1 first
// when it would grow past maxBytes. A log that ends inside a line gets a
// newline first, in the same write. With durable, the records (and a
// rotation) are on disk when it returns nil: the file is fsynced, and the
// dir after a rotation. A write cut short is not undone (the log is only
// appended to): the next write, on this log or another writer's, ends the
// unfinished line it left.
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
	var head []byte // the newline and the notes that go before lines
	if a.torn > 0 || a.lost != nil {
		var notes []AuditRecord
		if a.torn > 0 {
			gen := recs[0].Generation
			if a.lost != nil {
				gen = min(gen, a.lost.Generation) // in generation order
			}
			notes = append(notes, AuditRecord{Time: recs[0].Time, Op: OpAuditTorn, Generation: gen, Pid: recs[0].Pid,
				Reason: fmt.Sprintf("an unfinished record of %d bytes precedes this one, on a line of its own: its write was "+
					"cut short (a writer killed while appending, or a write that failed); it is left as it was", a.torn)})
		}
		if a.lost != nil {
			notes = append(notes, *a.lost)
		}
		var err error
		if head, err = appendAuditLines(nil, notes); err != nil {
			return err
		}
	}
	if a.size > 0 && a.size+int64(len(head)+len(lines)) > a.maxBytes {
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
		a.midLine = false // the unfinished line went with the rotation
		if durable {
			if err := syncDir(a.dir); err != nil {
				return fmt.Errorf("rotate %s: %w", p, err)
			}
		}
	}
	if a.midLine {
		// Our records must not be glued to the line the file ends inside
		// (ReadAudit would take them for part of it): they start a line.
		head = append([]byte{'\n'}, head...)
	}
	payload := lines
	if len(head) > 0 {
		payload = append(head, lines...)
	}
	// One write: appends of one write call are not interleaved with others.
	n, err := auditWrite(a.f, payload)
	a.size += int64(n)
	if err != nil {
		if n > 0 {
			// Cut short: the file ends after the last newline written,
			// inside the line after it unless the write stopped right
			// there. The notes are written once they are whole.
			written := payload[:n]
			a.torn = int64(n - 1 - bytes.LastIndexByte(written, '\n'))
			a.midLine = a.torn > 0
			if n >= len(head) {
				a.lost = nil
			}
		}
		return fmt.Errorf("append to %s: %w", p, err)
	}
	a.torn, a.midLine, a.lost = 0, false, nil
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
		case long && err != nil:
			errs = append(errs, &AuditLineError{Path: p, Line: line, Cause: fmt.Errorf("the log ends inside a line of %d bytes "+
				"at byte offset %d, without its newline, longer than any record (under %d bytes): skipped", off-start, start, maxAuditLine)})
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
			if jerr := json.Unmarshal(b, &rec); jerr != nil {
				errs = append(errs, &AuditLineError{Path: p, Line: line, Cause: badLine(b, jerr, start, err != nil)})
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

// badLine is why the audit line b (at byte offset off) did not decode: err,
// said more plainly for a write cut short, which leaves the start of a
// record (unfinished) and, until the next append ends it, no newline after
// it (last: the line ends the file without one).
func badLine(b []byte, err error, off int64, last bool) error {
	cut := "its write was cut short: a writer killed while appending, or a write that failed"
	switch {
	case last && unfinishedRecord(b):
		return fmt.Errorf("the log ends inside an unfinished record of %d bytes at byte offset %d, without its newline "+
			"(%s; the next append leaves it as it is and starts a line of its own): %w", len(b), off, cut, err)
	case last:
		return fmt.Errorf("the log ends inside a line of %d bytes at byte offset %d, without its newline (%s?): %w", len(b), off, cut, err)
	case unfinishedRecord(b):
		return fmt.Errorf("an unfinished record of %d bytes at byte offset %d (%s; the records after it start a line of their own): %w",
			len(b), off, cut, err)
	}
	return err
}
