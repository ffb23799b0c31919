// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// logOf builds a `go test -v` log: a runtime line, then one line per test
// result ("PASS", "FAIL", or a skip message).
func logOf(containerd, nri string, warn bool, results map[string]string) string {
	var b strings.Builder
	b.WriteString("=== RUN   TestRuntimeUnderTest\n")
	w := "false"
	if warn {
		w = "true"
	}
	b.WriteString("    runtime_test.go:170: runtime under test: containerd " + containerd + ", NRI " + nri + ", config version 3, stub version warning: " + w + ", cgroup v1\n")
	b.WriteString("--- PASS: TestRuntimeUnderTest (1.20s)\n")
	for _, s := range Scenarios {
		r, ok := results[s.Test]
		if !ok {
			continue
		}
		b.WriteString("=== RUN   " + s.Test + "\n")
		b.WriteString("    x_test.go:10: some log line\n")
		switch r {
		case "PASS", "FAIL":
			b.WriteString("=== RUN   " + s.Test + "/sub\n    --- SKIP: " + s.Test + "/sub (0.00s)\n")
			b.WriteString("--- " + r + ": " + s.Test + " (3.00s)\n")
		default:
			b.WriteString("    x_test.go:11: " + r + "\n--- SKIP: " + s.Test + " (0.00s)\n")
		}
	}
	b.WriteString("ok  \tgithub.com/x/test/integration\t30.1s\n")
	return b.String()
}

func allPass(except map[string]string) map[string]string {
	m := map[string]string{}
	for _, s := range Scenarios {
		m[s.Test] = "PASS"
	}
	for k, v := range except {
		if v == "" {
			delete(m, k)
		} else {
			m[k] = v
		}
	}
	return m
}

const noValidation = "not supported on containerd v1.7.35: NRI adjustment validation (ValidateContainerAdjustment) (since containerd 2.2); a later plugin can add a GPU unchecked"

const noValidator = "not supported on containerd v1.7.35: NRI default validator (required_plugins) (since containerd 2.2); fails open"

func TestParseReadsStatusesAndNotes(t *testing.T) {
	log := logOf("v1.7.35", "v0.8.0", true, allPass(map[string]string{
		"TestGuardAbsentFailsClosed":             noValidator,
		"TestStoppedHolderHandsGPUToHeadOfQueue": "FAIL",
		"TestPluginRestartReconcilesWithRuntime": "skipped for another reason",
		"TestHarnessRunsContainers":              "",
	}))
	r, err := Parse(strings.NewReader(log))
	require.NoError(t, err)
	assert.Equal(t, "v1.7.35", r.Containerd)
	assert.Equal(t, "v0.8.0", r.NRI)
	assert.True(t, r.StubWarning)
	assert.Equal(t, "v1", r.Cgroup)
	assert.Equal(t, NotSupported, r.Status["TestGuardAbsentFailsClosed"])
	assert.Equal(t, noValidator, r.Note["TestGuardAbsentFailsClosed"])
	assert.Equal(t, Fail, r.Status["TestStoppedHolderHandsGPUToHeadOfQueue"])
	assert.Equal(t, Skipped, r.Status["TestPluginRestartReconcilesWithRuntime"], "a skip that names no capability is not 'not supported'")
	assert.Equal(t, Pass, r.Status["TestConflictingRequestIsRefusedAndQueued"], "a skipped subtest does not change its parent's result")
	assert.Equal(t, NotRun, r.status(Scenarios[0]))
}

func TestParseRejectsALogWithoutTheRuntimeLine(t *testing.T) {
	_, err := Parse(strings.NewReader("=== RUN   TestX\n--- PASS: TestX (0.00s)\n"))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "runtime under test")
}

func TestReadmeRowAndTable(t *testing.T) {
	old, err := Parse(strings.NewReader(logOf("v1.7.35", "v0.8.0", true, allPass(map[string]string{
		"TestGuardAbsentFailsClosed": noValidator, "TestLaterPluginCannotAddAnUncheckedGPU": noValidation}))))
	require.NoError(t, err)
	cur, err := Parse(strings.NewReader(logOf("v2.2.1", "v0.11.0", false, allPass(nil))))
	require.NoError(t, err)
	broken, err := Parse(strings.NewReader(logOf("v2.4.2", "v0.12.3", false, allPass(map[string]string{"TestPreinstalledPluginSurvivesContainerdRestart": "FAIL"}))))
	require.NoError(t, err)

	assert.Equal(t, "| 1.7 (v1.7.35) | v0.8.0 | supported, without fail-closed validator or later-plugin validation | containers + CDI, admit/refuse + message, queue + reservation, restart reconcile, exited holder via cgroup, launched mode |", ReadmeRow(old))
	assert.Equal(t, "| 2.2 (v2.2.1) | v0.11.0 | supported | containers + CDI, admit/refuse + message, queue + reservation, restart reconcile, exited holder via cgroup, fail-closed validator, launched mode, later-plugin validation |", ReadmeRow(cur))
	assert.Contains(t, ReadmeRow(broken), "| **failing**: launched mode |")

	rs := []*Result{broken, cur, old}
	sortResults(rs)
	table := Table(rs)
	lines := strings.Split(table, "\n")
	assert.True(t, strings.HasPrefix(lines[2], "| v1.7.35 | v0.8.0 | v1 | yes | pass |"), lines[2])
	assert.True(t, strings.HasPrefix(lines[3], "| v2.2.1 |"), lines[3])
	assert.True(t, strings.HasSuffix(lines[4], "| FAIL | pass |"), lines[4])
	assert.Contains(t, table, "- v1.7.35, fail-closed validator: "+noValidator)
}

func TestCheckComparesRowsOfTheRunsOnly(t *testing.T) {
	old, err := Parse(strings.NewReader(logOf("v1.7.35", "v0.8.0", true, allPass(map[string]string{"TestGuardAbsentFailsClosed": noValidator}))))
	require.NoError(t, err)
	cur, err := Parse(strings.NewReader(logOf("v2.2.1", "v0.11.0", false, allPass(nil))))
	require.NoError(t, err)
	readme := "# X\n\n" + beginMarker + "\n| containerd | NRI | status | verified |\n|---|---|---|---|\n" +
		ReadmeRow(old) + "\n" + ReadmeRow(cur) + "\n| 2.4 (v2.4.2) | v0.12.3 | supported | whatever |\n" + endMarker + "\n"

	require.NoError(t, Check(readme, []*Result{old, cur}), "2.4 has no run: not judged")

	stale := strings.Replace(readme, "| 2.2 (v2.2.1) | v0.11.0 |", "| 2.2 (v2.2.1) | v0.10.0 |", 1)
	err = Check(stale, []*Result{old, cur})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "containerd 2.2 row differs")

	err = Check(strings.Replace(readme, ReadmeRow(old)+"\n", "", 1), []*Result{old})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "no row for containerd 1.7")

	assert.Error(t, Check("no markers", []*Result{old}))
}

// A scenario that failed, was skipped for another reason than a missing
// capability, or never ran (a renamed test) is not verified; passed and not
// supported ones are.
func TestUnverifiedNamesEveryScenarioNotVerified(t *testing.T) {
	old, err := Parse(strings.NewReader(logOf("v1.7.35", "v0.8.0", true, allPass(map[string]string{"TestGuardAbsentFailsClosed": noValidator}))))
	require.NoError(t, err)
	cur, err := Parse(strings.NewReader(logOf("v2.2.1", "v0.11.0", false, allPass(nil))))
	require.NoError(t, err)
	assert.Empty(t, Unverified([]*Result{old, cur}))

	bad, err := Parse(strings.NewReader(logOf("v2.4.2", "v0.12.3", false, allPass(map[string]string{
		"TestStoppedHolderHandsGPUToHeadOfQueue": "FAIL",
		"TestPluginRestartReconcilesWithRuntime": "skipped for another reason",
		"TestExitedHolderIsSeenThroughItsCgroup": "",
	}))))
	require.NoError(t, err)
	assert.Equal(t, []string{
		"containerd v2.4.2, queue + reservation (TestStoppedHolderHandsGPUToHeadOfQueue): FAIL",
		"containerd v2.4.2, restart reconcile (TestPluginRestartReconcilesWithRuntime): skipped",
		"containerd v2.4.2, exited holder via cgroup (TestExitedHolderIsSeenThroughItsCgroup): not run",
	}, Unverified([]*Result{old, bad, cur}))
}

func TestRunPatternNamesEveryScenario(t *testing.T) {
	p := RunPattern()
	assert.True(t, strings.HasPrefix(p, "^(TestRuntimeUnderTest|"), p)
	for _, s := range Scenarios {
		assert.Contains(t, p, "|"+s.Test)
	}
}

func TestLine(t *testing.T) {
	assert.Equal(t, "1.7", Line("v1.7.35"))
	assert.Equal(t, "2.10", Line("v2.10.0"))
}
