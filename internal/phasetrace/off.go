// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build !phasetrace

package phasetrace

// Mark ends a phase; without the phasetrace build tag it does nothing.
func Mark(string) {}
