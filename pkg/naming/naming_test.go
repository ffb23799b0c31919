// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package naming

import (
	"testing"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

func TestNames(t *testing.T) {
	const uuid = "GPU-6c1a2f2e-0000-4000-8000-000000000001"
	for got, want := range map[string]string{
		Device(devices.Device{UUID: uuid, Index: "1", Kind: devices.KindGPU}):      "GPU 1 (" + uuid + ")",
		Device(devices.Device{UUID: "MIG-x", Index: "1:0", Kind: devices.KindMIG}): "MIG 1:0 (MIG-x)",
		Device(devices.Device{UUID: uuid, Kind: devices.KindGPU}):                  "GPU " + uuid,
		Container("ml", "train", "main", "0123456789abcdef"):                       "ml/train/main (id 0123456789ab)",
		Container("", "train", "", "0123456789abcdef"):                             "-/train/- (id 0123456789ab)",
		Container("", "", "web", "abc"):                                            "web (id abc)",
		Container("", "", "", "0123456789abcdef"):                                  "container 0123456789ab",
		ShortID("0123456789ab"):                                                    "0123456789ab",
		// Pod names a container's creator wrote itself come after its id,
		// marked: a podman container can name itself after any pod.
		Holder("prod", "db", "main", "0123456789abcdef", false): "container 0123456789ab (prod/db/main by its own annotations, unverified)",
		Holder("prod", "db", "main", "0123456789abcdef", true):  "prod/db/main (id 0123456789ab)",
		Holder("", "", "web", "abc", false):                     "web (id abc)",
	} {
		if got != want {
			t.Errorf("got %q, want %q", got, want)
		}
	}
}
