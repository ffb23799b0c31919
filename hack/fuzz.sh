#!/usr/bin/env bash
# `make fuzz`: run every fuzz target of the module, one at a time (go test
# fuzzes one target of one package per run). Fails if any target finds a
# failing input; go test saves it under the package's
# testdata/fuzz/<Target>/ and it replays in the ordinary unit tests from
# then on.
#
# Two kinds of budget:
#   ci        (default) each target gets the call count listed in
#             hack/fuzz-budgets.txt (go test -fuzztime Nx). Counts have no
#             wall-clock deadline, so a slow or busy machine only makes the
#             run longer, never red. This is what CI runs.
#   DURATION  a Go duration such as 30s or 5m, or Nx for N calls of every
#             target: for exploring by hand.
#
# A duration budget can trip a race in Go's fuzz coordinator (a worker
# mid-call when the deadline expires: "context deadline exceeded" with no
# failing input; golang/go#75804, fixed in Go 1.27). Such a failure wrote no
# reproducer and printed no panic or test failure of ours, so it is not a
# finding: the target is run once more and only a second failure counts. A
# failure that wrote an input under testdata/fuzz/, or that printed a panic
# or a failure message of the fuzz function, always fails the run.
#
# Usage: hack/fuzz.sh [ci|DURATION]
#        FUZZ_MATCH=Decode hack/fuzz.sh   (only targets whose name matches)
#        hack/fuzz-selftest.sh            (proves the two rules above)
set -euo pipefail

ROOT=${FUZZ_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
BUDGET=${1:-ci}
GO=${GO:-go}
TAGS=${TAGS:-nri_no_wasm}
MATCH=${FUZZ_MATCH:-}
BUDGETS_FILE=${FUZZ_BUDGETS:-$ROOT/hack/fuzz-budgets.txt}
export CGO_CFLAGS=${CGO_CFLAGS:--O2 -Wno-deprecated-declarations}

cd "$ROOT"

# Every "func FuzzXxx(f *testing.F)" in a _test.go file that builds without
# extra tags (files behind the integration tag are not unit tests).
targets=()
while IFS= read -r file; do
	if grep -qE '^//go:build .*integration' "$file"; then
		continue
	fi
	dir=./$(dirname "$file")
	while IFS= read -r name; do
		[[ -z $MATCH || $name == *"$MATCH"* ]] || continue
		targets+=("$dir $name")
	done < <(sed -nE 's/^func (Fuzz[A-Za-z0-9_]*)\(f \*testing\.F\).*/\1/p' "$file")
done < <(find . -path ./.git -prune -o -type d \( -name testdata -o -name vendor -o -name dist \) -prune -o \
	-type f -name '*_test.go' -print | sed 's|^\./||' | sort)

if ((${#targets[@]} == 0)); then
	echo "fuzz: no fuzz targets found${MATCH:+ matching $MATCH}" >&2
	exit 1
fi

# budget_for NAME prints the -fuzztime value for one target.
budget_for() {
	local name=$1 count
	if [[ $BUDGET != ci ]]; then
		echo "$BUDGET"
		return
	fi
	count=$(awk -v t="$name" '$1 == t { print $2 }' "$BUDGETS_FILE")
	if [[ -z $count ]]; then
		echo "fuzz: $name has no budget in ${BUDGETS_FILE#"$ROOT"/}; add a line \"$name <calls>\"" >&2
		return 1
	fi
	echo "${count}x"
}

# corpus_listing DIR NAME lists the saved inputs of one target, so that a
# run that wrote a new one can be told apart from one that did not.
corpus_listing() {
	local d="$1/testdata/fuzz/$2"
	[[ -d $d ]] && find "$d" -type f | sort
	return 0
}

# is_coordinator_race LOG: the run failed only with the coordinator's
# deadline message — no panic, no failure message from the fuzz function,
# no "Failing input written".
is_coordinator_race() {
	local log=$1
	grep -q 'context deadline exceeded' "$log" || return 1
	grep -qE 'Failing input written|^panic:|panic\(|_test\.go:[0-9]+:' "$log" && return 1
	return 0
}

# Budgets are looked up before anything runs, so a missing one fails at once.
for t in "${targets[@]}"; do
	read -r _ name <<<"$t"
	budget_for "$name" >/dev/null
done

if [[ $BUDGET == ci ]]; then
	echo "fuzz: ${#targets[@]} targets, call-count budgets from ${BUDGETS_FILE#"$ROOT"/}"
else
	echo "fuzz: ${#targets[@]} targets, $BUDGET each"
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
failed=()
for t in "${targets[@]}"; do
	read -r dir name <<<"$t"
	fuzztime=$(budget_for "$name")
	for attempt in 1 2; do
		echo "fuzz: $name in $dir ($fuzztime)"
		before=$(corpus_listing "$dir" "$name")
		if "$GO" test -tags "$TAGS" -run '^$' -fuzz "^${name}\$" -fuzztime "$fuzztime" "$dir" 2>&1 | tee "$log"; then
			break
		fi
		after=$(corpus_listing "$dir" "$name")
		if ((attempt == 1)) && [[ $before == "$after" ]] && is_coordinator_race "$log"; then
			echo "fuzz: $name stopped on Go's fuzz-coordinator deadline race (golang/go#75804) without a failing input; running it once more"
			continue
		fi
		failed+=("$name ($dir)")
		break
	done
done

if ((${#failed[@]} > 0)); then
	printf 'fuzz: FAILED: %s\n' "${failed[@]}" >&2
	echo "fuzz: the failing inputs are under each package's testdata/fuzz/; \`go test -run '^FuzzName\$' ./pkg/x\` replays them" >&2
	exit 1
fi
echo "fuzz: all ${#targets[@]} targets passed"
