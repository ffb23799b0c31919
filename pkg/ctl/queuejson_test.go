// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"bytes"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// writeQueueJSON writes the same bytes as encoding/json (writeJSON) for any
// queue view: odd strings, nil and empty lists, times in other zones, and a
// time encoding/json refuses (the same error then).
func TestQueueJSONMatchesEncodingJSON(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	pieces := []string{"a", "ns", "GPU-0", "pod-1", "", `"`, `\`, "<", ">", "&", "é", "😀", "\u2028", "\u2029", "\x00", "\n", "\t", "\x1f", "\x7f", "\xff", "\xc3", " "}
	str := func() string {
		var s string
		for range rng.IntN(5) {
			s += pieces[rng.IntN(len(pieces))]
		}
		return s
	}
	list := func() []string {
		switch rng.IntN(4) {
		case 0:
			return nil
		case 1:
			return []string{}
		}
		var l []string
		for range 1 + rng.IntN(3) {
			l = append(l, str())
		}
		return l
	}
	zones := []*time.Location{time.UTC, time.FixedZone("x", 5*3600+30*60), time.FixedZone("y", -7*3600)}
	when := func() time.Time {
		if rng.IntN(5) == 0 {
			return time.Time{}
		}
		return time.Unix(rng.Int64N(4e9), rng.Int64N(1e9)*int64(rng.IntN(2))).In(zones[rng.IntN(len(zones))])
	}
	for i := range 500 {
		var v queueView
		switch rng.IntN(6) {
		case 0: // nil
		case 1:
			v.Waiters = []waiterJSON{}
		default:
			for range 1 + rng.IntN(4) {
				v.Waiters = append(v.Waiters, waiterJSON{
					Position: rng.IntN(100) - 5, QueueLength: rng.IntN(100), Requester: str(), ContainerID: str(),
					Namespace: str(), Pod: str(), PodUID: str(), Container: str(), Devices: list(),
					FirstSeen: when(), LastSeen: when(), WaitedSeconds: rng.Int64N(1e6) - 10, Reserved: list(),
				})
			}
		}
		if i%50 == 7 {
			// A time encoding/json refuses.
			v.Waiters = append(v.Waiters, waiterJSON{LastSeen: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)})
		}
		var fast, slow bytes.Buffer
		ferr, serr := writeQueueJSON(&fast, &v), writeJSON(&slow, v)
		if serr != nil {
			require.Equal(t, 7, i%50, "view %d: %v", i, serr)
			require.EqualError(t, ferr, serr.Error(), "view %d", i)
			continue
		}
		require.NoError(t, ferr, "view %d", i)
		require.Equal(t, slow.String(), fast.String(), "view %d", i)
	}
}
