package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"reflect"
	"sync"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices/nvmlloader"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// Builder is the daemon's nriplugin.SetupFunc: it opens the ledger, loads the GPU
// inventory once and writes the inventory cache the OCI hooks read. It keeps
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

	mu      sync.Mutex
	devCfg  *config.DevicesConfig
	inv     *devices.Inventory
	ledKey  ledgerKey
	ledger  *ledger.Ledger
	cacheAt string
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

	cachePath := filepath.Join(cfg.Ledger.Dir, devices.CacheFile)
	if b.inv == nil || b.devCfg == nil || !reflect.DeepEqual(*b.devCfg, cfg.Devices) {
		inv, err := devices.Discover(cfg.Devices, nvmlloader.New(nil))
		if err != nil {
			cached, cerr := devices.LoadCache(cachePath)
			if cerr != nil {
				return nil, fmt.Errorf("GPU inventory (source %q): %w; no usable cache at %s either: %w",
					cfg.Devices.Source, err, cachePath, cerr)
			}
			log.Warn("GPU inventory unavailable, using the cached one", "source", cfg.Devices.Source,
				"error", err, "cache", cachePath, "gpus", len(cached.GPUs))
			inv = cached
		}
		devCfg := cfg.Devices
		b.inv, b.devCfg, b.cacheAt = inv, &devCfg, ""
		log.Info("GPU inventory loaded", "source", inv.Source, "gpus", len(inv.GPUs))
	}
	if b.cacheAt != cachePath {
		if err := devices.SaveCache(cachePath, b.inv); err != nil {
			// The hooks fall back to discovering themselves; not fatal.
			log.Warn("could not write the inventory cache for the OCI hooks", "path", cachePath, "error", err)
		} else {
			b.cacheAt = cachePath
		}
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
