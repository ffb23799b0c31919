// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
)

// Decision.BusyText says what the refusal says about each busy device —
// the holder and the device it holds, the waiter a device is reserved or
// kept for (by name, not by requester key) and through which device — and
// says it again after the deciding transaction ended, with ages counted
// then: the waiting OCI hook and gpu-guard-ctl run print it in their
// progress lines and give-up errors.
func TestBusyTextSaysWhatTheRefusalSays(t *testing.T) {
	x := ctr("ml", "x", "main", "xxxx000000000001")
	h := ctr("ml", "h", "main", "hhhh000000000001")
	y := ctr("ml", "y", "main", "yyyy000000000001")
	for _, tc := range []struct {
		name  string
		setup func(e *env)
		spec  string
		words string
	}{
		{
			name:  "held through a MIG instance",
			setup: func(e *env) { require.Equal(t, guard.Admit, e.admit(x, visible("3:0")).Result) },
			spec:  "3",
			words: "GPU 3 (" + uuid(3) + ") is held by ml/x/main (id xxxx00000000) through MIG 3:0 (" + migUUID(0) + ") since ",
		},
		{
			name: "reserved through the GPU, for a waiter named by its container",
			setup: func(e *env) {
				require.Equal(t, guard.Admit, e.admit(x, visible("1")).Result)
				require.Equal(t, guard.Queue, e.admit(h, visible("1,3")).Result) // the head: GPU 3 reserved for it
			},
			spec: "3:1",
			words: "MIG 3:1 (" + migUUID(1) + ") is reserved for ml/h/main (id hhhh00000000) through GPU 3 (" + uuid(3) +
				") (earlier in the queue, first in line: kept for it until the other devices it asks for are free) until ",
		},
		{
			name: "kept for the head of the queue",
			setup: func(e *env) {
				require.Equal(t, guard.Admit, e.admit(x, visible("3:0")).Result)
				require.Equal(t, guard.Queue, e.admit(h, visible("3")).Result)
			},
			spec: "3:1",
			words: "MIG 3:1 (" + migUUID(1) + ") is kept for ml/h/main (id hhhh00000000) (earlier in the queue, first in line for GPU 3 (" +
				uuid(3) + "), which waits until the rest of it is free)",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, nil)
			tc.setup(e)
			d := e.admit(y, visible(tc.spec))
			require.Equal(t, guard.Queue, d.Result, d.Message)
			decided := e.clock.Now()
			text := d.BusyText(decided)
			assert.True(t, strings.HasPrefix(d.Message, text+"; queued at position"), "the refusal begins with %q:\n%s", text, d.Message)
			assert.Contains(t, text, tc.words)

			// Later, the same words, with the ages of then.
			e.clock.advance(time.Minute)
			later := d.BusyText(e.clock.Now())
			assert.Contains(t, later, tc.words)
			if strings.Contains(text, " left)") {
				assert.Contains(t, later, "(5m0s left)")
			}
			if strings.Contains(text, " ago)") {
				assert.Contains(t, later, "(1m0s ago)")
			}
		})
	}
}
