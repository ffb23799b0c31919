// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package config

import (
	"fmt"
	"time"
)

// Duration is a time.Duration written in TOML as a Go duration string ("250ms", "6m").
type Duration struct {
	time.Duration
}

// UnmarshalText parses a Go duration string.
func (d *Duration) UnmarshalText(text []byte) error {
	v, err := time.ParseDuration(string(text))
	if err != nil {
		return fmt.Errorf("invalid duration %q (use a number with a unit, e.g. \"250ms\", \"6m\"): %w", text, err)
	}
	d.Duration = v
	return nil
}

// MarshalText writes the duration in Go syntax.
func (d Duration) MarshalText() ([]byte, error) {
	return []byte(d.String()), nil
}
