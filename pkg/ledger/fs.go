// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/ledgerfault"
)

// File names inside the state dir.
const (
	stateName       = "ledger.json"
	prevName        = "ledger.json.prev"
	journalName     = "ledger.journal"
	journalPrevName = "ledger.journal.prev"
	lockName        = "ledger.lock"
	auditName       = "audit.log"
	auditRotated    = "audit.log.1"
	tempPrefix      = stateName + ".tmp-"
	corruptPrefix   = stateName + ".corrupt-"
	quarantineStamp = "20060102T150405.000000000Z"
)

// DirFiles returns the names of the files the ledger keeps in its state
// dir, for a reader that tells a ledger dir from another: always, those
// every ledger a writer committed to holds (the snapshot, the journal, the
// lock, the audit log; the lock alone where a writer committed nothing);
// sometimes, those it holds only at times (the audit log's rotation, the
// copies a compaction keeps, the gate of a contended lock). The files it
// moves aside or writes in passing have one of these names with a suffix.
func DirFiles() (always, sometimes []string) {
	return []string{stateName, journalName, lockName, auditName},
		[]string{auditRotated, prevName, journalPrevName, gateName}
}

// Failpoint stages of a commit, in order. Tests kill a process at each one to
// prove that a crash at any of them leaves the old or the new state.
//
// A journal append: before-write, torn-write (half the record written),
// after-write (all of it, not synced), after-fsync, after-audit.
// A compaction: before-write, snapshot-written (snapshot temp file
// written), snapshot-synced, prev-linked (the snapshot it replaces linked
// to a temp name), after-rename (the new snapshot in place), prev-kept (the
// old one renamed to .prev), after-dirsync, journal-synced (new journal
// temp file synced), journal-prev-linked (the journal it replaces linked
// to a temp name), journal-rotated (that name renamed to .journal.prev,
// the new journal not yet in place), journal-swapped, after-audit. The
// snapshot's stages have names of their own: a test that kills at a stage
// kills at its first occurrence, and a compaction follows a journal append.
// The state a recovery or reset writes (writeBase) is first kept as the
// new base: base-snapshot-synced (its copy's temp file synced),
// base-snapshot-kept (renamed over .prev, the dir synced),
// base-journal-synced, base-journal-kept (its empty journal renamed over
// .journal.prev, the dir synced); then it is put in place as a compaction
// puts its snapshot and journal, keeping nothing.
const (
	stageBeforeWrite    = "before-write"
	stageTornWrite      = "torn-write"
	stageAfterWrite     = "after-write"
	stageAfterFsync     = "after-fsync"
	stageSnapWritten    = "snapshot-written"
	stageSnapSynced     = "snapshot-synced"
	stagePrevLinked     = "prev-linked"
	stageAfterRename    = "after-rename"
	stagePrevKept       = "prev-kept"
	stageAfterDirSyn    = "after-dirsync"
	stageJournalSynced  = "journal-synced"
	stageJournalLinked  = "journal-prev-linked"
	stageJournalRotated = "journal-rotated"
	stageJournalSwapped = "journal-swapped"
	stageAfterAudit     = "after-audit"

	stageBaseSnapSynced    = "base-snapshot-synced"
	stageBaseSnapKept      = "base-snapshot-kept"
	stageBaseJournalSynced = "base-journal-synced"
	stageBaseJournalKept   = "base-journal-kept"
)

// failpoint, when non-nil, is called at each commit stage. Only tests set it
// (before any ledger is used); production code never does.
var failpoint func(stage string)

func reachStage(stage string) {
	if failpoint != nil {
		failpoint(stage)
	}
}

// checkDir verifies (and, if create, makes) the state dir: a real directory,
// not a symlink, owned by us (or root, for readers), not writable by group or
// others. missing reports a dir that does not exist when create is false;
// created, one it made (with any missing parents), whose chain the caller
// checks again: a dir someone else made in a sticky parent meanwhile is
// theirs.
func checkDir(dir string, create, readOnly bool) (missing, created bool, err error) {
	fi, err := os.Lstat(dir) //nolint:gosec // the state dir is the operator's choice
	if errors.Is(err, fs.ErrNotExist) {
		if !create {
			return true, false, nil
		}
		if err := os.MkdirAll(dir, 0o700); err != nil { //nolint:gosec // the state dir is the operator's choice
			return false, false, fmt.Errorf("create ledger dir %s: %w", dir, err)
		}
		created = true
		fi, err = os.Lstat(dir) //nolint:gosec // the state dir is the operator's choice
	}
	if err != nil {
		return false, created, fmt.Errorf("ledger dir %s: %w", dir, err)
	}
	if fi.Mode()&fs.ModeSymlink != 0 {
		return false, created, fmt.Errorf("%w: %s is a symlink; point the configuration at the real directory", ErrUnsafeDir, dir)
	}
	if !fi.IsDir() {
		return false, created, fmt.Errorf("%w: %s is not a directory", ErrUnsafeDir, dir)
	}
	if err := checkOwnerMode(dir, fi, readOnly); err != nil {
		return false, created, err
	}
	if !readOnly {
		tightenDir(dir, fi)
	}
	return false, created, nil
}

// tightenDir makes dir, which this process owns and checked, 0700 when it
// is readable or searchable by others (writable by them it was refused):
// the ledger is root's alone (the audit log and the holders' names are in
// it), but a dir made by another tool, such as a Kubernetes hostPath of type
// DirectoryOrCreate (0755), would stay open to reading. Best effort: a
// read-only mount keeps its mode, and nothing depends on it.
func tightenDir(dir string, fi fs.FileInfo) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || int(st.Uid) != os.Geteuid() || fi.Mode().Perm()&0o077 == 0 {
		return
	}
	_ = os.Chmod(dir, 0o700) //nolint:gosec // the operator's state dir, checked above: a directory owned by this user
}

// checkFiles verifies every file the ledger opens in dir, where it exists.
func checkFiles(dir string, readOnly bool) error {
	for _, name := range []string{stateName, prevName, journalName, journalPrevName, lockName, auditName, auditRotated} {
		p := filepath.Join(dir, name)
		fi, err := os.Lstat(p) //nolint:gosec // fixed names in the operator's state dir
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("ledger file %s: %w", p, err)
		}
		if fi.Mode()&fs.ModeSymlink != 0 {
			return fmt.Errorf("%w: %s is a symlink; remove it (the ledger never follows links)", ErrUnsafeDir, p)
		}
		if !fi.Mode().IsRegular() {
			return fmt.Errorf("%w: %s is not a regular file", ErrUnsafeDir, p)
		}
		if err := checkOwnerMode(p, fi, readOnly); err != nil {
			return err
		}
	}
	return nil
}

func checkOwnerMode(p string, fi fs.FileInfo, readOnly bool) error {
	if perm := fi.Mode().Perm(); perm&0o022 != 0 {
		return fmt.Errorf("%w: %s has mode %04o, writable by group or others; chmod go-w it (the dir should be 0700)", ErrUnsafeDir, p, perm)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return nil
	}
	uid := os.Geteuid()
	if int(st.Uid) == uid || (readOnly && st.Uid == 0) {
		return nil
	}
	return fmt.Errorf("%w: %s is owned by uid %d, not by uid %d that runs the guard; chown it", ErrUnsafeDir, p, st.Uid, uid)
}

// readFileNoFollow reads a file without following a symlink, into buf's
// storage when it is large enough. At most limit+1 bytes are read, so that the
// caller can tell an oversized file. exists is false (with a nil error) when
// there is no file.
func readFileNoFollow(p string, limit int64, buf []byte) (data []byte, exists bool, err error) {
	// O_NONBLOCK: a FIFO in its place must not hang the guard.
	f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0) //nolint:gosec // fixed name in the operator's state dir
	if errors.Is(err, fs.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("open %s: %w", p, err)
	}
	defer func() { _ = f.Close() }()
	want := int64(4096)
	if fi, err := f.Stat(); err == nil {
		if !fi.Mode().IsRegular() {
			return nil, true, fmt.Errorf("%w: %s is not a regular file (%s); remove it", ErrUnsafeDir, p, fi.Mode().Type())
		}
		want = min(fi.Size(), limit) + 512
	}
	buf = slices.Grow(buf[:0], int(want))
	r := io.LimitReader(f, limit+1)
	for {
		if len(buf) == cap(buf) {
			buf = slices.Grow(buf, 64<<10)
		}
		n, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if errors.Is(err, io.EOF) {
			return buf, true, nil
		}
		if err != nil {
			return nil, true, fmt.Errorf("read %s: %w", p, err)
		}
	}
}

// linkTemp gives the file at path a second, new name in dir starting with
// prefix (a temp name: never read as state, removed by the next writer if
// left behind), and returns it.
func linkTemp(dir, path, prefix string) (string, error) {
	for i := 0; ; i++ {
		// Uniqueness is all the name needs: the dir is ours alone (0700), and
		// a name taken is tried again.
		name := filepath.Join(dir, prefix+strconv.FormatUint(rand.Uint64(), 36)) //nolint:gosec // not a secret
		err := os.Link(path, name)
		if err == nil {
			return name, nil
		}
		if !errors.Is(err, fs.ErrExist) || i == 9 {
			return "", fmt.Errorf("link %s to %s: %w", path, name, err)
		}
	}
}

// writeTemp writes data to a new temp file in dir (named by pattern) and
// makes it durable (fsync, close), announcing the crash-test stages
// afterWrite and afterSync ("" for none) on the way; on failure the temp
// file is gone. The caller renames it into place.
func writeTemp(dir, pattern string, data []byte, afterWrite, afterSync string) (string, error) {
	f, err := os.CreateTemp(dir, pattern)
	if err != nil {
		return "", fmt.Errorf("create temp file in %s: %w", dir, err)
	}
	tmp := f.Name()
	fail := func(err error) (string, error) {
		_ = f.Close()
		_ = os.Remove(tmp) //nolint:gosec // our own temp file
		return "", err
	}
	if _, err := f.Write(data); err != nil {
		return fail(fmt.Errorf("write %s: %w", tmp, err))
	}
	if afterWrite != "" {
		reachStage(afterWrite)
	}
	if err := f.Sync(); err != nil {
		return fail(fmt.Errorf("fsync %s: %w", tmp, err))
	}
	if afterSync != "" {
		reachStage(afterSync)
	}
	if err := f.Close(); err != nil {
		_ = os.Remove(tmp) //nolint:gosec // our own temp file
		return "", fmt.Errorf("close %s: %w", tmp, err)
	}
	return tmp, nil
}

// syncDir makes a rename in dir durable.
func syncDir(dir string) error {
	if err := ledgerfault.Sync(dir); err != nil {
		return fmt.Errorf("fsync dir %s: %w", dir, err)
	}
	d, err := os.Open(dir) //nolint:gosec // the state dir is the operator's choice
	if err != nil {
		return fmt.Errorf("open dir %s: %w", dir, err)
	}
	defer func() { _ = d.Close() }()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync dir %s: %w", dir, err)
	}
	return nil
}

// removeStrayTemps deletes temp files left by a writer that crashed before
// its rename. Only called with the lock held: no live writer has one then.
func removeStrayTemps(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", dir, err)
	}
	var removed []string
	var errs []error
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), tempPrefix) || e.IsDir() {
			continue
		}
		p := filepath.Join(dir, e.Name())
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) { //nolint:gosec // a temp file of ours in the state dir
			errs = append(errs, err)
			continue
		}
		removed = append(removed, p)
	}
	return removed, errors.Join(errs...)
}
