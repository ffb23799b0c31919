#!/usr/bin/env bash
# gpu-check.sh: on a host with an NVIDIA GPU and driver, check that the guard's
# NVML inventory (index, UUID, minor number, bus id, MIG instances) and its
# resolver agree with nvidia-smi, and that the observer (pkg/observe) sees the
# same GPU processes as nvidia-smi and every device healthy, as does
# gpu-guard-ctl ps. nvidia-smi's own
# view of processes, ECC and performance is printed next to the observer's.
# Exits non-zero on any mismatch.
#
# On a host without a GPU it fails too, unless GPU_CHECK_ALLOW_SKIP=1, in
# which case it prints SKIP and exits 0 (for CI jobs that may land anywhere).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"

skip() {
	if [[ "${GPU_CHECK_ALLOW_SKIP:-0}" == "1" ]]; then
		echo "gpu-check: SKIP: $*"
		exit 0
	fi
	echo "gpu-check: $* (set GPU_CHECK_ALLOW_SKIP=1 to skip instead)" >&2
	exit 1
}

command -v nvidia-smi >/dev/null 2>&1 || skip "nvidia-smi not found: run this on a host with an NVIDIA GPU and driver"
nvidia-smi -L >/dev/null 2>&1 || skip "nvidia-smi -L fails: no usable NVIDIA GPU or driver"

GO="${GO:-go}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# NVML is reached through cgo; go-nvml's headers warn about deprecated calls
# it does not make.
export CGO_ENABLED=1
export CGO_CFLAGS="${CGO_CFLAGS:--O2 -Wno-deprecated-declarations}"
"$GO" build -tags nri_no_wasm -o "$tmp/inventory-check" ./test/gpu/inventory-check
# As make build builds them: gpu-guard-ctl static, running ps (NVML) as
# `nri-gpu-guard ctl`, the binary next to it.
"$GO" build -tags nri_no_wasm -o "$tmp/nri-gpu-guard" ./cmd/nri-gpu-guard
CGO_ENABLED=0 "$GO" build -tags nri_no_wasm -o "$tmp/gpu-guard-ctl" ./cmd/gpu-guard-ctl

echo "gpu-check: driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n1)"
status=0
"$tmp/inventory-check" || status=$?

# gpu-guard-ctl ps: the operator's view of the same accounting, against an
# empty ledger of its own (so every GPU process shows as an intruder: exit 3
# is expected when any runs; 1 is a failure).
mkdir -m 0700 "$tmp/state"
printf 'version = 1\n[ledger]\ndir = "%s"\n' "$tmp/state" >"$tmp/config.toml"
echo
echo "gpu-check: gpu-guard-ctl ps (this check's ledger is empty: every process is an intruder)"
ps_rc=0
"$tmp/gpu-guard-ctl" --config "$tmp/config.toml" ps -o wide || ps_rc=$?
if [[ "$ps_rc" != 0 && "$ps_rc" != 3 ]]; then
	echo "gpu-check: FAIL: gpu-guard-ctl ps exited $ps_rc" >&2
	status=1
fi

echo
echo "gpu-check: nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory (compare with the observer's processes above)"
nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv || status=1
echo
echo "gpu-check: nvidia-smi -q -d ECC,PERFORMANCE (compare with the observer's health above)"
nvidia-smi -q -d ECC,PERFORMANCE || status=1
exit "$status"
