// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Lock polling: flock has no timeout and a blocked flock cannot be cancelled,
// so the lock is polled with a non-blocking attempt and an exponential,
// jittered back-off (short first, because a commit holds the lock for about
// one fsync).
const (
	lockPollMin = 100 * time.Microsecond
	lockPollMax = 5 * time.Millisecond
)

// The gate keeps a polled lock fair. A writer that commits back to back
// (the daemon in a burst of container starts) takes the lock again
// microseconds after it let go, while a writer of another process polls it
// every few milliseconds: without a gate the poller almost never finds it
// free and reaches lock_timeout behind a holder that is busy, not stuck. So
// a writer that finds the lock held closes the gate (an exclusive flock on
// ledger.gate, taken without blocking, held until it has the lock or gives
// up), and every writer passes the gate (a shared flock, taken and dropped)
// before it tries the lock: whoever closed the gate gets the lock after the
// current holder and those already past the gate, never behind a writer
// that came after it. A writer that meets a closed gate polls it: the gate
// opens as soon as its holder has the lock, so it waits about one poll
// more than it would have, and then closes the gate itself if the lock is
// still held. (It is fair between one busy writer and the others, the case
// of the daemon in a burst; two writers committing back to back can still
// keep a third at the gate, as they kept it from the lock before.)
//
// The hook's turnstile does not do this: it lines hooks up among
// themselves, and the NRI daemon never enters it. Nor would a blocking
// flock: Linux does not hand a released flock to a waiter but wakes it to
// try again, and the writer that let go may take it first.
//
// The gate is an optimisation, never a condition: the ledger lock alone
// makes a write safe. A gate that cannot be opened is passed. A writer
// at a closed gate goes on to the lock when the gate's holder is stopped
// (SIGSTOP, ^Z of a waiting gpu-guard-ctl: it would hold the gate until
// continued), when the lock has been free for gateGrace without the gate's
// holder taking it (it polls at least every lockPollMax: one that leaves a
// free lock alone that long is frozen or starved of CPU), and when its own
// time runs out.
const gateName = "ledger.gate"

// gateGrace: see gateName.
var gateGrace = 50 * time.Millisecond // a variable for tests

// acquire takes the in-process and the host-wide lock within
// min(LockTimeout, ctx deadline). The returned func releases both. A context
// that is already done fails at once (nothing is changed for a caller that
// gave up), with the same *LockError.
func (l *Ledger) acquire(ctx context.Context) (func(), error) {
	start := time.Now()
	if ctx.Err() != nil {
		return nil, l.lockError(ctx, start, 0, nil)
	}
	lctx, cancel := context.WithTimeout(ctx, l.opts.LockTimeout)
	defer cancel()

	// Goroutines of one process share the flock object, and a flock held by
	// this process's file description would let a second goroutine in: the
	// semaphore serialises them first.
	select {
	case l.sem <- struct{}{}:
	default:
		select {
		case l.sem <- struct{}{}:
		case <-lctx.Done():
			return nil, l.lockError(ctx, start, os.Getpid(), nil)
		}
	}
	w := lockWait{l: l, gateFD: -1}
	defer w.leaveGate() // after the lock is taken, or given up
	w.passGate(lctx)
	if ctx.Err() != nil {
		// The caller gave up at the gate: nothing is taken for it.
		<-l.sem
		return nil, l.lockError(ctx, start, 0, &w)
	}
	delay := lockPollMin
	var timer *time.Timer
	for {
		ok, err := l.flock.TryLock()
		if err != nil {
			<-l.sem
			return nil, fmt.Errorf("lock %s: %w", l.LockPath(), err)
		}
		if ok && l.checkLockFile() != nil {
			// The file was replaced between our open and our flock: the
			// lock that counts is the one on the file now at the path.
			_ = l.flock.Unlock()
			ok = false
		}
		if ok {
			break
		}
		if lctx.Err() != nil {
			<-l.sem
			return nil, l.lockError(ctx, start, 0, &w)
		}
		// Closed before BeforeLockWait runs: once that is called, no
		// writer that comes later takes the lock ahead of this one.
		w.closeGate()
		w.begin()
		// Jitter keeps polling processes from moving in lockstep.
		d := delay/2 + time.Duration(time.Now().UnixNano()%int64(delay/2+1))
		if timer == nil {
			timer = time.NewTimer(d)
		} else {
			timer.Reset(d)
		}
		select {
		case <-timer.C:
		case <-lctx.Done():
			timer.Stop()
			// One last attempt when only our own time budget ran out (the
			// holder may have just let go); never for a caller that gave up.
			if ctx.Err() == nil {
				if ok, err := l.flock.TryLock(); err == nil && ok {
					if l.checkLockFile() == nil {
						return l.unlocker(), nil
					}
					_ = l.flock.Unlock()
				}
			}
			<-l.sem
			return nil, l.lockError(ctx, start, 0, &w)
		}
		delay = min(2*delay, lockPollMax)
	}
	return l.unlocker(), nil
}

// lockWait is one acquisition's part in the gate, and what it saw of the
// ledger's progress while it waited.
type lockWait struct {
	l *Ledger
	// began: the wait started (BeforeLockWait called, the boot marker
	// read into before/beforeOK).
	began    bool
	before   marker
	beforeOK bool
	// gateFD is open on the gate while this acquisition tries to close it
	// (-1: not opened, -2: cannot be), closed whether it holds it.
	gateFD int
	closed bool
}

// begin starts the wait, once: it reads the generation the ledger has
// committed so far (so that a timeout can tell a busy holder from a stuck
// one) and calls Options.BeforeLockWait.
func (w *lockWait) begin() {
	if w.began {
		return
	}
	w.began = true
	w.before, w.beforeOK = w.l.markerGeneration()
	if w.l.opts.BeforeLockWait != nil {
		w.l.opts.BeforeLockWait()
	}
}

// passGate waits, within ctx, until the gate is open (see gateName).
func (w *lockWait) passGate(ctx context.Context) {
	fd, err := syscall.Open(w.l.gatePath(), syscall.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		return // none yet (nobody ever waited here), or unusable: passed
	}
	defer func() { _ = syscall.Close(fd) }() // drops the shared flock too
	delay := lockPollMin
	var freeSince time.Time
	var timer *time.Timer
	for first := true; ; first = false {
		if err := syscall.Flock(fd, syscall.LOCK_SH|syscall.LOCK_NB); !errors.Is(err, syscall.EWOULDBLOCK) {
			return // open (or an error: passed)
		}
		if first {
			if processStopped(lockHolder(w.l.gatePath())) {
				return
			}
			w.begin()
		}
		if ctx.Err() != nil {
			return
		}
		switch free := lockFree(w.l.LockPath()); {
		case !free:
			freeSince = time.Time{}
		case freeSince.IsZero():
			freeSince = time.Now()
		case time.Since(freeSince) >= gateGrace:
			return
		}
		d := delay/2 + time.Duration(time.Now().UnixNano()%int64(delay/2+1))
		if timer == nil {
			timer = time.NewTimer(d)
			defer timer.Stop()
		} else {
			timer.Reset(d)
		}
		select {
		case <-timer.C:
		case <-ctx.Done():
			return
		}
		delay = min(2*delay, lockPollMax)
	}
}

// closeGate tries, without blocking, to close the gate for the writers that
// come after this one; it is tried again at every poll until it holds.
func (w *lockWait) closeGate() {
	if w.closed || w.gateFD == -2 {
		return
	}
	if w.gateFD == -1 {
		fd, err := syscall.Open(w.l.gatePath(), syscall.O_RDWR|syscall.O_CREAT|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0o600)
		if err != nil {
			w.gateFD = -2
			return
		}
		w.gateFD = fd
	}
	w.closed = syscall.Flock(w.gateFD, syscall.LOCK_EX|syscall.LOCK_NB) == nil
}

// leaveGate opens the gate again if this acquisition closed it.
func (w *lockWait) leaveGate() {
	if w.gateFD >= 0 {
		_ = syscall.Close(w.gateFD)
		w.gateFD = -1
	}
}

// gatePath is the gate's file (see gateName).
func (l *Ledger) gatePath() string { return filepath.Join(l.dir, gateName) }

// lockFree reports whether no process holds the lock on path: a shared
// flock on a descriptor of its own, taken and dropped at once. An error
// reads as held, which keeps a writer at the gate no longer than its time.
func lockFree(path string) bool {
	fd, err := syscall.Open(path, syscall.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer func() { _ = syscall.Close(fd) }()
	return syscall.Flock(fd, syscall.LOCK_SH|syscall.LOCK_NB) == nil
}

// processStopped reports whether pid is stopped (by a signal or a
// debugger), from /proc/PID/stat; false when it cannot tell.
func processStopped(pid int) bool {
	if pid <= 0 {
		return false
	}
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	// "pid (comm) S ...": comm may hold spaces and parentheses, the state
	// follows the last ')'.
	i := bytes.LastIndexByte(data, ')')
	if i < 0 || i+2 >= len(data) {
		return false
	}
	return data[i+2] == 'T' || data[i+2] == 't'
}

// markerGeneration reads the boot marker once, without the lock and without
// readMarker's retries (a torn read counts as unknown): what this boot last
// committed, for telling a busy holder from a stuck one.
func (l *Ledger) markerGeneration() (marker, bool) {
	data, exists, err := readFileNoFollow(l.markerPath(), markerSize, nil)
	if err != nil || !exists {
		return marker{}, false
	}
	m, err := decodeMarker(data)
	if err != nil || m.Dir != l.dir || m.BootID != l.opts.BootID {
		return marker{}, false
	}
	return m, true
}

// checkLockFile reports whether the file this process holds the flock on is
// still the one at LockPath. A flock belongs to an inode, not a name: if
// someone removes or replaces ledger.lock (taking it for a stale lock file),
// the next process creates or opens another inode and locks it while the
// holder still writes. The holder checks before every write (and refuses
// it), the taker after every flock (and takes the new file's), which leaves
// only the moments between a holder's check and its write.
func (l *Ledger) checkLockFile() error {
	if !l.flock.Locked() {
		return fmt.Errorf("%w: %s is not locked by this process", ErrLockLost, l.LockPath())
	}
	held, err := l.flock.Stat() // fstat of the locked descriptor
	if err != nil {
		return fmt.Errorf("%w: stat the held lock %s: %w", ErrLockLost, l.LockPath(), err)
	}
	at, err := os.Lstat(l.LockPath()) //nolint:gosec // a fixed name in the operator's state dir
	if err == nil && os.SameFile(held, at) {
		return nil
	}
	what := "replaced"
	if err != nil {
		what = "removed (" + err.Error() + ")"
	}
	return fmt.Errorf("%w: %s was %s while this process held it, so another process may be writing the ledger "+
		"at the same time; nothing was written and the request is refused (retry it). ledger.lock is a flock, "+
		"released when its holder exits: never remove it to break a lock (find the holder in /proc/locks)",
		ErrLockLost, l.LockPath(), what)
}

func (l *Ledger) unlocker() func() {
	return func() {
		_ = l.flock.Unlock()
		<-l.sem
	}
}

// lockError reports a lock not taken in time; w (nil if the wait never
// began) gives the commits made meanwhile.
func (l *Ledger) lockError(ctx context.Context, start time.Time, holder int, w *lockWait) error {
	if holder == 0 {
		holder = lockHolder(l.LockPath())
	}
	e := &LockError{
		Path:      l.LockPath(),
		HolderPid: holder,
		Waited:    time.Since(start),
		Cause:     context.Cause(ctx),
	}
	if w != nil && w.beforeOK {
		// The same lineage at a generation not below: the commits in
		// between. Another lineage (a reset) or an older generation (a
		// recovery that lost commits) cannot be counted.
		if after, ok := l.markerGeneration(); ok && after.Lineage == w.before.Lineage && after.Generation >= w.before.Generation {
			e.Commits, e.CommitsKnown = after.Generation-w.before.Generation, true
		}
	}
	return e
}

// lockHolder finds the pid holding a flock on path in /proc/locks (0 if it
// cannot tell). The kernel lists each lock as
//
//	1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF
//
// with the device as hex major:minor and the inode in decimal.
func lockHolder(path string) int {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return 0
	}
	f, err := os.Open("/proc/locks")
	if err != nil {
		return 0
	}
	defer func() { _ = f.Close() }()
	major, minor := devNumbers(uint64(st.Dev))
	wantDev := fmt.Sprintf("%02x:%02x:%d", major, minor, st.Ino)
	wantIno := ":" + strconv.FormatUint(st.Ino, 10)
	inoOnly := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		// Blocked waiters are listed as "N: -> FLOCK ..."; skip them.
		if len(fields) < 6 || fields[1] != "FLOCK" {
			continue
		}
		pid, err := strconv.Atoi(fields[4])
		if err != nil {
			continue
		}
		if fields[5] == wantDev {
			return pid
		}
		// Some filesystems (overlay) report another device number; an inode
		// match alone is still a good hint.
		if strings.HasSuffix(fields[5], wantIno) && inoOnly == 0 {
			inoOnly = pid
		}
	}
	return inoOnly
}

// devNumbers splits a Linux dev_t (the kernel's "huge" encoding, as glibc's
// major()/minor() do).
func devNumbers(dev uint64) (major, minor uint64) {
	major = (dev>>8)&0xfff | (dev>>32)&0xfffff000
	minor = dev&0xff | (dev>>12)&0xffffff00
	return major, minor
}
