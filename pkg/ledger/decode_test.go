// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"encoding/json"
	"hash/crc32"
	"math/rand/v2"
	"testing"
	"time"

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
		if bytes.Contains(line, []byte(`\`)) {
			// json.Marshal escapes <, >, & and odd runes: encoding/json's.
			require.False(t, ok, "record %d: %s", i, line)
			continue
		}
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
