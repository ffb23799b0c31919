// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package metrics is the daemon's observability endpoint: Prometheus metrics
// fed by the guard (it implements guard.Observer) and the /healthz and /readyz
// probes.
//
// Metrics (prefix nri_gpu_guard_):
//   - device_holder{device_uuid,device_index,namespace,pod,container}: 1 per
//     claim, rebuilt from the ledger after every change;
//   - decisions_total{result,reason}, decision_duration_seconds;
//   - wait_seconds: how long an admitted request had been queued;
//   - queue_depth, reservations, conflicts: from the ledger state;
//   - reconcile_releases_total{reason}: claims released without a stop event
//     ("stale" at Synchronize, "holder exited" by the liveness check);
//   - intruders{device_uuid,device_index}: processes the last observer pass
//     found on a device their container does not hold (intruder or out of
//     bounds), rebuilt every pass; unhealthy{device_uuid,device_index}: 1 per
//     device the running observer found unhealthy and holds cordoned (an
//     operator's uncordon clears it; a restarted observer starts empty);
//     observer_last_pass_timestamp_seconds: when the last pass completed.
//
// Invariants:
//   - The metrics live in their own registry (no global state), so tests and
//     several instances do not collide.
//   - Observer calls never block and never fail: they only touch in-memory
//     metric values.
//   - /readyz answers 200 only while the plugin is registered with the
//     runtime (SetReady); /healthz answers 200 while the process serves.
package metrics
