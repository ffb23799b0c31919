package ledger

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// CheckDirChain checks the state dir and every directory above it up to /:
// each must exist as a real directory (no symlink anywhere on the path),
// be owned by root (or by the user running the guard) and not be writable
// by group or others. A directory anyone can write to lets anyone rename the
// state dir away (`mv state stolen`) and put an empty one in its place.
// dir must be absolute. A missing state dir itself is allowed (it is
// created 0700); its parents must exist. The error wraps ErrUnsafeDir and
// names the directory and the fix.
func CheckDirChain(dir string) error {
	if !filepath.IsAbs(dir) {
		return fmt.Errorf("%w: ledger dir %q is not an absolute path", ErrUnsafeDir, dir)
	}
	if dir != filepath.Clean(dir) {
		return fmt.Errorf("%w: ledger dir %q is not a clean path (use %q)", ErrUnsafeDir, dir, filepath.Clean(dir))
	}
	euid := uint32(os.Geteuid()) //nolint:gosec // a uid fits
	for p, first := dir, true; ; first = false {
		fi, err := os.Lstat(p)
		switch {
		case first && errors.Is(err, fs.ErrNotExist):
			// Created by the first writer.
		case err != nil:
			return fmt.Errorf("%w: ledger dir %s: %w", ErrUnsafeDir, p, err)
		case fi.Mode()&fs.ModeSymlink != 0:
			return fmt.Errorf("%w: %s (on the path of the ledger dir %s) is a symlink; configure the real path", ErrUnsafeDir, p, dir)
		case !fi.IsDir():
			return fmt.Errorf("%w: %s (on the path of the ledger dir %s) is not a directory", ErrUnsafeDir, p, dir)
		default:
			if perm := fi.Mode().Perm(); perm&0o022 != 0 {
				return fmt.Errorf("%w: %s (on the path of the ledger dir %s) has mode %04o, writable by group or others, "+
					"so anyone could move the ledger away; chmod go-w it or put the ledger elsewhere", ErrUnsafeDir, p, dir, perm)
			}
			if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Uid != 0 && st.Uid != euid {
				return fmt.Errorf("%w: %s (on the path of the ledger dir %s) is owned by uid %d, not root; "+
					"whoever owns it can move the ledger away: chown root it", ErrUnsafeDir, p, dir, st.Uid)
			}
		}
		parent := filepath.Dir(p)
		if parent == p {
			return nil
		}
		p = parent
	}
}
