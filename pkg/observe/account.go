// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package observe

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"
)

// listing is what the GPU side reports for one device in one pass.
type listing struct {
	device Device
	procs  []Process // PID, Type and UsedMemoryBytes set
	// err: NVML could not list the device; nothing is concluded about it.
	err error
	// lost: the device vanished or reports a fatal state (unhealthy).
	lost error
	// gpu: the GPU of a MIG instance the inventory lacks
	// (device.unknownMIG), as the inventory lists it: its intruder and
	// out-of-bounds findings are on it (Finding.Instance).
	gpu Device
	// nowAt: a MIG instance of the inventory that NVML reports at another
	// MIG index now ("1:2"; instances destroyed and created since
	// discovery move those that stay). It is still the inventory's
	// instance (found by UUID), listed and judged as such.
	nowAt string
}

// ledgerView indexes the holdings for the comparison. Holdings of exempt
// containers (AnyDevice) are kept apart: they hold no device.
type ledgerView struct {
	holdings []Holding
	byDevice map[string][]Holding
	exempt   []Holding
}

func newLedgerView(hs []Holding) ledgerView {
	v := ledgerView{byDevice: map[string][]Holding{}}
	for _, h := range hs {
		if h.AnyDevice {
			v.exempt = append(v.exempt, h)
			continue
		}
		v.holdings = append(v.holdings, h)
		h.ContainerID = strings.ToLower(h.ContainerID)
		v.byDevice[h.DeviceUUID] = append(v.byDevice[h.DeviceUUID], h)
	}
	return v
}

// exempts reports whether p belongs to an exempt container.
func (v ledgerView) exempts(p Process) bool {
	for _, h := range v.exempt {
		if owns(h, p) {
			return true
		}
	}
	return false
}

// holdersOf returns the claims covering d: claims on d itself and, for a
// MIG instance, on its GPU.
func (v ledgerView) holdersOf(d Device) []Holding {
	out := append([]Holding(nil), v.byDevice[d.UUID]...)
	if d.IsMIG() {
		out = append(out, v.byDevice[d.ParentUUID]...)
	}
	return out
}

// owns reports whether p belongs to h's container.
func owns(h Holding, p Process) bool {
	if p.ContainerID != "" && strings.EqualFold(p.ContainerID, h.ContainerID) {
		return true
	}
	return h.CgroupPath != "" && p.Cgroup != "" &&
		(p.Cgroup == h.CgroupPath || strings.HasPrefix(p.Cgroup, strings.TrimSuffix(h.CgroupPath, "/")+"/"))
}

// claimsOf returns every claim of p's container, on any device.
func (v ledgerView) claimsOf(p Process) []Holding {
	var out []Holding
	for _, h := range v.holdings {
		if owns(h, p) {
			out = append(out, h)
		}
	}
	return out
}

// compare turns one pass's listings, with pids already attributed, into a
// report: every process the ledger does not explain is a finding.
func compare(now time.Time, ls []listing, v ledgerView) Report {
	r := Report{Time: now, Devices: []DeviceReport{}, Findings: []Finding{}}
	for _, l := range ls {
		holders := v.holdersOf(l.device)
		dr := DeviceReport{Device: l.device, Processes: l.procs}
		if dr.Processes == nil {
			dr.Processes = []Process{}
		}
		if len(holders) > 0 {
			dr.Holder = holders[0].ContainerID
		}
		switch {
		case l.lost != nil:
			dr.Error = l.lost.Error()
			f := lostFinding(now, l.device, l.lost)
			if len(holders) > 0 {
				f.Holder = holders[0].ContainerID
				f.Message += "; its holder " + holders[0].name() + " keeps its claim"
			}
			r.Findings = append(r.Findings, f)
		case l.err != nil:
			dr.Error = l.err.Error()
		}
		if l.device.unknownMIG {
			// Not an error: its processes were listed (else l.err says
			// so too), and are judged below like any device's.
			dr.NotInInventory = unknownMIGNotice(l.device)
		}
		r.Devices = append(r.Devices, dr)
		for _, p := range l.procs {
			f, ok := judge(now, l.device, p, holders, v)
			if !ok {
				continue
			}
			if l.device.unknownMIG && f.Kind != KindGone {
				f = onItsGPU(f, l.gpu)
			}
			r.Findings = append(r.Findings, f)
		}
	}
	sort.SliceStable(r.Findings, func(i, j int) bool {
		a, b := r.Findings[i], r.Findings[j]
		if a.Device.UUID != b.Device.UUID {
			return a.Device.UUID < b.Device.UUID
		}
		return a.PID < b.PID
	})
	return r
}

// unknownMIGNotice says that d, a MIG instance the inventory lacks, is
// observed only as part of its GPU, and how to rebuild the inventory.
func unknownMIGNotice(d Device) string {
	return fmt.Sprintf("the MIG layout of GPU %d (%s) changed since the inventory was discovered: "+
		"instance %s is not in it; its processes are judged against the claims on the GPU, "+
		"and it cannot be claimed until the inventory is rebuilt (restart nri-gpu-guard; "+
		"`sudo gpu-guard-ctl devices --refresh` refreshes the OCI hooks' cache)", d.gpuIndex, d.ParentUUID, d.UUID)
}

// onItsGPU moves f, an intruder or out-of-bounds finding on a MIG instance
// the inventory lacks, to gpu, the instance's GPU (see Finding.Instance):
// judged against the GPU's claims, it is the GPU that a cordon can name
// and that a claim could still take whole while the process runs. The
// message, which names the instance and its GPU, says so.
func onItsGPU(f Finding, gpu Device) Finding {
	instance := f.Device
	f.Device, f.Instance = gpu, &instance
	f.Message += fmt.Sprintf("; the finding is its GPU's, GPU %s (%s): "+
		"the GPU's claims cover the instance, and a cordon for the finding is on the GPU; "+
		"restart nri-gpu-guard so that its discovery lists the instance", gpu.Index, gpu.UUID)
	return f
}

func lostFinding(now time.Time, d Device, err error) Finding {
	return Finding{
		Kind: KindUnhealthy, Device: d, Time: now, Vanished: errors.Is(err, ErrVanished),
		Message: fmt.Sprintf("%s is unhealthy: %v; no new claims until it is back (check nvidia-smi and the kernel log; a reset or reboot may be needed)", d, err),
	}
}

// judge applies the rules to one process on one device.
func judge(now time.Time, d Device, p Process, holders []Holding, v ledgerView) (Finding, bool) {
	f := Finding{Device: d, Time: now, PID: p.PID, ContainerID: p.ContainerID}
	var holder *Holding
	if len(holders) > 0 {
		holder = &holders[0]
		f.Holder = holder.ContainerID
	}
	if p.Gone {
		f.Kind = KindGone
		f.Message = fmt.Sprintf("pid %d on %s exited or was reused before it could be attributed; not counted", p.PID, d)
		if p.unattributed != nil {
			f.Message = fmt.Sprintf("pid %d on %s could not be attributed (%v); not counted", p.PID, d, p.unattributed)
		}
		return f, true
	}
	for _, h := range holders {
		if owns(h, p) {
			return Finding{}, false
		}
	}
	if v.exempts(p) {
		return Finding{}, false
	}
	f.StartTicks = p.startTicks
	where := "which is free"
	if holder != nil {
		where = "held by " + holder.name()
	}
	if claims := v.claimsOf(p); len(claims) > 0 {
		var held []string
		for _, c := range claims {
			held = append(held, c.DeviceUUID)
		}
		sort.Strings(held)
		f.Kind = KindOutOfBounds
		f.Message = fmt.Sprintf("pid %d of %s runs on %s, %s, but %s claimed only %s: it reached a GPU the guard did not admit it to (stop it, or give the container that GPU); the guard does not kill it",
			p.PID, claims[0].name(), d, where, claims[0].name(), strings.Join(held, ", "))
		return f, true
	}
	f.Kind = KindIntruder
	f.Message = fmt.Sprintf("pid %d (%s) runs on %s, %s: it was not admitted by the guard (stop it, or run it through the guard); the guard does not kill it",
		p.PID, p.owner(), d, where)
	return f, true
}
