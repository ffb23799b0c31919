// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package ctl

import (
	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices/nvmlloader"
)

// failingNVML is an NVML whose library is not there, whatever GPUs the
// machine running the tests has.
func failingNVML() nvmlloader.Interface {
	srv := dgxa100.New()
	srv.InitFunc = func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }
	return srv
}
