// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package observe sees the GPUs themselves: which processes really run on
// each GPU and MIG instance, whether the ledger explains them, and whether a
// device is healthy.
//
// It owns the observer (New, Observer.Run): a periodic accounting pass
// (Observer.Account) that lists the compute and graphics processes NVML
// reports on every device, maps each pid to its container through
// /proc/PID/cgroup (the line liveness.PickCgroup picks, one that names a
// container first, so that a hybrid cgroup host's unified line, left at the
// shim's cgroup, does not hide the container; ContainerIDFromCgroup) and
// compares them with the claims the ledger holds (Ledger, Holding); the
// draining check of release_requires_idle (Observer.Idle); and the health
// watcher, which subscribes to NVML's critical Xid events and turns a
// critical Xid, a device that vanished or one that needs a reset into an
// unhealthy device (Observer.Unhealthy, Observer.Health).
//
// It also owns observe.json (File, WriteFile, ReadFile): the daemon's last
// report for gpu-guard-ctl, bounded, written atomically, judged stale after
// three intervals without a pass; and observe-carry.json (Carry,
// WriteCarry, ReadCarry): the findings the daemon acted on, for the daemon
// after it, named by process (the boot, the pid and Finding.StartTicks), and
// the devices it found unhealthy (UnhealthyDevice).
//
// Rules (Finding.Kind):
//   - intruder: a process of a container that holds no claim (or of the
//     host) runs on a device held by another container, or on a free one;
//   - out_of_bounds: a process of a holder runs on a device its claims do not
//     cover (a claim on a GPU covers its MIG instances);
//   - unhealthy: a critical Xid (the configured list), or NVML reports the
//     device lost, not found, or needing a reset. An Xid event's device is
//     found by its UUID or, when NVML cannot read it (a GPU fallen off the
//     bus), by the handle its GPU was registered by, its PCI bus id or its
//     minor number; one that nothing matches is logged as outside the
//     inventory only when something was read of it, and otherwise is a
//     critical Xid of an unidentified device: an error in the log, an
//     unhealthy finding in every report and, once per Xid code, a call of
//     OnUnidentified, telling the operator to find and cordon the GPU by
//     hand, never taken for a stranger's and dropped;
//   - gone (informational): NVML listed a pid whose /proc entry vanished and
//     that the kernel no longer knows (kill(pid, 0) answers ESRCH), or whose
//     pid was reused by a process started after the listing.
//
// Invariants:
//   - The observer never kills, never refuses, never writes the ledger: it
//     reports findings to callbacks; what to do with them is the caller's
//     policy (report, cordon, keep a claim draining).
//   - Admission never waits for NVML: Unhealthy and Health read memory only.
//     Every NVML query runs bounded by its context (ErrNVMLSlow), one at a
//     time; the health watcher runs in its own goroutine, stops within one
//     event wait of its context ending, and retries NVML failures with
//     capped exponential back-off (starting over after a watch that ran); a
//     GPU whose registration for Xid events failed is registered again, with
//     back-off, while the others are watched. Run returns when its context
//     ends even if NVML never returns from a call; with no GPU it makes no
//     event wait.
//   - Callbacks (OnReport, OnUnhealthy) never hold up the observer: Run
//     delivers them from a goroutine of its own; a slow consumer gets the
//     latest report and every unhealthy device (at most one per device).
//   - Closing the NVML source never shuts NVML down under a call in flight:
//     the last call to return does it.
//   - A pid is never guessed: a pid that cannot be attributed (gone, reused,
//     unreadable) is not blamed on a container or on the host; a device whose
//     processes cannot be listed is reported with its error and not judged.
//     Nor is it taken for gone when it may still run: Idle answers an error
//     for a listed pid whose /proc entry is unreadable, or missing while the
//     kernel still knows the pid (/proc mounted with hidepid).
//   - The processes of a GPU in MIG mode are listed on its MIG instances,
//     never on the GPU (its list aggregates theirs). Each pass walks the MIG
//     layout NVML reports now, not only the inventory's: an instance created
//     since discovery is listed and judged too (a claim on its GPU covers
//     it; otherwise it is free), Idle counts its processes, and its
//     DeviceReport.NotInInventory says the inventory lacks it and how to
//     rebuild it (it is logged once); its Error, as any device's, is set
//     only when NVML could not list its processes. An intruder or
//     out-of-bounds finding on it is its GPU's (Finding.Device), the
//     instance in Finding.Instance: the guard can claim and cordon only
//     what the inventory holds, and the GPU is what a claim would take
//     whole while the process runs. Instances are told apart by UUID, never by MIG
//     index: an instance of the inventory that NVML reports at another
//     index (destroying and creating instances beside it moves it) is
//     still the inventory's, listed and judged as such (its new index is
//     logged once); one is vanished only when it is in no index of a
//     layout NVML told whole.
//   - Every message names the device by index and UUID, the pid, and the
//     container (or "host process"); an instance the inventory lacks is
//     named with its GPU's index and UUID as well.
//   - NVML reports host pids: the process running the observer must see the
//     host's pid namespace and /proc (Options.ProcRoot).
//   - Code that needs cgo (NVML) is confined to nvml.go; builds without cgo
//     compile and OpenNVML reports NVML as unavailable.
package observe
