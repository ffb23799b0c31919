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
		switch i % 50 {
		case 7:
			// A time encoding/json refuses.
			v.Waiters = append(v.Waiters, waiterJSON{LastSeen: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)})
		case 17:
			v.Waiters = append(v.Waiters, waiterJSON{FirstSeen: time.Date(-1, 1, 1, 0, 0, 0, 0, time.UTC)})
		case 27:
			v.Waiters = append(v.Waiters, waiterJSON{LastSeen: time.Unix(0, 0).In(time.FixedZone("far", 24*3600))})
		case 37:
			v.Waiters = append(v.Waiters, waiterJSON{FirstSeen: time.Unix(0, 0).In(time.FixedZone("farther", -100*3600-59))})
		case 47:
			// Written: the offset's seconds are dropped, its hours are 23.
			v.Waiters = append(v.Waiters, waiterJSON{FirstSeen: time.Unix(0, 0).In(time.FixedZone("near", -(23*3600 + 59*60 + 59)))})
		}
		var fast, slow bytes.Buffer
		ferr, serr := writeQueueJSON(&fast, &v), writeJSON(&slow, v)
		if serr != nil {
			require.Contains(t, []int{7, 17, 27, 37}, i%50, "view %d: %v", i, serr)
			require.EqualError(t, ferr, serr.Error(), "view %d", i)
			continue
		}
		require.NoError(t, ferr, "view %d", i)
		require.Equal(t, slow.String(), fast.String(), "view %d", i)
	}
}

// chunkRecorder records the size of every write.
type chunkRecorder struct {
	bytes.Buffer
	writes []int
}

func (c *chunkRecorder) Write(p []byte) (int, error) {
	c.writes = append(c.writes, len(p))
	return c.Buffer.Write(p)
}

// A long queue is written in chunks, through one buffer, and the chunks add
// up to encoding/json's bytes.
func TestQueueJSONInChunks(t *testing.T) {
	var v queueView
	at := time.Date(2026, 3, 1, 12, 0, 0, 5, time.UTC)
	for i := range 2000 {
		v.Waiters = append(v.Waiters, waiterJSON{Position: i + 1, QueueLength: 2000, Requester: "ns/uid/ctr", ContainerID: "c",
			Devices: []string{"GPU-0", "GPU-1"}, FirstSeen: at, LastSeen: at.Add(time.Duration(i)), Reserved: []string{}})
	}
	var fast chunkRecorder
	var slow bytes.Buffer
	require.NoError(t, writeQueueJSON(&fast, &v))
	require.NoError(t, writeJSON(&slow, v))
	require.Equal(t, slow.String(), fast.String())
	require.Greater(t, len(fast.writes), 10)
	for _, n := range fast.writes {
		require.Less(t, n, queueChunk+4096, "one write of %d bytes", n)
	}
}
