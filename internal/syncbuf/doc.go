// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package syncbuf is the tests' shared output buffer: what a process's
// copying goroutines, a server's handlers or a logger write while the test
// reads it.
//
// Invariant: every Write and every read holds the buffer's lock, so the
// race detector never sees the test read what another goroutine writes;
// a Write never blocks on the Wrote signal.
package syncbuf
