// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package syncbuf

import (
	"bytes"
	"sync"
)

// Buffer is a bytes.Buffer safe for writers on other goroutines and a
// reader. The zero value is ready to use.
type Buffer struct {
	// Wrote, if set, is signalled after each Write without blocking (give
	// it a buffer of one): a test waits on it instead of sleeping.
	Wrote chan struct{}

	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends p.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	n, err := b.buf.Write(p)
	if b.Wrote != nil {
		select {
		case b.Wrote <- struct{}{}:
		default:
		}
	}
	return n, err
}

// String returns everything written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
