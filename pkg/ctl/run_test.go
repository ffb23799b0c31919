// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"os"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
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
			name:     "podman container run: the long form",
			args:     []string{"podman", "--root", "/r", "container", "run", "--rm", "-e", "NVIDIA_VISIBLE_DEVICES=1", "img"},
			want:     devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=1"}},
			wantFrom: "-e NVIDIA_VISIBLE_DEVICES=1",
			wantArgs: []string{"podman", "--root", "/r", "container", "run", "-e", hook.TicketEnv, "--rm", "-e", "NVIDIA_VISIBLE_DEVICES=1", "img"},
		},
		{
			name:     "docker container create",
			args:     []string{"docker", "container", "create", "--gpus", "device=2", "img"},
			want:     devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=2"}},
			wantFrom: "--gpus device=2",
			wantArgs: []string{"docker", "container", "create", "-e", hook.TicketEnv, "--gpus", "device=2", "img"},
		},
		{
			name:     "podman container ls is no run",
			args:     []string{"podman", "container", "ls", "run"},
			wantArgs: []string{"podman", "container", "ls", "run"},
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

// TestDockerGPUs: docker's --gpus value, read as docker reads it (CSV
// fields in any order; a bare field continues an unquoted list).
func TestDockerGPUs(t *testing.T) {
	for v, want := range map[string]string{
		"all":                                   "all",
		"2":                                     "0,1",
		"0":                                     "",
		"count=3":                               "0,1,2",
		"count=all":                             "all",
		"device=1":                              "1",
		"device=1,2":                            "1,2",
		`"device=1,2"`:                          "1,2",
		`"device=0,1",capabilities=compute`:     "0,1",
		"capabilities=compute,device=1":         "1",
		"capabilities=compute,utility,device=3": "3",
		"device=0,1,capabilities=compute":       "0,1",
		"all,capabilities=utility":              "all",
		"capabilities=utility,all":              "all",
		"driver=nvidia,count=1":                 "0",
		`"capabilities=compute,utility",2`:      "0,1",
		"device=GPU-6c1a2f2e":                   "GPU-6c1a2f2e",
		"device=1:0":                            "1:0",
		"capabilities=compute":                  "0", // docker: one GPU when no count or device is given
		"driver=nvidia":                         "0",
		"capabilities=compute,utility":          "", // docker refuses "utility" as a count
		`"device=1`:                             "",
		"":                                      "",
	} {
		assert.Equal(t, want, dockerGPUs(v), "--gpus %s", v)
	}
}

func TestRunUsage(t *testing.T) {
	f := newFixture(t)
	r := f.run(t, "run", "--", "podman", "create", "-e", "NVIDIA_VISIBLE_DEVICES=1", "img")
	require.Equal(t, ExitUsage, r.code, r.stderr)
	require.Contains(t, r.stderr, "podman create starts no container")
	require.Empty(t, f.state(t).Waiters, "refused before queueing")
	r = f.run(t, "run", "--", "docker", "container", "create", "-e", "NVIDIA_VISIBLE_DEVICES=1", "img")
	require.Equal(t, ExitUsage, r.code, r.stderr)
	require.Contains(t, r.stderr, "docker create starts no container")
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

// When the guard's hook refused the container that carried the ticket, the
// note on the unused ticket says why (from the refuse record the hook keys
// by the ticket) instead of only that no container took it over.
func TestRunUnusedTicketSaysWhy(t *testing.T) {
	f := newFixture(t)
	// The command stands in for a container engine whose create-runtime
	// hook refused the container: it leaves the hook's refuse record.
	script := `printf '{"time":"2026-12-01T00:00:00Z","op":"refuse","container_id":"4f3a9c1b2d7e00","key":"%s","front_end":"hook",` +
		`"reason":"refused (cordoned): GPU 1 is cordoned (unhealthy)","generation":1,"pid":1}\n' "$` + hook.TicketEnv + `" >>` + f.dir + `/audit.log; exit 126`
	r := f.run(t, "run", "--gpus", "1", "--", "sh", "-c", script)
	require.Equal(t, 126, r.code, r.stderr)
	require.Contains(t, r.stderr, "no container took ticket ticket-")
	require.Contains(t, r.stderr, "over (container 4f3a9c1b2d7e was refused (cordoned): GPU 1 is cordoned (unhealthy)); released GPU 1")
	require.Empty(t, f.state(t).Claims)

	// Without a refusal, the note says what else it can be.
	r = f.run(t, "run", "--gpus", "1", "--", "true")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stderr, "(the command started no container that carried it, or the container's create failed before the guard's hook decided)")
}

// TestRunChecksStateDir: run takes --state-dir as every other command does:
// a relative or missing dir is refused before anything is claimed, and
// nothing is created there (a fresh ledger in a mistyped dir would "claim"
// GPUs the daemon and the hooks never see).
func TestRunChecksStateDir(t *testing.T) {
	for _, tc := range badStateDirs {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			dir := tc.dir(f)
			r := f.run(t, "--state-dir", dir, "run", "--gpus", "1", "--", "true")
			require.Equal(t, tc.code, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			assert.Contains(t, r.stderr, "--state-dir")
			assert.Contains(t, r.stderr, tc.want)
			assert.NotContains(t, r.stderr, "claimed for ticket")
			if tc.name == "missing" {
				assert.NoDirExists(t, dir, "nothing is created in a mistyped state dir")
			}
			assert.Empty(t, f.state(t).Claims)
		})
	}
}

// A signal the process started with ignored (`nohup gpu-guard-ctl run …`)
// stays ignored: notifying it would turn it back on, and a hang-up would end
// a wait that nohup was asked to keep.
func TestIgnoredSignalsStayIgnored(t *testing.T) {
	none := func(os.Signal) bool { return false }
	hup := func(s os.Signal) bool { return s == syscall.SIGHUP }
	require.Contains(t, caughtInterrupts(none), os.Signal(syscall.SIGHUP))
	assert.NotContains(t, caughtInterrupts(hup), os.Signal(syscall.SIGHUP))
	assert.Contains(t, caughtInterrupts(hup), os.Signal(syscall.SIGTERM))
}
