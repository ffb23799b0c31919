// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"encoding/binary"
	"encoding/hex"
	"strconv"
	"time"
)

// Hand-written encoders for what every commit writes besides the state: its
// journal record, the boot marker and the audit records, and a decoder for
// the marker and the journal header, which every cold reader reads. Each
// hook that claims or releases a GPU is a process of its own, and
// encoding/json builds its reflection tables for every type on first use in
// each process: more CPU than the encoding itself. Every value is rendered
// byte-for-byte as encoding/json renders it (TestLineEncodersMatchEncodingJSON),
// and every decoder (fastDecoder, decode.go) falls back to encoding/json for
// anything but exactly that.

// appendRecordLine frames r as a journal line, as appendJournalLine(b, r)
// does. Times are written in UTC, as the snapshot writes them (the ledger's
// own are UTC already).
func appendRecordLine(b []byte, r *journalRecord) ([]byte, error) {
	return frameLine(b, func(b []byte) ([]byte, error) { return appendRecordJSON(b, r) })
}

// frameLine appends one journal line: the checksum of the JSON body writes
// as 8 hex digits, a space, the JSON, a newline. The body is written in
// place, after room left for the checksum.
func frameLine(b []byte, body func([]byte) ([]byte, error)) ([]byte, error) {
	start := len(b)
	b = append(b, "00000000 "...)
	b, err := body(b)
	if err != nil {
		return nil, err
	}
	js := b[start+9:]
	var crc [4]byte
	binary.BigEndian.PutUint32(crc[:], crc32cFunc(len(js))(js))
	hex.Encode(b[start:start+8], crc[:])
	return append(b, '\n'), nil
}

func appendRecordJSON(b []byte, r *journalRecord) ([]byte, error) {
	b = append(b, `{"g":`...)
	b = strconv.AppendUint(b, r.Gen, 10)
	b = append(b, `,"t":`...)
	b, err := appendTime(b, r.Time)
	if err != nil {
		return nil, err
	}
	b = append(b, `,"seq":`...)
	b = strconv.AppendUint(b, r.NextSeq, 10)
	if len(r.Claims) > 0 {
		b = append(b, `,"c":`...)
		if b, err = appendList(b, r.Claims, appendClaim); err != nil {
			return nil, err
		}
	}
	b = appendOptStrings(b, `,"dc":`, r.ClaimsGone)
	if len(r.Reservations) > 0 {
		b = append(b, `,"r":`...)
		if b, err = appendList(b, r.Reservations, appendReservation); err != nil {
			return nil, err
		}
	}
	b = appendOptStrings(b, `,"dr":`, r.ResGone)
	if len(r.Waiters) > 0 {
		b = append(b, `,"w":`...)
		if b, err = appendList(b, r.Waiters, appendWaiter); err != nil {
			return nil, err
		}
	}
	b = appendOptStrings(b, `,"dw":`, r.WaitersGone)
	if r.Conflicts != nil {
		b = append(b, `,"x":`...)
		if b, err = appendList(b, *r.Conflicts, appendConflict); err != nil {
			return nil, err
		}
	}
	if len(r.Cordons) > 0 {
		b = append(b, `,"k":`...)
		if b, err = appendList(b, r.Cordons, appendCordon); err != nil {
			return nil, err
		}
	}
	b = appendOptStrings(b, `,"dk":`, r.CordonsGone)
	if r.Clock != nil {
		b = append(b, `,"clk":`...)
		if b, err = appendClockAnchor(b, r.Clock); err != nil {
			return nil, err
		}
	}
	if len(r.Audit) > 0 {
		// Compact JSON already (journalAudit), which json.Marshal keeps as is.
		b = append(b, `,"a":`...)
		b = append(b, r.Audit...)
	}
	return append(b, '}'), nil
}

// appendOptStrings writes key and the list, unless it is empty (omitempty).
func appendOptStrings(b []byte, key string, ss []string) []byte {
	if len(ss) == 0 {
		return b
	}
	b = append(b, key...)
	return appendStrings(b, ss)
}

func appendStrings(b []byte, ss []string) []byte {
	b = append(b, '[')
	for i, s := range ss {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendString(b, s)
	}
	return append(b, ']')
}

// appendMarkerLine frames m as a journal line, as appendJournalLine(b, m)
// does.
func appendMarkerLine(b []byte, m *marker) []byte {
	b, _ = frameLine(b, func(b []byte) ([]byte, error) {
		b = append(b, `{"dir":`...)
		b = appendString(b, m.Dir)
		b = append(b, `,"boot_id":`...)
		b = appendString(b, m.BootID)
		b = append(b, `,"lineage":`...)
		b = appendString(b, m.Lineage)
		b = append(b, `,"generation":`...)
		b = strconv.AppendUint(b, m.Generation, 10)
		return append(b, '}'), nil
	})
	return b
}

// appendAuditLine renders r as json.Encoder.Encode does: one JSON line.
func appendAuditLine(b []byte, r *AuditRecord) ([]byte, error) {
	b = append(b, `{"time":`...)
	b, err := appendTimeJSON(b, r.Time)
	if err != nil {
		return nil, err
	}
	b = append(b, `,"op":`...)
	b = appendString(b, r.Op)
	b = appendOptStrings(b, `,"devices":`, r.Devices)
	b = appendOptString(b, `,"container_id":`, r.ContainerID)
	b = appendOptString(b, `,"key":`, r.Key)
	b = appendOptString(b, `,"namespace":`, r.Namespace)
	b = appendOptString(b, `,"pod":`, r.Pod)
	b = appendOptString(b, `,"container":`, r.Container)
	b = appendOptString(b, `,"front_end":`, r.FrontEnd)
	b = appendOptString(b, `,"reason":`, r.Reason)
	b = appendOptString(b, `,"seq":`, r.Seq)
	b = append(b, `,"generation":`...)
	b = strconv.AppendUint(b, r.Generation, 10)
	b = append(b, `,"pid":`...)
	b = strconv.AppendInt(b, int64(r.Pid), 10)
	return append(b, "}\n"...), nil
}

// appendTimeJSON writes t exactly as time.Time's MarshalJSON does: in its
// own location (an audit record keeps the zone its writer gave it).
func appendTimeJSON(b []byte, t time.Time) ([]byte, error) {
	if t.Location() == time.UTC {
		if y := t.Year(); y >= 0 && y <= 9999 {
			b = append(b, '"')
			b = t.AppendFormat(b, time.RFC3339Nano)
			return append(b, '"'), nil
		}
	}
	js, err := t.MarshalJSON()
	if err != nil {
		return nil, err
	}
	return append(b, js...), nil
}

// fastDecodeMarker decodes a marker exactly as appendMarkerLine writes it.
func fastDecodeMarker(b []byte) (marker, bool) {
	s := fastDecoder{b: b}
	var m marker
	s.lit(`{"dir":`)
	m.Dir = s.str()
	s.lit(`,"boot_id":`)
	m.BootID = s.str()
	s.lit(`,"lineage":`)
	m.Lineage = s.str()
	s.lit(`,"generation":`)
	m.Generation = s.uint()
	if !s.end() {
		return marker{}, false
	}
	return m, true
}

// fastDecodeHeader decodes a journal header exactly as json.Marshal writes
// it.
func fastDecodeHeader(b []byte) (journalHeader, bool) {
	s := fastDecoder{b: b}
	var h journalHeader
	s.lit(`{"journal":`)
	j := s.uint()
	if j > 1<<31 {
		return h, false
	}
	h.Journal = int(j)
	s.lit(`,"lineage":`)
	h.Lineage = s.str()
	s.lit(`,"boot_id":`)
	h.BootID = s.str()
	s.lit(`,"base":`)
	h.Base = s.uint()
	h.Genesis = s.opt(`,"genesis":true`)
	if s.opt(`,"base_next_seq":`) {
		h.BaseNextSeq = s.uint()
		if h.BaseNextSeq == 0 {
			return journalHeader{}, false // omitempty never writes 0
		}
	}
	if s.opt(`,"base_clock":`) {
		h.BaseClock = new(ClockAnchor)
		s.clockAnchor(h.BaseClock)
	}
	if !s.end() {
		return journalHeader{}, false
	}
	return h, true
}
