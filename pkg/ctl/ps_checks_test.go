// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package ctl

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// TestPSTimeIsUTC: ps's time comes from the host's clock, in its zone; the
// JSON gives it in UTC, as every time ctl prints (docs/ctl-json.md).
func TestPSTimeIsUTC(t *testing.T) {
	at := now.In(time.FixedZone("CET", 3600))
	v := buildPS(observe.Report{Time: at}, &ledger.State{}, nil)
	b, err := json.Marshal(v)
	require.NoError(t, err)
	assert.True(t, strings.HasPrefix(string(b), `{"time":"2026-03-01T12:00:00Z",`), string(b))
}
