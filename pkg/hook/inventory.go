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
// needed (poststop) or to tell whether a request names any GPU at all.
func emptyInventory() *devices.Inventory {
	inv, err := devices.NewInventory("none", nil)
	if err != nil {
		// NewInventory of nothing has nothing to reject; keep a usable value.
		return &devices.Inventory{Source: "none"}
	}
	return inv
}

// nothingRequested tells a container that reaches no GPU (skip: nothing to
// check, no ledger access) from one that must go through the guard. When the
// inventory could not be loaded, a request that still resolves to nothing
// against an empty inventory, without naming "all", names no GPU at all and
// is let through; any other request fails closed with the inventory error.
// A privileged container follows policy.privileged: under "declared" it
// claims only what it names (so it is let through when it names nothing,
// like the CNI and storage agents every node runs), under "all" it resolves
// to "all" and under "reject" to an error, both failing closed.
func nothingRequested(inv *devices.Inventory, invErr error, policy config.PolicyConfig, req devices.Request) (bool, error) {
	if invErr == nil {
		res, err := devices.NewResolver(inv, policy).Resolve(req)
		if err != nil {
			// Let the guard refuse it: it words and audits the refusal.
			return false, nil
		}
		return len(res.Devices) == 0 && !res.All, nil
	}
	res, err := devices.NewResolver(emptyInventory(), policy).Resolve(req)
	if err == nil && len(res.Devices) == 0 && !res.All {
		return true, nil
	}
	return false, fmt.Errorf("the container names a GPU, but %w", invErr)
}
