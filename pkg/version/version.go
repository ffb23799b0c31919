// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package version

import (
	"fmt"
	"runtime"
)

// Set by -ldflags "-X .../pkg/version.Version=... -X .../pkg/version.Commit=...".
var (
	Version = "dev"
	Commit  = "unknown"
)

// String is the one-line build description printed by `version`.
func String(program string) string {
	return fmt.Sprintf("%s %s (commit %s, %s, %s/%s)", program, Version, Commit, runtime.Version(), runtime.GOOS, runtime.GOARCH)
}
