// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package runtimestate lists the containers the OCI runtimes of this host
// know, from the runtimes' own state directories: what a hook-only host has
// instead of containerd's container list when the ledger lost claims
// (gpu-guard-ctl recover adopts the running containers it finds).
// Whether one container id is still known at all (the release rule's
// evidence that an OCI hook holder was removed) is guard.RuntimeRoots' to
// tell, over the same roots: the guard, which the hook imports, cannot
// import this package, which imports the hook.
//
// Each root (runc's /run/runc, which podman uses too; crun's /run/crun; any
// configured in [hook] runtime_roots) holds one directory per container id:
//
//   - runc (libcontainer): <root>/<id>/state.json with "id",
//     "init_process_pid", "init_process_start" (field 22 of
//     /proc/<pid>/stat), "created", and "config" whose "labels" hold
//     "bundle=<dir>" and whose "cgroups" "path" is the container's cgroup;
//   - crun: <root>/<id>/status with "pid", "process-start-time", "bundle",
//     "cgroup-path" and "created";
//   - both: <root>/<id>/exec.fifo while the container is created and not
//     yet started. During a create (while its createRuntime hooks run)
//     neither runtime has written its state file yet: such a directory is
//     not a container yet and is skipped.
//
// A container is live (created or running; paused counts as running) when
// its init pid exists, is not a zombie and started at the recorded time
// (against pid reuse): the runtime's own notion of a stopped container.
// The spec of a live container is its bundle's config.json, decoded as the
// OCI hook decodes it (hook.ReadSpec): the request its GPUs resolve from and
// its annotations. A bundle "/" is crun 1.8's working directory, recorded
// instead of the bundle for a container with a user namespace and devices:
// crun's own copy, <root>/<id>/config.json, is read for it
// (hook.ReadSpec, as the hook did at create), never /config.json.
//
// Invariants:
//   - Nothing is followed as a symlink: a root, container directory or
//     state file that is one is reported, not read (O_NOFOLLOW). The
//     bundle's config.json is the exception, read exactly as the hook read
//     it at create (the bundle path is the runtime's record).
//   - Every read is bounded (state files, number of entries) and never
//     blocks: a FIFO, device or over-size file is a reported problem.
//   - A bad entry (unreadable, malformed, a name that is not its id, a
//     symlink, too big) is reported in Result.Problems and never fails the
//     scan or hides the other entries. A missing root is no problem (that
//     runtime is not used here).
//   - A live container whose spec cannot be read is still listed (with
//     SpecErr): whoever frees GPUs must know it runs.
//   - Read only: the package never writes, signals or deletes anything.
//
// Cost: 200 entries, 100 of them live with a bundle, 30-40 ms on a
// loaded 2-core VM (BenchmarkScan); recover runs it once.
package runtimestate
