// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"strings"

	"github.com/prometheus/client_golang/prometheus"
)

// seriesSet is a gauge vector whose whole set of series is replaced at once
// (the holders of the ledger's claims, the findings of an observer pass).
// GaugeVec.Reset followed by a refill left a moment in which a series that
// is there both before and after was missing, and a scrape running
// alongside read a held GPU as free or an intruder as gone (an alert that
// clears and fires again). replace sets the new values first and deletes
// only the series that went: a scrape sees each series at its old or its
// new value. Its caller serialises the calls (each gauge has its mutex).
type seriesSet struct {
	vec *prometheus.GaugeVec
	// shown holds the label values of the series set now, by their
	// joined form.
	shown map[string][]string
}

// series is one series of a seriesSet: its label values, in the vector's
// order, and its value.
type series struct {
	labels []string
	value  float64
}

func newSeriesSet(vec *prometheus.GaugeVec) seriesSet {
	return seriesSet{vec: vec, shown: map[string][]string{}}
}

// replace makes next the set's series. Two entries with the same labels
// leave the later one's value.
func (s *seriesSet) replace(next []series) {
	keep := make(map[string][]string, len(next))
	for _, x := range next {
		s.vec.WithLabelValues(x.labels...).Set(x.value)
		keep[strings.Join(x.labels, "\x00")] = x.labels
	}
	for k, labels := range s.shown {
		if _, ok := keep[k]; !ok {
			s.vec.DeleteLabelValues(labels...)
		}
	}
	s.shown = keep
}
