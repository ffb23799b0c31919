// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package ctl implements gpu-guard-ctl, the operator's tool: it shows who
// holds which GPU (status, claims, queue, devices, audit), what really runs
// on the GPUs (ps, through NVML; status adds the daemon observer's last
// findings from observe.json), explains the
// decision a container would get (explain), fixes stuck claims (release, gc),
// validates configurations (check-config) and waits for GPUs outside a
// container engine before starting a container on them (run).
//
// Everything runs through Run, which takes the arguments and an Env (output
// writers, clock, uid, cgroup/proc roots) so that tests drive the real command
// tree against a real ledger directory; cmd/gpu-guard-ctl only wires os.Args,
// os.Stdout and signals into it, and so does `nri-gpu-guard ctl`.
//
// Invariants:
//   - A process without NVML (the static release binary: Env.NeedNVML set)
//     never stands in for it: where a command would initialise NVML (ps,
//     discovery under devices.source "nvml" or "auto" without a trusted
//     cache, every refresh that discovers through NVML), it hands the whole
//     invocation to `nri-gpu-guard ctl` before it has printed or written
//     anything, or fails naming that binary; it never falls back to /proc
//     or the static list, which would show another inventory than the
//     daemon's.
//   - Read commands never take the ledger lock and never write: they open the
//     ledger with ledger.OpenReadOnly and read it once with Ledger.View (the
//     committed state with queue expiry applied as of now), so an operator
//     polling status can never delay the daemon's admission decisions.
//   - Only root mutates (release, gc, devices --refresh, run), every mutation
//     goes through one ledger Update and leaves an audit record naming the
//     reason. run queues and claims through pkg/hook (the guard's own rules),
//     never by writing the ledger itself.
//   - Exit codes are a public interface: 0 ok, 1 error, 2 usage (unknown
//     command or flag, missing argument), 3 attention (status found a
//     conflict, a stale claim, an observer finding, a device the observer
//     could not list or one the daemon's inventory lacks, a cordon the
//     observer set, or a stale observer report; ps found an intruder, an
//     unhealthy device, one NVML could not list or one the inventory lacks:
//     a device nothing was checked on is never "no intruder");
//     run exits with its command's code. An operator's cordon, a
//     draining claim and a claim kept until its exited holder is removed
//     (release_on = "remove", a removal that can be told) are shown, never
//     a reason to exit 3: they are intended or end by themselves. So is,
//     under [hook] poststop = false, an exited OCI hook holder's claim
//     (not a ticket's): there only the next request for its device or gc
//     ends it, by design.
//   - A read command never shows a directory that holds no ledger as an
//     empty one without saying so: a --state-dir without any of the
//     ledger's (or the daemon's) files is refused, a [ledger] dir of the
//     configuration that is missing or holds none is warned about (a fresh
//     host looks like that), and a ledger whose files vanished after this
//     boot committed to it is refused by the ledger itself (audit too).
//   - status shows for every device one state (conflict, cordoned,
//     draining, held, reserved, free: the first that applies) and the
//     cordon covering it, the same one cordonOf finds and the guard
//     refuses with; it joins the state through maps built once
//     (statusIndex, cordonIndex), never a scan of a list per row.
//   - status never trusts an observer report older than three intervals: it
//     reports it stale instead of showing its findings.
//   - JSON field names are a public interface, documented in docs/ctl-json.md;
//     tables are for people and may change.
//   - Strings that came from containers (names, ids, reasons) are escaped
//     before they reach a terminal.
package ctl
