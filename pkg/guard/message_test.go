// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
)

var (
	msgNow = time.Date(2026, 5, 9, 8, 0, 0, 0, time.UTC)
	gpu1   = devices.Device{UUID: "GPU-11111111-1111-4111-8111-111111111111", Index: "1", Kind: devices.KindGPU}
	gpu2   = devices.Device{UUID: "GPU-22222222-2222-4222-8222-222222222222", Index: "2", Kind: devices.KindGPU}
	gpu3   = devices.Device{UUID: "GPU-33333333-3333-4333-8333-333333333333", Index: "3", Kind: devices.KindGPU}
	mig10  = devices.Device{UUID: "MIG-aaaaaaaa-aaaa-4aaa-8aaa-aaaaaaaaaaaa", Index: "1:0", Kind: devices.KindMIG, Parent: gpu1.UUID}
)

func TestNames(t *testing.T) {
	assert.Equal(t, "GPU 1 (GPU-11111111-1111-4111-8111-111111111111)", naming.Device(gpu1))
	assert.Equal(t, "MIG 1:0 (MIG-aaaaaaaa-aaaa-4aaa-8aaa-aaaaaaaaaaaa)", naming.Device(mig10))
	assert.Equal(t, "GPU GPU-x", naming.Device(devices.Device{UUID: "GPU-x"}))

	for _, tc := range []struct {
		owner ledger.Owner
		want  string
	}{
		{ledger.Owner{ContainerID: "0123456789abcdef0123", Namespace: "ml", Pod: "train-0", Container: "main"},
			"ml/train-0/main (id 0123456789ab)"},
		{ledger.Owner{ContainerID: "0123456789abcdef0123", Container: "cuda"}, "cuda (id 0123456789ab)"},
		{ledger.Owner{ContainerID: "short"}, "container short"},
	} {
		assert.Equal(t, tc.want, HolderName(tc.owner))
	}
}

func TestConflictText(t *testing.T) {
	holder := &ledger.Claim{
		Device: gpu1,
		Owner:  ledger.Owner{ContainerID: "0123456789abcdef", Namespace: "ml", Pod: "train-0", Container: "main"},
		Since:  msgNow.Add(-12*time.Minute - 3*time.Second),
	}
	migHolder := &ledger.Claim{Device: mig10, Owner: holder.Owner, Since: holder.Since}
	stoppedHolder := &ledger.Claim{Device: gpu1, Since: holder.Since,
		Owner: ledger.Owner{ContainerID: "fedcba9876543210", Namespace: "ml", Pod: "train-0", Container: "main",
			StoppedAt: msgNow.Add(-time.Minute)}}
	drainingHolder := &ledger.Claim{Device: gpu1, Since: holder.Since,
		Owner: ledger.Owner{ContainerID: "0a1b2c3d4e5f6789", Namespace: "ml", Pod: "train-1", Container: "main",
			DrainingSince: msgNow.Add(-time.Minute)}}
	reservation := &ledger.Reservation{Device: gpu2, For: "ml/uid-7/worker", Since: msgNow.Add(-time.Second),
		Until: msgNow.Add(5*time.Minute + 59*time.Second)}
	policy := config.Default().Policy
	waiters := map[string]ledger.Waiter{
		"ml/uid-7/worker": {Key: "ml/uid-7/worker",
			Owner: ledger.Owner{ContainerID: "aaaabbbbccccdddd", Namespace: "ml", Pod: "train-7", Container: "worker"}},
	}
	lookup := func(k string) (ledger.Waiter, bool) { w, ok := waiters[k]; return w, ok }

	for _, tc := range []struct {
		name string
		text conflictText
		want string
	}{
		{
			name: "held, queued, free GPUs named",
			text: conflictText{busy: []ledger.BusyDevice{{Wanted: gpu1, Holder: holder}},
				queued: true, position: 2, total: 3, waited: 45 * time.Second, free: []devices.Device{gpu2, gpu3}},
			want: "GPU 1 (GPU-11111111-1111-4111-8111-111111111111) is held by ml/train-0/main (id 0123456789ab) " +
				"since 2026-05-09T07:47:57Z (12m3s ago); queued at position 2 of 3, waiting 45s. " +
				"The request will be admitted when the holder stops and its turn comes; retrying is automatic under Kubernetes " +
				"(the head of the queue keeps a freed GPU for 6m0s). Free GPUs now: 2, 3 (e.g. NVIDIA_VISIBLE_DEVICES=2).",
		},
		{
			name: "reserved for a known waiter, rejected, nothing free",
			text: conflictText{busy: []ledger.BusyDevice{{Wanted: gpu2, Reservation: reservation}}},
			want: "GPU 2 (GPU-22222222-2222-4222-8222-222222222222) is reserved for ml/train-7/worker (id aaaabbbbcccc) " +
				"(earlier in the queue) until 2026-05-09T08:05:59Z (5m59s left). " +
				"Refused and not queued (policy on_conflict = \"reject\"): retry once the holder has stopped. No GPU is free now.",
		},
		{
			name: "reserved for an unknown key shows the key",
			text: conflictText{busy: []ledger.BusyDevice{{Wanted: gpu2, Reservation: &ledger.Reservation{
				Device: gpu2, For: "hook-ctr-1", Until: msgNow.Add(time.Minute)}}}, queued: true, position: 1, total: 1},
			want: "GPU 2 (GPU-22222222-2222-4222-8222-222222222222) is reserved for hook-ctr-1 (later in the queue, but all it asks for was free first) " +
				"until 2026-05-09T08:01:00Z (1m0s left); queued at position 1 of 1, waiting 0s. " +
				"The request will be admitted once the requesters holding the reservations have started or let them expire;",
		},
		{
			name: "full GPU wanted, MIG instance held; two busy devices",
			text: conflictText{busy: []ledger.BusyDevice{{Wanted: gpu1, Holder: migHolder}, {Wanted: gpu2, Reservation: reservation}},
				queued: true, position: 1, total: 1},
			want: "GPU 1 (GPU-11111111-1111-4111-8111-111111111111) is held by ml/train-0/main (id 0123456789ab) " +
				"through MIG 1:0 (MIG-aaaaaaaa-aaaa-4aaa-8aaa-aaaaaaaaaaaa) since 2026-05-09T07:47:57Z (12m3s ago); " +
				"GPU 2 (GPU-22222222-2222-4222-8222-222222222222) is reserved for ml/train-7/worker",
		},
		{
			name: "hook request: how many wait before it, no retry or reservation talk",
			text: conflictText{busy: []ledger.BusyDevice{{Wanted: gpu1, Holder: holder}}, hook: true,
				queued: true, position: 3, total: 3, waited: 45 * time.Second, free: []devices.Device{gpu2}},
			want: "GPU 1 (GPU-11111111-1111-4111-8111-111111111111) is held by ml/train-0/main (id 0123456789ab) " +
				"since 2026-05-09T07:47:57Z (12m3s ago); 2 requests wait for it before this one. " +
				"Free GPUs now: 2 (e.g. NVIDIA_VISIBLE_DEVICES=2).",
		},
		{
			name: "hook request at the head",
			text: conflictText{busy: []ledger.BusyDevice{{Wanted: gpu1, Holder: holder}}, hook: true,
				queued: true, position: 1, total: 1},
			want: "(12m3s ago); no other request waits for it. No GPU is free now.",
		},
		{
			name: "a free MIG instance kept for the head asking for its GPU whole",
			text: conflictText{busy: []ledger.BusyDevice{{Wanted: mig10, KeptFor: &ledger.Waiter{Key: "ml/uid-7/worker", Seq: 1,
				Owner: waiters["ml/uid-7/worker"].Owner}, Through: gpu1}}, queued: true, position: 2, total: 2},
			want: "MIG 1:0 (MIG-aaaaaaaa-aaaa-4aaa-8aaa-aaaaaaaaaaaa) is kept for ml/train-7/worker (id aaaabbbbcccc) " +
				"(earlier in the queue, first in line for GPU 1 (GPU-11111111-1111-4111-8111-111111111111), which waits until the rest of it is free); " +
				"queued at position 2 of 2, waiting 0s. The request will be admitted when the holder stops and its turn comes;",
		},
		{
			name: "stopped holder kept until removal",
			text: conflictText{busy: []ledger.BusyDevice{{Wanted: gpu1, Holder: stoppedHolder}}},
			want: "is held by ml/train-0/main (id fedcba987654) since 2026-05-09T07:47:57Z (12m3s ago) " +
				"(exited 2026-05-09T07:59:00Z (1m0s ago), kept until the container is removed: policy release_on = \"remove\")",
		},
		// A holder that has stopped already is not waited for to "stop".
		{
			name: "stopped holder, rejected: retry once it is removed",
			text: conflictText{busy: []ledger.BusyDevice{{Wanted: gpu1, Holder: stoppedHolder}}},
			want: "Refused and not queued (policy on_conflict = \"reject\"): retry once the stopped holder's container has been removed.",
		},
		{
			name: "stopped holder, queued: admitted once it is removed",
			text: conflictText{busy: []ledger.BusyDevice{{Wanted: gpu1, Holder: stoppedHolder}}, queued: true, position: 1, total: 1},
			want: "The request will be admitted when the stopped holder's container is removed and its turn comes;",
		},
		{
			name: "draining holder, queued: admitted once its processes left the GPU",
			text: conflictText{busy: []ledger.BusyDevice{{Wanted: gpu1, Holder: drainingHolder}}, queued: true, position: 1, total: 1},
			want: "(draining since 2026-05-09T07:59:00Z (1m0s ago), waiting for its processes to leave the GPU); queued at position 1 of 1, " +
				"waiting 0s. The request will be admitted when the draining holder's processes have left the GPU (or its claim's idle grace is over) " +
				"and its turn comes;",
		},
		{
			name: "a running holder among stopped ones is waited for",
			text: conflictText{busy: []ledger.BusyDevice{{Wanted: gpu1, Holder: stoppedHolder}, {Wanted: gpu2, Holder: &ledger.Claim{
				Device: gpu2, Owner: holder.Owner, Since: holder.Since}}}},
			want: "retry once the holder has stopped.",
		},
		{
			name: "stopped and draining holders",
			text: conflictText{busy: []ledger.BusyDevice{{Wanted: gpu1, Holder: stoppedHolder}, {Wanted: gpu2, Holder: &ledger.Claim{
				Device: gpu2, Owner: drainingHolder.Owner, Since: holder.Since}}}},
			want: "retry once the stopped holders' claims have ended (at their removal, or once their processes have left the GPU).",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.text.now, tc.text.policy, tc.text.waiter = msgNow, policy, lookup
			assert.Contains(t, tc.text.String(), tc.want)
		})
	}
}

// resolveErr is the resolver's error for NVIDIA_VISIBLE_DEVICES=visible.
func resolveErr(t *testing.T, inv *devices.Inventory, policy config.PolicyConfig, visible string) error {
	t.Helper()
	_, err := devices.NewResolver(inv, policy).Resolve(devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=" + visible}})
	require.Error(t, err)
	return err
}

func TestPolicyText(t *testing.T) {
	inv := &devices.Inventory{GPUs: []devices.GPU{{Index: 0, UUID: "GPU-a"}, {Index: 1, UUID: "GPU-b"}}}
	policy := config.Default().Policy
	allReject := policy
	allReject.AllDevices = config.AllReject
	for _, tc := range []struct {
		err        error
		wantReason string
		want       string
	}{
		{fmt.Errorf("%w \"7\" in env NVIDIA_VISIBLE_DEVICES", devices.ErrUnknownDevice), "unknown-device",
			`GPU request refused: unknown GPU "7" in env NVIDIA_VISIBLE_DEVICES; name a GPU of this host (policy unknown_device = "reject"). GPUs here: 0 (GPU-a), 1 (GPU-b).`},
		// The resolver's error already says what to do: not said twice.
		{resolveErr(t, inv, policy, "7"), "unknown-device",
			`; name a GPU of this host or set policy.unknown_device = "ignore"; GPUs here: 0 (GPU-a), 1 (GPU-b).`},
		// Joined with another kind's advice, the unknown id still gets its
		// own.
		{errors.Join(fmt.Errorf("%w \"7\" in env X", devices.ErrUnknownDevice), resolveErr(t, inv, allReject, "all")), "unknown-device",
			`name a GPU of this host (policy unknown_device = "reject"). GPUs here`},
		{fmt.Errorf("x: %w", devices.ErrInvalidID), "invalid-id", "fix the device id"},
		{devices.ErrAllRejected, "policy-all", `policy all_devices = "claim"`},
		{devices.ErrPrivilegedRejected, "policy-privileged", `policy privileged = "declared"`},
		{devices.ErrTooLarge, "too-large", "larger than any real one"},
		{errors.New("odd"), "invalid-request", "could not be understood"},
	} {
		assert.Equal(t, tc.wantReason, reasonFor(tc.err))
		assert.Contains(t, policyText(tc.err, policy, inv, ledger.FrontEndNRI), tc.want)
	}
}

// An OCI hook's container names its own namespace, so no exemption is
// granted on it: its privileged refusal does not suggest one.
func TestPrivilegedRefusalAdvicePerFrontEnd(t *testing.T) {
	inv := &devices.Inventory{GPUs: []devices.GPU{{Index: 0, UUID: "GPU-a"}}}
	policy := config.Default().Policy
	err := fmt.Errorf("x: %w", devices.ErrPrivilegedRejected)
	assert.Contains(t, policyText(err, policy, inv, ledger.FrontEndNRI), "drop privileged or exempt the namespace")
	hook := policyText(err, policy, inv, ledger.FrontEndHook)
	assert.NotContains(t, hook, "or exempt the namespace")
	assert.Contains(t, hook, "exempt_namespaces does not apply to this front end")
}

func TestAge(t *testing.T) {
	assert.Equal(t, "0s", age(-time.Second))
	assert.Equal(t, "1m30s", age(90*time.Second+400*time.Millisecond))
	assert.Equal(t, "an unknown time", stamp(time.Time{}, msgNow))
}

// An exited holder kept until its removal (release_on = "remove"): when it
// exited is said only once a transaction before this one recorded it (a
// stop this decision found carries the decision's own time, and a refusal
// that commits nothing finds it again at every request), and a claim whose
// container a runtime root still has says where, and how to end it should
// its engine have lost it.
func TestKeptHolderText(t *testing.T) {
	const id = "fedcba9876543210"
	stopped := ledger.Owner{ContainerID: id, FrontEnd: ledger.FrontEndHook, StoppedAt: msgNow.Add(-time.Minute)}
	release := "`sudo gpu-guard-ctl release --container " + id + " --reason \"container removed\"`"
	for _, tc := range []struct {
		name    string
		verdict Verdict
		want    string
	}{
		{name: "recorded earlier", verdict: Verdict{Action: KeepStopped},
			want: ` (exited 2026-05-09T07:59:00Z (1m0s ago), kept until the container is removed: policy release_on = "remove")`},
		{name: "not checked", verdict: Verdict{},
			want: ` (exited 2026-05-09T07:59:00Z (1m0s ago), kept until the container is removed: policy release_on = "remove")`},
		{name: "found exited by this decision", verdict: Verdict{Action: MarkStopped},
			want: ` (has exited, kept until the container is removed: policy release_on = "remove")`},
		{name: "found exited, still in runc's root", verdict: Verdict{Action: MarkStopped, Listed: "/run/runc"},
			want: ` (has exited, kept until the container is removed: policy release_on = "remove"; runtime root /run/runc ` +
				"still has its container: if its engine no longer lists it, delete it from the runtime " +
				"(`sudo runc --root /run/runc delete --force " + id + "`), then run `sudo gpu-guard-ctl gc`, or end its claim with " +
				release + ")"},
		{name: "recorded, still in crun's root", verdict: Verdict{Action: KeepStopped, Listed: "/run/crun"},
			want: ` (exited 2026-05-09T07:59:00Z (1m0s ago), kept until the container is removed: policy release_on = "remove"; ` +
				"runtime root /run/crun still has its container: if its engine no longer lists it, delete it from the runtime " +
				"(`sudo crun --root /run/crun delete --force " + id + "`), then run `sudo gpu-guard-ctl gc`, or end its claim with " +
				release + ")"},
		{name: "a root named after neither runtime", verdict: Verdict{Action: KeepStopped, Listed: "/var/lib/rt"},
			want: "(`sudo runc --root /var/lib/rt delete --force " + id + "` or `sudo crun --root /var/lib/rt delete --force " + id +
				"`, whichever runtime keeps its state there)"},
		{name: "removal unknown", verdict: Verdict{Action: MarkStopped, Unsure: "runtime root /run/runc is a symlink: not followed"},
			want: ` (has exited, kept until the container is removed: policy release_on = "remove"; whether it was removed cannot ` +
				"be told: runtime root /run/runc is a symlink: not followed; if its engine no longer lists it, end its claim with " +
				release + ")"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := conflictText{now: msgNow, busy: []ledger.BusyDevice{{Wanted: gpu1, Holder: &ledger.Claim{Device: gpu1,
				Owner: stopped, Since: msgNow.Add(-time.Hour)}}}, kept: map[incarnation]Verdict{incarnationOf(stopped): tc.verdict}}
			assert.Contains(t, c.busyList(), tc.want)
		})
	}
}

// A conflict record standing in the way is told from a claim by the busy
// entry's kind (BusyDevice.Conflict), not by the holder's Source text: a
// record holds nothing a container of the same pod could take over, and
// its refusal says the container is in use there without a claim. A claim
// whose source reads like the record's text is a claim all the same.
func TestARecordIsToldByItsKind(t *testing.T) {
	pred := ledger.Owner{ContainerID: "0123456789abcdef", Namespace: "ml", Pod: "train-0", Container: "init"}
	since := msgNow.Add(-time.Minute)
	for _, tc := range []struct {
		name     string
		busy     ledger.BusyDevice
		takeOver bool
		words    string
	}{
		{
			name: "a claim with the record's text as its source",
			busy: ledger.BusyDevice{Wanted: gpu1,
				Holder: &ledger.Claim{Device: gpu1, Owner: pred, Source: ledger.ConflictSource, Since: since}},
			takeOver: true,
			words:    "GPU 1 (" + gpu1.UUID + ") is held by ml/train-0/init (id 0123456789ab) since ",
		},
		{
			name: "a conflict record",
			busy: ledger.BusyDevice{Wanted: gpu1, Conflict: true,
				Holder: &ledger.Claim{Device: gpu1, Owner: pred, Source: "reconcile", Since: since}},
			words: "GPU 1 (" + gpu1.UUID + ") is in use by ml/train-0/init (id 0123456789ab) since ",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			busy := []ledger.BusyDevice{tc.busy}
			assert.Equal(t, tc.takeOver, onlyHeldBy(busy, []string{pred.ContainerID}), "a takeover of what pred holds")
			text := conflictText{now: msgNow, busy: busy}.busyText(tc.busy)
			assert.Contains(t, text, tc.words)
			assert.Equal(t, tc.busy.Conflict, strings.Contains(text, "running on it without a claim"), text)
		})
	}
}
