// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var commands = []string{"status", "claims", "queue", "devices", "explain", "audit", "release", "gc", "check-config", "version"}

// TestHelp: the root and every command explain themselves with an example,
// on stdout, with exit 0.
func TestHelp(t *testing.T) {
	f := newFixture(t)
	r := f.run(t, "--help")
	require.Equal(t, ExitOK, r.code)
	for _, c := range commands {
		assert.Regexp(t, `(?m)^  `+c+` `, r.stdout, "root help lists %s", c)
	}
	assert.Contains(t, r.stdout, "Exit codes: 0 ok, 1 error, 2 usage, 3 attention")

	for _, c := range commands {
		for _, form := range [][]string{{c, "--help"}, {"help", c}} {
			r := f.run(t, form...)
			require.Equal(t, ExitOK, r.code, "%v: %s", form, r.stderr)
			assert.Contains(t, r.stdout, "Usage:", form)
			assert.Regexp(t, `Examples:\n  (sudo )?gpu-guard-ctl `+c+`\s`, r.stdout, form)
			assert.Contains(t, r.stdout, "--output", "global flags are listed: %v", form)
			assert.Empty(t, r.stderr)
		}
	}
}

// TestUsageErrors: typos and bad flags exit 2 with a hint on stderr, and the
// closest command is suggested.
func TestUsageErrors(t *testing.T) {
	f := newFixture(t)
	for _, tc := range []struct {
		args     []string
		stderr   []string
		noStderr []string
		suggest  string
	}{
		{args: []string{"staus"}, suggest: "status"},
		{args: []string{"relase", "--container", "x"}, suggest: "release"},
		{args: []string{"claim"}, suggest: "claims"},
		{args: []string{"checkconfig"}, suggest: "check-config"},
		{args: []string{"frobnicate"}, stderr: []string{`unknown command "frobnicate"`}},
		{args: []string{}, stderr: []string{"no command given", "Available Commands:"}},
		{args: []string{"status", "--bogus"}, stderr: []string{"unknown flag: --bogus", "gpu-guard-ctl status --help"}},
		// An unknown flag before a command is the mistake, not the command.
		{args: []string{"--bogus", "status"}, stderr: []string{"unknown flag: --bogus"}, noStderr: []string{"unknown command", "Did you mean"}},
		{args: []string{"-x", "status"}, stderr: []string{"unknown shorthand flag: 'x' in -x"}, noStderr: []string{"unknown command", "Did you mean"}},
		{args: []string{"--bogus", "relase"}, suggest: "release"},
		{args: []string{"status", "extra"}, stderr: []string{"takes no arguments"}},
		{args: []string{"-o", "yaml", "status"}, stderr: []string{`invalid output format "yaml"`}},
		{args: []string{"audit", "-n", "-1"}, stderr: []string{"-n must not be negative"}},
		{args: []string{"audit", "--since", "soon"}, stderr: []string{"--since"}},
		{args: []string{"explain", "--env", "NOEQUALS"}, stderr: []string{"want KEY=VALUE"}},
		{args: []string{"explain", "--device", "/dev/sda"}, stderr: []string{"/dev/nvidia<N>"}},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			r := f.run(t, tc.args...)
			require.Equal(t, ExitUsage, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			assert.Contains(t, r.stderr, "error: ")
			for _, s := range tc.stderr {
				assert.Contains(t, r.stderr, s)
			}
			for _, s := range tc.noStderr {
				assert.NotContains(t, r.stderr, s)
			}
			if tc.suggest != "" {
				assert.Contains(t, r.stderr, "Did you mean this?\n\t"+tc.suggest+"\n")
			}
			assert.Empty(t, r.stdout)
		})
	}
}
