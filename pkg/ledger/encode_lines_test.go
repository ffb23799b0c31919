// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// oddStrings are strings encoding/json escapes or replaces, and plain ones.
var oddStrings = []string{"", "plain", `say "hi"`, `back\slash`, "<tag>&amp;", "tab\there\nnl", "\x01\x1f",
	"ünïcödé", "\u2028\u2029", "bad\xffutf8", "/usr/lib/x86_64", "GPU-6c1a2f2e-0000-4000-8000-000000000000"}

func oddString(rng *rand.Rand) string { return oddStrings[rng.IntN(len(oddStrings))] }

// The journal record, marker and audit line encoders write exactly what
// encoding/json writes for the same value, so that every reader (and the
// decoders that accept only that shape) reads them as before.
func TestLineEncodersMatchEncodingJSON(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	for i := 0; i < 400; i++ {
		rec := randomRecord(rng)
		if i%3 == 0 && len(rec.Claims) > 0 {
			rec.Claims[0].Source = oddString(rng)
			rec.Claims[0].Owner.Pod = oddString(rng)
		}
		want, err := appendJournalLine([]byte("prefix"), rec)
		require.NoError(t, err)
		got, err := appendRecordLine([]byte("prefix"), &rec)
		require.NoError(t, err)
		require.Equal(t, string(want), string(got), "record %d", i)
		lines, _, torn, err := journalLines(got[len("prefix"):], 0)
		require.NoError(t, err)
		require.Equal(t, int64(-1), torn)
		require.Len(t, lines, 1)
	}

	for i := 0; i < 200; i++ {
		m := marker{Dir: "/var/lib/nri-gpu-guard/" + oddString(rng), BootID: oddString(rng), Lineage: oddString(rng), Generation: rng.Uint64() >> rng.IntN(64)}
		want, err := appendJournalLine(nil, m)
		require.NoError(t, err)
		got := appendMarkerLine(nil, &m)
		require.Equal(t, string(want), string(got), "marker %d", i)
	}

	for i := 0; i < 400; i++ {
		r := AuditRecord{Time: time.Unix(rng.Int64N(4e9), rng.Int64N(1e9)).UTC(), Op: oddString(rng), Generation: rng.Uint64(), Pid: rng.IntN(1<<22) - 1<<10}
		if rng.IntN(4) == 0 {
			r.Time = r.Time.In(time.FixedZone("", 3600*(rng.IntN(24)-12))) // kept in its zone, as MarshalJSON does
		}
		for range rng.IntN(3) {
			r.Devices = append(r.Devices, oddString(rng))
		}
		if rng.IntN(5) == 0 {
			r.Devices = []string{} // omitempty: not written
		}
		for _, f := range []*string{&r.ContainerID, &r.Key, &r.Namespace, &r.Pod, &r.Container, &r.FrontEnd, &r.Reason} {
			if rng.IntN(2) == 0 {
				*f = oddString(rng)
			}
		}
		var want bytes.Buffer
		require.NoError(t, json.NewEncoder(&want).Encode(&r))
		got, err := appendAuditLine([]byte("x"), &r)
		require.NoError(t, err)
		require.Equal(t, "x"+want.String(), string(got), "audit record %d", i)
	}
	// What MarshalJSON refuses is refused.
	_, err := appendAuditLine(nil, &AuditRecord{Time: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)})
	require.Error(t, err)
}

// The marker and journal header decoders give what encoding/json gives for
// what the encoders write, and give up (encoding/json decides) on anything
// else.
// requireFastDecodes: fast decodes what json.Marshal writes of v (escapes
// included: Marshal never writes the surrogate escapes fast leaves to
// encoding/json) into what encoding/json decodes.
func requireFastDecodes[T any](t *testing.T, v T, fast func([]byte) (T, bool)) {
	t.Helper()
	js, err := json.Marshal(v)
	require.NoError(t, err)
	var slow T
	require.NoError(t, decodeStrict(js, &slow))
	got, ok := fast(js)
	require.True(t, ok, "%s", js)
	require.Equal(t, slow, got, "%s", js)
}

func TestLineDecodersMatchEncodingJSON(t *testing.T) {
	rng := rand.New(rand.NewPCG(23, 24))
	for i := 0; i < 200; i++ {
		m := marker{Dir: "/var/lib/g/" + oddString(rng), BootID: oddString(rng), Lineage: oddString(rng), Generation: rng.Uint64() >> rng.IntN(64)}
		requireFastDecodes(t, m, fastDecodeMarker)
	}
	for i := 0; i < 200; i++ {
		h := journalHeader{Journal: rng.IntN(4), Lineage: oddString(rng), BootID: oddString(rng), Base: rng.Uint64() >> rng.IntN(64),
			Genesis: rng.IntN(2) == 0}
		if rng.IntN(2) == 0 {
			h.BaseNextSeq = rng.Uint64() >> rng.IntN(64)
		}
		if rng.IntN(2) == 0 {
			a := randomAnchor(rng)
			h.BaseClock = &a
		}
		requireFastDecodes(t, h, fastDecodeHeader)
	}
	hdr := []byte(`{"journal":2,"lineage":"l","boot_id":"b","base":3,"genesis":true,"base_next_seq":4}`)
	_, ok := fastDecodeHeader(hdr)
	require.True(t, ok)
	for _, other := range []string{
		strings.Replace(string(hdr), `"base":3`, `"base":03`, 1),
		strings.Replace(string(hdr), `"base_next_seq":4`, `"base_next_seq":0`, 1),
		strings.Replace(string(hdr), `"genesis":true`, `"genesis":false`, 1),
		strings.Replace(string(hdr), `{"journal"`, `{ "journal"`, 1),
		strings.Replace(string(hdr), `}`, `,"extra":1}`, 1),
		string(hdr[:len(hdr)-1]),
		string(hdr) + " ",
	} {
		_, ok := fastDecodeHeader([]byte(other))
		require.False(t, ok, "%s", other)
	}
	mk := []byte(`{"dir":"/d","boot_id":"b","lineage":"l","generation":7}`)
	m, ok := fastDecodeMarker(mk)
	require.True(t, ok)
	require.Equal(t, marker{Dir: "/d", BootID: "b", Lineage: "l", Generation: 7}, m)
	m, ok = fastDecodeMarker([]byte(strings.Replace(string(mk), `"dir":"/d"`, `"dir":"/\u0064"`, 1)))
	require.True(t, ok, "an escape is decoded as encoding/json decodes it")
	require.Equal(t, "/d", m.Dir)
	for _, other := range []string{
		strings.Replace(string(mk), `"generation":7`, `"generation":-7`, 1),
		strings.Replace(string(mk), `"generation":7`, `"generation":99999999999999999999999`, 1),
		strings.Replace(string(mk), `"dir":"/d"`, `"dir":"/\ud800"`, 1), // encoding/json replaces a lone surrogate
		strings.Replace(string(mk), `"dir"`, `"Dir"`, 1),
		string(mk[:len(mk)-1]),
	} {
		_, ok := fastDecodeMarker([]byte(other))
		require.False(t, ok, "%s", other)
	}
}

// Committed is what the handle's last Update committed, read from nothing:
// another handle's later commit shows only once this one reads again.
func TestCommittedIsWhatTheLastUpdateCommitted(t *testing.T) {
	l := openTest(t, nil)
	_, ok := l.Committed()
	require.False(t, ok, "nothing read or written yet")
	owner := Owner{ContainerID: "c1", FrontEnd: FrontEndHook}
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("c1", owner, []devices.Device{gpu(0)}, "test")
		require.NoError(t, err)
	})
	st, ok := l.Committed()
	require.True(t, ok)
	require.Equal(t, map[string]string{gpu(0).UUID: "c1"}, holders(st))
	require.Equal(t, snapshot(t, l).Generation, st.Generation)

	other, err := Open(l.Dir(), testOptions(nil))
	require.NoError(t, err)
	update(t, other, func(tx *Tx) { tx.Release("c1", "test") })
	st, ok = l.Committed()
	require.True(t, ok)
	require.Len(t, st.Claims, 1, "no read since")
	require.Empty(t, snapshot(t, l).Claims)
	st, ok = l.Committed()
	require.True(t, ok)
	require.Empty(t, st.Claims, "the read refreshed it")
}
