// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
)

// defaultAuditLines is how many records `audit` shows without -n: enough to
// see what just happened, short enough for a terminal.
const defaultAuditLines = 50

// maxAuditLine bounds one line of audit.log while following it; the ledger
// writes a few hundred bytes per record.
const maxAuditLine = 1 << 20

func (a *app) auditCommand() *cobra.Command {
	var (
		n      int
		window time.Duration
		follow bool
	)
	cmd := newCommand("audit",
		"Show the audit log: every claim, release, queue change and reconcile",
		`Show the ledger's audit log (audit.log and its rotation audit.log.1), oldest
first: claims, releases with their reason, queue and reservation changes,
reconcile findings, and operator actions with the operator's uid.

-n limits the output to the last N records (0 = all); --since keeps records
newer than the given duration; --follow keeps printing new records until
interrupted (with -o json: one JSON object per line).`,
		`  gpu-guard-ctl audit
  gpu-guard-ctl audit --since 1h -n 0
  gpu-guard-ctl audit --follow -o json | jq -c 'select(.op == "release")'`,
		noArgs,
		func(cmd *cobra.Command, _ []string) error {
			if n < 0 {
				return usagef("-n must not be negative, got %d", n)
			}
			if window < 0 {
				return usagef("--since must not be negative, got %s", window)
			}
			f := auditFilter{n: n}
			if window > 0 {
				f.after = a.env.Now().Add(-window)
			}
			l, err := a.openLedger(true)
			if err != nil {
				return err
			}
			if err := a.checkAuditLog(cmd.Context(), l); err != nil {
				return err
			}
			if follow {
				return a.followAudit(cmd.Context(), l.AuditPath(), f)
			}
			recs, err := ledger.ReadAudit(l.AuditPath())
			if err != nil {
				// Good records come back with the error: show them, and say
				// which lines were bad.
				fmt.Fprintf(a.env.Stderr, "warning: %v\n", err)
			}
			return a.renderAudit(a.env.Stdout, f.apply(recs))
		})
	fl := cmd.Flags()
	fl.IntVarP(&n, "lines", "n", defaultAuditLines, "show the last N records (0 = all)")
	fl.DurationVar(&window, "since", 0, "show records newer than this (e.g. 30m, 2h)")
	fl.BoolVarP(&follow, "follow", "f", false, "keep printing new records until interrupted")
	return cmd
}

// checkAuditLog makes a state dir without an audit log (neither audit.log
// nor its rotation) read as the other read commands read it, instead of as
// an empty log: refused when the ledger needs recovery (its files are gone
// although this boot's marker says a ledger was committed there: the audit
// log went with them), refused for a --state-dir that holds no ledger, and
// warned about for a [ledger] dir that is missing or empty. Only then is
// the ledger read: the log of a damaged ledger is what an operator reads
// to learn what happened, and it stays readable.
func (a *app) checkAuditLog(ctx context.Context, l *ledger.Ledger) error {
	name := filepath.Base(l.AuditPath())
	names := []string{name, name + ".1"}
	for _, name := range names {
		if _, err := lstat(filepath.Join(l.Dir(), name)); !errors.Is(err, fs.ErrNotExist) {
			return nil // there (or not readable: reading it says why)
		}
	}
	// Only whether the ledger needs recovery is wanted: the read every
	// command does, without the queue upkeep a View runs on its state.
	if _, err := l.Snapshot(ctx); errors.Is(err, ledger.ErrNeedsRecovery) {
		return fmt.Errorf("no audit log in %s: read ledger %s: %w", l.Dir(), l.StatePath(), err)
	}
	return a.checkLedgerDir(names...)
}

// auditFilter is -n and --since.
type auditFilter struct {
	n     int
	after time.Time
}

func (f auditFilter) apply(recs []ledger.AuditRecord) []ledger.AuditRecord {
	if !f.after.IsZero() {
		kept := recs[:0:0]
		for _, r := range recs {
			if !r.Time.Before(f.after) {
				kept = append(kept, r)
			}
		}
		recs = kept
	}
	if f.n > 0 && len(recs) > f.n {
		recs = recs[len(recs)-f.n:]
	}
	return recs
}

// auditView is the audit output; the records keep the audit log's own JSON
// field names.
type auditView struct {
	Records []ledger.AuditRecord `json:"records"`
}

// renderAudit prints records as a table or JSON.
func (a *app) renderAudit(w io.Writer, recs []ledger.AuditRecord) error {
	if a.output == outputJSON {
		if recs == nil {
			recs = []ledger.AuditRecord{}
		}
		return writeJSON(w, auditView{Records: recs})
	}
	return a.auditTable(w, recs, true, false)
}

func (a *app) auditTable(w io.Writer, recs []ledger.AuditRecord, header, follow bool) error {
	wide := a.output == outputWide
	cols := []string{"TIME", "OP", "DEVICES", "HOLDER", "ID", "REASON"}
	if wide {
		cols = []string{"TIME", "OP", "DEVICES", "HOLDER", "CONTAINER ID", "KEY", "FRONT END", "GENERATION", "PID", "REASON"}
	}
	t := &table{tw: newTabWriter(w, 0)}
	if follow {
		// Every batch is its own table: a minimum cell width keeps the
		// batches roughly aligned with the header.
		t.tw = newTabWriter(w, 12)
	}
	if header {
		t.row(cols...)
	}
	for _, r := range recs {
		devs := make([]string, len(r.Devices))
		for i, d := range r.Devices {
			if wide {
				devs[i] = d
			} else {
				devs[i] = shortUUID(d)
			}
		}
		holder := none
		if r.Namespace != "" || r.Pod != "" || r.Container != "" {
			holder = holderName(ledger.Owner{Namespace: r.Namespace, Pod: r.Pod, Container: r.Container, ContainerID: r.ContainerID,
				FrontEnd: ledger.FrontEnd(r.FrontEnd)})
		}
		ts := r.Time.UTC().Format(time.RFC3339)
		if wide {
			t.row(ts, r.Op, strings.Join(devs, ","), holder, r.ContainerID, r.Key, r.FrontEnd,
				fmt.Sprint(r.Generation), fmt.Sprint(r.Pid), r.Reason)
			continue
		}
		t.row(ts, r.Op, strings.Join(devs, ","), holder, naming.ShortID(r.ContainerID), r.Reason)
	}
	return t.flush()
}

// followAudit prints the records selected by f, then every record appended
// later, until ctx ends.
func (a *app) followAudit(ctx context.Context, path string, f auditFilter) error {
	fw := &auditFollower{path: path, warn: a.warn}
	defer fw.close()
	recs, err := fw.start()
	if err != nil {
		return err
	}
	if err := a.renderFollowed(f.apply(recs), true); err != nil {
		return err
	}
	tick := time.NewTicker(a.env.FollowInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		recs, err := fw.poll()
		if err != nil {
			return err
		}
		if err := a.renderFollowed(recs, false); err != nil {
			return err
		}
	}
}

func (a *app) warn(err error) {
	fmt.Fprintf(a.env.Stderr, "warning: %v\n", err)
}

// auditFollower tails audit.log across rotations. It reads the files itself
// rather than re-reading them with ledger.ReadAudit: reading from an open
// descriptor, and switching to the new audit.log only after draining the
// rotated one, is what makes sure no record is lost or printed twice.
type auditFollower struct {
	path string // audit.log; its rotation is path + ".1"
	cur  auditTail
	warn func(error)
}

// start returns every record of both files, oldest first, and leaves the
// follower at the end of audit.log.
func (fw *auditFollower) start() ([]ledger.AuditRecord, error) {
	fw.cur = auditTail{path: fw.path}
	if err := fw.cur.open(); err != nil {
		return nil, err
	}
	var recs []ledger.AuditRecord
	// audit.log is opened first: if it rotates before audit.log.1 is read,
	// audit.log.1 is the file already open and is not read twice.
	if !fw.cur.sameFile(fw.path + ".1") {
		recs = fw.readWhole(fw.path + ".1")
	}
	return append(recs, fw.read(&fw.cur)...), nil
}

// poll returns the records appended since the last call.
func (fw *auditFollower) poll() ([]ledger.AuditRecord, error) {
	recs := fw.read(&fw.cur)
	if fw.cur.sameFile(fw.path) {
		return recs, nil
	}
	// audit.log was rotated (or created). Drain the old file once more: a
	// record may have been appended between the read above and the rename;
	// the ledger writes only to the new file after it.
	recs = append(recs, fw.read(&fw.cur)...)
	if fw.cur.f != nil && !fw.cur.sameFile(fw.path+".1") {
		// Rotated more than once since the last poll: audit.log.1 was
		// written entirely meanwhile. Older rotations are gone for good.
		fw.warn(fmt.Errorf("audit log %s rotated more than once between reads; some records may be missing (see the daemon's log)", fw.path))
		recs = append(recs, fw.readWhole(fw.path+".1")...)
	}
	fw.cur.close()
	if err := fw.cur.open(); err != nil {
		return recs, err
	}
	return append(recs, fw.read(&fw.cur)...), nil
}

func (fw *auditFollower) close() { fw.cur.close() }

func (fw *auditFollower) read(t *auditTail) []ledger.AuditRecord {
	recs, errs := t.read()
	for _, err := range errs {
		fw.warn(err)
	}
	return recs
}

// readWhole reads every record of a file that is not followed further.
func (fw *auditFollower) readWhole(path string) []ledger.AuditRecord {
	t := auditTail{path: path}
	if err := t.open(); err != nil {
		fw.warn(err)
		return nil
	}
	defer t.close()
	return fw.read(&t)
}

// renderFollowed prints one batch of followed records.
func (a *app) renderFollowed(recs []ledger.AuditRecord, first bool) error {
	if a.output != outputJSON {
		if len(recs) == 0 && !first {
			return nil
		}
		return a.auditTable(a.env.Stdout, recs, first, true)
	}
	for i := range recs {
		b, err := json.Marshal(&recs[i])
		if err != nil {
			return fmt.Errorf("encode audit record: %w", err)
		}
		b = append(b, '\n')
		if _, err := a.env.Stdout.Write(b); err != nil {
			return fmt.Errorf("write output: %w", err)
		}
	}
	return nil
}

// auditTail reads the complete lines appended to one audit file.
type auditTail struct {
	path    string
	f       *os.File // nil while the file does not exist
	partial []byte   // an incomplete last line, completed by a later read
	line    int
}

// open opens the file if it exists; a missing file is not an error (no record
// written yet, or mid-rotation).
func (t *auditTail) open() error {
	t.partial, t.line = nil, 0
	// O_NONBLOCK: a FIFO planted as audit.log must not block the open
	// (it is refused below); it is irrelevant for a regular file.
	f, err := os.OpenFile(t.path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if errors.Is(err, fs.ErrNotExist) {
		t.f = nil
		return nil
	}
	if err != nil {
		return fmt.Errorf("open audit log: %w", err)
	}
	fi, err := f.Stat()
	if err == nil && !fi.Mode().IsRegular() {
		err = fmt.Errorf("%s is not a regular file (%s); the ledger writes a regular file there", t.path, fi.Mode().Type())
	}
	if err != nil {
		_ = f.Close()
		return fmt.Errorf("open audit log: %w", err)
	}
	t.f = f
	return nil
}

func (t *auditTail) close() {
	if t.f != nil {
		_ = t.f.Close()
		t.f = nil
	}
}

// sameFile reports whether path names the file this tail has open.
func (t *auditTail) sameFile(path string) bool {
	if t.f == nil {
		return false
	}
	open, err := t.f.Stat()
	if err != nil {
		return false
	}
	named, err := os.Stat(path)
	if err != nil {
		return false
	}
	return os.SameFile(open, named)
}

// read returns the records of the complete lines appended since the last
// read, and one error per line that did not decode.
func (t *auditTail) read() ([]ledger.AuditRecord, []error) {
	if t.f == nil {
		return nil, nil
	}
	data, err := io.ReadAll(io.LimitReader(t.f, 64<<20))
	if err != nil {
		return nil, []error{fmt.Errorf("read audit log %s: %w", t.path, err)}
	}
	data = append(t.partial, data...)
	var (
		recs []ledger.AuditRecord
		errs []error
	)
	for {
		nl := bytes.IndexByte(data, '\n')
		if nl < 0 {
			break
		}
		line := bytes.TrimSpace(data[:nl])
		data = data[nl+1:]
		t.line++
		if len(line) == 0 {
			continue
		}
		var r ledger.AuditRecord
		if err := json.Unmarshal(line, &r); err != nil || r.Op == "" {
			if err == nil {
				err = errors.New("record has no op")
			}
			errs = append(errs, &ledger.AuditLineError{Path: t.path, Line: t.line, Cause: err})
			continue
		}
		recs = append(recs, r)
	}
	if len(data) > maxAuditLine {
		errs = append(errs, &ledger.AuditLineError{Path: t.path, Line: t.line + 1, Cause: fmt.Errorf("line longer than %d bytes", maxAuditLine)})
		data = nil
	}
	t.partial = append([]byte(nil), data...)
	return recs, errs
}
