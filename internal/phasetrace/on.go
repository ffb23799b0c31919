// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build phasetrace

package phasetrace

import (
	"os"
	"strconv"
	"time"
)

var start = time.Now()

// Mark writes "phase NAME MICROSECONDS" to stderr: the time since this
// package was initialised, which is after the runtime's start and the
// initialisers of the packages it follows.
func Mark(name string) {
	line := "phase " + name + " " + strconv.FormatInt(time.Since(start).Microseconds(), 10) + "\n"
	_, _ = os.Stderr.WriteString(line)
}
