// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// runMainEnv makes the test binary run main's run() with its arguments
// (see TestMain).
const runMainEnv = "NRI_GPU_GUARD_TEST_RUN_MAIN"

// A FIFO given as the configuration is refused at once by the daemon and the
// hook: opening it used to block forever, deaf to SIGTERM.
func TestFIFOConfigRefused(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "config.toml")
	require.NoError(t, syscall.Mkfifo(fifo, 0o600))
	for _, args := range [][]string{{"--config", fifo}, {"hook", "poststop", "--config", fifo}} {
		var stdout, stderr bytes.Buffer
		code := run(args, strings.NewReader(""), &stdout, &stderr)
		assert.Equal(t, 1, code, args)
		assert.Contains(t, stderr.String(), "not a regular file (it is a named pipe (FIFO))")
	}
}
