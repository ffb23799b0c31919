#!/usr/bin/env bash
# Where a GPU hook's time goes, phase by phase: builds nri-gpu-guard-hook
# with the phasetrace tag (internal/phasetrace), runs N claim + release
# pairs (create-runtime --wait, then poststop) against a throwaway ledger
# with an eight-GPU static inventory, as the shipped hook definitions run
# them (GOMAXPROCS=1), and prints each phase's average duration in
# microseconds, per phase of the hook. Needs root (the ledger's boot marker
# lives in /run/nri-gpu-guard). docs/benchmarks.md has its figures.
#
#   hack/hook-phases.sh [N]      (default 300)
set -euo pipefail

n=${1:-300}
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mktemp -d)
state="$work/state"
marker="/run/nri-gpu-guard/ledger-$(printf %s "$state" | sha256sum | cut -c1-24).marker"
trap 'rm -rf "$work"; rm -f "$marker"' EXIT

(cd "$repo_root" && CGO_ENABLED=0 go build -tags 'nri_no_wasm phasetrace' -trimpath -ldflags='-s -w' -o "$work/hook" ./cmd/nri-gpu-guard-hook)

{
	printf 'version = 1\n[ledger]\ndir = "%s"\n[devices]\nsource = "static"\nproc_root = "%s"\n' "$state" "$work/no-driver"
	for i in 0 1 2 3 4 5 6 7; do
		printf '[[devices.static]]\nindex = %d\nuuid = "GPU-6c1a2f2e-0000-4000-8000-00000000000%d"\nminor = %d\nmodel = "Fake GPU"\n' "$i" "$i" "$i"
	done
} >"$work/config.toml"
mkdir -p "$work/bundle"
printf '{"ociVersion":"1.2.0","process":{"args":["/app"],"env":["PATH=/bin","NVIDIA_VISIBLE_DEVICES=0"],"cwd":"/","capabilities":{"bounding":["CAP_CHOWN","CAP_KILL","CAP_SETGID","CAP_SETUID"]}},"root":{"path":"rootfs"}}\n' >"$work/bundle/config.json"

# Each pair's container process is a sleep that runs through create-runtime
# and is gone by poststop, as a container's is (poststop spares a claim whose
# recorded process still runs).
for i in $(seq "$n"); do
	sleep 3600 &
	ctr=$!
	printf '{"ociVersion":"1.2.0","id":"phases-%d","status":"created","pid":%d,"bundle":"%s"}' "$i" "$ctr" "$work/bundle" >"$work/state.json"
	env -i GOMAXPROCS=1 "$work/hook" create-runtime --config "$work/config.toml" --wait <"$work/state.json" 2>&1 | sed 's/^/create-runtime /'
	kill "$ctr"
	wait "$ctr" 2>/dev/null || true
	env -i GOMAXPROCS=1 "$work/hook" poststop --config "$work/config.toml" <"$work/state.json" 2>&1 | sed 's/^/poststop /'
done | awk -v n="$n" '
$2 != "phase" { print "unexpected output: " $0 > "/dev/stderr"; bad = 1; next }
{
	if ($3 == "init") prev[$1] = 0
	k = $1 " " $3
	if (!(k in sum)) order[++m] = k
	sum[k] += $4 - prev[$1]; cnt[k]++; prev[$1] = $4
}
END {
	printf "%-15s %-15s %8s\n", "hook", "phase", "avg µs"
	for (j = 1; j <= m; j++) { split(order[j], f, " "); printf "%-15s %-15s %8.0f\n", f[1], f[2], sum[order[j]] / cnt[order[j]] }
	exit bad
}'
