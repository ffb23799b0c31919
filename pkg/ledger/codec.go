// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// FormatVersion is the state format this build writes and the newest it
// reads. Bump it for any change an older build would misread. Format 1 was a
// single ledger.json rewritten whole at every commit; format 2 is a
// snapshot (ledger.json) plus a journal (ledger.journal). A format 1 file is
// read and converted at the next commit. Format 3 adds device cordons
// (State.Cordons) and draining claims (Owner.DrainingSince): a format 2
// build would refuse those fields as unknown and report the state corrupt,
// and its recovery could then drop a cordon; with the bump it reports a
// state written by a newer build, leaves it untouched and decides nothing
// (fail closed). A format 2 file is read as is (it has neither) and
// written as the current format at the next commit. Format 4 adds the clock
// anchor (State.Clock), by which a step of the wall clock is told from time
// passing: a format 3 build would refuse it as an unknown field, and now
// refuses the state as newer instead. A format 3 file is read as is (it has
// no anchor, so a step is not told until its next commit anchors it) and
// written as format 4 at the next commit.
const FormatVersion = 4

// oldestJournalFormat is the oldest snapshot-and-journal format (2: before
// cordons; 3: before the clock anchor), read as is and converted at the
// next commit.
const oldestJournalFormat = 2

// legacyFormat is the whole-file format, read for the upgrade only.
const legacyFormat = 1

// checksumPrefix names the hash so that a later format may change it.
const checksumPrefix = "sha256:"

// maxStateBytes bounds what is read as state: a ledger of a few hundred
// devices and waiters is well under a MiB, so a bigger file is not ours.
const maxStateBytes = 64 << 20

// snapshotHeader is the first line of a format 2 snapshot:
//
//	{"format":2,"generation":7,"boot_id":"…","lineage":"…","checksum":"sha256:…","bytes":1234}
//	{…state…}
//
// The checksum covers the exact bytes of the state line (without its
// newline), whose length is "bytes". The header repeats what a human (and
// the loader, before hashing) wants first; it must equal the state's fields.
type snapshotHeader struct {
	Format     int    `json:"format"`
	Generation uint64 `json:"generation"`
	BootID     string `json:"boot_id"`
	Lineage    string `json:"lineage"`
	Checksum   string `json:"checksum"`
	Bytes      int    `json:"bytes"`
}

// envelope is the format 1 file: one line,
//
//	{"format":1,"generation":7,"boot_id":"…","checksum":"sha256:…","state":{…}}
type envelope struct {
	Format     int             `json:"format"`
	Generation uint64          `json:"generation"`
	BootID     string          `json:"boot_id"`
	Checksum   string          `json:"checksum"`
	State      json.RawMessage `json:"state"`
}

// errBadState wraps every reason a file is not a valid state.
type errBadState struct{ reason string }

func (e *errBadState) Error() string { return e.reason }
func (e *errBadState) Unwrap() error { return ErrCorrupt }

func badState(format string, args ...any) error {
	return &errBadState{reason: fmt.Sprintf(format, args...)}
}

// encodeState renders st as a snapshot file.
func encodeState(st *State) ([]byte, error) {
	var e encoder
	return e.encode(st, nil)
}

// encode renders st as a snapshot file. The result is built in one of two
// buffers the encoder owns, never in keep (bytes a caller still holds).
func (e *encoder) encode(st *State, keep []byte) ([]byte, error) {
	i := 0
	if len(keep) > 0 && cap(e.out[0]) > 0 && &e.out[0][:1][0] == &keep[:1][0] {
		i = 1
	}
	// The body first (after room for the header), then the header in front.
	const room = 512
	out := append(e.out[i][:0], make([]byte, room)...)
	out, sum, err := e.appendStateBody(out, st)
	if err != nil {
		return nil, err
	}
	body := len(out) - room
	out = append(out, '\n')
	var h []byte
	h = append(h, `{"format":`...)
	h = strconv.AppendInt(h, FormatVersion, 10)
	h = append(h, `,"generation":`...)
	h = strconv.AppendUint(h, st.Generation, 10)
	h = append(h, `,"boot_id":`...)
	h = appendString(h, st.BootID)
	h = append(h, `,"lineage":`...)
	h = appendString(h, st.Lineage)
	h = append(h, `,"checksum":"`...)
	h = append(h, checksumPrefix...)
	h = hex.AppendEncode(h, sum[:])
	h = append(h, `","bytes":`...)
	h = strconv.AppendInt(h, int64(body), 10)
	h = append(h, "}\n"...)
	if len(h) > room {
		// Only a boot id or lineage of hundreds of bytes gets here.
		res := append(h, out[room:]...)
		e.out[i] = out
		return res, nil
	}
	start := room - len(h)
	copy(out[start:], h)
	e.out[i] = out
	return out[start:], nil
}

// DecodeState parses and verifies a snapshot file (format 2, or format 1
// for the upgrade). A file of a newer format yields a *FormatError (with an
// empty Path); anything else that is wrong yields an error wrapping
// ErrCorrupt — including a field this build does not know, which a later
// write would otherwise drop. It never panics. The state is decoded once,
// in one pass.
func DecodeState(data []byte) (State, error) { return decodeState(data, false) }

// decodeState is DecodeState; owned says data is the caller's own buffer,
// never written again, which the waiters' strings may then point into
// (fastDecodeState) instead of a copy of it.
func decodeState(data []byte, owned bool) (State, error) {
	if len(data) > maxStateBytes {
		return State{}, badState("file is %d bytes, more than the %d a ledger can be", len(data), maxStateBytes)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return State{}, badState("file is empty")
	}
	format, ok := peekFormat(data)
	switch {
	case !ok:
		return State{}, badState("not a ledger file: it does not start with {\"format\":<version>")
	case format > FormatVersion:
		return State{}, &FormatError{Version: format, Supported: FormatVersion}
	case format == legacyFormat:
		return decodeLegacy(data)
	case format < oldestJournalFormat:
		return State{}, badState("format version %d is not valid", format)
	}
	nl := bytes.IndexByte(data, '\n')
	if nl < 0 {
		return State{}, badState("no state after the header (truncated?)")
	}
	var hdr snapshotHeader
	if err := decodeStrict(data[:nl], &hdr); err != nil {
		return State{}, badState("header does not decode: %v", err)
	}
	body := data[nl+1:]
	if hdr.Bytes <= 0 || hdr.Bytes != len(body)-1 || body[len(body)-1] != '\n' {
		return State{}, badState("the state is %d bytes, the header says %d (truncated or appended to?)", max(len(body)-1, 0), hdr.Bytes)
	}
	body = body[:hdr.Bytes]
	sum := sha256.Sum256(body)
	if want := checksumPrefix + hex.EncodeToString(sum[:]); hdr.Checksum != want {
		return State{}, badState("checksum mismatch: file says %q, content hashes to %q", truncate(hdr.Checksum, 80), want)
	}
	st, ok := fastDecodeStateOf(body, owned)
	if !ok {
		// Not exactly as the encoder writes it: encoding/json decides.
		if err := decodeStrict(body, &st); err != nil {
			return State{}, badState("state does not decode: %v", err)
		}
	}
	if st.Generation != hdr.Generation || st.BootID != hdr.BootID || st.Lineage != hdr.Lineage {
		return State{}, badState("header (generation %d, boot %q, lineage %q) disagrees with state (generation %d, boot %q, lineage %q)",
			hdr.Generation, truncate(hdr.BootID, 64), truncate(hdr.Lineage, 64), st.Generation, truncate(st.BootID, 64), truncate(st.Lineage, 64))
	}
	if err := validateState(&st); err != nil {
		return State{}, badState("state violates an invariant: %v", err)
	}
	return st, nil
}

// peekFormat reads the version of `{"format":N` at the start of data, as
// every ledger file written by nri-gpu-guard begins.
func peekFormat(data []byte) (int, bool) {
	const prefix = `{"format":`
	if !bytes.HasPrefix(data, []byte(prefix)) {
		return 0, false
	}
	n, i := 0, len(prefix)
	for ; i < len(data) && i < len(prefix)+6 && data[i] >= '0' && data[i] <= '9'; i++ {
		n = n*10 + int(data[i]-'0')
	}
	if i == len(prefix) {
		return 0, false
	}
	return n, true
}

// decodeStrict decodes one JSON value, refusing a field v does not have:
// unknown fields are not dropped silently at the next write.
func decodeStrict(data []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(data))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		if strings.HasPrefix(err.Error(), "json: unknown field") {
			return fmt.Errorf("%w (written by a newer nri-gpu-guard, or edited by hand; this build would drop it at its next write)", err)
		}
		return err
	}
	if d.More() {
		return errors.New("data after the JSON value")
	}
	return nil
}

// decodeLegacy parses and verifies a format 1 file.
func decodeLegacy(data []byte) (State, error) {
	var env envelope
	if err := decodeStrict(data, &env); err != nil {
		return State{}, badState("not a ledger file: %v", err)
	}
	if len(env.State) == 0 || bytes.Equal(env.State, []byte("null")) {
		return State{}, badState("no state in the file")
	}
	sum := sha256.Sum256(env.State)
	want := checksumPrefix + hex.EncodeToString(sum[:])
	if env.Checksum != want {
		return State{}, badState("checksum mismatch: file says %q, content hashes to %q", truncate(env.Checksum, 80), want)
	}
	var st State
	if err := decodeStrict(env.State, &st); err != nil {
		return State{}, badState("state does not decode: %v", err)
	}
	if st.Generation != env.Generation || st.BootID != env.BootID {
		return State{}, badState("envelope (generation %d, boot %q) disagrees with state (generation %d, boot %q)",
			env.Generation, truncate(env.BootID, 64), st.Generation, truncate(st.BootID, 64))
	}
	if err := validateState(&st); err != nil {
		return State{}, badState("state violates an invariant: %v", err)
	}
	return st, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// validateState checks the invariants every committed state keeps. It runs on
// decode (a verified file that breaks them was not written by a correct
// ledger) and before every commit (a bug must not reach the disk).
func validateState(st *State) error { return validate(st, true) }

// validate is validateState, checking the queue itself only if
// checkWaiters (it is the costly part, and unchanged in most commits).
func validate(st *State, checkWaiters bool) error {
	for i := range st.Claims {
		c := &st.Claims[i]
		if c.Device.UUID == "" {
			return errors.New("a claim has no device UUID")
		}
		if c.Owner.ContainerID == "" {
			return fmt.Errorf("claim on %s has no container id", DescribeDevice(c.Device))
		}
		if i > 0 && st.Claims[i-1].Device.UUID >= c.Device.UUID {
			return fmt.Errorf("claims are not sorted by unique device UUID at %s", DescribeDevice(c.Device))
		}
		for j := 0; j < i; j++ {
			o := &st.Claims[j]
			if o.Owner.ContainerID != c.Owner.ContainerID && devices.Conflicts(o.Device, c.Device) {
				return fmt.Errorf("%s is held by container %s while %s is held by container %s",
					DescribeDevice(o.Device), ShortID(o.Owner.ContainerID), DescribeDevice(c.Device), ShortID(c.Owner.ContainerID))
			}
		}
	}
	var keys map[string]struct{}
	if checkWaiters {
		keys = make(map[string]struct{}, len(st.Waiters))
	}
	for i := 0; checkWaiters && i < len(st.Waiters); i++ {
		w := &st.Waiters[i]
		if w.Key == "" {
			return errors.New("a waiter has no key")
		}
		if _, dup := keys[w.Key]; dup {
			return fmt.Errorf("waiter %q is queued twice", w.Key)
		}
		keys[w.Key] = struct{}{}
		if i > 0 && st.Waiters[i-1].Seq >= w.Seq {
			return fmt.Errorf("waiters are not in strictly increasing arrival order at %q", w.Key)
		}
		if w.Seq >= st.NextSeq {
			return fmt.Errorf("waiter %q has seq %d, not below next_seq %d", w.Key, w.Seq, st.NextSeq)
		}
	}
	for i := range st.Reservations {
		r := &st.Reservations[i]
		if r.Device.UUID == "" || r.For == "" {
			return errors.New("a reservation has no device or no waiter")
		}
		if i > 0 && st.Reservations[i-1].Device.UUID >= r.Device.UUID {
			return fmt.Errorf("reservations are not sorted by unique device UUID at %s", DescribeDevice(r.Device))
		}
		for j := 0; j < i; j++ {
			o := &st.Reservations[j]
			if o.For != r.For && devices.Conflicts(o.Device, r.Device) {
				return fmt.Errorf("%s is reserved for %q while %s is reserved for %q",
					DescribeDevice(o.Device), o.For, DescribeDevice(r.Device), r.For)
			}
		}
	}
	for i := range st.Reservations {
		r := &st.Reservations[i]
		for j := range st.Claims {
			if c := &st.Claims[j]; devices.Conflicts(c.Device, r.Device) {
				return fmt.Errorf("%s is reserved for %q but %s is held by container %s",
					DescribeDevice(r.Device), r.For, DescribeDevice(c.Device), ShortID(c.Owner.ContainerID))
			}
		}
	}
	for i := range st.Conflicts {
		c := &st.Conflicts[i]
		if c.Device.UUID == "" || c.Owner.ContainerID == "" {
			return errors.New("a conflict record has no device or no container id")
		}
	}
	return validateCordons(st.Cordons)
}
