// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bufio"
	"context"
	"fmt"
	"os"
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

// acquire takes the in-process and the host-wide lock within
// min(LockTimeout, ctx deadline). The returned func releases both. A context
// that is already done fails at once (nothing is changed for a caller that
// gave up), with the same *LockError.
func (l *Ledger) acquire(ctx context.Context) (func(), error) {
	start := time.Now()
	if ctx.Err() != nil {
		return nil, l.lockError(ctx, start, 0)
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
			return nil, l.lockError(ctx, start, os.Getpid())
		}
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
			return nil, l.lockError(ctx, start, 0)
		}
		// Jitter keeps polling processes from moving in lockstep.
		d := delay/2 + time.Duration(time.Now().UnixNano()%int64(delay/2+1))
		if timer == nil {
			if l.opts.BeforeLockWait != nil {
				l.opts.BeforeLockWait()
			}
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
			return nil, l.lockError(ctx, start, 0)
		}
		delay = min(2*delay, lockPollMax)
	}
	return l.unlocker(), nil
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

func (l *Ledger) lockError(ctx context.Context, start time.Time, holder int) error {
	if holder == 0 {
		holder = lockHolder(l.LockPath())
	}
	return &LockError{
		Path:      l.LockPath(),
		HolderPid: holder,
		Waited:    time.Since(start),
		Cause:     context.Cause(ctx),
	}
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
