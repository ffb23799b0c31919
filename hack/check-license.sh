#!/usr/bin/env bash
# Every Go file carries the project's SPDX license header (make lint).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
missing=$(git ls-files '*.go' | while read -r f; do
	head -3 "$f" | grep -q '^// SPDX-License-Identifier: Apache-2.0$' || echo "$f"
done)
if [[ -n $missing ]]; then
	echo "check-license: these Go files lack '// SPDX-License-Identifier: Apache-2.0' in their first lines:" >&2
	echo "$missing" >&2
	exit 1
fi
