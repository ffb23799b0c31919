#!/usr/bin/env bash
# Prepares a machine for the end-to-end tests and `make demo`: containerd,
# its runc shim, ctr and crictl (built from source with the Go toolchain, into
# a per-user cache), runc (from the distribution) and the tests' container
# image. Idempotent and cached: a second run only checks versions and
# content keys, so it takes a second or two.
#
# Environment:
#   NRI_GPU_GUARD_CACHE  cache root (default $HOME/.cache/nri-gpu-guard)
#   TOOLS_DIR            where the binaries go (default $NRI_GPU_GUARD_CACHE/tools)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CACHE=${NRI_GPU_GUARD_CACHE:-$HOME/.cache/nri-gpu-guard}
TOOLS=${TOOLS_DIR:-$CACHE/tools}
IMAGES=$CACHE/images
GO=${GO:-go}

CONTAINERD_MODULE=github.com/containerd/containerd/v2
CONTAINERD_VERSION=v2.2.1
CRICTL_MODULE=sigs.k8s.io/cri-tools
CRICTL_VERSION=v1.34.0

# The names the tests and the demo run their pods under: the sandbox image
# must be the one pinned in containerd's config, since nothing can be pulled.
SANDBOX_IMAGE=registry.k8s.io/pause:3.10
WORKLOAD_IMAGE=localhost/gpu-guard-test/sleeper:1

log() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "the end-to-end tests run containerd and need root; run as root (e.g. sudo make integration)"
command -v "$GO" >/dev/null || die "no Go toolchain on PATH"
mkdir -p "$TOOLS" "$IMAGES"

# One setup at a time: two concurrent go installs into one GOBIN, or two
# image builds, would race.
exec 9>"$CACHE/setup.lock"
flock 9

# module_version BIN MODULE prints the version of MODULE that BIN was built
# from (empty if BIN is missing or was built from something else).
module_version() {
	[[ -x $1 ]] || return 0
	"$GO" version -m "$1" 2>/dev/null | awk -v m="$2" '$1 == "mod" && $2 == m { print $3 }'
}

need_containerd=0
for b in containerd containerd-shim-runc-v2 ctr; do
	if [[ $(module_version "$TOOLS/$b" "$CONTAINERD_MODULE") != "$CONTAINERD_VERSION" ]]; then
		need_containerd=1
	fi
done
if ((need_containerd)); then
	log "building containerd, containerd-shim-runc-v2 and ctr $CONTAINERD_VERSION into $TOOLS (a few minutes the first time)"
	GOBIN=$TOOLS CGO_ENABLED=1 "$GO" install -tags "no_btrfs no_devmapper no_zfs" \
		"$CONTAINERD_MODULE/cmd/containerd@$CONTAINERD_VERSION" \
		"$CONTAINERD_MODULE/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION" \
		"$CONTAINERD_MODULE/cmd/ctr@$CONTAINERD_VERSION"
fi
if [[ $(module_version "$TOOLS/crictl" "$CRICTL_MODULE") != "$CRICTL_VERSION" ]]; then
	log "building crictl $CRICTL_VERSION into $TOOLS"
	GOBIN=$TOOLS "$GO" install "$CRICTL_MODULE/cmd/crictl@$CRICTL_VERSION"
fi

if ! command -v runc >/dev/null; then
	command -v apt-get >/dev/null || die "runc is missing and this is no Debian/Ubuntu system: install runc (>= 1.1) by hand"
	log "installing runc from the distribution"
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq runc >/dev/null
fi

# overlayfs is the snapshotter the tests configure.
if ! grep -qw overlay /proc/filesystems; then
	modprobe overlay 2>/dev/null || die "the kernel has no overlay filesystem (modprobe overlay failed)"
fi

# The test image: a static "sleep until SIGTERM" program, keyed on the
# content of everything that goes into it, so it is rebuilt only when the
# program, the image tool or the Go toolchain changed.
key=$(cd "$ROOT" && {
	"$GO" version
	echo "$SANDBOX_IMAGE $WORKLOAD_IMAGE"
	cat test/integration/testdata/sleeper/*.go hack/ociimage/*.go go.sum
} | sha256sum | cut -c1-16)
image=$IMAGES/gpu-guard-test.tar
if [[ ! -f $image || $(cat "$image.key" 2>/dev/null) != "$key" ]]; then
	log "building the test image $image"
	build=$(mktemp -d)
	trap 'rm -rf "$build"' EXIT
	(cd "$ROOT" && CGO_ENABLED=0 "$GO" build -trimpath -ldflags '-s -w' -o "$build/sleeper" ./test/integration/testdata/sleeper)
	(cd "$ROOT" && CGO_ENABLED=0 "$GO" run ./hack/ociimage --out "$image" \
		--name "$SANDBOX_IMAGE" --name "$WORKLOAD_IMAGE" \
		--file "$build/sleeper:/sleeper:0755" --entrypoint /sleeper) >/dev/null
	echo "$key" >"$image.key"
fi

log "ready: tools in $TOOLS ($("$TOOLS/containerd" --version | awk '{print $3}'), crictl $CRICTL_VERSION, runc $(runc --version | awk 'NR==1{print $3}')), image $image"
