// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"math"
	"slices"
	"strings"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/gpuid"
)

// DeviceRule is one device cgroup rule of a container (the OCI spec's
// linux.resources.devices, NRI's LinuxDeviceCgroup). A nil Major or Minor,
// or a negative one, is the wildcard; one that does not fit a C int is
// read as each runtime reads it (crun truncates it: see ruleAccess).
type DeviceRule struct {
	Allow  bool
	Type   string // "a", "c", "b" or "" (all)
	Major  *int64
	Minor  *int64
	Access string // "r", "w", "m" combined; "" is rwm in an allow, nothing in a deny (see ruleBits)
}

// wildcardType reports whether a rule is of type "a" (all devices), which
// runc also makes of a rule without a type. The kernel's device cgroup (and
// runc's emulation of it for cgroup v2) reads nothing else of such a rule:
// "a 1:3 r" allows every device for reading, writing and mknod exactly as
// "a *:* rwm" does (and denies it all, as a deny). Its major, minor and
// access must not be read as narrowing it.
func wildcardType(r DeviceRule) bool { return r.Type == "" || r.Type == "a" }

// AllowsAllDevices reports whether the rules end up allowing every device
// for reading, writing and mknod: what a privileged container gets
// (containerd and podman give it a single "allow all, rwm" rule, an
// unprivileged one "deny all" followed by specific allows). The last rule of
// type "a" decides, as in the kernel's device cgroup, whatever major, minor
// or access it names.
func AllowsAllDevices(rules []DeviceRule) bool {
	all := false
	for _, r := range rules {
		if wildcardType(r) {
			all = r.Allow
		}
	}
	return all
}

// ApplyDeviceRules records on req what the container's device cgroup rules
// let it open, beyond the device nodes its spec lists. A node can reach a
// container other ways than linux.devices (mknod with CAP_MKNOD, a bind
// mount of the host's /dev), and then the device cgroup is what decides
// whether the container can open it. So a rule that lets the container read
// or write a GPU node is a request for that GPU, whether or not the node is
// listed: one for NVIDIA's major with any minor (or for any major) sets
// GPUNodesAllowed, which the resolver treats as privileged device access;
// one for a single GPU minor adds that node to Devices, as if listed.
// Call it after Devices is filled.
//
// The rules that can reach a node of the host's nvidia-caps major (a major
// of the kernel's dynamic range, which only the inventory knows) are kept on
// req in order (DynamicMajorRules) for the resolver: those of type "c" for a
// dynamic major or for no major (c *:<minor> covers every major), and those
// of type "a", which reset what came before. A rule that lets the container
// open every MIG capability node makes its parent GPU nodes reach every MIG
// instance.
func (req *Request) ApplyDeviceRules(rules []DeviceRule) {
	req.AllDevicesAllowed = AllowsAllDevices(rules)
	all, minors := gpuNodeAccess(rules)
	req.GPUNodesAllowed = all
	req.DynamicMajorRules, req.ManyDynamicMajorRules = nil, false
	for _, r := range rules {
		if r.Type == "b" || (!wildcardType(r) && wildcard(r.Major) >= 0 && *r.Major < firstDynamicMajor) {
			continue
		}
		if len(req.DynamicMajorRules) == maxDynamicMajorRules {
			req.ManyDynamicMajorRules = true
			break
		}
		req.DynamicMajorRules = append(req.DynamicMajorRules, r)
	}
	for _, m := range minors {
		listed := false
		for _, d := range req.Devices {
			if maj, min, _ := nodeNumbers(d); maj == nvidiaMajor && min == m {
				listed = true
				break
			}
		}
		if !listed {
			req.Devices = append(req.Devices, LinuxDevice{Path: cgroupRuleNode, Type: "c", Major: nvidiaMajor, Minor: m})
		}
	}
}

// gpuNodeAccess reports whether the rules let the container read or write
// every GPU node (all) or which GPU minors (see ruleAccess).
func gpuNodeAccess(rules []DeviceRule) (all bool, minors []int64) {
	return ruleAccess(rules, nvidiaMajor, gpuid.MaxGPUMinor)
}

// Access bits of a device cgroup rule.
const (
	accRead uint8 = 1 << iota
	accWrite
	accMknod
	accOpen = accRead | accWrite
)

// ruleBits returns the access a rule names. An empty access is read as rwm
// in an allow and as nothing in a deny: the kernel and the runtimes do not
// agree on it, and the reading that leaves more reachable is the safe one.
func ruleBits(r DeviceRule) uint8 {
	if r.Access == "" {
		if r.Allow {
			return accOpen | accMknod
		}
		return 0
	}
	var b uint8
	for _, c := range r.Access {
		switch c {
		case 'r':
			b |= accRead
		case 'w':
			b |= accWrite
		case 'm':
			b |= accMknod
		}
	}
	return b
}

// wildcard returns a rule's major or minor, -1 for the wildcard.
func wildcard(n *int64) int64 {
	if n == nil || *n < 0 {
		return -1
	}
	return *n
}

// numberReading is how a runtime reads a rule's major or minor: the number
// it matches a node's against, -1 for the wildcard. The spec's numbers are
// int64, the runtimes' are not, and a number none of them expects can mean
// a different node to each.
type numberReading func(n *int64) int64

// asWritten reads a number as the spec writes it, negative meaning the
// wildcard: runc on either cgroup version (which refuses a number past
// 4294967295, and whose eBPF program matches nothing for one from
// 2147483648 on), and crun for numbers that fit a C int.
func asWritten(n *int64) int64 { return wildcard(n) }

// asKernelU32 reads a number as the kernel's device cgroup (v1) does when
// crun writes it to devices.allow or devices.deny as written: a u32, where
// 4294967295 is the kernel's own wildcard, so c 4294967295:* rwm is
// c *:* rwm. (runc writes it too, but fails the container when the kernel
// reads back another rule; a number the kernel cannot take fails the
// container under both.)
func asKernelU32(n *int64) int64 {
	if n != nil && *n == math.MaxUint32 {
		return -1
	}
	return wildcard(n)
}

// asCInt reads a number as crun does for its eBPF program (cgroup v2): it
// copies the spec's int64 into a C int, which keeps the low 32 bits, and
// reads a negative result as the wildcard. So 4294967295 and everything
// from 2147483648 to 4294967295 are the wildcard, and 4294967491 is 195:
// c 4294967491:* rwm is c 195:* rwm.
func asCInt(n *int64) int64 {
	if n == nil {
		return -1
	}
	if v := int64(int32(*n)); v >= 0 { //nolint:gosec // the truncation is what crun does
		return v
	}
	return -1
}

// fitsCInt reports whether every reading of the rules' numbers is the
// number as written: each is absent or fits a C int (no negative number
// that fits one reads as anything but the wildcard).
func fitsCInt(rules []DeviceRule) bool {
	for _, r := range rules {
		for _, n := range [2]*int64{r.Major, r.Minor} {
			if n != nil && int64(int32(*n)) != *n { //nolint:gosec // comparing with the truncation
				return false
			}
		}
	}
	return true
}

// ruleAccess reports whether the rules let the container read or write
// every character node of major (all: any minor that no rule names), or
// which of the minors the rules name, up to maxMinor. A node counts when it
// can be opened for reading or for writing under any way a runtime applies
// the rules (when in doubt, it is reachable):
//
//   - the kernel's device cgroup (v1), which runc also emulates for v2
//     (kernelAccess), with the numbers as written and, as crun writes them
//     to the kernel, as the kernel reads them (asKernelU32);
//   - crun's eBPF program (v2; crunAccess), with the numbers as written and
//     as crun truncates them (asCInt).
//
// The readings differ only for numbers that do not fit a C int, which no
// device has: a rule that uses one to reach GPU nodes under one runtime
// while looking like another device's under the others is read as each
// would apply it.
func ruleAccess(rules []DeviceRule, major, maxMinor int64) (all bool, minors []int64) {
	type model struct {
		access func([]DeviceRule, int64, int64, numberReading) (bool, []int64)
		read   numberReading
	}
	models := []model{{kernelAccess, asWritten}, {crunAccess, asWritten}}
	if !fitsCInt(rules) {
		models = append(models, model{kernelAccess, asKernelU32}, model{crunAccess, asCInt})
	}
	for _, m := range models {
		a, ms := m.access(rules, major, maxMinor, m.read)
		if a {
			return true, nil
		}
		minors = append(minors, ms...)
	}
	slices.Sort(minors)
	return false, slices.Compact(minors)
}

// kernelAccess is ruleAccess under the kernel's device cgroup (v1), which
// runc also emulates for v2: a rule of type "a" resets the default to allow
// or deny and drops every exception, whatever numbers or access it names
// (see wildcardType); any other rule adds its access bits to the exception
// with exactly its type, major and minor (as read) when it goes against the
// default, and takes them from that exception only otherwise (a deny of
// c 195:* r leaves c 195:* w, and does not touch c 195:0). Under a deny
// default a node opens for an access one of its matching exceptions
// (c M:m, c M:*, c *:m, c *:*) holds; under an allow default, unless one
// holds it. A rule that grants only mknod ("m") opens nothing.
func kernelAccess(rules []DeviceRule, major, maxMinor int64, read numberReading) (all bool, minors []int64) {
	type key struct{ major, minor int64 } // -1: wildcard
	var (
		defaultAllow bool
		exceptions   = map[key]uint8{}
	)
	for _, r := range rules {
		if wildcardType(r) {
			defaultAllow = r.Allow
			clear(exceptions)
			continue
		}
		maj, mnr := read(r.Major), read(r.Minor)
		if r.Type != "c" || (maj >= 0 && maj != major) || mnr > maxMinor {
			continue // no exception that can match a node here
		}
		k, bits := key{maj, mnr}, ruleBits(r)
		if r.Allow != defaultAllow {
			exceptions[k] |= bits
			continue
		}
		if exceptions[k] &^= bits; exceptions[k] == 0 {
			delete(exceptions, k)
		}
	}
	reachable := func(m int64) bool {
		// The access bits of every exception that matches the node
		// (allowed ones under a deny default, denied ones under an allow
		// default).
		held := exceptions[key{major, -1}] | exceptions[key{-1, -1}]
		if m >= 0 {
			held |= exceptions[key{major, m}] | exceptions[key{-1, m}]
		}
		if defaultAllow {
			return held&accRead == 0 || held&accWrite == 0
		}
		return held&accOpen != 0
	}
	if reachable(-1) {
		return true, nil
	}
	for k := range exceptions {
		if k.minor >= 0 && reachable(k.minor) {
			minors = append(minors, k.minor)
		}
	}
	return false, minors
}

// crunAccess is ruleAccess under crun's eBPF program (v2): the last rule
// that matches the node and covers every access bit of the open decides; a
// rule of type "a" matches every type but its numbers are read; no match
// denies. A rule that grants only mknod ("m") opens nothing.
func crunAccess(rules []DeviceRule, major, maxMinor int64, read numberReading) (all bool, minors []int64) {
	type decision struct {
		at    int // 1 + the rule's position; 0: no rule matched
		allow bool
	}
	// The requests an open makes: read, write, read and write.
	opens := [3]uint8{accRead, accWrite, accOpen}
	var (
		anyMinor [3]decision                // last rule matching any minor, per open
		byMinor  = map[int64]*[3]decision{} // last rule naming that minor, per open
	)
	for i, r := range rules {
		maj, mnr := read(r.Major), read(r.Minor)
		// Every type but "b" matches a character node.
		if r.Type == "b" || (maj >= 0 && maj != major) || mnr > maxMinor {
			continue
		}
		slot := &anyMinor
		if mnr >= 0 {
			if byMinor[mnr] == nil {
				byMinor[mnr] = &[3]decision{}
			}
			slot = byMinor[mnr]
		}
		bits := ruleBits(r)
		for k, acc := range opens {
			// A rule applies to an open only when it covers every
			// access bit of the open ((req & rule) == req, as crun's
			// and runc's eBPF programs test): "deny r" says nothing
			// about an O_RDWR open.
			if bits&acc == acc {
				slot[k] = decision{at: i + 1, allow: r.Allow}
			}
		}
	}
	reachable := func(m int64) bool {
		for k := range opens {
			d := anyMinor[k]
			if s := byMinor[m]; m >= 0 && s != nil && s[k].at > d.at {
				d = s[k]
			}
			if d.at > 0 && d.allow {
				return true
			}
		}
		return false
	}
	if reachable(-1) {
		return true, nil
	}
	for m := range byMinor {
		if reachable(m) {
			minors = append(minors, m)
		}
	}
	return false, minors
}

// dynamicMajorAccess reports whether the rules let the container read or
// write some character node of a major of the kernel's dynamic range: one a
// rule names (as any runtime reads it), or one no rule names (reached
// through a rule for every major).
func dynamicMajorAccess(rules []DeviceRule) bool {
	named := map[int64]bool{}
	for _, r := range rules {
		for _, read := range [...]numberReading{asWritten, asKernelU32, asCInt} {
			if mj := read(r.Major); mj >= firstDynamicMajor {
				named[mj] = true
			}
		}
	}
	// A dynamic major no rule names stands for every other one: there
	// are more of them (234-254, 384-511) than rules read.
	unnamed := int64(lastDynamicMajor)
	for named[unnamed] {
		unnamed--
	}
	named[unnamed] = true
	for mj := range named {
		if all, minors := ruleAccess(rules, mj, maxCapsMinor); all || len(minors) > 0 {
			return true
		}
	}
	return false
}

const (
	// firstDynamicMajor is the lowest character major Linux hands out at
	// module load (nvidia-caps and nvidia-uvm get theirs from 234-254 and
	// 384-511).
	firstDynamicMajor = 234
	// lastDynamicMajor is the highest (CHRDEV_MAJOR_MAX - 1).
	lastDynamicMajor = 511
	// maxDynamicMajorRules bounds the rules kept per request.
	maxDynamicMajorRules = 64
)

// maxCapsMinor bounds the capability minors read from rules.
const maxCapsMinor = 1 << 20

// MayBeGPUNode reports whether device node d may be a GPU, a MIG capability
// or an NVIDIA control node on some host: a character device of NVIDIA's
// major or of one Linux hands out at module load (every major below
// firstDynamicMajor is a fixed assignment, none of which but 195 is
// NVIDIA's), as written or as made (a major past 12 bits makes a node of
// its low bits), or one named /dev/nvidia*. Block devices and FIFOs never
// are.
func MayBeGPUNode(d LinuxDevice) bool {
	if d.Type != "" && d.Type != "c" && d.Type != "u" {
		return false
	}
	// The major as written and as the runtime makes the node of it
	// (MadeNumbers): either may be NVIDIA's or a dynamic one.
	made, _ := MadeNumbers(d.Major, d.Minor)
	for _, m := range []int64{d.Major, made} {
		if m == nvidiaMajor || m >= firstDynamicMajor {
			return true
		}
	}
	return strings.HasPrefix(d.Path, "/dev/nvidia")
}
