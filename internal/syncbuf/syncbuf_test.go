// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package syncbuf

import (
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// Writers on many goroutines and a reader at once (run with -race): every
// line arrives whole, and a full Wrote channel never blocks a writer.
func TestBufferConcurrentWritesAndReads(t *testing.T) {
	b := &Buffer{Wrote: make(chan struct{}, 1)}
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			for j := range 50 {
				_, err := fmt.Fprintf(b, "%d.%d\n", i, j)
				require.NoError(t, err)
				_ = b.String()
			}
		})
	}
	wg.Wait()
	<-b.Wrote
	require.Len(t, b.String(), func() int {
		n := 0
		for i := range 8 {
			for j := range 50 {
				n += len(fmt.Sprintf("%d.%d\n", i, j))
			}
		}
		return n
	}())
	var zero Buffer
	_, err := zero.Write([]byte("x"))
	require.NoError(t, err)
	require.Equal(t, "x", zero.String())
}
