// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Command ociimage writes a single-layer OCI image layout as a tar archive,
// importable with `ctr -n k8s.io images import`, from files on the build host.
//
// The project's integration tests and demo run on hosts that cannot reach a
// registry, so their container image (and the plugin's own image) is built
// from local binaries with this tool:
//
//	go run ./hack/ociimage --out image.tar --name registry.k8s.io/pause:3.10 \
//	    --file bin/sleeper:/sleeper:0755 --entrypoint /sleeper [--library-deps]
//
// With --library-deps the shared libraries that ldd reports for every --file
// (and the dynamic loader) are copied into the layer at the paths ldd names,
// so a cgo-linked binary runs in an otherwise empty image. ldd may execute
// the program's loader: only use it on binaries you built.
//
// Invariants: the output is a pure function of the inputs (fixed timestamps,
// uid/gid 0, sorted entries, no gzip name or time), every blob is stored
// under its sha256 digest, the config's diff_id is the digest of the
// uncompressed layer, and the archive is written to a temporary file and
// renamed into place, so a failed run never leaves a partial image.
package main
