#!/usr/bin/env bash
# Whole-process benchmarks of the hook, of gpu-guard-ctl and of admission
# through a real containerd, each an interleaved A/B against its floor (see
# docs/benchmarks.md), printed as one table: benchmark, metric, one column
# per run (-count), then the median of the runs. `make bench-process` runs it.
#
# Environment:
#   COUNT     runs of each benchmark (default 3)
#   HOOK_N    rounds of BenchmarkHookProcess per run (default 300)
#   RUNC_N    rounds of BenchmarkRuncHook per run (default 100; needs root and runc)
#   CTL_N     rounds of BenchmarkCtlProcess per run (default 50)
#   CRI_N     rounds of BenchmarkCRIAdmission per run (default 30; needs root
#             and the end-to-end suite's tools: ./test/integration/setup.sh;
#             it builds bin/ first, since that is what it measures)
#   ONLY      a regexp of benchmarks to run (default: all four)
#   HOOK_BASELINE  another build of nri-gpu-guard-hook to time alongside (before/after,
#             in BenchmarkHookProcess and BenchmarkRuncHook)
#   CTL_BASELINE   another build of gpu-guard-ctl to time alongside (BenchmarkCtlProcess)
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_root"
export CGO_CFLAGS=${CGO_CFLAGS:--O2 -Wno-deprecated-declarations}
COUNT=${COUNT:-3}
ONLY=${ONLY:-.}
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT

bench() { # name rounds package [build tags]
	[[ $1 =~ $ONLY ]] || return 0
	go test -tags "${4:-nri_no_wasm}" -timeout 1h -run '^$' -bench "^$1\$" -benchtime="$2x" -count="$COUNT" "$3" | tee -a "$raw" >&2
}
bench BenchmarkHookProcess "${HOOK_N:-300}" ./cmd/nri-gpu-guard-hook
bench BenchmarkRuncHook "${RUNC_N:-100}" ./pkg/hook
bench BenchmarkCtlProcess "${CTL_N:-50}" ./pkg/ctl
# The end-to-end suite runs the plugin from bin/: build what is checked out.
if [[ BenchmarkCRIAdmission =~ $ONLY ]]; then
	make -s build >&2
fi
bench BenchmarkCRIAdmission "${CRI_N:-30}" ./test/integration "nri_no_wasm integration"

# Each result line: name rounds (value unit)...; keep the ms and ratio
# metrics, one row per benchmark and metric with every run's value. The table
# is aligned here (no column(1), which not every system ships).
awk '
/^Benchmark/ {
	name = $1; sub(/-[0-9]+$/, "", name)
	for (i = 3; i < NF; i += 2) {
		unit = $(i + 1)
		if (unit == "ns/op" || unit ~ /^(B|allocs)\/op$/) continue
		k = name "\t" unit
		if (!(k in seen)) { seen[k] = 1; order[++n] = k }
		vals[k] = vals[k] "\t" $i
		cnt[k]++; v[k, cnt[k]] = $i
	}
}
function row(line,   f, c, i) {
	c = split(line, f, "\t"); rows++
	for (i = 1; i <= c; i++) { cell[rows, i] = f[i]; if (length(f[i]) > w[i]) w[i] = length(f[i]) }
	if (c > cols) cols = c
}
END {
	row("benchmark\tmetric\truns...\tmedian")
	for (j = 1; j <= n; j++) {
		k = order[j]; m = cnt[k]
		for (a = 1; a <= m; a++) s[a] = v[k, a] + 0
		for (a = 1; a <= m; a++) for (b = a + 1; b <= m; b++) if (s[b] < s[a]) { t = s[a]; s[a] = s[b]; s[b] = t }
		med = (m % 2) ? s[(m + 1) / 2] : (s[m / 2] + s[m / 2 + 1]) / 2
		row(k vals[k] "\t" sprintf("%.3g", med))
	}
	for (r = 1; r <= rows; r++) {
		line = ""
		for (i = 1; i <= cols; i++) line = line sprintf(i < cols ? "%-" w[i] "s  " : "%s", cell[r, i])
		sub(/ +$/, "", line); print line
	}
}' "$raw"
