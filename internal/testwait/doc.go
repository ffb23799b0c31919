// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package testwait is how the project's tests wait for what another
// goroutine sends: a receive whose bound only turns a hang into a failure.
//
// Invariant: the bound never decides whether a test passes; a test that
// needs an order of events gets it from the channels themselves, not from
// how long something took.
package testwait
