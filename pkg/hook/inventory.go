// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// loadInventory returns the GPUs to resolve a request against, in the order
// every program shares (devices.LoadInventory as RoleHook): a static source's
// list; else the daemon's cache when it is trusted; else /proc/driver/nvidia
// (then the static list under "auto"). It never initialises NVML: a hook
// runs once per container, NVML init costs tens of milliseconds to seconds
// and needs the driver library in the hook's mount namespace.
//
// The boot id tells a cache of this boot, used as it is, from one of an
// earlier boot, checked against /proc/driver/nvidia first (the GPUs may have
// changed while the host was down). It is the one the ledger opens with:
// ledger.HostBootID reads the file once per process. Unreadable, it is
// unknown, and the cache is checked.
func loadInventory(cfg config.Config) (*devices.Inventory, error) {
	boot, _ := ledger.HostBootID()
	loaded, err := devices.LoadInventory(cfg.Devices, devices.LoadOptions{Role: devices.RoleHook, StateDir: cfg.Ledger.Dir, BootID: boot})
	if err != nil {
		return nil, err
	}
	return loaded.Inventory, nil
}

// emptyInventory is an inventory with no GPU, used where the real one is not
// needed (poststop).
func emptyInventory() *devices.Inventory {
	inv, err := devices.NewInventory("none", nil)
	if err != nil {
		// NewInventory of nothing has nothing to reject; keep a usable value.
		return &devices.Inventory{Source: "none"}
	}
	return inv
}
