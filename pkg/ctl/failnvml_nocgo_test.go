// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build !cgo

package ctl

import "github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices/nvmlloader"

// failingNVML is an NVML that is not there: a build without cgo has none,
// whatever is passed.
func failingNVML() nvmlloader.Interface { return nil }
