// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build !cgo

package nvmlloader

import (
	"fmt"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// Interface stands in for go-nvml's nvml.Interface, which needs cgo; in this
// build only nil is meaningful.
type Interface = any

type nvmlLoader struct{}

// New returns the NVML loader. This build has no cgo, hence no NVML: Load
// always fails with devices.ErrSourceUnavailable, and source "auto" moves on
// to /proc and the static list.
func New(Interface) devices.Loader { return nvmlLoader{} }

func (nvmlLoader) Name() string { return string(config.SourceNVML) }

func (nvmlLoader) Load() ([]devices.GPU, error) {
	return nil, fmt.Errorf("%w: nvml: this binary was built without cgo", devices.ErrSourceUnavailable)
}
