#!/usr/bin/env bash
# `make fuzz`: run every fuzz target of the module, one at a time (go test
# fuzzes one target of one package per run), each for DURATION (a go
# duration such as 15s, or Nx for N iterations). Fails if any target fails;
# the failing inputs are saved by go test under the package's
# testdata/fuzz/<Target>/ and replay in the ordinary unit tests from then on.
#
# Usage: hack/fuzz.sh [DURATION]        (default 15s)
#        FUZZ_MATCH=Decode hack/fuzz.sh  (only targets whose name matches)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DURATION=${1:-15s}
GO=${GO:-go}
TAGS=${TAGS:-nri_no_wasm}
MATCH=${FUZZ_MATCH:-}
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

echo "fuzz: ${#targets[@]} targets, $DURATION each"
failed=()
for t in "${targets[@]}"; do
	read -r dir name <<<"$t"
	echo "fuzz: $name in $dir"
	if ! "$GO" test -tags "$TAGS" -run '^$' -fuzz "^${name}\$" -fuzztime "$DURATION" "$dir"; then
		failed+=("$name ($dir)")
	fi
done

if ((${#failed[@]} > 0)); then
	printf 'fuzz: FAILED: %s\n' "${failed[@]}" >&2
	echo "fuzz: the failing inputs are under each package's testdata/fuzz/; \`go test -run '^FuzzName\$' ./pkg/x\` replays them" >&2
	exit 1
fi
echo "fuzz: all ${#targets[@]} targets passed"
