// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/daemon"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// psTimeout bounds the NVML accounting of ps: a hung driver makes ps fail
// with a clear error instead of hanging the operator's shell.
const psTimeout = 30 * time.Second

// Verdicts of ps (the "verdict" JSON field).
const (
	verdictOK          = "ok"
	verdictIntruder    = "intruder"
	verdictOutOfBounds = "out-of-bounds"
	verdictGone        = "gone"
	verdictExempt      = "exempt"
)

func (a *app) psCommand() *cobra.Command {
	return newCommand("ps",
		"List the processes NVML reports on each GPU and MIG device, and whether the ledger explains them",
		`Ask NVML now which compute and graphics processes run on every GPU and MIG
instance of the inventory, map each pid to its container through
/proc/PID/cgroup (or "host process"), and compare with the ledger: a process
of the device's holder is ok; a process of a container holding nothing (or of
the host) is an intruder; a process of a holder on a device it did not claim
is out-of-bounds; a pid that exited (or was reused) before it could be mapped
is gone and not judged. A device NVML cannot list, or that is lost, is shown
with its error: nothing was checked on it. A MIG instance NVML reports that
the inventory lacks (created since it was discovered) has its processes
listed and judged against the claims on its GPU like any device's, its index
marked "(not in inventory)"; it is a problem (not-in-inventory): nothing can
claim it until the inventory is rebuilt (restart nri-gpu-guard).

This is the daemon's periodic accounting ([observe] interval), done on demand,
with the same holdings (a process in a container nested in the holder's cgroup
is the holder's). The containers of policy.exempt_namespaces, which may use
any GPU, the daemon learns from the runtime through NRI; ps knows them from
their "exempt" records in the audit log (verdict exempt), and says under the
table what that misses. Run it as root in the host's pid namespace (NVML
reports host pids). It needs
NVML (the NVIDIA driver); ps exits 1 with an error without it, and 3 when a
process is an intruder or out of bounds, a device is unhealthy, NVML could
not list a device's processes (unobserved), or a device is not in the
inventory (not-in-inventory).`,
		`  sudo gpu-guard-ctl ps
  sudo gpu-guard-ctl ps -o json | jq '.devices[].processes[] | select(.verdict != "ok")'`,
		noArgs,
		func(cmd *cobra.Command, _ []string) error {
			v, err := a.ps(cmd.Context())
			if err != nil {
				return err
			}
			if err := v.render(a.env.Stdout, a.output); err != nil {
				return err
			}
			if len(v.Problems) > 0 {
				return attention(len(v.Problems))
			}
			return nil
		})
}

// psView is the ps output; its JSON is a public interface (docs/ctl-json.md).
type psView struct {
	Time     time.Time  `json:"time"`
	Devices  []psDevice `json:"devices"`
	Problems []problem  `json:"problems"`
	// Notes say what ps could not judge (exempt containers it cannot know).
	Notes []string `json:"notes"`
}

type psDevice struct {
	Index     string      `json:"index"`
	UUID      string      `json:"uuid"`
	Parent    string      `json:"parent,omitempty"`
	Holder    *psHolder   `json:"holder"`
	Processes []psProcess `json:"processes"`
	Error     string      `json:"error,omitempty"`
	// NotInInventory says that the inventory lacks the device (a MIG
	// instance created since discovery) and what to do; its processes
	// are listed and judged all the same.
	NotInInventory string `json:"not_in_inventory,omitempty"`
}

type psHolder struct {
	ContainerID string `json:"container_id"`
	Name        string `json:"name"`
}

type psProcess struct {
	PID             int    `json:"pid"`
	Type            string `json:"type"`
	UsedMemoryBytes uint64 `json:"used_memory_bytes"`
	ContainerID     string `json:"container_id,omitempty"`
	// Container names the process's container ("namespace/pod/container"
	// when the ledger knows it), "host process", or "" when gone.
	Container string `json:"container"`
	Verdict   string `json:"verdict"`
}

// ps runs one accounting pass through NVML against the ledger.
func (a *app) ps(ctx context.Context) (*psView, error) {
	if err := a.needNVML("ps (the processes on the GPUs)"); err != nil {
		return nil, err
	}
	inv, _, err := a.inventory()
	if err != nil {
		return nil, fmt.Errorf("ps needs the GPU inventory: %w", err)
	}
	l, err := a.openLedger(true)
	if err != nil {
		return nil, err
	}
	st, err := snapshotOf(ctx, l)
	if err != nil {
		return nil, err
	}
	// Against no ledger every process would be an intruder.
	if err := a.checkLedgerDir(); err != nil {
		return nil, err
	}
	procRoot := a.env.ProcRoot
	if filepath.Base(procRoot) != "proc" {
		return nil, fmt.Errorf("ps: the proc root %q must be a directory named proc", procRoot)
	}
	src, err := observe.OpenNVML(a.env.NVML)
	if err != nil {
		if errors.Is(err, observe.ErrNVMLUnavailable) {
			return nil, fmt.Errorf("ps needs NVML to see the processes on the GPUs, and it is not available on this host "+
				"(is the NVIDIA driver loaded? does nvidia-smi work?): %w", err)
		}
		return nil, err
	}
	defer func() { _ = src.Close() }() // nothing to do about a failed shutdown
	// The daemon's holdings, built by the same function: with each
	// holder's cgroup, so that a container nested in a holder is the
	// holder's, and the exempt containers, as far as ps can know them.
	exempt, exemptErr := psExempt(l.AuditPath())
	holdings := daemon.Holdings(st.Claims, exempt)
	o, err := observe.New(observe.Options{Source: src, GPUs: inv.GPUs, ProcRoot: filepath.Dir(procRoot),
		Ledger: observe.LedgerFunc(func() ([]observe.Holding, error) { return holdings, nil })})
	if err != nil {
		return nil, err
	}
	actx, cancel := context.WithTimeout(ctx, psTimeout)
	defer cancel()
	r, err := o.Account(actx)
	if err != nil {
		return nil, fmt.Errorf("ps: %w (NVML did not list the GPU processes within %s; check nvidia-smi and the kernel log)", err, psTimeout)
	}
	v := buildPS(r, &st, exempt)
	v.Notes = psNotes(v, len(exempt) > 0, exemptErr)
	return v, nil
}

// psExempt returns the containers the guard exempted (container id → "",
// no cgroup known), from their "exempt" records in the audit log at
// auditPath: the
// daemon learns a container's namespace from the runtime through NRI and
// keeps its exempt set to itself, but no container is exempted without
// that record (a container id is never reused). A record the log's rotation
// dropped is missing; psNotes says so.
func psExempt(auditPath string) (map[string]string, error) {
	recs, err := ledger.ReadAudit(auditPath)
	exempt := map[string]string{}
	for _, r := range recs {
		if r.Op == guard.AuditExempt && r.ContainerID != "" {
			exempt[r.ContainerID] = ""
		}
	}
	return exempt, err
}

// psNotes says what ps could not tell when it found an intruder: a
// container exempted (exempt_namespaces) whose audit record the rotation
// dropped, or one nested in an exempt container (the audit record names no
// cgroup), looks like an intruder to ps but not to the daemon. Said when
// exemptions were recorded, or the audit log could not be read.
func psNotes(v *psView, exempted bool, auditErr error) []string {
	notes := []string{}
	intruder := false
	for _, p := range v.Problems {
		intruder = intruder || p.Kind == problemIntruder
	}
	if !intruder {
		return notes
	}
	const daemon = "the daemon learns them from the runtime through NRI, and does not count their processes: " +
		"`" + programName + " status` shows its own findings"
	switch {
	case auditErr != nil:
		notes = append(notes, fmt.Sprintf("the audit log did not read whole (%v): an intruder above may be a container of "+
			"policy.exempt_namespaces whose \"exempt\" record is on a line that did not read (%s)", auditErr, daemon))
	case exempted:
		notes = append(notes, "ps knows the containers of policy.exempt_namespaces, which may use any GPU, from their "+
			"\"exempt\" records in the audit log: an intruder above may be one whose record the log's rotation dropped, "+
			"or a container nested in one ("+daemon+")")
	}
	return notes
}

// buildPS joins a report with the names the ledger knows; a process of a
// container in exempt is shown as exempt.
func buildPS(r observe.Report, st *ledger.State, exempt map[string]string) *psView {
	known := st.Owners()
	verdicts := map[string]string{} // device UUID + pid → verdict
	sick := map[string]bool{}       // devices found lost: that problem says why they are not listed
	// r.Time is the host's clock in its zone; the JSON gives UTC.
	v := &psView{Time: r.Time.UTC(), Devices: []psDevice{}, Problems: []problem{}, Notes: []string{}}
	for _, f := range r.Findings {
		// The verdict goes on the process's row, under the device NVML
		// listed it on: a finding on a MIG instance the inventory lacks
		// is its GPU's, the instance in f.Instance.
		on := f.Device.UUID
		if f.Instance != nil {
			on = f.Instance.UUID
		}
		k := on + "/" + strconv.Itoa(f.PID)
		switch f.Kind {
		case observe.KindIntruder:
			verdicts[k] = verdictIntruder
		case observe.KindOutOfBounds:
			verdicts[k] = verdictOutOfBounds
		case observe.KindGone:
			verdicts[k] = verdictGone
			continue
		}
		p := problem{Kind: problemIntruder, Device: f.Device.UUID, Index: f.Device.Index, ContainerID: f.ContainerID,
			Pid: f.PID, Message: f.Message}
		switch f.Kind {
		case observe.KindOutOfBounds:
			p.Kind = problemOutOfBounds
		case observe.KindUnhealthy:
			p.Kind, p.Pid = problemUnhealthy, 0
			sick[f.Device.UUID] = true
		}
		v.Problems = append(v.Problems, p)
	}
	for _, d := range r.Devices {
		pd := psDevice{Index: d.Device.Index, UUID: d.Device.UUID, Parent: d.Device.ParentUUID, Error: d.Error,
			NotInInventory: d.NotInInventory, Processes: []psProcess{}}
		var who string
		if d.Holder != "" {
			o, ok := known[d.Holder]
			if !ok {
				o = ledger.Owner{ContainerID: d.Holder}
			}
			pd.Holder = &psHolder{ContainerID: d.Holder, Name: holderName(o)}
			who = holderOf(o, time.Time{}).who()
		}
		if d.Error != "" && !reportedUnhealthy(sick, d.Device.UUID, d.Device.ParentUUID) {
			v.Problems = append(v.Problems, unobservedProblem(d.Device.UUID, d.Device.Index, d.Device.String(), who,
				"NVML could not list its processes ("+d.Error+")", "run ps again"))
		}
		if d.NotInInventory != "" {
			v.Problems = append(v.Problems, notInInventoryProblem(d.Device, d.NotInInventory, "", nil))
		}
		for _, p := range d.Processes {
			pp := psProcess{PID: p.PID, Type: p.Type, UsedMemoryBytes: p.UsedMemoryBytes, ContainerID: p.ContainerID,
				Verdict: verdictOK}
			switch {
			case p.Gone:
			case p.ContainerID == "":
				pp.Container = "host process"
			default:
				pp.Container = naming.ShortID(p.ContainerID)
				if o, ok := known[p.ContainerID]; ok {
					pp.Container = holderName(o)
				}
			}
			if vd, ok := verdicts[d.Device.UUID+"/"+strconv.Itoa(p.PID)]; ok {
				pp.Verdict = vd
			} else if _, ok := exempt[p.ContainerID]; ok && !p.Gone && p.ContainerID != "" {
				pp.Verdict = verdictExempt
			}
			pd.Processes = append(pd.Processes, pp)
		}
		v.Devices = append(v.Devices, pd)
	}
	return v
}

func (v *psView) render(w io.Writer, output string) error {
	if output == outputJSON {
		return writeJSON(w, v)
	}
	wide := output == outputWide
	header := []string{"INDEX", "UUID", "PID", "TYPE", "MEMORY", "CONTAINER", "HOLDER", "VERDICT"}
	if wide {
		header = []string{"INDEX", "UUID", "PID", "TYPE", "MEMORY", "CONTAINER", "CONTAINER ID", "HOLDER", "HOLDER ID", "VERDICT"}
	}
	t := newTable(w, header...)
	for _, d := range v.Devices {
		uuid := d.UUID
		if !wide {
			uuid = shortUUID(uuid)
		}
		holder, holderID := none, ""
		if d.Holder != nil {
			holder, holderID = d.Holder.Name, d.Holder.ContainerID
		}
		index := d.Index
		if d.NotInInventory != "" {
			// Its processes are judged like any device's; the problem
			// under the table says what the inventory's lack of it means.
			index += " (not in inventory)"
		}
		if d.Error != "" {
			row := []string{index, uuid, none, none, none, none, holder, "error: " + d.Error}
			if wide {
				row = []string{index, uuid, none, none, none, none, "", holder, holderID, "error: " + d.Error}
			}
			t.row(row...)
			continue
		}
		for _, p := range d.Processes {
			mem := none
			if p.UsedMemoryBytes > 0 {
				mem = strconv.FormatUint(p.UsedMemoryBytes>>20, 10) + "MiB"
			}
			ctr := p.Container
			if ctr == "" {
				ctr = "(exited)"
			}
			row := []string{index, uuid, strconv.Itoa(p.PID), p.Type, mem, ctr, holder, p.Verdict}
			if wide {
				row = []string{index, uuid, strconv.Itoa(p.PID), p.Type, mem, ctr, p.ContainerID, holder, holderID, p.Verdict}
			}
			t.row(row...)
		}
	}
	if err := t.flush(); err != nil {
		return err
	}
	if err := renderProblems(w, v.Problems); err != nil {
		return err
	}
	for _, n := range v.Notes {
		if _, err := fmt.Fprintln(w, escapeLine("note: "+n)); err != nil {
			return fmt.Errorf("write output: %w", err)
		}
	}
	return nil
}
