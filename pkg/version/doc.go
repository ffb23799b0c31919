// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package version holds the build information both programs print
// (`gpu-guard-ctl version`, and the daemon's version output and start-up
// log line).
//
// Invariants:
//   - Version and Commit are set only by the linker (-ldflags -X, see the
//     Makefile); a plain `go build` reports "dev" and "unknown" rather than
//     a guess.
//   - It imports only the standard library, so any package may use it.
package version
