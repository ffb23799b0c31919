// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package testtmp gives a test binary a temp root of its own and, when the
// tests are done, removes the boot markers of every ledger they made below
// it.
//
// Every ledger committed in this boot leaves a marker in the host's runtime
// dir (ledger.DefaultRuntimeDir), keyed by its state dir, so that a state
// dir that later vanishes is refused instead of read as a fresh host. Tests
// make thousands of state dirs in temp dirs and delete them; without this
// package each would leave its marker behind.
//
// Invariants: a marker is removed only after every test of the binary has
// finished, and only if its state dir lies below this binary's own root, so
// no test of another package (which may delete its state dir on purpose and
// rely on the marker to refuse it) loses a marker it needs. The root itself
// is removed only if the tests left it empty: something still mounted below
// it must not be walked into.
package testtmp
