// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package benchab

import (
	"os"
	"path/filepath"
	"slices"
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

// Run hands back every variant's samples by name, one per round, and
// ReportRatio reports the ratio of two of them.
func TestRunReturnsSamplesByName(t *testing.T) {
	var samples Samples
	res := testing.Benchmark(func(b *testing.B) {
		k := 0 // counts down round by round: sorted, it would count up
		variants := []Variant{
			{Name: "one", Run: func() (time.Duration, error) { return time.Millisecond, nil }},
			{Name: "three", Run: func() (time.Duration, error) { return 3 * time.Millisecond, nil }},
			{Name: "count", Run: func() (time.Duration, error) { k++; return time.Hour - time.Duration(k), nil }},
		}
		samples = Run(b, variants)
		samples.ReportRatio(b, "one", "three")
	})
	require.Len(t, samples["one"], res.N)
	// In round order, not sorted: ReportDiff pairs them by round.
	require.Len(t, samples["count"], res.N)
	for i, d := range samples["count"] {
		require.Equal(t, time.Hour-time.Duration(i+1), d, "round %d", i)
	}
	require.Len(t, samples["three"], res.N)
	require.InDelta(t, 3.0, res.Extra["three/one-p50"], 1e-9)
	require.InDelta(t, 1.0/3, res.Extra["one/three-p50"], 1e-9)
	require.InDelta(t, 1.0/3, res.Extra["one/three-p99"], 1e-9)
}

// PairedDiff pairs the samples round by round: a variant that costs 2 ms
// more than its baseline in every round reads 2 ms, however much the rounds
// themselves differ, where the difference of the medians reads otherwise.
func TestPairedDiff(t *testing.T) {
	ms := func(v ...int) []time.Duration {
		out := make([]time.Duration, len(v))
		for i, x := range v {
			out[i] = time.Duration(x) * time.Millisecond
		}
		return out
	}
	s := Samples{
		"plain": ms(10, 30, 11, 31, 12),
		"hook":  ms(12, 32, 13, 33, 20),
		"odd":   ms(11, 35, 14, 31),
	}
	d, ok := s.PairedDiff("hook", "plain")
	require.True(t, ok)
	require.Equal(t, 2*time.Millisecond, d)
	require.Equal(t, 8*time.Millisecond, Stats(slices.Clone(s["hook"])).P50-Stats(slices.Clone(s["plain"])).P50,
		"the medians' difference is not the paired one")
	// Unequal lengths pair the common rounds; an even count takes the
	// mean of the middle two differences (1, 5, 3, 0 -> 1 and 3).
	d, ok = s.PairedDiff("odd", "plain")
	require.True(t, ok)
	require.Equal(t, 2*time.Millisecond, d)
	_, ok = s.PairedDiff("hook", "none")
	require.False(t, ok)
}

// Each round times every variant exactly once, and across rounds every
// variant follows every other one: no variant carries the after-effects of
// one fixed predecessor (a rotated order gave each nearly always the same).
func TestOrderMixesPredecessors(t *testing.T) {
	const n, rounds = 9, 150
	o := newOrder(n)
	follows := make(map[[2]int]int)
	prev := -1
	for range rounds {
		seen := make(map[int]bool, n)
		for _, v := range o.next() {
			require.False(t, seen[v], "variant %d twice in one round", v)
			seen[v] = true
			if prev >= 0 {
				follows[[2]int{prev, v}]++
			}
			prev = v
		}
		require.Len(t, seen, n)
	}
	for a := range n {
		for b := range n {
			if a != b {
				require.Positive(t, follows[[2]int{a, b}], "variant %d never follows variant %d in %d rounds", b, a, rounds)
			}
		}
	}
}

// Installed makes a byte-identical executable copy next to the original.
func TestInstalled(t *testing.T) {
	src := filepath.Join(t.TempDir(), "prog")
	require.NoError(t, os.WriteFile(src, []byte("#!/bin/sh\nexit 0\n"), 0o700))
	dir := t.TempDir()
	dst, err := Installed(src, dir)
	require.NoError(t, err)
	require.Equal(t, filepath.Join(dir, "prog"), dst)
	got, err := os.ReadFile(dst)
	require.NoError(t, err)
	require.Equal(t, "#!/bin/sh\nexit 0\n", string(got))
	fi, err := os.Stat(dst)
	require.NoError(t, err)
	require.NotZero(t, fi.Mode()&0o100, "executable")
	_, err = Installed(filepath.Join(t.TempDir(), "missing"), dir)
	require.Error(t, err)
	_, err = Installed(src, filepath.Dir(src))
	require.ErrorContains(t, err, "would replace it")
}
