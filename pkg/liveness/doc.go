// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package liveness answers, out of band, whether the holder of a GPU claim
// still has processes: the check the guard runs before refusing a request,
// because containerd serialises NRI events and a holder's StopContainer may
// not have been delivered yet when a new container asks for its GPU.
//
// What counts as exited:
//   - A holder with a known cgroup whose cgroup (and every cgroup below it)
//     has no processes. Both cgroup v2 (unified) and v1 (a controller
//     hierarchy such as pids, memory, cpu,cpuacct or name=systemd) are read;
//     cgroupfs paths ("/k8s.io/<id>") and systemd paths
//     ("slice:prefix:name") are understood.
//   - A holder without a usable cgroup whose pid is gone (no /proc entry and,
//     on the procfs of this process's pid namespace, kill(pid, 0) answers
//     ESRCH: a pid hidden by hidepid is not gone), is a zombie with no other
//     thread left in /proc/<pid>/task, or was reused by another process
//     (start time differs from the one recorded).
//
// Invariants:
//   - A holder that never started (no pid, no cgroup) is alive: containerd
//     sends no StopContainer for created-but-never-started containers, and
//     they have no process yet.
//   - Doubt means alive. Anything unreadable, unknown or ambiguous keeps the
//     claim; only positive evidence of exit releases a GPU.
//   - The runtime-supplied cgroup path is cleaned and confined below the
//     cgroup root; it is never followed outside it.
package liveness
