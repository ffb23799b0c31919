package hook

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// loadInventory returns the GPUs to resolve a request against, without ever
// initialising NVML (a hook runs once per container; NVML init costs tens of
// milliseconds to seconds and needs the driver library in the hook's mount
// namespace):
//
//   - source = "static": the configuration's list, which is authoritative;
//   - otherwise the cache the daemon or `gpu-guard-ctl devices --refresh`
//     writes (<ledger dir>/inventory.json);
//   - without a cache: /proc/driver/nvidia (source "auto", "nvml", "proc"),
//     then, for "auto", the static list.
func loadInventory(cfg config.Config) (*devices.Inventory, error) {
	if cfg.Devices.Source == config.SourceStatic {
		inv, err := devices.Discover(cfg.Devices, nil)
		if err != nil {
			return nil, fmt.Errorf("static GPU inventory: %w", err)
		}
		return inv, nil
	}
	cachePath := filepath.Join(cfg.Ledger.Dir, devices.CacheFile)
	inv, cacheErr := loadCache(cachePath)
	if cacheErr == nil {
		return inv, nil
	}
	dc := cfg.Devices
	dc.Source = config.SourceProc
	inv, procErr := devices.Discover(dc, nil)
	if procErr == nil {
		return inv, nil
	}
	if cfg.Devices.Source == config.SourceAuto && len(cfg.Devices.Static) > 0 {
		dc.Source = config.SourceStatic
		if inv, err := devices.Discover(dc, nil); err == nil {
			return inv, nil
		}
	}
	return nil, fmt.Errorf("no GPU inventory: cache %s: %w; /proc/driver/nvidia: %w "+
		"(start the nri-gpu-guard daemon or run `gpu-guard-ctl devices --refresh` to write the cache, "+
		"or set devices.source = \"static\")", cachePath, cacheErr, procErr)
}

// loadCache reads the inventory cache after checking that only root could
// have written it: the hook trusts it to map device ids to GPUs, and a forged
// map would let a container through to a busy GPU.
func loadCache(path string) (*devices.Inventory, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file (%s)", path, fi.Mode().Type())
	}
	if fi.Mode().Perm()&0o022 != 0 {
		return nil, fmt.Errorf("%s is writable by group or others (mode %s)", path, fi.Mode().Perm())
	}
	if sys, ok := fi.Sys().(*syscall.Stat_t); ok && int(sys.Uid) != os.Geteuid() && sys.Uid != 0 {
		return nil, fmt.Errorf("%s is owned by uid %d, not root", path, sys.Uid)
	}
	return devices.LoadCache(path)
}

// emptyInventory is an inventory with no GPU, used where the real one is not
// needed (poststop).
func emptyInventory() *devices.Inventory {
	inv, err := devices.NewInventory("none", nil)
	if err != nil {
		// NewInventory of nothing has nothing to reject; keep a usable value.
		return &devices.Inventory{Source: "none"}
	}
	return inv
}
