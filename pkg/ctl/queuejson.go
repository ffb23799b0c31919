// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
)

// writeQueueJSON writes v exactly as writeJSON does (encoding/json, indented
// by two spaces, HTML-safe), without reflection or the second pass that
// indenting takes: at 4,000 waiters those were over a third of `queue -o
// json`. A string that is not plain printable ASCII (or holds a character
// encoding/json escapes) is quoted by encoding/json itself; a time it
// cannot write makes the whole view go through writeJSON, which names the
// error. TestQueueJSONMatchesEncodingJSON holds the two to the same bytes.
func writeQueueJSON(w io.Writer, v *queueView) error {
	b, ok := appendQueueJSON(make([]byte, 0, 512*len(v.Waiters)+64), v)
	if !ok {
		return writeJSON(w, v)
	}
	if _, err := w.Write(b); err != nil {
		return fmt.Errorf("write JSON output: %w", err)
	}
	return nil
}

func appendQueueJSON(b []byte, v *queueView) ([]byte, bool) {
	b = append(b, "{\n  \"waiters\": "...)
	switch {
	case v.Waiters == nil:
		b = append(b, "null"...)
	case len(v.Waiters) == 0:
		b = append(b, "[]"...)
	default:
		b = append(b, "[\n"...)
		for i := range v.Waiters {
			wj := &v.Waiters[i]
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
			b = append(b, ",\n      \"devices\": "...)
			b = appendStringList(b, wj.Devices)
			for _, f := range []struct {
				name string
				t    interface{ MarshalJSON() ([]byte, error) }
			}{{"first_seen", wj.FirstSeen}, {"last_seen", wj.LastSeen}} {
				t, err := f.t.MarshalJSON()
				if err != nil {
					return nil, false
				}
				b = append(b, ",\n      \""...)
				b = append(b, f.name...)
				b = append(b, "\": "...)
				b = append(b, t...)
			}
			b = append(b, ",\n      \"waited_seconds\": "...)
			b = strconv.AppendInt(b, wj.WaitedSeconds, 10)
			b = append(b, ",\n      \"reserved\": "...)
			b = appendStringList(b, wj.Reserved)
			b = append(b, "\n    }"...)
			if i < len(v.Waiters)-1 {
				b = append(b, ',')
			}
			b = append(b, '\n')
		}
		b = append(b, "  ]"...)
	}
	return append(b, "\n}\n"...), true
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
