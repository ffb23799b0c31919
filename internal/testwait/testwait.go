// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package testwait

import (
	"testing"
	"time"
)

// hangGuard is how long Receive waits before it calls the wait a hang: far
// beyond what any send in a passing test takes, even on a loaded machine.
const hangGuard = time.Minute

// Receive returns the next value from ch, and fails the test (naming what
// it waited for) when none comes within hangGuard.
func Receive[T any](t testing.TB, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(hangGuard):
		t.Fatalf("no %s within %s: a hang", what, hangGuard)
		var zero T
		return zero
	}
}
