// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/gpuid"
)

// ErrInvalidInventory is wrapped by every error NewInventory (and so
// json.Unmarshal and LoadCache) returns for an inconsistent device list.
var ErrInvalidInventory = errors.New("invalid GPU inventory")

// nvidiaMajor is the character-device major of /dev/nvidia<N>, nvidiactl and
// nvidia-modeset.
const nvidiaMajor = 195

// entry is one device of the inventory with what the resolver needs to reach
// it in O(1).
type entry struct {
	dev Device
	// gpu is the position in Inventory.GPUs of the GPU itself or of a MIG
	// instance's parent.
	gpu int
	// parent is the entry position of a MIG instance's parent; -1 for a GPU.
	parent int
	gi, ci int
}

type giciKey struct {
	parent int // entry position of the parent GPU
	gi, ci int
}

type giKey struct {
	parent int
	gi     int
}

// index is the immutable lookup structure behind an Inventory.
type index struct {
	ents    []entry        // in Devices() order: GPU, its MIGs by index, next GPU
	gpuEnts []int          // entry positions of the full GPUs
	byUUID  map[string]int // exact UUID
	byFold  map[string]int // lower-cased UUID: the runtime matches UUIDs case-insensitively
	byIndex map[string]int // "1", "1:0"
	byMinor map[int]int    // GPU minor number → GPU entry
	byBus   map[string]int // normalised PCI bus id → GPU entry
	byGICI  map[giciKey]int
	byGI    map[giKey][]int
	migsOf  map[int][]int // GPU entry → its MIG entries
	caps    map[int]MIGCap
	// known and knownMinors summarise the inventory for "unknown id" errors;
	// built once so that resolution does not format them per request.
	known       string
	knownMinors string
}

// NewInventory validates gpus and returns an immutable inventory over a copy
// of them, sorted by index. It rejects duplicate UUIDs, indices and minor
// numbers, minors outside 0-253, and MIG instances that do not belong to
// their GPU.
func NewInventory(source string, gpus []GPU) (*Inventory, error) {
	return newInventory(Inventory{Source: source, GPUs: gpus})
}

// newInventory validates and indexes a copy of in (all exported fields).
func newInventory(in Inventory) (*Inventory, error) {
	inv := &Inventory{
		Source:       in.Source,
		GPUs:         cloneGPUs(in.GPUs),
		Notes:        append([]string(nil), in.Notes...),
		CapsMajor:    in.CapsMajor,
		MIGCaps:      append([]MIGCap(nil), in.MIGCaps...),
		UnlistedGPUs: in.UnlistedGPUs,
		Undiscovered: in.Undiscovered,
		Unchecked:    in.Unchecked,
		// Contradiction is the daemon's, set on an undiscovered
		// inventory only.
		Contradiction: in.Contradiction,
	}
	if strings.TrimSpace(inv.Source) == "" {
		return nil, fmt.Errorf("%w: no source named", ErrInvalidInventory)
	}
	if inv.UnlistedGPUs < 0 || (inv.UnlistedGPUs > 0 && len(inv.GPUs) > 0) {
		return nil, fmt.Errorf("%w: %d unlisted GPUs next to %d listed ones", ErrInvalidInventory, inv.UnlistedGPUs, len(inv.GPUs))
	}
	if inv.Undiscovered && (len(inv.GPUs) > 0 || inv.UnlistedGPUs > 0) {
		return nil, fmt.Errorf("%w: an undiscovered inventory lists %d GPUs (%d unlisted)", ErrInvalidInventory, len(inv.GPUs), inv.UnlistedGPUs)
	}
	switch inv.Unchecked {
	case "", UncheckedNoDriver, UncheckedUUIDs:
	default:
		return nil, fmt.Errorf("%w: unchecked %q: want %q or %q", ErrInvalidInventory, inv.Unchecked, UncheckedNoDriver, UncheckedUUIDs)
	}
	if inv.Unchecked != "" && inv.Source != string(config.SourceStatic) {
		return nil, fmt.Errorf("%w: an inventory from %s is marked unchecked (only a static list is)", ErrInvalidInventory, inv.Source)
	}
	if inv.Contradiction != "" && !inv.Undiscovered {
		return nil, fmt.Errorf("%w: a contradiction on an inventory that is not undiscovered", ErrInvalidInventory)
	}
	if inv.CapsMajor < 0 {
		return nil, fmt.Errorf("%w: negative nvidia-caps major %d", ErrInvalidInventory, inv.CapsMajor)
	}
	sort.SliceStable(inv.GPUs, func(i, j int) bool { return inv.GPUs[i].Index < inv.GPUs[j].Index })
	idx, err := buildIndex(inv)
	if err != nil {
		return nil, err
	}
	inv.idx = idx
	return inv, nil
}

func cloneGPUs(in []GPU) []GPU {
	out := make([]GPU, len(in))
	for i, g := range in {
		out[i] = g
		out[i].MIG = append([]MIG(nil), g.MIG...)
	}
	return out
}

func gpuName(g GPU) string { return fmt.Sprintf("GPU %d (%s)", g.Index, g.UUID) }

// buildIndex validates inv and builds its lookup tables: every GPU, then its
// MIG instances, then the MIG capability nodes.
func buildIndex(inv *Inventory) (*index, error) {
	n := len(inv.GPUs)
	for _, g := range inv.GPUs {
		n += len(g.MIG)
	}
	ix := &index{
		ents:    make([]entry, 0, n),
		byUUID:  make(map[string]int, n),
		byFold:  make(map[string]int, n),
		byIndex: make(map[string]int, n),
		byMinor: make(map[int]int, len(inv.GPUs)),
		byBus:   make(map[string]int, len(inv.GPUs)),
		byGICI:  map[giciKey]int{},
		byGI:    map[giKey][]int{},
		migsOf:  map[int][]int{},
		caps:    map[int]MIGCap{},
	}
	for gi := range inv.GPUs {
		g := &inv.GPUs[gi]
		pos, err := ix.addGPU(inv, gi)
		if err != nil {
			return nil, err
		}
		sort.SliceStable(g.MIG, func(i, j int) bool { return g.MIG[i].Index < g.MIG[j].Index })
		for mi := range g.MIG {
			if err := ix.addMIG(g, gi, pos, &g.MIG[mi]); err != nil {
				return nil, err
			}
		}
	}
	if err := ix.addCaps(inv.MIGCaps); err != nil {
		return nil, err
	}
	ix.known, ix.knownMinors = summarise(inv)
	return ix, nil
}

// addUUID records uuid at pos, refusing a UUID listed twice in any case.
func (ix *index) addUUID(uuid string, pos int) error {
	fold := strings.ToLower(uuid)
	if prev, dup := ix.byFold[fold]; dup {
		return fmt.Errorf("%w: UUID %s is listed twice (index %s and %s)",
			ErrInvalidInventory, uuid, ix.ents[prev].dev.Index, ix.ents[pos].dev.Index)
	}
	ix.byUUID[uuid] = pos
	ix.byFold[fold] = pos
	return nil
}

// addGPU validates full GPU gi of inv and records it; it returns its entry.
func (ix *index) addGPU(inv *Inventory, gi int) (int, error) {
	g := &inv.GPUs[gi]
	if g.Index < 0 {
		return 0, fmt.Errorf("%w: %s: negative index", ErrInvalidInventory, gpuName(*g))
	}
	if !gpuid.IsGPUUUID(g.UUID) {
		return 0, fmt.Errorf("%w: GPU %d: UUID %q is not of the form GPU-<uuid>", ErrInvalidInventory, g.Index, g.UUID)
	}
	if !gpuid.IsGPUMinor(g.Minor) {
		return 0, fmt.Errorf("%w: %s: minor number %d is outside 0-%d", ErrInvalidInventory, gpuName(*g), g.Minor, gpuid.MaxGPUMinor)
	}
	key := strconv.Itoa(g.Index)
	if prev, dup := ix.byIndex[key]; dup {
		return 0, fmt.Errorf("%w: index %d is used by %s and %s", ErrInvalidInventory, g.Index, ix.ents[prev].dev.UUID, g.UUID)
	}
	if prev, dup := ix.byMinor[g.Minor]; dup {
		return 0, fmt.Errorf("%w: minor number %d is used by %s and %s", ErrInvalidInventory, g.Minor,
			gpuName(inv.GPUs[ix.ents[prev].gpu]), gpuName(*g))
	}
	pos := len(ix.ents)
	ix.ents = append(ix.ents, entry{dev: Device{UUID: g.UUID, Index: key, Kind: KindGPU}, gpu: gi, parent: -1})
	if err := ix.addUUID(g.UUID, pos); err != nil {
		return 0, err
	}
	ix.byIndex[key] = pos
	ix.byMinor[g.Minor] = pos
	ix.gpuEnts = append(ix.gpuEnts, pos)
	if g.BusID != "" {
		bus, ok := NormaliseBusID(g.BusID)
		if !ok {
			return 0, fmt.Errorf("%w: %s: PCI bus id %q is not of the form dddd:bb:dd.f", ErrInvalidInventory, gpuName(*g), g.BusID)
		}
		if _, dup := ix.byBus[bus]; dup {
			return 0, fmt.Errorf("%w: %s: PCI bus id %s is listed twice", ErrInvalidInventory, gpuName(*g), bus)
		}
		ix.byBus[bus] = pos
	}
	return pos, nil
}

// addMIG validates MIG instance m of GPU g (inventory position gi, entry pos)
// and records it.
func (ix *index) addMIG(g *GPU, gi, pos int, m *MIG) error {
	if err := checkMIG(*g, m); err != nil {
		return err
	}
	mkey := strconv.Itoa(g.Index) + ":" + strconv.Itoa(m.Index)
	if _, dup := ix.byIndex[mkey]; dup {
		return fmt.Errorf("%w: %s: MIG index %s is listed twice", ErrInvalidInventory, gpuName(*g), mkey)
	}
	gc := giciKey{parent: pos, gi: m.GI, ci: m.CI}
	if prev, dup := ix.byGICI[gc]; dup {
		return fmt.Errorf("%w: %s: GPU instance %d / compute instance %d is listed for both %s and %s",
			ErrInvalidInventory, gpuName(*g), m.GI, m.CI, ix.ents[prev].dev.UUID, m.UUID)
	}
	mpos := len(ix.ents)
	ix.ents = append(ix.ents, entry{
		dev: Device{UUID: m.UUID, Index: mkey, Kind: KindMIG, Parent: g.UUID},
		gpu: gi, parent: pos, gi: m.GI, ci: m.CI,
	})
	if err := ix.addUUID(m.UUID, mpos); err != nil {
		return err
	}
	ix.byIndex[mkey] = mpos
	ix.byGICI[gc] = mpos
	gk := giKey{parent: pos, gi: m.GI}
	ix.byGI[gk] = append(ix.byGI[gk], mpos)
	ix.migsOf[pos] = append(ix.migsOf[pos], mpos)
	return nil
}

// checkMIG validates one MIG instance of g, filling in the parent fields a
// loader may leave empty.
func checkMIG(g GPU, m *MIG) error {
	// Drivers before R470 named MIG devices "MIG-GPU-<uuid>/<gi>/<ci>".
	if !gpuid.IsMIGUUID(m.UUID) && !isLegacyMIGUUID(m.UUID) {
		return fmt.Errorf("%w: %s: MIG %d:%d: UUID %q is not of the form MIG-<uuid>", ErrInvalidInventory, gpuName(g), g.Index, m.Index, m.UUID)
	}
	if m.Index < 0 || m.GI < 0 || m.CI < 0 {
		return fmt.Errorf("%w: %s: MIG %s: negative index, GPU instance or compute instance", ErrInvalidInventory, gpuName(g), m.UUID)
	}
	if m.ParentUUID == "" {
		m.ParentUUID = g.UUID
	}
	if m.ParentUUID != g.UUID {
		return fmt.Errorf("%w: MIG %s is listed under %s but names parent %s", ErrInvalidInventory, m.UUID, gpuName(g), m.ParentUUID)
	}
	if m.ParentIndex != g.Index {
		if m.ParentIndex != 0 {
			return fmt.Errorf("%w: MIG %s is listed under %s but names parent index %d", ErrInvalidInventory, m.UUID, gpuName(g), m.ParentIndex)
		}
		m.ParentIndex = g.Index
	}
	return nil
}

func (ix *index) addCaps(caps []MIGCap) error {
	for _, c := range caps {
		if c.Minor < 0 {
			return fmt.Errorf("%w: nvidia-caps minor %d is negative", ErrInvalidInventory, c.Minor)
		}
		if _, dup := ix.caps[c.Minor]; dup {
			return fmt.Errorf("%w: nvidia-caps minor %d is listed twice", ErrInvalidInventory, c.Minor)
		}
		switch c.Kind {
		case CapConfig, CapMonitor:
		case CapGIAccess, CapCIAccess:
			gpu, ok := ix.byMinor[c.GPUMinor]
			if !ok {
				return fmt.Errorf("%w: nvidia-cap%d names GPU minor %d, which is not in the inventory", ErrInvalidInventory, c.Minor, c.GPUMinor)
			}
			var found bool
			if c.Kind == CapGIAccess {
				_, found = ix.byGI[giKey{parent: gpu, gi: c.GI}]
			} else {
				_, found = ix.byGICI[giciKey{parent: gpu, gi: c.GI, ci: c.CI}]
			}
			if !found {
				return fmt.Errorf("%w: nvidia-cap%d names GPU %s instance gi%d/ci%d, which is not in the inventory",
					ErrInvalidInventory, c.Minor, ix.ents[gpu].dev.Index, c.GI, c.CI)
			}
		default:
			return fmt.Errorf("%w: nvidia-cap%d has unknown kind %q", ErrInvalidInventory, c.Minor, c.Kind)
		}
		ix.caps[c.Minor] = c
	}
	return nil
}

// summarise renders the inventory for "unknown id" messages: index ranges and
// short UUIDs, bounded so an error stays one readable line on a big host.
func summarise(inv *Inventory) (known, minors string) {
	if len(inv.GPUs) == 0 {
		return "known: none (the inventory is empty)", "known minors: none"
	}
	var gpuIdx, minorList []int
	var migs, uuids []string
	for _, g := range inv.GPUs {
		gpuIdx = append(gpuIdx, g.Index)
		minorList = append(minorList, g.Minor)
		uuids = append(uuids, shortUUID(g.UUID))
		for _, m := range g.MIG {
			migs = append(migs, fmt.Sprintf("%d:%d", g.Index, m.Index))
			uuids = append(uuids, shortUUID(m.UUID))
		}
	}
	ids := ranges(gpuIdx)
	if len(migs) > 0 {
		ids += ", " + capList(migs, 8)
	}
	sort.Ints(minorList)
	return "known: " + ids + " / " + capList(uuids, 8), "known minors: " + ranges(minorList)
}

// shortUUID keeps the prefix and the first 8 hex digits: enough to recognise
// a device, short enough to list a whole host.
func shortUUID(u string) string {
	if i := strings.IndexByte(u, '-'); i >= 0 && len(u) > i+9 {
		return u[:i+9] + "…"
	}
	return u
}

func capList(items []string, max int) string {
	if len(items) <= max {
		return strings.Join(items, ", ")
	}
	return strings.Join(items[:max], ", ") + fmt.Sprintf(", … (%d more)", len(items)-max)
}

// ranges renders sorted ints as "0-3, 5".
func ranges(v []int) string {
	var b strings.Builder
	for i := 0; i < len(v); {
		j := i
		for j+1 < len(v) && v[j+1] == v[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteString(", ")
		}
		b.WriteString(strconv.Itoa(v[i]))
		if j > i {
			b.WriteString("-")
			b.WriteString(strconv.Itoa(v[j]))
		}
		i = j + 1
	}
	return b.String()
}

// NormaliseBusID turns a PCI bus id in NVML ("00000000:3B:00.0"), go-nvlib
// ("0000:3b:00.0") or /proc ("0000:3b:00.0") spelling into one canonical
// form "dddd:bb:dd.f" (lower-case hex), the way the NVIDIA runtime compares
// them. It accepts a domain of 1-8 hex digits.
func NormaliseBusID(s string) (string, bool) {
	dom, rest, ok := strings.Cut(s, ":")
	if !ok {
		return "", false
	}
	bus, rest, ok := strings.Cut(rest, ":")
	if !ok {
		return "", false
	}
	dev, fn, ok := strings.Cut(rest, ".")
	if !ok {
		return "", false
	}
	d, ok1 := parseHex(dom, 8)
	b, ok2 := parseHex(bus, 2)
	v, ok3 := parseHex(dev, 2)
	f, ok4 := parseHex(fn, 1)
	if !ok1 || !ok2 || !ok3 || !ok4 || v > 0x1f || f > 7 {
		return "", false
	}
	return fmt.Sprintf("%04x:%02x:%02x.%x", d, b, v, f), true
}

func isHex(c byte) bool {
	return ('0' <= c && c <= '9') || ('a' <= c && c <= 'f') || ('A' <= c && c <= 'F')
}

func parseHex(s string, maxDigits int) (uint64, bool) {
	if s == "" || len(s) > maxDigits {
		return 0, false
	}
	for i := 0; i < len(s); i++ {
		if !isHex(s[i]) {
			return 0, false
		}
	}
	v, err := strconv.ParseUint(s, 16, 64)
	return v, err == nil
}

// Devices returns every GPU and MIG instance ordered by index: GPU 0, its MIG
// instances 0:0, 0:1…, then GPU 1, and so on.
func (inv *Inventory) Devices() []Device {
	if inv == nil || inv.idx == nil {
		return nil
	}
	out := make([]Device, len(inv.idx.ents))
	for i, e := range inv.idx.ents {
		out[i] = e.dev
	}
	return out
}

// Lookup finds a GPU or MIG instance by UUID. The match is exact first, then
// case-insensitive, as the NVIDIA runtime compares UUIDs.
func (inv *Inventory) Lookup(uuid string) (Device, bool) {
	pos, ok := inv.lookupPos(uuid)
	if !ok {
		return Device{}, false
	}
	return inv.idx.ents[pos].dev, true
}

func (inv *Inventory) lookupPos(uuid string) (int, bool) {
	if inv == nil || inv.idx == nil {
		return 0, false
	}
	if pos, ok := inv.idx.byUUID[uuid]; ok {
		return pos, true
	}
	pos, ok := inv.idx.byFold[strings.ToLower(uuid)]
	return pos, ok
}

// ByIndex finds a GPU by its NVML index ("1") or a MIG instance by
// "<gpu index>:<mig index>" ("1:0"). Only canonical decimal spellings match.
func (inv *Inventory) ByIndex(index string) (Device, bool) {
	if inv == nil || inv.idx == nil {
		return Device{}, false
	}
	pos, ok := inv.idx.byIndex[index]
	if !ok {
		return Device{}, false
	}
	return inv.idx.ents[pos].dev, true
}

// ByMinor finds the GPU whose device node is /dev/nvidia<minor>. The minor
// number is NVML's, which need not equal the index.
func (inv *Inventory) ByMinor(minor int) (Device, bool) {
	if inv == nil || inv.idx == nil {
		return Device{}, false
	}
	pos, ok := inv.idx.byMinor[minor]
	if !ok {
		return Device{}, false
	}
	return inv.idx.ents[pos].dev, true
}

// GPUOf returns the physical GPU that uuid is, or that the MIG instance uuid
// belongs to. The result is a copy.
func (inv *Inventory) GPUOf(uuid string) (GPU, bool) {
	pos, ok := inv.lookupPos(uuid)
	if !ok {
		return GPU{}, false
	}
	g := inv.GPUs[inv.idx.ents[pos].gpu]
	g.MIG = append([]MIG(nil), g.MIG...)
	return g, true
}

// Describe renders a device for messages: "GPU 1 (GPU-…)" or
// "MIG 1:0 (MIG-…) of GPU 1". An unknown UUID is rendered as itself.
func (inv *Inventory) Describe(uuid string) string {
	pos, ok := inv.lookupPos(uuid)
	if !ok {
		return uuid
	}
	e := inv.idx.ents[pos]
	if e.dev.Kind == KindMIG {
		return fmt.Sprintf("MIG %s (%s) of GPU %s", e.dev.Index, e.dev.UUID, inv.idx.ents[e.parent].dev.Index)
	}
	return fmt.Sprintf("GPU %s (%s)", e.dev.Index, e.dev.UUID)
}

// UnmarshalJSON decodes an inventory and validates it and rebuilds its
// indexes, exactly as NewInventory does.
func (inv *Inventory) UnmarshalJSON(data []byte) error {
	// plain has Inventory's fields but not its methods, so decoding into it
	// does not recurse.
	type plain Inventory
	var p plain
	if err := json.Unmarshal(data, &p); err != nil {
		return fmt.Errorf("decode inventory: %w", err)
	}
	built, err := newInventory(Inventory(p))
	if err != nil {
		return err
	}
	*inv = *built
	return nil
}
