// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gofrs/flock"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/phasetrace"
)

// Defaults of Options (DESIGN §7).
const (
	DefaultLockTimeout    = time.Second
	DefaultAuditMaxBytes  = 10 << 20
	DefaultReservationTTL = 6 * time.Minute
	DefaultQueueTTL       = 15 * time.Minute
)

// bootIDPath is where Linux publishes the random id of the current boot.
const bootIDPath = "/proc/sys/kernel/random/boot_id"

// Ledger is a handle on the state dir. It is safe for concurrent use by
// goroutines; any number of processes may hold one on the same dir.
type Ledger struct {
	dir      string
	opts     Options
	readOnly bool
	log      *slog.Logger
	flock    *flock.Flock
	// sem serialises Update within this process (see acquire). Fields below
	// it up to fenceMu are only touched while holding it.
	sem        chan struct{}
	cleaned    bool    // stray temp files removed once
	enc        encoder // renders snapshots under the lock
	recBuf     []byte  // renders journal records under the lock
	auditBuf   []byte  // renders a commit's audit lines under the lock
	auditList  []byte  // the same as its journal record carries them
	compactMin int64   // see journalTooBig
	// compactAlways compacts after every commit (tests of recovery).
	compactAlways bool
	// fullPasses makes every reservation pass look at every waiter (tests
	// compare the incremental pass with it; see Tx.reserveCandidates).
	fullPasses bool
	markerF    *os.File // the boot marker, kept open (see writeMarker)

	// fence is the lineage every Update requires ("" = none; see
	// RequireLineage).
	fenceMu sync.Mutex
	fence   string

	// The last committed state this process read or wrote, with the
	// identity of the files it came from: unchanged files are not read
	// again, a grown journal only from where it was. The cached state is
	// never mutated: Tx copies what it changes, Snapshot hands out copies.
	cacheMu sync.Mutex
	cache   *loaded
}

// defaultCompactMin is the journal size below which it is never compacted.
// Every process that reads the ledger cold (each OCI hook run, each
// gpu-guard-ctl command) replays the whole journal since the last
// compaction, a few microseconds a record; compacting a small state costs
// four fsyncs (about 1.7 ms on the build machine's disk). At 16 KiB (some
// 37 claims with their releases) a cold read replays about 40 records on
// average: a hook's read of an eight-GPU ledger took 170 µs on average
// against 240 µs at 32 KiB, 145 µs at 8 KiB, and a claim + release pair of
// hook processes spent 100–160 µs less in the ledger (compaction included),
// while compaction adds about 5 % to the fsyncs of the commits between two
// of them (2.7 % at 32 KiB; at 256 KiB a cold read once replayed ~4 ms).
const defaultCompactMin = 16 << 10

// Open opens (creating it 0700 if missing) the ledger in dir for reading and
// writing. It refuses, with ErrUnsafeDir, a dir or ledger file that is a
// symlink, not a regular file, writable by group or others, or owned by
// another user. A dir that is missing although this boot committed a ledger
// there (the boot marker says so) is not created: every Update then fails
// with ErrNeedsRecovery. Open checks the dir's whole parent chain with
// CheckDirChain (before and after creating it), so every front end does.
func Open(dir string, opts Options) (*Ledger, error) {
	return open(dir, opts, false)
}

// OpenReadOnly opens the ledger in dir for gpu-guard-ctl reads. It never
// creates, locks, moves or writes anything; a missing dir or state file reads
// as an empty State on a fresh host, and as ErrNeedsRecovery once this boot
// committed a ledger there. The same safety checks as Open apply to what exists,
// except that root-owned files are accepted for any reader.
func OpenReadOnly(dir string, opts Options) (*Ledger, error) {
	return open(dir, opts, true)
}

func open(dir string, opts Options, readOnly bool) (*Ledger, error) {
	if dir == "" {
		return nil, fmt.Errorf("%w: empty ledger dir", ErrInvalid)
	}
	dir = filepath.Clean(dir)
	opts, err := withDefaults(opts)
	if err != nil {
		return nil, err
	}
	l := &Ledger{
		dir:        dir,
		opts:       opts,
		readOnly:   readOnly,
		log:        opts.Logger,
		sem:        make(chan struct{}, 1),
		compactMin: defaultCompactMin,
	}
	// A state dir that is gone although this boot committed a ledger there
	// is not created afresh: every Update refuses until it is recovered.
	create := !readOnly
	if create {
		if _, known, err := l.readMarker(); err != nil || known {
			create = false
		}
	}
	// The chain is checked before anything is created in it, and again
	// after where part of it was missing: a dir someone else made in a
	// sticky parent meanwhile is theirs. A chain that was whole needs no
	// second walk (the common case: every hook run opens an existing dir).
	complete, err := checkDirChain(dir)
	if err != nil {
		return nil, err
	}
	missing, created, err := checkDir(dir, create, readOnly)
	if err != nil {
		return nil, err
	}
	if created || (!complete && !missing) {
		if err := CheckDirChain(dir); err != nil {
			return nil, err
		}
	}
	if !missing {
		if err := checkFiles(dir, readOnly); err != nil {
			return nil, err
		}
	}
	if !readOnly {
		// O_NOFOLLOW: a symlink planted after the check is refused, not
		// followed; O_NONBLOCK: a FIFO planted there does not hang us.
		l.flock = flock.New(l.LockPath(),
			flock.SetFlag(os.O_CREATE|os.O_RDWR|syscall.O_NOFOLLOW|syscall.O_NONBLOCK),
			flock.SetPermissions(0o600))
	}
	return l, nil
}

func withDefaults(o Options) (Options, error) {
	if o.LockTimeout <= 0 {
		o.LockTimeout = DefaultLockTimeout
	}
	if o.AuditMaxBytes <= 0 {
		o.AuditMaxBytes = DefaultAuditMaxBytes
	}
	if o.ReservationTTL <= 0 {
		o.ReservationTTL = DefaultReservationTTL
	}
	if o.QueueTTL <= 0 {
		o.QueueTTL = DefaultQueueTTL
	}
	if o.Now == nil {
		o.Now = time.Now
		if o.BootClock == nil {
			o.BootClock = SinceBoot
		}
	}
	if o.BootClock == nil {
		o.BootClock = noBootClock // see Options.BootClock
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.RuntimeDir == "" {
		o.RuntimeDir = DefaultRuntimeDir
	}
	o.RuntimeDir = filepath.Clean(o.RuntimeDir)
	if o.BootID == "" {
		b, err := HostBootID()
		if err != nil {
			return o, fmt.Errorf("read boot id (claims from an earlier boot must be discarded, so the ledger needs it): %w", err)
		}
		o.BootID = b
	}
	return o, nil
}

var hostBoot struct {
	sync.Mutex
	id string
}

// HostBootID is the id of the current boot (bootIDPath). It is read once per
// process, as it cannot change while the process runs: the OCI hook asks
// for it both to load the GPU inventory (whose cache records the boot it was
// written in) and to open the ledger, and reads the file once. A failed
// read is not remembered.
func HostBootID() (string, error) {
	hostBoot.Lock()
	defer hostBoot.Unlock()
	if hostBoot.id != "" {
		return hostBoot.id, nil
	}
	b, err := os.ReadFile(bootIDPath)
	if err != nil {
		return "", err
	}
	id := strings.TrimSpace(string(b))
	if id == "" {
		return "", fmt.Errorf("%s is empty", bootIDPath)
	}
	hostBoot.id = id
	return id, nil
}

// Dir is the state dir.
func (l *Ledger) Dir() string { return l.dir }

// StatePath is the snapshot, ledger.json.
func (l *Ledger) StatePath() string { return filepath.Join(l.dir, stateName) }

// JournalPath is the journal of the commits since the snapshot,
// ledger.journal.
func (l *Ledger) JournalPath() string { return filepath.Join(l.dir, journalName) }

// LockPath is the lock file, ledger.lock (never deleted).
func (l *Ledger) LockPath() string { return filepath.Join(l.dir, lockName) }

// AuditPath is the audit log, audit.log (rotated to audit.log.1).
func (l *Ledger) AuditPath() string { return filepath.Join(l.dir, auditName) }

// BootID is the boot id the ledger stamps on (and requires of) the state.
func (l *Ledger) BootID() string { return l.opts.BootID }

func (l *Ledger) now() time.Time {
	// UTC and no monotonic reading: the value is stored and compared with
	// stored values.
	return l.opts.Now().UTC().Round(0)
}

// Snapshot returns the last committed state. It reads without the lock (a
// commit appends whole records and a compaction renames files into place,
// so a reader sees a committed state; a read that overlapped a compaction is
// retried) and never moves or writes anything. A state from an earlier boot,
// or none on a fresh host, reads as empty (bar its operator cordons). A state that is damaged,
// missing, replaced or rolled back is an error (*CorruptError,
// *NeedsRecoveryError: both wrap ErrNeedsRecovery), never an empty state.
// The result is the caller's to keep and modify.
func (l *Ledger) Snapshot(ctx context.Context) (State, error) {
	st, err := l.read(ctx)
	if err != nil {
		return State{}, err
	}
	return st.Clone(), nil
}

// Committed returns, without reading anything, the committed state this
// handle last read or wrote: right after an Update returned nil, the state
// it committed (or found, if it changed nothing), as of the end of its lock
// hold. ok is false when there is none of this boot. The result shares
// storage with the handle's cache and must not be modified.
func (l *Ledger) Committed() (st State, ok bool) {
	c := l.cached()
	if c == nil || !c.exists || c.st.BootID != l.opts.BootID {
		return State{}, false
	}
	return c.st, true
}

// View runs fn on a transaction over the committed state with the queue
// mechanics applied as of now (expired waiters and reservations gone, free
// devices reserved), and discards every change: Busy, Position and the
// decision an Update would make, without writing (gpu-guard-ctl explain).
func (l *Ledger) View(ctx context.Context, fn func(tx *Tx) error) error {
	st, err := l.readStored(ctx)
	if err != nil {
		return err
	}
	now, boot := l.clock()
	tx := newTx(l, st, now, boot) // moves the times by a step of the wall clock, as an Update would
	defer tx.close()
	tx.maintain()
	return fn(tx)
}

// confirmWait bounds how long a read that finds the ledger needing recovery
// waits for the lock to confirm it (see read).
var confirmWait = 2 * time.Second // a variable for tests

// ClaimsOf returns the claims of container id, as Snapshot would show them,
// without copying the rest of the state.
func (l *Ledger) ClaimsOf(ctx context.Context, id string) ([]Claim, error) {
	st, err := l.read(ctx)
	if err != nil {
		return nil, err
	}
	var out []Claim
	for _, c := range st.Claims {
		if c.Owner.ContainerID == id {
			out = append(out, c)
		}
	}
	return out, nil
}

// read is Snapshot without the copy: the result may share storage with the
// cache and must not be modified. Where the wall clock was stepped since the
// state's anchor, its times are moved by the step, as the next writer will
// move them (asOfClock): a reader judges deadlines and shows ages as that
// writer will.
func (l *Ledger) read(ctx context.Context) (State, error) {
	st, err := l.readStored(ctx)
	if err != nil {
		return State{}, err
	}
	wall, boot := l.clock()
	return l.asOfClock(st, wall, boot), nil
}

// readStored is read with the times as stored.
func (l *Ledger) readStored(ctx context.Context) (State, error) {
	if err := ctx.Err(); err != nil {
		return State{}, err
	}
	ld, err := l.current()
	if err != nil && !l.readOnly && errors.Is(err, ErrNeedsRecovery) {
		// Read without the lock, the files and the marker of another
		// process's recovery or reset can be caught half replaced (its
		// new snapshot beside the old journal, or the new state before
		// the marker that names it). Damage is only reported once a read
		// under the lock, after any such writer, confirms it. The wait is
		// short (confirmWait): a recovery holds the lock for milliseconds,
		// and a reader (the observer, a metrics scrape) must not stall for
		// lock_timeout behind a lock held for long while the ledger is
		// really damaged.
		cctx, cancel := context.WithTimeout(ctx, confirmWait)
		if unlock, lerr := l.acquire(cctx); lerr == nil {
			ld, err = l.current()
			unlock()
		}
		cancel()
	}
	if err != nil {
		if l.readOnly && errors.Is(err, os.ErrPermission) {
			return State{}, fmt.Errorf("read ledger (run as root): %w", err)
		}
		return State{}, err
	}
	if !ld.exists {
		return l.emptyState(0, 0), nil
	}
	if ld.st.BootID != l.opts.BootID {
		st := l.emptyState(ld.st.Generation, ld.st.NextSeq)
		st.Cordons = bootKeptCordons(ld.st.Cordons) // as the next Update keeps them
		return st, nil
	}
	return ld.st, nil
}

func (l *Ledger) emptyState(generation, nextSeq uint64) State {
	return State{Generation: generation, NextSeq: nextSeq, BootID: l.opts.BootID}
}

// RequireLineage fences every later Update of this Ledger: a state whose
// lineage is not lineage is refused with a *LineageError, without running
// the function. "" removes the fence.
//
// The NRI daemon fences its decisions with the lineage it reconciled at the
// runtime's Synchronize: a state started afresh since (Reset, or Recover
// that could not restore every commit) has forgotten the running holders it
// learned there, and deciding on it could hand a held GPU to a newcomer. The
// check costs a string comparison: no extra read.
func (l *Ledger) RequireLineage(lineage string) {
	l.fenceMu.Lock()
	l.fence = lineage
	l.fenceMu.Unlock()
}

// CheckLineage reports, for a state read from this ledger (Snapshot), a
// *LineageError when it is not of the lineage RequireLineage set: another
// process started the ledger afresh, and the state no longer knows every
// running holder. Readers that act on who holds what (the observer) check it
// as writers do; nil when no lineage is required.
func (l *Ledger) CheckLineage(st *State) error {
	if want := l.requiredLineage(); want != "" && st.Lineage != want {
		return &LineageError{Path: l.StatePath(), Expected: want, Found: st.Lineage,
			Why: "another process started it afresh since (gpu-guard-ctl recover, recover --reset), or it is gone"}
	}
	return nil
}

func (l *Ledger) requiredLineage() string {
	l.fenceMu.Lock()
	defer l.fenceMu.Unlock()
	return l.fence
}

// Update runs fn as one atomic mutation of the ledger, under the host-wide
// lock taken within min(LockTimeout, ctx deadline) (else a *LockError).
//
// The queue mechanics run before fn and after it (see Tx). If fn returns an
// error nothing is written and that error is returned. If nothing changed,
// nothing is written (records from Tx.Audit alone are still appended to the
// audit log). Otherwise the commit (generation+1) is appended to the
// journal with one fsync, or, now and then, the whole state is written as
// the new snapshot (compaction), and its audit records appended.
//
// No admission is ever decided against a state that is not the last one
// committed: a snapshot or journal that does not verify (*CorruptError), or
// state that is missing, moved, replaced or rolled back against this boot's
// marker (*NeedsRecoveryError), makes Update fail without running fn — the
// files are left as they are — until Recover or Reset. A file of a newer
// format is left alone and yields a *FormatError. A state from an earlier
// boot is discarded (audited) and fn runs on an empty state (with its
// operator cordons, see keepCordonsAcrossBoot), which (like the
// state of a fresh host) gets a new lineage. Under RequireLineage, a state
// of another lineage yields a *LineageError without running fn.
//
// An error while the commit is made durable, once it was written (the
// journal record's fdatasync, the state dir's fsync after a new lineage's
// journal was renamed into place), wraps ErrMaybeCommitted: the commit is
// visible to every later reader and the caller must take it for made (see
// ErrMaybeCommitted). Any other error means nothing of fn's was written.
//
// fn must not call Update, View or Snapshot of the same Ledger (the lock is
// not reentrant) and must not keep tx.
func (l *Ledger) Update(ctx context.Context, fn func(tx *Tx) error) error {
	unlock, _, err := l.lockForWrite(ctx, "update", false)
	if err != nil {
		return err
	}
	defer unlock()
	phasetrace.Mark("lock")

	now, boot := l.clock()
	ld, err := l.current()
	if err != nil {
		return err
	}
	phasetrace.Mark("read")
	st, pre, origin := l.prepare(&ld, now)
	if want := l.requiredLineage(); want != "" && st.Lineage != want {
		return l.lineageError(want, st.Lineage, origin)
	}
	tx := newTx(l, st, now, boot)
	defer tx.close()
	tx.freshLineage = origin != ""
	if len(pre) > 0 {
		tx.audit = append(tx.audit, pre...)
		tx.touch()
	}
	if origin == originOtherBoot {
		tx.keepCordonsAcrossBoot(ld.st.Cordons) // an operator's cordon outlives a reboot
	}
	// What this process knew of the state it committed holds for its
	// times as stored: a step of the wall clock moved them all.
	asStored := origin == "" && len(pre) == 0 && tx.clockStep == 0
	tx.baseSettled = ld.settled && asStored
	if asStored {
		tx.minLastSeen, tx.minKnown = ld.minLastSeen, ld.minKnown
	}
	if tx.baseSettled {
		tx.keep = ld.keep
		tx.fixed = &queueFixed{claims: tx.base.Claims, reservations: tx.base.Reservations, cordons: tx.base.Cordons, keep: tx.keptForHead()}
	}
	tx.maintain()
	if err := fn(tx); err != nil {
		return err
	}
	tx.maintain()
	return l.commit(tx, &ld, origin)
}

// lockTrouble explains a lock file that cannot be opened because the state
// dir is gone.
func (l *Ledger) lockTrouble(err error) error {
	if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if _, known, merr := l.readMarker(); merr == nil && known {
		return &NeedsRecoveryError{Path: l.dir, Problem: "the state dir is gone (moved or deleted) although this boot committed a ledger there"}
	}
	return fmt.Errorf("ledger dir %s is gone: %w", l.dir, err)
}

// lockForWrite is how every writer (Update, Recover, Reset) starts: refuse a
// read-only ledger, recreate the state dir when asked (recovery of a dir
// that vanished), take the lock (a vanished dir worded by lockTrouble) and remove
// the temp files a crashed writer left. The caller defers the unlock. made
// is the topmost dir it created ("" if none): a caller that ends up writing
// nothing removes what it made (unmakeDir), so that a dir moved away can be
// put back at its name.
func (l *Ledger) lockForWrite(ctx context.Context, verb string, createDir bool) (unlock func(), made string, err error) {
	if l.readOnly {
		return nil, "", fmt.Errorf("%s %s: %w", verb, l.StatePath(), ErrReadOnly)
	}
	if createDir {
		if made, err = l.ensureDir(); err != nil {
			return nil, "", err
		}
	}
	unlock, err = l.acquire(ctx)
	if err != nil {
		return nil, "", l.lockTrouble(err)
	}
	l.removeTemps()
	return unlock, made, nil
}

// removeTemps deletes, once per Ledger, temp files of an interrupted write
// (lock held).
func (l *Ledger) removeTemps() {
	if l.cleaned {
		return
	}
	removed, err := removeStrayTemps(l.dir)
	if err != nil {
		l.log.Warn("ledger: could not remove stray temp files", "dir", l.dir, "error", err)
	} else {
		l.cleaned = true
	}
	if len(removed) > 0 {
		l.log.Warn("ledger: removed temp files of an interrupted write", "files", removed)
	}
}

// prepare turns the loaded state into the one a Tx starts from. pre holds
// audit records of what that itself changed (a state from an earlier boot
// discarded). A state that starts empty (a fresh host, an earlier boot's
// state discarded) gets a new lineage, and so does a file without one;
// origin then says why (see the origin constants), and is "" for a state
// loaded with its lineage. The new lineage is stored by the first commit.
// A state that starts empty continues the generation of the one it
// replaces, or of the audit log's last record where that is higher (state
// files lost, and a reboot: see auditedThrough).
func (l *Ledger) prepare(ld *loaded, now time.Time) (st State, pre []AuditRecord, origin string) {
	if !ld.exists {
		st = l.emptyState(l.auditedThrough(), 0)
		st.Lineage = newLineage()
		return st, nil, originNoFile
	}
	st = ld.st
	if st.BootID == l.opts.BootID {
		if st.Lineage == "" {
			// st is a copy: the cached state keeps the file's "".
			st.Lineage = newLineage()
			return st, nil, originLegacy
		}
		return st, nil, ""
	}
	reason := fmt.Sprintf("state of boot %s (generation %d, %d claims, %d waiters) is from before the current boot %s",
		truncate(st.BootID, 64), st.Generation, len(st.Claims), len(st.Waiters), l.opts.BootID)
	l.log.Warn("ledger: discarding state from an earlier boot", "reason", reason)
	rec := AuditRecord{Time: now, Op: OpDiscard, Reason: reason}
	for _, c := range st.Claims {
		rec.Devices = append(rec.Devices, c.Device.UUID)
	}
	// Generation and sequence numbers keep counting up across boots.
	empty := l.emptyState(max(st.Generation, l.auditedThrough()), st.NextSeq)
	empty.Lineage = newLineage()
	return empty, []AuditRecord{rec}, originOtherBoot
}

// lineageError describes a loaded state of another lineage than want.
func (l *Ledger) lineageError(want, found, origin string) error {
	e := &LineageError{Path: l.StatePath(), Expected: want, Found: found, Why: origin}
	if origin != "" {
		e.Found = "" // made up by this load, never stored
	} else {
		e.Why = fmt.Sprintf("the state has lineage %s: the ledger was started afresh (reset, or recovered without "+
			"every commit) and has been written since", truncate(found, 64))
	}
	return e
}

// commit writes the transaction's state, if it changed, and its audit
// records: one journal record, or a snapshot when the lineage is new, the
// file is of the old format, or the journal has outgrown the snapshot.
//
// The audit records go into the journal record too, and audit.log gets
// them after the commit is durable: a writer stopped in between leaves them
// in the journal, and the next writer appends them (auditLog.catchUp), as
// it appends, before this commit, those of earlier commits the log lacks.
func (l *Ledger) commit(tx *Tx, ld *loaded, origin string) error {
	pid := os.Getpid()
	if !tx.dirty {
		if len(tx.audit) == 0 {
			return nil
		}
		for i := range tx.audit {
			tx.audit[i].Generation, tx.audit[i].Pid = tx.st.Generation, pid
		}
		return l.appendAudit(tx.audit, nil, tx.st.Generation, false)
	}
	st := tx.st
	if st.Generation == math.MaxUint64 {
		// A damaged file's number: wrapped, it would read as an older
		// state than every reader's. Fail closed.
		return fmt.Errorf("%w: generation %d cannot be numbered on; run gpu-guard-ctl recover --reset", ErrCorrupt, st.Generation)
	}
	st.Generation++
	st.BootID = l.opts.BootID
	if st.Lineage == "" {
		st.Lineage = newLineage() // prepare sets one; never store a state without
	}
	st.UpdatedAt = tx.now
	st.Clock = tx.anchorToStore()
	// The queue mechanics ran over the order the Tx had; a state they
	// settled in another order is not known to be settled in this one.
	reordered := st.sort(tx.waitersOwned)
	// Waiters the Tx did not touch come from a verified state.
	if err := validate(&st, tx.waitersOwned); err != nil {
		return fmt.Errorf("ledger: refusing to write a state that breaks an invariant (a bug; nothing was written): %w", err)
	}
	for i := range tx.audit {
		tx.audit[i].Generation, tx.audit[i].Pid = st.Generation, pid
		if len(tx.audit) > 1 {
			// Its place: a write of them cut right after one's newline
			// leaves a log whose last record says more follow (tailOf).
			tx.audit[i].Seq = auditSeq(i+1, len(tx.audit))
		}
	}
	// Rendered once: for the journal record and for audit.log.
	lines, err := appendAuditLines(l.auditBuf[:0], tx.audit)
	if err == nil {
		l.auditBuf = lines
		l.auditList, err = journalAudit(l.auditList, tx.audit, lines)
	}
	if err != nil {
		// Never seen (a time outside years 0-9999): the commit goes on
		// without them in its record; audit.log's append reports it.
		l.log.Error("ledger: the audit records of a commit do not encode", "generation", st.Generation, "error", err)
		lines, l.auditList = nil, l.auditList[:0]
	}
	aud := l.openAuditCaughtUp(st.Generation - 1)
	reachStage(stageBeforeWrite)
	phasetrace.Mark("decide")
	next, err := l.write(tx, ld, &st, origin, l.auditList)
	if err != nil {
		if aud != nil {
			_ = aud.close()
		}
		l.setCache(nil)
		return err
	}
	phasetrace.Mark("commit")
	next.st = st
	next.settled = tx.settled && !reordered
	next.keep = nil
	if next.settled {
		next.keep = tx.keep // found for tx.st, which st is
	}
	next.minLastSeen, next.minKnown = tx.minLastSeen, tx.minKnown
	l.setCache(&next)
	if err := l.writeMarker(&st); err != nil {
		// The commit stands; what is lost is the means to notice, later in
		// this boot, that the state dir vanished.
		l.log.Error("ledger: state committed but the boot marker was not updated", "generation", st.Generation, "error", err)
	}
	l.logClockStep(tx.clockStep, tx.now, st.Generation)
	if err := l.finishAudit(aud, st.Generation-1, tx.audit, lines); err != nil {
		// The state is committed: failing the call would make the caller
		// believe it was not. The journal record holds the records: the
		// next writer appends them.
		l.log.Error("ledger: state committed but its audit records were not written", "generation", st.Generation, "error", err)
	}
	phasetrace.Mark("marker-audit")
	reachStage(stageAfterAudit)
	return nil
}

// write makes the commit durable: one journal record, appended and synced.
// Every commit is a record, so that the previous snapshot and the journals
// replay to any commit should the current snapshot be lost. The state it
// follows is first written as the snapshot when there is none to append to:
// a fresh start (an empty base, so that its journal replays from nothing),
// a format 1 file or a journal of an older version (the upgrade: a build
// that reads that version may still be running, and would take this
// build's records for damage), a new lineage or a missing journal. After
// the append, a journal grown past the snapshot is compacted into a new one.
//
// audit is the commit's audit records, which its record carries.
func (l *Ledger) write(tx *Tx, ld *loaded, st *State, origin string, audit json.RawMessage) (loaded, error) {
	if err := l.checkLockFile(); err != nil {
		return loaded{}, err
	}
	cur := *ld
	var next loaded
	genesis := false
	if origin != "" || !ld.snapOK || ld.genesis || !ld.jOK || ld.format != FormatVersion || ld.jHdr.Journal != journalFormat {
		base := tx.base
		base.Lineage, base.BootID = st.Lineage, l.opts.BootID
		if base.UpdatedAt.IsZero() {
			base.UpdatedAt = tx.now
		}
		base.sort(true)
		if origin == originOtherBoot && isEmpty(&base) {
			n, err := l.startGenesis(&base, st, tx.touchedWaiters, ld, audit)
			if err != nil {
				return loaded{}, err
			}
			next, genesis = n, true
		} else {
			b, err := l.compact(&base, ld)
			if err != nil {
				return loaded{}, err
			}
			b.st = base
			cur = b
		}
	}
	if !genesis {
		rec := recordOf(&cur.st, st, tx.touchedWaiters)
		rec.Audit = audit
		n, err := l.appendRecord(&rec, &cur)
		if err != nil {
			return loaded{}, err
		}
		next = n
	}
	if l.compactAlways || l.journalTooBig(&next) {
		// The commit is durable already: a failed compaction only costs
		// the next reader a longer journal.
		c, err := l.compact(st, &next)
		if err != nil {
			l.log.Warn("ledger: compaction failed; the journal keeps growing until the next one", "error", err)
			return next, nil
		}
		next = c
	}
	return next, nil
}

// sort restores the documented order of every slice. It writes only to a
// slice that is out of order: one a Tx changed and therefore owns, never one
// shared with the cache. The queue, the long list, is looked at only if
// waiters (a Tx that did not copy it left it as loaded: sorted).
func (s *State) sort(waiters bool) (reordered bool) {
	byUUIDClaim := func(a, b Claim) int { return strings.Compare(a.Device.UUID, b.Device.UUID) }
	if !slices.IsSortedFunc(s.Claims, byUUIDClaim) {
		slices.SortFunc(s.Claims, byUUIDClaim)
		reordered = true
	}
	byUUIDRes := func(a, b Reservation) int { return strings.Compare(a.Device.UUID, b.Device.UUID) }
	if !slices.IsSortedFunc(s.Reservations, byUUIDRes) {
		slices.SortFunc(s.Reservations, byUUIDRes)
		reordered = true
	}
	bySeq := func(a, b Waiter) int { return cmpUint(a.Seq, b.Seq) }
	if waiters && !slices.IsSortedFunc(s.Waiters, bySeq) {
		slices.SortFunc(s.Waiters, bySeq)
		reordered = true
	}
	byDevID := func(a, b Conflict) int {
		if c := strings.Compare(a.Device.UUID, b.Device.UUID); c != 0 {
			return c
		}
		return strings.Compare(a.Owner.ContainerID, b.Owner.ContainerID)
	}
	if !slices.IsSortedFunc(s.Conflicts, byDevID) {
		slices.SortFunc(s.Conflicts, byDevID)
		reordered = true
	}
	return reordered
}

func cmpUint(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
