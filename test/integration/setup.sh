#!/usr/bin/env bash
# Prepares a machine for the end-to-end tests and `make demo`: containerd,
# its runc shim, ctr and crictl (built from source with the Go toolchain, into
# a per-user cache), runc (from the distribution) and the tests' container
# image. Idempotent and cached: a second run only checks versions and
# content keys, so it takes a second or two.
#
# Any containerd release line can be built (1.7 and later; NRI needs 1.7):
# each version goes to its own directory, $TOOLS_DIR/containerd-<version>, so
# a matrix of versions stays cached side by side. The default version is
# also linked into $TOOLS_DIR itself, where `make demo` looks.
#
# Environment:
#   NRI_GPU_GUARD_CACHE  cache root (default $HOME/.cache/nri-gpu-guard)
#   TOOLS_DIR            where the binaries go (default $NRI_GPU_GUARD_CACHE/tools)
#   CONTAINERD_VERSION   containerd release to build, e.g. v1.7.35 (default below)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CACHE=${NRI_GPU_GUARD_CACHE:-$HOME/.cache/nri-gpu-guard}
TOOLS=${TOOLS_DIR:-$CACHE/tools}
IMAGES=$CACHE/images
GO=${GO:-go}

# The version the suite runs by default; `make matrix` lists the others.
DEFAULT_CONTAINERD_VERSION=v2.2.1
CONTAINERD_VERSION=${CONTAINERD_VERSION:-$DEFAULT_CONTAINERD_VERSION}
# The build tags containerd's own release builds use on hosts without the
# btrfs, devmapper and zfs libraries.
CONTAINERD_TAGS="no_btrfs no_devmapper no_zfs"
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

[[ $CONTAINERD_VERSION =~ ^v(1\.([7-9]|[1-9][0-9])|[2-9]\.[0-9]+)\.[0-9]+$ ]] ||
	die "CONTAINERD_VERSION=$CONTAINERD_VERSION: want a containerd release tag, v1.7.0 or later (NRI first shipped in 1.7), e.g. v2.2.1"
case $CONTAINERD_VERSION in
v1.*) CONTAINERD_MODULE=github.com/containerd/containerd ;;
*) CONTAINERD_MODULE=github.com/containerd/containerd/v${CONTAINERD_VERSION:1:1} ;;
esac
CONTAINERD_DIR=$TOOLS/containerd-$CONTAINERD_VERSION
# What a cached build was made from: rebuilt when any of it changes.
containerd_stamp="$CONTAINERD_MODULE $CONTAINERD_VERSION tags=$CONTAINERD_TAGS $("$GO" env GOVERSION)"

# build_containerd builds containerd, its runc shim and ctr from the module's
# source. `go install module@version` refuses modules whose go.mod has
# `exclude` or `replace` directives (1.7.x, 2.0.x and 2.1.x have them), so
# every version is built the same way: from a writable copy of the module
# source, letting the go command use (and complete) the module's own go.mod.
build_containerd() {
	local src work
	src=$(cd "$TOOLS" && "$GO" mod download -json "$CONTAINERD_MODULE@$CONTAINERD_VERSION" |
		sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p') || true
	[[ -n $src && -d $src ]] || die "cannot download $CONTAINERD_MODULE@$CONTAINERD_VERSION: is it a released version? (go list -m -versions $CONTAINERD_MODULE)"
	work=$(mktemp -d "$TOOLS/.build-$CONTAINERD_VERSION.XXXXXX")
	# Removed however the build ends (a failed copy under set -e, Ctrl-C).
	# shellcheck disable=SC2064 # expand $work now: it is local
	trap "rm -rf '$work'" EXIT
	# The module cache is read-only; -mod=mod may need to write go.sum.
	cp -r "$src/." "$work/src"
	chmod -R u+w "$work/src"
	mkdir -p "$work/bin"
	if ! (cd "$work/src" && CGO_ENABLED=1 "$GO" build -mod=mod -trimpath -tags "$CONTAINERD_TAGS" \
		-o "$work/bin/" ./cmd/containerd ./cmd/containerd-shim-runc-v2 ./cmd/ctr); then
		rm -rf "$work"
		die "building containerd $CONTAINERD_VERSION failed (see above)"
	fi
	echo "$containerd_stamp" >"$work/bin/.stamp"
	rm -rf "$CONTAINERD_DIR"
	mv "$work/bin" "$CONTAINERD_DIR"
	rm -rf "$work"
}

if [[ $(cat "$CONTAINERD_DIR/.stamp" 2>/dev/null) != "$containerd_stamp" ]] ||
	! [[ -x $CONTAINERD_DIR/containerd && -x $CONTAINERD_DIR/containerd-shim-runc-v2 && -x $CONTAINERD_DIR/ctr ]]; then
	log "building containerd, containerd-shim-runc-v2 and ctr $CONTAINERD_VERSION into $CONTAINERD_DIR (a few minutes the first time)"
	build_containerd
fi
# `make demo` runs $TOOLS/containerd: link the default version there, unless
# a `go install` of that same version already put it there.
if [[ $CONTAINERD_VERSION == "$DEFAULT_CONTAINERD_VERSION" ]]; then
	for b in containerd containerd-shim-runc-v2 ctr; do
		if [[ -L $TOOLS/$b || $(module_version "$TOOLS/$b" "$CONTAINERD_MODULE") != "$CONTAINERD_VERSION" ]]; then
			ln -sfn "containerd-$CONTAINERD_VERSION/$b" "$TOOLS/$b"
		fi
	done
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

# The test image (see sleeper-image.sh).
# shellcheck source=test/integration/sleeper-image.sh
source "$ROOT/test/integration/sleeper-image.sh"
image=$IMAGES/gpu-guard-test.tar
sleeper_image "$image" "$SANDBOX_IMAGE" "$WORKLOAD_IMAGE"

log "ready: containerd in $CONTAINERD_DIR ($("$CONTAINERD_DIR/containerd" --version | awk '{print $3}')), crictl $CRICTL_VERSION, runc $(runc --version | awk 'NR==1{print $3}'), image $image"
