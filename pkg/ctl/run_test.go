// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
)

func TestCommandRequest(t *testing.T) {
	dev := func(n int64) devices.LinuxDevice {
		return devices.LinuxDevice{Path: "/dev/nvidia" + string(rune('0'+n)), Type: "c", Major: 195, Minor: n}
	}
	for _, tc := range []struct {
		name     string
		args     []string
		want     devices.Request
		wantFrom string
		wantArgs []string
	}{
		{
			name:     "podman run with env and global flags",
			args:     []string{"podman", "--root", "/r", "--runtime=crun", "run", "--rm", "--name", "job", "-e", "NVIDIA_VISIBLE_DEVICES=1", "img", "-e", "NVIDIA_VISIBLE_DEVICES=3"},
			want:     devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=1"}},
			wantFrom: "-e NVIDIA_VISIBLE_DEVICES=1",
			wantArgs: []string{"podman", "--root", "/r", "--runtime=crun", "run", "-e", hook.TicketEnv, "--rm", "--name", "job", "-e", "NVIDIA_VISIBLE_DEVICES=1", "img", "-e", "NVIDIA_VISIBLE_DEVICES=3"},
		},
		{
			name:     "devices and --env=",
			args:     []string{"/usr/bin/podman", "create", "--device", "/dev/nvidia2:/dev/nvidia0:rwm", "--env=NVIDIA_VISIBLE_DEVICES=0", "--device=/dev/nvidia3", "img"},
			want:     devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=0"}, Devices: []devices.LinuxDevice{dev(2), dev(3)}},
			wantFrom: "--device /dev/nvidia2 -e NVIDIA_VISIBLE_DEVICES=0 --device /dev/nvidia3",
			wantArgs: []string{"/usr/bin/podman", "create", "-e", hook.TicketEnv, "--device", "/dev/nvidia2:/dev/nvidia0:rwm", "--env=NVIDIA_VISIBLE_DEVICES=0", "--device=/dev/nvidia3", "img"},
		},
		{
			name:     "docker --gpus",
			args:     []string{"docker", "run", "--gpus", "device=1,2", "img"},
			want:     devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=1,2"}},
			wantFrom: "--gpus device=1,2",
			wantArgs: []string{"docker", "run", "-e", hook.TicketEnv, "--gpus", "device=1,2", "img"},
		},
		{
			name:     "docker --gpus N",
			args:     []string{"docker", "run", "--gpus=2", "img"},
			want:     devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=0,1"}},
			wantFrom: "--gpus 2",
			wantArgs: []string{"docker", "run", "-e", hook.TicketEnv, "--gpus=2", "img"},
		},
		{
			name:     "another command: nothing read, nothing added",
			args:     []string{"sh", "-c", "podman run -e NVIDIA_VISIBLE_DEVICES=1 img"},
			wantArgs: []string{"sh", "-c", "podman run -e NVIDIA_VISIBLE_DEVICES=1 img"},
		},
		{
			name:     "podman start carries no environment",
			args:     []string{"podman", "start", "job"},
			wantArgs: []string{"podman", "start", "job"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, from := commandRequest(tc.args)
			require.Equal(t, tc.want, req)
			require.Equal(t, tc.wantFrom, from)
			require.Equal(t, tc.wantArgs, withTicketArg(tc.args))
		})
	}
}

func TestRunUsage(t *testing.T) {
	f := newFixture(t)
	for _, args := range [][]string{
		{"run"},
		{"run", "--gpus", "1", "podman"}, // no --
		{"run", "--", "sh", "-c", "true"},
		{"run", "--timeout", "-1s", "--gpus", "1", "--", "true"},
	} {
		r := f.run(t, args...)
		require.Equal(t, ExitUsage, r.code, "%v: %s%s", args, r.stdout, r.stderr)
	}
}

// TestRunReleasesAnUnusedTicket: the command ran but started no container
// that took the ticket over: the claim is released and the command's exit
// code is gpu-guard-ctl's.
func TestRunReleasesAnUnusedTicket(t *testing.T) {
	f := newFixture(t)
	r := f.run(t, "run", "--gpus", "1", "--", "sh", "-c", `test -n "$`+hook.TicketEnv+`" && exit 3`)
	require.Equal(t, 3, r.code, r.stderr)
	require.Contains(t, r.stderr, "claimed for ticket ticket-")
	require.Contains(t, r.stderr, "no container took ticket")
	require.Contains(t, r.stderr, "released GPU 1")
	require.Empty(t, f.state(t).Claims)
	require.Empty(t, f.state(t).Waiters)
}
