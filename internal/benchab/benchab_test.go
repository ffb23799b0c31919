// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package benchab

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestStats(t *testing.T) {
	var d []time.Duration
	for i := 100; i >= 1; i-- { // unsorted on purpose
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	s := Stats(d)
	require.Equal(t, 50*time.Millisecond, s.P50)
	require.Equal(t, 99*time.Millisecond, s.P99)
	require.Equal(t, Summary{P50: 7, P99: 7}, Stats([]time.Duration{7}))
	require.Equal(t, Summary{}, Stats(nil))
	require.Equal(t, Summary{P50: 1, P99: 2}, Stats([]time.Duration{2, 1}))
}
