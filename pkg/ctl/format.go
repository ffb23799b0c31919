// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
)

// none is what a table shows for an empty cell, so columns stay aligned and
// `awk` sees a field.
const none = "-"

// age renders d like kubectl does: the largest unit only, "5s", "3m", "2h",
// "4d", "3y". Negative durations (clock skew between writer and reader) read
// as "0s".
func age(d time.Duration) string {
	if d < 0 {
		d = 0
	}
	const day = 24 * time.Hour
	switch {
	case d < time.Minute:
		return strconv.Itoa(int(d/time.Second)) + "s"
	case d < time.Hour:
		return strconv.Itoa(int(d/time.Minute)) + "m"
	case d < 2*day:
		return strconv.Itoa(int(d/time.Hour)) + "h"
	case d < 2*365*day:
		return strconv.Itoa(int(d/day)) + "d"
	default:
		return strconv.Itoa(int(d/(365*day))) + "y"
	}
}

// since is the age of t at now, or "-" for an unknown time.
func since(now, t time.Time) string {
	if t.IsZero() {
		return none
	}
	return age(now.Sub(t))
}

// shortUUID keeps the prefix and the first group of a GPU/MIG UUID
// ("GPU-6c1a2f2e"): enough to tell a host's GPUs apart in a table; -o wide
// shows the full UUID.
func shortUUID(u string) string {
	prefix, rest, ok := strings.Cut(u, "-")
	if !ok {
		return u
	}
	group, _, _ := strings.Cut(rest, "-")
	return prefix + "-" + group
}

// holderName is "namespace/pod/container" for CRI containers, the container
// name or the short id otherwise. Pod names a container's creator wrote
// itself (the OCI hook's, from annotations) are marked "(unverified)": a
// podman container can name itself after any Kubernetes pod.
func holderName(o ledger.Owner) string {
	switch {
	case (o.Namespace != "" || o.Pod != "") && o.FrontEnd == ledger.FrontEndHook:
		return o.Namespace + "/" + o.Pod + "/" + o.Container + " (unverified)"
	case o.Namespace != "" || o.Pod != "":
		return o.Namespace + "/" + o.Pod + "/" + o.Container
	case o.Container != "":
		return o.Container
	default:
		return naming.ShortID(o.ContainerID)
	}
}

// clean makes a string safe for one table cell: container-supplied names may
// carry tabs, newlines or terminal escapes, which are shown quoted instead of
// being interpreted.
func clean(s string) string {
	if s == "" {
		return none
	}
	return escapeLine(s)
}

// escapeLine quotes the non-printable characters of s (tabs, newlines,
// terminal escapes) so that s stays one harmless line.
func escapeLine(s string) string {
	for _, r := range s {
		if !unicode.IsPrint(r) || r == '\t' {
			q := strconv.Quote(s)
			return q[1 : len(q)-1]
		}
	}
	return s
}

// table writes aligned columns. Every cell goes through clean.
type table struct {
	tw *tabwriter.Writer
	// buf, when set, sits between tw and the output: a tabwriter writes
	// every cell and every run of padding separately, which unbuffered
	// would be one write(2) each (over a thousand for a 64-GPU status).
	buf *bufio.Writer
}

func newTable(w io.Writer, header ...string) *table {
	buf := bufio.NewWriterSize(w, 32<<10)
	t := &table{tw: newTabWriter(buf, 0), buf: buf}
	t.row(header...)
	return t
}

// newTabWriter pads cells to at least minWidth, with two spaces between
// columns.
func newTabWriter(w io.Writer, minWidth int) *tabwriter.Writer {
	return tabwriter.NewWriter(w, minWidth, 8, 2, ' ', 0)
}

func (t *table) row(cells ...string) {
	for i, c := range cells {
		if i > 0 {
			_, _ = io.WriteString(t.tw, "\t")
		}
		_, _ = io.WriteString(t.tw, clean(c))
	}
	_, _ = io.WriteString(t.tw, "\n")
}

func (t *table) flush() error {
	if err := t.tw.Flush(); err != nil {
		return fmt.Errorf("write output: %w", err)
	}
	if t.buf != nil {
		if err := t.buf.Flush(); err != nil {
			return fmt.Errorf("write output: %w", err)
		}
	}
	return nil
}

// writeJSON prints v as indented JSON. The encoder escapes HTML-significant
// characters and control characters, so container-supplied strings are safe.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return fmt.Errorf("write JSON output: %w", err)
	}
	return nil
}

// timeOrNil keeps zero times out of JSON (omitempty does not apply to
// structs), and gives the others in UTC, as every time ctl prints: the
// ledger keeps the zone of the clock that wrote a time, and the daemon
// writes observe.json in its host's.
func timeOrNil(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	t = t.UTC()
	return &t
}
