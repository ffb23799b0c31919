// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package benchab runs interleaved A/B process benchmarks: several commands
// timed in turn, round after round, so that a load change on the machine
// hits every variant alike, and reported as medians, 99th percentiles and
// their ratios to a baseline. Only benchmarks import it.
package benchab

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// Variant is one thing to time: Run does it once and returns how long the
// timed part took (setup around it is not counted).
type Variant struct {
	Name string
	Run  func() (time.Duration, error)
}

// Samples are the timings of each variant of a Run, by name.
type Samples map[string][]time.Duration

// ReportRatio reports the ratio of num's median and of its p99 to den's, as
// "num/den-p50" and "num/den-p99" (nothing when den has no samples): for a
// comparison other than with the baseline.
func (s Samples) ReportRatio(b *testing.B, num, den string) {
	b.Helper()
	n, d := Stats(slices.Clone(s[num])), Stats(slices.Clone(s[den]))
	if d.P50 == 0 || d.P99 == 0 {
		return
	}
	b.ReportMetric(float64(n.P50)/float64(d.P50), num+"/"+den+"-p50")
	b.ReportMetric(float64(n.P99)/float64(d.P99), num+"/"+den+"-p99")
}

// ReportDiff reports the median over rounds of num's time minus den's in
// the same round, in ms, as "num-den-ms": what num costs beyond den, paired
// round by round. A ratio of medians moves with how fast den is on the day
// (the same per-process cost is a larger share of a faster `runc run`) and
// with where in a wide distribution each median falls; the paired
// difference does neither, so it is the figure to compare across runs.
// Nothing when either has no samples.
func (s Samples) ReportDiff(b *testing.B, num, den string) {
	b.Helper()
	if d, ok := s.PairedDiff(num, den); ok {
		b.ReportMetric(ms(d), num+"-"+den+"-ms")
	}
}

// PairedDiff is the median over rounds of num's time minus den's in the same
// round; false when either has no samples.
func (s Samples) PairedDiff(num, den string) (time.Duration, bool) {
	n, d := s[num], s[den]
	k := min(len(n), len(d))
	if k == 0 {
		return 0, false
	}
	diffs := make([]time.Duration, k)
	for i := range k {
		diffs[i] = n[i] - d[i]
	}
	slices.Sort(diffs)
	if k%2 == 1 {
		return diffs[k/2], true
	}
	return (diffs[k/2-1] + diffs[k/2]) / 2, true
}

// Run times every variant once per b.Loop round, in an order shuffled anew
// each round, and reports for each its median and p99 in ms and, for each
// but the first (the baseline), the ratio of its median and of its p99 to
// the baseline's. It returns every variant's samples, one per round in
// round order, for further ratios and paired differences (ReportRatio,
// ReportDiff).
//
// Why shuffled: what one run leaves behind (a cgroup being torn down, dirty
// pages, a disk flush in flight) can slow the next one. With a fixed order,
// or one merely rotated each round, each variant nearly always follows the
// same other one and carries its after-effects: a `runc run` without hooks
// that always follows one whose hooks fdatasync is measured slower than it
// is. Shuffled, every variant follows every other about equally often. The
// seed is fixed, so that two runs of a benchmark use the same orders.
func Run(b *testing.B, variants []Variant) Samples {
	b.Helper()
	samples := make([][]time.Duration, len(variants))
	order := newOrder(len(variants))
	for b.Loop() {
		for _, v := range order.next() {
			d, err := variants[v].Run()
			if err != nil {
				b.Fatalf("%s: %v", variants[v].Name, err)
			}
			samples[v] = append(samples[v], d)
		}
	}
	// Stats sorts: summarise copies, and hand back the samples in round
	// order (ReportDiff pairs them by round).
	base := Stats(slices.Clone(samples[0]))
	for v, vr := range variants {
		s := Stats(slices.Clone(samples[v]))
		b.ReportMetric(ms(s.P50), vr.Name+"-p50-ms")
		b.ReportMetric(ms(s.P99), vr.Name+"-p99-ms")
		if v > 0 {
			b.ReportMetric(float64(s.P50)/float64(base.P50), fmt.Sprintf("%s/%s-p50", vr.Name, variants[0].Name))
			b.ReportMetric(float64(s.P99)/float64(base.P99), fmt.Sprintf("%s/%s-p99", vr.Name, variants[0].Name))
		}
	}
	// The default ns/op is the sum over the variants: meaningless here.
	b.ReportMetric(0, "ns/op")
	out := make(Samples, len(variants))
	for v, vr := range variants {
		out[vr.Name] = samples[v]
	}
	return out
}

// Summary is a sample's median and 99th percentile (nearest rank).
type Summary struct{ P50, P99 time.Duration }

// Stats summarises d (which it sorts in place).
func Stats(d []time.Duration) Summary {
	if len(d) == 0 {
		return Summary{}
	}
	slices.Sort(d)
	rank := func(p float64) time.Duration {
		i := int(p*float64(len(d))+0.999999) - 1
		return d[min(max(i, 0), len(d)-1)]
	}
	return Summary{P50: rank(0.50), P99: rank(0.99)}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// roundOrder hands out one permutation of the variants per round.
type roundOrder struct {
	rng  *rand.Rand
	perm []int
}

func newOrder(n int) *roundOrder {
	perm := make([]int, n)
	for i := range perm {
		perm[i] = i
	}
	return &roundOrder{rng: rand.New(rand.NewPCG(1, 2)), perm: perm} //nolint:gosec // an order of benchmark runs, not a secret
}

// next shuffles the permutation in place and returns it.
func (o *roundOrder) next() []int {
	o.rng.Shuffle(len(o.perm), func(i, j int) { o.perm[i], o.perm[j] = o.perm[j], o.perm[i] })
	return o.perm
}
