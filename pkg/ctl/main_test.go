// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"os"
	"testing"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testtmp"
)

// TestMain keeps the boot markers of the tests' ledgers out of the host's
// runtime dir once the tests are done (see internal/testtmp). Started with
// signalRoleEnv set, the test binary plays a part in the signal tests of
// gpu-guard-ctl run instead (see runsignal_test.go).
func TestMain(m *testing.M) {
	if role := os.Getenv(signalRoleEnv); role != "" {
		os.Exit(playSignalRole(role))
	}
	os.Exit(testtmp.Main(m))
}
