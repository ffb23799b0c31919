// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
)

func (a *app) cordonCommand() *cobra.Command {
	var reason string
	cmd := newCommand("cordon GPU --reason TEXT",
		"Take a GPU or MIG instance out of new claims (root only, audited)",
		`Cordon a device: from now on no container may claim it — nor a MIG instance of
a cordoned GPU, nor the GPU of a cordoned MIG instance — and it is not reserved
for the queue. Its holder, if any, keeps its claim and runs on: a cordon is for
maintenance or a suspected fault, it never stops anything. A request for it is
refused (not queued) with the cordon's reason and the uncordon command.

GPU is an index ("1"), a MIG instance ("1:0") or a UUID. The reason is required
and is recorded with the operator's uid in the ledger and the audit log. The
cordon lasts until `+"`uncordon`"+`, also across a reboot (the rest of the ledger of
an earlier boot is discarded; the observer's own intruder and unhealthy
cordons too); cordoning a cordoned device again updates its reason.`,
		`  sudo gpu-guard-ctl cordon 1 --reason "ECC errors, RMA ticket 4711"
  sudo gpu-guard-ctl cordon 0:1 --reason "MIG layout change"
  sudo gpu-guard-ctl cordon GPU-6c1a2f2e-0000-4000-8000-000000000000 --reason "reseat" -o json`,
		oneDevice,
		func(cmd *cobra.Command, args []string) error {
			reason = strings.TrimSpace(reason)
			if reason == "" {
				return usagef("--reason is required: say why the device is cordoned; it is shown in every refusal and the audit log")
			}
			if len(reason) > maxReasonLen {
				return usagef("--reason is %d bytes long; keep it under %d", len(reason), maxReasonLen)
			}
			if err := a.requireRoot("cordon"); err != nil {
				return err
			}
			return a.cordon(cmd.Context(), args[0], reason)
		})
	cmd.Flags().StringVar(&reason, "reason", "", "why (required; shown in refusals and written to the audit log)")
	return cmd
}

func (a *app) uncordonCommand() *cobra.Command {
	return newCommand("uncordon GPU",
		"Lift a cordon: the device takes new claims again (root only, audited)",
		`Lift the cordon on a device (an index, "1:0" for a MIG instance, or a UUID;
also the UUID of a cordoned device no longer in the inventory, which works
when the inventory does not load too). The queue is
applied at once: the head of the queue keeps each device it asks for that is
now free (even while its other devices are held), and any other waiter whose
devices are all free gets them reserved; a request for a device kept that way
is refused "reserved for …", anyone else is admitted as usual. Uncordoning a device that is not cordoned changes nothing
and says so. Only the cordon the command read is lifted: a device cordoned
while it runs (the observer found it unhealthy) is left alone, and a cordon
changed meanwhile is refused (exit 1), naming both. Audited with the
operator's uid.`,
		`  sudo gpu-guard-ctl uncordon 1
  sudo gpu-guard-ctl uncordon 0:1 -o json`,
		oneDevice,
		func(cmd *cobra.Command, args []string) error {
			if err := a.requireRoot("uncordon"); err != nil {
				return err
			}
			return a.uncordon(cmd.Context(), args[0])
		})
}

// oneDevice requires exactly one GPU argument.
func oneDevice(cmd *cobra.Command, args []string) error {
	if len(args) != 1 {
		return usagef("%s takes one device (an index, \"<gpu>:<mig>\" or a UUID), got %d argument(s)", cmd.CommandPath(), len(args))
	}
	return nil
}

// cordonView is the output of cordon and uncordon; its JSON is a public
// interface (docs/ctl-json.md).
type cordonView struct {
	Action string `json:"action"` // "cordon" or "uncordon"
	// Changed: a new cordon, a changed reason, or a cordon lifted; false
	// for a repeat of the same cordon, or an uncordon of a device that was
	// not cordoned.
	Changed bool        `json:"changed"`
	Cordon  *cordonJSON `json:"cordon"` // the cordon in force, or the one lifted; null if none
	// device is the device named (uncordon), for the text of "not cordoned".
	device devices.Device
}

// cordonJSON is one cordon.
type cordonJSON struct {
	Device string    `json:"device"` // UUID
	Index  string    `json:"index"`
	Kind   string    `json:"kind"` // gpu or mig
	Source string    `json:"source"`
	Reason string    `json:"reason"`
	By     string    `json:"by"`
	Since  time.Time `json:"since"`
}

func cordonJSONOf(k ledger.Cordon) *cordonJSON {
	return &cordonJSON{Device: k.Device.UUID, Index: k.Device.Index, Kind: string(k.Device.Kind),
		Source: k.Source, Reason: k.Reason, By: k.By, Since: k.Since}
}

// cordonOf returns the cordon covering d in st (on d, on its GPU, or on one
// of its MIG instances), or nil: what status shows as "cordoned".
func cordonOf(st ledger.State, d devices.Device) *ledger.Cordon {
	if k := newCordonIndex(st.Cordons).lookup(d); k != nil {
		c := *k
		return &c
	}
	return nil
}

// cordonIndex finds the cordon covering a device with two map lookups: status
// builds it once per state and looks up every row, instead of scanning the
// cordons per row.
type cordonIndex struct {
	byUUID   map[string]*ledger.Cordon // by the cordoned device's UUID
	byParent map[string]*ledger.Cordon // the first (by UUID) cordon on a MIG instance, by its GPU's UUID
}

// newCordonIndex indexes ks, which it keeps pointers into (ks must not
// change while the index is used).
func newCordonIndex(ks []ledger.Cordon) cordonIndex {
	x := cordonIndex{}
	if len(ks) == 0 {
		return x
	}
	x.byUUID = make(map[string]*ledger.Cordon, len(ks))
	x.byParent = map[string]*ledger.Cordon{}
	for i := range ks {
		k := &ks[i]
		x.byUUID[k.Device.UUID] = k
		if p := k.Device.Parent; p != "" {
			if old := x.byParent[p]; old == nil || k.Device.UUID < old.Device.UUID {
				x.byParent[p] = k
			}
		}
	}
	return x
}

// lookup returns the cordon covering d, the most specific first: on d
// itself, else on its GPU, else on one of its MIG instances; nil if none.
// These are exactly the cordons devices.Conflicts finds (the ones a claim of
// d is refused for).
func (x cordonIndex) lookup(d devices.Device) *ledger.Cordon {
	if x.byUUID == nil {
		return nil
	}
	if k := x.byUUID[d.UUID]; k != nil {
		return k
	}
	if d.Parent != "" {
		if k := x.byUUID[d.Parent]; k != nil {
			return k
		}
	}
	return x.byParent[d.UUID]
}

// operatorWho names the operator running the command, for "by".
func (a *app) operatorWho() string {
	who := fmt.Sprintf("uid %d", a.env.Getuid())
	if u := a.env.Getenv("SUDO_USER"); u != "" {
		who += " (sudo user " + u + ")"
	}
	return who + " via " + programName
}

// deviceArg resolves an operator's device argument against the inventory:
// an index, "<gpu>:<mig>", or a UUID.
func deviceArg(inv *devices.Inventory, arg string) (devices.Device, error) {
	if d, ok := inv.ByIndex(arg); ok {
		return d, nil
	}
	if d, ok := inv.Lookup(arg); ok {
		return d, nil
	}
	var here []string
	for _, d := range inv.Devices() {
		here = append(here, d.Index+" ("+d.UUID+")")
	}
	list := "none"
	if len(here) > 0 {
		list = strings.Join(here, ", ")
	}
	return devices.Device{}, fmt.Errorf("no GPU or MIG instance %q on this host: %w; give an index, \"<gpu>:<mig>\" or a UUID. Devices here: %s (see `%s devices`)",
		arg, ledger.ErrNotFound, list, programName)
}

// guardFor builds a guard over the writable ledger and the inventory, for
// the commands that change device states through the guard's API.
func (a *app) guardFor() (*guard.Guard, *devices.Inventory, error) {
	cfg, err := a.config()
	if err != nil {
		return nil, nil, err
	}
	inv, _, err := a.inventory()
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %w", errInventory, err)
	}
	l, err := a.openLedger(false)
	if err != nil {
		return nil, nil, err
	}
	g, err := guard.New(guard.Options{Config: cfg, Inventory: inv, Ledger: l, Liveness: a.env.Liveness, Now: a.env.Now})
	if err != nil {
		return nil, nil, err
	}
	return g, inv, nil
}

// uncordonGuard is guardFor for uncordon of arg, which also works when the
// inventory does not load, for a device the ledger records a cordon on by
// UUID (arg): lifting a cordon needs nothing but the ledger, and the
// device may be the very GPU whose driver broke. The guard is then built
// over an empty inventory, and a warning says so. A failed hand-over to
// the NVML build stays the error: nothing stands in for NVML.
func (a *app) uncordonGuard(ctx context.Context, arg string) (*guard.Guard, *devices.Inventory, error) {
	g, inv, err := a.guardFor()
	if err == nil {
		return g, inv, nil
	}
	if _, ok := errors.AsType[*NVMLHandoverError](err); ok || !errors.Is(err, errInventory) {
		return nil, nil, err
	}
	cfg, cerr := a.config()
	if cerr != nil {
		return nil, nil, cerr
	}
	l, lerr := a.openLedger(false)
	if lerr != nil {
		return nil, nil, lerr
	}
	st, serr := l.Snapshot(ctx)
	if serr != nil {
		return nil, nil, fmt.Errorf("read ledger %s: %w", l.StatePath(), serr)
	}
	if !slices.ContainsFunc(st.Cordons, func(k ledger.Cordon) bool { return strings.EqualFold(k.Device.UUID, arg) }) {
		return nil, nil, err
	}
	empty, ierr := devices.NewInventory("none", nil)
	if ierr != nil {
		return nil, nil, fmt.Errorf("%w (and an empty one for the uncordon: %w)", err, ierr)
	}
	fmt.Fprintln(a.env.Stderr, escapeLine(fmt.Sprintf("warning: %v; lifting the cordon the ledger records on %s", err, arg)))
	g, err = guard.New(guard.Options{Config: cfg, Inventory: empty, Ledger: l, Liveness: a.env.Liveness, Now: a.env.Now})
	if err != nil {
		return nil, nil, err
	}
	return g, empty, nil
}

// errInventory marks guardFor's error when the inventory did not load.
var errInventory = errors.New("load the GPU inventory")

func (a *app) cordon(ctx context.Context, arg, reason string) error {
	g, inv, err := a.guardFor()
	if err != nil {
		return err
	}
	d, err := deviceArg(inv, arg)
	if err != nil {
		return err
	}
	by := a.operatorWho()
	k, changed, err := g.Cordon(ctx, d.UUID, ledger.CordonOperator, reason, by)
	if err != nil {
		return err
	}
	st, err := g.Ledger().Snapshot(ctx)
	if err != nil {
		return fmt.Errorf("read ledger %s: %w", g.Ledger().StatePath(), err)
	}
	return renderCordon(a.env.Stdout, a.output, cordonView{Action: "cordon", Changed: changed, Cordon: cordonJSONOf(k)},
		holdersOf(st, d))
}

func (a *app) uncordon(ctx context.Context, arg string) error {
	g, inv, err := a.uncordonGuard(ctx, arg)
	if err != nil {
		return err
	}
	st, err := g.Ledger().Snapshot(ctx)
	if err != nil {
		return fmt.Errorf("read ledger %s: %w", g.Ledger().StatePath(), err)
	}
	d, derr := deviceArg(inv, arg)
	if derr != nil {
		// A cordoned device that left the inventory is lifted by UUID.
		found := false
		for _, k := range st.Cordons {
			if strings.EqualFold(k.Device.UUID, arg) {
				d, found = k.Device, true
			}
		}
		if !found {
			return derr
		}
	}
	var seen *ledger.Cordon // the cordon on d, as read
	for _, k := range st.Cordons {
		if k.Device.UUID == d.UUID {
			seen = &k
		}
	}
	if afterUncordonLook != nil {
		afterUncordonLook()
	}
	var (
		lifted ledger.Cordon
		was    bool
	)
	if seen != nil {
		// Only the cordon read is lifted: one set since (the observer
		// found the GPU unhealthy, another operator cordoned it again)
		// is refused, and named, rather than lifted unseen.
		lifted, was, err = g.Uncordon(ctx, d.UUID, a.operatorWho(), seen)
		if errors.Is(err, guard.ErrCordonChanged) {
			return fmt.Errorf("%w; check it (`%s status`) and run uncordon again", err, programName)
		}
		if err != nil {
			return err
		}
	}
	// Not cordoned when read, nothing is lifted: a cordon set since is
	// nobody's to lift unseen. (Cordoned when read, and not when lifted:
	// someone else lifted it meanwhile.)
	if !was {
		if seen == nil && a.output != outputJSON {
			// Say where a cordon covering it is, if one is.
			if k := cordonOf(st, d); k != nil {
				_, err := fmt.Fprintf(a.env.Stdout, "%s is not cordoned itself, but %s is: run `%s uncordon %s`\n",
					naming.Device(d), naming.Device(k.Device), programName, uncordonArg(inv, k.Device))
				return writeErr(err)
			}
		}
		return renderCordon(a.env.Stdout, a.output, cordonView{Action: "uncordon", device: d}, nil)
	}
	return renderCordon(a.env.Stdout, a.output, cordonView{Action: "uncordon", Changed: true, Cordon: cordonJSONOf(lifted), device: d}, nil)
}

// afterUncordonLook, when set, is called by uncordon between its look at the
// ledger and the transaction that lifts the cordon. Only tests set it, to
// change the ledger in that window.
var afterUncordonLook func()

// uncordonArg is how `uncordon` names cordoned device d: its index while
// the inventory has d under that index, else its UUID. A cordon outlives
// its device's place in the inventory (a MIG instance gone with a layout
// change, a removed GPU): its index then names nothing, or another device.
func uncordonArg(inv *devices.Inventory, d devices.Device) string {
	if cur, ok := inv.Lookup(d.UUID); ok && d.Index != "" && cur.Index == d.Index {
		return d.Index
	}
	return d.UUID
}

// holdersOf lists who holds d or a device conflicting with it.
func holdersOf(st ledger.State, d devices.Device) []ledger.Claim {
	var out []ledger.Claim
	for _, c := range st.Claims {
		if devices.Conflicts(c.Device, d) {
			out = append(out, c)
		}
	}
	return out
}

func renderCordon(w io.Writer, output string, v cordonView, holders []ledger.Claim) error {
	if output == outputJSON {
		return writeJSON(w, v)
	}
	var line string
	switch {
	case v.Action == "cordon":
		k := v.Cordon
		dev := naming.Device(devices.Device{UUID: k.Device, Index: k.Index, Kind: devices.Kind(k.Kind)})
		verb := "cordoned"
		if !v.Changed {
			verb = "already cordoned"
		}
		line = fmt.Sprintf("%s %s since %s: %s. No new claims until `%s uncordon %s`.", verb, dev,
			k.Since.UTC().Format(time.RFC3339), k.Reason, programName, k.Index)
		for _, c := range holders {
			line += fmt.Sprintf(" %s keeps its claim on %s.", guard.HolderName(c.Owner), naming.Device(c.Device))
		}
	case v.Changed:
		k := v.Cordon
		dev := naming.Device(devices.Device{UUID: k.Device, Index: k.Index, Kind: devices.Kind(k.Kind)})
		line = fmt.Sprintf("uncordoned %s (cordoned %s by %s since %s: %s); it takes new claims again.", dev, k.Source, k.By,
			k.Since.UTC().Format(time.RFC3339), k.Reason)
	case v.device.UUID != "":
		line = naming.Device(v.device) + " is not cordoned; nothing changed."
	default:
		line = "not cordoned; nothing changed."
	}
	_, err := fmt.Fprintln(w, escapeLine(line))
	return writeErr(err)
}

func writeErr(err error) error {
	if err != nil {
		return fmt.Errorf("write output: %w", err)
	}
	return nil
}
