#!/usr/bin/env bash
# Runs the end-to-end suite's core subset against several containerd
# releases, one after the other, and prints the compatibility table
# (`make matrix`). Each version is built once by setup.sh and cached.
#
# Usage: matrix.sh [VERSION...]   (default: the newest patch of every line)
#
# Environment:
#   MATRIX_OUT    where the per-version `go test -v` logs go (default bin/matrix)
#   MATRIX_RUN    go test -run pattern (default: the core subset, see
#                 test/integration/matrixreport)
#   MATRIX_CHECK  a README to check: its compatibility rows must match the runs
#   E2E_WRAP      a command the test run is wrapped in (`make matrix CGROUP=v2`
#                 sets test/integration/cgroup2.sh)
# Exit status: non-zero if any version failed to build or any test failed,
# a core scenario neither passed nor was reported as not supported (skipped,
# or never run), or the check failed. A scenario a release line cannot support is reported
# as "not supported" in the table, not as a failure.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
GO=${GO:-go}

if [[ $# -eq 0 ]]; then
	set -- v1.7.35 v2.0.14 v2.1.9 v2.2.1 v2.3.7 v2.4.2
fi
out=${MATRIX_OUT:-$ROOT/bin/matrix}
mkdir -p "$out"
report=("$GO" run ./test/integration/matrixreport)
run=${MATRIX_RUN:-$("${report[@]}" -run)}
# An empty pattern would run the whole suite as "the core subset".
[[ -n $run ]] || { echo "matrix: no test pattern for the core subset (matrixreport -run failed?)" >&2; exit 1; }

rc=0
logs=()
for v in "$@"; do
	printf '\n==> matrix: containerd %s\n' "$v"
	if ! CONTAINERD_VERSION=$v ./test/integration/setup.sh; then
		printf 'matrix: containerd %s: setup failed, not tested\n' "$v" >&2
		rc=1
		continue
	fi
	start=$(date +%s)
	# shellcheck disable=SC2086 # E2E_WRAP is a command, or nothing
	CONTAINERD_VERSION=$v ${E2E_WRAP:-} "$GO" test -tags 'nri_no_wasm integration' -count=1 -v -timeout 20m \
		-run "$run" ./test/integration/ 2>&1 | tee "$out/$v.log"
	status=${PIPESTATUS[0]}
	((status == 0)) || rc=1
	printf 'matrix: containerd %s: go test exit %d after %ds\n' "$v" "$status" $(($(date +%s) - start))
	logs+=("$out/$v.log")
done

if ((${#logs[@]} > 0)); then
	printf '\n==> matrix: results (logs in %s)\n\n' "$out"
	"${report[@]}" "${logs[@]}" || rc=1
	if [[ -n ${MATRIX_CHECK:-} ]]; then
		"${report[@]}" -check "$MATRIX_CHECK" "${logs[@]}" || rc=1
	fi
fi
exit $rc
