// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"reflect"
	"slices"
	"sync"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices/nvmlloader"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// Builder is the daemon's nriplugin.SetupFunc: it opens the ledger, loads the GPU
// inventory once (devices.LoadInventory, RoleDaemon: discover, write the cache
// the OCI hooks read, fall back to that cache) and builds the guard. It keeps
// the inventory and the ledger across calls with an unchanged configuration,
// so a reconnect (which calls Configure again) costs no NVML enumeration.
type Builder struct {
	// Logger; nil = discard.
	Logger *slog.Logger
	// Observer receives the guard's decisions (metrics); nil = none.
	Observer guard.Observer
	// Liveness overrides the holder liveness check; nil = host default.
	Liveness guard.Liveness
	// Now is the ledger's and the guard's clock; nil = time.Now (tests
	// inject one).
	Now func() time.Time
	// NVML is the NVML inventory source; nil = nvmlloader.New(nil) (tests
	// inject one).
	NVML devices.Loader
	// After is the timer Rediscover waits on between attempts; nil =
	// time.NewTimer (tests inject one).
	After func(time.Duration) <-chan time.Time

	mu     sync.Mutex
	invKey *inventoryKey
	inv    *devices.Inventory
	ledKey ledgerKey
	ledger *ledger.Ledger
	// invCfg is the configuration inv was loaded with.
	invCfg config.Config
	// incomplete: inv lists no GPU, is the cache a failed discovery fell
	// back to, or is a static list not checked against the driver in full
	// (devices.Inventory.Unchecked), or the undiscovered inventory that
	// replaced one the driver contradicted; Rediscover retries the
	// discovery until it lists the GPUs, checked.
	// atStart says what inv was (for the log line of the swap); guards are
	// the guards built over inv since, which the swap updates.
	incomplete bool
	atStart    string
	guards     []*guard.Guard
	// wake tells Rediscover that a Setup loaded an incomplete inventory.
	wake chan struct{}
}

// Bounds of the wait between two discoveries of an incomplete inventory.
const (
	rediscoverFirst = 5 * time.Second
	rediscoverMax   = time.Minute
)

// inventoryKey is what an inventory was loaded with: the [devices] section
// and the state directory its cache lives in.
type inventoryKey struct {
	devices  config.DevicesConfig
	stateDir string
}

// invKeyOf copies the static list deeply: the key must not change when the
// caller reuses or edits the configuration it passed.
func invKeyOf(cfg config.Config) inventoryKey {
	d := cfg.Devices
	d.Static = slices.Clone(d.Static)
	for i := range d.Static {
		d.Static[i].MIG = slices.Clone(d.Static[i].MIG)
	}
	return inventoryKey{devices: d, stateDir: cfg.Ledger.Dir}
}

// ledgerKey is what a ledger was opened with (ledger.Options holds a func and
// is not comparable): the directory and the options from the configuration.
type ledgerKey struct {
	dir                      string
	lockTimeout              time.Duration
	auditMaxBytes            int64
	reservationTTL, queueTTL time.Duration
}

func keyOf(dir string, o ledger.Options) ledgerKey {
	return ledgerKey{dir: dir, lockTimeout: o.LockTimeout, auditMaxBytes: o.AuditMaxBytes,
		reservationTTL: o.ReservationTTL, queueTTL: o.QueueTTL}
}

// Setup builds a guard for cfg. It implements SetupFunc.
func (b *Builder) Setup(_ context.Context, cfg config.Config) (*guard.Guard, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	log := b.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}

	opts := guard.LedgerOptions(cfg)
	key := keyOf(cfg.Ledger.Dir, opts)
	if b.ledger == nil || b.ledKey != key {
		opts.Now, opts.Logger = b.Now, log
		l, err := ledger.Open(key.dir, opts)
		if err != nil {
			return nil, fmt.Errorf("open ledger in %s (check [ledger] dir): %w", key.dir, err)
		}
		b.ledger, b.ledKey = l, key
	}

	if b.invKey == nil || !reflect.DeepEqual(*b.invKey, invKeyOf(cfg)) {
		// The ledger's boot id (read from the host, unless injected)
		// stamps the cache, so that the hooks trust it within this boot
		// and check it against the driver after a reboot.
		loaded, err := devices.LoadInventory(cfg.Devices, devices.LoadOptions{
			Role: devices.RoleDaemon, StateDir: cfg.Ledger.Dir, NVML: b.nvml(), BootID: b.ledger.BootID(),
		})
		if err != nil {
			return nil, fmt.Errorf("load the GPU inventory: %w", err)
		}
		for _, skipped := range loaded.Skipped {
			if loaded.Origin == devices.OriginNone {
				// Not fatal: refusing to start would leave containerd
				// (required_plugins) refusing every pod, the GPU
				// Operator's driver pod included.
				log.Warn("GPU inventory unavailable and no usable cache: starting with none, refusing every GPU request until the discovery retried in the background lists the GPUs",
					"source", cfg.Devices.Source, "error", skipped, "cache", loaded.CachePath)
				continue
			}
			log.Warn("GPU inventory unavailable, using the cached one", "source", cfg.Devices.Source,
				"error", skipped, "cache", loaded.CachePath, "gpus", len(loaded.Inventory.GPUs))
		}
		key := invKeyOf(cfg)
		b.inv, b.invKey = loaded.Inventory, &key
		if loaded.CacheWriteErr != nil {
			// The hooks fall back to discovering themselves; not fatal. The
			// inventory is not reused, so the next Setup (a reconnect)
			// loads and writes again rather than leave the hooks without
			// a cache for the daemon's lifetime.
			log.Warn("could not write the inventory cache for the OCI hooks", "path", loaded.CachePath, "error", loaded.CacheWriteErr)
			b.invKey = nil
		}
		log.Info("GPU inventory loaded", "source", loaded.Inventory.Source, "origin", string(loaded.Origin),
			"gpus", len(loaded.Inventory.GPUs))
		b.invCfg, b.guards = cfg, nil
		b.incomplete, b.atStart = incomplete(cfg, loaded)
		if b.incomplete {
			b.inv.Provisional = true // before any guard uses it
		}
		if loaded.CacheKept {
			log.Warn("GPU discovery lists no GPU while the PCI bus shows NVIDIA GPUs (driver not up yet?): "+
				"the inventory cache that lists GPUs is kept, but not decided with (it may predate a hardware change)",
				"unlisted", loaded.Inventory.UnlistedGPUs, "cache", loaded.CachePath)
		}
		switch {
		case !b.incomplete:
		case loaded.Inventory.Unchecked == devices.UncheckedNoDriver:
			// Fake GPUs (tests, demos) point proc_root where no driver
			// ever is: not worth a warning, and said once.
			log.Info("[[devices.static]] is used without a check against the NVIDIA driver: no driver tree under devices.proc_root "+
				"(driver not loaded yet, or fake GPUs); it is checked in the background once the driver lists GPUs, "+
				"and GPU requests are refused if the driver contradicts it",
				"proc_root", cfg.Devices.ProcRoot, "source", cfg.Devices.Source)
			b.signal()
		case loaded.Inventory.Unchecked == devices.UncheckedUUIDs:
			log.Warn("[[devices.static]] matches the NVIDIA driver by minor and index only: it does not show every GPU's UUID yet "+
				"(enable persistence mode, nvidia-smi -pm 1); an id the list lacks is refused, the UUIDs are checked in the background "+
				"once the driver shows them, and GPU requests are refused if it contradicts the list",
				"source", cfg.Devices.Source)
			b.signal()
		default:
			log.Warn("GPU inventory incomplete; requests for GPUs it does not list are refused, and the discovery is retried in the background until it lists them",
				"inventory", b.atStart, "source", cfg.Devices.Source)
			b.signal()
		}
	}

	g, err := guard.New(guard.Options{
		Config:    cfg,
		Inventory: b.inv,
		Ledger:    b.ledger,
		Liveness:  b.Liveness,
		Now:       b.Now,
		Logger:    log,
		Observer:  b.Observer,
	})
	if err == nil && b.incomplete {
		b.guards = append(b.guards, g)
	}
	return g, err
}

func (b *Builder) nvml() devices.Loader {
	if b.NVML != nil {
		return b.NVML
	}
	return nvmlloader.New(nil)
}

// incomplete reports whether the daemon should keep discovering for an
// inventory it loaded, and what that inventory was. A static list checked
// against the driver is complete (LoadInventory refused it if the driver
// listed other GPUs); one used unchecked is not: without a driver tree (a
// GPU Operator node, whose driver container starts after the guard; or
// fake GPUs, which never get one: the check then costs a directory read
// per minute, and changes nothing) or with a UUID the driver does not show
// yet, it is checked again until the driver shows that it matches, or
// contradicts it. An empty inventory is the common case of a GPU Operator
// node; the cache a failed discovery fell back to may predate a hardware
// change. Either way, live discovery replaces it once it lists GPUs.
func incomplete(cfg config.Config, l devices.Loaded) (bool, string) {
	switch l.Inventory.Unchecked {
	case devices.UncheckedNoDriver:
		return true, fmt.Sprintf("[[devices.static]] of %d GPU(s), unchecked (no driver tree)", len(l.Inventory.GPUs))
	case devices.UncheckedUUIDs:
		return true, fmt.Sprintf("[[devices.static]] of %d GPU(s), matched by minor and index (UUIDs not known yet)", len(l.Inventory.GPUs))
	}
	if cfg.Devices.Source == config.SourceStatic {
		return false, ""
	}
	switch {
	case l.Inventory.Undiscovered:
		return true, "none (no discovery source worked, no cache)"
	case l.Origin == devices.OriginCache:
		return true, fmt.Sprintf("the cache of %d GPU(s) (discovery failed)", len(l.Inventory.GPUs))
	case len(l.Inventory.GPUs) > 0:
		return false, ""
	case l.Inventory.UnlistedGPUs > 0:
		return true, fmt.Sprintf("empty, missing %d NVIDIA GPU(s) on the PCI bus", l.Inventory.UnlistedGPUs)
	}
	return true, "empty"
}

// signal wakes Rediscover; b.mu is held.
func (b *Builder) signal() {
	if b.wake == nil {
		b.wake = make(chan struct{}, 1)
	}
	select {
	case b.wake <- struct{}{}:
	default:
	}
}

func (b *Builder) wakeChan() <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.wake == nil {
		b.wake = make(chan struct{}, 1)
	}
	return b.wake
}

// Rediscover runs until ctx is done. While the inventory the guards decide
// with is incomplete (see incomplete: no GPU listed, typically because the
// NVIDIA driver came up after the daemon), it discovers again after 5s,
// then after twice the previous wait, up to a minute. Once discovery lists
// GPUs it writes the inventory cache the OCI hooks read, swaps the
// inventory of every guard built over the incomplete one
// (guard.SetInventory: safe with admissions in flight) and calls swapped
// with the latest of them (the daemon hands it to the observer, whose key
// changed). Without this, such a daemon refused every GPU request until
// someone restarted it. It never decides with a cache that a discovery
// listing nothing left in place (see devices.Loaded.CacheKept).
func (b *Builder) Rediscover(ctx context.Context, swapped func(*guard.Guard)) {
	wake := b.wakeChan()
	after := b.After
	if after == nil {
		after = func(d time.Duration) <-chan time.Time { return time.NewTimer(d).C }
	}
	wait := rediscoverFirst
	for {
		b.mu.Lock()
		need := b.incomplete
		b.mu.Unlock()
		if !need {
			wait = rediscoverFirst
			select {
			case <-ctx.Done():
				return
			case <-wake:
			}
			continue
		}
		select {
		case <-ctx.Done():
			return
		case <-after(wait):
		}
		wait = min(wait*2, rediscoverMax)
		if g := b.rediscoverOnce(); g != nil && swapped != nil {
			swapped(g)
		}
	}
}

// rediscoverOnce discovers the GPUs once (outside b.mu: NVML enumeration
// takes a while) and, when the inventory it replaces is still the incomplete
// one, swaps in what it found. It returns the latest guard it updated, nil
// when nothing was swapped.
//
//   - A discovery that lists GPUs, checked (not an unchecked static list):
//     the cache is written and the inventory is complete.
//   - A static list still unchecked: swapped in only when how far it is
//     checked changed (the driver came up, but a UUID is not known yet; or
//     it no longer contradicts the list); nothing is logged otherwise, so
//     that fake GPUs, which never get a driver, are not logged about every
//     minute.
//   - A discovery that fails because the driver contradicts the static list
//     (devices.ErrStaticMismatch) while the inventory is that list (used
//     unchecked) or already refuses on such a contradiction: an
//     undiscovered inventory carrying the mismatch replaces it, so that
//     every GPU request is refused with it; logged when the mismatch
//     changes. The cache is left as it is: it is marked unchecked, and
//     its readers find the same mismatch.
//   - Anything else: still incomplete, retried.
func (b *Builder) rediscoverOnce() *guard.Guard {
	b.mu.Lock()
	cfg, old, atStart := b.invCfg, b.inv, b.atStart
	b.mu.Unlock()
	log := b.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	inv, err := devices.Discover(cfg.Devices, b.nvml())
	staticList := old.Source == string(config.SourceStatic) || old.Contradiction != ""
	switch {
	case err == nil && len(inv.GPUs) > 0 && inv.Unchecked == "":
	case err == nil && inv.Unchecked != "" && staticList:
		if inv.Unchecked == old.Unchecked || old.Contradiction != "" {
			// As it was: nothing new, nothing logged. Or a list the
			// driver contradicted, now unchecked (the driver's tree gone
			// for a while, a UUID not shown): it stays refused until a
			// discovery checks it in full.
			return nil
		}
	case err != nil && errors.Is(err, devices.ErrStaticMismatch) && staticList:
		if old.Contradiction == err.Error() {
			return nil
		}
		none, nerr := devices.NewUndiscovered(fmt.Sprintf("discovery (devices.source = %q): %v", cfg.Devices.Source, err), err.Error())
		if nerr != nil {
			log.Error("GPU inventory: cannot build the inventory that refuses GPU requests", "error", nerr)
			return nil
		}
		inv = none
	default:
		log.Debug("GPU inventory still incomplete; discovery is retried", "error", err)
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.incomplete || b.inv != old {
		return nil // a Setup loaded another inventory meanwhile
	}
	done := !inv.Undiscovered && inv.Unchecked == ""
	if !inv.Undiscovered {
		cachePath := filepath.Join(cfg.Ledger.Dir, devices.CacheFile)
		if err := devices.SaveCache(cachePath, inv, b.ledger.BootID()); err != nil {
			// As in Setup: the hooks discover themselves; the next Setup
			// loads and writes again.
			log.Warn("could not write the inventory cache for the OCI hooks", "path", cachePath, "error", err)
			b.invKey = nil
		}
	}
	if !done {
		inv.Provisional = true // before any guard uses it
	}
	var latest *guard.Guard
	for _, g := range b.guards {
		if err := g.SetInventory(inv); err == nil {
			latest = g
		}
	}
	b.inv = inv
	switch {
	case done:
		b.incomplete, b.guards = false, nil
		log.Info(fmt.Sprintf("GPU inventory now lists %d GPUs (source %s); was %s at start", len(inv.GPUs), inv.Source, atStart),
			"gpus", len(inv.GPUs), "source", inv.Source, "was", atStart)
	case inv.Undiscovered:
		log.Error("the NVIDIA driver contradicts [[devices.static]]: every GPU request is refused until it matches "+
			"(fix the list and restart the daemon); checked again in the background",
			"error", inv.Contradiction, "source", cfg.Devices.Source)
	case inv.Unchecked == devices.UncheckedUUIDs:
		log.Warn("[[devices.static]] now matches the NVIDIA driver by minor and index; its UUIDs are checked once the driver shows them",
			"source", cfg.Devices.Source)
	default:
		log.Info("[[devices.static]] is used without a check again: no driver tree under devices.proc_root",
			"proc_root", cfg.Devices.ProcRoot, "source", cfg.Devices.Source)
	}
	return latest
}
