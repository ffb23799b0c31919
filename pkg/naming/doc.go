// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package naming renders devices and containers for people, the same way in
// every message, log line and ctl output: "GPU 1 (GPU-…)", "MIG 1:0 (MIG-…)",
// "ns/pod/container (id 0123456789ab)".
//
// Invariants:
//   - A device is named by its index (when known) and its full UUID, never
//     by the index alone: indices differ between tools, UUIDs do not.
//   - A container is named by what the operator knows it by (namespace, pod,
//     container) and the 12-character id prefix runtimes print.
//   - It imports no package of this project but devices (for the Device
//     type), so the ledger, the guard and the front ends can all use it.
package naming
