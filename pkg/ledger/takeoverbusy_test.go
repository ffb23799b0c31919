// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// BusyAfterTakeOver says what Busy would say once the claims of the given
// containers were the requester's, and moves nothing. Before a takeover the
// predecessor's claim hides a device kept for the head of the queue (the
// keep is looked for only where nothing holds the device), so Busy as it is
// cannot tell whether the takeover admits the request.
func TestBusyAfterTakeOver(t *testing.T) {
	app := owner("app")
	for _, tc := range []struct {
		name     string
		head     bool // h waits for GPU 0 whole, first in line
		wantKeep bool
	}{
		{name: "a device kept for the head of the queue", head: true, wantKeep: true},
		{name: "nothing else in the way"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := openTest(t, newClock())
			update(t, l, func(tx *Tx) {
				_, err := tx.Claim("", owner("init"), devs(mig(0, 0)), "env")
				require.NoError(t, err)
				require.True(t, tx.MarkStopped("init"))
				if tc.head {
					tx.Enqueue("h", owner("h"), devs(gpu(0)))
				}
			})
			before := snapshot(t, l)
			update(t, l, func(tx *Tx) {
				now := tx.Busy("", app, devs(gpu(0)))
				require.Len(t, now, 1)
				require.NotNil(t, now[0].Holder)
				assert.Equal(t, "init", now[0].Holder.Owner.ContainerID, "only the predecessor's claim shows")

				after := tx.BusyAfterTakeOver("", app, devs(gpu(0)), []string{"init"})
				if tc.wantKeep {
					require.Len(t, after, 1)
					require.NotNil(t, after[0].KeptFor)
					assert.Equal(t, "h", after[0].KeptFor.Key)
					assert.Equal(t, gpu(0).UUID, after[0].Through.UUID)
				} else {
					assert.Empty(t, after)
				}
				assert.False(t, tx.Changed(), "nothing moved")
				assert.Equal(t, now, tx.Busy("", app, devs(gpu(0))), "the transaction's own answer is unchanged")
			})
			assert.Equal(t, holders(before), holders(snapshot(t, l)))
		})
	}
}
