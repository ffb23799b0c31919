// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package benchab

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
)

// Installed copies the program at path, in one sequential pass, to a new
// executable file of the same name in dir and returns the copy's path: the
// form a package manager leaves a binary in. A process benchmark
// times the copies of every program it compares, never the files the Go
// linker wrote: on the development VM the same bytes started 10-15 % slower
// from a linker's output file than from a copy (1.29 vs 1.11-1.12 ms for
// the hook, measured over 600 interleaved runs; the kernel's page cache
// holds the two files differently), a difference as large as the changes
// being measured, and it fell on whichever build happened to be fresh from
// the linker.
func Installed(path, dir string) (string, error) {
	in, err := os.Open(path) //nolint:gosec // a program the benchmark built or was given
	if err != nil {
		return "", fmt.Errorf("install %s: %w", path, err)
	}
	defer func() { _ = in.Close() }()
	dst := filepath.Join(dir, filepath.Base(path))
	if dst == filepath.Clean(path) {
		return "", fmt.Errorf("install %s: the copy would replace it; name another dir", path)
	}
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o755) //nolint:gosec // next to the program, for the benchmark to run
	if err != nil {
		return "", fmt.Errorf("install %s: %w", path, err)
	}
	if _, err := io.Copy(out, in); err != nil {
		_ = out.Close()
		return "", fmt.Errorf("install %s: %w", path, err)
	}
	if err := out.Close(); err != nil {
		return "", fmt.Errorf("install %s: %w", path, err)
	}
	return dst, nil
}

// MustInstall is Installed into a temp dir of tb's, failing tb on error.
func MustInstall(tb testing.TB, path string) string {
	tb.Helper()
	inst, err := Installed(path, tb.TempDir())
	if err != nil {
		tb.Fatal(err)
	}
	return inst
}
