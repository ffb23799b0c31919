// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// ErrStaleCache is wrapped by LoadInventory's skip reason for a cache
// written in an earlier (or an unknown) boot that does not list the GPUs the
// NVIDIA driver lists now: a GPU was added, removed or replaced while the
// host was down. Such a cache would resolve "all" to the GPUs it lists and
// an index to the GPU that had it then, so it is never used.
var ErrStaleCache = errors.New("stale inventory cache")

// maxStaleDiffs bounds the differences a stale-cache error lists.
const maxStaleDiffs = 4

// checkCacheBoot returns nil when the cache c, read from path, may be used in
// the boot bootID ("" when unknown), else an error wrapping ErrStaleCache.
//
//   - Written in this boot: used as it is, without reading anything more.
//     GPUs are not added, removed or replaced while a host runs (a driver
//     reload or a PCI hot-plug is the exception: `gpu-guard-ctl devices
//     --refresh` then), and the OCI hook reads the cache for every container.
//   - Written in another boot, or in one it does not record: the physical
//     GPUs the driver lists and does not exclude
//     (<procRoot>/proc/driver/nvidia/gpus, read as the /proc source does)
//     must be the cache's, by UUID, PCI bus id (where the cache has one) and
//     device minor. The minor counts: a container's /dev/nvidia<minor> node
//     is resolved through it.
//   - A cache of another boot that lists MIG instances is stale whatever the
//     GPUs: MIG instances get new UUIDs when they are re-created.
//   - When the driver's tree is not there (the driver is not loaded, so no
//     container reaches a GPU), the cache is used as it is: nothing tells it
//     is out of date, and the daemon's fallback needs it while the driver
//     comes up. When it is there but a GPU in it cannot be read (its UUID
//     not known yet), the cache is stale: nothing shows it matches.
func checkCacheBoot(path, procRoot string, c cached, bootID string) error {
	if bootID != "" && c.bootID == bootID {
		return nil
	}
	if procRoot == "" {
		procRoot = "/"
	}
	driver, err := NewProcLoader(procRoot).Load()
	if errors.Is(err, ErrSourceUnavailable) {
		if _, serr := os.Stat(filepath.Join(procRoot, "proc")); serr == nil {
			return nil // no driver: nothing tells the cache is out of date
		}
		// No procfs where the configuration says (devices.proc_root set
		// for another mount namespace): nothing shows the cache matches.
		return fmt.Errorf("load inventory cache %s: %w: it was written in another boot, and there is no procfs under "+
			"devices.proc_root %s to compare it with; fix devices.proc_root, or run `gpu-guard-ctl devices --refresh`", path, ErrStaleCache, procRoot)
	}
	if err != nil {
		// The driver lists GPUs but one cannot be read (an uninitialised
		// GPU shows its UUID as "GPU-????????-…" until persistence mode or
		// a first open brings it up, right after a reboot): nothing shows
		// the cache matches, so it is not used. The next step of the order
		// fails on the same GPU and says so.
		return fmt.Errorf("load inventory cache %s: %w: it was written in another boot, and the GPUs the NVIDIA driver lists now "+
			"cannot all be read to compare (%w); run `gpu-guard-ctl devices --refresh` once they can", path, ErrStaleCache, err)
	}
	diffs := cacheDiffs(driver, c.inv.GPUs)
	// MIG instances are not kept across a reboot: whoever re-creates them
	// (mig-parted, nvidia-smi mig) gets new UUIDs. A cache listing them
	// from another boot names instances that are gone, and not the new
	// ones (a new MIG UUID would read as unknown, an index like 3:0 would
	// claim the old UUID).
	migs := 0
	for _, g := range c.inv.GPUs {
		migs += len(g.MIG)
	}
	if migs > 0 {
		diffs = append(diffs, fmt.Sprintf("the cache lists %d MIG instance(s), which are re-created with new UUIDs after a reboot", migs))
	}
	if len(diffs) == 0 {
		return nil
	}
	if len(diffs) > maxStaleDiffs {
		diffs = append(diffs[:maxStaleDiffs], fmt.Sprintf("%d more difference(s)", len(diffs)-maxStaleDiffs))
	}
	when := "an earlier boot"
	if c.bootID == "" {
		when = "a boot it does not record (an older nri-gpu-guard wrote it)"
	}
	return fmt.Errorf("load inventory cache %s: %w: it was written in %s and does not match what the NVIDIA driver lists now: %s; "+
		"run `gpu-guard-ctl devices --refresh` or start the nri-gpu-guard daemon to rewrite it",
		path, ErrStaleCache, when, strings.Join(diffs, "; "))
}

// cacheDiffs lists how the GPUs the driver lists (from the /proc loader:
// index in bus id order, normalised bus id) differ from the cache's, one
// phrase each; none when they are the same GPUs.
func cacheDiffs(driver, cache []GPU) []string {
	byUUID := make(map[string]GPU, len(cache))
	for _, g := range cache {
		byUUID[g.UUID] = g
	}
	var diffs []string
	listed := make(map[string]bool, len(driver))
	for _, d := range driver {
		listed[d.UUID] = true
		c, ok := byUUID[d.UUID]
		if !ok {
			diffs = append(diffs, fmt.Sprintf("GPU %d (%s) at %s is not in the cache", d.Index, d.UUID, d.BusID))
			continue
		}
		if c.BusID != "" {
			// A cache from NVML holds bus ids normalised already;
			// anything else is compared in the same spelling.
			if bus, ok := NormaliseBusID(c.BusID); !ok || bus != d.BusID {
				diffs = append(diffs, fmt.Sprintf("GPU %d (%s) is at %s, at %s in the cache", d.Index, d.UUID, d.BusID, c.BusID))
				continue
			}
		}
		if c.Minor != d.Minor {
			diffs = append(diffs, fmt.Sprintf("GPU %d (%s) at %s is /dev/nvidia%d, /dev/nvidia%d in the cache",
				d.Index, d.UUID, d.BusID, d.Minor, c.Minor))
		}
	}
	for _, c := range cache {
		if listed[c.UUID] {
			continue
		}
		at := ""
		if c.BusID != "" {
			at = " at " + c.BusID
		}
		diffs = append(diffs, fmt.Sprintf("the cache's GPU %d (%s)%s is not listed by the driver (removed, replaced or excluded)",
			c.Index, c.UUID, at))
	}
	return diffs
}
