// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// Role is the program that loads the inventory. It decides the order of
// LoadInventory: only the daemon and an operator's refresh enumerate
// through NVML and write the cache; the others read what they wrote.
type Role int

const (
	// RoleDaemon is the NRI daemon: it discovers, writes the cache, and
	// falls back to the cache when discovery fails.
	RoleDaemon Role = iota + 1
	// RoleHook is the OCI hook: it reads the cache, else discovers without
	// NVML (/proc/driver/nvidia; then the static list under "auto").
	RoleHook
	// RoleReader is a gpu-guard-ctl command that shows or explains: it
	// reads the cache, else discovers as the daemon would (NVML included).
	RoleReader
	// RoleRefresh is `gpu-guard-ctl devices --refresh`: it discovers and
	// rewrites the cache; it never falls back to the cache it replaces.
	RoleRefresh
)

func (r Role) String() string {
	switch r {
	case RoleDaemon:
		return "daemon"
	case RoleHook:
		return "hook"
	case RoleReader:
		return "reader"
	case RoleRefresh:
		return "refresh"
	}
	return fmt.Sprintf("Role(%d)", int(r))
}

// Origin says where a loaded inventory came from. Its values appear in
// gpu-guard-ctl's JSON output.
type Origin string

const (
	// OriginConfig is devices.source = "static", the configuration's list.
	OriginConfig Origin = "config"
	// OriginDiscovery is an inventory enumerated now, per devices.source.
	OriginDiscovery Origin = "discovery"
	// OriginCache is an inventory read from the cache file (CacheFile).
	OriginCache Origin = "cache"
	// OriginNone is the daemon's empty, undiscovered inventory
	// (Inventory.Undiscovered): discovery failed and there is no usable
	// cache to fall back to.
	OriginNone Origin = "none"
)

// LoadOptions says who loads the inventory and where the cache lives.
type LoadOptions struct {
	Role Role
	// StateDir is the directory of the cache file (ledger.dir, or
	// gpu-guard-ctl's --state-dir).
	StateDir string
	// NVML is the NVML loader (nvmlloader.New); nil counts NVML as
	// unavailable. RoleHook never uses it.
	NVML Loader
	// BootID is the host's current boot id (/proc/sys/kernel/random/boot_id,
	// as the ledger reads it). The cache records the boot it is written in;
	// a cache of this boot is used as it is, any other is checked against
	// the driver first. "" counts as unknown: every cache is checked, and
	// one written says it was written in an unknown boot.
	BootID string
}

// Loaded is an inventory and how LoadInventory got it.
type Loaded struct {
	Inventory *Inventory
	Origin    Origin
	// CachePath is the cache file, whether or not it was used.
	CachePath string
	// CachedAt is the cache file's modification time when it was read
	// (OriginCache) or written; zero otherwise.
	CachedAt time.Time
	// Skipped holds why earlier steps of the order did not give the
	// inventory: a cache that is missing (wraps fs.ErrNotExist), untrusted
	// (ErrUntrustedCache), unusable (ErrBadCache) or out of date
	// (ErrStaleCache), or the discovery a daemon fell back from. Callers
	// warn about them.
	Skipped []error
	// CacheWriteErr is set when the daemon could not write the cache. It is
	// not fatal to the daemon (the hooks then discover themselves).
	CacheWriteErr error
	// CacheKept is set when the daemon's discovery listed no GPU while the
	// PCI bus shows NVIDIA GPUs (Inventory.UnlistedGPUs > 0: the driver is
	// not up yet) and the cache, which lists GPUs, was left as it was
	// rather than overwritten with the empty result. The daemon still
	// decides with the empty inventory (see LoadInventory).
	CacheKept bool
}

// LoadInventory loads the GPU inventory in the one order every program
// follows:
//
//  1. devices.source = "static": the configuration's list is authoritative
//     for every role; no cache is read. It is checked against the GPUs the
//     driver lists under proc_root, where it lists any (see
//     staticLoader.verify): a list the driver contradicts fails the load,
//     wrapping ErrStaticMismatch, for every role (the daemon included: a
//     list that can never be right stops it, as an invalid list does), and
//     no cache is written. The daemon and a refresh still write it to the
//     cache, so the file always holds what the daemon decides with. A list
//     used without a check in full (no driver tree, or a GPU whose UUID the
//     driver does not know yet: Inventory.Unchecked) is written marked so,
//     and every reader checks that cache against the driver (see 3), in
//     its boot too; the daemon checks the list again in the background.
//  2. RoleDaemon and RoleRefresh discover per devices.source (NVML,
//     /proc/driver/nvidia, the static list; see Discover) and write the
//     cache, stamped with opts.BootID. When discovery fails, the daemon
//     falls back to a usable cache (see 3); a refresh fails. When discovery
//     fails and there is no usable cache either (the first boot of a node
//     whose NVIDIA driver is not loaded yet, or a cache the driver shows to
//     be out of date), the daemon gets an empty inventory marked
//     Undiscovered (OriginNone) and writes no cache: it refuses every GPU
//     request and retries the discovery itself, rather than refuse to start
//     and leave containerd refusing every pod, the driver's included. When
//     the daemon's discovery lists no GPU while the PCI bus shows NVIDIA
//     GPUs (the driver is not up yet), it decides with that empty inventory
//     but does not overwrite a cache that lists GPUs (Loaded.CacheKept); it
//     retries the discovery itself (pkg/daemon).
//  3. RoleHook and RoleReader read the cache the daemon (or a refresh)
//     wrote. A cache that is missing, untrusted (not a root-owned regular
//     file, or writable by group or others), unusable, or stale is skipped,
//     and the inventory is discovered instead: by RoleReader as the daemon
//     would, by RoleHook without NVML (source "auto": /proc/driver/nvidia
//     then the static list, checked against the driver as in 1; "nvml" and
//     "proc": /proc/driver/nvidia), so that no container start initialises
//     NVML. A cache written in this
//     boot (opts.BootID) is used as it is: GPUs do not change while the
//     host runs, and the hook reads nothing more; unless it holds a static
//     list marked unchecked (a static list reached under "auto" while a
//     GPU's UUID was not known, say), which is checked as one of another
//     boot is, indices included, and skipped while a UUID is not known
//     (the hook then matches the list itself). One written in another
//     boot, or in an unknown one, is stale (ErrStaleCache) when the GPUs
//     the driver lists under proc_root (/proc/driver/nvidia/gpus) are not
//     the ones it lists, by UUID, PCI bus id and device minor: a GPU added,
//     removed or replaced while the host was down would otherwise reach
//     containers unclaimed, or an index name another GPU than the one the
//     container gets. When the driver's tree cannot be read (no driver
//     loaded: no container reaches a GPU) the cache is used as it is. The
//     cache (from NVML) keeps the MIG instances that /proc cannot list.
//  4. Otherwise the load fails closed with an error naming every step tried
//     and what to do.
func LoadInventory(cfg config.DevicesConfig, opts LoadOptions) (Loaded, error) {
	out := Loaded{CachePath: filepath.Join(opts.StateDir, CacheFile)}
	writes := opts.Role == RoleDaemon || opts.Role == RoleRefresh
	switch opts.Role {
	case RoleDaemon, RoleRefresh, RoleHook, RoleReader:
	default:
		return out, fmt.Errorf("load GPU inventory: unknown role %d", int(opts.Role))
	}
	if opts.StateDir == "" {
		return out, errors.New("load GPU inventory: no state directory for the inventory cache (set [ledger] dir)")
	}

	if cfg.Source == config.SourceStatic {
		inv, err := Discover(cfg, nil)
		if err != nil {
			// Discover's error says "GPU inventory from static: ...".
			return out, fmt.Errorf("devices.source = \"static\": %w", err)
		}
		out.Inventory, out.Origin = inv, OriginConfig
		if writes {
			out.save(opts)
		}
		return out, out.fatalWrite(opts.Role)
	}

	if writes {
		inv, discErr := Discover(cfg, opts.NVML)
		if discErr == nil {
			out.Inventory, out.Origin = inv, OriginDiscovery
			if opts.Role == RoleDaemon && len(inv.GPUs) == 0 && inv.UnlistedGPUs > 0 && cacheListsGPUs(out.CachePath) {
				// The driver is not up yet (a GPU Operator's driver
				// container starts after the guard): keep the cache
				// of the GPUs the bus shows rather than destroy it.
				// The daemon does not decide with it: after a
				// hardware change its UUIDs and minors could be
				// another host's, so it refuses GPU requests until
				// its own discovery, retried in the background,
				// lists the GPUs and rewrites the cache.
				out.CacheKept = true
				return out, nil
			}
			out.save(opts)
			return out, out.fatalWrite(opts.Role)
		}
		if opts.Role == RoleRefresh {
			return out, fmt.Errorf("discover GPUs (devices.source = %q): %w", cfg.Source, discErr)
		}
		c, cacheErr := loadUsableCache(cfg, opts, out.CachePath)
		if cacheErr != nil && opts.Role == RoleDaemon && discovers(cfg.Source) {
			// No source works (the driver is not loaded yet: a GPU
			// Operator installs it from a pod, which containerd starts
			// only once the guard is registered) and no cache says what
			// the GPUs are, or the one there lists other GPUs than the
			// driver (NVML failed, /proc did not). Start over nothing
			// known, refusing every GPU request, and let the daemon
			// discover again. The cache is not written: the hooks keep
			// failing closed without it, or skip the stale one as the
			// daemon did.
			none, err := NewUndiscovered(fmt.Sprintf("discovery (devices.source = %q): %v", cfg.Source, discErr), "")
			if err != nil {
				return out, err
			}
			out.Inventory, out.Origin = none, OriginNone
			out.Skipped = append(out.Skipped, fmt.Errorf("discovery (devices.source = %q): %w", cfg.Source, discErr),
				fmt.Errorf("cache: %w", cacheErr))
			return out, nil
		}
		if cacheErr != nil {
			return out, fmt.Errorf("no GPU inventory: discovery (devices.source = %q): %w; cache: %w "+
				"(check the NVIDIA driver, or set devices.source = \"static\" with [[devices.static]])",
				cfg.Source, discErr, cacheErr)
		}
		out.Inventory, out.Origin, out.CachedAt = c.inv, OriginCache, c.at
		out.Skipped = append(out.Skipped, fmt.Errorf("discovery (devices.source = %q): %w", cfg.Source, discErr))
		return out, nil
	}

	c, cacheErr := loadUsableCache(cfg, opts, out.CachePath)
	if cacheErr == nil {
		out.Inventory, out.Origin, out.CachedAt = c.inv, OriginCache, c.at
		return out, nil
	}
	out.Skipped = append(out.Skipped, cacheErr)
	dc, nvml, tried := cfg, opts.NVML, fmt.Sprintf("discovery (devices.source = %q)", cfg.Source)
	if opts.Role == RoleHook {
		nvml = nil
		if dc.Source != config.SourceAuto && dc.Source != "" {
			dc.Source = config.SourceProc
		}
		tried = "discovery without NVML (/proc/driver/nvidia"
		if dc.Source != config.SourceProc {
			tried += ", then the static list"
		}
		tried += ")"
	}
	inv, discErr := Discover(dc, nvml)
	if discErr != nil {
		return out, fmt.Errorf("no GPU inventory: cache: %w; %s: %w "+
			"(start the nri-gpu-guard daemon or run `gpu-guard-ctl devices --refresh` to write the cache, "+
			"or set devices.source = \"static\")", cacheErr, tried, discErr)
	}
	out.Inventory, out.Origin = inv, OriginDiscovery
	return out, nil
}

// NewUndiscovered returns the empty inventory marked Undiscovered that a
// daemon decides with when no discovery source works (note says why), or,
// with contradiction set, when the driver contradicts the static list it
// decided with unchecked (see Inventory.Contradiction): every GPU request is
// refused.
func NewUndiscovered(note, contradiction string) (*Inventory, error) {
	return newInventory(Inventory{Source: "none", Undiscovered: true, Notes: []string{note}, Contradiction: contradiction})
}

// discovers reports whether source names a live discovery, which may work
// later (not a misspelt source, which never will).
func discovers(source config.Source) bool {
	switch source {
	case config.SourceAuto, "", config.SourceNVML, config.SourceProc:
		return true
	}
	return false
}

// loadUsableCache reads the cache at path and checks that it may be used in
// this boot (checkCacheBoot): a stale cache is an error wrapping
// ErrStaleCache, like an untrusted or a corrupt one.
func loadUsableCache(cfg config.DevicesConfig, opts LoadOptions, path string) (cached, error) {
	c, err := loadCache(path)
	if err != nil {
		return c, err
	}
	if err := checkCacheBoot(path, cfg.ProcRoot, c, opts.BootID); err != nil {
		return cached{}, err
	}
	return c, nil
}

// cacheListsGPUs reports whether path holds a trusted, usable cache that
// lists at least one GPU. It does not check the cache against the driver:
// it only decides whether the daemon keeps the file, never what it decides
// with, and the readers check it themselves.
func cacheListsGPUs(path string) bool {
	c, err := loadCache(path)
	return err == nil && len(c.inv.GPUs) > 0
}

// save writes the cache, stamped with the boot, and records its time, or the
// error.
func (l *Loaded) save(opts LoadOptions) {
	if err := SaveCache(l.CachePath, l.Inventory, opts.BootID); err != nil {
		l.CacheWriteErr = fmt.Errorf("write inventory cache %s (%s): %w", l.CachePath, opts.Role, err)
		return
	}
	if at, err := modTime(l.CachePath); err == nil {
		l.CachedAt = at
	}
}

// fatalWrite is the cache write error where it fails the load: a refresh
// exists to write the cache.
func (l *Loaded) fatalWrite(role Role) error {
	if role == RoleRefresh && l.CacheWriteErr != nil {
		return l.CacheWriteErr
	}
	return nil
}

func modTime(path string) (time.Time, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return time.Time{}, err
	}
	return fi.ModTime(), nil
}
