// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hookserve

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRequestRoundTrip(t *testing.T) {
	for _, q := range []Request{
		{Args: []string{"create-runtime"}},
		{Args: []string{"create-runtime", "--wait", ""}, Env: []string{"NRI_GPU_GUARD_CONFIG=/etc/x.toml"}, Stdin: []byte(`{"id":"c1"}`)},
		{Args: make([]string, MaxArgs), Env: []string{"A=" + strings.Repeat("v", MaxEnvLen-2)}, Stdin: bytes.Repeat([]byte{0}, MaxStdin)},
		{Args: []string{strings.Repeat("a", MaxArgLen)}, Env: []string{"A=", "B=", "C=", "D=", "E=", "F=", "G=", "H=="}},
	} {
		b, err := AppendRequest(nil, q)
		require.NoError(t, err)
		got, err := ReadRequest(bytes.NewReader(b))
		require.NoError(t, err)
		if len(q.Stdin) == 0 {
			q.Stdin = []byte{}
		}
		require.Equal(t, q, got)
	}
}

// u32 is n as the protocol writes it.
func u32(n uint32) []byte { return binary.LittleEndian.AppendUint32(nil, n) }

// text is s with its length.
func text(s string) []byte { return append(u32(uint32(len(s))), s...) }

func cat(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

// TestReadRequestBounds: every count and length one past its bound, and a
// message cut anywhere, is refused with an error naming the field, before
// anything of the claimed size is read.
func TestReadRequestBounds(t *testing.T) {
	arg := text("poststop")
	for _, tc := range []struct {
		name    string
		msg     []byte
		wantErr string
	}{
		{name: "bad magic", msg: cat([]byte("GGHX"), u32(1), arg, u32(0), u32(0)), wantErr: `magic "GGHX" is not "GGH2"`},
		// A relay of protocol version 1 (no go-ahead) is not answered: it
		// falls back, as it does for any server that does not answer.
		{name: "version 1", msg: cat([]byte("GGH1"), u32(1), arg, u32(0), u32(0)), wantErr: `magic "GGH1" is not "GGH2"`},
		{name: "no argument", msg: cat([]byte(Magic), u32(0), u32(0), u32(0)), wantErr: "argc 0 is out of range 1..32"},
		{name: "argc 33", msg: cat([]byte(Magic), u32(MaxArgs+1)), wantErr: "argc 33 is out of range 1..32"},
		{name: "argument 4097 bytes", msg: cat([]byte(Magic), u32(2), arg, u32(MaxArgLen+1)), wantErr: "argument 1 length 4097 is out of range 0..4096"},
		{name: "envc 9", msg: cat([]byte(Magic), u32(1), arg, u32(MaxEnv+1)), wantErr: "envc 9 is out of range 0..8"},
		{name: "environment entry 8193 bytes", msg: cat([]byte(Magic), u32(1), arg, u32(1), u32(MaxEnvLen+1)),
			wantErr: "environment entry 0 length 8193 is out of range 0..8192"},
		{name: "environment entry without =", msg: cat([]byte(Magic), u32(1), arg, u32(1), text("NAME"), u32(0)),
			wantErr: "environment entry 0 has no '='"},
		{name: "stdin 1 MiB + 2", msg: cat([]byte(Magic), u32(1), arg, u32(0), u32(MaxStdin+1)), wantErr: "stdin_len 1048578 is out of range 0..1048577"},
		{name: "empty", msg: nil, wantErr: "magic: EOF"},
		{name: "cut in the magic", msg: []byte("GG"), wantErr: "magic: unexpected EOF"},
		{name: "cut in an argument", msg: cat([]byte(Magic), u32(1), u32(8), []byte("post")), wantErr: "argument 0: unexpected EOF"},
		{name: "cut before the stdin length", msg: cat([]byte(Magic), u32(1), arg, u32(0)), wantErr: "stdin_len: unexpected EOF"},
		{name: "stdin shorter than said", msg: cat([]byte(Magic), u32(1), arg, u32(0), u32(10), []byte("{}")), wantErr: "stdin: unexpected EOF"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ReadRequest(bytes.NewReader(tc.msg))
			require.ErrorIs(t, err, ErrMalformed)
			require.ErrorContains(t, err, "request: "+tc.wantErr)
		})
	}
	// The bounds themselves pass: argc 32, an argument of 4096 bytes, 8
	// entries of 8192, 1 MiB + 1 of stdin (TestRequestRoundTrip), and the
	// encoder refuses what the decoder would.
	for _, q := range []Request{
		{},
		{Args: make([]string, MaxArgs+1)},
		{Args: []string{strings.Repeat("a", MaxArgLen+1)}},
		{Args: []string{"x"}, Env: make([]string, MaxEnv+1)},
		{Args: []string{"x"}, Env: []string{strings.Repeat("a", MaxEnvLen+1)}},
		{Args: []string{"x"}, Stdin: make([]byte, MaxStdin+1)},
	} {
		_, err := AppendRequest(nil, q)
		require.ErrorIs(t, err, ErrMalformed)
	}
}

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n int
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += n
	return n, err
}

// TestReadRequestStopsAtTheBound: a request that claims more than a bound
// is refused having read no more than the claim itself.
func TestReadRequestStopsAtTheBound(t *testing.T) {
	msg := cat([]byte(Magic), u32(1), text("poststop"), u32(0), u32(MaxStdin+1), make([]byte, MaxStdin+1))
	r := &countingReader{r: bytes.NewReader(msg)}
	_, err := ReadRequest(r)
	require.ErrorIs(t, err, ErrMalformed)
	require.Equal(t, len(Magic)+4+4+len("poststop")+4+4, r.n)
}

func TestAnswers(t *testing.T) {
	b := AppendAccept(nil)
	b = AppendResult(b, 75, []byte("busy\n"))
	r := bytes.NewReader(b)
	ack, err := ReadAck(r)
	require.NoError(t, err)
	require.Equal(t, Ack{Accepted: true}, ack)
	res, err := ReadResult(r)
	require.NoError(t, err)
	require.Equal(t, Result{Code: 75, Stderr: []byte("busy\n")}, res)
	require.Zero(t, r.Len(), "nothing after the result")

	ack, err = ReadAck(bytes.NewReader(AppendFallBack(nil, "too many")))
	require.NoError(t, err)
	require.Equal(t, Ack{Reason: "too many"}, ack)

	// Bounds: a reason is cut to 4096 bytes, stderr keeps its last 65536,
	// an exit code out of 0..255 is sent as 1.
	ack, err = ReadAck(bytes.NewReader(AppendFallBack(nil, strings.Repeat("r", MaxReason+1))))
	require.NoError(t, err)
	require.Len(t, ack.Reason, MaxReason)
	long := append(bytes.Repeat([]byte("p"), MaxStderr), "verdict\n"...)
	res, err = ReadResult(bytes.NewReader(AppendResult(nil, 256, long)))
	require.NoError(t, err)
	require.Equal(t, 1, res.Code)
	require.Len(t, res.Stderr, MaxStderr)
	require.True(t, bytes.HasSuffix(res.Stderr, []byte("verdict\n")), "the verdict line, last, is kept")

	for _, tc := range []struct {
		name    string
		read    func(io.Reader) error
		msg     []byte
		wantErr string
	}{
		{name: "ack code", read: readAck, msg: []byte(Magic + "X"), wantErr: "code 'X' is neither 'A' nor 'F'"},
		{name: "ack magic", read: readAck, msg: []byte("GGH0A"), wantErr: "magic"},
		{name: "reason 4097", read: readAck, msg: cat([]byte(Magic+"F"), u32(MaxReason+1)), wantErr: "reason length 4097 is out of range 0..4096"},
		{name: "result tag", read: readResult, msg: cat([]byte("Q"), u32(0), u32(0)), wantErr: "tag 'Q' is not 'R'"},
		{name: "exit code 256", read: readResult, msg: cat([]byte("R"), u32(256), u32(0)), wantErr: "exit code 256 is out of range 0..255"},
		{name: "stderr 65537", read: readResult, msg: cat([]byte("R"), u32(0), u32(MaxStderr+1)), wantErr: "stderr length 65537 is out of range 0..65536"},
		{name: "result cut", read: readResult, msg: cat([]byte("R"), u32(0), u32(5), []byte("ab")), wantErr: "stderr: unexpected EOF"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.read(bytes.NewReader(tc.msg))
			require.ErrorIs(t, err, ErrMalformed)
			require.ErrorContains(t, err, tc.wantErr)
		})
	}
}

func readAck(r io.Reader) error    { _, err := ReadAck(r); return err }
func readResult(r io.Reader) error { _, err := ReadResult(r); return err }

// FuzzReadRequest: any input either decodes to a request within every
// bound that encodes back to the very bytes it was read from, or is
// refused as malformed.
func FuzzReadRequest(f *testing.F) {
	for _, q := range []Request{
		{Args: []string{"create-runtime"}},
		{Args: []string{"poststop", "--config", "/c"}, Env: []string{"NRI_GPU_GUARD_CONFIG=/x"}, Stdin: []byte(`{"id":"a"}`)},
	} {
		b, err := AppendRequest(nil, q)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Add([]byte(Magic))
	f.Add(cat([]byte(Magic), u32(MaxArgs+1)))
	f.Fuzz(func(t *testing.T, data []byte) {
		r := bytes.NewReader(data)
		q, err := ReadRequest(r)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error not marked malformed: %v", err)
			}
			return
		}
		if len(q.Args) < 1 || len(q.Args) > MaxArgs || len(q.Env) > MaxEnv || len(q.Stdin) > MaxStdin {
			t.Fatalf("out of bounds: %d args, %d env, %d stdin", len(q.Args), len(q.Env), len(q.Stdin))
		}
		b, err := AppendRequest(nil, q)
		if err != nil {
			t.Fatalf("a decoded request does not encode: %v", err)
		}
		if consumed := len(data) - r.Len(); !bytes.Equal(b, data[:consumed]) {
			t.Fatalf("re-encoding differs from the %d bytes read", consumed)
		}
	})
}
