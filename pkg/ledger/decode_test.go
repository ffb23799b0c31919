// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// randomRecord is a journal record with every list present or not at
// random, built from a random state's entries.
func randomRecord(rng *rand.Rand) journalRecord {
	st := randomState(rng)
	r := journalRecord{Gen: rng.Uint64(), Time: time.Unix(rng.Int64N(4e9), rng.Int64N(1e9)).UTC(), NextSeq: rng.Uint64()}
	keys := func() []string {
		var ks []string
		for range rng.IntN(3) {
			ks = append(ks, "GPU-"+st.BootID+string(rune('a'+rng.IntN(26))))
		}
		return ks
	}
	if rng.IntN(2) == 0 {
		r.Claims = st.Claims
	}
	r.ClaimsGone = keys()
	if rng.IntN(2) == 0 {
		r.Reservations = st.Reservations
	}
	r.ResGone = keys()
	if rng.IntN(2) == 0 {
		r.Waiters = st.Waiters
	}
	r.WaitersGone = keys()
	switch rng.IntN(4) {
	case 0:
	case 1:
		x := []Conflict{} // "x":[]: the conflicts were cleared
		r.Conflicts = &x
	case 2:
		var x []Conflict // "x":null
		r.Conflicts = &x
	default:
		x := st.Conflicts
		r.Conflicts = &x
	}
	if rng.IntN(2) == 0 {
		for range rng.IntN(3) {
			r.Cordons = append(r.Cordons, Cordon{Device: gpu(rng.IntN(4)), Source: CordonOperator, Reason: st.Lineage, By: st.BootID, Since: time.Unix(rng.Int64N(4e9), 0).UTC()})
		}
	}
	r.CordonsGone = keys()
	if rng.IntN(2) == 0 {
		a := randomAnchor(rng)
		r.Clock = &a
	}
	return r
}

// The journal record decoder gives exactly what encoding/json gives for
// what json.Marshal writes, and gives up on anything else.
func TestFastRecordDecoderMatchesEncodingJSON(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	for i := 0; i < 400; i++ {
		rec := randomRecord(rng)
		line, err := json.Marshal(rec)
		require.NoError(t, err)
		var slow journalRecord
		require.NoError(t, decodeStrict(line, &slow))
		fast, ok := fastDecodeRecord(line)
		// json.Marshal escapes <, >, & and odd runes: decoded here too.
		require.True(t, ok, "record %d: %s", i, line)
		require.Equal(t, slow, fast, "record %d: %s", i, line)
	}
	rec := journalRecord{Gen: 3, Time: time.Unix(5, 0).UTC(), NextSeq: 9, Claims: sampleState().Claims, WaitersGone: []string{"k"}}
	line, err := json.Marshal(rec)
	require.NoError(t, err)
	_, ok := fastDecodeRecord(line)
	require.True(t, ok, "%s", line)
	for _, other := range [][]byte{
		bytes.Replace(line, []byte(`{"g":`), []byte(`{ "g":`), 1),
		bytes.Replace(line, []byte(`"dw":`), []byte(`"zz":1,"dw":`), 1),
		bytes.Replace(line, []byte(`"g":3`), []byte(`"g":03`), 1),
		bytes.Replace(line, []byte(`"g":3`), []byte(`"G":3`), 1),
		line[:len(line)-1],
		append(bytes.Clone(line), ' '),
	} {
		_, ok := fastDecodeRecord(other)
		require.False(t, ok, "%s", other)
	}
}

// A record decoded from a buffer the reader owns is the same record, its
// strings point into that buffer (no allocation each), and a string that
// had escapes is a copy of its own: nothing points at bytes that mean
// something else.
func TestOwnedRecordStringsPointIntoTheBuffer(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 14))
	for i := 0; i < 200; i++ {
		line, err := json.Marshal(randomRecord(rng))
		require.NoError(t, err)
		want, ok := fastDecodeRecord(line)
		require.True(t, ok)
		buf := bytes.Clone(line)
		got, ok := fastDecodeRecordOf(buf, true)
		require.True(t, ok)
		require.Equal(t, want, got, "record %d: %s", i, line)
	}
	rec := journalRecord{Gen: 1, Time: time.Unix(5, 0).UTC(), NextSeq: 2,
		Claims:      []Claim{{Device: gpu(0), Owner: Owner{ContainerID: "ctr-1", Pod: "a<b", FrontEnd: FrontEndHook}, Since: time.Unix(5, 0).UTC()}},
		WaitersGone: []string{"ns/uid/name"}}
	buf, err := json.Marshal(rec) // "a<b" is written escaped, as \u003c
	require.NoError(t, err)
	got, ok := fastDecodeRecordOf(buf, true)
	require.True(t, ok)
	require.Equal(t, rec, got)
	inBuf := func(s string) bool {
		p := uintptr(unsafe.Pointer(unsafe.StringData(s)))
		start := uintptr(unsafe.Pointer(&buf[0]))
		return p >= start && p < start+uintptr(len(buf))
	}
	require.True(t, inBuf(got.Claims[0].Owner.ContainerID), "a plain string is a slice of the buffer")
	require.True(t, inBuf(got.WaitersGone[0]))
	require.False(t, inBuf(got.Claims[0].Owner.Pod), "an unescaped string must be a copy")
}

// A snapshot's waiters share one string and one slab of devices: appending
// to one waiter's devices must not write into the next one's.
func TestFastDecodedWaitersDoNotShareCapacity(t *testing.T) {
	st := State{BootID: "b", Lineage: "l", Generation: 1, UpdatedAt: time.Unix(1, 0).UTC()}
	for i := range 3 {
		st.Waiters = append(st.Waiters, Waiter{Key: string(rune('a' + i)), Seq: uint64(i + 1),
			Devices: []devices.Device{gpu(i), gpu(i + 1)}, Owner: Owner{ContainerID: "c", FrontEnd: FrontEndHook},
			FirstSeen: time.Unix(1, 0).UTC(), LastSeen: time.Unix(1, 0).UTC()})
	}
	body, err := appendStateJSON(nil, &st)
	require.NoError(t, err)
	got, ok := fastDecodeState(body)
	require.True(t, ok)
	require.Equal(t, st.Waiters, got.Waiters)
	grown := append(got.Waiters[0].Devices, gpu(7))
	grown[0] = gpu(9)
	require.Equal(t, st.Waiters, got.Waiters, "an append to a decoded waiter's devices reached another waiter")
}

// FuzzFastDecodeLedger: wherever the hand-written decoders of the snapshot's
// state line and of a journal record answer, encoding/json (as the ledger
// calls it) accepts the same bytes and gives the same value.
func FuzzFastDecodeLedger(f *testing.F) {
	rng := rand.New(rand.NewPCG(11, 12))
	for range 6 {
		st := randomState(rng)
		body, err := appendStateJSON(nil, &st)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(body)
		line, err := json.Marshal(randomRecord(rng))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(line)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if st, ok := fastDecodeState(data); ok {
			var slow State
			if err := decodeStrict(data, &slow); err != nil {
				t.Fatalf("fast state decoder accepted what encoding/json refuses (%v): %q", err, data)
			}
			require.Equal(t, slow, st, "%q", data)
		}
		if r, ok := fastDecodeRecord(data); ok {
			var slow journalRecord
			if err := decodeStrict(data, &slow); err != nil {
				t.Fatalf("fast record decoder accepted what encoding/json refuses (%v): %q", err, data)
			}
			require.Equal(t, slow, r, "%q", data)
			owned, ok := fastDecodeRecordOf(bytes.Clone(data), true)
			require.True(t, ok, "the owned-buffer decode gave up where the copying one did not: %q", data)
			require.Equal(t, slow, owned, "%q", data)
		}
	})
}

// The byte-wise CRC-32C used for small journals is hash/crc32's Castagnoli,
// at every length and for either choice of crc32cFunc.
func TestCRC32CSmallMatchesHashCRC32(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for n := range 2000 {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		want := crc32.Checksum(b, crc32.MakeTable(crc32.Castagnoli))
		require.Equal(t, want, crc32cSmall(b), "length %d", n)
		require.Equal(t, want, crc32cFunc(crcHardwareMin)(b), "length %d", n)
		require.Equal(t, want, crc32cFunc(0)(b), "length %d", n)
	}
}

// benchState is the state gpu-guard-ctl's process benchmark reads: 32 of 64
// GPUs held and n waiters for two GPUs each.
func benchState(n int) State {
	at := time.Date(2026, 3, 1, 12, 0, 0, 123456789, time.UTC)
	st := State{BootID: testBoot, Lineage: "K5H5HT5E3PIMNNYN7XNXIGNIO7", Generation: 2, NextSeq: uint64(n), UpdatedAt: at}
	dev := func(i int) devices.Device {
		return devices.Device{UUID: fmt.Sprintf("GPU-%08x-0000-4000-8000-000000000000", i), Index: strconv.Itoa(i), Kind: devices.KindGPU}
	}
	for i := range 32 {
		o := Owner{ContainerID: fmt.Sprintf("%064x", i+1), Namespace: "ns", Pod: fmt.Sprintf("holder-%d", i), PodUID: fmt.Sprintf("uid-holder-%d", i),
			Container: "main", FrontEnd: FrontEndNRI}
		st.Claims = append(st.Claims, Claim{Device: dev(i), Owner: o, Source: "env", Since: at})
	}
	for i := range n {
		o := Owner{ContainerID: fmt.Sprintf("%064x", 10_000+i), Namespace: "ns", Pod: fmt.Sprintf("waiter-%d", i), PodUID: fmt.Sprintf("uid-waiter-%d", i),
			Container: "main", FrontEnd: FrontEndNRI}
		st.Waiters = append(st.Waiters, Waiter{Key: "ns/" + o.PodUID + "/main", Seq: uint64(i), Devices: []devices.Device{dev(i % 32), dev((i + 1) % 32)},
			Owner: o, FirstSeen: at.Add(time.Duration(i) * time.Millisecond), LastSeen: at.Add(time.Duration(i) * time.Second)})
	}
	return st
}

// BenchmarkFastDecodeState is the state line's decode alone (no checksum,
// no validation), at 1,000 waiters.
//
//	go test -tags nri_no_wasm -run '^$' -bench FastDecodeState -benchmem ./pkg/ledger/
func BenchmarkFastDecodeState(b *testing.B) {
	st := benchState(1000)
	body, err := appendStateJSON(nil, &st)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if got, ok := fastDecodeState(body); !ok || len(got.Waiters) != 1000 {
			b.Fatal("decode")
		}
	}
}

// parseUTC gives what time.Time's UnmarshalText gives for every time the
// encoder writes, and declines (leaving UnmarshalText to decide) everything
// else it is shown: other forms, offsets, fields out of range.
func TestParseUTCMatchesUnmarshalText(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 14))
	check := func(s string, wantOK bool) {
		t.Helper()
		got, ok := parseUTC([]byte(s))
		require.Equal(t, wantOK, ok, "%q", s)
		if !ok {
			return
		}
		var want time.Time
		require.NoError(t, want.UnmarshalText([]byte(s)), "%q", s)
		require.Equal(t, want, got, "%q", s)
	}
	for range 20000 {
		at := time.Unix(rng.Int64N(253402300800), 0).UTC() // years 1970 to 9999
		switch rng.IntN(4) {
		case 0: // whole seconds: no fraction written
		case 1:
			at = at.Add(time.Duration(rng.IntN(1e9)))
		case 2:
			at = at.Add(time.Duration(rng.IntN(1000)) * time.Millisecond)
		default:
			at = at.Add(time.Duration(rng.IntN(10)) * 100 * time.Millisecond)
		}
		b, err := appendTime(nil, at)
		require.NoError(t, err)
		s := string(b[1 : len(b)-1])
		check(s, true)
		got, _ := parseUTC([]byte(s))
		require.True(t, at.Equal(got) && got.Location() == time.UTC, "%q: %v, want %v", s, got, at)
	}
	for _, s := range []string{
		"0000-01-01T00:00:00Z", "9999-12-31T23:59:59.999999999Z", "2024-02-29T12:00:00Z", "2000-02-29T00:00:00.5Z",
		"2026-03-01T12:00:00.000000001Z", "2026-03-01T12:00:00.100Z", // trailing zeros: not written, still read
	} {
		check(s, true)
	}
	for _, s := range []string{
		"", "2026-03-01T12:00:00", "2026-03-01T12:00:00+00:00", "2026-03-01T12:00:00+01:00", "2026-03-01t12:00:00Z",
		"2026-03-01 12:00:00Z", "2026-3-01T12:00:00Z", "2026-03-01T12:00:00.Z", "2026-03-01T12:00:00.1234567891Z",
		"2026-03-01T12:00:00,5Z", "2026-03-01T12:00:00.5aZ", "+026-03-01T12:00:00Z", "2026-13-01T12:00:00Z",
		"2026-00-01T12:00:00Z", "2026-02-29T12:00:00Z", "1900-02-29T12:00:00Z", "2026-04-31T12:00:00Z",
		"2026-03-00T12:00:00Z", "2026-03-01T24:00:00Z", "2026-03-01T12:60:00Z", "2026-03-01T12:00:60Z",
		"2026-03-01T12:00:0xZ", "2026-03-01T12:00:00ZZ",
	} {
		check(s, false)
	}
}

// The string scanner's word-at-a-time skip stops for every byte that needs
// the byte loop ('"', '\\', control bytes, bytes of multi-byte runes) at
// every position in a word: the decoder answers exactly as encoding/json, or
// gives up.
func TestFastDecoderStringsAtEveryOffset(t *testing.T) {
	for _, special := range []string{`"`, `\\`, `\n`, "\x01", "\x1f", "\x7f", "é", "€", "😀", "\xff", " ", "~"} {
		for pre := range 17 {
			for post := range 9 {
				s := strings.Repeat("a", pre) + special + strings.Repeat("b", post)
				line, err := json.Marshal(s)
				require.NoError(t, err)
				// The raw bytes too, as a state written by hand could hold them.
				for _, quoted := range [][]byte{line, []byte(`"` + s + `"`)} {
					d := fastDecoder{b: quoted}
					got := d.str()
					var want string
					err := json.Unmarshal(quoted, &want)
					if d.bad || d.i != len(quoted) {
						// Gave up: encoding/json decides. Only for what
						// the encoder never writes as it is.
						require.NotContains(t, []string{" ", "~", "\x7f", "é", "€", "😀"}, special, "%q", quoted)
						continue
					}
					require.NoError(t, err, "%q", quoted)
					require.Equal(t, want, got, "%q", quoted)
				}
			}
		}
	}
	// Plain strings of every length end where the quote is.
	for n := range 40 {
		s := strings.Repeat("x", n)
		d := fastDecoder{b: []byte(`"` + s + `",`)}
		require.Equal(t, s, d.str())
		require.False(t, d.bad)
		require.Equal(t, n+2, d.i)
	}
}

// A state decoded from a buffer it owns gives what encoding/json gives, and
// its waiters' strings are the buffer's bytes: no copy of the line.
func TestFastDecodeOwnedBuffer(t *testing.T) {
	rng := rand.New(rand.NewPCG(15, 16))
	for i := range 100 {
		st := randomState(rng)
		body, err := appendStateJSON(nil, &st)
		require.NoError(t, err)
		var slow State
		require.NoError(t, decodeStrict(body, &slow))
		var fast State
		var ok bool
		allocs := testing.AllocsPerRun(1, func() { fast, ok = fastDecodeStateOf(body, true) })
		require.True(t, ok, "state %d: %s", i, body)
		copied := testing.AllocsPerRun(1, func() { _, _ = fastDecodeStateOf(body, false) })
		if len(fast.Waiters) > 0 {
			require.Less(t, allocs, copied, "state %d: the owned buffer was copied", i)
		}
		require.Equal(t, slow, fast, "state %d", i)
		for _, w := range fast.Waiters {
			if w.Key == "" {
				continue
			}
			p := unsafe.StringData(w.Key)
			require.True(t, uintptr(unsafe.Pointer(p)) >= uintptr(unsafe.Pointer(&body[0])) &&
				uintptr(unsafe.Pointer(p)) < uintptr(unsafe.Pointer(&body[0]))+uintptr(len(body)),
				"state %d: waiter key %q is a copy", i, w.Key)
		}
	}
}

// TestFastDecoderUnescapes: a claim's source quotes its variable, so claim
// records carry escapes; the fast decoder decodes them as encoding/json does
// and leaves to it only what it would pair or replace.
func TestFastDecoderUnescapes(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want string
		ok   bool
	}{
		{`"env NVIDIA_VISIBLE_DEVICES=\"0\""`, `env NVIDIA_VISIBLE_DEVICES="0"`, true},
		{`"a\\b\/c"`, `a\b/c`, true},
		{`"\b\f\n\r\t"`, "\b\f\n\r\t", true},
		{`"\u003c\u003E\u0026\u00e9\u2028"`, "<>&\u00e9\u2028", true},
		{`"x\u0000y"`, "x\x00y", true},
		{`"\"é\""`, `"é"`, true},
		{`"\ud83d\ude00"`, "", false}, // a surrogate pair: encoding/json's
		{`"\udc00"`, "", false},       // a lone surrogate: replaced there
		{`"\x41"`, "", false},
		{`"\u12"`, "", false},
		{`"\u12g4"`, "", false},
		{`"a\`, "", false},
		{"\"a\\\n\"", "", false},   // a raw control byte after an escape
		{"\"\\n\xff\"", "", false}, // invalid UTF-8 after an escape
	} {
		for _, share := range []bool{false, true} {
			d := &fastDecoder{b: []byte(tc.in), share: share, s: tc.in}
			got := d.str()
			require.Equal(t, !tc.ok, d.bad, "%q share=%v", tc.in, share)
			if !tc.ok {
				continue
			}
			require.Equal(t, tc.want, got, "%q share=%v", tc.in, share)
			var slow string
			require.NoError(t, json.Unmarshal([]byte(tc.in), &slow))
			require.Equal(t, slow, got, "%q", tc.in)
		}
	}
}
