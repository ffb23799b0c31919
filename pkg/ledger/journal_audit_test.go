// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// randomAudit is a commit's audit records with odd strings, as audit.log
// and its journal record get them.
func randomAudit(rng *rand.Rand) []AuditRecord {
	recs := make([]AuditRecord, 1+rng.IntN(3))
	for i := range recs {
		r := AuditRecord{Time: time.Unix(rng.Int64N(4e9), rng.Int64N(1e9)).UTC(), Op: oddString(rng), Generation: rng.Uint64(), Pid: rng.IntN(1<<22) - 1<<10}
		if rng.IntN(4) == 0 {
			r.Time = r.Time.In(time.FixedZone("", 3600*(rng.IntN(24)-12)))
		}
		for range rng.IntN(3) {
			r.Devices = append(r.Devices, oddString(rng))
		}
		for _, f := range []*string{&r.ContainerID, &r.Key, &r.Namespace, &r.Pod, &r.Container, &r.FrontEnd, &r.Reason} {
			if rng.IntN(2) == 0 {
				*f = oddString(rng)
			}
		}
		recs[i] = r
	}
	return recs
}

// A journal record's audit records ("a") are written as json.Marshal
// writes the record, decoded by the fast decoder as encoding/json decodes
// them (a json.RawMessage, never parsed on replay), a slice of the buffer
// when the reader owns it, and they are the records audit.log gets.
func TestJournalAuditEncodesAndDecodesAsEncodingJSON(t *testing.T) {
	rng := rand.New(rand.NewPCG(31, 32))
	for i := 0; i < 300; i++ {
		rec := randomRecord(rng)
		audit := randomAudit(rng)
		lines, err := appendAuditLines(nil, audit)
		require.NoError(t, err)
		rec.Audit, err = journalAudit(nil, audit, lines)
		require.NoError(t, err)
		var back []AuditRecord
		require.NoError(t, json.Unmarshal(rec.Audit, &back))
		var inLog []AuditRecord
		for _, line := range bytes.SplitAfter(lines, []byte("\n")) {
			if len(line) > 0 {
				var r AuditRecord
				require.NoError(t, json.Unmarshal(line, &r))
				inLog = append(inLog, r)
			}
		}
		require.Equal(t, inLog, back, "record %d: the records audit.log gets, from the journal", i)

		want, err := appendJournalLine(nil, rec)
		require.NoError(t, err)
		got, err := appendRecordLine(nil, &rec)
		require.NoError(t, err)
		require.Equal(t, string(want), string(got), "record %d", i)

		js := got[9 : len(got)-1]
		var slow journalRecord
		require.NoError(t, decodeStrict(js, &slow))
		fast, ok := fastDecodeRecord(js)
		require.True(t, ok, "record %d: %s", i, js)
		require.Equal(t, slow, fast, "record %d", i)
		buf := bytes.Clone(js)
		owned, ok := fastDecodeRecordOf(buf, true)
		require.True(t, ok)
		require.Equal(t, slow, owned)
		p := uintptr(unsafe.Pointer(unsafe.SliceData(owned.Audit)))
		start := uintptr(unsafe.Pointer(&buf[0]))
		require.True(t, p >= start && p < start+uintptr(len(buf)), "an owned buffer's audit list is a slice of it")
		require.Equal(t, len(owned.Audit), cap(owned.Audit), "capped: an append copies")
	}
}

// The fast decoder passes only over lists of the shape appendAuditLine
// writes; anything else is left to encoding/json, which decides.
func TestJournalAuditOfAnotherShapeIsLeftToEncodingJSON(t *testing.T) {
	for _, a := range []string{
		`null`, `{}`, `"x"`, `[1]`, `[{"op":1.5}]`, `[{"op":true}]`, `[{"op":{"x":1}}]`, `[{"op":[1]}]`,
		`[{"op":"\ud800"}]`, `[{"op":"a"},]`, `[{"op":"a"}`, `[{"op" :"a"}]`, `[{"op":"a"} ]`, `[{"g":01}]`,
	} {
		line := []byte(`{"g":3,"t":"2026-03-01T12:00:00Z","seq":1,"a":` + a + `}`)
		_, ok := fastDecodeRecord(line)
		require.False(t, ok, "%s", line)
		var slow journalRecord
		if err := decodeStrict(line, &slow); err == nil {
			require.JSONEq(t, a, string(slow.Audit))
		}
	}
	line := []byte(`{"g":3,"t":"2026-03-01T12:00:00Z","seq":1,"a":[]}`)
	r, ok := fastDecodeRecord(line)
	require.True(t, ok)
	require.Equal(t, json.RawMessage(`[]`), r.Audit)
}

// A commit that writes more audit records than a journal record holds
// (thousands of waiters dropped at once) keeps the first ones and a
// record that says what was left out: the record line stays far below
// what a reader accepts.
func TestJournalAuditIsBounded(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	recs := make([]AuditRecord, 6000)
	for i := range recs {
		recs[i] = AuditRecord{Time: now, Op: OpExpired, Key: fmt.Sprintf("ns/uid-%d/ctr", i), Namespace: "ns", Pod: fmt.Sprintf("pod-%d", i),
			Container: "ctr", Reason: strings.Repeat("not seen for queue_ttl ", 8), Generation: 9, Pid: 7}
	}
	recs[5999].Op = OpDequeue
	lines, err := appendAuditLines(nil, recs)
	require.NoError(t, err)
	require.Greater(t, len(lines), maxJournalAudit)
	list, err := journalAudit(nil, recs, lines)
	require.NoError(t, err)
	require.Less(t, len(list), maxJournalAudit+1024)
	var back []AuditRecord
	require.NoError(t, json.Unmarshal(list, &back))
	kept := len(back) - 1
	require.Equal(t, recs[:kept], back[:kept])
	note := back[kept]
	require.Equal(t, OpAuditLost, note.Op)
	require.Equal(t, uint64(9), note.Generation)
	require.Contains(t, note.Reason, fmt.Sprintf("%d more audit record(s) of this commit (expired ×%d, dequeue ×1)", 6000-kept, 5999-kept))
	require.Equal(t, appendAuditLinesOK(t, recs), string(lines), "what audit.log gets is whole")
}

func appendAuditLinesOK(t *testing.T, recs []AuditRecord) string {
	t.Helper()
	b, err := appendAuditLines(nil, recs)
	require.NoError(t, err)
	return string(b)
}

// A writer reads the generation of the audit log's last record from its
// end: before a torn tail (left as it is) or an unfinished record a newline
// ended since, from a whole record that lacks only its newline, past a
// last line longer than the first read, from audit.log.1 while audit.log is
// empty (a rotation) or holds nothing but an unfinished line, before an
// unfinished line there too (a rotation of a log that ended inside a line),
// and not at all when the last line is not a record.
func TestAuditLogKnowsTheGenerationOfItsLastRecord(t *testing.T) {
	rec := func(g uint64, reason string) string {
		return appendAuditLinesOK(t, []AuditRecord{{Time: time.Unix(5, 0).UTC(), Op: OpClaim, Reason: reason, Generation: g, Pid: 42}})
	}
	for _, c := range []struct {
		name         string
		log, rotated string
		noRotated    bool
		last         uint64
		known, none  bool
		torn, torn1  int64
		midLine      bool
	}{
		{name: "plain", log: rec(3, "a") + rec(4, "b"), noRotated: true, last: 4, known: true},
		{name: "torn tail", log: rec(3, "a") + rec(4, "b") + `{"time":"2026`, noRotated: true, last: 4, known: true, torn: 13, midLine: true},
		{name: "torn tail ended", log: rec(3, "a") + rec(4, "b") + `{"time":"2026` + "\n", noRotated: true, last: 4, known: true, torn: 13},
		{name: "torn tail ended, torn again", log: rec(3, "a") + rec(4, "b") + `{"time":"2026` + "\n" + `{"ti`, noRotated: true, last: 4,
			known: true, torn: 4, midLine: true},
		{name: "a whole record without its newline", log: rec(3, "a") + strings.TrimSuffix(rec(4, "b"), "\n"), noRotated: true, last: 4,
			known: true, midLine: true},
		{name: "long last line", log: rec(3, "a") + rec(4, strings.Repeat("x", 3*auditTailRead)), noRotated: true, last: 4, known: true},
		{name: "one long line", log: rec(7, strings.Repeat("x", 3*auditTailRead)), noRotated: true, last: 7, known: true},
		{name: "rotated", log: "", rotated: rec(5, "a") + rec(6, "b"), last: 6, known: true},
		{name: "rotated inside a line", log: "", rotated: rec(5, "a") + rec(6, "b") + `{"time":"2026`, last: 6, known: true, torn1: 13},
		{name: "rotated with an unfinished line ended", log: "", rotated: rec(5, "a") + rec(6, "b") + `{"time":"2026` + "\n", last: 6, known: true,
			torn1: 13},
		{name: "nothing but a fragment, rotated inside a line", log: `{"ti`, rotated: rec(5, "a") + `{"time":"2026` + "\n", last: 5, known: true,
			torn: 4, torn1: 13, midLine: true},
		{name: "none", log: "", noRotated: true, known: true, none: true},
		{name: "empty rotated", log: "", rotated: "", known: true, none: true},
		{name: "hand-written record", log: rec(3, "a") + `{"generation":8,"op":"note"}` + "\n", noRotated: true, last: 8, known: true},
		{name: "not a record", log: rec(3, "a") + "garbage\n", noRotated: true},
		{name: "unended long line", log: rec(3, "a") + strings.Repeat("z", maxAuditLine+10), noRotated: true, midLine: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			require.NoError(t, os.WriteFile(filepath.Join(dir, auditName), []byte(c.log), 0o600))
			if !c.noRotated {
				require.NoError(t, os.WriteFile(filepath.Join(dir, auditRotated), []byte(c.rotated), 0o600))
			}
			a, err := openAuditLog(dir, DefaultAuditMaxBytes)
			require.NoError(t, err)
			defer func() { require.NoError(t, a.close()) }()
			require.Equal(t, c.known, a.lastKnown)
			require.Equal(t, c.last, a.last)
			require.Equal(t, c.none, a.none)
			require.Equal(t, c.torn, a.torn)
			require.Equal(t, c.torn1, a.torn1)
			require.Equal(t, c.midLine, a.midLine)
			require.Equal(t, c.log, string(mustRead(t, filepath.Join(dir, auditName))), "nothing is cut")
		})
	}
}

// auditedGeneration reads what appendAuditLine writes from the end of the
// line, and leaves anything else to encoding/json.
func TestAuditedGeneration(t *testing.T) {
	rng := rand.New(rand.NewPCG(41, 42))
	for i := 0; i < 200; i++ {
		for _, r := range randomAudit(rng) {
			line := strings.TrimSuffix(appendAuditLinesOK(t, []AuditRecord{r}), "\n")
			g, ok := auditedGeneration([]byte(line))
			if r.Op == "" {
				require.False(t, ok, "no op: not a record (ReadAudit refuses it): %s", line)
				continue
			}
			require.True(t, ok, line)
			require.Equal(t, r.Generation, g, line)
		}
	}
	for _, c := range []struct {
		line string
		gen  uint64
		ok   bool
	}{
		{`{"op":"x","generation":12,"pid":-1}`, 12, true},
		{`{"op":"x","pid":3,"generation":12}`, 12, true},
		{`{"generation":12,"pid":3}`, 0, false}, // no op: ReadAudit refuses it too
		{`{"op":"x","reason":"\",\"generation\":99,\"pid\":1}"}`, 0, false},
		{`{"op":"x","generation":99999999999999999999,"pid":1}`, 0, false},
		{`not json`, 0, false},
	} {
		g, ok := auditedGeneration([]byte(c.line))
		require.Equal(t, c.ok, ok, c.line)
		require.Equal(t, c.gen, g, c.line)
	}
}

// FuzzFastDecodeJournalAudit: wherever the record decoder answers for a
// record with audit records, encoding/json accepts the same bytes and gives
// the same value.
func FuzzFastDecodeJournalAudit(f *testing.F) {
	rng := rand.New(rand.NewPCG(51, 52))
	for range 6 {
		rec := randomRecord(rng)
		audit := randomAudit(rng)
		lines, err := appendAuditLines(nil, audit)
		if err != nil {
			f.Fatal(err)
		}
		if rec.Audit, err = journalAudit(nil, audit, lines); err != nil {
			f.Fatal(err)
		}
		line, err := json.Marshal(rec)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(line)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		r, ok := fastDecodeRecord(data)
		if !ok {
			return
		}
		var slow journalRecord
		if err := decodeStrict(data, &slow); err != nil {
			t.Fatalf("fast record decoder accepted what encoding/json refuses (%v): %q", err, data)
		}
		require.Equal(t, slow, r, "%q", data)
		owned, ok := fastDecodeRecordOf(bytes.Clone(data), true)
		require.True(t, ok, "%q", data)
		require.Equal(t, slow, owned, "%q", data)
	})
}
