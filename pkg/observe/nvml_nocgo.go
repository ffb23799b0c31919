// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build !cgo

package observe

import (
	"errors"
	"fmt"
)

// NVMLInterface stands in for go-nvml's nvml.Interface, which needs cgo; in
// this build only nil is meaningful.
type NVMLInterface = any

// ErrNVMLUnavailable is wrapped when NVML cannot be initialised.
var ErrNVMLUnavailable = errors.New("NVML is not available")

// OpenNVML always fails in a build without cgo: there is no NVML to observe.
func OpenNVML(NVMLInterface) (Source, error) {
	return nil, fmt.Errorf("observe: %w: this binary was built without cgo", ErrNVMLUnavailable)
}
