#!/usr/bin/env bash
# Builds the nri-gpu-guard .deb and .rpm into dist/ from the binaries that
# `make build` left in bin/. `make package` runs it.
#
# Environment:
#   BIN_DIR      where the binaries are (default: bin)
#   DIST_DIR     where the packages go (default: dist)
#   PKG_VERSION  package version (default: derived from `git describe`)
#   NFPM         nfpm binary (default: nfpm on PATH, else the tools cache,
#                installed there with `go install` when missing)
#   FORMATS      package formats (default: "deb rpm")
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_root"

BIN_DIR=${BIN_DIR:-bin}
DIST_DIR=${DIST_DIR:-dist}
FORMATS=${FORMATS:-deb rpm}
NFPM_VERSION=v2.45.2
TOOLS_DIR=${TOOLS_DIR:-$HOME/.cache/nri-gpu-guard/tools}

log() { printf 'build-packages: %s\n' "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}

# pkg_version turns `git describe` output into a version that sorts correctly
# in both dpkg and rpm:
#   v1.2.3                   -> 1.2.3
#   v1.2.3-rc.1              -> 1.2.3~rc.1           (before 1.2.3)
#   v1.2.3-4-gabc1234        -> 1.2.3+git4.gabc1234  (after 1.2.3)
#   abc1234 (no tag yet)     -> 0.0.0+git<commits>.gabc1234
#   ...-dirty                -> ....dirty
pkg_version() {
	local desc dirty="" base count hash pre
	desc=$(git describe --tags --always --dirty --match 'v[0-9]*' 2>/dev/null) || desc=""
	if [[ -z $desc ]]; then
		echo "0.0.0+unknown"
		return
	fi
	if [[ $desc == *-dirty ]]; then
		dirty=".dirty"
		desc=${desc%-dirty}
	fi
	if [[ $desc =~ ^v([0-9]+(\.[0-9]+)*)(-([0-9A-Za-z.]+))?-([0-9]+)-g([0-9a-f]+)$ ]]; then
		base=${BASH_REMATCH[1]} pre=${BASH_REMATCH[4]} count=${BASH_REMATCH[5]} hash=${BASH_REMATCH[6]}
		[[ -n $pre ]] && base="$base~$pre"
		echo "$base+git$count.g$hash$dirty"
	elif [[ $desc =~ ^v([0-9]+(\.[0-9]+)*)(-([0-9A-Za-z.]+))?$ ]]; then
		base=${BASH_REMATCH[1]} pre=${BASH_REMATCH[4]}
		[[ -n $pre ]] && base="$base~$pre"
		# A dirty tree is not the release: sort it after the tag.
		[[ -n $dirty ]] && base="$base+dirty"
		echo "$base"
	elif [[ $desc =~ ^[0-9a-f]+$ ]]; then
		count=$(git rev-list --count HEAD 2>/dev/null || echo 0)
		echo "0.0.0+git$count.g$desc$dirty"
	else
		die "cannot derive a package version from git describe output '$desc'; set PKG_VERSION"
	fi
}

find_nfpm() {
	if [[ -n ${NFPM:-} ]]; then
		echo "$NFPM"
	elif command -v nfpm >/dev/null 2>&1; then
		command -v nfpm
	else
		if [[ ! -x $TOOLS_DIR/nfpm ]]; then
			log "installing nfpm $NFPM_VERSION into $TOOLS_DIR"
			GOBIN=$TOOLS_DIR go install "github.com/goreleaser/nfpm/v2/cmd/nfpm@$NFPM_VERSION" >&2
		fi
		echo "$TOOLS_DIR/nfpm"
	fi
}

for b in nri-gpu-guard gpu-guard-ctl nri-gpu-guard-hook nri-gpu-guard-hook-relay; do
	[[ -x $BIN_DIR/$b ]] || die "$BIN_DIR/$b is missing: run 'make build' first (or 'make package')"
done

version=${PKG_VERSION:-$(pkg_version)}
[[ $version =~ ^[0-9][0-9A-Za-z.+~]*$ ]] || die "package version '$version' is not valid for dpkg and rpm"
arch=$(go env GOARCH)
nfpm=$(find_nfpm)

stage=$DIST_DIR/.stage
rm -rf "$stage"
# 0755 whatever the builder's umask: nfpm ships a tree's directories with
# their modes, and a 0700 hooks.d is unreadable to rootless podman (and
# clashes with containers-common's ownership of the directory in an rpm).
install -d -m 0755 "$stage" "$stage/doc" "$stage/hooks.d"

# Documentation: README, docs/*.md, and the --help text of the binaries.
[[ -f README.md ]] && install -m 0644 README.md "$stage/doc/"
for f in docs/*.md; do
	[[ -f $f ]] && install -m 0644 "$f" "$stage/doc/"
done
[[ -f LICENSE ]] && install -m 0644 LICENSE "$stage/doc/"
for b in nri-gpu-guard gpu-guard-ctl nri-gpu-guard-hook; do
	# The exit status of --help varies (flag.ContinueOnError returns 2);
	# what counts is that it printed a usage text.
	help=$(timeout 10 "$BIN_DIR/$b" --help 2>&1 </dev/null) || true
	if grep -qi 'usage' <<<"$help"; then
		printf '%s\n' "$help" >"$stage/doc/$b.help.txt"
		chmod 0644 "$stage/doc/$b.help.txt"
	else
		log "WARNING: '$b --help' failed; its help text is not included"
	fi
done
[[ -n $(ls -A "$stage/doc") ]] || log "WARNING: no documentation found to ship"

# OCI hooks for runtimes that read hooks.d (podman, CRI-O).
hooks=0
for f in packaging/oci-hooks.d/*.json; do
	[[ -f $f ]] || continue
	install -m 0644 "$f" "$stage/hooks.d/"
	hooks=$((hooks + 1))
done
((hooks > 0)) || log "WARNING: packaging/oci-hooks.d/*.json not found; the packages ship no OCI hook"

export NRI_GPU_GUARD_VERSION=$version NRI_GPU_GUARD_ARCH=$arch \
	NRI_GPU_GUARD_BIN=$BIN_DIR NRI_GPU_GUARD_STAGE=$stage

mkdir -p "$DIST_DIR"
for fmt in $FORMATS; do
	# Remove earlier builds so dist/ holds exactly one package per format
	# (test-packages.sh installs dist/*.deb).
	rm -f "$DIST_DIR"/nri-gpu-guard*."$fmt"
	"$nfpm" package --config packaging/nfpm.yaml --packager "$fmt" --target "$DIST_DIR/" >&2
done
rm -rf "$stage"

log "version $version ($arch):"
for fmt in $FORMATS; do
	ls -1 "$DIST_DIR"/nri-gpu-guard*."$fmt"
done
