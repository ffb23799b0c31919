// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// app is one invocation: the environment, the global flags and what was
// loaded from them (each at most once).
type app struct {
	env Env

	configFlag   string
	stateDirFlag string
	output       string

	cfg     *config.Config // loaded once, on first use
	cfgPath string         // the file cfg was read from; "" for the defaults

	// stopInterrupts stops the signal handling Env.Interrupts started.
	stopInterrupts context.CancelFunc
}

// config loads the configuration named by --config, then
// $NRI_GPU_GUARD_CONFIG, then the default path (absent = defaults).
func (a *app) config() (config.Config, error) {
	if a.cfg != nil {
		return *a.cfg, nil
	}
	name := a.configFlag
	if name == "" {
		name = a.env.Getenv(config.EnvPath)
	}
	cfg, path, err := config.LoadDefault(name)
	if err != nil {
		return config.Config{}, fmt.Errorf("load configuration: %w (check it with `%s check-config`)", err, programName)
	}
	a.cfg, a.cfgPath = &cfg, path
	return cfg, nil
}

var (
	// ledgerFiles are the files of every ledger a writer committed to,
	// named in messages; ledgerOtherFiles those it holds at times
	// (ledger.DirFiles).
	ledgerFiles, ledgerOtherFiles = ledger.DirFiles()
	// daemonFiles are what the daemon writes beside the ledger: the
	// inventory cache, the observer's report, and the findings it carries
	// to the daemon after it.
	daemonFiles = []string{devices.CacheFile, observe.FileName, observe.CarryFileName}
	// ledgerDirFiles are the files whose presence makes a directory a
	// ledger directory. The ones every used ledger has come first: the
	// usual read answers with one lstat.
	ledgerDirFiles = slices.Concat(ledgerFiles, ledgerOtherFiles, daemonFiles)
)

// ledgerDirState is what a state directory holds, as a read command judges it.
type ledgerDirState int

const (
	dirHasLedger ledgerDirState = iota // one of ledgerDirFiles, or it cannot be told
	dirMissing
	dirEmpty // exists, none of ledgerDirFiles
)

// lstat is os.Lstat, a variable for the tests that count what a command
// looks at.
var lstat = os.Lstat

// ledgerDirOf judges dir by its files; absent are those of ledgerDirFiles
// the caller already found missing there, not looked at again.
func ledgerDirOf(dir string, absent ...string) ledgerDirState {
	for _, name := range ledgerDirFiles {
		if slices.Contains(absent, name) {
			continue
		}
		_, err := lstat(filepath.Join(dir, name))
		if err == nil || !errors.Is(err, fs.ErrNotExist) {
			// There, or not readable (not root): the ledger read said
			// what it could, nothing to add.
			return dirHasLedger
		}
	}
	if _, err := lstat(dir); errors.Is(err, fs.ErrNotExist) {
		return dirMissing
	}
	return dirEmpty
}

// checkLedgerDir is what a read command does once the ledger read
// succeeded, about a state dir that reads as an empty ledger only because
// no ledger is there: every GPU would show free. The ledger itself refuses
// the dir whose files vanished after this boot committed to it (its boot
// marker: ErrNeedsRecovery), so what is left here is a dir never used in
// this boot, which is either a fresh host's or the wrong one.
//   - --state-dir (which exists: checkStateDirFlag) holding none of the
//     ledger's or the daemon's files is refused: the operator named a
//     directory on purpose, and /run/nri-gpu-guard, the ledger dir's parent
//     or a backup's are easy to name by mistake. A --state-dir naming the
//     configured [ledger] dir is judged as that dir.
//   - [ledger] dir of the configuration is only warned about, missing or
//     holding none of those files: on a fresh host it is both (the package
//     creates it empty; the daemon and the hook write the ledger with their
//     first claim), and a read command must work there.
//
// absent are files of ledgerDirFiles the caller found missing in the
// ledger's dir (the one it opened, which is the dir judged here).
func (a *app) checkLedgerDir(absent ...string) error {
	dir, explicit := a.stateDirFlag, a.stateDirFlag != ""
	if a.cfg != nil && (!explicit || filepath.Clean(dir) == filepath.Clean(a.cfg.Ledger.Dir)) {
		dir, explicit = a.cfg.Ledger.Dir, false
	}
	if dir == "" {
		return nil
	}
	state := ledgerDirOf(dir, absent...)
	if state == dirHasLedger {
		return nil
	}
	if explicit {
		return fmt.Errorf("--state-dir %s: no ledger here: it holds none of the ledger's files (%s) nor the daemon's (%s), "+
			"and would read as an empty ledger with every GPU free; "+
			"name the ledger directory the daemon and the hook use ([ledger] dir of their configuration, %s by default)",
			dir, strings.Join(ledgerFiles, ", "), strings.Join(daemonFiles, ", "), config.Default().Ledger.Dir)
	}
	from := "the default, no configuration file"
	if a.cfgPath != "" {
		from = "[ledger] dir of " + a.cfgPath
	}
	what := "does not exist"
	if state == dirEmpty {
		what = "holds no ledger (none of " + strings.Join(ledgerFiles, ", ") + ")"
	}
	fmt.Fprintln(a.env.Stderr, escapeLine(fmt.Sprintf("warning: the ledger directory %s (%s) %s, so the ledger reads as empty: "+
		"either no claim was ever recorded on this host (the daemon and the hook write the ledger with their first claim), "+
		"or the path is wrong: [ledger] dir must name the directory the daemon and the hook use", dir, from, what)))
	return nil
}

// stateDir is --state-dir, else [ledger] dir.
func (a *app) stateDir() (string, error) {
	if a.stateDirFlag != "" {
		if err := checkStateDirFlag(a.stateDirFlag); err != nil {
			return "", err
		}
		return a.stateDirFlag, nil
	}
	cfg, err := a.config()
	if err != nil {
		return "", err
	}
	return cfg.Ledger.Dir, nil
}

// checkStateDirFlag refuses a --state-dir that cannot be a ledger directory.
// It stands for [ledger] dir, so it is judged as that key is
// (config.CheckLedgerDir, with the same words): a relative path would depend
// on where ctl runs, and a system directory (/var/lib for
// /var/lib/nri-gpu-guard) would get the ledger's files and mode 0700 from a
// mutating command. It must also be an existing directory: opened anyway, it
// reads as an empty ledger, and status would report every GPU free (for the
// same reason a read command refuses one that holds no ledger:
// checkLedgerDir).
func checkStateDirFlag(dir string) error {
	if err := config.CheckLedgerDir(dir); err != nil {
		return usagef("--state-dir: %v (it names the ledger directory the daemon and the hook use, [ledger] dir of their configuration)", err)
	}
	fi, err := os.Stat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("--state-dir %s: no such directory; name the ledger directory the daemon and the hook use "+
			"([ledger] dir of their configuration, %s by default)", dir, config.Default().Ledger.Dir)
	case err != nil:
		return fmt.Errorf("--state-dir %s: %w", dir, err)
	case !fi.IsDir():
		return fmt.Errorf("--state-dir %s: not a directory; name the ledger directory ([ledger] dir)", dir)
	}
	return nil
}

// ledgerOptions are the ledger's tunables from the configuration, with the
// injected clocks and boot id.
func (a *app) ledgerOptions(cfg config.Config) ledger.Options {
	opts := guard.LedgerOptions(cfg)
	opts.Now, opts.BootClock, opts.BootID = a.env.Now, a.env.BootClock, a.env.BootID
	return opts
}

// bootID is the host's boot id (env.BootID when a test pins it), as the
// ledger reads it: a refresh stamps the inventory cache with it, and a
// reader trusts a cache of this boot without checking it against the driver.
// "" when it cannot be read: a cache is then checked, and one written says
// its boot is unknown, which costs its readers that check, never safety.
func (a *app) bootID() string {
	if a.env.BootID != "" {
		return a.env.BootID
	}
	id, err := ledger.HostBootID()
	if err != nil {
		return ""
	}
	return id
}

// openLedger opens the ledger read-only (readOnly) or for writing.
func (a *app) openLedger(readOnly bool) (*ledger.Ledger, error) {
	cfg, err := a.config()
	if err != nil {
		return nil, err
	}
	dir, err := a.stateDir()
	if err != nil {
		return nil, err
	}
	open := ledger.Open
	if readOnly {
		open = ledger.OpenReadOnly
	}
	l, err := open(dir, a.ledgerOptions(cfg))
	if err != nil {
		return nil, fmt.Errorf("open ledger in %s: %w", dir, err)
	}
	return l, nil
}

// view runs fn over the ledger state as of now, without the lock and without
// writing: the committed state with the queue mechanics applied (waiters and
// reservations past their deadline gone, free devices reserved for the queue
// heads), exactly what the daemon's next decision would start from.
func (a *app) view(ctx context.Context, fn func(tx *ledger.Tx) error) error {
	l, err := a.openLedger(true)
	if err != nil {
		return err
	}
	return viewOf(ctx, l, fn)
}

// viewOf is view over a ledger already open.
func viewOf(ctx context.Context, l *ledger.Ledger, fn func(tx *ledger.Tx) error) error {
	if err := l.View(ctx, fn); err != nil {
		return fmt.Errorf("read ledger %s: %w", l.StatePath(), err)
	}
	return nil
}

// snapshot is a copy of the state as view sees it, the caller's to keep and
// modify: tx.State() already is one (it shares no storage with the Tx or the
// ledger), so it is not copied again.
func (a *app) snapshot(ctx context.Context) (ledger.State, error) {
	l, err := a.openLedger(true)
	if err != nil {
		return ledger.State{}, err
	}
	return snapshotOf(ctx, l)
}

// snapshotOf is snapshot of a ledger already open.
func snapshotOf(ctx context.Context, l *ledger.Ledger) (ledger.State, error) {
	var st ledger.State
	err := viewOf(ctx, l, func(tx *ledger.Tx) error {
		st = *tx.State()
		return nil
	})
	return st, err
}

// inventoryInfo says where an inventory came from.
type inventoryInfo struct {
	// Origin is "cache" (the daemon's inventory.json), "config" (devices.source
	// = "static") or "discovery".
	Origin    string
	CachePath string
	// CachedAt is the cache file's modification time when it was read or
	// written (zero otherwise).
	CachedAt time.Time

	// warnings are for stderr: a cache that is present but was refused.
	warnings []string
}

// printWarnings writes info's warnings to w.
func (info inventoryInfo) printWarnings(w io.Writer) {
	for _, s := range info.warnings {
		fmt.Fprintln(w, escapeLine("warning: "+s))
	}
}

// inventory loads the GPU inventory as every reading program does
// (devices.LoadInventory, RoleReader): the configured list under a static
// source, else the daemon's cache when it is trusted, else discovery as the
// daemon would. A cache that is present but refused is reported on stderr.
func (a *app) inventory() (*devices.Inventory, inventoryInfo, error) {
	inv, info, err := a.inventoryQuiet()
	info.printWarnings(a.env.Stderr)
	return inv, info, err
}

// inventoryQuiet is inventory leaving its warnings to the caller (in
// inventoryInfo), which prints them once it knows they matter: status
// does not lead with a refused cache when the ledger read then fails.
func (a *app) inventoryQuiet() (*devices.Inventory, inventoryInfo, error) {
	return a.loadInventory(devices.RoleReader)
}

// loadInventory loads the inventory as role, per [devices] of the
// configuration, with the cache in the state directory.
func (a *app) loadInventory(role devices.Role) (*devices.Inventory, inventoryInfo, error) {
	cfg, err := a.config()
	if err != nil {
		return nil, inventoryInfo{}, err
	}
	dir, err := a.stateDir()
	if err != nil {
		return nil, inventoryInfo{}, err
	}
	if role == devices.RoleRefresh && cfg.Devices.Source != config.SourceStatic && cfg.Devices.Source != config.SourceProc {
		// A refresh discovers, NVML first, and writes the cache: without
		// NVML, hand over before discovery could fall back to /proc or the
		// static list and write that.
		if err := a.needNVML(discoveryWhy(cfg.Devices.Source)); err != nil {
			return nil, inventoryInfo{}, err
		}
	}
	nvml, handover := a.nvmlLoader(cfg.Devices.Source)
	loaded, err := devices.LoadInventory(cfg.Devices, devices.LoadOptions{Role: role, StateDir: dir, NVML: nvml, BootID: a.bootID()})
	info := inventoryInfo{Origin: string(loaded.Origin), CachePath: loaded.CachePath, CachedAt: loaded.CachedAt}
	if handover != nil && handover.err != nil {
		// Discovery needed NVML and the handover failed: what discovery
		// then made of it (under "auto", /proc or the static list) is not
		// the daemon's inventory.
		return nil, info, handover.err
	}
	if err != nil {
		return nil, info, err
	}
	for _, skipped := range loaded.Skipped {
		if !errors.Is(skipped, fs.ErrNotExist) {
			info.warnings = append(info.warnings, fmt.Sprintf("ignoring the inventory cache: %v; discovering GPUs instead", skipped))
		}
	}
	return loaded.Inventory, info, nil
}

// requireRoot refuses a mutating command for anyone but root.
func (a *app) requireRoot(what string) error {
	if uid := a.env.Getuid(); uid != 0 {
		return fmt.Errorf("%s changes the ledger and needs root (running as uid %d): run it with sudo", what, uid)
	}
	return nil
}

// gcPause counts the one-shot reads running with the collector paused; the
// first saves the settings, the last puts them back (tests run commands
// concurrently in one process).
var gcPause struct {
	sync.Mutex
	n     int
	pct   int
	limit int64
}

// pauseGC turns the garbage collector off, under a memory limit, until the
// returned function is called. A one-shot read (status, queue) allocates a
// few times the ledger's size once and exits: collecting on the way only
// costs (at 4,000 waiters a quarter of `queue -o json`, mostly the
// collector waiting to stop the goroutine that renders). The limit still
// collects should a huge ledger need it.
func pauseGC() (restore func()) {
	gcPause.Lock()
	defer gcPause.Unlock()
	if gcPause.n == 0 {
		gcPause.pct = debug.SetGCPercent(-1)
		gcPause.limit = debug.SetMemoryLimit(-1)
		if gcPause.limit == math.MaxInt64 {
			debug.SetMemoryLimit(256 << 20) // far above a few-MB ledger; a kind bound on a small node
		}
	}
	gcPause.n++
	return func() {
		gcPause.Lock()
		defer gcPause.Unlock()
		if gcPause.n--; gcPause.n == 0 {
			debug.SetMemoryLimit(gcPause.limit)
			debug.SetGCPercent(gcPause.pct)
		}
	}
}
