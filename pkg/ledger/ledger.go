package ledger

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gofrs/flock"
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
	// it up to cacheMu are only touched while holding it.
	sem     chan struct{}
	cleaned bool    // stray temp files removed once
	readBuf []byte  // reused for reading the state file under the lock
	enc     encoder // renders states under the lock

	// The last state this process read or wrote, with the exact file bytes.
	// An unchanged file (byte-equal) is not decoded again. cacheState is
	// never mutated: Tx clones what it changes, Snapshot hands out copies.
	cacheMu    sync.Mutex
	cacheRaw   []byte
	cacheState State
}

// Open opens (creating it 0700 if missing) the ledger in dir for reading and
// writing. It refuses, with ErrUnsafeDir, a dir or ledger file that is a
// symlink, writable by group or others, or owned by another user.
func Open(dir string, opts Options) (*Ledger, error) {
	return open(dir, opts, false)
}

// OpenReadOnly opens the ledger in dir for gpu-guard-ctl reads. It never
// creates, locks, moves or writes anything; a missing dir or state file reads
// as an empty State. The same safety checks as Open apply to what exists,
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
	missing, err := checkDir(dir, !readOnly, readOnly)
	if err != nil {
		return nil, err
	}
	if !missing {
		if err := checkFiles(dir, readOnly); err != nil {
			return nil, err
		}
	}
	l := &Ledger{
		dir:      dir,
		opts:     opts,
		readOnly: readOnly,
		log:      opts.Logger,
		sem:      make(chan struct{}, 1),
	}
	if !readOnly {
		// O_NOFOLLOW: a symlink planted after the check is refused, not followed.
		l.flock = flock.New(l.LockPath(),
			flock.SetFlag(os.O_CREATE|os.O_RDWR|syscall.O_NOFOLLOW),
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
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.BootID == "" {
		b, err := os.ReadFile(bootIDPath)
		if err != nil {
			return o, fmt.Errorf("read boot id (claims from an earlier boot must be discarded, so the ledger needs it): %w", err)
		}
		o.BootID = strings.TrimSpace(string(b))
		if o.BootID == "" {
			return o, fmt.Errorf("read boot id: %s is empty", bootIDPath)
		}
	}
	return o, nil
}

// Dir is the state dir.
func (l *Ledger) Dir() string { return l.dir }

// StatePath is the state file, ledger.json.
func (l *Ledger) StatePath() string { return filepath.Join(l.dir, stateName) }

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

// Snapshot returns the committed state. It reads without the lock (the state
// file is replaced by rename, so a reader sees the old or the new file
// whole) and takes the lock only to move a corrupt file aside (never for a
// read-only ledger). A state from an earlier boot reads as empty. The result
// is the caller's to keep and modify.
func (l *Ledger) Snapshot(ctx context.Context) (State, error) {
	st, err := l.read(ctx)
	if err != nil {
		return State{}, err
	}
	return st.Clone(), nil
}

// View runs fn on a transaction over the committed state with the queue
// mechanics applied as of now (expired waiters and reservations gone, free
// devices reserved), and discards every change: Busy, Position and the
// decision an Update would make, without writing (gpu-guard-ctl explain).
func (l *Ledger) View(ctx context.Context, fn func(tx *Tx) error) error {
	st, err := l.read(ctx)
	if err != nil {
		return err
	}
	tx := newTx(l, st, l.now())
	defer tx.close()
	tx.maintain()
	return fn(tx)
}

// read is Snapshot without the copy: the result may share storage with the
// cache and must not be modified.
func (l *Ledger) read(ctx context.Context) (State, error) {
	for attempt := 0; ; attempt++ {
		raw, exists, err := readFileNoFollow(l.StatePath(), maxStateBytes, nil)
		if err != nil {
			if l.readOnly && errors.Is(err, os.ErrPermission) {
				return State{}, fmt.Errorf("read ledger (run as root): %w", err)
			}
			return State{}, fmt.Errorf("read ledger: %w", err)
		}
		if !exists {
			return l.emptyState(0, 0), nil
		}
		st, ok := l.cached(raw)
		if !ok {
			st, err = DecodeState(raw)
			if err != nil {
				if !errors.Is(err, ErrCorrupt) || l.readOnly || attempt > 0 {
					return State{}, l.decorate(err)
				}
				if err := l.quarantineLocked(ctx); err != nil {
					return State{}, err
				}
				continue // replaced by a good state meanwhile: read that
			}
			l.setCache(bytes.Clone(raw), st)
		}
		if st.BootID != l.opts.BootID {
			return l.emptyState(st.Generation, st.NextSeq), nil
		}
		return st, nil
	}
}

// quarantineLocked re-reads the state file under the lock (a writer may have
// replaced it meanwhile) and moves it aside if it is still bad, returning the
// *CorruptError. It returns nil if the file is good or gone by now.
func (l *Ledger) quarantineLocked(ctx context.Context) error {
	unlock, err := l.acquire(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	raw, exists, err := readFileNoFollow(l.StatePath(), maxStateBytes, nil)
	if err != nil {
		return fmt.Errorf("read ledger: %w", err)
	}
	if !exists {
		return nil
	}
	if _, err := DecodeState(raw); err != nil {
		if !errors.Is(err, ErrCorrupt) {
			return l.decorate(err)
		}
		return l.moveAside(err)
	}
	return nil
}

// decorate fills in the path of a decode error.
func (l *Ledger) decorate(err error) error {
	var fe *FormatError
	if errors.As(err, &fe) {
		fe.Path = l.StatePath()
		return fe
	}
	if errors.Is(err, ErrCorrupt) {
		return &CorruptError{Path: l.StatePath(), Reason: err.Error()}
	}
	return err
}

// moveAside quarantines the state file (lock held) and audits it.
func (l *Ledger) moveAside(cause error) error {
	now := l.now()
	dst, err := quarantine(l.dir, l.StatePath(), now)
	if err != nil {
		return fmt.Errorf("ledger state %s is corrupt (%w) and could not be moved aside: %w", l.StatePath(), cause, err)
	}
	l.setCache(nil, State{})
	ce := &CorruptError{Path: l.StatePath(), Quarantined: dst, Reason: cause.Error()}
	l.log.Error("ledger state was corrupt; moved aside, starting empty", "path", ce.Path, "quarantined", dst, "reason", ce.Reason)
	rec := AuditRecord{Time: now, Op: OpCorrupt, Reason: fmt.Sprintf("%s; moved to %s", ce.Reason, dst), Pid: os.Getpid()}
	if err := appendAudit(l.dir, l.opts.AuditMaxBytes, []AuditRecord{rec}); err != nil {
		l.log.Error("ledger audit append failed", "error", err)
	}
	return ce
}

func (l *Ledger) emptyState(generation, nextSeq uint64) State {
	return State{Generation: generation, NextSeq: nextSeq, BootID: l.opts.BootID}
}

func (l *Ledger) cached(raw []byte) (State, bool) {
	l.cacheMu.Lock()
	defer l.cacheMu.Unlock()
	if l.cacheRaw != nil && bytes.Equal(raw, l.cacheRaw) {
		return l.cacheState, true
	}
	return State{}, false
}

func (l *Ledger) setCache(raw []byte, st State) {
	l.cacheMu.Lock()
	l.cacheRaw, l.cacheState = raw, st
	l.cacheMu.Unlock()
}

// Update runs fn as one atomic mutation of the ledger, under the host-wide
// lock taken within min(LockTimeout, ctx deadline) (else a *LockError).
//
// The queue mechanics run before fn and after it (see Tx). If fn returns an
// error nothing is written and that error is returned. If nothing changed,
// nothing is written (records from Tx.Audit alone are still appended to the
// audit log). Otherwise the new state (generation+1) is written atomically and
// its audit records appended.
//
// A state file that does not verify is moved aside and Update returns a
// *CorruptError without running fn; the next Update starts from an empty
// state (callers rebuild it from the runtime, then retry). A file of a newer
// format is left alone and yields a *FormatError. A state from an earlier
// boot is discarded (audited) and fn runs on an empty state, which (like the
// empty state of a missing file) gets a new lineage. Under a context from
// RequireLineage, a state of another lineage yields a *LineageError without
// running fn.
//
// An I/O error after the rename (syncing the dir) is returned although the
// new state may already be in place.
//
// fn must not call Update, View or Snapshot of the same Ledger (the lock is
// not reentrant) and must not keep tx.
func (l *Ledger) Update(ctx context.Context, fn func(tx *Tx) error) error {
	if l.readOnly {
		return fmt.Errorf("update %s: %w", l.StatePath(), ErrReadOnly)
	}
	unlock, err := l.acquire(ctx)
	if err != nil {
		return err
	}
	defer unlock()

	if !l.cleaned {
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

	now := l.now()
	st, pre, origin, err := l.loadLocked(now)
	if err != nil {
		return err
	}
	if want := requiredLineage(ctx); want != "" && st.Lineage != want {
		return l.lineageError(want, st.Lineage, origin)
	}
	tx := newTx(l, st, now)
	defer tx.close()
	tx.freshLineage = origin != ""
	if len(pre) > 0 {
		tx.audit = append(tx.audit, pre...)
		tx.touch()
	}
	tx.maintain()
	if err := fn(tx); err != nil {
		return err
	}
	tx.maintain()
	return l.commit(tx)
}

// loadLocked reads the state under the lock. pre holds audit records of what
// loading itself changed (a state from an earlier boot discarded). A state
// that starts empty (no file, an earlier boot's state discarded) gets a new
// lineage, and so does a file without one; origin then says why (see the
// origin constants), and is "" for a state loaded with its lineage. The new
// lineage is stored by the first commit.
func (l *Ledger) loadLocked(now time.Time) (st State, pre []AuditRecord, origin string, err error) {
	raw, exists, err := readFileNoFollow(l.StatePath(), maxStateBytes, l.readBuf)
	if err != nil {
		return State{}, nil, "", fmt.Errorf("read ledger: %w", err)
	}
	if !exists {
		st = l.emptyState(0, 0)
		st.Lineage = newLineage()
		return st, nil, originNoFile, nil
	}
	l.readBuf = raw[:0]
	st, ok := l.cached(raw)
	if !ok {
		st, err = DecodeState(raw)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				return State{}, nil, "", l.decorate(err)
			}
			return State{}, nil, "", l.moveAside(err)
		}
		l.setCache(bytes.Clone(raw), st)
	}
	if st.BootID == l.opts.BootID {
		if st.Lineage == "" {
			// st is a copy: the cached state keeps the file's "".
			st.Lineage = newLineage()
			return st, nil, originLegacy, nil
		}
		return st, nil, "", nil
	}
	reason := fmt.Sprintf("state of boot %s (generation %d, %d claims, %d waiters) is from before the current boot %s",
		truncate(st.BootID, 64), st.Generation, len(st.Claims), len(st.Waiters), l.opts.BootID)
	l.log.Warn("ledger: discarding state from an earlier boot", "reason", reason)
	rec := AuditRecord{Time: now, Op: OpDiscard, Reason: reason}
	for _, c := range st.Claims {
		rec.Devices = append(rec.Devices, c.Device.UUID)
	}
	// Generation and sequence numbers keep counting up across boots.
	empty := l.emptyState(st.Generation, st.NextSeq)
	empty.Lineage = newLineage()
	return empty, []AuditRecord{rec}, originOtherBoot, nil
}

// lineageError describes a loaded state of another lineage than want.
func (l *Ledger) lineageError(want, found, origin string) error {
	e := &LineageError{Path: l.StatePath(), Expected: want, Found: found, Why: origin}
	if origin != "" {
		e.Found = "" // made up by this load, never stored
	} else {
		e.Why = fmt.Sprintf("the state file has lineage %s: another process started the ledger afresh "+
			"(it found the file corrupt or missing) and has written it since", truncate(found, 64))
	}
	return e
}

// commit writes the transaction's state, if it changed, and its audit records.
func (l *Ledger) commit(tx *Tx) error {
	pid := os.Getpid()
	if !tx.dirty {
		if len(tx.audit) == 0 {
			return nil
		}
		for i := range tx.audit {
			tx.audit[i].Generation, tx.audit[i].Pid = tx.st.Generation, pid
		}
		if err := appendAudit(l.dir, l.opts.AuditMaxBytes, tx.audit); err != nil {
			return err
		}
		return nil
	}
	st := tx.st
	st.Generation++
	st.BootID = l.opts.BootID
	if st.Lineage == "" {
		st.Lineage = newLineage() // loadLocked sets one; never store a state without
	}
	st.UpdatedAt = tx.now
	st.sort()
	// Waiters the Tx did not touch come from a verified state.
	if err := validate(&st, tx.waitersOwned); err != nil {
		return fmt.Errorf("ledger: refusing to write a state that breaks an invariant (a bug; nothing was written): %w", err)
	}
	l.cacheMu.Lock()
	keep := l.cacheRaw
	l.cacheMu.Unlock()
	data, err := l.enc.encode(&st, keep)
	if err != nil {
		return fmt.Errorf("encode ledger state: %w", err)
	}
	if err := writeAtomic(l.dir, l.StatePath(), data); err != nil {
		l.setCache(nil, State{})
		return err
	}
	l.setCache(data, st)
	for i := range tx.audit {
		tx.audit[i].Generation, tx.audit[i].Pid = st.Generation, pid
	}
	if err := appendAudit(l.dir, l.opts.AuditMaxBytes, tx.audit); err != nil {
		// The state is committed: failing the call would make the caller
		// believe it was not.
		l.log.Error("ledger: state committed but its audit records were not written", "generation", st.Generation, "error", err)
	}
	reachStage(stageAfterAudit)
	return nil
}

// sort restores the documented order of every slice. It writes only to a
// slice that is out of order: one a Tx changed and therefore owns, never one
// shared with the cache.
func (s *State) sort() {
	byUUIDClaim := func(a, b Claim) int { return strings.Compare(a.Device.UUID, b.Device.UUID) }
	if !slices.IsSortedFunc(s.Claims, byUUIDClaim) {
		slices.SortFunc(s.Claims, byUUIDClaim)
	}
	byUUIDRes := func(a, b Reservation) int { return strings.Compare(a.Device.UUID, b.Device.UUID) }
	if !slices.IsSortedFunc(s.Reservations, byUUIDRes) {
		slices.SortFunc(s.Reservations, byUUIDRes)
	}
	bySeq := func(a, b Waiter) int { return cmpUint(a.Seq, b.Seq) }
	if !slices.IsSortedFunc(s.Waiters, bySeq) {
		slices.SortFunc(s.Waiters, bySeq)
	}
	byDevID := func(a, b Conflict) int {
		if c := strings.Compare(a.Device.UUID, b.Device.UUID); c != 0 {
			return c
		}
		return strings.Compare(a.Owner.ContainerID, b.Owner.ContainerID)
	}
	if !slices.IsSortedFunc(s.Conflicts, byDevID) {
		slices.SortFunc(s.Conflicts, byDevID)
	}
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
