// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/gpuid"
)

// idError is a device id the inventory cannot resolve. It wraps
// ErrUnknownDevice or ErrInvalidID and always quotes the token.
type idError struct {
	sentinel error
	token    string
	detail   string
	// strict errors are refused even under policy.unknown_device = "ignore":
	// they are not stale ids but ambiguous, malformed or evasive ones. Only
	// a well-formed id that names no device of this host (ErrUnknownDevice)
	// may be ignored: NVIDIA's runtime reads ids more loosely than their
	// forms say (strtoumax takes "-0" and " 3" for indices, sscanf stops
	// reading a bus id before its function), so an id the resolver cannot
	// read may still select a GPU there.
	strict bool
	// advises: detail says what to do about the id (see Advises).
	advises bool
	// mig: the id has a MIG instance's form (<gpu>:<mig>, MIG-<uuid>, the
	// legacy MIG-GPU-<uuid>/<gi>/<ci>) and names no listed instance;
	// migParent is the entry position, plus one, of the listed GPU it
	// names as the parent (0: it names none, as a MIG UUID does). An
	// inventory that cannot list MIG instances needs both (see
	// builder.missing).
	mig       bool
	migParent int
}

func (e *idError) Error() string { return e.sentinel.Error() + " " + quoteToken(e.token) + e.detail }
func (e *idError) Unwrap() error { return e.sentinel }

// maxQuoted bounds how much of an untrusted token an error or note repeats.
const maxQuoted = 128

// quoteToken quotes an untrusted token for a message: Go-escaped, so control
// characters and quotes cannot forge log lines, and clipped to maxQuoted bytes.
func quoteToken(s string) string {
	if len(s) <= maxQuoted {
		return strconv.Quote(s)
	}
	n := maxQuoted
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return strconv.Quote(s[:n]) + "…"
}

// plainText renders an untrusted name (annotation key, path) raw when it is
// short printable ASCII without spaces or quotes, and quoted otherwise.
func plainText(s string) string {
	if len(s) == 0 || len(s) > maxQuoted {
		return quoteToken(s)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c >= 0x7f || c == '"' || c == '\\' {
			return quoteToken(s)
		}
	}
	return s
}

const idForms = "want an index (0), <gpu>:<mig> (1:0), GPU-<uuid>, MIG-<uuid>, MIG-GPU-<uuid>/<gi>/<ci> or a PCI bus id"

func (ix *index) unknown(tok string) *idError {
	return &idError{sentinel: ErrUnknownDevice, token: tok, detail: " (" + ix.known + ")"}
}

// invalid reports a malformed id; it is strict (see idError).
func invalid(tok, why string) *idError {
	return &idError{sentinel: ErrInvalidID, token: tok, detail: ": " + why, strict: true}
}

// advising marks e as saying, in its detail, what to do instead.
func (e *idError) advising() *idError {
	e.advises = true
	return e
}

// decimal parses a non-negative decimal made of digits only (leading zeros
// allowed, as the runtime's strtoumax allows them). ok is false for anything
// else; big is true when it is digits but too long to be an index.
func decimal(s string) (n int, ok, big bool) {
	if s == "" {
		return 0, false, false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, false, false
		}
	}
	t := strings.TrimLeft(s, "0")
	if len(t) > 9 {
		return 0, true, true
	}
	if t == "" {
		return 0, true, false
	}
	v, err := strconv.Atoi(t)
	if err != nil {
		return 0, true, true
	}
	return v, true, false
}

func hasPrefixFold(s, prefix string) bool {
	return len(s) >= len(prefix) && strings.EqualFold(s[:len(prefix)], prefix)
}

// resolveID resolves one NVIDIA_VISIBLE_DEVICES-style id to an entry
// position. The forms are those the NVIDIA runtime accepts: an NVML index
// (with an optional '+', as strtoumax reads it), <gpu>:<mig>, a GPU UUID or a
// unique case-insensitive prefix of one, a MIG UUID, the legacy
// MIG-GPU-<uuid>/<gi>/<ci>, and a PCI bus id (any function: the runtime
// takes the GPU at function 0 of that device). Anything else is a strict
// ErrInvalidID.
func (ix *index) resolveID(tok string) (int, *idError) {
	if n, ok, big := decimal(strings.TrimPrefix(tok, "+")); ok {
		if big {
			return 0, ix.unknown(tok)
		}
		if pos, found := ix.byIndex[strconv.Itoa(n)]; found {
			return pos, nil
		}
		return 0, ix.unknown(tok)
	}
	if g, m, ok := strings.Cut(tok, ":"); ok {
		gi, okG, bigG := decimal(g)
		mi, okM, bigM := decimal(m)
		if okG && okM {
			if bigG || bigM {
				return 0, ix.unknown(tok)
			}
			if pos, found := ix.byIndex[strconv.Itoa(gi)+":"+strconv.Itoa(mi)]; found {
				return pos, nil
			}
			return 0, ix.unknownMIG(tok, strconv.Itoa(gi))
		}
	}
	switch {
	case hasPrefixFold(tok, "MIG-GPU-"):
		return ix.resolveLegacyMIG(tok)
	case hasPrefixFold(tok, "GPU-") && len(tok) > len("GPU-"):
		return ix.resolveGPUUUID(tok)
	case hasPrefixFold(tok, "MIG-") && len(tok) > len("MIG-"):
		if pos, found := ix.byFold[strings.ToLower(tok)]; found {
			return pos, nil
		}
		return 0, ix.unknownMIG(tok, "")
	}
	if bus, ok := NormaliseBusID(tok); ok {
		if pos, found := ix.byBus[bus]; found {
			return pos, nil
		}
		// The runtime reads domain, bus and device only, and selects the
		// GPU at function 0 of that address: 0000:1b:00.1 is the GPU at
		// 0000:1b:00.0.
		if pos, found := ix.byBus[bus[:len(bus)-1]+"0"]; found {
			return pos, nil
		}
		// A bus id of no GPU is no stale id the policy may ignore: the
		// runtime then tries it as an index and as <gpu>:<mig> with
		// sscanf("%u:%u"), which reads the leading digits of domain and
		// bus, so 0001:02:00.0 selects MIG 1:2. Telling the harmless ones
		// apart would copy that loose parse exactly; refusing them all
		// costs a stale bus id an error.
		e := ix.unknown(tok)
		e.strict = true
		e.detail += ": no GPU of this host has this PCI bus id"
		if g, m, ok := busIDAsMIG(tok); ok {
			e.detail += fmt.Sprintf(", and NVIDIA's runtime then reads it as MIG %d:%d", g, m)
		} else {
			e.detail += ", and NVIDIA's runtime then reads it as other forms of id"
		}
		return 0, e
	}
	return 0, invalid(tok, idForms)
}

// busIDAsMIG reads a PCI bus id as NVIDIA's runtime's sscanf("%u:%u")
// does: the decimal digits that start the domain, a colon, the decimal
// digits that start the bus. It serves the error message only.
func busIDAsMIG(tok string) (gpu, mig int, ok bool) {
	dom, bus, _ := strings.Cut(tok, ":")
	n := 0
	for n < len(bus) && bus[n] >= '0' && bus[n] <= '9' {
		n++
	}
	g, okG, bigG := decimal(dom)
	m, okM, bigM := decimal(bus[:n])
	if !okG || !okM || bigG || bigM {
		return 0, 0, false
	}
	return g, m, true
}

// unknownMIG reports an id of a MIG instance's form that names no listed
// instance; parentIndex is the index of the GPU it names as the parent,
// "" when it names none. One whose parent is no GPU of this host is a plain
// unknown id: that GPU has no MIG instance either.
func (ix *index) unknownMIG(tok, parentIndex string) *idError {
	e := ix.unknown(tok)
	if parentIndex == "" {
		e.mig = true
		return e
	}
	if pos, found := ix.byIndex[parentIndex]; found {
		e.mig, e.migParent = true, pos+1
	}
	return e
}

// resolveGPUUUID matches a full GPU UUID, then a unique prefix of one: the
// NVIDIA runtime selects a GPU whose UUID starts with the given text, so a
// prefix reaches a real GPU and must be claimed as one.
func (ix *index) resolveGPUUUID(tok string) (int, *idError) {
	fold := strings.ToLower(tok)
	if pos, found := ix.byFold[fold]; found && ix.ents[pos].dev.Kind == KindGPU {
		return pos, nil
	}
	match := -1
	for _, pos := range ix.gpuEnts {
		if strings.HasPrefix(strings.ToLower(ix.ents[pos].dev.UUID), fold) {
			if match >= 0 {
				return 0, &idError{sentinel: ErrInvalidID, token: tok, strict: true,
					detail: fmt.Sprintf(": ambiguous UUID prefix, it matches GPU %s (%s) and GPU %s (%s); give the full UUID",
						ix.ents[match].dev.Index, ix.ents[match].dev.UUID, ix.ents[pos].dev.Index, ix.ents[pos].dev.UUID)}
			}
			match = pos
		}
	}
	if match >= 0 {
		return match, nil
	}
	return 0, ix.unknown(tok)
}

// resolveLegacyMIG resolves MIG-GPU-<uuid>/<gi>/<ci>: first as a UUID (drivers
// before R470 used this as the MIG device's UUID), then by GPU, GPU instance
// and compute instance.
func (ix *index) resolveLegacyMIG(tok string) (int, *idError) {
	if pos, found := ix.byFold[strings.ToLower(tok)]; found {
		return pos, nil
	}
	gpu, gi, ci, ok := parseLegacyMIG(tok)
	if !ok {
		return 0, invalid(tok, "want MIG-GPU-<uuid>/<gi>/<ci>")
	}
	parent, found := ix.byFold[strings.ToLower(gpu)]
	if !found || ix.ents[parent].dev.Kind != KindGPU {
		return 0, ix.unknown(tok)
	}
	if pos, found := ix.byGICI[giciKey{parent: parent, gi: gi, ci: ci}]; found {
		return pos, nil
	}
	e := ix.unknown(tok)
	e.mig, e.migParent = true, parent+1
	return 0, e
}

// parseLegacyMIG splits MIG-GPU-<uuid>/<gi>/<ci> into "GPU-<uuid>", gi, ci.
func parseLegacyMIG(s string) (gpu string, gi, ci int, ok bool) {
	if !hasPrefixFold(s, "MIG-GPU-") {
		return "", 0, 0, false
	}
	parts := strings.Split(s[len("MIG-"):], "/")
	if len(parts) != 3 || len(parts[0]) <= len("GPU-") {
		return "", 0, 0, false
	}
	gi, okG, bigG := decimal(parts[1])
	ci, okC, bigC := decimal(parts[2])
	if !okG || !okC || bigG || bigC {
		return "", 0, 0, false
	}
	return parts[0], gi, ci, true
}

func isLegacyMIGUUID(s string) bool {
	gpu, _, _, ok := parseLegacyMIG(s)
	return ok && strings.HasPrefix(s, "MIG-") && gpuid.IsGPUUUID(gpu)
}

// CDI vendors and classes whose devices are NVIDIA GPUs: the toolkit's
// nvidia.com specs, and the k8s device plugin's own specs (cdi-annotations
// and cdi-cri strategies), which name each allocated GPU by UUID or index.
const (
	cdiVendor             = "nvidia.com"
	cdiVendorDevicePlugin = "k8s.device-plugin.nvidia.com"
	// cdiVendorRuntime: NVIDIA's runtime generates a CDI spec for
	// runtime.nvidia.com/gpu=<id|all> on the fly.
	cdiVendorRuntime = "runtime.nvidia.com"
	// cdiVendorManagement: the GPU Operator's management spec
	// (nvidia-ctk cdi generate --mode=management) has one device,
	// management.nvidia.com/gpu=all, that injects every /dev/nvidia* node
	// and every nvidia-caps node: it opens every GPU.
	cdiVendorManagement = "management.nvidia.com"
	cdiClassGPU         = "gpu"
	cdiClassMIG         = "mig"
)

// parseQualifiedName splits a CDI device name "vendor/class=name".
func parseQualifiedName(s string) (vendor, class, name string, ok bool) {
	vc, name, ok := strings.Cut(s, "=")
	if !ok || name == "" {
		return "", "", "", false
	}
	vendor, class, ok = strings.Cut(vc, "/")
	if !ok || vendor == "" || class == "" || strings.ContainsAny(class, "/") {
		return "", "", "", false
	}
	return vendor, class, name, true
}

// isGPUClass reports whether a qualified CDI name is one of NVIDIA's GPU or
// MIG devices. Other vendors' and other NVIDIA classes' devices (the device
// plugin's gdrcopy and mofed, imex channels) are not GPU allocations;
// management.nvidia.com devices open every GPU (see cdiName).
// nvidiaVendor reports whether a CDI vendor is NVIDIA's domain or one of
// its subdomains (k8s.gpu.nvidia.com, the DRA driver's), whose specs may hold
// GPU device nodes under any class.
func nvidiaVendor(vendor string) bool {
	return vendor == "nvidia.com" || strings.HasSuffix(vendor, ".nvidia.com")
}

func isGPUClass(vendor, class string) bool {
	return (vendor == cdiVendor || vendor == cdiVendorDevicePlugin || vendor == cdiVendorRuntime) && (class == cdiClassGPU || class == cdiClassMIG)
}

// namesGPUs reports whether an NVIDIA CDI name the guard cannot resolve may
// denote GPUs: the DRA driver's (k8s.gpu.nvidia.com/device=gpu-0), or a
// class that says gpu or mig under another vendor of NVIDIA's. NVIDIA's
// names for other devices (the Network Operator's nvidia.com/net-pci, IMEX
// channels, the device plugin's gdrcopy, gds and mofed, which its
// cdi-annotations strategy names next to the GPUs it allocates) hold no GPU
// device node.
func namesGPUs(vendor, class string) bool {
	v, c := strings.ToLower(vendor), strings.ToLower(class)
	return strings.Contains(v, "gpu") || strings.Contains(c, "gpu") || strings.Contains(c, "mig")
}

const cdiForms = "want a CDI device name of nvidia.com/gpu: an index (0), <gpu>:<mig> (1:0), gpu<N>, mig<G>:<M>, a UUID or all"

// resolveCDIName resolves the name part of nvidia.com/gpu=<name> (or
// nvidia.com/mig=<name>) as the NVIDIA CDI spec generator names devices: by
// index ("0", "1:0"), by type and index ("gpu0", "mig1:0"), by UUID, or "all".
// CDI names are matched exactly (no prefixes): the CDI registry does so too.
func (ix *index) resolveCDIName(name string) (pos int, all bool, err *idError) {
	if name == "all" {
		return 0, true, nil
	}
	id := name
	switch {
	case strings.HasPrefix(name, "gpu"):
		id = name[len("gpu"):]
		if _, ok, _ := decimal(id); !ok {
			return 0, false, invalid(name, cdiForms)
		}
	case strings.HasPrefix(name, "mig"):
		id = name[len("mig"):]
		g, m, ok := strings.Cut(id, ":")
		_, okG, _ := decimal(g)
		_, okM, _ := decimal(m)
		if !ok || !okG || !okM {
			return 0, false, invalid(name, cdiForms)
		}
	}
	if _, ok, _ := decimal(id); ok {
		p, e := ix.resolveID(id)
		return p, false, reToken(e, name)
	}
	if g, m, ok := strings.Cut(id, ":"); ok {
		_, okG, _ := decimal(g)
		_, okM, _ := decimal(m)
		if okG && okM {
			p, e := ix.resolveID(id)
			return p, false, reToken(e, name)
		}
	}
	if gpuid.IsGPUUUID(id) || gpuid.IsMIGUUID(id) {
		if p, found := ix.byFold[strings.ToLower(id)]; found {
			return p, false, nil
		}
		if gpuid.IsMIGUUID(id) {
			return 0, false, ix.unknownMIG(name, "")
		}
		return 0, false, ix.unknown(name)
	}
	return 0, false, invalid(name, cdiForms)
}

// reToken makes an id error name the token as the container wrote it.
func reToken(e *idError, tok string) *idError {
	if e != nil {
		e.token = tok
	}
	return e
}
