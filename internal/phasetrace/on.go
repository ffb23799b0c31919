// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build phasetrace

package phasetrace

import (
	"os"
	"strconv"
	"time"
)

var (
	start = time.Now()
	// out is stderr, or the file PHASETRACE_FILE names (appended to): a
	// runtime keeps a successful hook's stderr to itself.
	out = openOut()
	// who prefixes each line in a file: the process's first argument (the
	// hook's phase), so that lines of several processes can be told apart.
	who = firstArg()
)

func openOut() *os.File {
	p := os.Getenv("PHASETRACE_FILE")
	if p == "" {
		return os.Stderr
	}
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600) //nolint:gosec // a trace build's own output file
	if err != nil {
		return os.Stderr
	}
	return f
}

func firstArg() string {
	if os.Getenv("PHASETRACE_FILE") == "" || len(os.Args) < 2 {
		return ""
	}
	return os.Args[1] + " "
}

// Mark writes "phase NAME MICROSECONDS": the time since this package was
// initialised, which is after the runtime's start and the initialisers of
// the packages it follows.
func Mark(name string) {
	line := who + "phase " + name + " " + strconv.FormatInt(time.Since(start).Microseconds(), 10) + "\n"
	_, _ = out.WriteString(line)
}
