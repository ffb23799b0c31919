// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// Discover loads the inventory from the configured source. Source "auto"
// tries NVML, then /proc/driver/nvidia, then the static list, and takes the
// first that finds a GPU; the inventory's Source says which one, and its Notes
// why the earlier ones were skipped. When every source that works finds no
// GPU, the first of them is returned, empty (a host without GPUs); when none
// works, the error wraps ErrSourceUnavailable. An explicitly named source
// either works or fails with its own error.
//
// nvml is the NVML loader (nvmlloader.New), kept out of this package so
// that resolution and everything that imports it build without cgo; nil means
// a program that never initialises NVML (the OCI hook): NVML counts as
// unavailable. Where the inventory has MIG instances, the /dev/nvidia-caps
// mapping is read from proc_root too.
func Discover(cfg config.DevicesConfig, nvml Loader) (*Inventory, error) {
	root := cfg.ProcRoot
	if root == "" {
		root = "/"
	}
	if nvml == nil {
		nvml = noNVML{}
	}
	// The static list is checked against the driver's tree under root
	// wherever it is used: named alone, and as the last resort of "auto",
	// which reaches it when NVML is not there (the hook, an image without
	// the library) and /proc cannot be read (a GPU whose UUID is not known
	// yet): a list the driver contradicts is never the inventory.
	nvmlL, procL, staticL := nvml, NewProcLoader(root), &staticLoader{gpus: cfg.Static, root: root,
		fallback: cfg.Source != config.SourceStatic}
	var loaders []Loader
	switch cfg.Source {
	case config.SourceAuto, "":
		loaders = []Loader{nvmlL, procL, staticL}
	case config.SourceNVML:
		loaders = []Loader{nvmlL}
	case config.SourceProc:
		loaders = []Loader{procL}
	case config.SourceStatic:
		loaders = []Loader{staticL}
	default:
		return nil, fmt.Errorf("devices.source %q: want auto, nvml, proc or static", cfg.Source)
	}
	return discover(loaders, root, len(loaders) == 1)
}

func load(l Loader) ([]GPU, []string, error) {
	if n, ok := l.(notingLoader); ok {
		return n.loadNoted()
	}
	gpus, err := l.Load()
	return gpus, nil, err
}

// verifyingLoader is a Loader whose validated list is checked before it is
// used (the static list against the driver: staticLoader.verify); it may
// add notes.
type verifyingLoader interface {
	verify(gpus []GPU) ([]string, Unchecked, error)
}

func discover(loaders []Loader, root string, explicit bool) (*Inventory, error) {
	var notes []string
	// skips are the notes as errors, a source's own error wrapped, so that
	// the error of a discovery where no source works still wraps each
	// (ErrStaticMismatch, say: pkg/daemon tells a contradicted static list
	// by it).
	var skips []error
	skip := func(name string, err error) {
		notes = append(notes, fmt.Sprintf("%s: skipped: %v", name, err))
		skips = append(skips, fmt.Errorf("%s: skipped: %w", name, err))
	}
	note := func(n ...string) {
		notes = append(notes, n...)
		for _, s := range n {
			skips = append(skips, errors.New(s))
		}
	}
	var empty *Inventory
	for _, l := range loaders {
		gpus, loaderNotes, err := load(l)
		if err != nil {
			if explicit {
				return nil, fmt.Errorf("GPU inventory from %s: %w", l.Name(), err)
			}
			skip(l.Name(), err)
			continue
		}
		note(loaderNotes...)
		inv, err := newInventory(Inventory{Source: l.Name(), GPUs: gpus, Notes: notes})
		if v, ok := l.(verifyingLoader); ok && err == nil {
			var checked []string
			var unchecked Unchecked
			if checked, unchecked, err = v.verify(inv.GPUs); err == nil && (len(checked) > 0 || unchecked != "") {
				note(checked...)
				inv, err = newInventory(Inventory{Source: l.Name(), GPUs: gpus, Notes: notes, Unchecked: unchecked})
			}
		}
		if err != nil {
			if explicit {
				return nil, fmt.Errorf("GPU inventory from %s: %w", l.Name(), err)
			}
			skip(l.Name(), err)
			continue
		}
		if len(gpus) == 0 {
			// No GPU: under auto, try the next source; named alone (nvml,
			// proc), the answer, but one that may come before the driver
			// lists its GPUs: either way the PCI bus is counted below, so
			// that a request for every GPU is not admitted with nothing
			// claimed while they are there. (A static list of none is
			// refused by its loader.)
			if empty == nil {
				empty = inv
			}
			if !explicit {
				note(l.Name() + ": skipped: found no GPU")
			}
			continue
		}
		return withMIGCaps(inv, root)
	}
	if empty != nil {
		if n, addrs := unboundNvidiaGPUs(root); n > 0 {
			notes = append(notes, fmt.Sprintf("%d NVIDIA GPU(s) on the PCI bus are not listed (%s): is the NVIDIA driver loaded? "+
				"Requests for every GPU are refused until the inventory lists them: the nri-gpu-guard daemon retries the discovery by itself once the driver is up", n, strings.Join(addrs, ", ")))
			next := *empty
			next.UnlistedGPUs = n
			empty, _ = newInventory(next) // an empty inventory with a count: valid
		}
		empty.Notes = notes
		return empty, nil
	}
	return nil, fmt.Errorf("%w: no GPU inventory source works: %w", ErrSourceUnavailable, errors.Join(skips...))
}

// withMIGCaps adds the /dev/nvidia-caps mapping to an inventory with MIG
// instances.
func withMIGCaps(inv *Inventory, root string) (*Inventory, error) {
	hasMIG := false
	for _, g := range inv.GPUs {
		hasMIG = hasMIG || len(g.MIG) > 0
	}
	if !hasMIG {
		return inv, nil
	}
	major, caps, notes := loadMIGCaps(root, inv.GPUs)
	next := *inv
	next.CapsMajor, next.MIGCaps = major, caps
	if len(notes) > 0 {
		next.Notes = append(append([]string(nil), inv.Notes...), notes...)
	}
	return newInventory(next)
}

// noNVML is the NVML source of a program that does not load NVML.
type noNVML struct{}

func (noNVML) Name() string { return string(config.SourceNVML) }

func (noNVML) Load() ([]GPU, error) {
	return nil, fmt.Errorf("%w: nvml: not loaded by this program", ErrSourceUnavailable)
}

// unboundNvidiaGPUs counts the NVIDIA display and 3D controllers on the PCI
// bus under root (sys/bus/pci/devices) that no other driver than NVIDIA's
// has taken (a GPU handed to vfio-pci for a virtual machine is no container's),
// and lists up to a few of their addresses. Without sysfs it finds none.
func unboundNvidiaGPUs(root string) (n int, addrs []string) {
	dir := filepath.Join(root, "sys", "bus", "pci", "devices")
	entries, err := os.ReadDir(dir)
	if err != nil {
		return 0, nil
	}
	const maxDevices, maxListed = 4096, 4
	for i, e := range entries {
		if i == maxDevices {
			break
		}
		dev := filepath.Join(dir, e.Name())
		if readTrimmed(filepath.Join(dev, "vendor")) != "0x10de" {
			continue
		}
		class := readTrimmed(filepath.Join(dev, "class"))
		if !strings.HasPrefix(class, "0x0300") && !strings.HasPrefix(class, "0x0302") {
			continue
		}
		if drv, err := os.Readlink(filepath.Join(dev, "driver")); err == nil && filepath.Base(drv) != "nvidia" {
			continue
		}
		n++
		if len(addrs) < maxListed {
			addrs = append(addrs, e.Name())
		}
	}
	return n, addrs
}

// readTrimmed reads a small sysfs attribute ("" when unreadable).
func readTrimmed(path string) string {
	f, err := os.Open(path) //nolint:gosec // a fixed sysfs attribute under the configured root
	if err != nil {
		return ""
	}
	defer func() { _ = f.Close() }()
	var buf [64]byte
	n, _ := io.ReadFull(f, buf[:])
	return strings.TrimSpace(string(buf[:n]))
}
