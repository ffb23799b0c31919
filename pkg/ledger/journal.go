// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"hash/crc32"
	"slices"
	"strings"
	"sync"
	"time"
)

// The journal (ledger.journal) holds the commits made since the snapshot,
// one line each, so that a commit costs one small append and one fsync
// whatever the size of the queue:
//
//	<crc32c of the JSON, 8 hex digits> <JSON>\n
//
// The first line is a journalHeader; every other line is a journalRecord
// with the generation it produced, each exactly one more than the one
// before. A record is written with one write call; a last line without its
// newline is a write that a crash interrupted: that transaction never
// committed (its caller never got an answer), so readers ignore it and the
// next writer truncates it. Any other line that does not verify is damage.

// journalFormat is the version of the journal's header and records. Journal
// 2 (with snapshot format 3) adds cordons and draining claims; a journal 1
// is read (it has neither) and replaced at the next commit, which writes a
// format 3 snapshot and a new journal first. Journal 3 adds each commit's
// audit records ("a"), so that a commit whose writer was stopped after its
// record was durable, before it appended them to audit.log, still gets them
// there (see auditLog.catchUp); a build of journal 2 would take that field
// for damage, and refuses a journal 3 as newer instead (format 4 in its
// words). A journal 2 is read (its records carry none) and replaced at the
// next commit, as a journal 1 is: records of this build are never appended
// to a journal an older build would still read. Journal 4 (with snapshot
// format 4) adds the clock anchor ("clk"), carried by the records that set
// or move it (see ClockAnchor); a journal 3 is read and replaced the same
// way.
const journalFormat = 4

// auditJournalFormat is the first journal version whose records carry
// their commit's audit records: a record of it without any had none.
const auditJournalFormat = 3

// maxJournalLine bounds one record: a commit changes a few claims and
// waiters, so a bigger line is not ours.
const maxJournalLine = 4 << 20

// castagnoli is built on first use, not at package init: building it costs
// every process that links the ledger (a hook for a container without a
// GPU never writes a journal record). hash/crc32 builds its hardware tables
// with it too, ~0.2 ms: more than checksumming a small journal takes, so
// small inputs use crc32cSmall instead.
var castagnoli = sync.OnceValue(func() *crc32.Table { return crc32.MakeTable(crc32.Castagnoli) })

// crcHardwareMin is the size of input from which hash/crc32's
// Castagnoli (hardware-assisted, after its table setup) is used.
const crcHardwareMin = 256 << 10

// crc32cTable is the byte-wise table of CRC-32C (reflected polynomial
// crc32.Castagnoli), a few microseconds to build.
var crc32cTable = sync.OnceValue(func() *[256]uint32 {
	var t [256]uint32
	for i := range t {
		c := uint32(i)
		for range 8 {
			if c&1 == 1 {
				c = c>>1 ^ crc32.Castagnoli
			} else {
				c >>= 1
			}
		}
		t[i] = c
	}
	return &t
})

// crc32cSmall is crc32.Checksum(b, castagnoli()), a byte at a time.
func crc32cSmall(b []byte) uint32 {
	t := crc32cTable()
	c := ^uint32(0)
	for _, x := range b {
		c = t[(c^uint32(x))&0xff] ^ c>>8
	}
	return ^c
}

// crc32cFunc is the checksum for input of about size bytes in all.
func crc32cFunc(size int) func([]byte) uint32 {
	if size >= crcHardwareMin {
		return func(b []byte) uint32 { return crc32.Checksum(b, castagnoli()) }
	}
	return crc32cSmall
}

// journalHeader starts a journal: the state it continues from.
type journalHeader struct {
	Journal int    `json:"journal"` // journalFormat
	Lineage string `json:"lineage"`
	BootID  string `json:"boot_id"`
	// Base is the generation of the snapshot the journal continues.
	Base uint64 `json:"base"`
	// Genesis: the base state is empty (a fresh start), so the journal can
	// be replayed without any snapshot. BaseNextSeq is its next_seq.
	Genesis     bool   `json:"genesis,omitempty"`
	BaseNextSeq uint64 `json:"base_next_seq,omitempty"`
	// BaseClock is the clock anchor of a genesis base that has one (an
	// empty state compacted keeps its anchor): the base replays whole.
	BaseClock *ClockAnchor `json:"base_clock,omitempty"`
}

// genesisBase is the empty state a genesis journal continues.
func (h *journalHeader) genesisBase() State {
	st := State{Generation: h.Base, NextSeq: h.BaseNextSeq, BootID: h.BootID, Lineage: h.Lineage}
	if h.BaseClock != nil {
		st.Clock = *h.BaseClock
	}
	return st
}

// journalRecord is one commit: what changed, by identity (claims and
// reservations by device UUID, waiters by key); conflicts, few and rare,
// are written whole when they changed.
type journalRecord struct {
	Gen          uint64        `json:"g"`
	Time         time.Time     `json:"t"`
	NextSeq      uint64        `json:"seq"`
	Claims       []Claim       `json:"c,omitempty"`
	ClaimsGone   []string      `json:"dc,omitempty"`
	Reservations []Reservation `json:"r,omitempty"`
	ResGone      []string      `json:"dr,omitempty"`
	Waiters      []Waiter      `json:"w,omitempty"`
	WaitersGone  []string      `json:"dw,omitempty"`
	Conflicts    *[]Conflict   `json:"x,omitempty"`
	Cordons      []Cordon      `json:"k,omitempty"`
	CordonsGone  []string      `json:"dk,omitempty"`
	// Clock is the state's clock anchor, in the records that change it
	// only: the first commit of a state (or of one without an anchor) and
	// a commit that found the wall clock stepped.
	Clock *ClockAnchor `json:"clk,omitempty"`
	// Audit is the commit's audit records as audit.log gets them (the
	// same objects, as a JSON list; see journalAudit), for the next writer
	// to append should this commit's writer stop before it does. Replay
	// never decodes it.
	Audit json.RawMessage `json:"a,omitempty"`
}

// appendJournalLine frames one JSON value as a journal line.
func appendJournalLine(b []byte, v any) ([]byte, error) {
	js, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	return frameLine(b, func(b []byte) ([]byte, error) { return append(b, js...), nil })
}

// journalLines splits data (read from offset base of the file) into its
// complete lines, verifying each line's checksum. It returns the JSON of
// every line, the file offset just after each, and where the torn tail (a
// last line without a newline) starts, or -1 if none. A line that does not
// verify is damage: an error wrapping ErrCorrupt naming its offset, returned
// with the lines before it (recovery keeps those; every other reader fails).
func journalLines(data []byte, base int64) (lines [][]byte, ends []int64, torn int64, err error) {
	torn = -1
	off := 0
	sum := crc32cFunc(len(data))
	for off < len(data) {
		nl := bytes.IndexByte(data[off:], '\n')
		if nl < 0 {
			torn = base + int64(off)
			break
		}
		line := data[off : off+nl]
		if len(line) > maxJournalLine {
			return lines, ends, -1, badState("journal line at offset %d is %d bytes, more than %d", base+int64(off), len(line), maxJournalLine)
		}
		if len(line) < 10 || line[8] != ' ' {
			return lines, ends, -1, badState("journal line at offset %d is not a record", base+int64(off))
		}
		var crc [4]byte
		if _, herr := hex.Decode(crc[:], line[:8]); herr != nil {
			return lines, ends, -1, badState("journal line at offset %d has no checksum", base+int64(off))
		}
		want := binary.BigEndian.Uint32(crc[:])
		if got := sum(line[9:]); got != want {
			return lines, ends, -1, badState("journal line at offset %d: checksum mismatch (damaged)", base+int64(off))
		}
		lines = append(lines, line[9:])
		off += nl + 1
		ends = append(ends, base+int64(off))
	}
	return lines, ends, torn, nil
}

func decodeHeader(line []byte) (journalHeader, error) {
	h, ok := fastDecodeHeader(line)
	if !ok {
		// The format number first, as peekFormat does for a snapshot: a
		// newer build's header may carry fields this one does not know,
		// and must read as newer (left alone), not as damage (which
		// recovery moves aside, dropping the newer build's commits).
		var v struct {
			Journal int `json:"journal"`
		}
		if json.Unmarshal(line, &v) == nil && v.Journal > journalFormat {
			return h, &FormatError{Version: FormatVersion + v.Journal - journalFormat, Supported: FormatVersion}
		}
		if err := decodeStrict(line, &h); err != nil {
			return h, badState("journal header does not decode: %v", err)
		}
	}
	if h.Journal > journalFormat {
		return h, &FormatError{Version: FormatVersion + h.Journal - journalFormat, Supported: FormatVersion}
	}
	if h.Journal < 1 || h.Lineage == "" {
		return h, badState("journal header is not valid (journal %d, lineage %q)", h.Journal, truncate(h.Lineage, 64))
	}
	return h, nil
}

// decodeRecord decodes one journal record (a copy of every string).
func decodeRecord(line []byte, at int64) (journalRecord, error) {
	return decodeRecordOf(line, at, false)
}

// decodeRecordOf is decodeRecord; owned is fastDecodeRecordOf's.
func decodeRecordOf(line []byte, at int64, owned bool) (journalRecord, error) {
	if r, ok := fastDecodeRecordOf(line, owned); ok {
		return r, nil
	}
	// Not exactly as json.Marshal writes it: encoding/json decides.
	var r journalRecord
	if err := decodeStrict(line, &r); err != nil {
		return r, badState("journal record ending at offset %d does not decode: %v", at, err)
	}
	return r, nil
}

// recordOf is the journal record that turns base into st (st.Generation
// already the new one): claims and reservations compared by device UUID
// (both lists are sorted by it), the waiters touched by the Tx, the
// conflicts whole if they changed.
func recordOf(base, st *State, touched []string) journalRecord {
	r := journalRecord{Gen: st.Generation, Time: st.UpdatedAt, NextSeq: st.NextSeq}
	r.Claims, r.ClaimsGone = diffByUUID(base.Claims, st.Claims, func(c *Claim) string { return c.Device.UUID }, sameClaim)
	r.Reservations, r.ResGone = diffByUUID(base.Reservations, st.Reservations, func(x *Reservation) string { return x.Device.UUID }, sameReservation)
	r.Cordons, r.CordonsGone = diffByUUID(base.Cordons, st.Cordons, func(k *Cordon) string { return k.Device.UUID }, sameCordon)
	if !slices.EqualFunc(base.Conflicts, st.Conflicts, sameConflict) {
		x := slices.Clone(st.Conflicts)
		if x == nil {
			x = []Conflict{}
		}
		r.Conflicts = &x
	}
	if !sameAnchor(&base.Clock, &st.Clock) {
		a := st.Clock
		r.Clock = &a
	}
	if len(touched) > 0 {
		find := waiterFinder(st.Waiters, len(touched))
		seen := make(map[string]bool, len(touched))
		for _, k := range touched {
			if seen[k] {
				continue
			}
			seen[k] = true
			if i := find(k); i >= 0 {
				r.Waiters = append(r.Waiters, st.Waiters[i])
			} else {
				r.WaitersGone = append(r.WaitersGone, k)
			}
		}
	}
	return r
}

// waiterFinder returns a lookup of a waiter's index by key: a scan for a
// few lookups, a map for many.
func waiterFinder(ws []Waiter, lookups int) func(string) int {
	if lookups <= 8 {
		return func(k string) int {
			for i := range ws {
				if ws[i].Key == k {
					return i
				}
			}
			return -1
		}
	}
	m := make(map[string]int, len(ws))
	for i := range ws {
		m[ws[i].Key] = i
	}
	return func(k string) int {
		if i, ok := m[k]; ok {
			return i
		}
		return -1
	}
}

// diffByUUID lists the elements of b that are new or changed against a, and
// the UUIDs of a that b no longer has; both are sorted by UUID.
func diffByUUID[T any](a, b []T, uuid func(*T) string, same func(*T, *T) bool) (upserts []T, gone []string) {
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		switch {
		case j == len(b) || (i < len(a) && uuid(&a[i]) < uuid(&b[j])):
			gone = append(gone, uuid(&a[i]))
			i++
		case i == len(a) || uuid(&b[j]) < uuid(&a[i]):
			upserts = append(upserts, b[j])
			j++
		default:
			if !same(&a[i], &b[j]) {
				upserts = append(upserts, b[j])
			}
			i++
			j++
		}
	}
	return upserts, gone
}

func sameOwner(a, b *Owner) bool {
	return a.ContainerID == b.ContainerID && a.Container == b.Container && a.Namespace == b.Namespace &&
		a.Pod == b.Pod && a.PodUID == b.PodUID && a.PodSandboxID == b.PodSandboxID && a.FrontEnd == b.FrontEnd &&
		a.Pid == b.Pid && a.PidStart == b.PidStart && a.Cgroup == b.Cgroup &&
		a.StartedAt.Equal(b.StartedAt) && a.StoppedAt.Equal(b.StoppedAt) && a.DrainingSince.Equal(b.DrainingSince)
}

func sameAnchor(a, b *ClockAnchor) bool { return a.Wall.Equal(b.Wall) && a.Boot == b.Boot }

func sameCordon(a, b *Cordon) bool {
	return a.Device == b.Device && a.Source == b.Source && a.Reason == b.Reason && a.By == b.By && a.Since.Equal(b.Since)
}

func sameClaim(a, b *Claim) bool {
	return a.Device == b.Device && a.Source == b.Source && a.Since.Equal(b.Since) && sameOwner(&a.Owner, &b.Owner)
}

func sameReservation(a, b *Reservation) bool {
	return a.Device == b.Device && a.For == b.For && a.Since.Equal(b.Since) && a.Until.Equal(b.Until)
}

func sameConflict(a, b Conflict) bool {
	return a.Device == b.Device && a.Since.Equal(b.Since) && sameOwner(&a.Owner, &b.Owner)
}

// applyRecords applies journal records, in order, to st, which the caller
// owns (its slices are replaced, never written in place). Each record must
// carry the next generation. The result is validated.
func applyRecords(st *State, recs []journalRecord) error {
	if len(recs) == 0 {
		return nil
	}
	waiterOps := 0
	for i := range recs {
		waiterOps += len(recs[i].Waiters) + len(recs[i].WaitersGone)
	}
	ws := waiterSet{ws: st.Waiters}
	if waiterOps > 0 {
		// Copy on write: st.Waiters may be shared with a cached state.
		ws.ws = slices.Clone(st.Waiters)
	}
	if waiterOps > 8 {
		ws.index()
	}
	st.Claims = slices.Clone(st.Claims)
	st.Reservations = slices.Clone(st.Reservations)
	for i := range recs {
		r := &recs[i]
		if r.Gen != st.Generation+1 {
			return badState("journal record of generation %d follows generation %d (a record is missing)", r.Gen, st.Generation)
		}
		for _, u := range r.ClaimsGone {
			st.Claims = deleteByUUID(st.Claims, u, func(c Claim) string { return c.Device.UUID })
		}
		for _, c := range r.Claims {
			st.Claims = upsertByUUID(st.Claims, c, func(c Claim) string { return c.Device.UUID })
		}
		for _, u := range r.ResGone {
			st.Reservations = deleteByUUID(st.Reservations, u, func(x Reservation) string { return x.Device.UUID })
		}
		for _, x := range r.Reservations {
			st.Reservations = upsertByUUID(st.Reservations, x, func(x Reservation) string { return x.Device.UUID })
		}
		if r.Conflicts != nil {
			st.Conflicts = slices.Clone(*r.Conflicts)
		}
		if len(r.Cordons) > 0 || len(r.CordonsGone) > 0 {
			st.Cordons = applyCordons(st.Cordons, r.Cordons, r.CordonsGone)
		}
		if r.Clock != nil {
			st.Clock = *r.Clock
		}
		for _, k := range r.WaitersGone {
			ws.remove(k)
		}
		for _, w := range r.Waiters {
			ws.upsert(w)
		}
		st.Generation, st.UpdatedAt, st.NextSeq = r.Gen, r.Time, r.NextSeq
	}
	if waiterOps > 0 {
		st.Waiters = ws.result()
	}
	if err := validate(st, waiterOps > 0); err != nil {
		return badState("the journal leads to a state that violates an invariant: %v", err)
	}
	return nil
}

func deleteByUUID[T any](s []T, u string, uuid func(T) string) []T {
	i, found := slices.BinarySearchFunc(s, u, func(e T, u string) int { return strings.Compare(uuid(e), u) })
	if !found {
		return s
	}
	return slices.Delete(s, i, i+1)
}

// waiterSet applies waiter changes: removals leave holes, filled in once at
// the end, so a replay of many records costs O(waiters + changes), not
// O(waiters × changes).
type waiterSet struct {
	ws    []Waiter
	dead  []bool
	idx   map[string]int
	holes int
}

func (s *waiterSet) index() {
	s.idx = make(map[string]int, len(s.ws))
	for i := range s.ws {
		s.idx[s.ws[i].Key] = i
	}
}

func (s *waiterSet) find(k string) int {
	if s.idx != nil {
		if i, ok := s.idx[k]; ok {
			return i
		}
		return -1
	}
	for i := range s.ws {
		if s.ws[i].Key == k && (s.dead == nil || !s.dead[i]) {
			return i
		}
	}
	return -1
}

func (s *waiterSet) remove(k string) {
	i := s.find(k)
	if i < 0 {
		return
	}
	if s.dead == nil {
		s.dead = make([]bool, len(s.ws), cap(s.ws))
	}
	s.dead[i] = true
	s.holes++
	if s.idx != nil {
		delete(s.idx, k)
	}
}

func (s *waiterSet) upsert(w Waiter) {
	if i := s.find(w.Key); i >= 0 {
		if s.ws[i].Seq == w.Seq {
			s.ws[i] = w
			return
		}
		s.remove(w.Key) // queued again: a new arrival number, at the tail
	}
	s.ws = append(s.ws, w)
	if s.dead != nil {
		s.dead = append(s.dead, false)
	}
	if s.idx != nil {
		s.idx[w.Key] = len(s.ws) - 1
	}
}

func (s *waiterSet) result() []Waiter {
	out := s.ws
	if s.holes > 0 {
		out = make([]Waiter, 0, len(s.ws)-s.holes)
		for i := range s.ws {
			if !s.dead[i] {
				out = append(out, s.ws[i])
			}
		}
	}
	// Arrival numbers only grow, so appends keep the order; a replay of a
	// damaged or hand-made journal is still sorted here and validated.
	if !slices.IsSortedFunc(out, func(a, b Waiter) int { return cmpUint(a.Seq, b.Seq) }) {
		slices.SortFunc(out, func(a, b Waiter) int { return cmpUint(a.Seq, b.Seq) })
	}
	if len(out) == 0 {
		return nil
	}
	return out
}
