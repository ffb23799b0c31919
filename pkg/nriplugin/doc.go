// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package nriplugin is the containerd NRI adapter of the guard: it turns NRI
// events into guard calls and runs the plugin in either launch mode. It holds
// no policy and builds nothing: the guard comes from the SetupFunc it is
// given (package daemon in production), and every decision is the guard's.
//
//   - CreateContainer: the container's env, mounts, annotations, CDI devices,
//     Linux devices and device-cgroup rules become a devices.Request; the
//     guard's decision admits it or refuses it with the guard's message.
//   - ValidateContainerAdjustment (containerd 2.2 and later): the container
//     as containerd creates it once every plugin adjusted it (adjusted:
//     env, mounts and devices changed one copy of a key at a time, as
//     containerd applies them) must reach only GPUs it claims. Where NRI
//     showed the plugins another env (a variable the spec holds twice, set
//     by a plugin: containerd keeps the last original copy), that view is
//     checked too.
//   - StartContainer / PostStartContainer: the pid and cgroup are recorded for
//     the out-of-band liveness check.
//   - StopContainer / RemoveContainer: the guard releases or keeps the
//     claims (Guard.Stopped, Guard.Removed).
//   - StopPodSandbox / RemovePodSandbox: the pod's claims are released and its
//     waiters leave the queue.
//   - Configure: the guard is built (SetupFunc) within the request's
//     deadline; a GPU discovery still running then goes on in the
//     background, GPU requests refused meanwhile (guard.Guard.Discovering).
//   - Synchronize (every (re)connect): the ledger's NRI claims are reconciled
//     with the containers the runtime lists (the claim of one not listed
//     ends only once its processes are gone or if it never started: the
//     guard's release rule, since containerd leaves out a running container
//     it could not load), and the guard forgets the
//     waiters of pods the runtime no longer lists. A launched plugin whose
//     reconcile fails still answers (containerd would stop it for good) and
//     rebuilds in place from the containers listed. One that comes while
//     the guard's GPU discovery still runs is answered the same way and
//     reconciled once the discovery's inventory is in (a launched plugin
//     in place, an external one by reconnecting): over an inventory that
//     knows no GPU, running containers' GPUs would read as free.
//
// Invariants:
//   - A handler never blocks on a GPU becoming free. containerd serialises
//     all NRI calls under one lock, so the holder's StopContainer cannot
//     arrive while CreateContainer waits, and a handler that overruns the
//     request timeout gets the plugin dropped: containerd 1.7–2.1 then
//     creates the container unchecked, 2.2–2.4 refuse it (they ask the
//     closed plugin to validate it, which fails), and every create after
//     the plugin's removal is refused only by the containerd drop-in.
//     Every decision runs under a deadline well inside the request's;
//     "queueing" is a FIFO reservation across kubelet retries.
//   - Every handler's ledger work, not only CreateContainer's, runs under
//     a deadline inside the request's: a Stop or Remove that answered late
//     would get the plugin dropped just the same.
//   - When the guard cannot decide (ledger lock busy, corrupt ledger, a
//     panic under a handler), the create is refused with a clear error:
//     fail closed, never open. A panic never ends the process: a
//     connection that breaks under a request lets that container through
//     on containerd before 2.2, and drops the plugin on every line.
//   - A release that fails (ledger lock busy) is due: it is retried, with
//     its own event's meaning, at the start of every later handler that
//     takes the ledger lock and on a timer with backoff, until it succeeds
//     or a reconcile settles it. A create of a container id whose earlier
//     container's release is still due is refused: releases name a
//     container by id alone.
//   - After a ledger was found needing recovery, the plugin refuses GPU
//     creations until it is rebuilt (the others are decided as always,
//     needing no holder): an external plugin by the reconnect's
//     Synchronize, a launched one (which cannot reconnect) in place, from
//     the containers it tracks. Every handler requires the ledger lineage
//     the last rebuild reconciled: a ledger another process started afresh
//     (it found it corrupt, missing or from an earlier boot) has forgotten
//     the running holders, and is handled the same way, before anything is
//     decided on it. A rebuild lifts that fence while it rebuilds, so no
//     create decides while one runs: the create's last rebuilding check
//     and its decision happen under a shared lock the rebuild holds
//     exclusively, and a create that cannot take it refuses at once.
//   - The tracked containers are what a Synchronize would list of the GPU
//     containers: every claim holder and conflict-record container the last
//     rebuild found, every admission since, less every stop and removal
//     since, each with its request as last seen (pid and cgroup once
//     started). An in-place rebuild that sees them change runs again; a
//     stop or removal leaves the set before its release is written, so
//     that no rebuild adopts back a claim the release ends.
//   - A recovery that reads the OCI runtimes' state for the hook's
//     containers leaves out every container the runtime has shown this
//     plugin (listed at Synchronize or created since, not removed), GPU or
//     not: they are this front end's, even in a runtime root the hook
//     shares (CRI-O's runc root).
//   - The connection is only closed on purpose (resync, SIGTERM) once no
//     handler has run for a short quiet period, so that no reply is cut.
//   - Run returns once its context is done wherever it is in reaching the
//     runtime: dialing, registering, or waiting for a Configure that never
//     comes (the stub's Start ignores the context there; it is abandoned).
//   - Stop and Remove of a container only ever touch that container id's
//     claims: containerd sends both for a refused create.
//   - The event mask never includes events 12–14 (pod sandbox updates,
//     adjustment validation), which containerd 2.0/2.1 refuse.
package nriplugin
