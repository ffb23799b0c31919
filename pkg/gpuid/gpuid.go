// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package gpuid

// MaxGPUMinor is the largest /dev/nvidia<N> minor that names a GPU: 254 and
// 255 are nvidia-modeset and nvidiactl.
const MaxGPUMinor = 253

// Prefixes of the UUIDs NVML reports.
const (
	GPUPrefix = "GPU-"
	MIGPrefix = "MIG-"
)

// IsGPUUUID reports whether s is a full-GPU UUID, GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
func IsGPUUUID(s string) bool { return isUUIDWithPrefix(s, GPUPrefix) }

// IsMIGUUID reports whether s is a MIG device UUID in the form drivers since
// R470 report, MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
func IsMIGUUID(s string) bool { return isUUIDWithPrefix(s, MIGPrefix) }

// IsGPUMinor reports whether minor is the minor number of a GPU device node.
func IsGPUMinor(minor int) bool { return minor >= 0 && minor <= MaxGPUMinor }

func isUUIDWithPrefix(s, prefix string) bool {
	if len(s) != len(prefix)+36 || s[:len(prefix)] != prefix {
		return false
	}
	u := s[len(prefix):]
	for i := 0; i < len(u); i++ {
		c := u[i]
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return false
			}
		default:
			if !isHex(c) {
				return false
			}
		}
	}
	return true
}

func isHex(c byte) bool {
	return ('0' <= c && c <= '9') || ('a' <= c && c <= 'f') || ('A' <= c && c <= 'F')
}
