// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/ledgerfault"
)

// fileID identifies one version of a file: the same inode, size and times
// mean nobody wrote to it since (a rename replaces the inode, an append
// grows it, a write in place moves mtime and ctime).
type fileID struct {
	dev, ino     uint64
	size         int64
	mtime, ctime syscall.Timespec
}

func idOf(fi fs.FileInfo) fileID {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fileID{size: fi.Size()}
	}
	return fileID{dev: uint64(st.Dev), ino: st.Ino, size: st.Size, mtime: st.Mtim, ctime: st.Ctim} //nolint:unconvert // Dev is uint64 on amd64 only
}

// loaded is the committed state as read from the files, with what the
// next reader needs to tell whether they changed since.
type loaded struct {
	st     State
	exists bool // a snapshot or a journal is there

	snapOK bool // ledger.json is there (and verified)
	snapID fileID
	// genesis: st is a genesis journal's (the first commit of a boot
	// from an empty base), read next to an earlier boot's snapshot that
	// the next write replaces (see startGenesis).
	genesis   bool
	format    int
	snapBytes int64

	jOK  bool // ledger.journal is there (and verified)
	jID  fileID
	jHdr journalHeader
	jEnd int64 // end of the last complete record; a torn tail follows if jID.size > jEnd

	// settled: st is what this process committed right after the queue
	// mechanics ran (Tx.maintain), so it is their fixed point as long as
	// nothing expires (see Tx.maintain). Never set for a state read from
	// the files.
	settled bool
	// keep, when settled, is what keptForHead found for st in the Tx that
	// committed it, or nil: the next Tx of this process starts from it.
	keep *headKeep
	// minLastSeen, when minKnown, is at most the LastSeen of every waiter
	// of st: the queue_ttl expiry has nothing to do before
	// minLastSeen+queue_ttl. Known only for a state this process
	// committed (see Tx.expireWaiters).
	minLastSeen time.Time
	minKnown    bool
}

// openRegular opens a ledger file for reading without following a symlink
// and without blocking (a FIFO planted in its place must not hang the
// guard), and refuses anything but a regular file we (or, for readers, root)
// own that group and others cannot write. exists is false if there is none.
func openRegular(p string, readOnly bool) (f *os.File, fi fs.FileInfo, exists bool, err error) {
	f, err = os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0) //nolint:gosec // fixed names in the operator's state dir
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, false, nil
	}
	if errors.Is(err, syscall.ELOOP) {
		return nil, nil, true, fmt.Errorf("%w: %s is a symlink; remove it (the ledger never follows links)", ErrUnsafeDir, p)
	}
	if err != nil {
		return nil, nil, true, fmt.Errorf("open %s: %w", p, err)
	}
	fi, err = f.Stat()
	if err == nil && !fi.Mode().IsRegular() {
		err = fmt.Errorf("%w: %s is not a regular file (%s); remove it, the ledger only reads regular files", ErrUnsafeDir, p, fi.Mode().Type())
	}
	if err == nil {
		err = checkOwnerMode(p, fi, readOnly)
	}
	if err != nil {
		_ = f.Close()
		return nil, nil, true, err
	}
	return f, fi, true, nil
}

// readFrom reads f from off to its end, at most limit bytes (more is an
// error wrapping ErrCorrupt: not a file of ours).
func readFrom(f *os.File, off, size, limit int64, buf []byte) ([]byte, error) { //nolint:unparam // the limit is the caller's to state, next to the file it reads
	if size-off > limit {
		return nil, badState("%s is %d bytes, more than the %d a ledger file can be", f.Name(), size, limit)
	}
	buf = slices.Grow(buf[:0], int(max(size-off, 0))+512)
	r := io.LimitReader(io.NewSectionReader(f, off, limit+1), limit+1)
	for {
		if len(buf) == cap(buf) {
			buf = slices.Grow(buf, 64<<10)
		}
		n, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if errors.Is(err, io.EOF) {
			if int64(len(buf)) > limit {
				return nil, badState("%s is more than the %d bytes a ledger file can be", f.Name(), limit)
			}
			return buf, nil
		}
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", f.Name(), err)
		}
	}
}

// loadFiles reads the snapshot and the journal. With a cached load c of the
// same snapshot and journal, only the journal's new records are read.
func (l *Ledger) loadFiles(c *loaded) (loaded, error) {
	var ld loaded
	sf, sfi, sExists, err := openRegular(l.StatePath(), l.readOnly)
	if err != nil {
		return ld, err
	}
	if sExists {
		defer func() { _ = sf.Close() }()
		ld.snapOK, ld.snapID, ld.exists = true, idOf(sfi), true
	}
	jf, jfi, jExists, err := openRegular(l.JournalPath(), l.readOnly)
	if err != nil {
		return ld, err
	}
	if jExists {
		defer func() { _ = jf.Close() }()
		ld.jOK, ld.jID, ld.exists = true, idOf(jfi), true
	}

	// The cache is good if the snapshot is the same file, and the journal
	// the same one, grown at most. A cached journal that ended in a torn
	// record (jEnd short of its size) is read again from jEnd even when it
	// looks unchanged: a writer may have cut that tail and appended a
	// commit of the same length within one timestamp tick (coarse
	// timestamps). Trusting the identity hid that commit; the boot
	// marker's generation then read as commits lost, and a healthy ledger
	// needed recovery.
	if c != nil && c.snapOK == ld.snapOK && c.snapID == ld.snapID && c.jOK == ld.jOK {
		switch {
		case !ld.jOK:
			return *c, nil
		case c.jID == ld.jID && c.jID.size == c.jEnd:
			return *c, nil
		case c.jID.dev == ld.jID.dev && c.jID.ino == ld.jID.ino && ld.jID.size > c.jEnd:
			next, err := l.readJournalTail(jf, c, ld.jID)
			if err == nil {
				return next, nil
			}
			// Fall through to a full read: it names the damage precisely.
		}
	}

	if sExists {
		data, err := readFrom(sf, 0, sfi.Size(), maxStateBytes, nil)
		if err != nil {
			return ld, l.corrupt(l.StatePath(), err)
		}
		ld.snapBytes = int64(len(data))
		ld.format, _ = peekFormat(data)
		ld.st, err = decodeState(data, true) // data is this read's own buffer
		if err != nil {
			return ld, l.corrupt(l.StatePath(), err)
		}
	}
	if !jExists {
		return ld, nil
	}
	data, err := readFrom(jf, 0, jfi.Size(), maxStateBytes, nil)
	if err != nil {
		return ld, l.corrupt(l.JournalPath(), err)
	}
	hdr, recs, end, err := parseJournal(data, 0, true) // data is this read's own buffer
	if err != nil {
		return ld, l.corrupt(l.JournalPath(), err)
	}
	ld.jHdr, ld.jEnd = hdr, end
	if hdr.Genesis && sExists && ld.st.BootID != hdr.BootID && hdr.Base >= ld.st.Generation {
		// A journal from an empty base holds its whole lineage: the first
		// writer after a reboot (startGenesis) was stopped before the
		// snapshot of that base replaced the earlier boot's, whose
		// generation it continues. Stopped by a power cut, the reader is
		// of a third boot, and discards it in turn as an earlier boot's
		// (prepare). The snapshot file stays what it is (snapOK, snapID),
		// so that neither the cache nor replacedMeanwhile mistakes it for
		// one that changed.
		st := hdr.genesisBase()
		if err := applyRecords(&st, recs); err != nil {
			return ld, l.corrupt(l.JournalPath(), err)
		}
		ld.st, ld.genesis, ld.format, ld.snapBytes = st, true, FormatVersion, 0
		return ld, nil
	}
	if !sExists {
		return ld, &NeedsRecoveryError{Path: l.StatePath(), Problem: "the snapshot is missing although the journal " + l.JournalPath() + " is there (deleted or renamed)"}
	}
	if hdr.Lineage != ld.st.Lineage || hdr.BootID != ld.st.BootID {
		return ld, &NeedsRecoveryError{Path: l.JournalPath(), Problem: fmt.Sprintf(
			"the journal (lineage %s, boot %s) does not belong to the snapshot (lineage %s, boot %s): one of them was replaced",
			truncate(hdr.Lineage, 64), truncate(hdr.BootID, 64), truncate(ld.st.Lineage, 64), truncate(ld.st.BootID, 64))}
	}
	if hdr.Base > ld.st.Generation {
		return ld, &NeedsRecoveryError{Path: l.StatePath(), Problem: fmt.Sprintf(
			"the snapshot is of generation %d but the journal continues generation %d: the snapshot was replaced by an older copy",
			ld.st.Generation, hdr.Base)}
	}
	// Records up to the snapshot's generation are already in it (a crash
	// between writing a snapshot and starting its journal leaves them).
	i := 0
	for i < len(recs) && recs[i].Gen <= ld.st.Generation {
		i++
	}
	if i < len(recs) {
		st := ld.st
		if err := applyRecords(&st, recs[i:]); err != nil {
			return ld, l.corrupt(l.JournalPath(), err)
		}
		ld.st = st
	}
	return ld, nil
}

// parseJournal verifies a whole journal: its header, its records, and where
// the complete records end (a torn tail after that is ignored).
// owned says data is never written again: the records' strings point into
// it (fastDecodeRecordOf).
func parseJournal(data []byte, base int64, owned bool) (journalHeader, []journalRecord, int64, error) {
	var hdr journalHeader
	lines, ends, _, err := journalLines(data, base)
	if err != nil {
		return hdr, nil, 0, err
	}
	if len(lines) == 0 {
		return hdr, nil, 0, badState("the journal has no header (empty or torn at its first line)")
	}
	if hdr, err = decodeHeader(lines[0]); err != nil {
		return hdr, nil, 0, err
	}
	recs := make([]journalRecord, 0, len(lines)-1)
	for k := 1; k < len(lines); k++ {
		r, err := decodeRecordOf(lines[k], ends[k], owned)
		if err != nil {
			return hdr, nil, 0, err
		}
		recs = append(recs, r)
	}
	return hdr, recs, ends[len(ends)-1], nil
}

// readJournalTail applies the records appended since c was read.
func (l *Ledger) readJournalTail(jf *os.File, c *loaded, id fileID) (loaded, error) {
	data, err := readFrom(jf, c.jEnd, id.size, maxStateBytes, nil)
	if err != nil {
		return loaded{}, err
	}
	lines, ends, _, err := journalLines(data, c.jEnd)
	if err != nil {
		return loaded{}, err
	}
	next := *c
	next.jID = id
	if len(lines) == 0 {
		return next, nil // only a torn tail: a write in flight or interrupted
	}
	recs := make([]journalRecord, 0, len(lines))
	for k := range lines {
		r, err := decodeRecordOf(lines[k], ends[k], true) // data is this read's own buffer
		if err != nil {
			return loaded{}, err
		}
		recs = append(recs, r)
	}
	st := c.st
	if err := applyRecords(&st, recs); err != nil {
		return loaded{}, err
	}
	next.st, next.jEnd = st, ends[len(ends)-1]
	next.settled = false // another writer's commits
	next.keep = nil
	next.minKnown = false
	return next, nil
}

// corrupt wraps a decode error of path: a *CorruptError, or the
// *FormatError of a newer format with its path.
func (l *Ledger) corrupt(path string, err error) error {
	var fe *FormatError
	if errors.As(err, &fe) {
		fe.Path = path
		return fe
	}
	if errors.Is(err, ErrCorrupt) {
		return &CorruptError{Path: path, Reason: err.Error()}
	}
	return err
}

// current returns the last committed state, checked against this boot's
// marker, from the cache when the files did not change. A read that
// overlapped a compaction (possible only without the lock) is retried.
func (l *Ledger) current() (loaded, error) {
	for attempt := 0; ; attempt++ {
		m, mok, err := l.readMarker()
		if err != nil {
			return loaded{}, err
		}
		c := l.cached()
		ld, err := l.loadFiles(c)
		if attempt < 20 && l.replacedMeanwhile(&ld) {
			continue
		}
		if err != nil {
			return loaded{}, err
		}
		if err := l.checkMarker(&ld, m, mok); err != nil {
			return loaded{}, err
		}
		if c == nil || c.snapID != ld.snapID || c.jID != ld.jID || c.snapOK != ld.snapOK || c.jOK != ld.jOK {
			l.setCache(&ld)
		}
		return ld, nil
	}
}

// replacedMeanwhile reports whether the snapshot path no longer names the
// file that was read: a writer compacted meanwhile, and the journal read may
// belong to the new snapshot. A compaction renames the snapshot before it
// replaces the journal, so this check after reading both catches it.
func (l *Ledger) replacedMeanwhile(ld *loaded) bool {
	fi, err := os.Lstat(l.StatePath()) //nolint:gosec // fixed name in the operator's state dir
	if errors.Is(err, fs.ErrNotExist) {
		return ld.snapOK
	}
	if err != nil {
		return false
	}
	id := idOf(fi)
	return !ld.snapOK || id.dev != ld.snapID.dev || id.ino != ld.snapID.ino
}

// checkMarker refuses state that is not the last committed in this boot:
// missing files, another lineage, an earlier boot's state, or an older
// generation than the marker records.
func (l *Ledger) checkMarker(ld *loaded, m marker, mok bool) error {
	if !mok {
		return nil
	}
	was := fmt.Sprintf("this boot committed generation %d of lineage %s here", m.Generation, truncate(m.Lineage, 64))
	switch {
	case !ld.exists:
		return &NeedsRecoveryError{Path: l.dir, Problem: "the state files are gone (deleted, or the state dir was moved or replaced) but " + was}
	case ld.st.BootID != l.opts.BootID:
		return &NeedsRecoveryError{Path: l.StatePath(), Problem: fmt.Sprintf("the state is from boot %s, but %s: it was replaced", truncate(ld.st.BootID, 64), was)}
	case ld.st.Lineage != m.Lineage:
		return &NeedsRecoveryError{Path: l.StatePath(), Problem: fmt.Sprintf("the state has lineage %q, but %s: it was replaced by another ledger's", truncate(ld.st.Lineage, 64), was)}
	case ld.st.Generation < m.Generation:
		return &NeedsRecoveryError{Path: l.StatePath(), Problem: fmt.Sprintf("the state is of generation %d, but %s: commits were lost (an older copy put back, or the journal cut)", ld.st.Generation, was)}
	}
	return nil
}

func (l *Ledger) cached() *loaded {
	l.cacheMu.Lock()
	defer l.cacheMu.Unlock()
	return l.cache
}

func (l *Ledger) setCache(ld *loaded) {
	l.cacheMu.Lock()
	l.cache = ld
	l.cacheMu.Unlock()
}

// journalTooBig: compact once the journal outgrows the snapshot (so a
// reader never reads more than twice the state), and at least
// compactMinBytes of it (so a small state is not rewritten every commit).
func (l *Ledger) journalTooBig(ld *loaded) bool {
	return ld.jEnd > max(l.compactMin, ld.snapBytes)
}

// compact writes st as the snapshot and starts an empty journal after it.
// The snapshot it replaces (verified: it was just loaded) is kept as
// ledger.json.prev, and the journal as ledger.journal.prev, for Recover.
// Order matters for lock-free readers and crashes: the snapshot is renamed
// into place first (its journal's records up to its generation are skipped
// by readers; replaceSnapshot keeps the old one as .prev), then the journal
// is replaced.
func (l *Ledger) compact(st *State, ld *loaded) (loaded, error) {
	data, hdr, line, err := l.encodeBase(st)
	if err != nil {
		return loaded{}, err
	}
	return l.install(st, data, hdr, line, ld.snapOK, ld.jOK)
}

// encodeBase renders st as a snapshot, and the header of an empty journal
// that continues it.
func (l *Ledger) encodeBase(st *State) (data []byte, hdr journalHeader, line []byte, err error) {
	data, err = l.enc.encode(st, nil)
	if err != nil {
		return nil, hdr, nil, fmt.Errorf("encode ledger state: %w", err)
	}
	hdr = journalHeader{Journal: journalFormat, Lineage: st.Lineage, BootID: st.BootID, Base: st.Generation,
		Genesis: isEmpty(st), BaseNextSeq: st.NextSeq}
	if hdr.Genesis && !st.Clock.IsZero() {
		a := st.Clock
		hdr.BaseClock = &a
	}
	line, err = appendJournalLine(nil, hdr)
	if err != nil {
		return nil, hdr, nil, err
	}
	return data, hdr, line, nil
}

// install puts the snapshot data of st in place, then the journal line
// (hdr) after it, keeping the ones they replace as .prev where keepSnap and
// keepJournal say so, and returns what was written as loaded.
func (l *Ledger) install(st *State, data []byte, hdr journalHeader, line []byte, keepSnap, keepJournal bool) (loaded, error) {
	if err := l.replaceSnapshot(data, keepSnap); err != nil {
		return loaded{}, err
	}
	if _, err := l.replaceJournal(line, keepJournal); err != nil {
		return loaded{}, err
	}
	next := loaded{st: *st, exists: true, snapOK: true, format: FormatVersion, snapBytes: int64(len(data)),
		jOK: true, jHdr: hdr, jEnd: int64(len(line))}
	if fi, err := os.Lstat(l.StatePath()); err == nil { //nolint:gosec // fixed names in the operator's state dir
		next.snapID = idOf(fi)
	}
	if fi, err := os.Lstat(l.JournalPath()); err == nil { //nolint:gosec // fixed names in the operator's state dir
		next.jID = idOf(fi)
	}
	return next, nil
}

// writeBase writes st, the state a recovery or reset made, which no journal
// record holds (it is not a commit after the state on disk, which is
// damaged, of another lineage, or being discarded), as the base that every
// later commit continues: ledger.json.prev and ledger.json each hold it
// (two files, never two names of one: damage in place to one is not damage
// to the other), and ledger.journal.prev and ledger.journal each an empty
// journal after it. Order:
//
//  1. a copy of the snapshot is written to a temp file, fsynced, renamed
//     over ledger.json.prev and the dir fsynced;
//  2. so is the empty journal, over ledger.journal.prev;
//  3. the snapshot and the journal are put in place as a compaction puts
//     them (install), keeping nothing as .prev.
//
// From the instant ledger.json holds st, when a reader may find it healthy
// and commit after it, ledger.json.prev holds st too: should ledger.json
// be lost again, .prev and the journals replay to every commit made since
// (the records of a journal not yet replaced, at or below st's generation,
// are skipped). Writing ledger.json first and .prev after would leave a
// window in which commits follow a state that only ledger.json holds;
// keeping the .prev pair as it was (or, as a compaction does, rotating the
// replaced files into it) leaves it replaying to an older generation, if
// to any: a second loss of ledger.json before the next compaction lost
// every commit since the recovery.
//
// Cut before step 3, the state dir reads as it did. After a recovery's
// cut, that is as needing recovery, and Recover finds st at
// ledger.json.prev (a generation past every other file's, and of this
// boot, so it supersedes the marker's lineage as any state a recovery
// wrote before the marker said so). After a cut reset of a healthy
// ledger, it is that ledger, whose previous snapshot is kept aside (Reset
// linked it) but no longer at ledger.json.prev until its next compaction.
func (l *Ledger) writeBase(st *State) (loaded, error) {
	data, hdr, line, err := l.encodeBase(st)
	if err != nil {
		return loaded{}, err
	}
	if err := l.putBaseFile(prevName, data, stageBaseSnapSynced, stageBaseSnapKept); err != nil {
		return loaded{}, err
	}
	if err := l.putBaseFile(journalPrevName, line, stageBaseJournalSynced, stageBaseJournalKept); err != nil {
		return loaded{}, err
	}
	return l.install(st, data, hdr, line, false, false)
}

// putBaseFile is a step of writeBase: data replaces the file name in the
// state dir in one rename, durable (the temp file and the dir fsynced)
// before the next step.
func (l *Ledger) putBaseFile(name string, data []byte, synced, kept string) error {
	tmp, err := writeTemp(l.dir, tempPrefix+"base-*", data, "", synced)
	if err != nil {
		return err
	}
	p := filepath.Join(l.dir, name)
	if err := os.Rename(tmp, p); err != nil { //nolint:gosec // our temp file onto a fixed name
		_ = os.Remove(tmp) //nolint:gosec // our own temp file
		return fmt.Errorf("rename %s to %s: %w", tmp, p, err)
	}
	if err := syncDir(l.dir); err != nil {
		return err
	}
	reachStage(kept)
	return nil
}

// startGenesis begins the new lineage of the first commit after a reboot
// from an empty base (the earlier boot's state is discarded bar the
// operator's cordons, which this commit's record carries): the journal, its
// header and this commit's record in one file, is put in place first, and
// the snapshot of the empty base after it. A crash before the journal is in
// place leaves the earlier boot's files, read as empty bar its operator
// cordons; a crash after leaves this commit whole in a journal of this boot
// that loadFiles replays from its empty base, past the earlier boot's
// snapshot. (Writing the snapshot first, as compact does, left a window
// with a snapshot of this boot next to the earlier boot's journal, which
// reads as damage, and one with the empty base and no record, which lost the
// operator's cordons.)
func (l *Ledger) startGenesis(base, st *State, touched []string, ld *loaded, audit json.RawMessage) (loaded, error) {
	hdr := journalHeader{Journal: journalFormat, Lineage: base.Lineage, BootID: base.BootID, Base: base.Generation,
		Genesis: true, BaseNextSeq: base.NextSeq}
	content, err := appendJournalLine(nil, hdr)
	if err != nil {
		return loaded{}, err
	}
	rec := recordOf(base, st, touched)
	rec.Audit = audit // the discard of the earlier boot's state among them
	if content, err = appendRecordLine(content, &rec); err != nil {
		return loaded{}, fmt.Errorf("encode journal record: %w", err)
	}
	if placed, err := l.replaceJournal(content, ld.jOK); err != nil {
		if placed {
			// In place, this commit's record with it: readers see it.
			return loaded{}, fmt.Errorf("%w: the new journal %s holding it is in place, the fsync of its directory failed: %w",
				ErrMaybeCommitted, l.JournalPath(), err)
		}
		return loaded{}, err
	}
	next := loaded{st: *st, exists: true, format: FormatVersion, jOK: true, jHdr: hdr, jEnd: int64(len(content))}
	if fi, err := os.Lstat(l.JournalPath()); err == nil { //nolint:gosec // fixed names in the operator's state dir
		next.jID = idOf(fi)
	}
	// The commit is durable: a snapshot that cannot be written now only
	// leaves the next writer to write one (snapOK false).
	data, err := l.enc.encode(base, nil)
	if err == nil {
		err = l.replaceSnapshot(data, ld.snapOK)
	}
	if err != nil {
		l.log.Warn("ledger: the snapshot of a new lineage could not be written; the journal holds the commit", "error", err)
		return next, nil
	}
	next.snapOK, next.snapBytes = true, int64(len(data))
	if fi, err := os.Lstat(l.StatePath()); err == nil { //nolint:gosec // fixed names in the operator's state dir
		next.snapID = idOf(fi)
	}
	return next, nil
}

// replaceSnapshot puts data in place as ledger.json, keeping the snapshot
// it replaces (keepPrev: one that verified) as ledger.json.prev. Order:
//
//  1. the new snapshot is written to a temp file and fsynced;
//  2. the current snapshot is linked to a second temp name;
//  3. the new snapshot is renamed over ledger.json;
//  4. the linked old one is renamed over ledger.json.prev; the dir fsynced.
//
// ledger.json.prev is thus replaced in one rename, by a file that no longer
// has the name ledger.json: it never shares the snapshot's inode (damage in
// place to one would be damage to both), and a write that fails or is cut
// before step 3 leaves it as it was, the only base of ledger.journal.prev.
// Cut between steps 3 and 4, the old snapshot is lost with its temp name
// (the next writer removes it), but nothing else is: the journal is not yet
// replaced, so .prev, .journal.prev and the journal still replay, one after
// the other, to the commit the new snapshot holds. Keeping .prev is for
// Recover only: failing to costs nothing now and is only logged.
func (l *Ledger) replaceSnapshot(data []byte, keepPrev bool) error {
	tmp, err := writeTemp(l.dir, tempPrefix+"*", data, stageSnapWritten, stageSnapSynced)
	if err != nil {
		return err
	}
	prev := filepath.Join(l.dir, prevName)
	old := ""
	if keepPrev {
		if old, err = linkTemp(l.dir, l.StatePath(), tempPrefix+"prev-"); err != nil {
			l.log.Warn("ledger: could not keep the previous snapshot", "path", prev, "error", err)
		}
		reachStage(stagePrevLinked)
	}
	if err := os.Rename(tmp, l.StatePath()); err != nil { //nolint:gosec // our temp file onto the fixed state name
		_ = os.Remove(tmp) //nolint:gosec // our own temp file
		if old != "" {
			_ = os.Remove(old) // our own temp link; the snapshot keeps its name
		}
		return fmt.Errorf("rename %s to %s: %w", tmp, l.StatePath(), err)
	}
	reachStage(stageAfterRename)
	if old != "" {
		if err := os.Rename(old, prev); err != nil { //nolint:gosec // our temp link onto the fixed name
			_ = os.Remove(old) // our own temp link
			l.log.Warn("ledger: could not keep the previous snapshot", "path", prev, "error", err)
		}
		reachStage(stagePrevKept)
	}
	if err := syncDir(l.dir); err != nil {
		return err
	}
	reachStage(stageAfterDirSyn)
	return nil
}

func isEmpty(st *State) bool {
	return len(st.Claims) == 0 && len(st.Waiters) == 0 && len(st.Reservations) == 0 && len(st.Conflicts) == 0 &&
		len(st.Cordons) == 0
}

// replaceJournal puts a new journal holding header (and whatever records
// follow it in the same bytes) in place, keeping the journal it replaces
// (keepPrev: one that verified) as ledger.journal.prev. Order:
//
//  1. the new journal is written to a temp file and fsynced;
//  2. the current journal is linked to a second temp name;
//  3. that name is renamed over ledger.journal.prev;
//  4. the new journal is renamed over ledger.journal; the dir fsynced.
//
// ledger.journal.prev is thus replaced in one rename, as replaceSnapshot
// replaces ledger.json.prev: cut anywhere, it is the journal it was or the
// one being replaced, never missing, and either replays onto
// ledger.json.prev (the old one's records all precede it, the replaced
// one continues it). The old journal keeps its name until the new one
// replaces it in one rename: a crash never leaves the state dir without a
// journal next to a snapshot that needs it. Unlike the snapshot's, the
// previous journal cannot be renamed into place after the new one: cut in
// between, it would be left under a temp name only, and nothing would
// replay from ledger.json.prev to the new snapshot's generation.
//
// placed reports that the new journal is in place (an error then is the
// directory's fsync: readers see the new journal).
func (l *Ledger) replaceJournal(header []byte, keepPrev bool) (placed bool, err error) {
	tmp, err := writeTemp(l.dir, tempPrefix+"journal-*", header, "", "")
	if err != nil {
		return false, err
	}
	ok := false
	defer func() {
		if !ok {
			_ = os.Remove(tmp) //nolint:gosec // our own temp file
		}
	}()
	reachStage(stageJournalSynced)
	if keepPrev {
		l.keepPrevJournal()
	}
	reachStage(stageJournalRotated)
	if err := os.Rename(tmp, l.JournalPath()); err != nil { //nolint:gosec // our temp file onto the fixed journal name
		return false, fmt.Errorf("rename %s to %s: %w", tmp, l.JournalPath(), err)
	}
	ok = true
	if err := syncDir(l.dir); err != nil {
		return true, err
	}
	reachStage(stageJournalSwapped)
	return true, nil
}

// keepPrevJournal is steps 2 and 3 of replaceJournal: the journal in place
// becomes ledger.journal.prev too. It is for Recover only: failing to keep
// it costs nothing now and is only logged.
func (l *Ledger) keepPrevJournal() {
	prev := filepath.Join(l.dir, journalPrevName)
	cur, err := os.Lstat(l.JournalPath()) //nolint:gosec // fixed names in the operator's state dir
	if errors.Is(err, fs.ErrNotExist) {
		return // nothing to keep
	}
	// A writer cut between steps 3 and 4 left ledger.journal.prev a second
	// name of the journal, which is kept already; renaming a link over
	// another name of the same file would do nothing and leave the temp
	// name behind (rename(2)).
	if p, perr := os.Lstat(prev); err == nil && perr == nil && os.SameFile(cur, p) { //nolint:gosec // fixed names in the operator's state dir
		return
	}
	old, err := linkTemp(l.dir, l.JournalPath(), tempPrefix+"journal-prev-")
	if err != nil {
		l.log.Warn("ledger: could not keep the previous journal", "path", prev, "error", err)
		return
	}
	reachStage(stageJournalLinked)
	if err := os.Rename(old, prev); err != nil { //nolint:gosec // our temp link onto the fixed name
		_ = os.Remove(old) // our own temp link; the journal keeps its name
		l.log.Warn("ledger: could not keep the previous journal", "path", prev, "error", err)
	}
}

// appendRecord appends one commit to the journal (one write, one fdatasync)
// after cutting a torn tail left by a crashed writer. A failed fdatasync
// returns an error wrapping ErrMaybeCommitted: the record was written.
func (l *Ledger) appendRecord(rec *journalRecord, ld *loaded) (loaded, error) {
	line, err := appendRecordLine(l.recBuf[:0], rec)
	if err != nil {
		return loaded{}, fmt.Errorf("encode journal record: %w", err)
	}
	l.recBuf = line
	f, err := os.OpenFile(l.JournalPath(), os.O_WRONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0) //nolint:gosec // fixed name in the operator's state dir
	if err != nil {
		return loaded{}, fmt.Errorf("open journal: %w", err)
	}
	defer func() { _ = f.Close() }()
	if ld.jID.size != ld.jEnd {
		l.log.Warn("ledger: cutting the torn last record of an interrupted commit", "journal", l.JournalPath(),
			"offset", ld.jEnd, "bytes", ld.jID.size-ld.jEnd)
		if err := f.Truncate(ld.jEnd); err != nil {
			return loaded{}, fmt.Errorf("cut the torn tail of %s: %w", l.JournalPath(), err)
		}
	}
	if failpoint != nil {
		// Tests: a write cut in the middle, as a crash leaves it.
		half := len(line) / 2
		if _, err := f.WriteAt(line[:half], ld.jEnd); err != nil {
			return loaded{}, fmt.Errorf("append to %s: %w", l.JournalPath(), err)
		}
		reachStage(stageTornWrite)
		if _, err := f.WriteAt(line[half:], ld.jEnd+int64(half)); err != nil {
			return loaded{}, fmt.Errorf("append to %s: %w", l.JournalPath(), err)
		}
	} else if _, err := f.WriteAt(line, ld.jEnd); err != nil {
		return loaded{}, fmt.Errorf("append to %s: %w", l.JournalPath(), err)
	}
	reachStage(stageAfterWrite)
	if err := syncJournal(f, l.JournalPath()); err != nil {
		// Not cut back: a lock-free reader may have read the record
		// already, and a cut is one more write to a disk that just
		// failed one, whose own sync may fail the same way. The caller
		// is told that the commit may stand.
		return loaded{}, fmt.Errorf("%w: the record is in %s, whose fdatasync failed: %w", ErrMaybeCommitted, l.JournalPath(), err)
	}
	reachStage(stageAfterFsync)
	next := *ld
	next.jEnd += int64(len(line))
	if fi, err := f.Stat(); err == nil {
		next.jID = idOf(fi)
	}
	return next, nil
}

// syncJournal makes the record just appended to the journal at path durable.
func syncJournal(f *os.File, path string) error {
	if err := ledgerfault.Sync(path); err != nil {
		return err
	}
	return syscall.Fdatasync(int(f.Fd()))
}
