// Package daemon builds what the NRI daemon decides with, from a
// configuration: the ledger, the GPU inventory (loaded through NVML once and
// written to the cache the OCI hooks and gpu-guard-ctl read) and the guard
// over both. Builder.Setup is the nriplugin.SetupFunc the daemon hands to the
// NRI adapter; cmd/nri-gpu-guard wires it together with the metrics
// endpoint.
//
// Invariants:
//   - A Setup with an unchanged configuration reuses the ledger and the
//     inventory: a reconnect (which calls Configure again) costs no NVML
//     enumeration.
//   - When NVML and the configured source fail, the cached inventory is
//     used (with a warning); with neither, Setup fails and the daemon
//     refuses to start rather than decide without an inventory.
//   - Failing to write the inventory cache is not fatal: the hooks fall back
//     to discovering the GPUs themselves.
package daemon
