// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package hook is the OCI runtime hook front end of nri-gpu-guard, for
// runtimes that do not speak NRI (podman, CRI-O without NRI, Docker through a
// wrapper runtime, plain runc).
//
// A runtime runs "nri-gpu-guard-hook create-runtime" before the container's
// process starts and "nri-gpu-guard-hook poststop" after it was deleted
// (cmd/nri-gpu-guard-hook, a small static binary; "nri-gpu-guard hook PHASE"
// runs the same Run). Both read the OCI state (specs.State) on stdin and the
// bundle's config.json (for a state that names the bundle "/", as crun 1.8
// does for a container with a user namespace and devices, crun's own copy
// of it in its state directory: crunSpec).
//
// create-runtime decides at once by default: engines such as podman hold the
// container's lock while it runs, so waiting there froze them. Waiting happens
// outside the engine instead: AcquireTicket (gpu-guard-ctl run) queues a
// ticket, and the container that carries the ticket (TicketEnv) takes its
// claim over. With Options.Wait the hook waits itself, unless its runtime was
// started by an engine that holds such a lock (conmon, containerd-shim).
//
// Invariants:
//   - The hook never decides anything itself: admission, the "does this
//     container name a GPU at all" pre-check (guard.Prescreen) and the
//     release rule its waiting loop watches (guard.Releasable) are pkg/guard's,
//     the same code the NRI front end uses, over the same ledger.
//   - Fail closed: a create-runtime hook that cannot read its input, resolve
//     the devices or reach the ledger, or cannot write the marker a
//     container's poststop needs to find its claim (below), exits non-zero
//     with one self-contained line, and the runtime refuses the container.
//   - A create-runtime hook that does not wait leaves no waiter: it decides
//     in one transaction that records only an admission
//     (guard.AdmitIfFree), so a busy answer changes no ledger state.
//   - A waiter (hook or ticket) that is cancelled (SIGTERM/SIGINT), times
//     out, or whose container disappears leaves no claim and no waiter: the
//     withdrawal retries lock timeouts, for ten lock timeouts, or for 500 ms
//     when told to stop (so SIGTERM ends it within a second), or, for a
//     --wait hook whose config.json definition has a timeout, until 500 ms
//     before the runtime kills it. An entry left by a waiter killed with
//     SIGKILL, or that could not withdraw within that budget, is dropped by
//     the next request it stands in the way of, once the process its entry
//     records is gone.
//   - A --wait hook's wait counts from the hook's start (Options.Started;
//     under a hook timeout, its process's start where that was earlier: a
//     hook the relay exec'd), as the runtime's hook timeout does; under
//     such a timeout it ends
//     2 s before the kill: it wakes at that deadline whatever
//     hook.poll_interval is, no Admit waits for the turnstile or the ledger
//     lock past it, and the dead waiters dropped before an Admit share one
//     budget that ends there. Under a timeout of 2 s or less it does not
//     wait at all: it decides as a hook without --wait does, ending 0.5 s
//     before the kill.
//   - Signal handling (SIGTERM/SIGINT cancel, SIGPIPE ignored) is set up
//     only before the hook blocks: before it waits in the queue, for the
//     turnstile or for a ledger lock another process holds (interrupts).
//     Before that a signal ends the process the default way, with nothing
//     written or with whole, crash-safe transactions that the runtime's
//     cleanup of a failed container undoes.
//   - Hook processes line up on a blocking flock (hook.turnstile) before
//     they write the ledger; the turnstile is an optimisation, the ledger
//     lock alone makes a write safe.
//   - A ticket's claim moves to a container only if the ticket holds every
//     GPU the container asks for and none of them is cordoned (checked in
//     the hand-over's transaction); the container takes over the claims on
//     the GPUs it asks for and the ticket's others are released in the same
//     transaction; a ticket is used once.
//   - poststop is idempotent: releasing a container that holds nothing
//     succeeds. A container whose spec names no GPU under any policy
//     (Input.NeverClaims) and that has no marker (create-runtime writes one
//     before it writes anything of the container to the ledger, so that a
//     config.json edited after create cannot make poststop skip a release:
//     marker.go) does not open the ledger at all; a marker only makes
//     poststop read the ledger, never decides a release; one absent from
//     the ledger is told apart by a lock-free read and never takes the lock,
//     and one present takes it only for the writes it needs (release if it
//     holds, withdraw if it waits).
//   - The marker also leads poststop to the claim of a container that
//     reaches GPUs only because no device cgroup applies to it (CAP_MKNOD,
//     CAP_SYS_ADMIN, a bind through a symlink, a root filesystem or a
//     directory bound in not nodev in the container): poststop cannot read a
//     cgroup (the process is gone) and goes by the spec's spellings, which
//     do not show such a claim. create-runtime refuses such a container
//     when it cannot write the marker (poststopFindsClaim), since its claim
//     would outlive it; any other container goes on without one, with a
//     line on stderr.
//   - Under [hook] poststop = false (the host installs the createRuntime
//     hook alone) create-runtime writes no marker: no poststop would read
//     or remove it. Claims then end only the out-of-band way (the guard's
//     release rule at the next request for the GPU, gc).
//   - poststop never ends what another container of the same id has (ids
//     are unique only per runtime root or containerd namespace): which
//     claims and queue entry of the id are the deleted container's is
//     decided under the ledger lock, never from the lock-free read; one
//     whose recorded process (pid and start time) still runs is kept.
//   - The input is read once (ReadInput). A container that can reach no GPU
//     under any configuration is answered from it alone: both hook entries
//     (nri-gpu-guard-hook and "nri-gpu-guard hook", one path: Main) do so
//     before loading the configuration, so a configuration that does not
//     load refuses only containers that could reach a GPU. The decoders
//     of the state and the spec take a fast path without reflection only
//     where it yields exactly what encoding/json yields (FuzzFastDecode).
//   - The package imports nothing of NRI, ttrpc, protobuf, prometheus,
//     net/http or NVML: the hook binary links it alone (TestHookDeps in
//     cmd/nri-gpu-guard-hook).
//   - A waiting hook reads the ledger without the lock at every poll and
//     asks the guard again (a locked write) only when the answer can have
//     changed or its queue entry needs refreshing; it reads the state before
//     each such Admit, so no change between two polls goes unnoticed.
//   - Container-supplied input (state, config.json) is bounded in size and
//     never opened as a path, except the bundle directory the runtime
//     names (or, for the bundle "/", <root>/<id>/config.json below crun's
//     state root: its command line's --root, else its environment's
//     XDG_RUNTIME_DIR/crun, else /run/crun; only when owned by the hook's user
//     and writable by no other, with no symlink below the root; a
//     recovery's ReadSpec takes the root's owner for that user). Mount
//     sources (a relative one from the bundle), overlay layers (lowerdir,
//     lowerdir+, datadir+, upperdir) and the root filesystem (root.path,
//     and its dev) are stat'ed (the root statfs'ed too) to tell what they
//     are on the host (boundNodes, boundRoot), never opened. Where no
//     device cgroup applies, a directory source's symlinks are resolved, it
//     is statfs'ed (a procfs; a mount not nodev, whose nodes open),
//     /proc/self/mountinfo is read (bounded) for the mounts below a
//     recursive bind, and a directory of the host's /dev filesystem is
//     listed (bounded) for its nodes (readDirs); the link
//     /proc/<ppid>/exe (or, where it reads "/", the first argument of
//     /proc/<ppid>/cmdline) tells, at most once, whether the runtime keeps
//     the nodev of a source's or the root's mount (runc for a bind without
//     flag options and a read-write root; crun never: readRoot), and,
//     where that decides, the ns/user links of the container's process and
//     the hook's tell, at most once, whether a user namespace of the
//     container's own locks that nodev (runc for any bind and root, crun
//     for its root: userNSLocksMounts). Nothing
//     in the container's root filesystem, or in another directory bound
//     in, is opened or listed: where its nodes open (a rootful runtime, a
//     mount not nodev, or nodev but dropped by the runtime), it counts as
//     reaching every GPU node.
//   - No NVML initialisation per container: the inventory comes from the
//     daemon's cache (inventory.json in the ledger dir) or a /proc or static
//     discovery.
package hook
