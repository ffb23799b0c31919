// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package packaging holds what nri-gpu-guard ships besides its binaries: the
// default configuration, the containerd drop-in, the systemd unit, the .deb and
// .rpm recipe, the Kubernetes manifests and the image recipe. It has no code of
// its own; its tests keep the shipped files consistent with the configuration
// schema of package config.
//
// Invariants the tests enforce:
//   - config.toml parses to exactly config.Default() and mentions every key of
//     the schema, so the file an operator edits can never drift from the code.
//   - The containerd drop-in only enables NRI and its default validator with
//     required_plugins = [the default plugin name], and sets no paths.
//   - The systemd unit may write the ledger directory and the NRI socket
//     directory that the defaults name.
package packaging
