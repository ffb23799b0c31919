// Package ledger is the host ledger: the single source of truth for which
// container holds which GPU, who waits for it, and for whom a released GPU is
// reserved. It is shared by the NRI daemon, any number of OCI hook processes
// and gpu-guard-ctl, each with its own Ledger on the same state dir.
//
// Files in the state dir (created 0700; refused if a symlink, writable by
// group or others, or owned by another user; never followed as symlinks):
//
//   - ledger.json: the state, in an envelope with the format version, the
//     boot id, the generation and a sha256 checksum of the state bytes;
//   - ledger.lock: the flock every mutation holds (never deleted);
//   - audit.log: one JSON line per change, rotated to audit.log.1 by size;
//   - ledger.json.corrupt-<UTC time>: a state file that did not verify, kept
//     for a human.
//
// Use: Ledger.Update runs a function on a Tx under the lock and commits what
// it changed; Ledger.Snapshot reads without the lock; Ledger.View runs a Tx
// that is never committed (explain). Policy — admit, queue or reject, and
// the messages — lives in the guard, not here.
//
// Invariants:
//   - Every mutation runs under the exclusive lock, bounded by
//     min(LockTimeout, context deadline): read + verify, change, write a temp
//     file, fsync, rename, fsync the dir, append the audit records. A crash at
//     any instant leaves the old or the new state, never a torn one; a
//     leftover temp file is never read and is removed by the next writer.
//   - No two containers hold conflicting devices (the same device, or a full
//     GPU and one of its MIG instances); a claim is all or nothing.
//   - A claim belongs to exactly one container id; release is idempotent and
//     only ever releases claims of the given container id.
//   - Reservations are all or nothing: a waiter holds one on every device it
//     asks for (bar those its own container holds), or none. Whenever every
//     device some waiter asks for is free, they are reserved for the earliest
//     such waiter until reservation_ttl; so a newcomer never takes devices a
//     waiter could start on, every reservation can be used at its waiter's
//     next retry, and no free device is held for a request that cannot start
//     (no two waiters can block each other with halves of their requests).
//     Reservations are never taken back before they are used or expire,
//     unless they stop covering their waiter's whole request (its retry asked
//     for other devices, or a container found running on one took it).
//     Waiters not seen for queue_ttl are dropped.
//   - Every commit increments the generation and writes at least one audit
//     record stamped with it: replaying the claim records reproduces the
//     claims of the state.
//   - A state file that fails to parse or verify is moved aside, never
//     silently overwritten; one written by a newer format is never touched;
//     state from an earlier boot is discarded with an audit record.
//   - Every stored state has a lineage: a random id given when the state
//     starts empty (no file, a corrupt file moved aside, an earlier boot's
//     state discarded) and kept by every other mutation, inside the
//     checksummed state. A file without one (older versions) gets one at its
//     next commit. A new lineage means the ledger forgot what it knew:
//     whoever rebuilds it from the runtime fences on its lineage
//     (RequireLineage).
package ledger
