// Package devices answers "which GPUs can this container reach?".
//
// It owns the GPU inventory (NVML through go-nvlib, /proc/driver/nvidia, or a
// static list from the configuration) and the resolver that turns a container
// description (environment, mounts, annotations, CDI device names, Linux device
// nodes, privileged flag) into a canonical set of device UUIDs, following
// DESIGN.md §3.
//
// Invariants:
//   - The canonical identity of a device is its NVML UUID (GPU-… or MIG-…);
//     indices and minor numbers are only ever inputs.
//   - Resolution does no NVML call and no file I/O: it reads the cached
//     Inventory only. Loading or refreshing the inventory is explicit.
//   - Container-supplied strings are untrusted: bounded, never used as paths,
//     quoted in errors; every error names the offending token and its source.
//   - A full GPU conflicts with each of its MIG instances; sibling MIG instances
//     do not conflict (Conflicts).
package devices
