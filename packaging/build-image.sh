#!/usr/bin/env bash
# Builds the nri-gpu-guard container image as an OCI image archive from the
# binaries that `make build` left in bin/, without a Docker engine or a
# registry. Import it on a node with:
#
#   ctr -n k8s.io images import dist/nri-gpu-guard-image.tar
#
# The binaries are cgo-linked (NVML); their shared libraries (the C library and
# the dynamic loader, as ldd reports them) are copied into the image, so the
# image needs no base layer. packaging/Containerfile builds an equivalent image
# with a container engine.
#
# Environment:
#   BIN_DIR     where the binaries are (default: bin)
#   OUT         output archive (default: dist/nri-gpu-guard-image.tar)
#   IMAGE_REPO  image repository (default: docker.io/nri-gpu-guard/nri-gpu-guard)
#   IMAGE_TAG   image tag (default: derived from `git describe`)
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_root"

BIN_DIR=${BIN_DIR:-bin}
OUT=${OUT:-dist/nri-gpu-guard-image.tar}
IMAGE_REPO=${IMAGE_REPO:-docker.io/nri-gpu-guard/nri-gpu-guard}

die() {
	printf 'build-image: ERROR: %s\n' "$*" >&2
	exit 1
}

for b in nri-gpu-guard gpu-guard-ctl; do
	[[ -x $BIN_DIR/$b ]] || die "$BIN_DIR/$b is missing: run 'make build' first"
done
[[ -d hack/ociimage ]] || die "hack/ociimage (the image writer) is missing"

# The same version string the binaries are stamped with (Makefile VERSION),
# made a valid tag: [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}.
tag=${IMAGE_TAG:-$(git describe --tags --always --dirty 2>/dev/null || echo dev)}
tag=$(printf '%s' "$tag" | tr -c 'A-Za-z0-9_.-' '-' | cut -c1-128)
[[ $tag =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]*$ ]] || die "image tag '$tag' is not valid"

mkdir -p "$(dirname "$OUT")"
# :latest too, so that packaging/kubernetes/30-daemonset.yaml finds a freshly
# imported image; pin the DaemonSet to the versioned name in production.
CGO_ENABLED=0 go run ./hack/ociimage --out "$OUT" \
	--name "$IMAGE_REPO:$tag" --name "$IMAGE_REPO:latest" \
	--file "$BIN_DIR/nri-gpu-guard:/usr/bin/nri-gpu-guard:0755" \
	--file "$BIN_DIR/gpu-guard-ctl:/usr/bin/gpu-guard-ctl:0755" \
	--file "packaging/config.toml:/etc/nri-gpu-guard/config.toml:0644" \
	--library-deps \
	--entrypoint /usr/bin/nri-gpu-guard >&2
printf '%s\n' "$IMAGE_REPO:$tag"
