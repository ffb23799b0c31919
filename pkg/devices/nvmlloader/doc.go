// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package nvmlloader enumerates a host's GPUs and MIG instances through NVML
// (go-nvml, visited with go-nvlib) for devices.Discover, which the daemon and
// gpu-guard-ctl reach through devices.LoadInventory. It is the only package
// of the inventory and resolution path that links the NVML bindings, as
// go-nvlib keeps its NVML wrapper apart from the code that uses the result
// (the GPU observer, pkg/observe, links them for its own queries).
//
// Invariants:
//   - Load initialises NVML, enumerates, and shuts NVML down again: the
//     inventory is loaded once and cached, never per container.
//   - UUID, minor number and MIG layout are required (they are what the
//     guard matches on); model, memory and bus id are descriptive and left
//     empty when NVML cannot say.
//   - Builds without cgo compile: New returns a loader that reports NVML as
//     unavailable (devices.ErrSourceUnavailable), so source "auto" moves on
//     to /proc and the static list.
package nvmlloader
