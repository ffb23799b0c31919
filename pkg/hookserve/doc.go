// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package hookserve is the resident half of the hook relay: a server
// (`nri-gpu-guard-hook serve`) that runs the OCI hook (pkg/hook) for
// nri-gpu-guard-hook-relay, a small static C program that hooks.d names
// instead of the Go hook, so that a hook run costs no Go runtime start.
//
// It owns the relay protocol's Go side (encoding and decoding, with every
// bound checked before anything is allocated), the listening socket (a unix
// socket path, mode 0600, or the one systemd socket activation passes), and
// the handling of each request; it holds no policy: every verdict is
// hook.MainAs's, the same entry as the hook binary's (hook.Main), with the
// same argument parsing (hook.ParseArgs).
//
// Protocol, version 2 (integers u32 little-endian):
//
//	request  (relay -> server): "GGH2", argc 1..32, argc x (len 0..4096, bytes)
//	         the hook's arguments from the phase on, envc 0..8, envc x
//	         (len 0..8192, "NAME=VALUE": only NRI_GPU_GUARD_CONFIG),
//	         stdin_len 0..1 MiB + 1, the stdin bytes
//	ack      (server -> relay), before anything is done: "GGH2" then 'A'
//	         (the server will run the hook) or 'F', len 0..4096, reason (the
//	         server did nothing and closes)
//	go-ahead (relay -> server, after an 'A' that came within the relay's
//	         timeout): 'G'; a relay that gave up waiting closes instead
//	result   (after 'G'): 'R', exit code 0..255, len 0..65536, the hook's stderr
//
// Version 1 ("GGH1") had no go-ahead: an 'A' sent after the relay's timeout
// had the server run a request whose relay was already running the hook
// itself, two runs of one request at once (a wait could lose its place in
// the queue to the cancelled twin). The go-ahead makes the relay's choice the
// only one: it sends 'G' or it closes, never both. A request of the other
// version is closed without an answer (bad magic), so a relay and a server
// of different versions (an upgrade under way) fall back.
//
// The relay runs the Go hook itself (exec, with the same arguments and stdin
// bytes) whenever the server cannot answer: no connection, no or a bad
// acknowledgement within its timeout, 'F', or a connection that ends before
// the result. So the verdict never depends on the server, and the server
// answers 'F', or nothing, whenever in doubt. The result's stderr comes in
// one piece at the end, not as the hook writes it: runc gives a hook's
// output to nobody until the hook has exited (it prints it with a failing
// hook's error), crun discards it, so streaming it would show nothing more.
//
// Invariants:
//   - Nothing is done to the ledger before the relay's 'G' is read; then the
//     hook runs and a result is sent unless the relay is gone. No 'G' (the
//     relay closed, sent something else, or nothing within ReadTimeout):
//     nothing runs. A relay that falls back after its 'G' (the connection
//     broke before the result) runs a hook again for the same container: a
//     hook run is idempotent per container id.
//   - A malformed request (bad magic, a count or length out of bounds, cut
//     short, or not read within ReadTimeout) is closed without an answer.
//   - 'F' for: a peer whose SO_PEERCRED uid is not the server's effective uid,
//     whose pid is not visible, or that does not share the server's mount,
//     pid, user, cgroup and time (where the kernel has one) namespaces
//     (what the hook reads of "its own" process the server reads of
//     itself: the user namespace's uid_map, the mount table, /proc, the boot
//     clock), or whose root directory is not the server's (a chrooted
//     runtime reads files below its root); anything about the peer that
//     cannot be read; arguments hook.ParseArgs does not take (version, help,
//     add-hooks, a bad flag, an extra argument: the hook binary answers
//     those itself); a --config, --state-dir or $NRI_GPU_GUARD_CONFIG
//     relative to the working directory (the relay's is the bundle, the
//     server's another); more than
//     MaxInFlight connections at once (answered without reading the
//     request); a connection accepted, or a request read, once the server
//     is stopping.
//   - The hook runs for the peer as its process (hook.Process: its pid, its
//     parent read from /proc/<pid>/stat, the environment it forwarded, never
//     the server's own $NRI_GPU_GUARD_CONFIG), with the peer's stdin bytes
//     and a context cancelled when a read on the connection returns (the
//     runtime killed the relay: a waiting hook leaves the queue). The server
//     installs no signal handling per request.
//   - Stopping (Serve's ctx ends): every relay that connects is answered
//     'F' at once, unlogged (the listener stays open through the grace: one
//     systemd passed is a copy of a socket that keeps listening when it is
//     closed, where a relay would wait its whole acknowledgement timeout
//     for an accept), requests still being read are answered 'F', runs in
//     flight have Grace (10 s) to
//     finish before their contexts are cancelled (cause hook.ErrHandOver:
//     a wait keeps its queue entry); a cancelled run that refuses gets no
//     answer (its refusal would say the server stopped, not what the hook
//     decides), so its relay runs the hook itself, which finds that entry
//     and waits on in its place; Serve closes the listener and returns
//     when every connection is done.
//   - Options.Started is the relay's start (/proc/<pid>/stat and
//     CLOCK_BOOTTIME): a runtime's hook timeout counts from there.
//   - One log line per fallback and per error, none per answered request
//     (nor per relay a stop answers).
//   - The package does nothing at init and imports nothing heavy (no NRI,
//     ttrpc, protobuf, prometheus or net/http): the hook binary links it.
package hookserve
