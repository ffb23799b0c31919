// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package phasetrace marks where a short-lived process (an OCI hook run)
// spends its time: Mark names the end of a phase. In a normal build Mark
// does nothing and costs nothing (an empty function, inlined away). Built
// with the tag phasetrace, each Mark writes "phase NAME MICROSECONDS" to
// stderr (or appends it to the file PHASETRACE_FILE names), the
// microseconds since the package was initialised (early: it
// imports only the standard library, so the first phase holds the
// initialisers of the packages that follow it);
// hack/hook-phases.sh builds the hook that way and averages the phases over
// many claim + release pairs (docs/benchmarks.md).
//
// Invariant: nothing but the trace build ever writes anything; phase names
// are constants of the caller, never data.
package phasetrace
