// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"fmt"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

type staticLoader struct {
	gpus []config.StaticGPU
}

// NewStaticLoader returns the loader for the configuration's
// [[devices.static]] list. An empty list is ErrSourceUnavailable, so that
// source "auto" moves on.
func NewStaticLoader(gpus []config.StaticGPU) Loader {
	return &staticLoader{gpus: gpus}
}

func (l *staticLoader) Name() string { return string(config.SourceStatic) }

func (l *staticLoader) Load() ([]GPU, error) {
	if len(l.gpus) == 0 {
		return nil, fmt.Errorf("%w: static: no [[devices.static]] GPU is configured", ErrSourceUnavailable)
	}
	out := make([]GPU, 0, len(l.gpus))
	for _, s := range l.gpus {
		g := GPU{Index: s.Index, UUID: s.UUID, Minor: s.Minor, Model: s.Model, MemoryMiB: s.MemoryMiB}
		for _, m := range s.MIG {
			g.MIG = append(g.MIG, MIG{
				Index: m.Index, UUID: m.UUID, GI: m.GI, CI: m.CI,
				ParentUUID: s.UUID, ParentIndex: s.Index,
			})
		}
		out = append(out, g)
	}
	return out, nil
}
