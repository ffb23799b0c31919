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
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

var trickyStrings = []string{
	"", "plain", `quo"te`, `back\slash`, "html <&>", "ctl \x00\x01\b\f\n\r\t\x1f", "é ü 中文", "line\u2028para\u2029",
	"bad \xff utf8", "\xc3", "emoji 🎉",
}

// fill sets every field of v (recursively) from rng: strings from
// trickyStrings, numbers, times, slices of 0–2 elements. With full, nothing is
// left zero, so that a field the encoder forgets shows up.
func fill(v reflect.Value, rng *rand.Rand, full bool) {
	switch v.Kind() {
	case reflect.String:
		s := trickyStrings[rng.IntN(len(trickyStrings))]
		if full && s == "" {
			s = "x"
		}
		v.SetString(s)
	case reflect.Int, reflect.Int64:
		if full || rng.IntN(2) == 0 {
			v.SetInt(rng.Int64N(1 << 40))
		}
	case reflect.Uint64:
		if full || rng.IntN(2) == 0 {
			v.SetUint(rng.Uint64())
		}
	case reflect.Slice:
		n := rng.IntN(3)
		if full {
			n = 2
		}
		if !full && rng.IntN(4) == 0 {
			return // nil slice
		}
		s := reflect.MakeSlice(v.Type(), n, n)
		for i := 0; i < n; i++ {
			fill(s.Index(i), rng, full)
		}
		v.Set(s)
	case reflect.Struct:
		if v.Type() == reflect.TypeOf(time.Time{}) {
			if full || rng.IntN(3) > 0 {
				v.Set(reflect.ValueOf(time.Unix(rng.Int64N(1<<34), rng.Int64N(1e9)).UTC()))
			}
			return
		}
		for i := 0; i < v.NumField(); i++ {
			fill(v.Field(i), rng, full)
		}
	default:
		panic("fill: unhandled kind " + v.Kind().String() + " — teach the encoder and this test about it")
	}
}

// zeroFields lists the paths of fields left zero in v.
func zeroFields(v reflect.Value, path string) []string {
	switch v.Kind() {
	case reflect.Struct:
		if v.Type() == reflect.TypeOf(time.Time{}) {
			if v.Interface().(time.Time).IsZero() {
				return []string{path}
			}
			return nil
		}
		var out []string
		for i := 0; i < v.NumField(); i++ {
			out = append(out, zeroFields(v.Field(i), path+"."+v.Type().Field(i).Name)...)
		}
		return out
	case reflect.Slice:
		var out []string
		if v.Len() == 0 {
			return []string{path}
		}
		for i := 0; i < v.Len(); i++ {
			out = append(out, zeroFields(v.Index(i), fmt.Sprintf("%s[%d]", path, i))...)
		}
		return out
	default:
		if v.IsZero() {
			return []string{path}
		}
		return nil
	}
}

func TestEncoderMatchesEncodingJSON(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	for i := 0; i < 300; i++ {
		var st State
		full := i == 0
		fill(reflect.ValueOf(&st).Elem(), rng, full)
		if full {
			require.Empty(t, zeroFields(reflect.ValueOf(st), "State"), "the full sample must set every field")
		}
		got, err := appendStateJSON(nil, &st)
		require.NoError(t, err)
		require.Equal(t, string(marshalQueueFirst(t, &st)), string(got))

		// Nothing is lost: what encoding/json makes of its own encoding and
		// of ours is the same (this catches a field the encoder forgets).
		std, err := json.Marshal(&st)
		require.NoError(t, err)
		var want, back State
		require.NoError(t, json.Unmarshal(std, &want))
		require.NoError(t, json.Unmarshal(got, &back))
		require.Equal(t, want, back)
	}
}

// marshalQueueFirst is encoding/json's rendering of st with the queue moved
// to the front, as the ledger writes it.
func marshalQueueFirst(t *testing.T, st *State) []byte {
	t.Helper()
	var b bytes.Buffer
	b.WriteString("{")
	type field struct {
		name string
		v    any
	}
	fields := []field{{"waiters", st.Waiters}, {"claims", st.Claims}, {"reservations", st.Reservations}, {"conflicts", st.Conflicts}}
	if len(st.Cordons) > 0 { // omitempty
		fields = append(fields, field{"cordons", st.Cordons})
	}
	fields = append(fields, []field{{"generation", st.Generation}, {"boot_id", st.BootID}, {"lineage", st.Lineage},
		{"next_seq", st.NextSeq}, {"updated_at", st.UpdatedAt}}...)
	if !st.Clock.IsZero() { // omitzero
		fields = append(fields, field{"clock", st.Clock})
	}
	for i, f := range fields {
		if i > 0 {
			b.WriteString(",")
		}
		v, err := json.Marshal(f.v)
		require.NoError(t, err)
		fmt.Fprintf(&b, "%q:%s", f.name, v)
	}
	b.WriteString("}")
	return b.Bytes()
}

func TestEncoderReusesTheUnchangedQueue(t *testing.T) {
	var e encoder
	st := sampleState()
	first, err := e.encode(&st, nil)
	require.NoError(t, err)
	first = bytes.Clone(first)
	// Same queue array, other changes: the cached prefix is used, and the
	// result is what a fresh encoder makes.
	st.Generation++
	st.Claims = append(st.Claims, Claim{Device: gpu(3), Owner: owner("c3"), Since: st.UpdatedAt})
	cached := e.waitersHash
	again, err := e.encode(&st, first)
	require.NoError(t, err)
	require.Same(t, cached, e.waitersHash, "the queue was not encoded again")
	fresh, err := encodeState(&st)
	require.NoError(t, err)
	require.Equal(t, string(fresh), string(again))
	_, err = DecodeState(again)
	require.NoError(t, err)
	// A changed queue (a new array, as a Tx makes) is encoded anew.
	st.Waiters = append(slices.Clone(st.Waiters), Waiter{Key: "k2", Seq: 2, Devices: devs(gpu(1)), Owner: owner("c9"), FirstSeen: st.UpdatedAt, LastSeen: st.UpdatedAt})
	st.NextSeq = 3
	third, err := e.encode(&st, again)
	require.NoError(t, err)
	fresh, err = encodeState(&st)
	require.NoError(t, err)
	require.Equal(t, string(fresh), string(third))
	got, err := DecodeState(third)
	require.NoError(t, err)
	require.Len(t, got.Waiters, 2)
}

func TestEncoderRefusesUnstorableTimes(t *testing.T) {
	st := State{UpdatedAt: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)}
	_, err := appendStateJSON(nil, &st)
	require.ErrorContains(t, err, "year outside")
	// Any zone is stored as UTC.
	st.UpdatedAt = time.Date(2026, 1, 1, 12, 0, 0, 0, time.FixedZone("x", 3600+7))
	b, err := appendStateJSON(nil, &st)
	require.NoError(t, err)
	require.Contains(t, string(b), `"updated_at":"2026-01-01T10:59:53Z"`)
	require.True(t, bytes.HasPrefix(b, []byte(`{"waiters":null,"claims":null,`)), "the queue comes first")
}

func sampleState() State {
	return State{
		Claims: []Claim{{Device: gpu(0), Owner: owner("c1"), Source: "env", Since: time.Unix(100, 5).UTC()}},
		Waiters: []Waiter{{Key: "ns/uid/ctr", Seq: 1, Devices: devs(gpu(0), mig(1, 0)), Owner: owner("c2"),
			FirstSeen: time.Unix(50, 0).UTC(), LastSeen: time.Unix(60, 0).UTC()}},
		Reservations: []Reservation{{Device: mig(1, 0), For: "ns/uid/ctr", Since: time.Unix(70, 0).UTC(), Until: time.Unix(80, 0).UTC()}},
		Generation:   42,
		BootID:       testBoot,
		Lineage:      testLineage,
		NextSeq:      2,
		UpdatedAt:    time.Unix(100, 5).UTC(),
	}
}

// testLineage is a lineage as newLineage makes them (26 base32 characters).
const testLineage = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

func TestEncodeDecodeRoundTrip(t *testing.T) {
	st := sampleState()
	b, err := encodeState(&st)
	require.NoError(t, err)
	require.True(t, bytes.HasPrefix(b, []byte(fmt.Sprintf(`{"format":%d,"generation":42,`, FormatVersion)+`"boot_id":"`+testBoot+`","lineage":"`+testLineage+`","checksum":"sha256:`)))
	require.True(t, bytes.HasSuffix(b, []byte("}\n")))
	require.Equal(t, 2, bytes.Count(b, []byte("\n")), "a header line and a state line")
	got, err := DecodeState(b)
	require.NoError(t, err)
	require.Equal(t, st, got)

	// A format 1 file (older builds) decodes to the same state.
	legacy, err := DecodeState(legacyFile(t, st))
	require.NoError(t, err)
	st.Lineage = ""
	require.Equal(t, st, legacy)
}

// snapFile assembles a format 2 snapshot from a header and a state line.
func snapFile(t *testing.T, hdr map[string]any, body []byte) []byte {
	t.Helper()
	h, err := json.Marshal(hdr)
	require.NoError(t, err)
	// The format comes first, as every ledger file starts.
	h = append([]byte(fmt.Sprintf(`{"format":%v,`, hdr["format"])), bytes.Replace(h[1:], []byte(fmt.Sprintf(`"format":%v,`, hdr["format"])), nil, 1)...)
	out := append(h, '\n')
	out = append(out, body...)
	return append(out, '\n')
}

func TestDecodeRejects(t *testing.T) {
	st := sampleState()
	good, err := encodeState(&st)
	require.NoError(t, err)
	goodBody := good[bytes.IndexByte(good, '\n')+1 : len(good)-1]
	header := func() map[string]any {
		return map[string]any{"format": FormatVersion, "generation": st.Generation, "boot_id": st.BootID,
			"lineage": st.Lineage, "checksum": checksumOf(goodBody), "bytes": len(goodBody)}
	}
	reheader := func(mut func(h map[string]any)) []byte {
		h := header()
		mut(h)
		return snapFile(t, h, goodBody)
	}
	withBody := func(body []byte) []byte {
		h := header()
		h["checksum"], h["bytes"] = checksumOf(body), len(body)
		return snapFile(t, h, body)
	}
	withState := func(mut func(*State)) []byte {
		s := sampleState()
		mut(&s)
		body, err := json.Marshal(&s)
		require.NoError(t, err)
		return withBody(body)
	}
	for _, tc := range []struct {
		name   string
		data   []byte
		format bool // a *FormatError rather than corruption
		reason string
	}{
		{name: "empty", data: nil, reason: "empty"},
		{name: "whitespace", data: []byte(" \n"), reason: "empty"},
		{name: "NUL-filled", data: make([]byte, 4096), reason: "not a ledger file"},
		{name: "truncated", data: good[:len(good)/2], reason: "truncated"},
		{name: "header only", data: good[:bytes.IndexByte(good, '\n')+1], reason: "truncated"},
		{name: "garbage", data: []byte("\x00\x01garbage"), reason: "not a ledger file"},
		{name: "json array", data: []byte("[1,2]"), reason: "not a ledger file"},
		{name: "over-size", data: append(bytes.Clone(good), make([]byte, maxStateBytes)...), reason: "more than"},
		{name: "newer format", data: reheader(func(h map[string]any) { h["format"] = FormatVersion + 1 }), format: true},
		{name: "format 0", data: reheader(func(h map[string]any) { h["format"] = 0 }), reason: "format version 0"},
		{name: "bad checksum", data: bytes.Replace(good, []byte(`"c1"`), []byte(`"c9"`), 1), reason: "checksum mismatch"},
		{name: "flipped byte", data: func() []byte { b := bytes.Clone(good); b[len(b)-20] ^= 0x01; return b }(), reason: "checksum mismatch"},
		{name: "lineage edited", data: bytes.ReplaceAll(good, []byte(testLineage), []byte("ANOTHERLINEAGEOFTHESAMELEN")), reason: "checksum mismatch"},
		{name: "generation mismatch", data: reheader(func(h map[string]any) { h["generation"] = 41 }), reason: "disagrees"},
		{name: "boot mismatch", data: reheader(func(h map[string]any) { h["boot_id"] = "other" }), reason: "disagrees"},
		{name: "lineage mismatch", data: reheader(func(h map[string]any) { h["lineage"] = "OTHER" }), reason: "disagrees"},
		{name: "length mismatch", data: reheader(func(h map[string]any) { h["bytes"] = len(goodBody) - 1 }), reason: "truncated or appended"},
		{name: "unknown header field", data: reheader(func(h map[string]any) { h["extra"] = 1 }), reason: "unknown field"},
		{name: "unknown state field", data: withBody(append([]byte(`{"future":true,`), goodBody[1:]...)), reason: "unknown field"},
		{name: "unknown field in a claim", data: withBody(bytes.Replace(goodBody, []byte(`"source":`), []byte(`"priority":1,"source":`), 1)), reason: "unknown field \"priority\""},
		{name: "double holder", data: withState(func(s *State) {
			s.Claims = append(s.Claims, Claim{Device: mig(0, 3), Owner: owner("c2"), Since: s.UpdatedAt})
		}), reason: "invariant"},
		{name: "duplicate waiter", data: withState(func(s *State) {
			w := s.Waiters[0]
			w.Seq = 5
			s.NextSeq = 6
			s.Waiters = append(s.Waiters, w)
		}), reason: "queued twice"},
		{name: "reservation on a held device", data: withState(func(s *State) {
			s.Reservations[0].Device = gpu(0)
		}), reason: "invariant"},
		{name: "legacy with an unknown field", data: bytes.Replace(legacyFile(t, st), []byte(`"generation":42,`), []byte(`"generation":42,"x":1,`), 1), reason: "unknown field"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeState(tc.data)
			require.Error(t, err)
			if tc.format {
				var fe *FormatError
				require.ErrorAs(t, err, &fe)
				require.ErrorIs(t, err, ErrUnsupportedFormat)
				require.Equal(t, FormatVersion+1, fe.Version)
				return
			}
			require.ErrorIs(t, err, ErrCorrupt)
			require.Contains(t, err.Error(), tc.reason)
		})
	}
}

func checksumOf(body []byte) string {
	sum := sha256.Sum256(body)
	return checksumPrefix + hex.EncodeToString(sum[:])
}

func FuzzDecode(f *testing.F) {
	st := sampleState()
	good, err := encodeState(&st)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	f.Add(good[:len(good)-10])
	// Format 3: cordons and a draining claim.
	st.Cordons = []Cordon{{Device: gpu(1), Source: CordonOperator, Reason: "reseat", By: "root", Since: time.Unix(9, 0).UTC()}}
	st.Claims[0].Owner.DrainingSince = time.Unix(10, 0).UTC()
	withCordon, err := encodeState(&st)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(withCordon)
	f.Add(append(formatPrefix(2), withCordon[len(formatPrefix(FormatVersion)):]...))
	// Format 4: the clock anchor; format 3, before it.
	st.Clock = ClockAnchor{Wall: time.Unix(11, 0).UTC(), Boot: 5 * time.Second}
	withClock, err := encodeState(&st)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(withClock)
	f.Add(append(formatPrefix(3), withCordon[len(formatPrefix(FormatVersion)):]...))
	f.Add([]byte(`{"format":1,"generation":0,"boot_id":"","checksum":"sha256:","state":{}}`))
	f.Add([]byte(`{"format":2,"generation":0,"boot_id":"","lineage":"","checksum":"sha256:","bytes":2}` + "\n{}\n"))
	f.Add([]byte(`{"format":99}`))
	f.Add([]byte("null"))
	f.Fuzz(func(t *testing.T, data []byte) {
		st, err := DecodeState(data)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrUnsupportedFormat) {
				t.Fatalf("decode error %v wraps neither ErrCorrupt nor ErrUnsupportedFormat", err)
			}
			return
		}
		// Whatever decodes is a valid state and encodes back to a file that
		// decodes to the same state.
		if err := validateState(&st); err != nil {
			t.Fatalf("decoded an invalid state: %v", err)
		}
		b, err := encodeState(&st)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		back, err := DecodeState(b)
		if err != nil {
			t.Fatalf("re-decode: %v", err)
		}
		if !reflect.DeepEqual(normalizeForCompare(t, st), normalizeForCompare(t, back)) {
			t.Fatalf("round trip changed the state")
		}
	})
}

// normalizeForCompare is what a state looks like after one trip through the
// file: times in UTC, invalid UTF-8 as U+FFFD.
func normalizeForCompare(t *testing.T, st State) State {
	b, err := appendStateJSON(nil, &st)
	if err != nil {
		t.Fatalf("encode: %v", err)
	}
	var out State
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("decode: %v", err)
	}
	return out
}

// The hand-written decoder gives exactly what encoding/json gives for what
// the encoder writes, and gives up (encoding/json then decides) on anything
// else.
func TestFastDecoderMatchesEncodingJSON(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	for i := 0; i < 300; i++ {
		st := randomState(rng)
		body, err := appendStateJSON(nil, &st)
		require.NoError(t, err)
		fast, ok := fastDecodeState(body)
		require.True(t, ok, "state %d: %s", i, body)
		var slow State
		require.NoError(t, decodeStrict(body, &slow))
		require.Equal(t, slow, fast, "state %d", i)
	}
	st := sampleState()
	body, err := appendStateJSON(nil, &st)
	require.NoError(t, err)
	// An escape is decoded as encoding/json decodes it.
	escaped := bytes.Replace(body, []byte(`"c1"`), []byte(`"c\u0031"`), 1)
	fast, ok := fastDecodeState(escaped)
	require.True(t, ok, "%s", escaped)
	var slow State
	require.NoError(t, decodeStrict(escaped, &slow))
	require.Equal(t, slow, fast)
	require.Equal(t, "c1", fast.Claims[0].Owner.ContainerID)
	for _, other := range [][]byte{
		bytes.Replace(body, []byte(`{"waiters":`), []byte(`{ "waiters":`), 1),
		bytes.Replace(body, []byte(`"c1"`), []byte(`"c\ud800"`), 1), // encoding/json replaces it
		bytes.Replace(body, []byte(`"source":`), []byte(`"x":1,"source":`), 1),
		body[:len(body)-1],
		append(bytes.Clone(body), ' '),
	} {
		_, ok := fastDecodeState(other)
		require.False(t, ok, "%s", other)
	}
}

// randomState is a valid-looking state with the optional fields set at
// random, odd characters included.
func randomState(rng *rand.Rand) State {
	str := func() string {
		const alphabet = "abcXYZ019-_/.:é€😀 "
		n := rng.IntN(12)
		var b []rune
		for range n {
			r := []rune(alphabet)
			b = append(b, r[rng.IntN(len(r))])
		}
		return string(b)
	}
	when := func() time.Time {
		if rng.IntN(4) == 0 {
			return time.Time{}
		}
		return time.Unix(rng.Int64N(4e9), rng.Int64N(1e9)).UTC()
	}
	dev := func() devices.Device {
		d := devices.Device{UUID: "GPU-" + str(), Index: str(), Kind: devices.KindGPU}
		if rng.IntN(2) == 0 {
			d.Kind, d.Parent = devices.KindMIG, "GPU-"+str()
		}
		return d
	}
	own := func() Owner {
		return Owner{ContainerID: "c" + str(), Container: str(), Namespace: str(), Pod: str(), PodUID: str(),
			PodSandboxID: str(), FrontEnd: FrontEnd(str()), Pid: rng.IntN(3) * rng.IntN(1<<20), PidStart: uint64(rng.IntN(3)) * rng.Uint64(),
			Cgroup: str(), StartedAt: when(), StoppedAt: when()}
	}
	st := State{Generation: rng.Uint64(), BootID: str(), Lineage: str(), NextSeq: rng.Uint64(), UpdatedAt: when()}
	lists := rng.IntN(4)
	for range rng.IntN(4) {
		st.Claims = append(st.Claims, Claim{Device: dev(), Owner: own(), Source: str(), Since: when()})
	}
	for range rng.IntN(4) {
		w := Waiter{Key: str(), Seq: rng.Uint64(), Owner: own(), FirstSeen: when(), LastSeen: when()}
		switch rng.IntN(3) {
		case 0:
		case 1:
			w.Devices = []devices.Device{}
		default:
			w.Devices = []devices.Device{dev(), dev()}
		}
		st.Waiters = append(st.Waiters, w)
	}
	for range rng.IntN(3) {
		st.Reservations = append(st.Reservations, Reservation{Device: dev(), For: str(), Since: when(), Until: when()})
	}
	for range rng.IntN(3) {
		st.Conflicts = append(st.Conflicts, Conflict{Device: dev(), Owner: own(), Since: when()})
	}
	if lists == 0 { // empty, not null
		st.Claims, st.Waiters, st.Reservations, st.Conflicts = []Claim{}, []Waiter{}, []Reservation{}, []Conflict{}
	}
	if rng.IntN(2) == 0 {
		st.Clock = randomAnchor(rng)
	}
	return st
}

// randomAnchor is a clock anchor, its boot reading 0 at times (a wall time
// alone is an anchor too).
func randomAnchor(rng *rand.Rand) ClockAnchor {
	return ClockAnchor{Wall: time.Unix(rng.Int64N(4e9), rng.Int64N(1e9)).UTC(), Boot: time.Duration(rng.Int64N(3) * rng.Int64N(1<<62))}
}
