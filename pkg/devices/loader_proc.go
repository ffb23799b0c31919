// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sort"
	"strconv"
	"strings"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/gpuid"
)

// Paths below the configured proc_root (relative, for os.Root).
const (
	procGPUsDir   = "proc/driver/nvidia/gpus"
	procMIGMinors = "proc/driver/nvidia-caps/mig-minors"
	procDevices   = "proc/devices"
)

// maxProcFile bounds what is read from one /proc file: the real ones are a
// few hundred bytes (mig-minors a few KiB).
const maxProcFile = 1 << 20

// notingLoader is a Loader with observations for Inventory.Notes.
type notingLoader interface {
	loadNoted() ([]GPU, []string, error)
}

type procLoader struct {
	root string
	// unknownUUIDs lists a GPU whose UUID the driver does not know yet
	// (procGPU.uuidUnknown) rather than fail: only for comparing a list
	// with the driver (readDriverGPUs), which can still match it by bus id
	// and minor. An inventory never holds such a GPU.
	unknownUUIDs bool
	// aside collects, when non-nil, the GPUs read() leaves out of the
	// inventory (excluded by the driver, display adapters), for messages.
	aside *[]procGPU
}

// NewProcLoader returns the loader that reads
// <root>/proc/driver/nvidia/gpus/*/information, the driver's own description
// of each GPU, without NVML. root is the configuration's proc_root ("/" on a
// host; tests point it at a fake tree).
//
// /proc gives no NVML index, so the index is the GPU's position in PCI bus id
// order: that is the order NVML enumerates GPUs in (nvidia-smi shows the
// same), and GPUs the driver excludes are skipped, as NVML skips them.
// test/gpu/gpu-check.sh compares both on a real host. /proc does not list MIG
// instances (it has no MIG UUIDs), so a proc inventory has none: the
// resolver then claims the parent GPU of a MIG id whole, and refuses a MIG
// UUID (see builder.missing).
func NewProcLoader(root string) Loader {
	return &procLoader{root: root}
}

func (l *procLoader) Name() string { return string(config.SourceProc) }

func (l *procLoader) Load() ([]GPU, error) {
	gpus, _, err := l.loadNoted()
	return gpus, err
}

type procGPU struct {
	GPU
	bus      [4]uint64
	excluded bool
	// uuidUnknown: the driver shows the UUID as "GPU-????????-…" (the GPU
	// is not initialised yet); UUID is empty. Only with unknownUUIDs.
	uuidUnknown bool
}

func (l *procLoader) loadNoted() ([]GPU, []string, error) {
	found, notes, err := l.read()
	if err != nil {
		return nil, nil, err
	}
	gpus := make([]GPU, len(found))
	for i, g := range found {
		gpus[i] = g.GPU
	}
	return gpus, notes, nil
}

// readDriverGPUs reads the GPUs the driver lists under root, as the /proc
// source does (same indices, excluded GPUs and display adapters left out),
// but keeps a GPU whose UUID is not known yet (uuidUnknown) instead of
// failing: what it shows (bus id, minor, its index) can still be compared
// with a list of GPUs. aside holds the GPUs left out (excluded ones, display
// adapters), so that a list naming one can be told why it is not a GPU of
// the inventory. A missing driver tree wraps ErrSourceUnavailable.
func readDriverGPUs(root string) (gpus, aside []procGPU, err error) {
	gpus, _, err = (&procLoader{root: root, unknownUUIDs: true, aside: &aside}).read()
	return gpus, aside, err
}

// read lists the GPUs in the inventory's order, with their indices.
func (l *procLoader) read() ([]procGPU, []string, error) {
	root, err := os.OpenRoot(l.root)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil, fmt.Errorf("%w: proc: %w", ErrSourceUnavailable, err)
		}
		return nil, nil, fmt.Errorf("proc: %w", err)
	}
	defer func() { _ = root.Close() }()
	dir, err := fs.ReadDir(root.FS(), procGPUsDir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil, fmt.Errorf("%w: proc: no %s under %s (NVIDIA driver not loaded?)", ErrSourceUnavailable, procGPUsDir, l.root)
		}
		return nil, nil, fmt.Errorf("proc: %w", err)
	}
	var found []procGPU
	var notes []string
	for _, e := range dir {
		if !e.IsDir() {
			continue
		}
		name := procGPUsDir + "/" + e.Name() + "/information"
		data, err := readBounded(root, name)
		if err != nil {
			return nil, nil, fmt.Errorf("proc: %w", err)
		}
		g, err := parseInfo(data, l.unknownUUIDs)
		if err != nil {
			return nil, nil, fmt.Errorf("proc: %s: %w", name, err)
		}
		if g.BusID == "" {
			g.BusID = e.Name()
		}
		norm, ok := NormaliseBusID(g.BusID)
		if !ok {
			return nil, nil, fmt.Errorf("proc: %s: bus location %q is not a PCI bus id", name, g.BusID)
		}
		g.BusID = norm
		g.bus = busKey(norm)
		if g.excluded {
			notes = append(notes, fmt.Sprintf("proc: GPU %s at %s is excluded by the driver (NVreg_ExcludedGpus): not in the inventory, as NVML does not list it", g.uuidText(), g.BusID))
			if l.aside != nil {
				*l.aside = append(*l.aside, g)
			}
			continue
		}
		found = append(found, g)
	}
	sort.Slice(found, func(i, j int) bool {
		a, b := found[i].bus, found[j].bus
		for k := range a {
			if a[k] != b[k] {
				return a[k] < b[k]
			}
		}
		return false
	})
	gpus := make([]procGPU, 0, len(found))
	for i, g := range found {
		if isDisplayGPU(g.Model) {
			// NVML counts it (its index is skipped, not reused), but the
			// NVML inventory leaves it out, as go-nvlib's enumeration
			// does: the same GPUs, at the same indices, from both
			// sources, so that a cache of one is not stale to the other.
			notes = append(notes, fmt.Sprintf("proc: GPU %s at %s (%s) is a display adapter: not in the inventory, as in NVML's", g.uuidText(), g.BusID, g.Model))
			if l.aside != nil {
				*l.aside = append(*l.aside, g)
			}
			continue
		}
		g.Index = i
		gpus = append(gpus, g)
	}
	return gpus, notes, nil
}

// uuidText is the GPU's UUID for messages.
func (g procGPU) uuidText() string {
	if g.uuidUnknown {
		return "UUID not known yet"
	}
	return g.UUID
}

// isDisplayGPU reports whether model names the display adapter of a DGX
// Station, which NVIDIA's enumeration (go-nvlib) never lists as a GPU.
func isDisplayGPU(model string) bool {
	return model == "DGX Display" || model == "NVIDIA DGX Display"
}

func busKey(norm string) [4]uint64 {
	var k [4]uint64
	fields := strings.FieldsFunc(norm, func(r rune) bool { return r == ':' || r == '.' })
	for i := 0; i < len(fields) && i < 4; i++ {
		k[i], _ = strconv.ParseUint(fields[i], 16, 64)
	}
	return k
}

func readBounded(root *os.Root, name string) (string, error) {
	f, err := root.Open(name)
	if err != nil {
		return "", err
	}
	defer func() { _ = f.Close() }()
	data, err := io.ReadAll(io.LimitReader(f, maxProcFile+1))
	if err != nil {
		return "", fmt.Errorf("read %s: %w", name, err)
	}
	if len(data) > maxProcFile {
		return "", fmt.Errorf("%s is larger than %d bytes", name, maxProcFile)
	}
	return string(data), nil
}

// parseInformation reads one /proc/driver/nvidia/gpus/<bus>/information file:
// "Key: value" lines, of which Model, GPU UUID, Device Minor, Bus Location
// and GPU Excluded are used.
func parseInformation(data string) (procGPU, error) {
	return parseInfo(data, false)
}

// parseInfo is parseInformation that, with unknownUUID, reads a UUID the
// driver does not know yet as uuidUnknown rather than as an error.
func parseInfo(data string, unknownUUID bool) (procGPU, error) {
	var g procGPU
	var hasUUID, hasMinor bool
	sc := bufio.NewScanner(strings.NewReader(data))
	for sc.Scan() {
		key, value, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		value = strings.TrimSpace(value)
		switch strings.TrimSpace(key) {
		case "Model":
			g.Model = value
		case "GPU UUID":
			if strings.Contains(value, "?") && unknownUUID {
				g.uuidUnknown, hasUUID = true, true
				continue
			}
			if strings.Contains(value, "?") {
				return g, fmt.Errorf("GPU UUID %q is not known yet (the driver fills it in once the GPU is initialised: enable persistence mode, or use source \"nvml\")", value)
			}
			if !gpuid.IsGPUUUID(value) {
				return g, fmt.Errorf("GPU UUID %q is not of the form GPU-<uuid>", value)
			}
			g.UUID, hasUUID = value, true
		case "Device Minor":
			n, ok, big := decimal(value)
			if !ok || big || n > gpuid.MaxGPUMinor {
				return g, fmt.Errorf("device minor %q is not a number in 0-%d", value, gpuid.MaxGPUMinor)
			}
			g.Minor, hasMinor = n, true
		case "Bus Location":
			g.BusID = value
		case "GPU Excluded":
			g.excluded = strings.EqualFold(value, "yes")
		}
	}
	if err := sc.Err(); err != nil {
		return g, err
	}
	if !hasUUID || !hasMinor {
		return g, errors.New("no \"GPU UUID\" or \"Device Minor\" line")
	}
	return g, nil
}
