// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package guard is the one place that decides whether a container may have
// the GPUs it asks for, what the refusal says, and when a holder's claim may
// be released without a stop event (ReleasableIdle, the one release rule
// that the guard itself, gpu-guard-ctl gc and status, and the waiting OCI
// hook apply, through Guard.Releasable or ReleaseRule). Both front ends (the NRI plugin and the OCI hook) and gpu-guard-ctl
// call it; none of them contains policy (TestFrontEndsHoldNoPolicy). It also
// owns the one translation of the configuration into ledger.Options
// (LedgerOptions).
//
// A decision resolves the container's request against the cached inventory
// (no NVML, no file I/O), then, inside one ledger transaction: finds what is
// busy, releases holders whose processes are gone although no stop event
// arrived (or, under release_on = "remove", lets a container of the same pod,
// a restart or the pod's next container, take over the claims of one that
// has stopped on the devices it asks for), and claims, queues or refuses.
// Explain makes the same decision on a view and writes nothing; AdmitIfFree
// (a requester that does not wait) makes it under the lock and writes only
// an admission.
//
// It also keeps the persistent device states of the ledger (cordon.go): a
// cordon (CordonDevice, Uncordon; from gpu-guard-ctl, or from the
// observer for an intruder or an unhealthy device, never over a cordon of
// a source that ranks higher, operator > unhealthy > intruder, which stays
// as it was set: an operator's, or an unhealthy one under an intruder
// finding; gpu-guard-ctl lifts only the cordon it read, Uncordon) and,
// under [observe]
// release_requires_idle, draining claims (Draining, FinishDraining): a
// holder's stop, removal, pod removal, exit found out of band, or absence
// from the runtime's list at reconcile once its processes are gone keeps its
// claims draining until the observer sees its processes leave the GPU or
// idle_grace passes (the ledger releases them then, at any process's next
// update, so a host without an observer never waits longer).
//
// Invariants:
//   - A request for a cordoned device (or a MIG instance of a cordoned GPU,
//     or a GPU with a cordoned MIG instance) is refused outright, never
//     queued, whatever on_conflict says, before any holder is settled: a
//     cordon does not end by itself, so a queue position would promise a
//     turn nobody schedules. Its holder keeps its claim; the ledger never
//     reserves the device. The refusal names the device, the cordon (source,
//     by, since, why) and the command that lifts it, and is audited.
//   - A decision is all or nothing: every device of the request is claimed
//     in the same transaction, or none is. A container takes over the
//     claims of a stopped container of its pod (never of a running one) on
//     the devices it asks for (those in its way: a MIG instance's GPU, a
//     GPU's instances; the stopped container keeps the others, which a
//     sibling may ask for) only when that admits it, which is decided
//     before any claim moves (ledger.Tx.BusyAfterTakeOver: the
//     predecessor's claim hides a device kept for the head of the queue);
//     a refused one leaves the predecessor's claims untouched, and its
//     refusal names the predecessor and what else stands in the way. One
//     whose create is undone after its admission (refused at validation,
//     failed in the runtime) hands back what it took over when it is
//     removed without having started (remembered in memory, so within one
//     daemon's life).
//   - An earlier incarnation of the requester's own container (same id and
//     front end, another process: a runtime creates an id again only after
//     deleting its container) is judged without the requester's process,
//     which runs in the cgroup the runtime names after the id, and as
//     removed whatever release_on says (releasableFor): a restart is never
//     refused in its own name, and any other process left there keeps the
//     earlier claim.
//   - A holder that never started (no pid, no cgroup) is never checked for
//     liveness and keeps its claim; a holder is released out of band only on
//     positive evidence that its processes are gone. Absence from the
//     runtime's list at reconcile is no such evidence (containerd leaves out
//     a running container it could not load after a restart, CRI state
//     UNKNOWN): the claim of a container not listed ends only when the
//     release rule finds its processes gone (or recorded as stopped), or
//     when it never started — the runtime lists every created container, so
//     one never started and not listed is gone, and no event would end its
//     claim (Reconcile, unlistedRule). Under release_on =
//     "remove" an OCI hook holder's claim, kept past its exit, ends out of
//     band only on positive evidence that its container was removed too: no
//     runtime state root ([hook] runtime_roots) lists its id, and at least
//     one of them was read (RuntimeRoots). A root that cannot be read keeps
//     the claim, and the refusal, status and gc say why (Verdict.Unsure);
//     a root that still has the container keeps it too, and the refusal and
//     status name that root and how to end the claim should the engine have
//     lost the container (Verdict.Listed, KeptRemedy).
//   - Stop and remove events release only the given container id's claims and
//     never touch the queue: a refused create is followed by both, and its
//     requester keeps its place. A front end that names a removed container
//     by id alone while another container may run under that id (the OCI
//     hook's poststop) ends only the claims and queue entry whose recorded
//     process is gone, decided under the ledger lock (RemovedExited,
//     WithdrawExited). Pod stop/removal drops the pod's waiters;
//     a front end's pod events touch only its own claims and waiters, and
//     only those of the sandbox the event names (a pod keeps its UID across
//     the sandboxes the kubelet gives it; ledger.PodMatches). A pod the
//     runtime no longer lists loses its waiters (ForgetVanishedPods), never
//     a claim: the reconcile decides claims from the container list.
//   - Every refusal message names each busy device by index and full UUID,
//     its holder (namespace/pod/container and short id; a container found
//     running on it at reconcile without a claim counts as one) or the
//     waiter it is reserved or kept for, the device that makes it busy when
//     that is another (a whole GPU against one of its MIG instances), the
//     queue position, and what to do. Decision.BusyText says the same of
//     the busy devices after the decision (the waiting OCI hook's progress
//     lines and give-up errors, gpu-guard-ctl run): one wording.
//   - Nothing a container's creator can set decides a trust question: an
//     exemption (exempt_namespaces), the takeover of a stopped claim by a
//     restart in the same pod, and the requester key rest on pod identity
//     only from a front end that vouches for it (TrustsIdentity: NRI and
//     ctl, never the hook, whose pod names are spec annotations). An
//     exemption is audited, or not granted.
//   - Container-controlled names are bounded by BoundOwner on every request,
//     whatever the front end (the front ends apply it too, before logging).
//   - No admission is ever decided against a ledger that is not the last
//     committed one. When the ledger cannot be read or locked in time, or is
//     damaged, missing, moved, replaced or in an unsafe dir (errors wrapping
//     ledger.ErrNeedsRecovery or ledger.ErrUnsafeDir), Admit returns an
//     error and the front end refuses every container, saying which file is
//     wrong and what the operator does (gpu-guard-ctl recover; on an NRI
//     host the daemon recovers at its next sync): the guard fails closed.
package guard
