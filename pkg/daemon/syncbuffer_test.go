// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package daemon

import "github.com/nri-gpu-guard/nri-gpu-guard/internal/syncbuf"

// syncBuffer is a log sink safe to read while the watch logs
// (internal/syncbuf). It is built with and without cgo: the tests of both
// builds log into it.
type syncBuffer = syncbuf.Buffer
