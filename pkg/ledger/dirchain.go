// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// CheckDirChain checks the state dir and every directory above it up to /.
// Open and OpenReadOnly run it on every open, so no front end can forget it.
//
// The attack it stops: whoever may rename an entry of a directory on the
// path can move the state dir away (`mv state stolen`) and let the next
// writer start an empty ledger, or plant a dir of their own in its place.
// Renaming or deleting an entry needs write permission on the directory
// holding it, and, where that directory has the sticky bit, also ownership
// of the entry or of the directory. Hence, for each existing component:
//
//   - no symlink anywhere on the path (it could point anywhere later);
//   - owned by root or by the user running the guard;
//   - the state dir itself not writable by group or others;
//   - a parent writable by group or others only with the sticky bit (like
//     /tmp, mode 1777): then only root, the euid or the parent's owner (root
//     or the euid, checked above) can rename the component below it, which
//     is itself owned by root or the euid. Without the sticky bit anyone
//     with write access can rename it: refused.
//
// dir must be absolute and clean. Missing components at the end of the path
// are allowed (Open creates them 0700 and checks the chain again); the
// existing part must pass. The error wraps ErrUnsafeDir and names the
// directory and the fix.
func CheckDirChain(dir string) error {
	_, err := checkDirChain(dir)
	return err
}

// checkDirChain is CheckDirChain; complete reports that every component
// existed (none was missing at the end of the path). Where one was, Open
// checks the chain again once the dir exists: a component that appeared
// meanwhile, made by whoever, must pass too.
func checkDirChain(dir string) (complete bool, err error) {
	if !filepath.IsAbs(dir) {
		return false, fmt.Errorf("%w: ledger dir %q is not an absolute path", ErrUnsafeDir, dir)
	}
	if dir != filepath.Clean(dir) {
		return false, fmt.Errorf("%w: ledger dir %q is not a clean path (use %q)", ErrUnsafeDir, dir, filepath.Clean(dir))
	}
	euid := uint32(os.Geteuid()) //nolint:gosec // a uid fits
	complete = true
	// tail: every component below p is missing so far.
	for p, leaf, tail := dir, true, true; ; leaf = false {
		fi, err := os.Lstat(p) //nolint:gosec // the state dir is the operator's choice
		switch {
		case tail && errors.Is(err, fs.ErrNotExist):
			// Created 0700 by the first writer.
			complete = false
		case err != nil:
			return false, fmt.Errorf("%w: ledger dir %s: %w", ErrUnsafeDir, p, err)
		case fi.Mode()&fs.ModeSymlink != 0:
			return false, fmt.Errorf("%w: %s (on the path of the ledger dir %s) is a symlink; configure the real path", ErrUnsafeDir, p, dir)
		case !fi.IsDir():
			return false, fmt.Errorf("%w: %s (on the path of the ledger dir %s) is not a directory", ErrUnsafeDir, p, dir)
		default:
			tail = false
			if err := checkChainDir(p, dir, fi, leaf, euid); err != nil {
				return false, err
			}
		}
		parent := filepath.Dir(p)
		if parent == p {
			return complete, nil
		}
		p = parent
	}
}

// checkChainDir applies CheckDirChain's owner and mode rules to one existing
// directory p on the path of the ledger dir.
func checkChainDir(p, dir string, fi fs.FileInfo, leaf bool, euid uint32) error {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Uid != 0 && st.Uid != euid {
		return fmt.Errorf("%w: %s (on the path of the ledger dir %s) is owned by uid %d, not root; "+
			"whoever owns it can move the ledger away: chown root it, or put the ledger elsewhere", ErrUnsafeDir, p, dir, st.Uid)
	}
	perm := fi.Mode().Perm()
	if perm&0o022 == 0 {
		return nil
	}
	if leaf {
		return fmt.Errorf("%w: the ledger dir %s has mode %04o, writable by group or others; chmod 0700 it", ErrUnsafeDir, p, perm)
	}
	if fi.Mode()&fs.ModeSticky != 0 {
		// Like /tmp: nobody else can rename or delete the root- or
		// euid-owned component below it.
		return nil
	}
	return fmt.Errorf("%w: %s (on the path of the ledger dir %s) has mode %04o, writable by group or others without "+
		"the sticky bit, so anyone who can write there can move the ledger away (mv state stolen); "+
		"chmod go-w it (or chmod +t it) or put the ledger elsewhere", ErrUnsafeDir, p, dir, perm)
}
