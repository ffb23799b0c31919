// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
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
//   - A cache of a static list is checked as one of another boot is, on
//     every read, in the boot it was written in too: one not checked
//     against the driver in full when it was written (Inventory.Unchecked:
//     no driver tree then, or a GPU whose UUID the driver did not know),
//     since the driver may have come up, or shown the UUID, since; and one
//     without the mark, which a binary from before static lists were
//     checked may have written unchecked. Its indices are
//     compared as well (they are the list's, not NVML's), and its MIG
//     instances are kept within its boot.
//   - When the driver's tree is not there (the driver is not loaded, so no
//     container reaches a GPU), the cache is used as it is: nothing tells it
//     is out of date, and the daemon's fallback needs it while the driver
//     comes up. When it is there but a GPU in it cannot be read (its UUID
//     not known yet), the cache is stale: nothing shows it matches.
func checkCacheBoot(path, procRoot string, c cached, bootID string) error {
	thisBoot := bootID != "" && c.bootID == bootID
	// A static list's cache is checked in its boot too, marked unchecked or
	// not: one written by a binary from before static lists were checked
	// carries no mark, and a list it never compared could name other GPUs
	// than the driver's. Hosts read such a cache only when "auto" fell
	// back to the list (under "static" the hooks load the list itself).
	if thisBoot && c.inv.Unchecked == "" && c.inv.Source != string(config.SourceStatic) {
		return nil
	}
	when := "another boot"
	if thisBoot {
		when = "this boot, of a [[devices.static]] list not checked against the driver then"
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
		return fmt.Errorf("load inventory cache %s: %w: it was written in %s, and there is no procfs under "+
			"devices.proc_root %s to compare it with; fix devices.proc_root, or run `gpu-guard-ctl devices --refresh`", path, ErrStaleCache, when, procRoot)
	}
	if err != nil {
		// The driver lists GPUs but one cannot be read (an uninitialised
		// GPU shows its UUID as "GPU-????????-…" until persistence mode or
		// a first open brings it up, right after a reboot): nothing shows
		// the cache matches, so it is not used. The next step of the order
		// fails on the same GPU and says so.
		return fmt.Errorf("load inventory cache %s: %w: it was written in %s, and the GPUs the NVIDIA driver lists now "+
			"cannot all be read to compare (%w); run `gpu-guard-ctl devices --refresh` once they can", path, ErrStaleCache, when, err)
	}
	diffs := cacheDiffs(driver, c.inv)
	// MIG instances are not kept across a reboot: whoever re-creates them
	// (mig-parted, nvidia-smi mig) gets new UUIDs. A cache listing them
	// from another boot names instances that are gone, and not the new
	// ones (a new MIG UUID would read as unknown, an index like 3:0 would
	// claim the old UUID).
	migs := 0
	for _, g := range c.inv.GPUs {
		if !thisBoot {
			migs += len(g.MIG)
		}
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
	switch {
	case thisBoot:
	case c.bootID == "":
		when = "a boot it does not record (an older nri-gpu-guard wrote it)"
	default:
		when = "an earlier boot"
	}
	return fmt.Errorf("load inventory cache %s: %w: it was written in %s and does not match what the NVIDIA driver lists now: %s; "+
		"run `gpu-guard-ctl devices --refresh` or start the nri-gpu-guard daemon to rewrite it",
		path, ErrStaleCache, when, strings.Join(diffs, "; "))
}

// cacheDiffs lists how the GPUs the driver lists (from the /proc loader:
// index in bus id order, normalised bus id) differ from the cache's, one
// phrase each; none when they are the same GPUs. Indices are not compared
// in a cache of NVML or the /proc source: both number GPUs in bus id order,
// which the bus ids compared already fix. They are in a cache of a static
// list, which has no bus ids and whose indices were written by hand.
func cacheDiffs(driver []GPU, cache *Inventory) []string {
	d := make([]procGPU, len(driver))
	for i, g := range driver {
		d[i] = procGPU{GPU: g}
	}
	return listDiffs(d, nil, cache.GPUs, listCache, cache.Source == string(config.SourceStatic))
}

// listKind names the list of GPUs listDiffs compares with the driver's, in
// its phrases.
type listKind struct {
	in    string // "in the cache"
	whose string // "the cache's GPU"
	// minors: name the minor of a GPU missing from the list (what a
	// static list must give for it).
	minors bool
}

var (
	listCache  = listKind{in: "in the cache", whose: "the cache's GPU"}
	listStatic = listKind{in: "in [[devices.static]]", whose: "the [[devices.static]] GPU", minors: true}
)

// listDiffs lists how the GPUs the driver lists (readDriverGPUs, or the
// /proc loader) differ from list, one phrase each naming the GPU by index,
// UUID and bus id; none when they are the same GPUs. This is the one
// comparison of a list of GPUs with the driver, for a cache of another boot
// (checkCacheBoot) and for the configuration's static list (checkStatic):
//
//   - by UUID, ignoring case as the configuration's validation, the
//     inventory's index and the resolver do (a list typed with upper-case
//     hex names the same GPUs): every GPU the driver lists is in the list,
//     and every GPU in the list is one the driver lists;
//   - by PCI bus id, where the list has one (a static list has none);
//   - by device minor: a container's /dev/nvidia<minor> node is resolved
//     through it;
//   - with withIndex, by index (the driver's GPUs numbered in bus id order,
//     as NVML numbers them): a hand-written index that is not NVML's would
//     claim one GPU while NVIDIA's runtime hands the container another.
//
// aside are the GPUs the driver shows but leaves out (excluded ones, display
// adapters: readDriverGPUs): a listed GPU that is one of them is named as
// such, since it is no GPU a container is handed (NVML does not list it
// either) and the list must leave it out.
//
// A GPU whose UUID the driver does not know yet (uuidUnknown) is matched to
// the listed GPU at its bus id, else (a list without bus ids) at its minor,
// among those no known UUID matched, and then compared like the others: what
// it shows still fixes which listed GPU it is, only its UUID is unchecked.
func listDiffs(driver, aside []procGPU, list []GPU, kind listKind, withIndex bool) []string {
	byUUID := make(map[string]int, len(list))
	for i, g := range list {
		byUUID[strings.ToLower(g.UUID)] = i
	}
	var diffs []string
	matched := make([]bool, len(list))
	pair := make([]int, len(driver))
	for i, d := range driver {
		pair[i] = -1
		if d.uuidUnknown {
			continue
		}
		if j, ok := byUUID[strings.ToLower(d.UUID)]; ok {
			pair[i], matched[j] = j, true
		}
	}
	for i, d := range driver {
		if !d.uuidUnknown {
			continue
		}
		pair[i] = matchUnknown(d, list, matched)
		if pair[i] >= 0 {
			matched[pair[i]] = true
		}
	}
	for i, d := range driver {
		if pair[i] < 0 {
			minor := ""
			if kind.minors || d.uuidUnknown {
				minor = fmt.Sprintf(", /dev/nvidia%d,", d.Minor)
			}
			diffs = append(diffs, fmt.Sprintf("GPU %d %s at %s%s is not %s", d.Index, uuidPhrase(d), d.BusID, minor, kind.in))
			continue
		}
		c := list[pair[i]]
		if c.BusID != "" {
			// A cache from NVML holds bus ids normalised already;
			// anything else is compared in the same spelling.
			if bus, ok := NormaliseBusID(c.BusID); !ok || bus != d.BusID {
				diffs = append(diffs, fmt.Sprintf("GPU %d %s is at %s, at %s %s", d.Index, uuidPhrase(d), d.BusID, c.BusID, kind.in))
				continue
			}
		}
		if c.Minor != d.Minor {
			diffs = append(diffs, fmt.Sprintf("GPU %d %s at %s is /dev/nvidia%d, /dev/nvidia%d %s",
				d.Index, uuidPhrase(d), d.BusID, d.Minor, c.Minor, kind.in))
			continue
		}
		if withIndex && c.Index != d.Index {
			diffs = append(diffs, fmt.Sprintf("GPU %d %s at %s is index %d %s (NVML numbers GPUs in PCI bus id order)",
				d.Index, uuidPhrase(d), d.BusID, c.Index, kind.in))
		}
	}
	for j, c := range list {
		if matched[j] {
			continue
		}
		at := ""
		if c.BusID != "" {
			at = " at " + c.BusID
		}
		if why := asideWhy(aside, c.UUID); why != "" {
			diffs = append(diffs, fmt.Sprintf("%s %d (%s)%s is %s: leave it out of %s",
				kind.whose, c.Index, c.UUID, at, why, strings.TrimPrefix(kind.in, "in ")))
			continue
		}
		diffs = append(diffs, fmt.Sprintf("%s %d (%s)%s is not listed by the driver (removed, replaced or excluded)",
			kind.whose, c.Index, c.UUID, at))
	}
	return diffs
}

// asideWhy says why the driver leaves the GPU of uuid out of the GPUs it
// lists, when aside holds it: "" when it does not.
func asideWhy(aside []procGPU, uuid string) string {
	for _, g := range aside {
		if g.uuidUnknown || !strings.EqualFold(g.UUID, uuid) {
			continue
		}
		if g.excluded {
			return fmt.Sprintf("excluded by the driver at %s (NVreg_ExcludedGpus), so no container is handed it and NVML does not list it", g.BusID)
		}
		return fmt.Sprintf("a display adapter (%s) at %s: nvidia-smi lists it on a DGX Station, but it is no GPU a container is handed "+
			"and NVIDIA's enumeration leaves it out", g.Model, g.BusID)
	}
	return ""
}

// matchUnknown is the position in list of the GPU that driver GPU d, whose
// UUID is not known yet, is: the one not matched yet at its bus id, else,
// when that one has no bus id, at its minor; -1 when none is.
func matchUnknown(d procGPU, list []GPU, matched []bool) int {
	byMinor := -1
	for j, c := range list {
		if matched[j] {
			continue
		}
		if c.BusID != "" {
			if bus, ok := NormaliseBusID(c.BusID); ok && bus == d.BusID {
				return j
			}
			continue
		}
		if c.Minor == d.Minor && byMinor < 0 {
			byMinor = j
		}
	}
	return byMinor
}

// uuidPhrase is "(GPU-…)", or what stands for a UUID not known yet.
func uuidPhrase(d procGPU) string { return "(" + d.uuidText() + ")" }
