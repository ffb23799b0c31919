// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package config owns the nri-gpu-guard configuration schema: one versioned TOML
// document shared by the NRI daemon, the OCI hook and gpu-guard-ctl.
//
// Invariants:
//   - Every key has a documented default (see Default and the README); an empty
//     document yields exactly Default().
//   - Unknown keys are an error that names the key; a document is never
//     half-applied. Keys are compared exactly, as TOML defines them
//     (case-sensitive): the decoder's case-insensitive match is not relied
//     on, and the schema's key set is derived from the toml tags.
//   - The same schema is accepted from a file, from the NRI Configure string and
//     from gpu-guard-ctl check-config; Validate is the single place that judges a
//     configuration.
//   - The key names are a public interface: renaming one is a breaking change.
package config
