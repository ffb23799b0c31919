// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"fmt"
	"log/slog"
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

	mu     sync.Mutex
	invKey *inventoryKey
	inv    *devices.Inventory
	ledKey ledgerKey
	ledger *ledger.Ledger
}

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
		loaded, err := devices.LoadInventory(cfg.Devices, devices.LoadOptions{
			Role: devices.RoleDaemon, StateDir: cfg.Ledger.Dir, NVML: nvmlloader.New(nil),
		})
		if err != nil {
			return nil, fmt.Errorf("load the GPU inventory: %w", err)
		}
		for _, skipped := range loaded.Skipped {
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
	}

	return guard.New(guard.Options{
		Config:    cfg,
		Inventory: b.inv,
		Ledger:    b.ledger,
		Liveness:  b.Liveness,
		Now:       b.Now,
		Logger:    log,
		Observer:  b.Observer,
	})
}
