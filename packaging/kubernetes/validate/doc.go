// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package validate checks the Kubernetes manifests in packaging/kubernetes:
// every document decodes strictly (unknown or duplicate fields are errors)
// into the Kubernetes API types, and the DaemonSet agrees with the rest of
// the project: the ConfigMap carries packaging/config.toml (with the metrics
// endpoint the probes need), the hostPath volumes are the directories that
// configuration names, the pod carries the annotation the containerd
// drop-in tolerates, and the image is the one packaging/build-image.sh
// writes.
//
// It is its own Go module so that the main module does not depend on the
// Kubernetes libraries. Run it with `go test ./...` in this directory; after
// editing packaging/config.toml, regenerate the ConfigMap with
// `go test ./... -update`.
package validate
