// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"errors"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestConfigErrorNamesContainerAndCheck: whatever the phase, the error of a
// configuration that does not load names the container (when its state was
// read) and the command that says what is wrong, and wraps the cause.
func TestConfigErrorNamesContainerAndCheck(t *testing.T) {
	cause := errors.New("invalid configuration: policy.on_conflict: invalid value \"maybe\"")
	read := &Input{state: specs.State{ID: "4f3a9c"}}
	unread := &Input{stateErr: errors.New("stdin is empty")}
	for _, tc := range []struct {
		name, phase string
		in          *Input
		want        []string
	}{
		{"create-runtime", PhaseCreateRuntime, read, []string{
			"hook create-runtime: container 4f3a9c refused: configuration: " + cause.Error(),
			". Fix the configuration (`gpu-guard-ctl check-config` says what is wrong), then create the container again"}},
		{"create-runtime, state unread", PhaseCreateRuntime, unread, []string{
			"hook create-runtime: container refused: configuration: " + cause.Error(),
			"`gpu-guard-ctl check-config` says what is wrong"}},
		{"create-runtime, no input", PhaseCreateRuntime, nil, []string{
			"hook create-runtime: container refused: configuration: ", "`gpu-guard-ctl check-config`"}},
		{"poststop", PhasePoststop, read, []string{
			"hook poststop: container 4f3a9c: its GPUs are not released: configuration: " + cause.Error(),
			". Fix the configuration (`gpu-guard-ctl check-config` says what is wrong), then run `sudo gpu-guard-ctl release --container 4f3a9c"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := ConfigError(tc.phase, tc.in, cause)
			require.ErrorIs(t, err, cause)
			for _, w := range tc.want {
				assert.Contains(t, err.Error(), w)
			}
		})
	}
}
