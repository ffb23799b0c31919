// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// Device states beyond held and free that status shows: draining claims,
// cordons and the observer's unhealthy devices. Which of them are problems
// (exit 3): a cordon the observer set (intruder, unhealthy) is, since
// someone has to look at the device and lift the cordon; an operator's
// cordon is not, since an operator set it on purpose and it is shown where
// everyone sees it; a draining claim is not, since it ends by itself within
// idle_grace (an unhealthy device already is one, from the observer).

// statusSummary counts the rows by state (each row is counted once, under
// its "state"), and the unhealthy ones.
type statusSummary struct {
	Devices   int `json:"devices"`
	Free      int `json:"free"`
	Held      int `json:"held"`
	Draining  int `json:"draining"`
	Reserved  int `json:"reserved"`
	Cordoned  int `json:"cordoned"`
	Conflict  int `json:"conflict"`
	Unhealthy int `json:"unhealthy"`
}

func (s *statusSummary) count(d *statusDevice) {
	s.Devices++
	switch d.State {
	case stateFree:
		s.Free++
	case stateHeld:
		s.Held++
	case stateDraining:
		s.Draining++
	case stateReserved:
		s.Reserved++
	case stateCordoned:
		s.Cordoned++
	case stateConflict:
		s.Conflict++
	}
}

// line is the summary under the table: "7 devices: 2 free, 3 held, 1
// draining, 1 cordoned; 1 unhealthy".
func (s *statusSummary) line() string {
	var parts []string
	for _, c := range []struct {
		n    int
		what string
	}{{s.Free, stateFree}, {s.Held, stateHeld}, {s.Draining, stateDraining}, {s.Reserved, stateReserved},
		{s.Cordoned, stateCordoned}, {s.Conflict, stateConflict}} {
		if c.n > 0 {
			parts = append(parts, strconv.Itoa(c.n)+" "+c.what)
		}
	}
	noun := "devices"
	if s.Devices == 1 {
		noun = "device"
	}
	out := strconv.Itoa(s.Devices) + " " + noun
	if len(parts) > 0 {
		out += ": " + strings.Join(parts, ", ")
	}
	if s.Unhealthy > 0 {
		out += "; " + strconv.Itoa(s.Unhealthy) + " unhealthy"
	}
	return out
}

// setDrainDeadlines sets when each draining claim ends at the latest: the
// ledger releases it once it has drained for idle_grace.
func (v *statusView) setDrainDeadlines(grace time.Duration) {
	for i := range v.Devices {
		if h := v.Devices[i].Holder; h != nil && h.DrainingSince != nil {
			until := h.DrainingSince.Add(grace)
			h.DrainingUntil = &until
		}
	}
}

// markUnhealthy marks the rows of the devices the observer reports
// unhealthy, and the MIG instances of such a GPU: one map, one pass.
func (v *statusView) markUnhealthy(sick []observe.Finding) {
	if len(sick) == 0 {
		return
	}
	since := make(map[string]time.Time, len(sick))
	for _, u := range sick {
		if t, ok := since[u.Device.UUID]; !ok || u.Time.Before(t) {
			since[u.Device.UUID] = u.Time
		}
	}
	for i := range v.Devices {
		d := &v.Devices[i]
		t, ok := since[d.UUID]
		if !ok && d.Parent != "" {
			t, ok = since[d.Parent]
		}
		if ok {
			d.UnhealthySince = timeOrNil(t)
			v.Summary.Unhealthy++
		}
	}
}

// stateLabel is the STATE cell: the state, then what else the device is
// ("cordoned,held", "conflict,cordoned", "held,unhealthy").
func (d *statusDevice) stateLabel() string {
	s := d.State
	switch {
	case d.State == stateCordoned && d.underlying != "" && d.underlying != stateFree:
		s += "," + d.underlying
	case d.State != stateCordoned && d.Cordon != nil:
		s += "," + stateCordoned
	}
	if d.Kept != nil || d.Exited != nil {
		s += ",exited" // kept until removed or the next request: listed under the table
	}
	if d.UnhealthySince != nil {
		s += ",unhealthy"
	}
	return s
}

// label names the device for people: "GPU 1 (GPU-…)".
func (d *statusDevice) label() string {
	return naming.Device(devices.Device{UUID: d.UUID, Index: d.Index, Kind: devices.Kind(d.Kind)})
}

// uncordonArg names the device for an uncordon command: its index, or its
// UUID once it has left the inventory.
func (d *statusDevice) uncordonArg() string {
	if d.InInventory {
		return d.Index
	}
	return d.UUID
}

// cordonProblem is the problem of a cordon the observer set, on the row of
// the cordoned device (not on the rows it covers: one problem per cordon).
func (d *statusDevice) cordonProblem(label string) (problem, bool) {
	k := d.Cordon
	if k == nil || d.CordonedVia != "" || k.Source == ledger.CordonOperator {
		return problem{}, false
	}
	what := fmt.Sprintf("%s is cordoned (%s, by %s since %s: %s): no new claims on it", label, k.Source, k.By,
		k.Since.UTC().Format(time.RFC3339), k.Reason)
	var do string
	switch k.Source {
	case ledger.CordonIntruder:
		do = fmt.Sprintf("find the process the ledger does not explain (`sudo %s ps`) and stop it or recreate its container through the guard, then `sudo %s uncordon %s`",
			programName, programName, d.uncordonArg())
	default: // unhealthy
		gpu := d.UUID
		if d.Parent != "" {
			gpu = d.Parent
		}
		do = fmt.Sprintf("check the GPU (`nvidia-smi -q -i %s`, `dmesg | grep -i xid`); once it is fixed, `sudo %s uncordon %s` (a reboot drops this cordon too)",
			gpu, programName, d.uncordonArg())
	}
	return problem{Kind: problemCordoned, Device: d.UUID, Index: d.Index, Message: what + "; " + do}, true
}

// renderNotes prints, under the table, the summary line and what is
// cordoned, draining, kept until removed or exited until the next request:
// listed for people, not problems.
func (v *statusView) renderNotes(w io.Writer, now time.Time) error {
	var cordoned, draining, kept, exited []string
	for i := range v.Devices {
		d := &v.Devices[i]
		if k := d.Cordon; k != nil && d.CordonedVia == "" {
			line := fmt.Sprintf("%s: %s cordon by %s since %s (%s ago): %s", d.label(), k.Source, k.By,
				k.Since.UTC().Format(time.RFC3339), age(now.Sub(k.Since)), k.Reason)
			if !d.InInventory && !v.noInventory {
				line += "; not in the inventory any more: lift it with `sudo " + programName + " uncordon " + d.UUID + "`"
			}
			cordoned = append(cordoned, line)
		}
		if h := d.Holder; h != nil && h.DrainingSince != nil && d.HeldVia == "" {
			line := fmt.Sprintf("%s: held by %s (%s), stopped; draining for %s, waiting for its processes to leave the GPU",
				d.label(), h.name(), naming.ShortID(h.ContainerID), age(now.Sub(*h.DrainingSince)))
			if h.DrainingUntil != nil {
				line += fmt.Sprintf(" (released at the latest in %s: idle_grace)", age(h.DrainingUntil.Sub(now)))
			}
			draining = append(draining, line)
		}
		if line, ok := d.keptNote(now); ok {
			kept = append(kept, line)
		}
		if line, ok := d.exitedNote(); ok {
			exited = append(exited, line)
		}
	}
	if _, err := fmt.Fprintf(w, "\n%s\n", v.Summary.line()); err != nil {
		return fmt.Errorf("write output: %w", err)
	}
	for _, sec := range []struct {
		title string
		lines []string
	}{{"CORDONS", cordoned}, {"DRAINING CLAIMS", draining}, {"KEPT UNTIL REMOVED", kept},
		{"EXITED, NO POSTSTOP", exited}} {
		if len(sec.lines) == 0 {
			continue
		}
		if _, err := fmt.Fprintf(w, "\n%s (%d):\n", sec.title, len(sec.lines)); err != nil {
			return fmt.Errorf("write output: %w", err)
		}
		for _, l := range sec.lines {
			if _, err := fmt.Fprintf(w, "  - %s\n", escapeLine(l)); err != nil {
				return fmt.Errorf("write output: %w", err)
			}
		}
	}
	return nil
}

// keptNote is the line under the table for a claim kept until its exited
// holder's container is removed (Kept): when it exited, and for an OCI hook
// holder the runtime root that still has its container and how to end the
// claim should its engine have lost it.
func (d *statusDevice) keptNote(now time.Time) (string, bool) {
	h := d.Holder
	if d.Kept == nil || h == nil {
		return "", false
	}
	exited := "has exited (" + d.Kept.Why + "; its stop is not recorded yet)"
	if h.StoppedAt != nil {
		exited = fmt.Sprintf("exited at %s (%s ago)", h.StoppedAt.UTC().Format(time.RFC3339), age(now.Sub(*h.StoppedAt)))
	}
	line := fmt.Sprintf("%s: held by %s, which %s and keeps its claim until its container is removed (release_on = \"remove\")",
		d.label(), h.who(), exited)
	if root := d.Kept.RuntimeRoot; root != "" {
		line += "; runtime root " + root + " still has its container: " + guard.KeptRemedy(root, h.ContainerID)
	}
	return line, true
}

// exitedNote is the line under the table for the claim of an exited OCI hook
// holder on a host without its poststop (Exited): how it is known to have
// exited, and what ends its claim, since the operator may expect the GPU to
// be free once the container is gone.
func (d *statusDevice) exitedNote() (string, bool) {
	h := d.Holder
	if d.Exited == nil || h == nil {
		return "", false
	}
	ends := "its claim ends at the next request for the device or with `sudo " + programName + " gc`"
	switch {
	case d.Exited.Ends == endsGC && d.Exited.Drains:
		ends = "its claim is marked draining by `sudo " + programName + " gc` (the device is cordoned: no request is admitted to it), " +
			"then released once its processes leave the GPU (release_requires_idle, at the latest after idle_grace)"
	case d.Exited.Ends == endsGC:
		ends = "its claim ends with `sudo " + programName + " gc` (the device is cordoned: no request is admitted to it)"
	case d.Exited.Drains:
		ends = "its claim is marked draining at the next request for the device or by `sudo " + programName + " gc`, " +
			"then released once its processes leave the GPU (release_requires_idle, at the latest after idle_grace)"
	}
	return fmt.Sprintf("%s: held by %s, which has exited (%s); %s ([hook] poststop = false)",
		d.label(), h.who(), d.Exited.Why, ends), true
}
