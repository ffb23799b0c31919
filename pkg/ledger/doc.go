// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package ledger is the host ledger: the single source of truth for which
// container holds which GPU, who waits for it, and for whom a released GPU is
// reserved. It is shared by the NRI daemon, any number of OCI hook processes
// and gpu-guard-ctl, each with its own Ledger on the same state dir.
//
// The property it exists for: no admission is ever decided against a ledger
// that is not the last committed one. A state that is damaged, missing,
// moved, replaced, rolled back or foreign-owned is refused by every Update
// and reported by every read (errors wrapping ErrNeedsRecovery, or
// ErrUnsafeDir), never read as empty, until it is recovered (Recover, Reset;
// gpu-guard-ctl recover).
//
// Every Open and OpenReadOnly checks the state dir's whole parent chain
// (CheckDirChain): no symlink on the path, every directory owned by root
// or the euid, and none writable by group or others unless it has the
// sticky bit (like /tmp, 1777: there nobody else can rename the root- or
// euid-owned entry below it). A parent anyone may write to without the
// sticky bit lets anyone `mv state stolen`: refused, with what to fix.
//
// Files in the state dir (created 0700; refused if a symlink, not a regular
// file, writable by group or others, or owned by another user; never
// followed as symlinks, never opened blocking):
//
//   - ledger.json: the snapshot, format 4: a header line
//     {"format":4,"generation":G,"boot_id":…,"lineage":…,"checksum":"sha256:…","bytes":N}
//     and the state as one JSON line of N bytes, which the checksum covers.
//     It is decoded once, in one pass; a field this build does not know is
//     refused (a write would drop it), not ignored;
//   - ledger.journal: the commits since the snapshot, one line each,
//     "<crc32c hex> <JSON>\n": a header (lineage, boot, the generation it
//     continues; "genesis" when that base is the empty state of a fresh
//     start) and one record per commit with its generation (always the
//     previous one plus one), what changed (claims and reservations by
//     device UUID, waiters by key, cordons by device UUID, conflicts
//     whole), since journal 3 the commit's audit records, and since
//     journal 4 the clock anchor where the commit set or moved it;
//   - ledger.json.prev, ledger.journal.prev: the snapshot and journal the
//     last compaction replaced, kept for Recover; after a recovery or reset
//     (until the next compaction), a copy of the state it wrote and an
//     empty journal after it;
//   - ledger.lock: the flock every mutation holds (never deleted). A flock
//     belongs to the inode: if the file is removed or replaced while held,
//     the next process locks another one. The holder checks before every
//     write (commit, Recover, Reset) that the file at the path is the one
//     it locked and otherwise refuses to write (ErrLockLost, "ledger lock
//     lost"), and a process whose flock landed on a replaced file takes the
//     new one's; only the moments between a holder's check and its write
//     stay open;
//   - ledger.gate: keeps the polled lock fair (lock.go). A writer that
//     finds the lock held closes the gate (an exclusive flock, held until
//     it has the lock or gives up) and every writer passes it (a shared
//     flock, taken and dropped) before it tries the lock, so that a writer
//     that commits back to back cannot take the lock again ahead of one
//     that waits. An optimisation, never a condition: a gate that cannot
//     be used, whose holder is stopped or leaves the free lock alone, is
//     passed;
//   - audit.log: one JSON line per change, rotated to audit.log.1 by size,
//     in generation order. Appended without fsync (AppendAudit's records
//     are fsynced) after the commit is durable: a commit's records are in its journal record
//     too, and the writer that takes the lock next appends first what the
//     log lacks (see the invariants). Records, marker and audit lines are
//     rendered by hand, byte-for-byte
//     as encoding/json renders them (a hook is a process per claim, and
//     encoding/json's reflection tables cost each process more than the
//     encoding);
//   - <file>.corrupt-<UTC time>, <file>.reset-<UTC time>: files Recover or
//     Reset moved aside, kept for a human.
//
// A per-boot marker in Options.RuntimeDir (a tmpfs, /run/nri-gpu-guard)
// records, per state dir, the lineage and the generation last committed in
// this boot. State of an earlier boot is discarded anyway, so a boot
// legitimately starts empty; once this boot committed, missing files, a
// moved dir, another lineage, an earlier boot's state or an older
// generation are refused. Format 1 (one ledger.json rewritten whole at
// every commit), format 2 (before cordons and draining claims) and format 3
// (before the clock anchor) are read, and converted at the next commit; a
// format 2 build refuses a format 3 state as newer and leaves it untouched,
// so it never drops a cordon, and a format 3 build a format 4 one. So with
// the journal: a journal 2 (records without audit records) or 3 (without
// the clock anchor) is read and replaced by a journal 4 at the next commit,
// never appended to; a build of journal 3 refuses a journal 4 as newer (it
// says format 4). The
// format number (a snapshot's "format", a journal header's "journal") is
// read before the strict decode, so that a newer file with fields this
// build does not know reads as newer, not as damage; Recover refuses to
// move such a file aside (its commits would be lost).
//
// Use: Ledger.Update runs a function on a Tx under the lock and commits what
// it changed; Ledger.Snapshot reads without the lock (a read that finds
// the ledger needing recovery confirms it under the lock first, since
// another process's recovery or reset can be caught half done);
// Ledger.Committed gives,
// without reading, the state this handle's last Update committed;
// Ledger.View runs a Tx that is never committed (explain); Ledger.AppendAudit writes audit records
// alone, fsynced, returning any error, for a decision whose only trace is its
// record (an exemption: not granted unless recorded). Policy — admit, queue or reject, and
// the messages — lives in the guard, not here.
//
// Invariants:
//   - Every mutation runs under the exclusive lock, bounded by
//     min(LockTimeout, context deadline) (a LockError then says whether
//     the ledger committed meanwhile: busy, or a holder stuck): read + verify, change, append one
//     journal record (its audit records in it) with one write and one
//     fdatasync, update the boot marker, append the audit records (no
//     fsync). Its cost does not grow with the
//     queue: the record holds what changed. A record is written whole or,
//     if a crash cut it, is a last line without its newline: that
//     transaction never committed (its caller got no answer); readers ignore
//     it and the next writer cuts it. Any other line that does not verify is
//     damage. A record written whole whose fdatasync fails is not cut back
//     (a reader may have read it, and a cut is one more write to a disk
//     that just failed one): the Update returns an error wrapping
//     ErrMaybeCommitted, and its caller treats the commit as made.
//   - Compaction, once the journal outgrows the snapshot (and 16 KiB), runs
//     after the commit's record is durable: the new snapshot goes through a
//     temp file, fsync, rename and fsync of the dir, then a new journal
//     replaces the old one the same way; the replaced files become .prev.
//     The replaced snapshot is linked to a temp name before the rename and
//     renamed over ledger.json.prev after it: .prev is never a second name
//     of ledger.json, and a compaction that fails or is cut before its
//     snapshot is in place leaves .prev as it was. A crash at any instant
//     leaves the old or the new state, never a torn one, and .prev with
//     the journals still replays to it; a leftover temp file is never read
//     and is removed by the next writer. Readers without the lock retry a
//     read that overlapped it.
//   - Every commit is a journal record, so the previous snapshot (or the
//     empty base of a genesis journal) and the journals replay to any commit
//     should the snapshot be lost. The state Recover or Reset writes is no
//     record (it follows no state on disk that it could continue): it is
//     written as a base (writeBase), first as ledger.json.prev with an
//     empty ledger.journal.prev, each in one rename made durable, and only
//     then as ledger.json and ledger.journal, as a compaction writes them.
//     So from the instant ledger.json holds it (and a reader may commit
//     after it), .prev and the journals replay to it and to every commit
//     since: a second loss of ledger.json before the next compaction loses
//     nothing.
//     Cut before ledger.json holds it, the files read as they did: a
//     recovery's as needing recovery (Recover then finds the new state as
//     .prev); a reset's of a healthy ledger as that ledger, whose previous
//     snapshot is then kept only aside (.reset-) until its next compaction.
//     Recover replays the journals onto every base, preferring the chain
//     that reaches this boot's marker, never adopting another lineage's
//     state, moving damaged or foreign files aside, and reporting exactly
//     what it recovered and what was lost. A verified state of this boot
//     past the marker's generation (what a recovery or reset of this boot
//     wrote before it could update the marker) supersedes the marker's
//     lineage. An earlier boot's state is discarded by Recover as by any
//     read of it (audited): only the operator's cordons carry over, and the
//     result gets a new lineage. Files moved aside are first linked aside
//     and keep their names until the write of the recovered state replaces
//     them, so a crash inside Recover leaves the files as they were (still
//     needing recovery, the recovered state perhaps already as .prev),
//     never an empty dir read as a fresh host.
//     Nothing else moves or overwrites a file that does not verify. The
//     containers a runtime runs (RecoverOptions.Running,
//     ResetOptions.Running) are applied in the same commit: their claims
//     are never released by Alive, a device of theirs without a claim is
//     adopted, one another container holds (another incarnation of its id
//     included) is a Conflict. A reset decides whether the ledger is
//     healthy under its lock (RefuseHealthy; Keep carries a healthy one's
//     running holders): the runtimes are read before it, while front ends
//     may still admit.
//   - A Ledger caches the last committed state with the identity of its
//     files (inode, size, mtime, ctime): an unchanged file is not read
//     again, a grown journal only from where it was read. A rewrite in place
//     that keeps the file's size within the file system's timestamp
//     granularity of its last write can escape a process that cached the
//     state until its next full read; every new process (each hook) reads
//     and verifies everything.
//   - No two containers hold conflicting devices (the same device, or a full
//     GPU and one of its MIG instances); a claim is all or nothing.
//   - A claim belongs to exactly one container id; release is idempotent and
//     only ever releases claims of the given container id. A container id
//     is unique only within one runtime root (or containerd namespace): two
//     containers of one id are separate holders, told apart by the recorded
//     pid and its start time (SameIncarnation). What ends claims because a
//     holder was found exited (the guard's liveness check, gc, Recover's
//     Alive) ends only that incarnation (ReleaseIncarnation,
//     MarkDrainingIncarnation, MarkStoppedIncarnation: the claims recording
//     the exited process, SameRecordedProcess: a pid on both sides or on
//     neither, and every field both record — pid, its start time, cgroup —
//     equal); a claim of the id that records no process, or one whose
//     process differs in any field both know, may be another container and
//     is kept. What is missing from the exited one's record (a start time
//     that could not be read, a pid not recorded yet) is never taken for a
//     match.
//   - Reservations are on free devices (no claim or conflict record
//     conflicts with one: a container found running on a whole GPU keeps
//     its MIG instances busy, and Busy names it as a holder), and
//     keep the queue fair without deadlock. The head of the queue (the
//     earliest waiter that cannot start yet and asks for no cordoned
//     device) has every device it asks for reserved as soon as it is free,
//     so later requests cannot overtake it on any of them; a free MIG
//     instance of a GPU it asks for whole, which cannot be reserved while
//     another instance is in use, is kept for it without a stored
//     reservation (Busy reports it as KeptFor). Every other
//     waiter holds a reservation on every device it asks for (bar those its
//     own container holds), or none: whenever every device some waiter asks
//     for is free, they are reserved for the earliest such waiter until
//     reservation_ttl, so a newcomer never takes devices a waiter could
//     start on. One partial holder cannot deadlock (it waits for claims, and
//     for reservations that can be used at their waiter's next retry); when
//     it starts, the next waiter is the head. Reservations are never taken
//     back before they are used or expire, unless they stop being of use
//     (their waiter's retry asked for other devices, a container found
//     running on one took it, a waiter other than the head holds part of
//     its request).
//     Waiters not seen for queue_ttl are dropped.
//   - Every commit increments the generation and writes at least one audit
//     record stamped with it, which its journal record carries: durable
//     with the commit. audit.log gets them from the commit's writer once
//     the record is durable or, if that writer stopped first (killed, its
//     append failed), from the next process that takes the lock to write
//     anything (a commit, AppendAudit, Recover, Reset): before its own
//     records, and before its own write could compact the record away
//     (the journals hold every commit since the compaction before the last),
//     it appends the records of the generations after the log's last
//     record, each commit's after an audit-late record. So a state that
//     starts afresh (its files lost with no marker to continue from, a
//     Recover that finds nothing, Reset) continues above the log's last
//     generation as well as above every file's: numbered below it, its
//     commits would never be caught up. Records a power cut
//     dropped from the log's end come back the same way. Generations whose
//     records no journal holds any more (compacted away since, written by
//     an older build, a state Recover or Reset wrote whole, which is no
//     record) are named in one audit-lost record, and so are those whose
//     append failed, ahead of the writer's own records (which would leave
//     them behind, where no later writer looks); a log with no record at
//     all (removed) only gets what the journals hold. Catching up reads the
//     last line of the log (one read of its end) and, only when it lacks
//     something, the journals. After a write cut short (an unfinished line,
//     left as it was; a catch-up's own write cut short too; one cut after a
//     rotation, the records it follows in audit.log.1), the records the cut
//     write may have left out are compared with its commit's journal record
//     and only those the log lacks are appended; where that cannot be told,
//     none is, and an audit-lost record says the generation may lack
//     records.
//   - Every stored state has a lineage: a random id given when the state
//     starts empty (a fresh host, an earlier boot's state discarded, Reset,
//     or Recover that could not restore every commit) and kept by every other
//     mutation. A file without one (format 1) gets one at its next commit. A
//     new lineage means the ledger forgot what it knew: whoever rebuilds it
//     from the runtime fences on its lineage (Ledger.RequireLineage).
//   - A cordon (State.Cordons; Tx.Cordon, Tx.Uncordon) takes a device out
//     of new claims: no Claim of it or of a device conflicting with it (a
//     cordon on a GPU covers its MIG instances, one on a MIG instance blocks
//     its GPU) and no reservation on it; its holder keeps its claim, and so
//     may a container ask again for what it holds. A cordon never
//     replaces one of a source that ranks higher on the same device,
//     operator > unhealthy > intruder (CordonKept: the finding is audited,
//     the cordon in force stays as it was, so an operator's still survives
//     a reboot and an unhealthy one is not lifted as an intruder's); one
//     of equal or higher rank replaces it, keeping Since.
//     Cordons are per device UUID: a GPU's and its MIG instance's are two,
//     each lifted on its own. Cordons last until
//     lifted, through compaction and Recover (they are journaled). At the
//     first Update after a reboot the operator's cordons (source operator:
//     maintenance set on purpose) are kept, each audited as kept, while the
//     observer's (intruder, unhealthy: about processes and a driver state
//     the reboot ended; the observer cordons again what it still finds) are
//     dropped, audited, with everything else of the earlier boot's state;
//     a read before that Update already shows the same. Reset drops them
//     all. That first Update writes its journal (a genesis header and its
//     record, the kept cordons in it) before the snapshot of the empty
//     base: killed before the journal is in place it leaves the earlier
//     boot's files, after, a journal of this boot that a reader replays
//     from its empty base past the earlier boot's snapshot (a reader of a
//     later boot too, when a power cut did the killing: it then discards
//     that state as an earlier boot's, operator cordons kept). Never a
//     snapshot of this boot next to the earlier boot's journal (which would
//     read as damage), never the empty base without the cordons.
//   - A draining claim (Owner.DrainingSince; Tx.MarkDraining) is held like
//     any other until Tx.FinishDraining or, at the first Update or View
//     after Options.DrainGrace, released with an audit record and a log
//     line: it never outlives the grace. Reconcile does not release it as
//     stale (its container is stopped by definition).
//   - Every TTL (queue_ttl, reservation_ttl, the drain grace) counts the
//     time that passed, not steps of the wall clock, which every stored
//     time is read from. The state carries a clock anchor (State.Clock):
//     one reading of the wall clock and of CLOCK_BOOTTIME, which every
//     process of the boot shares and nobody steps, set at the first commit
//     of a state. Every transaction (Update, View, Recover, Reset for the
//     claims it keeps) and every read without the lock first compares the
//     two clocks' advance since the anchor; apart by more than a second,
//     the wall clock was stepped, and every stored time of this boot is
//     moved by the step before any expiry is judged (times before the
//     boot's start, an operator's cordon carried across a reboot, stay).
//     The Update that finds it commits the moved times with the new anchor
//     and an audit record (clock-step), and logs it; a reader moves its
//     copy alike. The anchor changes only then, so an ordinary commit's
//     journal record does not carry it. A state of an earlier boot, or
//     written before format 4 until its next commit, has no anchor to
//     compare with: a step is not told there.
//   - Tx.State hands out a copy: nothing outside a Tx's methods changes the
//     state a commit journals, or the cache.
package ledger
