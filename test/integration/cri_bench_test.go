// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build integration

package integration

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/benchab"
)

// BenchmarkCRIAdmission measures what NRI admission by the guard costs a
// container's whole life through a real containerd, as an interleaved A/B:
// two containerds of the harness run side by side, configured alike, one
// with the guard connected as an external NRI plugin ("guard") and one
// without a plugin ("bare"), each with one running pod. One sample is
// `crictl create`, `start`, `stop` and `rm` of a fresh container in that
// pod, timed from before the create to after the rm. Four variants, one
// sample each per round: "plain" (bare, no GPU), "nogpu" (guard, no GPU),
// "plain-gpu" (bare, NVIDIA_VISIBLE_DEVICES=0) and "gpu" (guard, the same
// env: the guard claims GPU 0 at create, records the container's pid at
// start and releases GPU 0 at stop, three ledger commits). The two bare
// variants are an A/A pair: plain-gpu/plain shows the run's noise. It
// reports each variant's median and p99 in ms and the ratios of the
// plugin's cost: nogpu/plain and gpu/plain-gpu (p50 and p99). Outside the
// timed part, every gpu sample is checked against the guard's audit log
// (GPU 0 claimed by that container, then released) and every nogpu sample
// for leaving no record. Run it with -benchtime=30x -count=3
// (hack/bench-process.sh, CRI_N, does).
func BenchmarkCRIAdmission(b *testing.B) {
	bare := StartContainerd(b, ContainerdOptions{})
	guarded := StartContainerd(b, ContainerdOptions{})
	g := StartGuard(b, guarded, GuardOptions{})
	barePod := bare.RunPod(b, PodSpec{Name: "bench"})
	guardPod := guarded.RunPod(b, PodSpec{Name: "bench"})
	// Registered after StartGuard's cleanup, so they run before it: the
	// guard sees its pod go.
	b.Cleanup(func() { barePod.Remove(b) })
	b.Cleanup(func() { guardPod.Remove(b) })

	gpu0 := guarded.GPUs[0].UUID
	audit := filepath.Join(g.StateDir, "audit.log")
	seq := 0
	variant := func(name string, p *Pod, env []EnvVar, check func(id string) error) benchab.Variant {
		return benchab.Variant{Name: name, Run: func() (time.Duration, error) {
			seq++
			d, id, err := criCycle(b, p, ContainerSpec{Name: fmt.Sprintf("%s-%d", name, seq), Env: env})
			if err != nil {
				return 0, err
			}
			if check != nil {
				if err := check(id); err != nil {
					return 0, fmt.Errorf("container %s: %w", shortID(id), err)
				}
			}
			return d, nil
		}}
	}
	claimedAndReleased := func(id string) error { return waitAudit(audit, id, gpu0) }
	noRecord := func(id string) error {
		recs, err := auditRecordsOf(audit, id)
		if err != nil {
			return err
		}
		if len(recs) > 0 {
			return fmt.Errorf("a container naming no GPU left audit records: %s", describe(recs))
		}
		return nil
	}
	variants := []benchab.Variant{
		variant("plain", barePod, nil, nil),
		variant("nogpu", guardPod, nil, noRecord),
		variant("plain-gpu", barePod, GPUEnv("0"), nil),
		variant("gpu", guardPod, GPUEnv("0"), claimedAndReleased),
	}
	// One untimed round first: the first container of a containerd pays
	// for what later ones find ready, and a broken setup fails here.
	for _, v := range variants {
		if _, err := v.Run(); err != nil {
			b.Fatalf("warm-up %s: %v", v.Name, err)
		}
	}
	samples := benchab.Run(b, variants)
	samples.ReportRatio(b, "gpu", "plain-gpu")
	if claims := g.Claims(b); len(claims) != 0 {
		b.Fatalf("the ledger holds claims after the runs: %s", describe(claims))
	}
	if !g.Ready() {
		b.Fatal("the guard is no longer ready (registered and synchronized) after the runs")
	}
}

// criCycle creates, starts, stops and removes one container in p, and
// returns how long the four took and the container's id.
func criCycle(b *testing.B, p *Pod, spec ContainerSpec) (time.Duration, string, error) {
	start := time.Now()
	id, err := p.Create(spec)
	if err != nil {
		return 0, "", fmt.Errorf("create %s: %w", p.Owner(spec.Name), err)
	}
	p.c.StartContainer(b, id)
	p.c.StopContainer(b, id)
	p.c.RemoveContainer(b, id)
	return time.Since(start), id, nil
}

// waitAudit waits until the audit log at path shows container id claiming
// exactly the device uuid and then releasing it. The release reaches the
// ledger through NRI's StopContainer or RemoveContainer, both done by the
// time `crictl rm` returns; waiting covers a runtime that delivers them
// late.
func waitAudit(path, id, uuid string) error {
	var last []auditLine
	err := poll(waitTimeout, func() (bool, error) {
		recs, err := auditRecordsOf(path, id)
		if err != nil {
			return false, err
		}
		last = recs
		claimed := slices.IndexFunc(recs, func(r auditLine) bool {
			return r.Op == "claim" && slices.Equal(r.Devices, []string{uuid})
		})
		if claimed < 0 {
			return false, nil
		}
		released := slices.ContainsFunc(recs[claimed+1:], func(r auditLine) bool {
			return r.Op == "release" && slices.Equal(r.Devices, []string{uuid})
		})
		return released, nil
	})
	if err != nil {
		return fmt.Errorf("waiting for the audit log to show %s claimed and released: %w; records of the container: %s", uuid, err, describe(last))
	}
	return nil
}

// auditLine is the part of one audit.log record the benchmark checks.
type auditLine struct {
	Op          string   `json:"op"`
	Devices     []string `json:"devices"`
	ContainerID string   `json:"container_id"`
}

// auditRecordsOf returns the audit log's records about container id, in
// order (none when the log does not exist yet).
func auditRecordsOf(path, id string) ([]auditLine, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the audit log: %w", err)
	}
	var recs []auditLine
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var r auditLine
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return nil, fmt.Errorf("audit log line %q: %w", sc.Text(), err)
		}
		if r.ContainerID == id {
			recs = append(recs, r)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read the audit log: %w", err)
	}
	return recs, nil
}
