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
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/gofrs/flock"
)

// DefaultRuntimeDir holds the per-boot markers (Options.RuntimeDir): a
// tmpfs that every boot starts empty.
const DefaultRuntimeDir = "/run/nri-gpu-guard"

// The per-boot marker tells a fresh host from a vanished state. A ledger of
// an earlier boot is discarded anyway, so a boot legitimately starts empty;
// but once a ledger was committed in this boot, the marker (in a tmpfs, gone
// at the next boot) records its lineage and the generation last committed,
// and a state dir that is then missing, empty, of another lineage or of an
// older generation is refused instead of read as a fresh host.
type marker struct {
	Dir        string `json:"dir"`
	BootID     string `json:"boot_id"`
	Lineage    string `json:"lineage"`
	Generation uint64 `json:"generation"`
}

// markerPath is this state dir's marker: one per dir path, since what
// vanishes is what the configuration points at.
func (l *Ledger) markerPath() string {
	sum := sha256.Sum256([]byte(l.dir))
	return filepath.Join(l.opts.RuntimeDir, "ledger-"+hex.EncodeToString(sum[:12])+".marker")
}

// markerSize is the marker file's fixed size: a record padded with spaces,
// rewritten in place, so that a commit pays one pwrite on a tmpfs.
const markerSize = 512

// readMarker returns this boot's marker of the state dir, or ok = false if
// there is none (a marker of another boot, on a runtime dir that is not a
// tmpfs, is none either). A marker that does not verify is an error: it must
// not read as "fresh host". A read that overlapped a rewrite (its checksum
// fails) is retried: a reader takes no lock, and a writer preempted inside
// its pwrite leaves the marker half-written for as long as it is off the
// CPU, which on a loaded host outlasts any number of immediate retries. So
// while some process holds the ledger lock (only a lock holder writes the
// marker) the retries back off, for up to min(lock timeout, 1 s); a marker
// that does not verify while nobody holds the lock, or still not after
// that, is damaged.
func (l *Ledger) readMarker() (m marker, ok bool, err error) {
	p := l.markerPath()
	deadline := time.Now().Add(min(l.opts.LockTimeout, time.Second))
	pause := 50 * time.Microsecond
	for attempt := 0; ; attempt++ {
		data, exists, err := readFileNoFollow(p, 64<<10, nil)
		if err != nil {
			return m, false, fmt.Errorf("read the ledger's boot marker: %w", err)
		}
		if !exists {
			return m, false, nil
		}
		m, err = decodeMarker(data)
		if err == nil && m.Dir == l.dir {
			if m.BootID != l.opts.BootID {
				return marker{}, false, nil
			}
			return m, true, nil
		}
		if attempt >= 5 && (!time.Now().Before(deadline) || !l.lockHeld()) {
			return m, false, &NeedsRecoveryError{Path: p, Problem: "the boot marker of the state dir does not verify (damaged, or not ours)"}
		}
		if attempt >= 5 {
			time.Sleep(pause) // a backoff between reads, not a wait for an event
			pause = min(2*pause, 10*time.Millisecond)
		}
	}
}

// lockHeld reports whether some process (this one included) holds the
// ledger lock, or whether that cannot be told: a probe on a descriptor of
// its own, which conflicts with every other descriptor's lock.
func (l *Ledger) lockHeld() bool {
	probe := flock.New(l.LockPath(), flock.SetFlag(os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK))
	got, err := probe.TryRLock()
	if err != nil {
		return true // cannot tell: keep retrying until the deadline
	}
	if got {
		_ = probe.Unlock()
	}
	return !got
}

// decodeMarker parses "<crc32c hex> <JSON>" followed by padding.
func decodeMarker(data []byte) (marker, error) {
	var m marker
	lines, _, torn, err := journalLines(bytes.TrimRight(data, " "), 0)
	if err != nil {
		return m, err
	}
	if len(lines) != 1 || torn >= 0 {
		return m, errors.New("not one marker record")
	}
	if m, ok := fastDecodeMarker(lines[0]); ok && m.Lineage != "" {
		return m, nil
	}
	if err := json.Unmarshal(lines[0], &m); err != nil || m.Lineage == "" {
		return m, errors.New("the marker record does not decode")
	}
	return m, nil
}

// writeMarker records the committed lineage and generation (lock held).
// The runtime dir is a tmpfs: no fsync, it does not outlive the boot.
func (l *Ledger) writeMarker(st *State) error {
	rec := appendMarkerLine(make([]byte, 0, markerSize), &marker{Dir: l.dir, BootID: l.opts.BootID, Lineage: st.Lineage, Generation: st.Generation})
	if len(rec) > markerSize {
		return fmt.Errorf("boot marker of %s: %d bytes, more than %d (state dir path too long?)", l.dir, len(rec), markerSize)
	}
	rec = append(rec, bytes.Repeat([]byte(" "), markerSize-len(rec))...)
	f, err := l.markerFile()
	if err != nil {
		return err
	}
	if _, err := f.WriteAt(rec, 0); err != nil {
		l.closeMarker()
		return fmt.Errorf("write the ledger's boot marker %s: %w", f.Name(), err)
	}
	return nil
}

// markerFile is the open marker file, reopened if the path no longer names
// it (deleted or replaced: a write to it would be lost).
func (l *Ledger) markerFile() (*os.File, error) {
	p := l.markerPath()
	if l.markerF != nil {
		fi, err := os.Lstat(p) //nolint:gosec // fixed name in the configured runtime dir
		ofi, oerr := l.markerF.Stat()
		if err == nil && oerr == nil && os.SameFile(fi, ofi) {
			return l.markerF, nil
		}
		l.closeMarker()
	}
	if err := ensureRuntimeDir(l.opts.RuntimeDir); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0o600) //nolint:gosec // fixed name in the runtime dir
	if err != nil {
		return nil, fmt.Errorf("open the ledger's boot marker: %w", err)
	}
	fi, err := f.Stat()
	if err == nil && !fi.Mode().IsRegular() {
		err = fmt.Errorf("%w: %s is not a regular file", ErrUnsafeDir, p)
	}
	if err == nil {
		err = checkOwnerMode(p, fi, false)
	}
	if err != nil {
		_ = f.Close()
		return nil, err
	}
	l.markerF = f
	return f, nil
}

// Close releases what the ledger keeps open between transactions: the boot
// marker's file (kept open so that each commit rewrites it in place). A
// process that opens the ledger once for its life need not call it; one that
// opens a ledger per request must (the resident hook server answers every
// container with a ledger of its own: without Close each left a file open
// until the garbage collector found it). It waits for a transaction of this
// process in progress; the Ledger must not be used after it.
func (l *Ledger) Close() {
	l.sem <- struct{}{}
	defer func() { <-l.sem }()
	l.closeMarker()
}

func (l *Ledger) closeMarker() {
	if l.markerF != nil {
		_ = l.markerF.Close()
		l.markerF = nil
	}
}

// ensureRuntimeDir creates the runtime dir (0700) and checks it like the
// state dir: whoever can write there can erase the memory of a ledger.
func ensureRuntimeDir(dir string) error {
	fi, err := os.Lstat(dir) //nolint:gosec // the runtime dir is the operator's choice
	if errors.Is(err, fs.ErrNotExist) {
		if err := os.MkdirAll(dir, 0o700); err != nil { //nolint:gosec // the runtime dir is the operator's choice
			return fmt.Errorf("create the ledger runtime dir %s: %w", dir, err)
		}
		fi, err = os.Lstat(dir) //nolint:gosec // the runtime dir is the operator's choice
	}
	if err != nil {
		return fmt.Errorf("ledger runtime dir %s: %w", dir, err)
	}
	if fi.Mode()&fs.ModeSymlink != 0 || !fi.IsDir() {
		return fmt.Errorf("%w: ledger runtime dir %s is not a directory (a symlink?)", ErrUnsafeDir, dir)
	}
	if err := checkOwnerMode(dir, fi, false); err != nil {
		return err
	}
	tightenDir(dir, fi)
	return nil
}

// RemoveMarkersUnder removes from runtimeDir the boot markers of state dirs
// at or below root, and returns how many it removed. It is for whoever
// deletes state dirs it made and will not use again: a test suite's temp
// root, an uninstaller. A marker is what refuses a vanished state dir, so
// calling this for a dir that is still in use turns that refusal off until
// the next commit writes the marker again. Markers that do not verify, and
// files that are not markers, are left alone.
func RemoveMarkersUnder(runtimeDir, root string) (int, error) {
	if !filepath.IsAbs(root) {
		return 0, fmt.Errorf("remove boot markers under %q: not an absolute path", root)
	}
	root = filepath.Clean(root)
	entries, err := os.ReadDir(runtimeDir)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("list the ledger runtime dir: %w", err)
	}
	removed := 0
	for _, e := range entries {
		name := e.Name()
		if !e.Type().IsRegular() || !strings.HasPrefix(name, "ledger-") || !strings.HasSuffix(name, ".marker") {
			continue
		}
		p := filepath.Join(runtimeDir, name)
		data, exists, err := readFileNoFollow(p, 64<<10, nil)
		if err != nil || !exists {
			continue
		}
		m, err := decodeMarker(data)
		if err != nil || !isWithin(m.Dir, root) {
			continue
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return removed, fmt.Errorf("remove the boot marker of %s: %w", m.Dir, err)
		}
		removed++
	}
	return removed, nil
}

// isWithin reports whether the clean absolute path p is root or below it.
func isWithin(p, root string) bool {
	if p == root {
		return true
	}
	if root == "/" {
		return strings.HasPrefix(p, "/")
	}
	return strings.HasPrefix(p, root+"/")
}
