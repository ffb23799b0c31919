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
	"strconv"
	"strings"
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
	// Seq is the record's place among its commit's records, "i/n" (i
	// from 1), when the commit wrote more than one: a log whose last
	// record says i < n ends where a write of them was cut short, right
	// after a newline (see auditLog). Empty for a commit's only record, for
	// the log's own notes, and in the records of older builds.
	Seq        string `json:"seq,omitempty"`
	Generation uint64 `json:"generation"`
	Pid        int    `json:"pid"` // of the process that wrote the record
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
	OpAuditTorn          = "audit-torn"          // an unfinished record (a write cut short) precedes this one on a line of its own, or ends audit.log.1 (rotated since), left as it was
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
	// behind. Or that one generation (Generation; Reason says "may lack
	// records") may lack some of its records: a write that was appending
	// them was cut short, and which of them the log has could not be told,
	// so none was appended again. What they changed is in the state.
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

// auditRunRead bounds how much of the end of the log (audit.log, then
// audit.log.1) is read to find the records of the generation a cut write
// was appending (auditLog.runOf): all of one commit's records, as its
// journal record holds them, and more.
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
// reports it, by line and byte offset. A rotation ends it first, in the old
// file, so that audit.log.1 ends with whole lines.
//
// After a write cut short, the next writer appends the records of the
// generation of the log's last record that the cut write may have left out
// (catchUp, present), read back from the log, past the notes a cut
// catch-up left between them and into audit.log.1. Where it cannot tell
// which the log has, it appends none and says so (OpAuditLost): a record is
// never appended twice, and never left out without a record that says so.
//
// A write cut right after a newline (a writer killed at a page boundary, a
// full disk) leaves only whole lines; the log's last line says whether the
// write went on (tailOf): it is one of the notes that go ahead of records
// in the same write (OpAuditTorn, OpAuditLate); or a record of a commit of
// several whose place (Seq, i/n) says more of them follow; or, for records
// without a place (a catch-up of an older build's journal record), one of
// fewer records of its generation than the OpAuditLate note before them
// says follow, that note within the end read (auditTailRead). Only the
// records of a commit that changed the state carry a place: those of a
// commit that changed nothing and of AppendAudit have no journal record to
// be appended from, and a write of them cut right after a newline is not
// seen (as none cut anywhere could be appended late).
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
	// torn1 is the length of an unfinished record that ends audit.log.1,
	// which the next write notes too: a rotation moved it there (ended by
	// a newline first), before any note of it was written.
	torn1 int64
	// tornGen: a write was cut short after the log's last record, and may
	// have carried more records of its generation (last), which the log
	// then lacks: catchUp appends those of them its journal record holds
	// (see runOf). recEnd is where the log's last record line ends
	// (including its newline); tailRec that record when the cut write did
	// not reach its newline (it is the unfinished line, and whole). recIn1:
	// they are in audit.log.1 (audit.log has no record).
	tornGen bool
	recEnd  int64
	tailRec []byte
	recIn1  bool
	// lost is the OpAuditLost record of the generations a failed catchUp
	// could not append, written ahead of the writer's own records.
	lost *AuditRecord
	// size is the length of audit.log: read when it was opened and raised
	// by each write (the lock is held, so nobody else changes it).
	// appended counts the bytes of records and notes this writer appended,
	// across rotations.
	size     int64
	appended int64
	// last is the generation of the log's last record (of audit.log, or of
	// audit.log.1 while audit.log has none), kept up to date by each write.
	// lastKnown is false when the last line is not a record: how far the
	// log got is then unknown, and nothing is caught up. none: the log has
	// no record at all (a fresh host, a log removed by hand, a state dir
	// restored without it).
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

// auditedThrough is the generation of the audit log's last record (of
// audit.log, or of audit.log.1 while audit.log has none), read without
// writing anything: 0 when the log has no record, or when its end is not a
// record (how far it got is unknown, and nothing is caught up anyway). A
// state that starts afresh continues above it (see prepare): the log is in
// generation order, and a writer only catches it up through generations
// past its last record, so a commit numbered at or below it (a state that
// restarted at generation 1 next to a log that ends at 40) whose writer was
// stopped before its append would lose its records without a trace.
func (l *Ledger) auditedThrough() uint64 {
	// Read only, as the ledger's other files are read.
	f, fi, exists, err := openRegular(filepath.Join(l.dir, auditName), true)
	if err != nil {
		return 0
	}
	a := &auditLog{dir: l.dir}
	if exists {
		defer func() { _ = f.Close() }()
		a.f, a.size = f, fi.Size()
	}
	if err := a.readTail(); err != nil || !a.lastKnown || a.last > maxAuditedGeneration {
		// A generation past any a ledger reaches is a damaged log's (it
		// carries no checksum): numbering on from it would wrap the
		// state's generation.
		return 0
	}
	return a.last
}

// maxAuditedGeneration is the highest generation of the audit log a fresh
// start numbers on from (auditedThrough): far beyond what a host commits in
// its life (a commit a microsecond for 100,000 years is 2^62), far below
// where a uint64 wraps.
const maxAuditedGeneration = 1 << 62

// readTail reads the end of the log: one read of its last few records in
// the common case (tailOf). When audit.log has no record (it is empty after
// a rotation, or holds nothing but unfinished lines: the write after the
// rotation was cut short), audit.log.1 says how far the log got, read the
// same way (readRotatedTail).
func (a *auditLog) readTail() error {
	t, err := tailOf(a.f, a.size)
	if err != nil {
		return err
	}
	a.midLine, a.torn = t.midLine, t.torn
	switch {
	case t.unknown:
		return nil
	case t.found:
		a.last, a.lastKnown, a.tornGen, a.recEnd, a.tailRec = t.last, true, t.tornGen, t.recEnd, t.tailRec
		return nil
	}
	a.readRotatedTail(t.tornGen)
	return nil
}

// readRotatedTail reads how far the log got from the end of audit.log.1,
// for a log whose audit.log has no record: none when there is no
// audit.log.1 (or it is empty), unknown when it cannot be read or its last
// line is not a record. It may end with an unfinished line (the rotation
// moved it there, ended by a newline, or a power cut lost that newline):
// its last record is read before it, and a cut write is looked for from
// there (tornGen), as it is when audit.log holds unfinished lines (cut,
// here: a write cut short after the rotation, which may have carried
// records of that generation too).
func (a *auditLog) readRotatedTail(cut bool) {
	f, size, exists, err := openRotatedAudit(a.dir)
	switch {
	case err != nil:
		return
	case !exists || size == 0:
		if f != nil {
			_ = f.Close()
		}
		a.last, a.lastKnown, a.none = 0, true, true
		return
	}
	defer func() { _ = f.Close() }()
	t, err := tailOf(f, size)
	if err != nil || !t.found {
		return // not a record (nor one before a few unfinished lines): unknown
	}
	a.last, a.lastKnown, a.recEnd, a.tailRec, a.recIn1 = t.last, true, t.recEnd, t.tailRec, true
	a.tornGen = cut || t.tornGen
	a.torn1 = t.torn
}

// openRotatedAudit opens audit.log.1 in dir for reading; exists is false
// when there is none. Anything but a regular file is an error.
func openRotatedAudit(dir string) (f *os.File, size int64, exists bool, err error) {
	p := filepath.Join(dir, auditRotated)
	f, err = os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0) //nolint:gosec // fixed name in the operator's state dir
	if errors.Is(err, fs.ErrNotExist) {
		return nil, 0, false, nil
	}
	if err != nil {
		return nil, 0, true, err
	}
	fi, err := f.Stat()
	if err == nil && !fi.Mode().IsRegular() {
		err = fmt.Errorf("%w: audit log %s is not a regular file (%s)", ErrUnsafeDir, p, fi.Mode().Type())
	}
	if err != nil {
		_ = f.Close()
		return nil, 0, true, err
	}
	return f, fi.Size(), true, nil
}

// auditTail is what the end of one audit file says (tailOf); the fields
// are those of auditLog of the same names.
type auditTail struct {
	midLine bool
	torn    int64
	tornGen bool
	// found: last is the generation of the file's last record, which ends
	// at recEnd (or is tailRec). unknown: the last line is not a record,
	// nor an unfinished one, or more unfinished lines end the file than a
	// few writes cut short leave: how far the log got is unknown. Neither:
	// the file is empty, or holds nothing but unfinished lines.
	found, unknown bool
	last           uint64
	recEnd         int64
	tailRec        []byte
}

// tailOf reads the end of the audit file f (size bytes): one read of its
// last few records in the common case. A file that ends inside a line (a
// write cut short) is read further back, past that line, to its last
// record; so is a last line that is an unfinished record ended by a
// newline (the next write was cut short in turn, right after the newline
// it starts with, or a rotation ended it). Neither counts as a record: what
// the cut write carried is looked for by catchUp. Nor does a file whose
// last record is one of the log's own notes (OpAuditTorn, OpAuditLate) end
// where a write ended: each is written ahead of records, in the same write,
// so the write was cut right after its newline; nor one whose last record
// says more of its commit's records follow it (moreFollow, lateCut). These
// look at what was read already: no read more.
func tailOf(f *os.File, size int64) (t auditTail, err error) {
	if size == 0 {
		return t, nil
	}
	tail, err := readTail(f, size, auditTailRead)
	if err != nil {
		return t, err
	}
	end := size // the part of the file looked at: it ends a line
	if tail[len(tail)-1] != '\n' {
		// A writer killed inside its write(2) can leave the start of a
		// line without its newline (the kernel copies a write page by
		// page and stops at a fatal signal), and so can a write that
		// failed partway (a full disk). Appending straight after it would
		// glue our first record to it and make both unreadable.
		frag, long, err := unfinishedLine(f, size, tail)
		if err != nil {
			return t, err
		}
		t.midLine = true
		if long {
			t.unknown = true // not a record of ours: how far the log got is unknown
			return t, nil
		}
		t.tornGen = true
		if g, ok := auditedGeneration(frag); ok && json.Valid(frag) {
			// Whole: the write stopped right before its newline.
			t.last, t.found, t.recEnd, t.tailRec = g, true, size-int64(len(frag)), frag
			return t, nil
		}
		t.torn = int64(len(frag))
		end -= int64(len(frag))
		tail = tail[:max(len(tail)-len(frag), 0)]
	}
	for range 4 {
		if end == 0 {
			return t, nil
		}
		line, ok, err := lastLineOf(f, end, tail)
		if err != nil {
			return t, err
		}
		if !ok {
			t.unknown = true
			return t, nil
		}
		if g, ok := auditedGeneration(line); ok {
			t.last, t.found, t.recEnd = g, true, end
			t.tornGen = t.tornGen || logNote(line) || moreFollow(line) || lateCut(tail, int64(len(tail)) == end, g)
			return t, nil
		}
		if !unfinishedRecord(line) {
			t.unknown = true // not a record: how far the log got is unknown
			return t, nil
		}
		// An unfinished record ended by the newline a later write starts
		// with, a write cut short right after it: nothing notes it yet.
		if t.torn == 0 {
			t.torn = int64(len(line))
		}
		t.tornGen = true
		end -= int64(len(line)) + 1
		tail = tail[:max(len(tail)-len(line)-1, 0)]
	}
	t.unknown = end > 0 // more unfinished lines than a few writes cut short leave
	return t, nil
}

// logNote says whether the record line is one of the log's own notes that
// precede records in the same write (OpAuditTorn, OpAuditLate). Decoded
// only when it may be one: every other line is passed over by a search.
func logNote(line []byte) bool {
	if !bytes.Contains(line, []byte(`"audit-`)) {
		return false
	}
	var r struct {
		Op string `json:"op"`
	}
	return json.Unmarshal(line, &r) == nil && (r.Op == OpAuditTorn || r.Op == OpAuditLate)
}

// auditSeq is the Seq of the i-th of a commit's n records.
func auditSeq(i, n int) string {
	return strconv.Itoa(i) + "/" + strconv.Itoa(n)
}

// moreFollow says whether the record line is one of a commit's records
// that is not its last (its Seq says i/n, i < n): a log that ends with it
// ends where a write of them was cut short, right after its newline.
// appendAuditLine writes Seq as `,"seq":"i/n"`, which no string holds
// unescaped; anything else is left to encoding/json.
func moreFollow(line []byte) bool {
	k := bytes.LastIndex(line, []byte(`,"seq":"`))
	if k < 0 {
		return false
	}
	seq, _, ok := bytes.Cut(line[k+len(`,"seq":"`):], []byte(`"`))
	if !ok {
		return false
	}
	is, ns, ok := bytes.Cut(seq, []byte("/"))
	if !ok {
		return false
	}
	i, err1 := strconv.Atoi(string(is))
	n, err2 := strconv.Atoi(string(ns))
	return err1 == nil && err2 == nil && i < n
}

// lateCut says whether tail, the end of an audit file (whole: all of it),
// which ends with a record of generation g, ends where a write appending
// g's records late was cut short, right after a newline: an OpAuditLate
// record of g before them says how many follow it, and fewer do. Records of
// older builds carry no Seq (moreFollow), and a catch-up of their journal
// records is told by this count. Only a tail that holds such a note is
// decoded; when the note is not in tail (the run is longer than what was
// read), the write is taken for whole, as before.
func lateCut(tail []byte, whole bool, g uint64) bool {
	if !bytes.Contains(tail, []byte(`"op":"audit-late"`)) {
		return false
	}
	lines := bytes.Split(bytes.TrimSuffix(tail, []byte{'\n'}), []byte{'\n'})
	if !whole {
		lines = lines[1:] // cut by where the read began
	}
	follow := 0
	for i := len(lines) - 1; i >= 0; i-- {
		var r AuditRecord
		if json.Unmarshal(lines[i], &r) != nil || r.Generation != g {
			return false
		}
		switch r.Op {
		case OpAuditLate:
			n, ok := lateCount(r.Reason)
			return ok && follow < n
		case OpAuditTorn, OpAuditLost, "":
			return false // noted already, or not a record of the commit
		}
		follow++
	}
	return false
}

// lateCount is how many records follow the OpAuditLate record whose reason
// is why, as lateAudit and lateRest write it ("the N record(s) of
// generation G that follow …", "the last N of the M record(s) …").
func lateCount(why string) (int, bool) {
	rest, ok := strings.CutPrefix(why, "the ")
	if !ok {
		return 0, false
	}
	rest = strings.TrimPrefix(rest, "last ")
	digits, _, ok := strings.Cut(rest, " ")
	if !ok {
		return 0, false
	}
	n, err := strconv.Atoi(digits)
	return n, err == nil && n > 0
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
// journal record holds and the log lacks are appended too (present says
// which the log has), never one it has: the unfinished line is none. When
// that cannot be told, none is appended, and an OpAuditLost record says the
// generation may lack records (see lateAudit).
func (a *auditLog) catchUp(l *Ledger, through uint64) {
	if !a.lastKnown || a.last > through || (a.last == through && !a.tornGen) {
		return
	}
	from := a.last + 1
	var have func([]AuditRecord) (int, bool)
	if a.tornGen {
		from, have = a.last, a.present
	}
	now, pid := l.now(), os.Getpid()
	recs := l.lateAudit(from, through, !a.none, now, pid, have)
	if len(recs) > 0 {
		l.log.Warn("ledger: appending audit records the audit log lacks (their writer stopped before it appended them)",
			"generations", fmt.Sprintf("%d-%d", from, through), "records", len(recs))
		appended := a.appended
		if err := a.write(recs, nil, false); err != nil {
			l.log.Error("ledger: could not append the audit records the audit log lacks; an audit-lost record names them",
				"generations", fmt.Sprintf("%d-%d", from, through), "error", err)
			why := fmt.Sprintf("appending them from their journal records failed (%v)", err)
			if a.appended > appended {
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
// they are appended in order, in one write, or after a cut one in a later
// write): all of them when they are there whole, or when an OpAuditLost
// record of that generation names what it lacks. The log's own notes
// (OpAuditTorn, OpAuditLate) that a later writer's write put between them,
// itself cut short perhaps, are not records of the commit. ok is false
// when what the log has of that generation is not what cut writes of them
// leave, or was not read back to its start (runOf): it is not known which
// of them the log lacks, and appending any might append one twice.
func (a *auditLog) present(recs []AuditRecord) (n int, ok bool) {
	run, whole := a.runOf(a.last)
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
	have := make([]string, 0, len(run))
	for i := range run {
		switch run[i].Op {
		case OpAuditLost:
			return len(recs), true // what the log lacks of it is named already
		case OpAuditTorn, OpAuditLate:
			continue
		}
		have = append(have, key(&run[i]))
	}
	for i := 0; i+len(want) <= len(have); i++ {
		if slices.Equal(have[i:i+len(want)], want) {
			return len(recs), true
		}
	}
	if !whole {
		return 0, false
	}
	// The cut write was appending them: the log ends with the first m.
	for m := min(len(have), len(want)-1); m > 0; m-- {
		if slices.Equal(have[len(have)-m:], want[:m]) {
			return m, true
		}
	}
	if len(have) == 0 {
		return 0, true // nothing but the log's notes: none of them
	}
	return 0, false
}

// runOf returns the records of generation g that end the log, in order, up
// to its last record (recEnd, and tailRec): the lines before it are read
// back to the first record of another generation, on into audit.log.1 when
// they go back to the start of audit.log. Lines that are not records (an
// unfinished one) are passed over. whole is false when the start of the
// run was not reached: it is longer than auditRunRead, goes back to the
// start of audit.log.1 (it may go on in the log a rotation dropped), or
// audit.log.1 could not be read; run is then its last part.
func (a *auditLog) runOf(g uint64) (run []AuditRecord, whole bool) {
	var rev []AuditRecord // the run, its last record first
	if a.tailRec != nil {
		var r AuditRecord
		if json.Unmarshal(a.tailRec, &r) == nil && r.Generation == g {
			rev = append(rev, r)
		}
	}
	done := func(whole bool) ([]AuditRecord, bool) {
		slices.Reverse(rev)
		return rev, whole
	}
	budget := int64(auditRunRead)
	end := a.recEnd
	if !a.recIn1 {
		part, found, ok, read := runBack(a.f, end, g, budget)
		rev = append(rev, part...)
		if !ok || found {
			return done(ok)
		}
		budget -= read
		end = -1 // all of audit.log.1
	}
	f, size, exists, err := openRotatedAudit(a.dir)
	if err != nil || !exists {
		// None: the run starts the log (unless it was in audit.log.1).
		return done(err == nil && !a.recIn1)
	}
	defer func() { _ = f.Close() }()
	if end < 0 {
		end = size
	}
	part, found, ok, _ := runBack(f, end, g, budget)
	rev = append(rev, part...)
	return done(ok && found)
}

// runBack reads the lines of the first end bytes of f back from the end,
// at most limit bytes, and returns the records of generation g among them,
// the last first, up to the first record of another generation (found).
// Lines that are not records are passed over. ok is false when the start of
// the run was not reached: a read failed, or the limit came first.
func runBack(f *os.File, end int64, g uint64, limit int64) (rev []AuditRecord, found, ok bool, read int64) {
	if end == 0 {
		return nil, false, true, 0
	}
	if limit <= 0 {
		return nil, false, false, 0
	}
	for n := min(end, 64<<10, limit); ; n = min(end, 8*n, limit) {
		buf, err := readTail(f, end, n)
		if err != nil {
			return nil, false, false, 0
		}
		whole := int64(len(buf)) == end
		lines := bytes.Split(bytes.TrimSuffix(buf, []byte{'\n'}), []byte{'\n'})
		if !whole {
			lines = lines[1:] // cut by where the read began
		}
		rev, found = rev[:0], false
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
			return rev, found, true, n
		}
		if n >= limit {
			return rev, false, false, n
		}
	}
}

// write appends recs in one write(2) (lines: their rendering, or nil to
// render them), after the notes of an unfinished record (OpAuditTorn) and
// of generations a catch-up lost, rotating audit.log to audit.log.1 first
// when it would grow past maxBytes (rotate). A log that ends inside a line
// gets a newline first, in the same write. With durable, the records (and a
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
	notes := a.notes(recs)
	head, err := appendAuditLines(nil, notes) // the notes, and a newline, go before lines
	if err != nil {
		return err
	}
	if a.size > 0 && a.size+int64(len(head)+len(lines)) > a.maxBytes {
		if err := a.rotate(p, durable); err != nil {
			return err
		}
		// The unfinished record went with the rotation: the note says so.
		notes = a.notes(recs)
		if head, err = appendAuditLines(nil, notes); err != nil {
			return err
		}
	}
	lead := 0
	if a.midLine {
		// Our records must not be glued to the line the file ends inside
		// (ReadAudit would take them for part of it): they start a line.
		head, lead = append([]byte{'\n'}, head...), 1
	}
	payload := lines
	if len(head) > 0 {
		payload = append(head, lines...)
	}
	// One write: appends of one write call are not interleaved with others.
	n, err := auditWrite(a.f, payload)
	a.size += int64(n)
	a.appended += int64(n)
	if err != nil {
		if n > 0 {
			// Cut short: the file ends after the last newline written,
			// inside the line after it unless the write stopped right
			// there. The notes are written once they are whole.
			written := payload[:n]
			a.torn = int64(n - 1 - bytes.LastIndexByte(written, '\n'))
			a.midLine = a.torn > 0
			if n >= len(head) {
				a.lost, a.torn1 = nil, 0
			}
			// The log's last record is the last line written whole.
			if k := bytes.Count(written[lead:], []byte{'\n'}); k > len(notes) {
				a.last, a.lastKnown, a.none = recs[min(k-len(notes), len(recs))-1].Generation, true, false
			} else if k > 0 {
				a.last, a.lastKnown, a.none = notes[k-1].Generation, true, false
			}
		}
		return fmt.Errorf("append to %s: %w", p, err)
	}
	a.torn, a.torn1, a.midLine, a.lost = 0, 0, false, nil
	a.last, a.lastKnown, a.none = recs[len(recs)-1].Generation, true, false
	if durable {
		if err := a.f.Sync(); err != nil {
			return fmt.Errorf("fsync %s: %w", p, err)
		}
	}
	return nil
}

// notes returns the notes the next write puts ahead of recs: that of the
// unfinished records it follows (OpAuditTorn), and that of the generations
// a catch-up lost (OpAuditLost, a.lost), in generation order.
//
// The audit-torn note is stamped with the generation of the log's last
// record (when it is known): a write cut right after the note's newline
// leaves the note as the log's last record, and the next writer then looks
// at that generation again, and catches up every one after it (catchUp).
// Stamped with a later one, of recs, it would make the generations
// between, of a catch-up cut short, seem appended.
func (a *auditLog) notes(recs []AuditRecord) []AuditRecord {
	var notes []AuditRecord
	if a.torn > 0 || a.torn1 > 0 {
		gen := recs[0].Generation
		if a.lost != nil {
			gen = min(gen, a.lost.Generation) // in generation order
		}
		if a.lastKnown && !a.none {
			gen = min(gen, a.last)
		}
		var where []string
		if a.torn > 0 {
			where = append(where, fmt.Sprintf("an unfinished record of %d bytes precedes this one, on a line of its own", a.torn))
		}
		if a.torn1 > 0 {
			where = append(where, fmt.Sprintf("an unfinished record of %d bytes ends %s (the log was rotated after it), "+
				"on a line of its own", a.torn1, auditRotated))
		}
		notes = append(notes, AuditRecord{Time: recs[0].Time, Op: OpAuditTorn, Generation: gen, Pid: recs[0].Pid,
			Reason: strings.Join(where, "; ") + ": its write was cut short (a writer killed while appending, or a write " +
				"that failed); it is left as it was"})
	}
	if a.lost != nil {
		notes = append(notes, *a.lost)
	}
	return notes
}

// rotate renames audit.log to audit.log.1 (replacing the one before) and
// opens a new audit.log. A log that ends inside a line gets its newline
// first, in a write(2) of its own: audit.log.1 then ends with whole lines,
// the unfinished one among them, as a reader following the log expects,
// and the next writer reads its last record back past it (tailOf) when the
// new audit.log gets none (the writes after failed). If that newline
// cannot be written, nothing is rotated. The unfinished record's note,
// written at the start of the new audit.log, says where it is (torn1).
func (a *auditLog) rotate(p string, durable bool) error {
	if a.midLine {
		n, err := auditWrite(a.f, []byte{'\n'})
		a.size += int64(n)
		if n > 0 {
			a.midLine = false
		}
		if err != nil {
			return fmt.Errorf("append to %s: %w", p, err)
		}
	}
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
	a.torn1, a.torn = a.torn, 0 // the one in the audit.log.1 replaced went with it
	if durable {
		if err := syncDir(a.dir); err != nil {
			return fmt.Errorf("rotate %s: %w", p, err)
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
