#!/usr/bin/env bash
# Prepares a Debian machine for the podman end-to-end suite
# (test/integration/podman_*_test.go, `make integration-podman`): podman,
# conmon, runc and crun from the distribution, and the suite's container
# image (the static sleeper program, built with hack/ociimage) as an OCI
# archive that the tests `podman load` into their private storage.
# Idempotent: a second run only checks what is there.
#
# Environment:
#   NRI_GPU_GUARD_CACHE  cache root (default $HOME/.cache/nri-gpu-guard)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CACHE=${NRI_GPU_GUARD_CACHE:-$HOME/.cache/nri-gpu-guard}
IMAGES=$CACHE/images
GO=${GO:-go}
PODMAN_IMAGE=localhost/gpu-guard-test/sleeper:1

log() { printf 'setup-podman: %s\n' "$*"; }
die() { printf 'setup-podman: error: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "the podman tests run containers as root; run as root (e.g. sudo make integration-podman)"
command -v "$GO" >/dev/null || die "no Go toolchain on PATH"
mkdir -p "$IMAGES"

need=()
for b in podman conmon runc crun; do
	command -v "$b" >/dev/null || need+=("$b")
done
if ((${#need[@]})); then
	command -v apt-get >/dev/null || die "missing ${need[*]} and this is no Debian/Ubuntu system: install podman (>= 4.3), conmon, runc and crun by hand"
	log "installing ${need[*]} from the distribution"
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

exec 9>"$CACHE/setup-podman.lock"
flock 9

# shellcheck source=test/integration/sleeper-image.sh
source "$ROOT/test/integration/sleeper-image.sh"
image=$IMAGES/gpu-guard-podman.tar
sleeper_image "$image" "$PODMAN_IMAGE"

log "ready: podman $(podman --version | awk '{print $3}'), conmon $(conmon --version | awk 'NR==1{print $3}'), runc $(runc --version | awk 'NR==1{print $3}'), crun $(crun --version | awk 'NR==1{print $3}'), image $image"
