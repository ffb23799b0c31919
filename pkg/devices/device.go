// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

// Kind tells a full GPU from a MIG instance.
type Kind string

// Device kinds.
const (
	KindGPU Kind = "gpu"
	KindMIG Kind = "mig"
)

// Device is one claimable unit: a full GPU or one MIG instance. UUID is the
// canonical identity everywhere in the project; Index is for people only
// ("1" for a GPU, "1:0" for a MIG instance).
type Device struct {
	UUID  string `json:"uuid"`
	Index string `json:"index"`
	Kind  Kind   `json:"kind"`
	// Parent is the full GPU's UUID for a MIG instance, empty for a GPU.
	Parent string `json:"parent,omitempty"`
}

// Conflicts reports whether claims on a and b exclude each other: the same
// device, or a full GPU and one of its MIG instances. Two different MIG
// instances of one GPU do not conflict.
func Conflicts(a, b Device) bool {
	if a.UUID == b.UUID {
		return true
	}
	return (a.Parent != "" && a.Parent == b.UUID) || (b.Parent != "" && b.Parent == a.UUID)
}
