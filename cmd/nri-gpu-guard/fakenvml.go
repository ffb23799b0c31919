// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build fakenvml && cgo

// This file exists only in binaries built with the fakenvml tag, for the
// end-to-end tests on hosts without a GPU: the observer's NVML is go-nvml's
// mock (a DGX A100 server) whose GPUs and processes come from the JSON file
// named by $NRI_GPU_GUARD_FAKE_NVML, re-read on every listing:
//
//	{"gpus": [{"uuid": "GPU-…", "pids": [1234]}]}
//
// Release builds do not have the tag and always use the host's NVML.

package main

import (
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// fakeNVMLEnv names the fake NVML's process file.
const fakeNVMLEnv = "NRI_GPU_GUARD_FAKE_NVML"

type fakeNVMLFile struct {
	GPUs []struct {
		UUID string   `json:"uuid"`
		Pids []uint32 `json:"pids"`
	} `json:"gpus"`
}

func readFakeNVML(path string) (fakeNVMLFile, error) {
	var f fakeNVMLFile
	data, err := os.ReadFile(path) //nolint:gosec // a test binary's fixture, named by its test
	if err != nil {
		return f, err
	}
	if err := json.Unmarshal(data, &f); err != nil {
		return f, fmt.Errorf("fake NVML %s: %w", path, err)
	}
	return f, nil
}

func init() {
	path := os.Getenv(fakeNVMLEnv)
	if path == "" {
		return
	}
	openNVML = func() (observe.Source, error) {
		f, err := readFakeNVML(path)
		if err != nil {
			return nil, err
		}
		srv := dgxa100.New()
		if len(f.GPUs) > len(srv.Devices) {
			return nil, fmt.Errorf("fake NVML %s: %d GPUs, the mock has %d", path, len(f.GPUs), len(srv.Devices))
		}
		srv.Devices = srv.Devices[:len(f.GPUs)]
		for i := range f.GPUs {
			d := srv.Devices[i].(*server.Device)
			d.UUID = f.GPUs[i].UUID
			d.GetUUIDFunc = func() (string, nvml.Return) { return d.UUID, nvml.SUCCESS }
			d.GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) {
				now, err := readFakeNVML(path)
				if err != nil || i >= len(now.GPUs) {
					return nil, nvml.ERROR_UNKNOWN
				}
				var out []nvml.ProcessInfo
				for _, pid := range now.GPUs[i].Pids {
					out = append(out, nvml.ProcessInfo{Pid: pid, UsedGpuMemory: 1 << 30})
				}
				return out, nvml.SUCCESS
			}
			d.GetGraphicsRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.ERROR_NOT_SUPPORTED }
			d.GetSupportedEventTypesFunc = func() (uint64, nvml.Return) { return nvml.EventTypeXidCriticalError, nvml.SUCCESS }
			d.RegisterEventsFunc = func(uint64, nvml.EventSet) nvml.Return { return nvml.SUCCESS }
		}
		srv.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) {
			return &mock.EventSet{
				WaitFunc: func(ms uint32) (nvml.EventData, nvml.Return) {
					// No Xid ever: wait as long as asked, like NVML.
					<-time.After(time.Duration(ms) * time.Millisecond)
					return nvml.EventData{}, nvml.ERROR_TIMEOUT
				},
				FreeFunc: func() nvml.Return { return nvml.SUCCESS },
			}, nvml.SUCCESS
		}
		return observe.OpenNVML(srv)
	}
}
