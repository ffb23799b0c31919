package devices

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"
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
	Version   int        `json:"version"`
	Inventory *Inventory `json:"inventory"`
}

// SaveCache writes inv to path atomically: a temporary file in the same
// directory, mode 0600, fsynced, renamed over path, and the directory fsynced,
// so a reader sees the old or the new inventory, never a torn one.
func SaveCache(path string, inv *Inventory) (err error) {
	if inv == nil || inv.idx == nil {
		return errors.New("save inventory cache: the inventory was not built by NewInventory")
	}
	data, err := json.MarshalIndent(cacheDoc{Version: cacheVersion, Inventory: inv}, "", "  ")
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

// LoadCache reads an inventory written by SaveCache, validating it and
// rebuilding its indexes. A missing file wraps fs.ErrNotExist; a file that
// cannot be used wraps ErrBadCache. It does not follow a symlink at path:
// the cache lives in the root-owned state directory and is never a link.
func LoadCache(path string) (*Inventory, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW, 0) //nolint:gosec // the state directory the operator configured
	if err != nil {
		if errors.Is(err, syscall.ELOOP) {
			return nil, fmt.Errorf("load inventory cache %s: %w: it is a symbolic link", path, ErrBadCache)
		}
		return nil, fmt.Errorf("load inventory cache: %w", err)
	}
	defer func() { _ = f.Close() }()
	data, err := io.ReadAll(io.LimitReader(f, maxCacheBytes+1))
	if err != nil {
		return nil, fmt.Errorf("load inventory cache %s: %w", path, err)
	}
	if len(data) > maxCacheBytes {
		return nil, fmt.Errorf("load inventory cache %s: %w: larger than %d bytes", path, ErrBadCache, maxCacheBytes)
	}
	var doc cacheDoc
	if err := json.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("load inventory cache %s: %w: %w", path, ErrBadCache, err)
	}
	if doc.Version != cacheVersion {
		return nil, fmt.Errorf("load inventory cache %s: %w: format version %d, this build reads %d", path, ErrBadCache, doc.Version, cacheVersion)
	}
	if doc.Inventory == nil {
		return nil, fmt.Errorf("load inventory cache %s: %w: no inventory in it", path, ErrBadCache)
	}
	return doc.Inventory, nil
}
