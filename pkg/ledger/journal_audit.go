// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"encoding/json"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"
	"unicode/utf16"
	"unicode/utf8"
)

// A commit's audit records travel in its journal record ("a"), so that they
// are as durable as the commit: a writer stopped between its journal record
// and its append to audit.log (a SIGKILL, an append that failed) leaves
// them there, and the next writer appends them late (auditLog.catchUp,
// lateAudit). They are the same JSON objects audit.log gets, rendered once.

// maxJournalAudit bounds the audit records one journal record carries. A
// commit that drops thousands of waiters at once writes a record for each,
// and the journal line must stay well under maxJournalLine; past the bound
// the list ends with a record that says what was left out.
const maxJournalAudit = 1 << 20

// journalAudit renders the audit lines of a commit (lines: one line for
// each record of recs, as appendAuditLine writes them) as the list its
// journal record carries, into buf.
func journalAudit(buf []byte, recs []AuditRecord, lines []byte) ([]byte, error) {
	buf = buf[:0]
	if len(recs) == 0 {
		return buf, nil
	}
	body := lines
	if len(lines) > maxJournalAudit {
		cut := bytes.LastIndexByte(lines[:maxJournalAudit], '\n') + 1
		left := recs[bytes.Count(lines[:cut], []byte{'\n'}):]
		note := AuditRecord{Time: recs[0].Time, Op: OpAuditLost, Generation: recs[0].Generation, Pid: recs[0].Pid,
			Reason: fmt.Sprintf("%d more audit record(s) of this commit (%s) were left out of its journal record, which holds %d bytes of them at most",
				len(left), opCounts(left), maxJournalAudit)}
		var err error
		// A copy: lines is what audit.log gets, whole.
		if body, err = appendAuditLine(lines[:cut:cut], &note); err != nil {
			return buf, err
		}
	}
	buf = append(buf, '[')
	buf = append(buf, body...)
	// Every line ends in a newline, and none has one inside (JSON escapes
	// it in a string): the newlines become the list's commas, the last its
	// closing bracket.
	for i := 1; ; {
		j := bytes.IndexByte(buf[i:], '\n')
		if j < 0 {
			break
		}
		buf[i+j] = ','
		i += j + 1
	}
	buf[len(buf)-1] = ']'
	return buf, nil
}

// opCounts summarises the ops of recs, in order of first appearance:
// "expired ×4000, dequeue ×2".
func opCounts(recs []AuditRecord) string {
	var ops []string
	n := map[string]int{}
	for _, r := range recs {
		if n[r.Op] == 0 {
			ops = append(ops, r.Op)
		}
		n[r.Op]++
	}
	parts := make([]string, len(ops))
	for i, op := range ops {
		parts[i] = fmt.Sprintf("%s ×%d", op, n[op])
	}
	return strings.Join(parts, ", ")
}

// auditList passes over a journal record's audit records ("a"): a JSON list
// of objects whose values are strings, integers or lists of strings, which
// is what appendAuditLine writes. Replay never needs them (a late append
// does, and decodes them then: lateAudit), so nothing is decoded here. The
// list is checked to be such JSON (anything else is left to encoding/json,
// which decides) and handed out as encoding/json hands out a
// json.RawMessage, its bytes: a slice of b when the caller owns b (see
// fastDecodeRecordOf), a copy otherwise.
func (d *fastDecoder) auditList(owned bool) json.RawMessage {
	start := d.i
	d.lit("[")
	if d.opt("]") {
		return d.rawSince(start, owned)
	}
	for !d.bad {
		d.lit("{")
		for !d.bad {
			d.skipString() // the key
			d.lit(":")
			switch {
			case d.i < len(d.b) && d.b[d.i] == '"':
				d.skipString()
			case d.opt("["):
				for !d.bad && !d.opt("]") {
					d.skipString()
					if d.opt("]") {
						break
					}
					d.lit(",")
				}
			default:
				d.opt("-")
				d.uint()
			}
			if d.opt("}") {
				break
			}
			d.lit(",")
		}
		if d.opt("]") {
			break
		}
		d.lit(",")
	}
	return d.rawSince(start, owned)
}

// rawSince is the input from start to here (nil once it is bad): a slice
// of b capped at its length, or a copy.
func (d *fastDecoder) rawSince(start int, owned bool) json.RawMessage {
	if d.bad {
		return nil
	}
	if owned {
		return d.b[start:d.i:d.i]
	}
	return bytes.Clone(d.b[start:d.i])
}

// skipString passes over a JSON string, accepting what raw accepts, without
// keeping it (and so without the copy raw makes of a string with escapes).
func (d *fastDecoder) skipString() {
	d.lit(`"`)
	if d.bad {
		return
	}
	start, ascii := d.i, true
	for {
		d.skipPlain()
		if d.i >= len(d.b) {
			d.bad = true
			return
		}
		switch c := d.b[d.i]; {
		case c == '"':
			if !ascii && !utf8.Valid(d.b[start:d.i]) {
				d.bad = true // encoding/json replaces invalid bytes: let it
			}
			d.i++
			return
		case c == '\\':
			if !d.skipEscape() {
				d.bad = true
				return
			}
		case c < 0x20:
			d.bad = true
			return
		default:
			if c >= utf8.RuneSelf {
				ascii = false
			}
			d.i++
		}
	}
}

// skipEscape passes over the escape at d.i, one of those unescape decodes.
func (d *fastDecoder) skipEscape() bool {
	if d.i+1 >= len(d.b) {
		return false
	}
	switch d.b[d.i+1] {
	case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
		d.i += 2
		return true
	case 'u':
		if d.i+6 > len(d.b) {
			return false
		}
		r, ok := hexRune(d.b[d.i+2 : d.i+6])
		if !ok {
			return false
		}
		d.i += 6
		return !utf16.IsSurrogate(r)
	}
	return false
}

// journaledAudit is what the journals say of one commit's audit records.
type journaledAudit struct {
	recs []AuditRecord
	// known: the record is of a journal that carries audit records
	// (auditJournalFormat) and they decoded; recs is then all of them,
	// none if the commit wrote none.
	known bool
}

// lateAudit returns the records audit.log must get for generations
// from..through, none of which it has (see auditLog.catchUp), from the
// journals (ledger.journal and ledger.journal.prev, which between them hold
// every commit since the compaction before the last): for each commit
// found, a record OpAuditLate stamped with its generation and this writer's
// pid, then the commit's own records as its writer would have appended
// them; for the generations no journal holds any more (compacted away twice
// since, written by a build before journal 3, or a state a recovery or
// reset wrote whole, which is no record), one OpAuditLost record for each
// run of them, stamped with its last generation (unless !reportLost).
// Generations keep counting
// up across lineages and boots, so a generation names one commit of the
// state dir.
//
// With have, the log may have some of generation from's records already (a
// write of them was cut short): have says how many of them, a prefix, and
// only the rest are appended, if any (lateRest).
func (l *Ledger) lateAudit(from, through uint64, reportLost bool, now time.Time, pid int,
	have func([]AuditRecord) (int, bool)) []AuditRecord {
	found := map[uint64]journaledAudit{}
	for _, name := range []string{journalPrevName, journalName} { // the newer file last: it decides
		l.readJournaledAudit(filepath.Join(l.dir, name), from, through, found)
	}
	gens := make([]uint64, 0, len(found))
	for g := range found {
		gens = append(gens, g)
	}
	slices.Sort(gens)
	var out []AuditRecord
	lostFrom := uint64(0) // first generation of the run of lost ones, 0 = none
	lost := func(lo uint64) {
		if lostFrom == 0 {
			lostFrom = lo
		}
	}
	flush := func(upTo uint64) {
		if lostFrom == 0 {
			return
		}
		if reportLost {
			out = append(out, lostNote(lostFrom, upTo, now, pid, "no journal holds them: the process that committed them "+
				"stopped before it appended them, or the log lost them (removed, cut by a power cut), and the journal "+
				"records were compacted away since, written by an older build, or never existed (a state a recovery or "+
				"reset wrote whole); what they changed is in the state (gpu-guard-ctl status)"))
		}
		lostFrom = 0
	}
	next := from
	if have != nil {
		out = lateRest(out, from, found[from], have, now, pid)
		next = from + 1
	}
	for _, g := range gens {
		if g < next {
			continue // from, with have
		}
		if g > next {
			lost(next)
		}
		a := found[g]
		switch {
		case !a.known:
			lost(g)
		case len(a.recs) > 0:
			flush(g - 1)
			out = append(out, AuditRecord{Time: now, Op: OpAuditLate, Generation: g, Pid: pid, Reason: fmt.Sprintf(
				"the %d record(s) of generation %d that follow are appended late, from its journal record: the process that "+
					"committed it (pid %d) stopped before it appended them (killed, or its append failed)", len(a.recs), g, a.recs[0].Pid)})
			out = append(out, a.recs...)
		default:
			// A commit without audit records: nothing is missing. A run
			// of lost generations still ends at the one before it.
			flush(g - 1)
		}
		next = g + 1
	}
	if next <= through {
		lost(next)
	}
	flush(through)
	return out
}

// lateRest appends to out what the log gets of generation g, whose records
// a write cut short may have been appending (auditLog.catchUp), from a,
// what the journals say of it: those of its records the log lacks (have says
// how many it has, a prefix), after an OpAuditLate record. When that cannot
// be told (have is not sure, or no journal holds its records any more), it
// is not known which the log lacks, and appending any might append one
// twice: an OpAuditLost record says the generation may lack records.
// Generation 0 is no commit's.
func lateRest(out []AuditRecord, g uint64, a journaledAudit, have func([]AuditRecord) (int, bool), now time.Time, pid int) []AuditRecord {
	mayLack := func(why string) []AuditRecord {
		return append(out, AuditRecord{Time: now, Op: OpAuditLost, Generation: g, Pid: pid, Reason: fmt.Sprintf(
			"generation %d may lack records: a write that may have been appending them was cut short (the log ended "+
				"inside a line, or right after a note that goes ahead of records), and %s, so none of them is appended "+
				"again (none is appended twice); what it changed is in the state (gpu-guard-ctl status)", g, why)})
	}
	switch {
	case g == 0 || a.known && len(a.recs) == 0:
		return out // no commit, or one without records: nothing is missing
	case !a.known:
		return mayLack("no journal holds its records any more (compacted away since, written by an older build, or " +
			"a state a recovery or reset wrote whole), so which of them the log lacks is not known")
	}
	m, ok := have(a.recs)
	switch {
	case !ok:
		return mayLack(fmt.Sprintf("what the log has of that generation is not a part of the %d record(s) its journal "+
			"record holds that a cut write of them leaves, or could not be read back to its start, so which of them "+
			"the log lacks is not known", len(a.recs)))
	case m >= len(a.recs):
		return out
	}
	rest := a.recs[m:]
	which := fmt.Sprintf("the %d record(s) of generation %d that follow are", len(rest), g)
	if m > 0 {
		which = fmt.Sprintf("the last %d of the %d record(s) of generation %d follow,", len(rest), len(a.recs), g)
	}
	out = append(out, AuditRecord{Time: now, Op: OpAuditLate, Generation: g, Pid: pid, Reason: fmt.Sprintf(
		"%s appended late, from its journal record: the write that was appending them (its committer's, "+
			"pid %d, or a later writer's) was cut short, at the unfinished line above", which, a.recs[0].Pid)})
	return append(out, rest...)
}

// lostNote is the record of generations lo..hi whose audit records
// audit.log will not get; why says why.
func lostNote(lo, hi uint64, now time.Time, pid int, why string) AuditRecord {
	which := fmt.Sprintf("generation %d", lo)
	if hi > lo {
		which = fmt.Sprintf("generations %d to %d", lo, hi)
	}
	return AuditRecord{Time: now, Op: OpAuditLost, Generation: hi, Pid: pid,
		Reason: fmt.Sprintf("the audit log has no record of %s, and %s", which, why)}
}

// readJournaledAudit adds to found what the journal at p says of the
// audit records of generations from..through. It reads as Recover does: a
// journal that cannot be read says nothing, a damaged one what precedes
// the damage.
func (l *Ledger) readJournaledAudit(p string, from, through uint64, found map[uint64]journaledAudit) {
	f, fi, exists, err := openRegular(p, false)
	if err != nil || !exists {
		return
	}
	defer func() { _ = f.Close() }()
	data, err := readFrom(f, 0, fi.Size(), maxStateBytes, nil)
	if err != nil {
		return
	}
	lines, ends, _, _ := journalLines(data, 0) // the lines before any damage
	if len(lines) < 2 {
		return
	}
	hdr, err := decodeHeader(lines[0])
	if err != nil {
		return
	}
	for k := 1; k < len(lines); k++ {
		d := fastDecoder{b: lines[k]}
		d.lit(`{"g":`)
		if g := d.uint(); !d.bad && (g < from || g > through) {
			continue // decoded only when it may be needed
		}
		r, err := decodeRecord(lines[k], ends[k])
		if err != nil || r.Gen < from || r.Gen > through {
			continue
		}
		a := journaledAudit{known: hdr.Journal >= auditJournalFormat}
		if a.known && len(r.Audit) > 0 {
			if err := json.Unmarshal(r.Audit, &a.recs); err != nil {
				a = journaledAudit{}
			}
		}
		found[r.Gen] = a
	}
}
