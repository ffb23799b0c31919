// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package runtimescan turns what the OCI runtimes' state directories list
// (package runtimestate) into holdings of the OCI hook front end: for each
// live container, the owner the hook would have recorded and the GPUs its
// spec resolves to with the guard's inventory and policy. It is what a
// ledger that lost claims is rebuilt from where no containerd lists the
// containers: `gpu-guard-ctl recover` on a hook host, and the NRI daemon's
// own recovery on a host where podman or CRI-O containers run beside
// containerd's.
//
// Invariants:
//   - Every live container is listed, even one without a GPU or whose GPUs
//     cannot be told (its spec unreadable, its request no longer resolving):
//     a claim it holds is never released while it runs. Only resolved
//     devices are ever adopted.
//   - It reads only: nothing is written to the ledger or the runtimes' dirs.
//   - The GPU inventory is needed only when a live container exists.
package runtimescan
