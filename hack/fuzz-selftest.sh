#!/usr/bin/env bash
# Proves the rules of hack/fuzz.sh on a throwaway module:
#   1. a planted failing input fails the run and leaves its reproducer under
#      testdata/fuzz/, with a call-count budget and with a duration budget;
#   2. a bare "context deadline exceeded" with no reproducer (Go's
#      fuzz-coordinator race) is run once more: once is forgiven, twice fails.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
FUZZ="$HERE/fuzz.sh"
GO=${GO:-go}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fail() { echo "fuzz-selftest: FAIL: $*" >&2; exit 1; }

mod="$work/mod"
mkdir -p "$mod/planted"
cat >"$mod/go.mod" <<'MOD'
module example.test/planted

go 1.22
MOD
cat >"$mod/planted/planted_test.go" <<'SRC'
package planted

import "testing"

func FuzzPlanted(f *testing.F) {
	f.Add([]byte("abc"))
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > 1 && b[0] == 'x' {
			t.Fatalf("planted failure on %q", b)
		}
	})
}
SRC
printf 'FuzzPlanted 200000\n' >"$work/budgets.txt"

for budget in ci 60s; do
	rm -rf "$mod/planted/testdata"
	if FUZZ_ROOT="$mod" FUZZ_BUDGETS="$work/budgets.txt" TAGS= GO="$GO" \
		"$FUZZ" "$budget" >"$work/out" 2>&1; then
		cat "$work/out" >&2
		fail "a planted failing input passed (budget $budget)"
	fi
	ls "$mod/planted/testdata/fuzz/FuzzPlanted/"* >/dev/null 2>&1 ||
		fail "no reproducer written for the planted input (budget $budget)"
	grep -q 'FAILED: FuzzPlanted' "$work/out" || fail "the summary does not name FuzzPlanted"
	echo "fuzz-selftest: planted input fails the run and is kept (budget $budget)"
done
rm -rf "$mod/planted/testdata"

# A stand-in for go that reports the coordinator race the first FAILS times.
cat >"$work/racego" <<'SH'
#!/usr/bin/env bash
n=$(cat "$COUNTER" 2>/dev/null || echo 0)
echo $((n + 1)) >"$COUNTER"
if ((n < FAILS)); then
	printf -- '--- FAIL: FuzzPlanted (11.05s)\n    context deadline exceeded\nFAIL\n'
	exit 1
fi
echo ok
SH
chmod +x "$work/racego"

export COUNTER="$work/count"
rm -f "$COUNTER"
FAILS=1 FUZZ_ROOT="$mod" GO="$work/racego" "$FUZZ" 10s >"$work/out" 2>&1 ||
	{ cat "$work/out" >&2; fail "one coordinator race failed the run"; }
grep -q 'running it once more' "$work/out" || fail "the race was not named"
echo "fuzz-selftest: one coordinator race is run again and passes"

rm -f "$COUNTER"
if FAILS=2 FUZZ_ROOT="$mod" GO="$work/racego" "$FUZZ" 10s >"$work/out" 2>&1; then
	fail "two coordinator races in a row passed"
fi
echo "fuzz-selftest: two in a row fail the run"
echo "fuzz-selftest: ok"
