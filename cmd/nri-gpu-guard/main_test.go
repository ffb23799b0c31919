// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/version"
)

func TestRunExitCodes(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing.toml")
	bad := filepath.Join(t.TempDir(), "bad.toml")
	if err := os.WriteFile(bad, []byte("[policy]\non_conflict = \"maybe\"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	good := filepath.Join(t.TempDir(), "good.toml")
	if err := os.WriteFile(good, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	wantVersion := version.String("nri-gpu-guard") + "\n"
	for _, tc := range []struct {
		name    string
		args    []string
		want    int
		wantErr string // substring of stderr; "" = stderr must be empty
		wantOut string // stdout, exactly
	}{
		{name: "version", args: []string{"version"}, want: 0, wantOut: wantVersion},
		{name: "--version", args: []string{"--version"}, want: 0, wantOut: wantVersion},
		{name: "-version", args: []string{"-version"}, want: 0, wantOut: wantVersion},
		// gpu-guard-ctl's commands, as its static build hands them over.
		{name: "ctl version", args: []string{"ctl", "version"}, want: 0, wantOut: version.String("gpu-guard-ctl") + "\n"},
		{name: "ctl unknown command", args: []string{"ctl", "bogus"}, want: 2, wantErr: `unknown command "bogus" for "gpu-guard-ctl"`},
		{name: "unknown flag", args: []string{"--bogus"}, want: 2, wantErr: "usage"},
		{name: "stray argument", args: []string{"serve"}, want: 2, wantErr: `unexpected argument "serve"`},
		{name: "hook without phase", args: []string{"hook"}, want: 2, wantErr: "hook create-runtime|poststop"},
		{name: "hook with unknown phase", args: []string{"hook", "prestart"}, want: 2, wantErr: "hook create-runtime|poststop"},
		{name: "missing config named explicitly", args: []string{"--config", missing}, want: 1, wantErr: "configuration"},
		{name: "invalid config", args: []string{"--config", bad}, want: 1, wantErr: "policy.on_conflict"},
		{name: "relative state dir", args: []string{"--config", good, "--state-dir", "rel"}, want: 1, wantErr: "ledger.dir"},
		{name: "hook with invalid config", args: []string{"hook", "poststop", "--config", bad}, want: 1, wantErr: "policy.on_conflict"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			got := run(tc.args, strings.NewReader(""), &stdout, &stderr)
			assert.Equal(t, tc.want, got, stderr.String())
			assert.Equal(t, tc.wantOut, stdout.String())
			if tc.wantErr == "" {
				assert.Empty(t, stderr.String())
			} else {
				assert.Contains(t, stderr.String(), tc.wantErr)
			}
		})
	}
}
