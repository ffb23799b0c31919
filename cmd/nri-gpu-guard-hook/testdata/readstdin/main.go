// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Command readstdin reads its stdin to the end and exits: the floor a hook
// process is measured against (a static Go program doing the least a hook
// must do). Built with CGO_ENABLED=0 by BenchmarkHookProcess.
package main

import (
	"io"
	"os"
)

func main() {
	if _, err := io.Copy(io.Discard, os.Stdin); err != nil {
		os.Exit(1)
	}
}
