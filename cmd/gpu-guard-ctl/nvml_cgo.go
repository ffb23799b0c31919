// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package main

// withNVML: a cgo build links NVML (go-nvml) and runs every command itself.
const withNVML = true
