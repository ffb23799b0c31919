// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

func (a *app) devicesCommand() *cobra.Command {
	var refresh bool
	cmd := newCommand("devices",
		"Show the GPU inventory and where it came from",
		`Show the GPUs and MIG instances the guard knows, and their source (nvml, proc
or static). Under devices.source = "static" it is the configured list;
otherwise it is the daemon's cache (<state dir>/inventory.json) when that is
a root-owned regular file not writable by group or others, and without one
the GPUs are discovered as the daemon would, per [devices] of the
configuration.

--refresh discovers the GPUs now and rewrites the cache (root only); the daemon
reads the cache when it starts. Use it after adding, removing or
reconfiguring GPUs (MIG), then restart the daemon.`,
		`  gpu-guard-ctl devices
  gpu-guard-ctl devices -o json | jq -r '.gpus[].uuid'
  sudo gpu-guard-ctl devices --refresh`,
		noArgs,
		func(_ *cobra.Command, _ []string) error {
			var (
				inv  *devices.Inventory
				info inventoryInfo
				err  error
			)
			if refresh {
				inv, info, err = a.refreshInventory()
			} else {
				inv, info, err = a.inventory()
			}
			if err != nil {
				return err
			}
			return renderDevices(a.env.Stdout, a.output, inv, info, a.env.Now())
		})
	cmd.Flags().BoolVar(&refresh, "refresh", false, "discover the GPUs now and rewrite the inventory cache (root only)")
	return cmd
}

// refreshInventory rediscovers the GPUs and rewrites the cache
// (devices.RoleRefresh).
func (a *app) refreshInventory() (*devices.Inventory, inventoryInfo, error) {
	if err := a.requireRoot("devices --refresh"); err != nil {
		return nil, inventoryInfo{}, err
	}
	inv, info, err := a.loadInventory(devices.RoleRefresh)
	info.printWarnings(a.env.Stderr)
	return inv, info, err
}

// devicesView is the devices output; its JSON is a public interface.
type devicesView struct {
	Source    string        `json:"source"`
	Origin    string        `json:"origin"`
	CachePath string        `json:"cache_path"`
	CachedAt  *time.Time    `json:"cached_at,omitempty"`
	GPUs      []devices.GPU `json:"gpus"`
	// Unchecked: a static list not checked against the NVIDIA driver in
	// full (devices.Inventory.Unchecked), omitted when checked.
	Unchecked devices.Unchecked `json:"unchecked,omitempty"`
	Notes     []string          `json:"notes,omitempty"`
}

func renderDevices(w io.Writer, output string, inv *devices.Inventory, info inventoryInfo, now time.Time) error {
	if output == outputJSON {
		v := devicesView{
			Source: inv.Source, Origin: info.Origin, CachePath: info.CachePath,
			CachedAt: timeOrNil(info.CachedAt), GPUs: inv.GPUs, Unchecked: inv.Unchecked, Notes: inv.Notes,
		}
		if v.GPUs == nil {
			v.GPUs = []devices.GPU{}
		}
		return writeJSON(w, v)
	}
	origin := "discovered now"
	switch info.Origin {
	case string(devices.OriginConfig):
		origin = "configuration"
	case string(devices.OriginCache):
		origin = "cache " + info.CachePath
		if !info.CachedAt.IsZero() {
			origin += ", written " + since(now, info.CachedAt) + " ago"
		}
	}
	if _, err := fmt.Fprintf(w, "Source: %s (%s)\n", escapeLine(inv.Source), escapeLine(origin)); err != nil {
		return fmt.Errorf("write output: %w", err)
	}
	// An operator reading the list wants to know the driver has not
	// vouched for it (the daemon re-checks it in the background).
	unchecked := ""
	switch inv.Unchecked {
	case devices.UncheckedNoDriver:
		unchecked = "Not checked against the NVIDIA driver: no driver tree under devices.proc_root (not loaded yet, or fake GPUs)\n"
	case devices.UncheckedUUIDs:
		unchecked = "Checked against the NVIDIA driver by minor and index only: it does not show every GPU's UUID yet (nvidia-smi -pm 1)\n"
	}
	if _, err := fmt.Fprint(w, unchecked+"\n"); err != nil {
		return fmt.Errorf("write output: %w", err)
	}
	wide := output == outputWide
	header := []string{"INDEX", "UUID", "KIND", "MODEL", "MEMORY", "MINOR", "BUS ID"}
	if wide {
		header = append(header, "GI/CI")
	}
	t := newTable(w, header...)
	row := func(d devices.Device, model string, mib uint64, minor, bus, gici string) {
		u := d.UUID
		if !wide {
			u = shortUUID(u)
		}
		cells := []string{d.Index, u, string(d.Kind), model, memory(mib), minor, bus}
		if wide {
			cells = append(cells, gici)
		}
		t.row(cells...)
	}
	for _, g := range inv.GPUs {
		d, _ := inv.Lookup(g.UUID)
		row(d, g.Model, g.MemoryMiB, strconv.Itoa(g.Minor), g.BusID, "")
		for _, m := range g.MIG {
			d, _ := inv.Lookup(m.UUID)
			row(d, migModel(g, m), m.MemoryMiB, "", "", fmt.Sprintf("%d/%d", m.GI, m.CI))
		}
	}
	if err := t.flush(); err != nil {
		return err
	}
	for _, n := range inv.Notes {
		if _, err := fmt.Fprintf(w, "note: %s\n", escapeLine(n)); err != nil {
			return fmt.Errorf("write output: %w", err)
		}
	}
	return nil
}

// memory renders a MiB figure, "-" when unknown.
func memory(mib uint64) string {
	if mib == 0 {
		return none
	}
	return strconv.FormatUint(mib, 10) + " MiB"
}
