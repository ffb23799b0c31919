// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"testing"
)

// Multi-process tests re-run this test binary as a helper process: TestMain
// sees helperEnv and runs the named helper instead of the tests.
const helperEnv = "LEDGER_TEST_HELPER"

var helpers = map[string]func() int{}

func TestMain(m *testing.M) {
	if name := os.Getenv(helperEnv); name != "" {
		fn, ok := helpers[name]
		if !ok {
			fmt.Fprintf(os.Stderr, "unknown helper %q\n", name)
			os.Exit(2)
		}
		os.Exit(fn())
	}
	os.Exit(runTests(m))
}

// runTests runs the tests with TMPDIR at a root of their own and then
// removes the boot markers their ledgers left in DefaultRuntimeDir (what
// internal/testtmp does for the other packages, which this one cannot
// import: it imports this package).
func runTests(m *testing.M) int {
	// Every test verifies that no change of the state leaves keptForHead's
	// answer stale; a benchmark measures the code as it runs.
	flag.Parse()
	checkKeep = flag.Lookup("test.bench").Value.String() == ""
	root, err := os.MkdirTemp("", "ggt-")
	if err != nil {
		fmt.Fprintf(os.Stderr, "ledger tests: %v\n", err)
		return 1
	}
	if err := os.Setenv("TMPDIR", root); err != nil {
		fmt.Fprintf(os.Stderr, "ledger tests: %v\n", err)
		return 1
	}
	code := m.Run()
	if _, err := RemoveMarkersUnder(DefaultRuntimeDir, root); err != nil {
		fmt.Fprintf(os.Stderr, "ledger tests: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	_ = os.Remove(root) // only if the tests left it empty
	return code
}

// helperCmd prepares a helper process with the given environment. It may
// run in any goroutine (no t.Fatal).
func helperCmd(t testing.TB, name string, env map[string]string) *exec.Cmd {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		exe = os.Args[0] // then Start reports the problem
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+name)
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	return cmd
}

// runHelper runs a helper to completion and returns its exit code and
// output. It may run in any goroutine: a helper that does not start is
// reported as exit code -1 with the error as its output (t.Fatal is for the
// test's own goroutine only).
func runHelper(t testing.TB, name string, env map[string]string) (int, string) {
	t.Helper()
	cmd := helperCmd(t, name, env)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if err != nil && cmd.ProcessState == nil {
		return -1, fmt.Sprintf("start helper %s: %v", name, err)
	}
	return cmd.ProcessState.ExitCode(), out.String()
}

func envInt(name string) int {
	n, err := strconv.Atoi(os.Getenv(name))
	if err != nil {
		fmt.Fprintf(os.Stderr, "helper: %s=%q: %v\n", name, os.Getenv(name), err)
		os.Exit(2)
	}
	return n
}

// helperFail reports a helper failure and returns its exit code.
func helperFail(format string, args ...any) int {
	fmt.Fprintf(os.Stderr, "helper: "+format+"\n", args...)
	return 1
}
