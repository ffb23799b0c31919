// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build !cgo

package main

// withNVML: a build without cgo has no NVML; commands that need it are run
// by `nri-gpu-guard ctl`.
const withNVML = false
