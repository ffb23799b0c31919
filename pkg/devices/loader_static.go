// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"errors"
	"fmt"
	"path"
	"strings"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// ErrStaticMismatch is wrapped by Discover's error when the configuration's
// [[devices.static]] list is not the GPUs the NVIDIA driver lists (or the
// driver's list cannot be read to compare): "all" would claim only the
// listed GPUs while NVIDIA's runtime hands out every GPU, and an index or a
// minor would claim one GPU while the container gets another. Fix the list,
// or use devices.source = "auto".
var ErrStaticMismatch = errors.New("[[devices.static]] does not match the GPUs the NVIDIA driver lists")

// maxStaticDiffs bounds the differences a static mismatch lists: enough for
// every GPU of a large host, listed and missing.
const maxStaticDiffs = 32

type staticLoader struct {
	gpus []config.StaticGPU
	// root is the proc_root whose driver tree the list is checked against
	// (verify); "" checks nothing (NewStaticLoader).
	root string
	// fallback: the list is source "auto"'s last resort, not the source
	// named (what to do differs).
	fallback bool
}

// NewStaticLoader returns the loader for the configuration's
// [[devices.static]] list, taken as it is. An empty list is
// ErrSourceUnavailable, so that source "auto" moves on. Discover uses a
// static loader that also checks the list against the driver (see
// staticLoader.verify).
func NewStaticLoader(gpus []config.StaticGPU) Loader {
	return &staticLoader{gpus: gpus}
}

func (l *staticLoader) Name() string { return string(config.SourceStatic) }

func (l *staticLoader) Load() ([]GPU, error) {
	if len(l.gpus) == 0 {
		return nil, fmt.Errorf("%w: static: no [[devices.static]] GPU is configured", ErrSourceUnavailable)
	}
	out := make([]GPU, 0, len(l.gpus))
	for _, s := range l.gpus {
		g := GPU{Index: s.Index, UUID: s.UUID, Minor: s.Minor, Model: s.Model, MemoryMiB: s.MemoryMiB}
		for _, m := range s.MIG {
			g.MIG = append(g.MIG, MIG{
				Index: m.Index, UUID: m.UUID, GI: m.GI, CI: m.CI,
				ParentUUID: s.UUID, ParentIndex: s.Index,
			})
		}
		out = append(out, g)
	}
	return out, nil
}

// verify checks the validated static list gpus against the GPUs the NVIDIA
// driver lists under l.root (<proc_root>/proc/driver/nvidia/gpus, excluded
// GPUs and display adapters left out, as the /proc source reads it), with
// the comparison a cache of another boot gets (listDiffs), indices included:
// the list must hold every GPU the driver lists and no other, each with the
// driver's minor and its index in PCI bus id order. The guard's job is that
// no GPU is reached unclaimed; a list that misses one (a GPU added, a typo,
// a list copied from another host) would let "all" and the indices through
// to GPUs it does not know, so the load fails instead (ErrStaticMismatch),
// naming each difference.
//
//   - No driver tree (no driver loaded, or a proc_root of fake GPUs in
//     tests): nothing to compare, the list is used as it is, marked
//     UncheckedNoDriver. No container reaches a GPU without the driver; the
//     daemon checks the list again in the background (the driver of a GPU
//     Operator node loads after the guard), and every other load checks it
//     anew.
//   - A GPU whose UUID the driver does not know yet (right after a boot,
//     before persistence mode or a first open) is matched by minor, and its
//     index compared; the list is marked UncheckedUUIDs and a note says so.
//     Failing there would stop the daemon on every boot of a host without
//     persistence mode. Its UUID is checked by the next load once the driver
//     shows it: the daemon's background check, the hook's own load under
//     "static", and under "auto" every reader of the cache, which holds the
//     list marked unchecked and is checked against the driver on every read
//     (checkCacheBoot), in this boot too. Until then an unknown id is
//     refused under unknown_device = "ignore" (the resolver).
//   - The driver's tree there but unreadable: nothing shows the list
//     matches; the load fails.
//
// It runs on every load of the static list, not once per boot through the
// cache, deliberately. Under source "static" the hook never reads the cache
// (the configuration is authoritative, and the configuration may change
// without the daemon rewriting it), so a per-boot verdict would need a new
// trusted record of which configuration was checked against which driver
// tree; and the read is small (one directory and a few hundred bytes per GPU
// of procfs, a fraction of a millisecond), made only for containers that
// name a GPU (the no-GPU path never loads the inventory), next to the ledger
// lock and fsync the same hook takes. Checking on every load also catches a
// UUID that was not known at the daemon's start.
func (l *staticLoader) verify(gpus []GPU) (notes []string, unchecked Unchecked, err error) {
	if l.root == "" {
		return nil, "", nil
	}
	driver, aside, err := readDriverGPUs(l.root)
	if errors.Is(err, ErrSourceUnavailable) {
		return nil, UncheckedNoDriver, nil
	}
	tree := path.Join(l.root, procGPUsDir)
	if err != nil {
		return nil, "", fmt.Errorf("%w: the GPUs the driver lists under %s cannot be read to compare (%w); "+
			"fix the driver's tree, or set devices.source = \"auto\"", ErrStaticMismatch, tree, err)
	}
	if diffs := listDiffs(driver, aside, gpus, listStatic, true); len(diffs) > 0 {
		if len(diffs) > maxStaticDiffs {
			diffs = append(diffs[:maxStaticDiffs], fmt.Sprintf("%d more difference(s)", len(diffs)-maxStaticDiffs))
		}
		instead := "or set devices.source = \"auto\" to discover them"
		if l.fallback {
			// Under "auto" the list is reached only when neither NVML
			// nor /proc gave the GPUs: the usual cause is a GPU whose
			// UUID the driver does not show yet.
			instead = "or enable persistence mode (nvidia-smi -pm 1) so that /proc/driver/nvidia shows every GPU's UUID and discovery needs no list"
		}
		return nil, "", fmt.Errorf("%w (%s): %s; fix [[devices.static]] to list every GPU the driver lists, "+
			"each with its index (PCI bus id order, as nvidia-smi numbers them), UUID and minor "+
			"(`nvidia-smi -q` shows them as GPU UUID and Minor Number), %s",
			ErrStaticMismatch, tree, strings.Join(diffs, "; "), instead)
	}
	for _, d := range driver {
		if d.uuidUnknown {
			notes = append(notes, fmt.Sprintf("static: GPU %d at %s (/dev/nvidia%d) matches [[devices.static]] by minor and index; "+
				"its UUID is not known to the driver yet, and is checked once it is", d.Index, d.BusID, d.Minor))
			unchecked = UncheckedUUIDs
		}
	}
	return notes, unchecked, nil
}
