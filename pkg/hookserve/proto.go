// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hookserve

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
)

// The relay protocol, version 2 (see doc.go). Integers are unsigned 32-bit
// little-endian.
const (
	// Magic opens every request and every acknowledgement. Version 1
	// ("GGH1") had no go-ahead: a server of one version closes a request of
	// the other without an answer, and the relay then runs the hook itself.
	Magic = "GGH2"
	// MaxArgs bounds a request's argument count (at least one: the phase).
	MaxArgs = 32
	// MaxArgLen bounds one argument, in bytes.
	MaxArgLen = 4096
	// MaxEnv bounds a request's environment entries.
	MaxEnv = 8
	// MaxEnvLen bounds one environment entry ("NAME=VALUE"), in bytes.
	MaxEnvLen = 8192
	// MaxStdin bounds the stdin bytes a request carries: 1 MiB + 1, so that
	// a state over the hook's own 1 MiB bound reaches the hook as one it
	// refuses, as the relay's own stdin would.
	MaxStdin = 1<<20 + 1
	// MaxReason bounds a fallback's reason text, in bytes.
	MaxReason = 4096
	// MaxStderr bounds a result's stderr text, in bytes.
	MaxStderr = 65536
)

// The acknowledgement, go-ahead and result codes.
const (
	ackAccept   = 'A'
	ackFallBack = 'F'
	// GoAhead is the one byte a relay sends after an 'A' that came within
	// its timeout: only then does the server run the hook. A relay that
	// gave up waiting closes instead, so exactly one of the two (server or
	// the relay's own hook) runs a request.
	GoAhead   = 'G'
	tagResult = 'R'
)

// ErrMalformed is wrapped by every error of a message that does not follow
// the protocol: a bad magic, a count or length out of its bound, a message
// cut short. The server answers such a request with nothing (the relay
// then runs the hook itself).
var ErrMalformed = errors.New("malformed hook relay message")

// Request is what a relay sends: the hook's arguments from the phase on,
// the part of its environment it forwards, and what it read of its stdin.
type Request struct {
	Args  []string
	Env   []string
	Stdin []byte
}

// malformed is an ErrMalformed error saying what and where.
func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

// ReadRequest reads one request from r. Every count and length is checked
// against its bound before anything is allocated for it, so that a request
// costs at most its bounds (some 1.2 MiB) whatever it claims. An error
// wraps ErrMalformed and names the field, and io.ErrUnexpectedEOF where the
// message was cut short, or io.EOF where not a byte of it came.
func ReadRequest(r io.Reader) (Request, error) {
	d := decoder{r: r, what: "request"}
	var q Request
	d.magic()
	argc := d.count("argc", 1, MaxArgs)
	for i := range argc {
		q.Args = append(q.Args, d.text(fmt.Sprintf("argument %d", i), MaxArgLen))
	}
	envc := d.count("envc", 0, MaxEnv)
	for i := range envc {
		kv := d.text(fmt.Sprintf("environment entry %d", i), MaxEnvLen)
		if d.err == nil && !strings.Contains(kv, "=") {
			d.err = malformed("request: environment entry %d has no '=' (want NAME=VALUE)", i)
		}
		q.Env = append(q.Env, kv)
	}
	n := d.count("stdin_len", 0, MaxStdin)
	if d.err == nil {
		q.Stdin = make([]byte, n)
		d.full(q.Stdin, "stdin")
	}
	if d.err != nil {
		return Request{}, d.err
	}
	return q, nil
}

// AppendRequest appends q's encoding to b, as a relay sends it. It refuses
// a request out of the protocol's bounds, as ReadRequest would.
func AppendRequest(b []byte, q Request) ([]byte, error) {
	if len(q.Args) < 1 || len(q.Args) > MaxArgs {
		return b, malformed("request: argc %d is out of range 1..%d", len(q.Args), MaxArgs)
	}
	if len(q.Env) > MaxEnv {
		return b, malformed("request: envc %d is out of range 0..%d", len(q.Env), MaxEnv)
	}
	if len(q.Stdin) > MaxStdin {
		return b, malformed("request: stdin_len %d is out of range 0..%d", len(q.Stdin), MaxStdin)
	}
	b = append(b, Magic...)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(q.Args))) //nolint:gosec // bounded above
	for i, a := range q.Args {
		if len(a) > MaxArgLen {
			return b, malformed("request: argument %d is %d bytes, more than %d", i, len(a), MaxArgLen)
		}
		b = appendText(b, a)
	}
	b = binary.LittleEndian.AppendUint32(b, uint32(len(q.Env))) //nolint:gosec // bounded above
	for i, kv := range q.Env {
		if len(kv) > MaxEnvLen {
			return b, malformed("request: environment entry %d is %d bytes, more than %d", i, len(kv), MaxEnvLen)
		}
		b = appendText(b, kv)
	}
	return appendText(b, string(q.Stdin)), nil
}

// AppendAccept appends the acknowledgement 'A': the server runs the hook
// once the relay's go-ahead comes, and a result follows.
func AppendAccept(b []byte) []byte {
	return append(append(b, Magic...), ackAccept)
}

// AppendFallBack appends the acknowledgement 'F' with reason (cut to
// MaxReason bytes): the server did nothing, and the relay runs the hook
// itself.
func AppendFallBack(b []byte, reason string) []byte {
	if len(reason) > MaxReason {
		reason = reason[:MaxReason]
	}
	return appendText(append(append(b, Magic...), ackFallBack), reason)
}

// AppendResult appends the result of a hook run: its exit code (0..255)
// and its stderr (the last MaxStderr bytes: the verdict line comes last).
func AppendResult(b []byte, code int, stderr []byte) []byte {
	if code < 0 || code > 255 {
		code = 1 // what a hook that cannot say gets: create-runtime refuses
	}
	if len(stderr) > MaxStderr {
		stderr = stderr[len(stderr)-MaxStderr:]
	}
	b = append(b, tagResult)
	b = binary.LittleEndian.AppendUint32(b, uint32(code))
	return appendText(b, string(stderr))
}

// Ack is an acknowledgement as a relay reads it.
type Ack struct {
	// Accepted: the relay sends GoAhead (or closes), then a result follows.
	// Otherwise the relay falls back, and Reason says why.
	Accepted bool
	Reason   string
}

// ReadAck reads one acknowledgement from r.
func ReadAck(r io.Reader) (Ack, error) {
	d := decoder{r: r, what: "acknowledgement"}
	d.magic()
	var code [1]byte
	d.full(code[:], "code")
	if d.err != nil {
		return Ack{}, d.err
	}
	switch code[0] {
	case ackAccept:
		return Ack{Accepted: true}, nil
	case ackFallBack:
		reason := d.text("reason", MaxReason)
		if d.err != nil {
			return Ack{}, d.err
		}
		return Ack{Reason: reason}, nil
	}
	return Ack{}, malformed("acknowledgement: code %q is neither 'A' nor 'F'", code[0])
}

// Result is a hook run's answer as a relay reads it.
type Result struct {
	Code   int
	Stderr []byte
}

// ReadResult reads one result (after an 'A') from r.
func ReadResult(r io.Reader) (Result, error) {
	d := decoder{r: r, what: "result"}
	var tag [1]byte
	d.full(tag[:], "tag")
	if d.err == nil && tag[0] != tagResult {
		d.err = malformed("result: tag %q is not 'R'", tag[0])
	}
	code := d.count("exit code", 0, 255)
	stderr := d.text("stderr", MaxStderr)
	if d.err != nil {
		return Result{}, d.err
	}
	return Result{Code: int(code), Stderr: []byte(stderr)}, nil
}

func appendText(b []byte, s string) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(s))) //nolint:gosec // every caller bounds s
	return append(b, s...)
}

// decoder reads one message's fields; the first error sticks and makes
// every later read a no-op, so a reader states the message's layout once.
type decoder struct {
	r    io.Reader
	what string // the message, for errors
	read bool   // a field was read
	err  error
}

func (d *decoder) full(p []byte, field string) {
	if d.err != nil {
		return
	}
	if _, err := io.ReadFull(d.r, p); err != nil {
		// io.EOF stays only for a message of which nothing came (a
		// connection closed at once: a probe whether a server answers).
		if errors.Is(err, io.EOF) && (d.read || field != "magic") {
			err = io.ErrUnexpectedEOF
		}
		d.err = fmt.Errorf("%w: %s: %s: %w", ErrMalformed, d.what, field, err)
	}
	d.read = true
}

func (d *decoder) magic() {
	var m [len(Magic)]byte
	d.full(m[:], "magic")
	if d.err == nil && string(m[:]) != Magic {
		d.err = malformed("%s: magic %q is not %q (not a hook relay of this protocol version)", d.what, m[:], Magic)
	}
}

// count reads a u32 and checks it against lo..hi.
func (d *decoder) count(field string, lo, hi uint32) uint32 {
	var b [4]byte
	d.full(b[:], field)
	if d.err != nil {
		return 0
	}
	n := binary.LittleEndian.Uint32(b[:])
	if n < lo || n > hi {
		d.err = malformed("%s: %s %d is out of range %d..%d", d.what, field, n, lo, hi)
		return 0
	}
	return n
}

// text reads a u32 length, at most max, and that many bytes.
func (d *decoder) text(field string, limit uint32) string {
	n := d.count(field+" length", 0, limit)
	if d.err != nil {
		return ""
	}
	p := make([]byte, n)
	d.full(p, field)
	return string(p)
}
