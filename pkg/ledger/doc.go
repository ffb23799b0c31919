// Package ledger is the host ledger: the single source of truth for which
// container holds which GPU, who waits for it, and for whom a released GPU is
// reserved. It is shared by the NRI daemon, any number of OCI hook processes
// and gpu-guard-ctl.
//
// Files in the state dir (created 0700; refused if a symlink, world-writable or
// owned by another user): ledger.json (state), ledger.lock (flock; never
// deleted), audit.log (JSON lines, rotated by size).
//
// Invariants:
//   - Every mutation runs under the exclusive lock: read + verify, change,
//     write a temp file, fsync, rename, fsync the dir. A crash at any instant
//     leaves the old or the new state, never a torn one.
//   - No device is ever held by two claims, and no claim conflicts with another
//     (a full GPU and its MIG instances exclude each other).
//   - A claim belongs to exactly one container id; release is idempotent and
//     only ever releases claims of the given container id.
//   - A device that is free and wanted by a waiter is reserved for the earliest
//     such waiter (FIFO by arrival), until reservation_ttl.
//   - A state file that fails to parse or verify is moved aside
//     (ledger.json.corrupt-<time>), never silently overwritten; state from an
//     earlier boot is discarded with an audit record.
//   - Every mutation appends an audit record.
package ledger
