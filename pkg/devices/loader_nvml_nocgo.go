//go:build !cgo

package devices

import (
	"fmt"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// NVMLInterface stands in for go-nvml's nvml.Interface, which needs cgo; in
// this build only nil is meaningful.
type NVMLInterface = any

type nvmlLoader struct{}

// NewNVMLLoader returns the NVML loader. This build has no cgo, hence no
// NVML: Load always fails with ErrSourceUnavailable, and source "auto" moves
// on to /proc and the static list.
func NewNVMLLoader(NVMLInterface) Loader { return nvmlLoader{} }

func (nvmlLoader) Name() string { return string(config.SourceNVML) }

func (nvmlLoader) Load() ([]GPU, error) {
	return nil, fmt.Errorf("%w: nvml: this binary was built without cgo", ErrSourceUnavailable)
}
