// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package gpuid owns the syntax of NVIDIA GPU identities that both the
// configuration and the device inventory check: the UUID forms NVML reports
// (GPU-<uuid>, MIG-<uuid>) and the range of /dev/nvidia<N> minor numbers that
// name a GPU.
//
// Invariants:
//   - It is a leaf: it imports only the standard library and uses no cgo,
//     so the configuration can check identities without the NVML bindings.
//   - The checks are syntactic and exact: the prefix is case-sensitive, the
//     36-character UUID has dashes at positions 8, 13, 18 and 23 and hex
//     digits (either case) elsewhere.
package gpuid
