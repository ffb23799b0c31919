// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package devices answers "which GPUs can this container reach?".
//
// It owns the GPU inventory (NVML through the nvmlloader package,
// /proc/driver/nvidia, or a static list from the configuration; see
// Discover), the cache file the daemon writes for the OCI hook and
// gpu-guard-ctl (SaveCache/LoadCache), the one order in which every program
// loads the inventory (LoadInventory), and the resolver that turns a container
// description (environment, mounts, annotations, CDI device names, Linux
// device nodes, privileged flag) into a canonical set of device UUIDs,
// following DESIGN.md §3 (see Resolver.Resolve for the rules in detail).
//
// Invariants:
//   - The canonical identity of a device is its NVML UUID (GPU-… or MIG-…);
//     indices and minor numbers are only ever inputs. A GPU's minor number
//     (/dev/nvidia<minor>) need not equal its index.
//   - An Inventory is validated (unique UUIDs, indices and minors; MIG
//     instances belong to their GPU) and immutable once built, whether by
//     NewInventory, Discover, json.Unmarshal or LoadCache.
//   - Every program loads the inventory through LoadInventory, in one
//     documented order: a static source is authoritative everywhere; the
//     daemon discovers and writes the cache; the hook and gpu-guard-ctl read
//     it, else discover (the hook without NVML); else the load fails closed.
//   - A static list ([[devices.static]], named as the source or reached as
//     the last resort of "auto") is the inventory only when it is the GPUs
//     the driver lists under proc_root, by UUID, minor and index, compared
//     as a cache of another boot is; otherwise the load fails
//     (ErrStaticMismatch). A GPU whose UUID the driver does not know yet is
//     matched by what it shows. Without a driver tree it is used as it is.
//     Either way it is marked unchecked (Inventory.Unchecked): its cache is
//     checked against the driver on every read, an unknown id is refused
//     while UUIDs are unchecked, and the daemon checks it again until it is
//     checked in full.
//   - The cache is read only when it is a regular file owned by root (or
//     the reading user), not writable by group or others, and not a link
//     (ErrUntrustedCache): it decides which GPU a container's index means.
//   - The cache is used as it is only in the boot it was written in (its
//     boot_id), and only when it holds no static list; a cache of another
//     or an unknown boot, or one of a static list (in its boot too), is used
//     only when the GPUs the driver lists under proc_root are its GPUs, else
//     it is skipped (ErrStaleCache), since GPUs change while the host is
//     down. It is skipped too while the driver shows a GPU whose UUID it
//     does not know yet: nothing shows the cache matches. Without a driver
//     tree to compare with, it is used as it is.
//   - Resolution does no NVML call and no file I/O: it reads the cached
//     Inventory only. Loading or refreshing the inventory is explicit.
//   - Resolution fails closed: a well-formed id that names no device of
//     this host is an error unless policy.unknown_device = "ignore";
//     malformed and ambiguous ids, PCI bus ids of no GPU and mangled mount
//     paths are errors under every policy (NVIDIA's runtime reads ids
//     loosely and may select a GPU by one the resolver cannot read: a bus
//     id it matches to no GPU it reads as <gpu>:<mig>).
//   - When the rules are in doubt, a GPU counts as reachable: a device
//     cgroup rule is read the way (kernel and runc, or crun) that opens
//     more, its major and minor as each runtime reads them (crun keeps 32
//     bits of them: c 4294967295:* is c *:* there), a linux.devices entry
//     as the node the runtime makes of it (mknod(2) keeps 12 bits of the
//     major and 20 of the minor: c 4294967491:0 is 195:0), and a request
//     the runtime would refuse may still be claimed.
//   - Container-supplied strings are untrusted: bounded (MaxValueBytes,
//     MaxValueTokens, MaxRequestTokens), never used as paths, quoted in errors;
//     every error names the offending token and its source.
//   - A full GPU conflicts with each of its MIG instances; sibling MIG instances
//     do not conflict (Conflicts).
//   - The node of a GPU with MIG instances counts as the instances the
//     request names, since the capability nodes decide which run work; but
//     a container holding CAP_SYS_ADMIN (Request.Privileged), or one
//     whose spec gives no capabilities and so may hold it
//     (Request.SysAdmin), needs none (the driver's administrator), so
//     there it is the whole GPU.
//   - This package uses no cgo and does not import go-nvml: the NVML loader is
//     the separate package nvmlloader, handed to Discover by the programs
//     that enumerate through NVML (the daemon, gpu-guard-ctl). Everything
//     that only resolves (the guard, the ledger, the OCI hook) builds
//     without the NVML bindings.
package devices
