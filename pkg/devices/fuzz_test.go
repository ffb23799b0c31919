// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/gpuid"
)

var sentinels = []error{ErrUnknownDevice, ErrInvalidID, ErrAllRejected, ErrPrivilegedRejected, ErrTooLarge}

func leafErrors(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}

// checkResolution asserts the invariants of every resolution: devices are in
// the inventory, sorted and unique by UUID, each with a source; every error
// wraps a sentinel, is one line, and names one of the candidate tokens (or,
// for ErrTooLarge, the source).
func checkResolution(t *testing.T, inv *Inventory, res Resolution, err error, candidates []string, sources []string) {
	t.Helper()
	if err != nil {
		if len(res.Devices) != 0 {
			t.Fatalf("failed resolution claims devices: %v", res.UUIDs())
		}
		for _, leaf := range leafErrors(err) {
			msg := leaf.Error()
			if strings.HasPrefix(msg, "… and ") {
				continue
			}
			if strings.ContainsAny(msg, "\n\r") {
				t.Fatalf("error spans lines (unquoted input?): %q", msg)
			}
			wrapped := false
			for _, s := range sentinels {
				wrapped = wrapped || errors.Is(leaf, s)
			}
			if !wrapped {
				t.Fatalf("error wraps no sentinel: %q", msg)
			}
			named := false
			if errors.Is(leaf, ErrTooLarge) || errors.Is(leaf, ErrPrivilegedRejected) {
				for _, s := range sources {
					named = named || strings.Contains(msg, s)
				}
			}
			for _, c := range candidates {
				named = named || strings.Contains(msg, quoteToken(c))
			}
			if !named {
				t.Fatalf("error names no offending token %q: %q", candidates, msg)
			}
		}
		return
	}
	for i, d := range res.Devices {
		if got, ok := inv.Lookup(d.UUID); !ok || got != d.Device {
			t.Fatalf("resolved device %+v is not the inventory's %+v", d.Device, got)
		}
		if i > 0 && res.Devices[i-1].UUID >= d.UUID {
			t.Fatalf("not sorted and unique: %v", res.UUIDs())
		}
		if len(d.Sources) == 0 {
			t.Fatalf("device %s has no source", d.UUID)
		}
	}
}

func splitCandidates(value string) []string {
	out := []string{strings.TrimSpace(value)}
	for _, tok := range strings.Split(value, ",") {
		out = append(out, strings.TrimSpace(tok))
	}
	return out
}

func FuzzVisibleDevices(f *testing.F) {
	for _, s := range []string{"0", " 1 , 2 ", "0,all", "void,0", "none", "", ",,", "all,none", "MIG-GPU-a0000001-0000-4000-8000-000000000001/1/0",
		"1:0", "+1", "01", "GPU-a", "GPU-", "0000:3b:00.0", "7", "x\n", "\"", strings.Repeat("0,", 300), "ALL", "1:99999999999"} {
		f.Add(s)
	}
	inv := testInventory(f)
	r := NewResolver(inv, defaultPolicy())
	f.Fuzz(func(t *testing.T, value string) {
		req := Request{Env: []string{EnvVisibleDevices + "=" + value}}
		res, err := r.Resolve(req)
		checkResolution(t, inv, res, err, splitCandidates(value), []string{"env " + EnvVisibleDevices})
		res2, err2 := r.Resolve(req)
		if (err == nil) != (err2 == nil) || (err == nil && len(res.Devices) != len(res2.Devices)) {
			t.Fatalf("resolution is not deterministic")
		}
		if err != nil {
			return
		}
		tokens := strings.Split(value, ",")
		for _, tok := range tokens {
			if strings.TrimSpace(tok) == "void" && len(res.Devices) > 0 {
				t.Fatalf("void claimed %v", res.UUIDs())
			}
		}
	})
}

func FuzzCDIName(f *testing.F) {
	for _, s := range []string{"nvidia.com/gpu=0", "nvidia.com/gpu=all", "nvidia.com/mig=mig1:0", "nvidia.com/gpu=gpu3", "nvidia.com/gpu=GPU-a0000001-0000-4000-8000-000000000001",
		"example.com/x=1", "k8s.gpu.nvidia.com/device=gpu-0", "gpu0", "=", "/=", "nvidia.com/=0", "nvidia.com/gpu=", "nvidia.com/gpu=mig:", "nvidia.com/gpu=gpu+1", "a/b/c=d"} {
		f.Add(s)
	}
	inv := testInventory(f)
	r := NewResolver(inv, defaultPolicy())
	f.Fuzz(func(t *testing.T, name string) {
		res, err := r.Resolve(Request{CDIDevices: []string{name}})
		checkResolution(t, inv, res, err, []string{strings.TrimSpace(name)}, []string{"CDI device"})
		res, err = r.Resolve(Request{Annotations: map[string]string{CDIAnnotationPrefix + "fuzz": name}})
		checkResolution(t, inv, res, err, splitCandidates(name), []string{"annotation " + CDIAnnotationPrefix + "fuzz"})
	})
}

func FuzzMountDestination(f *testing.F) {
	for _, s := range []string{mr + "0", mr + "../0", mr + "/0", mr + "0/", MountRoot, mr + "cdi/nvidia.com/gpu=1", mr + "all", mr + "void",
		mr + "0,all", mr + " 3", mr + "0,9", mr + "cdi/management.nvidia.com/gpu/all", "/var/./run/nvidia-container-devices/0", "/dev/null", mr + "9", mr + "cdi/x"} {
		f.Add(s)
	}
	inv := testInventory(f)
	r := NewResolver(inv, defaultPolicy())
	f.Fuzz(func(t *testing.T, dest string) {
		res, err := r.Resolve(Request{Mounts: []string{dest}})
		rest := strings.TrimPrefix(dest, mr)
		// The runtime joins mounted ids with commas: an error may name one.
		candidates := append([]string{dest, rest, strings.TrimPrefix(rest, "cdi/")}, splitCandidates(rest)...)
		if name, ok := strings.CutPrefix(rest, "cdi/"); ok {
			// The runtime's form cdi/<vendor>/<class>/<device> is named as
			// the CDI device it means.
			if p := strings.SplitN(name, "/", 3); len(p) == 3 {
				candidates = append(candidates, p[0]+"/"+p[1]+"="+p[2])
			}
		}
		checkResolution(t, inv, res, err, candidates, []string{"mount"})
	})
}

func FuzzResolve(f *testing.F) {
	f.Add("0,1", "/dev/null", "cdi.k8s.io/x", "nvidia.com/gpu=2", "nvidia.com/gpu=3", "/dev/nvidia3", int64(195), int64(3), false, uint8(0))
	f.Add("all", mr+"1:1", "cdi.k8s.io/y", "nvidia.com/mig=mig1:0", "", "/dev/nvidia-caps/nvidia-cap31", int64(508), int64(31), true, uint8(5))
	f.Add("", "", "", "", "", "/dev/x", int64(0), int64(0), true, uint8(255))
	inv := testInventory(f)
	f.Fuzz(func(t *testing.T, envVal, mount, annKey, annVal, cdi, devPath string, major, minor int64, privileged bool, pol uint8) {
		p := defaultPolicy()
		p.AllDevices = []config.AllDevices{config.AllClaim, config.AllReject, config.AllIgnore, ""}[pol&3]
		p.Privileged = []config.Privileged{config.PrivilegedDeclared, config.PrivilegedAll, config.PrivilegedReject, ""}[(pol>>2)&3]
		p.UnknownDevice = []config.UnknownDevice{config.UnknownReject, config.UnknownIgnore}[(pol>>4)&1]
		req := Request{
			Env:         []string{"DOCKER_RESOURCE_GPU=" + envVal},
			Mounts:      []string{mount},
			Annotations: map[string]string{annKey: annVal},
			CDIDevices:  []string{cdi},
			Devices:     []LinuxDevice{{Path: devPath, Type: "c", Major: major, Minor: minor}},
			Privileged:  privileged,
		}
		res, err := NewResolver(inv, p).Resolve(req)
		rest := strings.TrimPrefix(mount, mr)
		candidates := append(splitCandidates(envVal), mount, rest, strings.TrimPrefix(rest, "cdi/"), strings.TrimSpace(cdi))
		candidates = append(candidates, splitCandidates(rest)...)
		candidates = append(candidates, splitCandidates(annVal)...)
		candidates = append(candidates, devNumbers(major, minor, devPath)...)
		checkResolution(t, inv, res, err, candidates, []string{"env", "mount", "annotation", "CDI device", "device", "privileged"})
		if err == nil && privileged && p.Privileged == config.PrivilegedAll && len(res.Devices) < len(inv.GPUs) {
			t.Fatalf("privileged under policy all claimed only %v", res.UUIDs())
		}
	})
}

// devNumbers are the "major:minor" tokens an error about a device node names.
func devNumbers(major, minor int64, path string) []string {
	mj, mn, _ := nodeNumbers(LinuxDevice{Path: path, Major: major, Minor: minor})
	return []string{strconv.FormatInt(mj, 10) + ":" + strconv.FormatInt(mn, 10)}
}

func FuzzInventoryJSON(f *testing.F) {
	data, err := json.Marshal(testInventory(f))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(data)
	f.Add([]byte(`{"source":"nvml","gpus":[]}`))
	f.Add([]byte(`{"source":"nvml","gpus":[{"index":0,"uuid":"GPU-c0000000-0000-4000-8000-000000000000","minor":0,"mig":[{"index":0,"uuid":"MIG-GPU-c0000000-0000-4000-8000-000000000000/1/0","gi":1}]}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		var inv Inventory
		if err := json.Unmarshal(data, &inv); err != nil {
			return
		}
		again, err := json.Marshal(&inv)
		if err != nil {
			t.Fatal(err)
		}
		var back Inventory
		if err := json.Unmarshal(again, &back); err != nil {
			t.Fatalf("a valid inventory does not round-trip: %v", err)
		}
		if len(back.Devices()) != len(inv.Devices()) {
			t.Fatalf("round trip changed the devices")
		}
		for _, d := range inv.Devices() {
			if got, ok := back.ByIndex(d.Index); !ok || got != d {
				t.Fatalf("round trip lost %+v", d)
			}
		}
	})
}

func FuzzProcInformation(f *testing.F) {
	f.Add("Model: \t\t NVIDIA H100\nGPU UUID: \t GPU-c0000000-0000-4000-8000-000000000000\nBus Location: \t 0000:3b:00.0\nDevice Minor: \t 0\nGPU Excluded:\t No\n")
	f.Add("GPU UUID: GPU-????????-????-????-????-????????????\nDevice Minor: 1\n")
	f.Add("Device Minor: 999\n")
	f.Fuzz(func(t *testing.T, data string) {
		g, err := parseInformation(data)
		if err != nil {
			return
		}
		if !gpuid.IsGPUUUID(g.UUID) || g.Minor < 0 || g.Minor > gpuid.MaxGPUMinor {
			t.Fatalf("accepted an invalid GPU: %+v", g.GPU)
		}
	})
}

func FuzzMIGMinors(f *testing.F) {
	f.Add(migMinors)
	f.Add("config 1\ngpu3/gi1/access 5\ngpu3/gi1/access 5\n")
	f.Fuzz(func(t *testing.T, data string) {
		caps, err := parseMIGMinors(data, testGPUs())
		if err != nil {
			return
		}
		_, err = newInventory(Inventory{Source: "nvml", GPUs: testGPUs(), MIGCaps: caps})
		if err != nil && !strings.Contains(err.Error(), "listed twice") {
			t.Fatalf("parsed caps do not fit the inventory: %v", err)
		}
	})
}

// FuzzRuleAccess checks ruleAccess against a plain per-node replay of the
// models it joins: the kernel's exception list (and runc's emulation of it)
// and crun's last-matching-rule program, each with the numbers as every
// runtime reads them (numbers past a C int included: crun truncates them).
func FuzzRuleAccess(f *testing.F) {
	f.Add([]byte{0x00, 0x5b, 0x6d})
	f.Add([]byte{0x01, 0x25, 0x13, 0x0b, 0x00, 0x00})
	f.Add([]byte{0x81, 0x07, 0xff, 0x3f, 0x12, 0x40, 0x9a})
	f.Add([]byte{0x00, 0x00, 0x1b, 0x38}) // deny all, allow c 4294967295:* rwm
	types := []string{"a", "c", "b", ""}
	majors := []int64{-1, nvidiaMajor, 5,
		math.MaxUint32,           // crun and the kernel (v1): any major
		1<<32 + nvidiaMajor,      // crun: 195
		1 << 31,                  // crun: any major
		-(1 << 32) + nvidiaMajor, // crun: 195; runc: any major
		1 << 32,                  // crun: 0
		-5,
	}
	minors := []int64{-1, 0, 1, 2, 3, 4, 5,
		1<<32 + 2,      // crun: 2
		math.MaxUint32, // crun and the kernel (v1): any minor
		1<<31 + 3,      // crun: any minor
		-(1 << 32) + 4, // crun: 4; runc: any minor
		-7,
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var rules []DeviceRule
		for i := 0; i+1 < len(data) && len(rules) < 12; i += 2 {
			x, y := data[i], data[i+1]
			r := DeviceRule{Allow: x&1 == 1, Type: types[(x>>1)&3]}
			if mj := majors[int(x>>3)%len(majors)]; mj != -1 {
				r.Major = &mj
			}
			if mn := minors[(int(y&7)|int(y>>6)<<3)%len(minors)]; mn != -1 {
				r.Minor = &mn
			}
			r.Access = []string{"", "r", "w", "m", "rw", "rm", "wm", "rwm"}[(y>>3)&7]
			rules = append(rules, r)
		}
		reaches := func(minor int64) bool {
			for _, read := range []func(*int64) int64{refWritten, refKernelU32} {
				if kernelReaches(rules, minor, read) {
					return true
				}
			}
			for _, read := range []func(*int64) int64{refWritten, refCInt} {
				if crunReaches(rules, minor, read) {
					return true
				}
			}
			return false
		}
		all, got := ruleAccess(rules, nvidiaMajor, gpuid.MaxGPUMinor)
		const other = 100 // a minor no rule names
		if want := reaches(other); all != want {
			t.Fatalf("%s: all = %v, the models say %v", showRules(rules), all, want)
		}
		if all {
			return
		}
		var want []int64
		for m := int64(0); m < 7; m++ {
			if reaches(m) {
				want = append(want, m)
			}
		}
		if !slices.Equal(got, want) {
			t.Fatalf("%s: minors %v, the models say %v", showRules(rules), got, want)
		}
	})
}

// showRules prints rules as the device cgroup writes them.
func showRules(rules []DeviceRule) string {
	num := func(n *int64) string {
		if n == nil {
			return "*"
		}
		return strconv.FormatInt(*n, 10)
	}
	var b strings.Builder
	for _, r := range rules {
		verb := "deny"
		if r.Allow {
			verb = "allow"
		}
		fmt.Fprintf(&b, "[%s %q %s:%s %q]", verb, r.Type, num(r.Major), num(r.Minor), r.Access)
	}
	return b.String()
}

func refBits(r DeviceRule) (bits [3]bool) {
	if r.Access == "" {
		return [3]bool{r.Allow, r.Allow, r.Allow}
	}
	return [3]bool{strings.Contains(r.Access, "r"), strings.Contains(r.Access, "w"), strings.Contains(r.Access, "m")}
}

// refWritten reads a rule's number as written: negative is the wildcard.
func refWritten(n *int64) int64 {
	if n == nil || *n < 0 {
		return -1
	}
	return *n
}

// refKernelU32 reads it as the kernel's device cgroup (v1) parses what crun
// writes: 4294967295 (~0 in a u32) is the kernel's wildcard.
func refKernelU32(n *int64) int64 {
	if n != nil && *n == 1<<32-1 {
		return -1
	}
	return refWritten(n)
}

// refCInt reads it as crun's C int: the low 32 bits, two's complement, and
// a negative value is the wildcard.
func refCInt(n *int64) int64 {
	if n == nil {
		return -1
	}
	v := *n & (1<<32 - 1)
	if v >= 1<<31 {
		return -1
	}
	return v
}

// kernelReaches replays the kernel's device cgroup for c 195:minor, with
// the rules' numbers as read reads them: may it be opened for reading or for
// writing?
func kernelReaches(rules []DeviceRule, minor int64, read func(*int64) int64) bool {
	type exception struct {
		major, minor int64
		bits         [3]bool
	}
	var list []exception
	allow := false
	for _, r := range rules {
		if r.Type == "" || r.Type == "a" {
			allow, list = r.Allow, nil
			continue
		}
		if r.Type != "c" {
			continue
		}
		mj, mn, bits := read(r.Major), read(r.Minor), refBits(r)
		i := slices.IndexFunc(list, func(e exception) bool { return e.major == mj && e.minor == mn })
		if r.Allow != allow {
			if i < 0 {
				list = append(list, exception{major: mj, minor: mn})
				i = len(list) - 1
			}
			for b := range bits {
				list[i].bits[b] = list[i].bits[b] || bits[b]
			}
		} else if i >= 0 {
			for b := range bits {
				list[i].bits[b] = list[i].bits[b] && !bits[b]
			}
		}
	}
	for _, acc := range []int{0, 1} {
		held := false
		for _, e := range list {
			if (e.major < 0 || e.major == nvidiaMajor) && (e.minor < 0 || e.minor == minor) && e.bits[acc] {
				held = true
			}
		}
		if held != allow {
			return true
		}
	}
	return false
}

// crunReaches replays crun's eBPF program for c 195:minor opened for
// reading, writing, or both, with the rules' numbers as read reads them.
func crunReaches(rules []DeviceRule, minor int64, read func(*int64) int64) bool {
	for _, open := range [][3]bool{{true, false, false}, {false, true, false}, {true, true, false}} {
		for i := len(rules) - 1; i >= 0; i-- {
			r := rules[i]
			mj, mn, bits := read(r.Major), read(r.Minor), refBits(r)
			if r.Type == "b" || (mj >= 0 && mj != nvidiaMajor) || (mn >= 0 && mn != minor) {
				continue
			}
			if (!open[0] || bits[0]) && (!open[1] || bits[1]) {
				if r.Allow {
					return true
				}
				break
			}
		}
	}
	return false
}
