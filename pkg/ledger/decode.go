// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"encoding/binary"
	"time"
	"unicode/utf16"
	"unicode/utf8"
	"unsafe"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// A hand-written decoder for the state line exactly as the encoder writes it
// (encode.go): the same fields in the same order, optional ones only where
// the encoder omits them, strings without escapes. Every reader (ctl status,
// each hook) decodes the whole state, and encoding/json spends most of that
// time on reflection. Anything else — another field order, an escape, an
// unknown field, a number it does not expect — makes fastDecodeState give up,
// and DecodeState falls back to encoding/json, which decides (and names the
// problem). So the result, when there is one, is what encoding/json would
// have produced (TestFastDecoderMatchesEncodingJSON holds it to that).

type fastDecoder struct {
	b   []byte
	i   int
	bad bool
	// strs interns strings: the same device UUIDs, front ends and boot id
	// recur across claims, reservations and records. Made on first use.
	strs map[string]string
	// While share is set (the waiters of a snapshot), a string is a slice
	// of s, which is b as one string, and a waiter's devices a slice of the
	// slab devs: no allocation per string or per list. A snapshot's
	// thousands of waiters otherwise cost an allocation and a map insert
	// for every key, container id and pod name, most of a cold read. The
	// price is that s stays in memory while any waiter decoded from it
	// does; waiters leave within queue_ttl, and the long-lived entries
	// (claims, cordons) allocate their own strings. s is a copy of b, or,
	// when the caller owns b and never writes it again (a file's bytes just
	// read), b itself: a reader's memory is mostly the state, and every
	// fresh page of it costs a fault (a whole process, gpu-guard-ctl
	// status, spent a third of its time in them).
	share bool
	// view is share for strings alone (no slab): a journal record decoded
	// from a buffer the reader owns, whose strings point into it.
	view bool
	// unescaped says the last raw string had escapes and was decoded into
	// a fresh buffer, which str must not take as a slice of s.
	unescaped bool
	s         string
	devs      []devices.Device
}

// fastDecodeState decodes the state line b, or gives up (ok false).
func fastDecodeState(b []byte) (State, bool) { return fastDecodeStateOf(b, false) }

// fastDecodeStateOf is fastDecodeState; owned says b is never written
// again, by anyone: the waiters' strings then point into it.
func fastDecodeStateOf(b []byte, owned bool) (State, bool) {
	d := fastDecoder{b: b}
	var st State
	d.lit(`{"waiters":`)
	if !d.bad {
		// The line has exactly one `{"key":` per waiter (a string
		// holding a '"' has an escape, which this decoder gives up on),
		// so the list is allocated once, at its size.
		n := bytes.Count(b, []byte(`{"key":`))
		d.share = true
		if owned {
			d.s = unsafe.String(&b[0], len(b)) //nolint:gosec // b is the caller's and never written again (see owned)
		} else {
			d.s = string(b)
		}
		d.devs = make([]devices.Device, 0, 2*n)
		st.Waiters = fastListCap(&d, n, (*fastDecoder).waiter)
		d.share, d.devs = false, nil
	}
	d.lit(`,"claims":`)
	st.Claims = fastList(&d, (*fastDecoder).claim)
	d.lit(`,"reservations":`)
	st.Reservations = fastList(&d, (*fastDecoder).reservation)
	d.lit(`,"conflicts":`)
	st.Conflicts = fastList(&d, (*fastDecoder).conflict)
	if d.opt(`,"cordons":`) {
		st.Cordons = fastList(&d, (*fastDecoder).cordon)
	}
	d.lit(`,"generation":`)
	st.Generation = d.uint()
	d.lit(`,"boot_id":`)
	st.BootID = d.str()
	d.lit(`,"lineage":`)
	st.Lineage = d.str()
	d.lit(`,"next_seq":`)
	st.NextSeq = d.uint()
	d.lit(`,"updated_at":`)
	st.UpdatedAt = d.time()
	if d.opt(`,"clock":`) {
		d.clockAnchor(&st.Clock)
	}
	d.lit(`}`)
	if d.bad || d.i != len(d.b) {
		return State{}, false
	}
	return st, true
}

// lit consumes s, or marks the input as not the encoder's.
func (d *fastDecoder) lit(s string) {
	if d.bad || len(d.b)-d.i < len(s) || string(d.b[d.i:d.i+len(s)]) != s {
		d.bad = true
		return
	}
	d.i += len(s)
}

// end consumes the closing brace of a top-level object and says whether the
// line was decoded whole.
func (d *fastDecoder) end() bool {
	d.lit("}")
	return !d.bad && d.i == len(d.b)
}

// opt consumes s if it comes next.
func (d *fastDecoder) opt(s string) bool {
	if d.bad || len(d.b)-d.i < len(s) || string(d.b[d.i:d.i+len(s)]) != s {
		return false
	}
	d.i += len(s)
	return true
}

func fastList[T any](d *fastDecoder, item func(*fastDecoder, *T)) []T {
	return fastListCap(d, 0, item)
}

// fastListCap is fastList with room for n items made at once.
func fastListCap[T any](d *fastDecoder, n int, item func(*fastDecoder, *T)) []T {
	if d.opt("null") {
		return nil
	}
	d.lit("[")
	out := make([]T, 0, n)
	if d.opt("]") {
		return out
	}
	var zero T
	for !d.bad {
		// Decoded in place: a local passed to item (a func value) would
		// escape, one heap object per item.
		out = append(out, zero)
		item(d, &out[len(out)-1])
		if d.opt("]") {
			return out
		}
		d.lit(",")
	}
	return nil
}

// raw returns the bytes of a string without escapes, or marks the input.
func (d *fastDecoder) raw() []byte {
	d.unescaped = false
	d.lit(`"`)
	if d.bad {
		return nil
	}
	start := d.i
	ascii := true
	for d.i < len(d.b) {
		d.skipPlain()
		if d.i == len(d.b) {
			break
		}
		c := d.b[d.i]
		switch {
		case c == '"':
			s := d.b[start:d.i]
			d.i++
			if !ascii && !utf8.Valid(s) {
				d.bad = true // encoding/json replaces invalid bytes: let it
				return nil
			}
			return s
		case c == '\\':
			return d.unescape(start)
		case c < 0x20:
			d.bad = true
			return nil
		case c >= utf8.RuneSelf:
			ascii = false
		}
		d.i++
	}
	d.bad = true
	return nil
}

// unescape finishes a string that starts at start and has an escape at d.i,
// into a fresh buffer (never a slice of b: str must not share it). A claim's
// source quotes its variable (`env NVIDIA_VISIBLE_DEVICES="0"`), so every
// claim record has escapes; giving up on them sent each through
// encoding/json's reflection, the largest cost of a GPU hook's read. It
// decodes what encoding/json does the same way and gives up on the rest:
// a surrogate in \u (encoding/json pairs or replaces them), a raw control
// byte, an unknown escape, invalid UTF-8.
func (d *fastDecoder) unescape(start int) []byte {
	out := make([]byte, 0, d.i-start+16)
	out = append(out, d.b[start:d.i]...)
	ascii := true
	for d.i < len(d.b) {
		c := d.b[d.i]
		switch {
		case c == '"':
			d.i++
			if !ascii && !utf8.Valid(out) {
				d.bad = true
				return nil
			}
			d.unescaped = true
			return out
		case c < 0x20:
			d.bad = true
			return nil
		case c != '\\':
			if c >= utf8.RuneSelf {
				ascii = false
			}
			out = append(out, c)
			d.i++
			continue
		}
		if d.i+1 >= len(d.b) {
			break
		}
		e := d.b[d.i+1]
		d.i += 2
		switch e {
		case '"', '\\', '/':
			out = append(out, e)
		case 'b':
			out = append(out, '\b')
		case 'f':
			out = append(out, '\f')
		case 'n':
			out = append(out, '\n')
		case 'r':
			out = append(out, '\r')
		case 't':
			out = append(out, '\t')
		case 'u':
			if d.i+4 > len(d.b) {
				d.bad = true
				return nil
			}
			r, ok := hexRune(d.b[d.i : d.i+4])
			if !ok || utf16.IsSurrogate(r) {
				d.bad = true
				return nil
			}
			d.i += 4
			out = utf8.AppendRune(out, r)
		default:
			d.bad = true
			return nil
		}
	}
	d.bad = true
	return nil
}

// SWAR constants: a byte repeated in every lane of a word, and the lanes'
// high bits.
const (
	swarOnes  = 0x0101010101010101
	swarHighs = 0x8080808080808080
)

// skipPlain moves past the bytes of a string that need no attention, eight
// at a time: it stops at the first word holding a '"', a '\\', a control
// byte or a byte of a multi-byte rune (or a word that only looks like it:
// the byte loop of raw then decides), and at the last seven bytes.
func (d *fastDecoder) skipPlain() {
	b, i := d.b, d.i
	for ; i+8 <= len(b); i += 8 {
		w := binary.LittleEndian.Uint64(b[i:])
		q := w ^ (swarOnes * '"')
		bs := w ^ (swarOnes * '\\')
		// A lane of x is zero (or below n) where (x - ones*n) &^ x has its
		// high bit; w's own high bit marks a byte >= 0x80.
		if ((q-swarOnes)&^q|(bs-swarOnes)&^bs|(w-swarOnes*0x20)&^w|w)&swarHighs != 0 {
			break
		}
	}
	d.i = i
}

func (d *fastDecoder) str() string {
	s := d.raw()
	if d.bad {
		return ""
	}
	if (d.share || d.view) && !d.unescaped { // an unescaped string is a fresh buffer, not a slice of s
		end := d.i - 1 // the closing quote
		return d.s[end-len(s) : end]
	}
	if v, ok := d.strs[string(s)]; ok {
		return v
	}
	if d.strs == nil {
		d.strs = make(map[string]string, 16)
	}
	v := string(s)
	d.strs[v] = v
	return v
}

// strItem decodes one string of a list.
func (d *fastDecoder) strItem(s *string) { *s = d.str() }

// deviceList decodes a waiter's devices into the slab while share is set:
// each list a slice of it, capped at its length (an append copies).
func (d *fastDecoder) deviceList() []devices.Device {
	if !d.share {
		return fastList(d, (*fastDecoder).device)
	}
	if d.opt("null") {
		return nil
	}
	d.lit("[")
	if d.opt("]") {
		return []devices.Device{}
	}
	start := len(d.devs)
	for !d.bad {
		if len(d.devs) == cap(d.devs) {
			// A new slab, carrying this list's first items.
			next := make([]devices.Device, len(d.devs)-start, 2*(len(d.devs)-start)+256)
			copy(next, d.devs[start:])
			d.devs, start = next, 0
		}
		d.devs = d.devs[:len(d.devs)+1]
		d.device(&d.devs[len(d.devs)-1])
		if d.opt("]") {
			return d.devs[start:len(d.devs):len(d.devs)]
		}
		d.lit(",")
	}
	return nil
}

func (d *fastDecoder) uint() uint64 {
	if d.bad {
		return 0
	}
	start := d.i
	var n uint64
	for d.i < len(d.b) && d.b[d.i] >= '0' && d.b[d.i] <= '9' {
		c := uint64(d.b[d.i] - '0')
		if n > (1<<64-1-c)/10 {
			d.bad = true // overflow: encoding/json reports it
			return 0
		}
		n = n*10 + c
		d.i++
	}
	if d.i == start || (d.i-start > 1 && d.b[start] == '0') {
		d.bad = true
	}
	return n
}

func (d *fastDecoder) int() int {
	neg := d.opt("-")
	n := d.uint()
	if n > 1<<62 {
		d.bad = true
		return 0
	}
	if neg {
		return -int(n)
	}
	return int(n)
}

// int64 decodes a number encoding/json decodes into an int64: all of them.
func (d *fastDecoder) int64() int64 {
	neg := d.opt("-")
	n := d.uint()
	switch {
	case d.bad:
		return 0
	case neg && n == 0:
		d.bad = true // "-0": let encoding/json decide
		return 0
	case neg && n <= 1<<63:
		return int64(-n) //nolint:gosec // n <= 1<<63: -n is the two's complement of the number
	case !neg && n <= 1<<63-1:
		return int64(n)
	}
	d.bad = true // out of range: encoding/json reports it
	return 0
}

func (d *fastDecoder) time() time.Time {
	s := d.raw()
	var t time.Time
	if d.bad {
		return t
	}
	if t, ok := parseUTC(s); ok {
		return t
	}
	// What time.Time's UnmarshalJSON does with the quoted text.
	if err := t.UnmarshalText(s); err != nil {
		d.bad = true
	}
	return t
}

// parseUTC parses the one form of RFC 3339 the encoder writes (appendTime:
// UTC, "Z", the fraction without trailing zeros and absent when zero) to what
// time.Time's UnmarshalText gives for it. Anything else, or a field out of
// range, is not ok and left to UnmarshalText, which decides and names the
// problem.
func parseUTC(s []byte) (time.Time, bool) {
	// 2006-01-02T15:04:05[.999999999]Z
	if len(s) < 20 || s[4] != '-' || s[7] != '-' || s[10] != 'T' || s[13] != ':' || s[16] != ':' || s[len(s)-1] != 'Z' {
		return time.Time{}, false
	}
	num := func(s []byte) (int, bool) {
		n := 0
		for _, c := range s {
			if c < '0' || c > '9' {
				return 0, false
			}
			n = n*10 + int(c-'0')
		}
		return n, true
	}
	year, ok1 := num(s[0:4])
	month, ok2 := num(s[5:7])
	day, ok3 := num(s[8:10])
	hour, ok4 := num(s[11:13])
	minute, ok5 := num(s[14:16])
	sec, ok6 := num(s[17:19])
	if !ok1 || !ok2 || !ok3 || !ok4 || !ok5 || !ok6 ||
		month < 1 || month > 12 || day < 1 || day > daysIn(month, year) || hour > 23 || minute > 59 || sec > 59 {
		return time.Time{}, false
	}
	nsec := 0
	if frac := s[19 : len(s)-1]; len(frac) > 0 {
		// ".d" to ".ddddddddd": nanoseconds, scaled up by the missing digits.
		if frac[0] != '.' || len(frac) < 2 || len(frac) > 10 {
			return time.Time{}, false
		}
		n, ok := num(frac[1:])
		if !ok {
			return time.Time{}, false
		}
		for range 10 - len(frac) {
			n *= 10
		}
		nsec = n
	}
	return time.Date(year, time.Month(month), day, hour, minute, sec, nsec, time.UTC), true
}

// daysIn is the number of days of month in year (proleptic Gregorian).
func daysIn(month, year int) int {
	switch month {
	case 2:
		if year%4 == 0 && (year%100 != 0 || year%400 == 0) {
			return 29
		}
		return 28
	case 4, 6, 9, 11:
		return 30
	}
	return 31
}

func (d *fastDecoder) device(v *devices.Device) {
	d.lit(`{"uuid":`)
	v.UUID = d.str()
	d.lit(`,"index":`)
	v.Index = d.str()
	d.lit(`,"kind":`)
	v.Kind = devices.Kind(d.str())
	if d.opt(`,"parent":`) {
		v.Parent = d.str()
	}
	d.lit(`}`)
}

func (d *fastDecoder) optStr(key string, dst *string) {
	if d.opt(key) {
		*dst = d.str()
	}
}

func (d *fastDecoder) owner(o *Owner) {
	d.lit(`{"container_id":`)
	o.ContainerID = d.str()
	d.optStr(`,"container":`, &o.Container)
	d.optStr(`,"namespace":`, &o.Namespace)
	d.optStr(`,"pod":`, &o.Pod)
	d.optStr(`,"pod_uid":`, &o.PodUID)
	d.optStr(`,"pod_sandbox_id":`, &o.PodSandboxID)
	d.lit(`,"front_end":`)
	o.FrontEnd = FrontEnd(d.str())
	if d.opt(`,"pid":`) {
		o.Pid = d.int()
	}
	if d.opt(`,"pid_start":`) {
		o.PidStart = d.uint()
	}
	d.optStr(`,"cgroup":`, &o.Cgroup)
	if d.opt(`,"started_at":`) {
		o.StartedAt = d.time()
	}
	if d.opt(`,"stopped_at":`) {
		o.StoppedAt = d.time()
	}
	if d.opt(`,"draining_since":`) {
		o.DrainingSince = d.time()
	}
	d.lit(`}`)
}

func (d *fastDecoder) claim(c *Claim) {
	d.lit(`{"device":`)
	d.device(&c.Device)
	d.lit(`,"owner":`)
	d.owner(&c.Owner)
	d.optStr(`,"source":`, &c.Source)
	d.lit(`,"since":`)
	c.Since = d.time()
	d.lit(`}`)
}

func (d *fastDecoder) waiter(w *Waiter) {
	d.lit(`{"key":`)
	w.Key = d.str()
	d.lit(`,"seq":`)
	w.Seq = d.uint()
	d.lit(`,"devices":`)
	w.Devices = d.deviceList()
	d.lit(`,"owner":`)
	d.owner(&w.Owner)
	d.lit(`,"first_seen":`)
	w.FirstSeen = d.time()
	d.lit(`,"last_seen":`)
	w.LastSeen = d.time()
	d.lit(`}`)
}

func (d *fastDecoder) reservation(r *Reservation) {
	d.lit(`{"device":`)
	d.device(&r.Device)
	d.lit(`,"for":`)
	r.For = d.str()
	d.lit(`,"since":`)
	r.Since = d.time()
	d.lit(`,"until":`)
	r.Until = d.time()
	d.lit(`}`)
}

func (d *fastDecoder) conflict(c *Conflict) {
	d.lit(`{"device":`)
	d.device(&c.Device)
	d.lit(`,"owner":`)
	d.owner(&c.Owner)
	d.lit(`,"since":`)
	c.Since = d.time()
	d.lit(`}`)
}

func (d *fastDecoder) clockAnchor(a *ClockAnchor) {
	d.lit(`{"wall":`)
	a.Wall = d.time()
	d.lit(`,"boot_ns":`)
	a.Boot = time.Duration(d.int64())
	d.lit(`}`)
}

func (d *fastDecoder) cordon(c *Cordon) {
	d.lit(`{"device":`)
	d.device(&c.Device)
	d.lit(`,"source":`)
	c.Source = d.str()
	d.lit(`,"reason":`)
	c.Reason = d.str()
	d.lit(`,"by":`)
	c.By = d.str()
	d.lit(`,"since":`)
	c.Since = d.time()
	d.lit(`}`)
}

// fastDecodeRecord decodes a journal record exactly as json.Marshal writes
// it (journalRecord's fields in order, empty lists omitted), or gives up
// like fastDecodeState. Every cold reader — each hook that claims or
// releases — replays the journal since the last compaction, up to a few
// hundred records.
func fastDecodeRecord(b []byte) (journalRecord, bool) { return fastDecodeRecordOf(b, false) }

// fastDecodeRecordOf is fastDecodeRecord; owned says b is never written
// again, by anyone: the record's strings then point into it instead of
// each being allocated (with a map to intern them, per record). A cold
// reader replays up to a few hundred records, and that garbage was most of
// the fresh heap pages, each a page fault, of a hook's journal replay. The
// journal buffer stays in memory while a string of it does: at most the
// journal's size, which compaction bounds.
func fastDecodeRecordOf(b []byte, owned bool) (journalRecord, bool) {
	d := fastDecoder{b: b}
	if owned && len(b) > 0 {
		d.view = true
		d.s = unsafe.String(&b[0], len(b)) //nolint:gosec // b is the caller's and never written again (see owned)
	}
	var r journalRecord
	d.lit(`{"g":`)
	r.Gen = d.uint()
	d.lit(`,"t":`)
	r.Time = d.time()
	d.lit(`,"seq":`)
	r.NextSeq = d.uint()
	if d.opt(`,"c":`) {
		r.Claims = fastList(&d, (*fastDecoder).claim)
	}
	if d.opt(`,"dc":`) {
		r.ClaimsGone = fastList(&d, (*fastDecoder).strItem)
	}
	if d.opt(`,"r":`) {
		r.Reservations = fastList(&d, (*fastDecoder).reservation)
	}
	if d.opt(`,"dr":`) {
		r.ResGone = fastList(&d, (*fastDecoder).strItem)
	}
	if d.opt(`,"w":`) {
		r.Waiters = fastList(&d, (*fastDecoder).waiter)
	}
	if d.opt(`,"dw":`) {
		r.WaitersGone = fastList(&d, (*fastDecoder).strItem)
	}
	if d.opt(`,"x":`) {
		// encoding/json sets the pointer to nil for null, and points it
		// at the list (empty or not) otherwise.
		if x := fastList(&d, (*fastDecoder).conflict); x != nil {
			r.Conflicts = &x
		}
	}
	if d.opt(`,"k":`) {
		r.Cordons = fastList(&d, (*fastDecoder).cordon)
	}
	if d.opt(`,"dk":`) {
		r.CordonsGone = fastList(&d, (*fastDecoder).strItem)
	}
	if d.opt(`,"clk":`) {
		r.Clock = new(ClockAnchor)
		d.clockAnchor(r.Clock)
	}
	if d.opt(`,"a":`) {
		r.Audit = d.auditList(owned)
	}
	d.lit(`}`)
	if d.bad || d.i != len(d.b) {
		return journalRecord{}, false
	}
	return r, true
}

// hexRune decodes the four hex digits of a \u escape.
func hexRune(digits []byte) (rune, bool) {
	var r rune
	for _, h := range digits {
		switch {
		case h >= '0' && h <= '9':
			r = r<<4 | rune(h-'0')
		case h >= 'a' && h <= 'f':
			r = r<<4 | rune(h-'a'+10)
		case h >= 'A' && h <= 'F':
			r = r<<4 | rune(h-'A'+10)
		default:
			return 0, false
		}
	}
	return r, true
}
