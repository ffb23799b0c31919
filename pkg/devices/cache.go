// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// CacheFile is the inventory cache's name in the state directory
// (ledger.dir): the daemon writes it after loading the inventory, and the
// OCI hook reads it instead of initialising NVML for every container.
const CacheFile = "inventory.json"

// cacheVersion is the cache file's format; a file of another version is
// refused, so the caller reloads the inventory from its source.
const cacheVersion = 1

// maxCacheBytes bounds what LoadCache reads: a 16-GPU host with MIG is a few
// KiB.
const maxCacheBytes = 16 << 20

// ErrBadCache is wrapped by LoadCache when the file exists but cannot be
// used (wrong version, corrupt, invalid): reload from the source.
var ErrBadCache = errors.New("unusable inventory cache")

type cacheDoc struct {
	Version int `json:"version"`
	// BootID is the boot the cache was written in (the host's
	// /proc/sys/kernel/random/boot_id): within it the GPUs cannot have
	// changed, so readers trust the cache as it is; a cache of another boot
	// is checked against the driver first (see LoadInventory). A cache
	// written before the field existed has none: its boot is unknown, and it
	// is checked too. Adding the field kept the format version, so that an
	// upgrade does not make every reader discard the cache.
	BootID    string     `json:"boot_id,omitempty"`
	Inventory *Inventory `json:"inventory"`
}

// SaveCache writes inv to path atomically: a temporary file in the same
// directory, mode 0600, fsynced, renamed over path, and the directory fsynced,
// so a reader sees the old or the new inventory, never a torn one. bootID is
// the boot it is written in ("" when unknown: readers then check the cache
// against the driver before they use it).
func SaveCache(path string, inv *Inventory, bootID string) (err error) {
	if inv == nil || inv.idx == nil {
		return errors.New("save inventory cache: the inventory was not built by NewInventory")
	}
	if inv.Undiscovered {
		// It says nothing about the host's GPUs: written, it would read as
		// a host without GPUs to the hooks, which fail closed without it.
		return errors.New("save inventory cache: the inventory is undiscovered (no discovery source works)")
	}
	data, err := json.MarshalIndent(cacheDoc{Version: cacheVersion, BootID: bootID, Inventory: inv}, "", "  ")
	if err != nil {
		return fmt.Errorf("save inventory cache: %w", err)
	}
	data = append(data, '\n')
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("save inventory cache: %w", err)
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	// CreateTemp already uses 0600; Chmod states it regardless of umask.
	if err = tmp.Chmod(0o600); err != nil {
		return fmt.Errorf("save inventory cache: %w", err)
	}
	if _, err = tmp.Write(data); err != nil {
		return fmt.Errorf("save inventory cache: %w", err)
	}
	if err = tmp.Sync(); err != nil {
		return fmt.Errorf("save inventory cache: %w", err)
	}
	if err = tmp.Close(); err != nil {
		return fmt.Errorf("save inventory cache: %w", err)
	}
	if err = os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("save inventory cache: %w", err)
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir) //nolint:gosec // the state directory the operator configured
	if err != nil {
		return fmt.Errorf("save inventory cache: open directory: %w", err)
	}
	defer func() { _ = d.Close() }()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("save inventory cache: sync directory %s: %w", dir, err)
	}
	return nil
}

// ErrUntrustedCache is wrapped by LoadCache when the file is not one only
// root (or the user running this program) could have written: a symbolic
// link, not a regular file, writable by group or others, or owned by another
// user. The cache decides which GPU a container's index means, so a forged
// one would let a container through to a busy GPU; it is never read.
var ErrUntrustedCache = errors.New("untrusted inventory cache")

// LoadCache reads an inventory written by SaveCache, validating it and
// rebuilding its indexes. A missing file wraps fs.ErrNotExist; a file that
// may have been written by someone else wraps ErrUntrustedCache (see
// checkCacheTrust); a file that cannot be used wraps ErrBadCache.
func LoadCache(path string) (*Inventory, error) {
	c, err := loadCache(path)
	return c.inv, err
}

// cached is a cache file as loadCache read it.
type cached struct {
	inv *Inventory
	// at is the file's modification time.
	at time.Time
	// bootID is the boot it was written in; "" when unknown.
	bootID string
}

// loadCache is LoadCache that also returns the file's modification time and
// the boot it was written in. The trust check runs on the opened descriptor,
// so the file checked is the file read: no rename between a stat and the
// open can swap it.
func loadCache(path string) (cached, error) {
	// O_NOFOLLOW: never a link. O_NONBLOCK: a FIFO planted at path must not
	// block the reader (the OCI hook) before it is refused as not regular.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0) //nolint:gosec // the state directory the operator configured
	if err != nil {
		if errors.Is(err, syscall.ELOOP) {
			return cached{}, fmt.Errorf("load inventory cache %s: %w: it is a symbolic link", path, ErrUntrustedCache)
		}
		return cached{}, fmt.Errorf("load inventory cache: %w", err)
	}
	defer func() { _ = f.Close() }()
	fi, err := f.Stat()
	if err != nil {
		return cached{}, fmt.Errorf("load inventory cache %s: %w", path, err)
	}
	if err := checkCacheTrust(path, fi, os.Geteuid()); err != nil {
		return cached{}, err
	}
	data, err := io.ReadAll(io.LimitReader(f, maxCacheBytes+1))
	if err != nil {
		return cached{}, fmt.Errorf("load inventory cache %s: %w", path, err)
	}
	if len(data) > maxCacheBytes {
		return cached{}, fmt.Errorf("load inventory cache %s: %w: larger than %d bytes", path, ErrBadCache, maxCacheBytes)
	}
	var doc cacheDoc
	if err := json.Unmarshal(data, &doc); err != nil {
		return cached{}, fmt.Errorf("load inventory cache %s: %w: %w", path, ErrBadCache, err)
	}
	if doc.Version != cacheVersion {
		return cached{}, fmt.Errorf("load inventory cache %s: %w: format version %d, this build reads %d", path, ErrBadCache, doc.Version, cacheVersion)
	}
	if doc.Inventory == nil {
		return cached{}, fmt.Errorf("load inventory cache %s: %w: no inventory in it", path, ErrBadCache)
	}
	return cached{inv: doc.Inventory, at: fi.ModTime(), bootID: doc.BootID}, nil
}

// checkCacheTrust accepts a regular file that is not writable by group or
// others and is owned by root or by euid (the user running this program:
// root for the daemon and the hook; an unprivileged gpu-guard-ctl trusts
// only what root or the user itself wrote, which is no more than the user
// could forge anyway).
func checkCacheTrust(path string, fi fs.FileInfo, euid int) error {
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("load inventory cache %s: %w: not a regular file (%s); remove it and run `gpu-guard-ctl devices --refresh`",
			path, ErrUntrustedCache, fi.Mode().Type())
	}
	if perm := fi.Mode().Perm(); perm&0o022 != 0 {
		return fmt.Errorf("load inventory cache %s: %w: mode %04o is writable by group or others; run `gpu-guard-ctl devices --refresh` to rewrite it (mode 0600)",
			path, ErrUntrustedCache, perm)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Uid != 0 && int(st.Uid) != euid {
		return fmt.Errorf("load inventory cache %s: %w: owned by uid %d, not root; run `gpu-guard-ctl devices --refresh` as root to rewrite it",
			path, ErrUntrustedCache, st.Uid)
	}
	return nil
}
