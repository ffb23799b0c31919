// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// loadMIGCaps maps /dev/nvidia-caps/nvidia-cap<N> to the MIG instances of
// gpus, from <root>/proc/driver/nvidia-caps/mig-minors (which the driver
// writes for every possible GPU/compute instance), and reads the
// nvidia-caps major from <root>/proc/devices. Only entries that name an
// instance of gpus are kept. It never fails: what cannot be read is said in
// notes, and capability nodes are then claimed conservatively (see
// builder.capNode and builder.linuxDevices).
//
// The major is read whatever becomes of the mapping: with the major known,
// a node or device cgroup rule of it is recognised by its numbers, under any
// name, and claims its whole GPU while the mapping is unknown.
func loadMIGCaps(rootDir string, gpus []GPU) (major int64, caps []MIGCap, notes []string) {
	root, err := os.OpenRoot(rootDir)
	if err != nil {
		return 0, nil, []string{"MIG capability mapping and nvidia-caps major unknown (" + err.Error() + "): " + unknownCapsMajorEffect}
	}
	defer func() { _ = root.Close() }()
	if devs, err := readBounded(root, procDevices); err == nil {
		major = parseCapsMajor(devs)
	}
	if major == 0 {
		notes = append(notes, "nvidia-caps major unknown ("+procDevices+"): "+unknownCapsMajorEffect)
	}
	data, err := readBounded(root, procMIGMinors)
	if err != nil {
		return major, nil, append(notes, "MIG capability mapping unknown ("+err.Error()+"): /dev/nvidia-caps nodes will claim their whole GPU")
	}
	caps, err = parseMIGMinors(data, gpus)
	if err != nil {
		return major, nil, append(notes, "MIG capability mapping unknown ("+procMIGMinors+": "+err.Error()+"): /dev/nvidia-caps nodes will claim their whole GPU")
	}
	return major, caps, notes
}

// unknownCapsMajorEffect says what an unknown nvidia-caps major does to
// resolution (see builder.linuxDevices and builder.capsRules).
const unknownCapsMajorEffect = "any device node or device cgroup rule of a dynamic major may be a MIG capability, " +
	"and claims whole the GPUs whose nodes the container has"

// parseMIGMinors reads "<name> <minor>" lines: "config 1", "monitor 2",
// "gpu<M>/gi<G>/access <N>" and "gpu<M>/gi<G>/ci<C>/access <N>", where M is the
// GPU's minor number.
func parseMIGMinors(data string, gpus []GPU) ([]MIGCap, error) {
	type gk struct{ minor, gi int }
	type ck struct{ minor, gi, ci int }
	haveGI := map[gk]bool{}
	haveCI := map[ck]bool{}
	for _, g := range gpus {
		for _, m := range g.MIG {
			haveGI[gk{g.Minor, m.GI}] = true
			haveCI[ck{g.Minor, m.GI, m.CI}] = true
		}
	}
	var caps []MIGCap
	sc := bufio.NewScanner(strings.NewReader(data))
	for line := 1; sc.Scan(); line++ {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		if len(fields) != 2 {
			return nil, fmt.Errorf("line %d: want \"<name> <minor>\", got %q", line, sc.Text())
		}
		minor, ok, big := decimal(fields[1])
		if !ok || big {
			return nil, fmt.Errorf("line %d: minor %q is not a number", line, fields[1])
		}
		c := MIGCap{Minor: minor}
		switch name := fields[0]; name {
		case "config":
			c.Kind = CapConfig
		case "monitor":
			c.Kind = CapMonitor
		default:
			nums, ok := parseCapName(name)
			if !ok {
				// A capability this code does not know opens no MIG
				// instance it could name; a node with this minor stays
				// unmapped and is handled conservatively.
				continue
			}
			c.GPUMinor, c.GI = nums[0], nums[1]
			if len(nums) == 2 {
				if !haveGI[gk{c.GPUMinor, c.GI}] {
					continue
				}
				c.Kind = CapGIAccess
			} else {
				c.CI = nums[2]
				if !haveCI[ck{c.GPUMinor, c.GI, c.CI}] {
					continue
				}
				c.Kind = CapCIAccess
			}
		}
		caps = append(caps, c)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return caps, nil
}

// parseCapName splits "gpu<M>/gi<G>/access" into [M G] and
// "gpu<M>/gi<G>/ci<C>/access" into [M G C].
func parseCapName(name string) ([]int, bool) {
	parts := strings.Split(name, "/")
	if len(parts) < 3 || len(parts) > 4 || parts[len(parts)-1] != "access" {
		return nil, false
	}
	prefixes := [...]string{"gpu", "gi", "ci"}
	nums := make([]int, 0, 3)
	for i, p := range parts[:len(parts)-1] {
		rest, ok := strings.CutPrefix(p, prefixes[i])
		n, isNum, big := decimal(rest)
		if !ok || !isNum || big {
			return nil, false
		}
		nums = append(nums, n)
	}
	return nums, true
}

// parseCapsMajor finds "<major> nvidia-caps" in the "Character devices:"
// section of /proc/devices; 0 when absent.
func parseCapsMajor(data string) int64 {
	inChar := false
	sc := bufio.NewScanner(strings.NewReader(data))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case strings.HasSuffix(line, "devices:"):
			inChar = line == "Character devices:"
		case inChar:
			f := strings.Fields(line)
			if len(f) == 2 && f[1] == "nvidia-caps" {
				if n, err := strconv.ParseInt(f[0], 10, 64); err == nil && n > 0 {
					return n
				}
			}
		}
	}
	return 0
}
