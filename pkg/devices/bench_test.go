// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"fmt"
	"testing"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

func benchInventory(b *testing.B) *Inventory {
	b.Helper()
	gpus := make([]GPU, 16)
	for i := range gpus {
		gpus[i] = GPU{Index: i, UUID: gpuUUID(i), Minor: i, Model: "NVIDIA H100 80GB HBM3", BusID: fmt.Sprintf("0000:%02x:00.0", i+1)}
	}
	inv, err := NewInventory("nvml", gpus)
	if err != nil {
		b.Fatal(err)
	}
	return inv
}

// BenchmarkResolveTypical resolves what a Kubernetes GPU container carries
// (5 env vars, 3 annotations, 2 device nodes) on a 16-GPU host: the cost the
// guard adds to every CreateContainer.
func BenchmarkResolveTypical(b *testing.B) {
	inv := benchInventory(b)
	r := NewResolver(inv, defaultPolicy())
	req := Request{
		Env: []string{
			"PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/sbin:/usr/bin:/sbin:/bin",
			"CUDA_VERSION=12.4.1",
			"NVIDIA_REQUIRE_CUDA=cuda>=12.4",
			"NVIDIA_DRIVER_CAPABILITIES=compute,utility",
			"NVIDIA_VISIBLE_DEVICES=" + gpuUUID(3),
		},
		Annotations: map[string]string{
			"io.kubernetes.cri.container-type":                    "container",
			"io.kubernetes.cri.sandbox-namespace":                 "ml",
			"cdi.k8s.io/nvidia-device-plugin_" + gpuUUID(3)[4:12]: "nvidia.com/gpu=" + gpuUUID(3),
		},
		Devices: []LinuxDevice{
			{Path: "/dev/nvidiactl", Type: "c", Major: 195, Minor: 255},
			{Path: "/dev/nvidia3", Type: "c", Major: 195, Minor: 3},
		},
	}
	if res, err := r.Resolve(req); err != nil || len(res.Devices) != 1 || len(res.Devices[0].Sources) != 3 {
		b.Fatalf("unexpected resolution %+v, %v", res, err)
	}
	b.ReportAllocs()
	for b.Loop() {
		_, _ = r.Resolve(req)
	}
}

// BenchmarkResolveAll16 is NVIDIA_VISIBLE_DEVICES=all on a 16-GPU host.
func BenchmarkResolveAll16(b *testing.B) {
	r := NewResolver(benchInventory(b), defaultPolicy())
	req := Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=all"}}
	b.ReportAllocs()
	for b.Loop() {
		_, _ = r.Resolve(req)
	}
}

// BenchmarkDiscoverStatic8 loads an 8-GPU static list as the hook does under
// devices.source = "static" (once per container that names a GPU), with
// and without a driver tree to check it against (staticLoader.verify): the
// difference is what the check costs.
func BenchmarkDiscoverStatic8(b *testing.B) {
	var static []config.StaticGPU
	tree := b.TempDir()
	for i := range 8 {
		bus := fmt.Sprintf("0000:%02x:00.0", i+1)
		fakeProcGPU(b, tree, bus, "NVIDIA H100 80GB HBM3", gpuUUID(i), i, false)
		static = append(static, config.StaticGPU{Index: i, UUID: gpuUUID(i), Minor: i})
	}
	for _, bc := range []struct{ name, root string }{{"no driver tree", b.TempDir()}, {"checked", tree}} {
		b.Run(bc.name, func(b *testing.B) {
			cfg := config.DevicesConfig{Source: config.SourceStatic, ProcRoot: bc.root, Static: static}
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Discover(cfg, nil); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
