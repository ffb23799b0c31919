// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package testtmp

import (
	"fmt"
	"os"
	"testing"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// Main runs m with TMPDIR pointing at a new root below the current temp
// dir (so t.TempDir and os.MkdirTemp("", ...) land there, in this process
// and in the processes it starts), then the after funcs (a package's own
// teardown, such as removing binaries it built for all its tests), then
// removes the boot markers of the state dirs below that root and the root
// if it is empty. It returns the exit code for os.Exit: m.Run's, or 1 if
// the markers could not be removed.
func Main(m *testing.M, after ...func()) int {
	root, err := os.MkdirTemp("", "ggt-")
	if err != nil {
		fmt.Fprintf(os.Stderr, "testtmp: %v\n", err)
		return 1
	}
	prev, had := os.LookupEnv("TMPDIR")
	if err := os.Setenv("TMPDIR", root); err != nil {
		fmt.Fprintf(os.Stderr, "testtmp: %v\n", err)
		return 1
	}
	code := m.Run()
	for _, fn := range after {
		fn()
	}
	if had {
		_ = os.Setenv("TMPDIR", prev)
	} else {
		_ = os.Unsetenv("TMPDIR")
	}
	if err := Sweep(root); err != nil {
		fmt.Fprintf(os.Stderr, "testtmp: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	_ = os.Remove(root) // only if empty: see the package doc
	return code
}

// Sweep removes the boot markers of the state dirs at or below root from
// the default runtime dir. Call it only once nothing uses those dirs.
func Sweep(root string) error {
	if _, err := ledger.RemoveMarkersUnder(ledger.DefaultRuntimeDir, root); err != nil {
		return fmt.Errorf("remove the boot markers of the test ledgers below %s: %w", root, err)
	}
	return nil
}
