// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"os"
	"testing"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testtmp"
)

// TestMain keeps the boot markers of the tests' ledgers out of the host's
// runtime dir once the tests are done (see internal/testtmp).
func TestMain(m *testing.M) { os.Exit(testtmp.Main(m)) }
