// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"crypto/sha256"
	"fmt"
	"hash"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// A hand-written encoder for State. Every mutation re-encodes the whole state
// (hundreds of waiters on a busy host) while holding the host-wide lock, and
// encoding/json spends most of that time on reflection and time formatting.
// Each value is rendered byte-for-byte as encoding/json renders it
// (TestEncoderMatchesEncodingJSON holds it to that), so the file is plain JSON
// that encoding/json decodes. Only the order of State's fields differs: the
// queue comes first (see encoder).

// encoder renders state files for one Ledger (used under its lock). It
// remembers the encoded queue of the last state it rendered, and the sha256
// state after hashing it: a Tx that leaves the queue alone hands on the very
// same Waiters array (copy-on-write, never modified in place), and encoding
// and hashing hundreds of waiters is most of a commit's CPU time. That is why
// the queue is the first field of the state body: the checksum's prefix is
// then reusable.
type encoder struct {
	out         [2][]byte // file buffers, used in turn (see encode)
	waiters     []Waiter  // the queue last encoded ...
	waitersJSON []byte    // ... `{"waiters":[...]` ...
	waitersHash hash.Hash // ... and sha256 after writing waitersJSON
}

// sameArray reports whether a and b are the same slice of the same array.
func sameArray(a, b []Waiter) bool {
	return len(a) == len(b) && (a == nil) == (b == nil) && (len(a) == 0 || &a[0] == &b[0])
}

// appendStateJSON renders the state body: {"waiters":…,"claims":…,…}.
func appendStateJSON(b []byte, st *State) ([]byte, error) { //nolint:unparam // append-style, so a caller may reuse a buffer
	b = append(b, `{"waiters":`...)
	b, err := appendList(b, st.Waiters, appendWaiter)
	if err != nil {
		return nil, err
	}
	return appendStateRest(b, st)
}

// appendStateBody renders the state body like appendStateJSON, reusing the
// queue's encoding and hash when the queue is unchanged, and returns the
// sha256 of the body.
func (e *encoder) appendStateBody(b []byte, st *State) ([]byte, [sha256.Size]byte, error) {
	var sum [sha256.Size]byte
	var h hash.Hash
	if e.waitersHash != nil && sameArray(e.waiters, st.Waiters) {
		c, err := e.waitersHash.(hash.Cloner).Clone()
		if err != nil {
			return nil, sum, fmt.Errorf("clone sha256: %w", err)
		}
		h = c
		b = append(b, e.waitersJSON...)
	} else {
		start := len(b)
		b = append(b, `{"waiters":`...)
		var err error
		if b, err = appendList(b, st.Waiters, appendWaiter); err != nil {
			return nil, sum, err
		}
		e.waiters, e.waitersHash = nil, nil
		e.waitersJSON = append(e.waitersJSON[:0:0], b[start:]...)
		h = sha256.New()
		h.Write(e.waitersJSON)
		saved, err := h.(hash.Cloner).Clone()
		if err != nil {
			return nil, sum, fmt.Errorf("clone sha256: %w", err)
		}
		e.waiters, e.waitersHash = st.Waiters, saved
	}
	rest := len(b)
	b, err := appendStateRest(b, st)
	if err != nil {
		return nil, sum, err
	}
	h.Write(b[rest:])
	h.Sum(sum[:0])
	return b, sum, nil
}

// appendStateRest renders the state body after the queue.
func appendStateRest(b []byte, st *State) ([]byte, error) {
	var err error
	b = append(b, `,"claims":`...)
	if b, err = appendList(b, st.Claims, appendClaim); err != nil {
		return nil, err
	}
	b = append(b, `,"reservations":`...)
	if b, err = appendList(b, st.Reservations, appendReservation); err != nil {
		return nil, err
	}
	b = append(b, `,"conflicts":`...)
	if b, err = appendList(b, st.Conflicts, appendConflict); err != nil {
		return nil, err
	}
	if len(st.Cordons) > 0 {
		b = append(b, `,"cordons":`...)
		if b, err = appendList(b, st.Cordons, appendCordon); err != nil {
			return nil, err
		}
	}
	b = append(b, `,"generation":`...)
	b = strconv.AppendUint(b, st.Generation, 10)
	b = append(b, `,"boot_id":`...)
	b = appendString(b, st.BootID)
	b = append(b, `,"lineage":`...)
	b = appendString(b, st.Lineage)
	b = append(b, `,"next_seq":`...)
	b = strconv.AppendUint(b, st.NextSeq, 10)
	b = append(b, `,"updated_at":`...)
	if b, err = appendTime(b, st.UpdatedAt); err != nil {
		return nil, err
	}
	if !st.Clock.IsZero() {
		b = append(b, `,"clock":`...)
		if b, err = appendClockAnchor(b, &st.Clock); err != nil {
			return nil, err
		}
	}
	return append(b, '}'), nil
}

func appendClockAnchor(b []byte, a *ClockAnchor) ([]byte, error) {
	b = append(b, `{"wall":`...)
	b, err := appendTime(b, a.Wall)
	if err != nil {
		return nil, err
	}
	b = append(b, `,"boot_ns":`...)
	b = strconv.AppendInt(b, int64(a.Boot), 10)
	return append(b, '}'), nil
}

// appendList renders a JSON array (null for a nil slice, as encoding/json
// does) with one element encoder.
func appendList[T any](b []byte, items []T, appendItem func([]byte, *T) ([]byte, error)) ([]byte, error) {
	if items == nil {
		return append(b, "null"...), nil
	}
	var err error
	b = append(b, '[')
	for i := range items {
		if i > 0 {
			b = append(b, ',')
		}
		if b, err = appendItem(b, &items[i]); err != nil {
			return nil, err
		}
	}
	return append(b, ']'), nil
}

func appendDevice(b []byte, d *devices.Device) []byte {
	b = append(b, `{"uuid":`...)
	b = appendString(b, d.UUID)
	b = append(b, `,"index":`...)
	b = appendString(b, d.Index)
	b = append(b, `,"kind":`...)
	b = appendString(b, string(d.Kind))
	if d.Parent != "" {
		b = append(b, `,"parent":`...)
		b = appendString(b, d.Parent)
	}
	return append(b, '}')
}

func appendOwner(b []byte, o *Owner) ([]byte, error) {
	b = append(b, `{"container_id":`...)
	b = appendString(b, o.ContainerID)
	b = appendOptString(b, `,"container":`, o.Container)
	b = appendOptString(b, `,"namespace":`, o.Namespace)
	b = appendOptString(b, `,"pod":`, o.Pod)
	b = appendOptString(b, `,"pod_uid":`, o.PodUID)
	b = appendOptString(b, `,"pod_sandbox_id":`, o.PodSandboxID)
	b = append(b, `,"front_end":`...)
	b = appendString(b, string(o.FrontEnd))
	if o.Pid != 0 {
		b = append(b, `,"pid":`...)
		b = strconv.AppendInt(b, int64(o.Pid), 10)
	}
	if o.PidStart != 0 {
		b = append(b, `,"pid_start":`...)
		b = strconv.AppendUint(b, o.PidStart, 10)
	}
	b = appendOptString(b, `,"cgroup":`, o.Cgroup)
	var err error
	if !o.StartedAt.IsZero() {
		b = append(b, `,"started_at":`...)
		if b, err = appendTime(b, o.StartedAt); err != nil {
			return nil, err
		}
	}
	if !o.StoppedAt.IsZero() {
		b = append(b, `,"stopped_at":`...)
		if b, err = appendTime(b, o.StoppedAt); err != nil {
			return nil, err
		}
	}
	if !o.DrainingSince.IsZero() {
		b = append(b, `,"draining_since":`...)
		if b, err = appendTime(b, o.DrainingSince); err != nil {
			return nil, err
		}
	}
	return append(b, '}'), nil
}

func appendClaim(b []byte, c *Claim) ([]byte, error) {
	b = append(b, `{"device":`...)
	b = appendDevice(b, &c.Device)
	b = append(b, `,"owner":`...)
	b, err := appendOwner(b, &c.Owner)
	if err != nil {
		return nil, err
	}
	b = appendOptString(b, `,"source":`, c.Source)
	b = append(b, `,"since":`...)
	if b, err = appendTime(b, c.Since); err != nil {
		return nil, err
	}
	return append(b, '}'), nil
}

func appendWaiter(b []byte, w *Waiter) ([]byte, error) {
	b = append(b, `{"key":`...)
	b = appendString(b, w.Key)
	b = append(b, `,"seq":`...)
	b = strconv.AppendUint(b, w.Seq, 10)
	b = append(b, `,"devices":`...)
	if w.Devices == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, '[')
		for i := range w.Devices {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendDevice(b, &w.Devices[i])
		}
		b = append(b, ']')
	}
	b = append(b, `,"owner":`...)
	b, err := appendOwner(b, &w.Owner)
	if err != nil {
		return nil, err
	}
	b = append(b, `,"first_seen":`...)
	if b, err = appendTime(b, w.FirstSeen); err != nil {
		return nil, err
	}
	b = append(b, `,"last_seen":`...)
	if b, err = appendTime(b, w.LastSeen); err != nil {
		return nil, err
	}
	return append(b, '}'), nil
}

func appendReservation(b []byte, r *Reservation) ([]byte, error) {
	b = append(b, `{"device":`...)
	b = appendDevice(b, &r.Device)
	b = append(b, `,"for":`...)
	b = appendString(b, r.For)
	b = append(b, `,"since":`...)
	b, err := appendTime(b, r.Since)
	if err != nil {
		return nil, err
	}
	b = append(b, `,"until":`...)
	if b, err = appendTime(b, r.Until); err != nil {
		return nil, err
	}
	return append(b, '}'), nil
}

func appendConflict(b []byte, c *Conflict) ([]byte, error) {
	b = append(b, `{"device":`...)
	b = appendDevice(b, &c.Device)
	b = append(b, `,"owner":`...)
	b, err := appendOwner(b, &c.Owner)
	if err != nil {
		return nil, err
	}
	b = append(b, `,"since":`...)
	if b, err = appendTime(b, c.Since); err != nil {
		return nil, err
	}
	return append(b, '}'), nil
}

func appendCordon(b []byte, c *Cordon) ([]byte, error) {
	b = append(b, `{"device":`...)
	b = appendDevice(b, &c.Device)
	b = append(b, `,"source":`...)
	b = appendString(b, c.Source)
	b = append(b, `,"reason":`...)
	b = appendString(b, c.Reason)
	b = append(b, `,"by":`...)
	b = appendString(b, c.By)
	b = append(b, `,"since":`...)
	b, err := appendTime(b, c.Since)
	if err != nil {
		return nil, err
	}
	return append(b, '}'), nil
}

func appendOptString(b []byte, key, s string) []byte {
	if s == "" {
		return b
	}
	b = append(b, key...)
	return appendString(b, s)
}

// appendTime writes t in UTC as time.Time's MarshalJSON does (RFC 3339 with
// nanoseconds), and refuses the years MarshalJSON refuses. Storing UTC keeps
// the file independent of the writer's time zone.
func appendTime(b []byte, t time.Time) ([]byte, error) {
	t = t.UTC()
	if y := t.Year(); y < 0 || y > 9999 {
		return nil, fmt.Errorf("time %v: year outside [0,9999] cannot be stored", t)
	}
	b = append(b, '"')
	b = t.AppendFormat(b, time.RFC3339Nano)
	return append(b, '"'), nil
}

const hexDigits = "0123456789abcdef"

// plainASCII marks the bytes appendString copies as they are.
var plainASCII = func() (t [utf8.RuneSelf]bool) {
	for c := 0x20; c < utf8.RuneSelf; c++ {
		t[c] = c != '"' && c != '\\' && c != '<' && c != '>' && c != '&'
	}
	return t
}()

// appendString writes s as a JSON string, escaping exactly what encoding/json
// escapes by default: quotes, backslashes, control characters, the HTML
// characters < > &, U+2028 and U+2029; invalid UTF-8 becomes U+FFFD.
func appendString(b []byte, s string) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if plainASCII[c] {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\b':
				b = append(b, '\\', 'b')
			case '\f':
				b = append(b, '\\', 'f')
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
		case r == '\u2028' || r == '\u2029':
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hexDigits[r&0xf])
		default:
			i += size
			continue
		}
		i += size
		start = i
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
