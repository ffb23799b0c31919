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
//
// Setup answers by its context's deadline: the runtime gives a plugin's
// Configure its request timeout (2s by default) and drops a plugin that
// answers late, while an NVML enumeration on a host without persistence mode
// can take longer. The load runs in the background; a Setup whose context
// ends first answers with a guard over an undiscovered inventory that
// refuses every GPU request (guard.Options.Discovering), and the load swaps
// its result into that guard when it ends (guard.SetInventory).
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

	// setupMu makes Setups one at a time: each may wait for a load
	// without holding mu, which the load needs to end.
	setupMu sync.Mutex

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
	// the guards built over inv since, which the swap updates (and the
	// guards built while a load runs, which it updates when it ends).
	incomplete bool
	atStart    string
	guards     []*guard.Guard
	// loading is the load of the inventory for invKey while it runs (inv
	// is then the undiscovered one that stands in for it); nil otherwise.
	loading *inventoryLoad
	// cacheDue: writing inv to the cache the OCI hooks read failed;
	// Rediscover writes it again (not a new discovery), with its back-off.
	cacheDue bool
	// landed is the latest guard that a load ending after its Setup had
	// answered swapped an inventory into, for Rediscover to hand to its
	// swapped (the daemon's observer then restarts over the GPUs); landedC
	// wakes Rediscover for it.
	landed  *guard.Guard
	landedC chan struct{}
	// wake tells Rediscover that a Setup loaded an incomplete inventory.
	wake chan struct{}
}

// inventoryLoad is one run of devices.LoadInventory for a Setup (see
// Builder.loading).
type inventoryLoad struct {
	cfg  config.Config
	key  inventoryKey
	done chan struct{} // closed once it ended and its result was applied
	// Under Builder.mu:
	ended bool
	err   error
	// detached: a Setup answered before it ended, with a guard over the
	// undiscovered inventory: its result is swapped into Builder.guards.
	detached bool
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

func (b *Builder) logger() *slog.Logger {
	if b.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return b.Logger
}

// Setup builds a guard for cfg. It implements SetupFunc.
//
// It answers by ctx's end (the NRI adapter gives it the request's deadline
// less a margin): a load of the inventory still running then goes on in the
// background, and the guard returned decides over an undiscovered inventory
// that refuses every GPU request, saying that the discovery is in progress
// (guard.Guard.Discovering), until the load swaps in what it found. A ctx
// that never ends (the external daemon's first Setup) waits for the load,
// whose error it returns, as before the daemon serves anything.
func (b *Builder) Setup(ctx context.Context, cfg config.Config) (*guard.Guard, error) {
	b.setupMu.Lock()
	defer b.setupMu.Unlock()
	log := b.logger()
	ld, err := b.prepare(cfg, log)
	if err != nil {
		return nil, err
	}
	if ld != nil {
		select {
		case <-ld.done:
		case <-ctx.Done():
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	discovering := false
	if ld != nil {
		switch {
		case ld.ended && ld.err != nil:
			return nil, fmt.Errorf("load the GPU inventory: %w", ld.err)
		case !ld.ended:
			ld.detached, discovering = true, true
			log.Warn("GPU discovery is still running when the runtime needs an answer: answering now, with every GPU request "+
				"refused until the discovery ends in the background (containers without a GPU are decided as always)",
				"source", cfg.Devices.Source, "error", context.Cause(ctx))
		}
	}
	g, err := guard.New(guard.Options{
		Config:      cfg,
		Inventory:   b.inv,
		Ledger:      b.ledger,
		Liveness:    b.Liveness,
		Now:         b.Now,
		Logger:      log,
		Observer:    b.Observer,
		Discovering: discovering,
	})
	if err == nil && (b.incomplete || discovering) {
		b.guards = append(b.guards, g)
	}
	return g, err
}

// prepare opens the ledger for cfg and, when the inventory must be loaded
// (first Setup, or another [devices] section or state directory), starts
// its load; it returns the load the Setup waits for (nil: the inventory is
// there). A load of the same key still running is joined; one of another
// key is superseded (its result is dropped when it ends).
func (b *Builder) prepare(cfg config.Config, log *slog.Logger) (*inventoryLoad, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	opts := guard.LedgerOptions(cfg)
	lkey := keyOf(cfg.Ledger.Dir, opts)
	if b.ledger == nil || b.ledKey != lkey {
		opts.Now, opts.Logger = b.Now, log
		l, err := ledger.Open(lkey.dir, opts)
		if err != nil {
			return nil, fmt.Errorf("open ledger in %s (check [ledger] dir): %w", lkey.dir, err)
		}
		b.ledger, b.ledKey = l, lkey
	}
	key := invKeyOf(cfg)
	if ld := b.loading; ld != nil {
		if reflect.DeepEqual(ld.key, key) {
			return ld, nil
		}
		b.loading = nil
	}
	if b.invKey != nil && reflect.DeepEqual(*b.invKey, key) {
		return nil, nil
	}
	pending, err := devices.NewUndiscovered(fmt.Sprintf("discovery (devices.source = %q) in progress", cfg.Devices.Source), "")
	if err != nil {
		return nil, fmt.Errorf("load the GPU inventory: %w", err)
	}
	pending.Provisional = true // before any guard uses it
	ld := &inventoryLoad{cfg: cfg, key: key, done: make(chan struct{})}
	b.loading, b.invKey, b.inv, b.invCfg = ld, &key, pending, cfg
	b.guards, b.incomplete, b.cacheDue, b.atStart = nil, false, false, "none (discovery in progress)"
	// The ledger's boot id (read from the host, unless injected) stamps
	// the cache, so that the hooks trust it within this boot and check it
	// against the driver after a reboot.
	bootID := b.ledger.BootID()
	go b.load(ld, bootID, log)
	return ld, nil
}

// load runs devices.LoadInventory for ld (NVML enumeration, the cache's
// write) without holding b.mu, and applies its result.
func (b *Builder) load(ld *inventoryLoad, bootID string, log *slog.Logger) {
	loaded, err := devices.LoadInventory(ld.cfg.Devices, devices.LoadOptions{
		Role: devices.RoleDaemon, StateDir: ld.cfg.Ledger.Dir, NVML: b.nvml(), BootID: bootID,
	})
	b.land(ld, loaded, err, log)
}

// land applies the result of load ld, unless a Setup for another [devices]
// section superseded it: the inventory becomes b.inv, and when its Setup has
// answered already (detached), it is swapped into the guards built over the
// undiscovered one meanwhile. A load that failed while its Setup waited
// leaves that Setup to return the error (the next Setup loads again); one
// that failed after leaves the guards refusing every GPU request, with the
// error, while Rediscover retries.
func (b *Builder) land(ld *inventoryLoad, loaded devices.Loaded, err error, log *slog.Logger) {
	b.mu.Lock()
	defer b.mu.Unlock()
	defer close(ld.done)
	ld.ended, ld.err = true, err
	if b.loading != ld {
		return
	}
	b.loading = nil
	switch {
	case err != nil && !ld.detached:
		b.invKey = nil
		return
	case err != nil:
		contradiction := ""
		if errors.Is(err, devices.ErrStaticMismatch) {
			contradiction = err.Error()
		}
		none, nerr := devices.NewUndiscovered(fmt.Sprintf("load the GPU inventory (devices.source = %q): %v", ld.cfg.Devices.Source, err), contradiction)
		if nerr != nil {
			log.Error("GPU inventory: cannot build the inventory that refuses GPU requests", "error", nerr)
			return
		}
		log.Error("the GPU inventory could not be loaded: every GPU request is refused; fix the configuration and restart "+
			"the daemon (the discovery is retried in the background)", "source", ld.cfg.Devices.Source, "error", err)
		none.Provisional = true // before any guard uses it
		b.inv, b.incomplete = none, true
		b.atStart = fmt.Sprintf("none (the load failed: %v)", err)
		b.signal()
	default:
		b.adopt(ld.cfg, loaded, log)
	}
	if !ld.detached {
		return
	}
	var latest *guard.Guard
	for _, g := range b.guards {
		if err := g.SetInventory(b.inv); err == nil {
			latest = g
		}
	}
	if !b.incomplete {
		b.guards = nil
	}
	if latest != nil {
		log.Info("GPU discovery ended: GPU requests are decided with its inventory", "gpus", len(b.inv.GPUs),
			"source", b.inv.Source)
		b.landed = latest
		if b.landedC == nil {
			b.landedC = make(chan struct{}, 1)
		}
		select {
		case b.landedC <- struct{}{}:
		default:
		}
	}
}

// adopt makes the inventory LoadInventory loaded (for cfg) b.inv, logs what
// a daemon must know of it, and says whether Rediscover has work. b.mu is
// held.
func (b *Builder) adopt(cfg config.Config, loaded devices.Loaded, log *slog.Logger) {
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
	b.inv = loaded.Inventory
	if loaded.CacheWriteErr != nil {
		// The hooks fall back to discovering themselves; not fatal. The
		// inventory is kept (a reconnect costs no new enumeration), and
		// Rediscover writes it again, so that the hooks do not stay
		// without a cache for the daemon's lifetime.
		log.Warn("could not write the inventory cache for the OCI hooks; written again in the background",
			"path", loaded.CachePath, "error", loaded.CacheWriteErr)
		b.cacheDue = true
		b.signal()
	}
	log.Info("GPU inventory loaded", "source", loaded.Inventory.Source, "origin", string(loaded.Origin),
		"gpus", len(loaded.Inventory.GPUs))
	b.invCfg = cfg
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
//
// It also hands swapped the guards a load that outlasted its Setup updated
// (see Setup), and writes again, with the same back-off, an inventory cache
// whose write failed (not a new discovery: the inventory is known).
func (b *Builder) Rediscover(ctx context.Context, swapped func(*guard.Guard)) {
	wake, landed := b.wakeChan(), b.landedChan()
	after := b.After
	if after == nil {
		after = func(d time.Duration) <-chan time.Time { return time.NewTimer(d).C }
	}
	report := func() {
		b.mu.Lock()
		g := b.landed
		b.landed = nil
		b.mu.Unlock()
		if g != nil && swapped != nil {
			swapped(g)
		}
	}
	wait := rediscoverFirst
	for {
		report()
		b.mu.Lock()
		need, due := b.incomplete, b.cacheDue
		b.mu.Unlock()
		if !need && !due {
			wait = rediscoverFirst
			select {
			case <-ctx.Done():
				return
			case <-wake:
			case <-landed:
			}
			continue
		}
		timer := after(wait)
		for fired := false; !fired; {
			select {
			case <-ctx.Done():
				return
			case <-timer:
				fired = true
			case <-landed:
				report() // within the wait, which goes on
			}
		}
		wait = min(wait*2, rediscoverMax)
		if need {
			if g := b.rediscoverOnce(); g != nil && swapped != nil {
				swapped(g)
			}
		}
		b.retryCache()
	}
}

func (b *Builder) landedChan() <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.landedC == nil {
		b.landedC = make(chan struct{}, 1)
	}
	return b.landedC
}

// retryCache writes the inventory cache again when its last write failed
// (cacheDue), outside b.mu (it syncs to disk).
func (b *Builder) retryCache() {
	b.mu.Lock()
	inv, due, dir := b.inv, b.cacheDue, b.invCfg.Ledger.Dir
	bootID := ""
	if b.ledger != nil {
		bootID = b.ledger.BootID()
	}
	if due && (inv == nil || inv.Undiscovered) {
		b.cacheDue = false // never written: the hooks keep failing closed (see devices.SaveCache)
	}
	b.mu.Unlock()
	if !due || inv == nil || inv.Undiscovered {
		return
	}
	path := filepath.Join(dir, devices.CacheFile)
	err := devices.SaveCache(path, inv, bootID)
	b.mu.Lock()
	if b.inv == inv {
		b.cacheDue = err != nil
	}
	b.mu.Unlock()
	if err != nil {
		b.logger().Warn("could not write the inventory cache for the OCI hooks; retried", "path", path, "error", err)
		return
	}
	b.logger().Info("inventory cache for the OCI hooks written", "path", path)
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
	log := b.logger()
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
			// As in Setup: the hooks discover themselves; written again
			// at the next attempt (retryCache).
			log.Warn("could not write the inventory cache for the OCI hooks; written again in the background", "path", cachePath, "error", err)
			b.cacheDue = true
		} else {
			b.cacheDue = false
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
