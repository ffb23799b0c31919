// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"time"
)

// writeQueueJSON writes v exactly as writeJSON does (encoding/json, indented
// by two spaces, HTML-safe), without reflection or the second pass that
// indenting takes: at 4,000 waiters those were over a third of `queue -o
// json`. A string that is not plain printable ASCII (or holds a character
// encoding/json escapes) is quoted by encoding/json itself; a time it
// cannot write makes the whole view go through writeJSON, which names the
// error. The output goes out in chunks of queueChunk bytes, through one
// buffer: building all of it first touched as many fresh pages as the
// ledger itself. TestQueueJSONMatchesEncodingJSON holds the two to the same
// bytes.
func writeQueueJSON(w io.Writer, v *queueView) error {
	for i := range v.Waiters {
		if !jsonTimeOK(v.Waiters[i].FirstSeen) || !jsonTimeOK(v.Waiters[i].LastSeen) {
			return writeJSON(w, v)
		}
	}
	out := chunkWriter{w: w, b: make([]byte, 0, queueChunk+4096)}
	out.b = append(out.b, "{\n  \"waiters\": "...)
	switch {
	case v.Waiters == nil:
		out.b = append(out.b, "null"...)
	case len(v.Waiters) == 0:
		out.b = append(out.b, "[]"...)
	default:
		out.b = append(out.b, "[\n"...)
		for i := range v.Waiters {
			out.b = appendWaiterJSON(out.b, &v.Waiters[i])
			if i < len(v.Waiters)-1 {
				out.b = append(out.b, ',')
			}
			out.b = append(out.b, '\n')
			if err := out.flushFull(); err != nil {
				return err
			}
		}
		out.b = append(out.b, "  ]"...)
	}
	out.b = append(out.b, "\n}\n"...)
	return out.flush()
}

// queueChunk is how much of the JSON output is written at once.
const queueChunk = 32 << 10

// chunkWriter collects output in b and writes it out a chunk at a time.
type chunkWriter struct {
	w io.Writer
	b []byte
}

func (c *chunkWriter) flushFull() error {
	if len(c.b) < queueChunk {
		return nil
	}
	return c.flush()
}

func (c *chunkWriter) flush() error {
	if _, err := c.w.Write(c.b); err != nil {
		return fmt.Errorf("write JSON output: %w", err)
	}
	c.b = c.b[:0]
	return nil
}

func appendWaiterJSON(b []byte, wj *waiterJSON) []byte {
	b = append(b, "    {\n      \"position\": "...)
	b = strconv.AppendInt(b, int64(wj.Position), 10)
	b = append(b, ",\n      \"queue_length\": "...)
	b = strconv.AppendInt(b, int64(wj.QueueLength), 10)
	b = appendField(b, "requester", wj.Requester)
	b = appendField(b, "container_id", wj.ContainerID)
	b = appendField(b, "namespace", wj.Namespace)
	b = appendField(b, "pod", wj.Pod)
	b = appendField(b, "pod_uid", wj.PodUID)
	b = appendField(b, "container", wj.Container)
	b = appendField(b, "front_end", wj.FrontEnd)
	b = append(b, ",\n      \"devices\": "...)
	b = appendStringList(b, wj.Devices)
	b = append(b, ",\n      \"first_seen\": "...)
	b = appendJSONTime(b, wj.FirstSeen)
	b = append(b, ",\n      \"last_seen\": "...)
	b = appendJSONTime(b, wj.LastSeen)
	b = append(b, ",\n      \"waited_seconds\": "...)
	b = strconv.AppendInt(b, wj.WaitedSeconds, 10)
	b = append(b, ",\n      \"reserved\": "...)
	b = appendStringList(b, wj.Reserved)
	return append(b, "\n    }"...)
}

// jsonTimeOK says whether time.Time's MarshalJSON writes t (RFC 3339 with
// nanoseconds): a four-digit year, and a zone offset under 24 hours.
func jsonTimeOK(t time.Time) bool {
	if y := t.Year(); y < 0 || y > 9999 {
		return false
	}
	_, off := t.Zone()
	minutes := off / 60
	if minutes < 0 {
		minutes = -minutes
	}
	return minutes/60 < 24
}

// appendJSONTime writes t as time.Time's MarshalJSON does, for a t that
// jsonTimeOK accepts.
func appendJSONTime(b []byte, t time.Time) []byte {
	b = append(b, '"')
	b = t.AppendFormat(b, time.RFC3339Nano)
	return append(b, '"')
}

func appendField(b []byte, name, s string) []byte {
	b = append(b, ",\n      \""...)
	b = append(b, name...)
	b = append(b, "\": "...)
	return appendJSONString(b, s)
}

// appendStringList writes a list of strings at the depth of a waiter's field.
func appendStringList(b []byte, list []string) []byte {
	switch {
	case list == nil:
		return append(b, "null"...)
	case len(list) == 0:
		return append(b, "[]"...)
	}
	b = append(b, "[\n"...)
	for i, s := range list {
		b = append(b, "        "...)
		b = appendJSONString(b, s)
		if i < len(list)-1 {
			b = append(b, ',')
		}
		b = append(b, '\n')
	}
	return append(b, "      ]"...)
}

// appendJSONString quotes s as encoding/json does: plain printable ASCII
// here, anything else by encoding/json.
func appendJSONString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			q, err := json.Marshal(s)
			if err != nil { // a string always marshals; kept for safety
				return strconv.AppendQuote(b, s)
			}
			return append(b, q...)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}
