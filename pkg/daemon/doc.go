// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package daemon builds what the NRI daemon decides with, from a
// configuration: the ledger, the GPU inventory (discovered once, NVML
// included, again in the background while it lists no GPU, and written to
// the cache the OCI hooks and gpu-guard-ctl read) and the guard over both. Builder.Setup is the nriplugin.SetupFunc the daemon hands to the
// NRI adapter; cmd/nri-gpu-guard wires it together with the metrics
// endpoint and the Watch.
//
// Watch runs the GPU observer (pkg/observe) beside the guard and applies its
// policy: each finding (intruder, out of bounds, unhealthy) is logged once
// when it appears and when it clears, audited, counted (metrics) and written
// to observe.json in the state directory for gpu-guard-ctl status (and the
// intruder and out-of-bounds ones, and the unhealthy devices, to
// observe-carry.json, for the next daemon of the same boot); under
// [observe] on_intruder = "cordon" an intruder's device is cordoned, an
// unhealthy device always is (persisted in the ledger, so the hook front end
// honours it too); under release_requires_idle a draining claim is released
// once its holder's processes left the device, or after idle_grace.
//
// Invariants:
//   - The inventory is loaded by devices.LoadInventory as RoleDaemon, the
//     order every program shares: a static source is the configured list;
//     otherwise discover, write the cache, and fall back to a trusted cache
//     (with a warning) when discovery fails. With neither, the daemon starts
//     over an empty, undiscovered inventory that refuses every GPU request
//     and writes no cache (the hooks keep failing closed): refusing to start
//     deadlocks a GPU Operator node, whose driver pod containerd
//     (required_plugins) starts only once the guard is registered.
//   - An inventory that lists no GPU (the NVIDIA driver came up after the
//     daemon, as a GPU Operator's driver container does) or that is the
//     cache a failed discovery fell back to is discovered again by
//     Builder.Rediscover (5s doubling to 1 min) until discovery lists GPUs;
//     then the cache is rewritten and the inventory swapped into every guard
//     built over the old one (guard.SetInventory), without a restart. While
//     the PCI bus shows NVIDIA GPUs discovery does not list, a cache that
//     lists GPUs is kept, not overwritten, and not decided with.
//   - A static list used without a check against the driver in full
//     (devices.Inventory.Unchecked: no driver tree under proc_root, or a GPU
//     whose UUID the driver does not show yet), under "static" or as the
//     last resort of "auto", is decided with, and checked again the same
//     way until the driver shows it matches (then it, or under "auto" what
//     discovery lists, is the inventory, cached, and the retries stop) or
//     contradicts it (devices.ErrStaticMismatch: an undiscovered inventory
//     carrying the mismatch is swapped in, refusing every GPU request).
//     Nothing is swapped or logged while nothing changes: fake GPUs (tests,
//     demos), whose proc_root never gets a driver, cost a directory read
//     per minute.
//   - A Setup with an unchanged [devices] section and state directory reuses
//     the ledger and the inventory: a reconnect (which calls Configure again)
//     costs no NVML enumeration.
//   - Setup answers by its context's end: the inventory is loaded in the
//     background, and a load still running then (NVML's enumeration
//     outlasting the runtime's request timeout) leaves the guard it returns
//     over an undiscovered inventory that refuses every GPU request, saying
//     that the discovery is in progress (guard.Options.Discovering), until
//     the load swaps in what it found (guard.SetInventory) and Rediscover
//     hands the guard to the observer. A context that never ends (the
//     external daemon's first Setup) waits for the load and gets its error.
//   - The Watch never runs on the admission path: Use only hands over the
//     guard; NVML is queried in the Watch's goroutines, never under the
//     ledger lock. Without NVML it logs one line and observes nothing, and
//     tries NVML again only once the inventory comes from a discovery that
//     works after one that listed no GPU or fell back to the cache (the
//     GPU Operator's reboot: the library was not there yet), not at every
//     reconnect.
//   - Findings are acted on only while the plugin is synchronized with the
//     runtime (Watch.SetReady): before Synchronize, containers created while
//     the plugin was down are not adopted yet and would read as intruders.
//     Readiness counts when the pass reads the ledger: no pass reads it
//     while the plugin is not ready, and a report whose view was read before
//     the last SetReady(true) is dropped (the pass waits in NVML after the
//     read, and the plugin may have resynchronized meanwhile).
//   - A cordon the observer decided is not lost to a failed write: an
//     unhealthy device's is retried at every pass, by an observer started
//     afresh too (NVML reports the Xid once), while the inventory lists the
//     device; an intruder's at every pass that still reports a process the
//     guard did not admit on the device (dropped once none is).
//   - An observer that runs no pass ([observe] interval = "0s") still
//     watches health, and settles its unhealthy devices on its own
//     (Watch.settleLoop) as a pass would: at once when it starts (the
//     cordons it took over pending, from the daemon before or the
//     observer before), then after a back-off while a cordon is still to
//     be written and every 10s while one is watched (lost: written again;
//     lifted: forgotten). Settling and a device found unhealthy are
//     handled one at a time (Watch.healthMu).
//   - An observer's cordon is in force while the device has a cordon,
//     whatever its source: the ledger keeps one cordon per device, the one
//     of the highest-ranking source written (operator > unhealthy >
//     intruder: an operator's replaces the observer's, an unhealthy one
//     an intruder's, and an intruder's finding leaves an unhealthy cordon
//     in force, so a broken device's cordon never turns into one lifted
//     with its intruder); only an uncordon removes it (judgeCordons, the
//     one rule for a pass and for the daemon after). An observer's cordon
//     missing in the ledger lineage it was written in (read before the
//     write) or last seen in force in was lifted by an uncordon: nothing
//     else removes it within a lineage. Missing in another lineage (a
//     reset, or a recovery that started afresh or lost commits), it may
//     have been lost with the state: it is written again, logged and
//     audited as such ("cordoned again").
//   - An unhealthy device stays unhealthy, and cordoned, until the operator
//     uncordons it: then it is forgotten, and its next critical error
//     cordons it again. It stays so across a restart of the observer (NVML
//     reports the Xid once): every unhealthy device the new inventory
//     lists is carried over, with the lineage its cordon was seen in, so
//     that a cordon lost later is written again and an uncordon is still
//     told from a loss. So is a restart of the daemon (same boot), whatever
//     [observe] interval (the health watcher runs at "0s" too, and the
//     daemon's first observer that watches health takes the file over):
//     the unhealthy devices are in observe-carry.json, each with the lineage
//     of its cordon and its cordon pending when it was still to write
//     (written there before the cordon), whatever cordon is in force on
//     it: an operator's outranks an unhealthy one and is kept instead
//     (ledger.CordonKept), so the ledger alone does not say that the
//     device failed. The daemon after lists them, watches them and
//     cordons them again as unhealthy if no cordon is in force on them
//     in another lineage, as the daemon before would. A new observer also
//     adopts the unhealthy cordons in force in the ledger that it does
//     not carry (a file of an older daemon carries no unhealthy device);
//     a reboot forgets both (a device that still fails is found again).
//   - An intruder's device (on_intruder = "cordon") stays cordoned while a
//     process the guard did not admit is reported on it, until the
//     operator uncordons it: then the same finding does not cordon it
//     again (a new one does). Once no finding is left on the device, its
//     cordon is no longer watched. A restart of the observer is no new
//     finding: the findings on the devices the new inventory lists are
//     carried over (when it still accounts, over the same ledger), with
//     their cordons' lineages and pending retries, and the first pass that
//     no longer sees one clears it. So is a restart of the daemon: its
//     first observer that accounts carries them from observe-carry.json,
//     which the daemon rewrites after each pass that changes them and
//     keeps across a clean stop (a daemon whose observer does not account
//     keeps the findings there as it found them, for one that does). A pass that cordons intruders writes it
//     before its cordon writes too, naming them pending: a daemon that
//     dies between its cordons and the file leaves the next one each
//     pending cordon to write unless the ledger shows a cordon in force
//     on the device, never one it takes for written (and, missing, for
//     lifted). Only a daemon that dies between a pass's audit records and
//     the file has the next one report that pass's new findings once more
//     (logged, audited, cordoned): two writes, the records first, so that
//     none is ever missing. A finding is a process (the boot, the pid
//     and its start time): one that ended is cleared at the first pass, a
//     pid reused is a new finding. The ledger decides the cordons: on a
//     carried finding's device whose cordon the daemon before watched or
//     still had to write, a cordon in force is seen in force there,
//     whatever the file says; one missing is judged at the first pass by
//     the lineage the file recorded (lifted or lost). A file
//     that is missing, of another boot or format, or unreadable carries
//     nothing (logged): every process is judged afresh, toward reporting
//     and cordoning.
//   - A finding on a MIG instance the inventory lacks (created since
//     discovery) is its GPU's (observe.Finding.Instance names the
//     instance): the guard can cordon only what the inventory holds, and
//     the GPU is what a claim could take whole while the process runs.
//     Everything the policy keeps of it (its key, its cordon's lineage
//     and retry, the carry file) names the GPU, so the GPU's cordon is
//     judged at each pass as any device's; the instance is what NVML
//     lists or fails to list, and a pass that could not list it keeps the
//     finding. The log and the cordon's reason name the instance.
//   - A clean stop removes observe.json; a report left behind by a daemon
//     that died grows stale, and status says so instead of trusting it.
//   - Failing to write the inventory cache is not fatal: the hooks fall back
//     to discovering the GPUs themselves, and Rediscover writes the
//     inventory known again with its back-off (no new enumeration: a
//     reconnect's Setup reuses the inventory all the same).
package daemon
