// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package integration holds the end-to-end tests of nri-gpu-guard: a real
// containerd (2.2 by default, any release from 1.7 on) with runc, driven
// through crictl (what the kubelet speaks), with the plugin as its own
// process, external or pre-installed, and fake GPUs (a static inventory,
// mknod'ed /dev/nvidiaN nodes and a CDI spec).
//
// Everything is behind the `integration` build tag and needs root plus the
// tools and image that setup.sh prepares; `make integration` runs both:
//
//	make integration                             # the default containerd
//	make integration CONTAINERD_VERSION=v1.7.35  # another release
//	make integration CGROUP=v2                   # on cgroup v2 (cgroup2.sh)
//	make matrix                                  # core subset × release lines, a table
//	# or, after `make build` and `sudo ./test/integration/setup.sh`:
//	go test -tags 'nri_no_wasm integration' -count=1 -v ./test/integration/...
//
// The containerd under test is CONTAINERD_VERSION (DefaultContainerdVersion
// when unset); the harness writes its config in that release's format. What
// a release line lacks is a named Capability: a test needing it calls
// RequireCapability and is skipped with a "not supported on containerd …"
// message that names the capability and what its absence means, which the
// matrix report (matrixreport) shows as "not supported". TestRuntimeUnderTest
// checks the binary's version and logs its NRI version for the report.
//
// The harness (harness_test.go, containerd_test.go, cri_test.go,
// guardproc_test.go) is the package's reusable part: StartContainerd /
// SharedContainerd, RunPod, Pod.Create / Pod.Refused / Pod.Run, StartGuard /
// InstallGuard / NewGuardEnv, Guard.Claims / Guard.Queue.
//
// The GPU observer's test (observe_test.go) runs nri-gpu-guard built with the
// fakenvml tag (GuardOptions.Bin): the release code with one difference at
// the process boundary, its NVML is go-nvml's mock fed by a JSON file that
// says which host pids run on which GPU (cmd/nri-gpu-guard/fakenvml.go);
// the pids are real container processes, mapped through the real
// /proc/PID/cgroup.
//
// Invariants the harness keeps:
//   - every daemon runs in its own short temp dir (unix socket paths are
//     limited to 108 bytes) named ggi-*, with its own containerd root, state,
//     NRI socket, plugin dirs and CDI spec dir: nothing of the host's
//     containerd or /var/run/cdi is read or written;
//   - processes are started with a recorded pid and stopped by that pid;
//     teardown (t.Cleanup, TestMain for the shared daemon) removes pods,
//     stops containerd, kills any process still running from the temp dir
//     (shims, launched plugins, and containers found by their cgroups),
//     unmounts what is mounted under it and removes it, also after a
//     failure; a run that died without teardown is swept by the next one;
//   - tests never sleep to synchronise: they poll a condition (ledger
//     content, container state, a readiness endpoint) up to a deadline.
package integration
