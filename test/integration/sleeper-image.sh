#!/usr/bin/env bash
# Sourced by setup.sh and setup-podman.sh: builds the suites' container image,
# the static "sleep until SIGTERM" program (testdata/sleeper) packed by
# hack/ociimage as an OCI archive. The image is keyed on everything that goes
# into it (the program, the image tool, the Go toolchain and the image names),
# so it is rebuilt only when one of them changed.
#
# Needs ROOT, GO and log from the sourcing script.
#
# sleeper_image ARCHIVE NAME... builds ARCHIVE tagged with every NAME unless
# an up-to-date one is there.
sleeper_image() {
	local image=$1 key build n
	shift
	local names=()
	for n in "$@"; do names+=(--name "$n"); done
	key=$(cd "$ROOT" && {
		"$GO" version
		echo "$*"
		cat test/integration/testdata/sleeper/*.go hack/ociimage/*.go go.sum
	} | sha256sum | cut -c1-16)
	if [[ -f $image && $(cat "$image.key" 2>/dev/null) == "$key" ]]; then
		return 0
	fi
	log "building the test image $image"
	build=$(mktemp -d)
	# A subshell so that its EXIT trap removes the build dir on every way out
	# without replacing a trap of the sourcing script.
	(
		trap 'rm -rf "$build"' EXIT
		cd "$ROOT"
		CGO_ENABLED=0 "$GO" build -trimpath -ldflags '-s -w' -o "$build/sleeper" ./test/integration/testdata/sleeper
		CGO_ENABLED=0 "$GO" run ./hack/ociimage --out "$image" "${names[@]}" \
			--file "$build/sleeper:/sleeper:0755" --entrypoint /sleeper >/dev/null
	)
	echo "$key" >"$image.key"
}
