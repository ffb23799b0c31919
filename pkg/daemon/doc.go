// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package daemon builds what the NRI daemon decides with, from a
// configuration: the ledger, the GPU inventory (discovered once, NVML
// included, and written to the cache the OCI hooks and gpu-guard-ctl read) and the guard
// over both. Builder.Setup is the nriplugin.SetupFunc the daemon hands to the
// NRI adapter; cmd/nri-gpu-guard wires it together with the metrics
// endpoint.
//
// Invariants:
//   - The inventory is loaded by devices.LoadInventory as RoleDaemon, the
//     order every program shares: a static source is the configured list;
//     otherwise discover, write the cache, and fall back to a trusted cache
//     (with a warning) when discovery fails. With neither, Setup fails and
//     the daemon refuses to start rather than decide without an inventory.
//   - A Setup with an unchanged [devices] section and state directory reuses
//     the ledger and the inventory: a reconnect (which calls Configure again)
//     costs no NVML enumeration.
//   - Failing to write the inventory cache is not fatal: the hooks fall back
//     to discovering the GPUs themselves, and the next Setup loads and
//     writes again.
package daemon
