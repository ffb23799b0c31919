// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// gatedNVML is an NVML enumeration that lasts until the test releases it
// (nvmlInit on a multi-GPU host without persistence mode takes seconds):
// each Load reports on entered, then waits for release to be closed.
type gatedNVML struct {
	entered chan struct{}
	release chan struct{}
	loads   atomic.Int32
}

func newGatedNVML() *gatedNVML {
	return &gatedNVML{entered: make(chan struct{}, 4), release: make(chan struct{})}
}

func (*gatedNVML) Name() string { return string(config.SourceNVML) }

func (n *gatedNVML) Load() ([]devices.GPU, error) {
	n.loads.Add(1)
	n.entered <- struct{}{}
	<-n.release
	return []devices.GPU{{Index: 0, UUID: uuidLate, Minor: 0, BusID: "0000:3b:00.0"}}, nil
}

// nvmlHost is a configuration that discovers through NVML (auto: NVML
// first), with no cache yet.
func nvmlHost(t *testing.T) config.Config {
	t.Helper()
	cfg := config.Default()
	cfg.Ledger.Dir = t.TempDir()
	cfg.Devices.Source = config.SourceAuto
	cfg.Devices.ProcRoot = t.TempDir()
	return cfg
}

// TestSetupAnswersWhileDiscoveryRuns: a plugin launched by containerd
// builds its guard in Configure, which the runtime awaits for its request
// timeout only (2s by default), and drops a plugin that answers late. Setup
// therefore answers once its context ends although the NVML enumeration
// still runs: with a guard that refuses every GPU request, saying the
// discovery is in progress, and admits the others. When the enumeration
// ends, its inventory is swapped into that guard, the cache is written, and
// Rediscover hands the guard on (the daemon's observer); a reconnect's Setup
// enumerates nothing again.
func TestSetupAnswersWhileDiscoveryRuns(t *testing.T) {
	cfg := nvmlHost(t)
	nvml := newGatedNVML()
	t.Cleanup(func() {
		select {
		case <-nvml.release:
		default:
			close(nvml.release)
		}
	})
	b := &Builder{NVML: nvml, After: newManualTimer().after}

	ctx, cancel := context.WithCancel(context.Background())
	type setup struct {
		g   *guard.Guard
		err error
	}
	answered := make(chan setup, 1)
	go func() {
		g, err := b.Setup(ctx, cfg)
		answered <- setup{g, err}
	}()
	testwait.Receive(t, nvml.entered, "the enumeration to start")
	cancel() // the runtime's deadline, less the plugin's margin
	res := testwait.Receive(t, answered, "Setup to answer while the enumeration runs")
	require.NoError(t, res.err)
	g := res.g
	discovering, replaced := g.Discovering()
	require.True(t, discovering)
	assert.True(t, g.Inventory().Undiscovered)

	d, err := g.Admit(context.Background(), gpuRequest("gpu-1", "0"))
	require.NoError(t, err)
	assert.Equal(t, guard.Reject, d.Result)
	assert.Equal(t, guard.ReasonInventoryIncomplete, d.Reason)
	assert.Contains(t, d.Message, "still discovering this host's GPUs")
	assert.Contains(t, d.Message, "retrying is automatic")
	d, err = g.Admit(context.Background(), guard.Request{FrontEnd: ledger.FrontEndNRI,
		Owner: ledger.Owner{ContainerID: "plain", Namespace: "ml", Pod: "p", PodUID: "u-plain", Container: "c", FrontEnd: ledger.FrontEndNRI},
		Spec:  devices.Request{Env: []string{"PATH=/bin"}}})
	require.NoError(t, err)
	assert.Equal(t, guard.Skip, d.Result, "a container without GPU is decided as always")

	swapped, _ := runRediscover(t, b)
	close(nvml.release)
	testwait.Receive(t, replaced, "the discovery's inventory to be swapped in")
	assert.Same(t, g, testwait.Receive(t, swapped, "the guard handed on"))
	discovering, _ = g.Discovering()
	assert.False(t, discovering)
	_, ok := g.Inventory().Lookup(uuidLate)
	require.True(t, ok)
	d, err = g.Admit(context.Background(), gpuRequest("gpu-2", "0"))
	require.NoError(t, err)
	assert.Equal(t, guard.Admit, d.Result, d.Message)
	cached, err := devices.LoadCache(filepath.Join(cfg.Ledger.Dir, devices.CacheFile))
	require.NoError(t, err, "the cache the hooks read is written")
	assert.Equal(t, uuidLate, cached.GPUs[0].UUID)

	g2, err := b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	discovering, _ = g2.Discovering()
	assert.False(t, discovering)
	assert.Equal(t, int32(1), nvml.loads.Load(), "a reconnect enumerates nothing again")
}

// A Setup whose context does not end (the external daemon's first one)
// waits for the enumeration: it answers with the discovered inventory.
func TestSetupWaitsForDiscoveryWithoutADeadline(t *testing.T) {
	cfg := nvmlHost(t)
	nvml := newGatedNVML()
	close(nvml.release)
	g, err := (&Builder{NVML: nvml}).Setup(context.Background(), cfg)
	require.NoError(t, err)
	discovering, _ := g.Discovering()
	assert.False(t, discovering)
	_, ok := g.Inventory().Lookup(uuidLate)
	assert.True(t, ok)
}

// A failed write of the inventory cache used to drop the inventory, so that
// the next Setup (every reconnect of an external daemon, in Configure)
// enumerated the GPUs again. The inventory is kept, and the cache is written
// again in the background.
func TestCacheWriteFailureIsRetriedNotRediscovered(t *testing.T) {
	cfg := nvmlHost(t)
	cache := filepath.Join(cfg.Ledger.Dir, devices.CacheFile)
	// A directory where the cache goes: its write fails.
	require.NoError(t, os.MkdirAll(filepath.Join(cache, "blocker"), 0o755))
	nvml := newGatedNVML()
	close(nvml.release)
	timer := newManualTimer()
	b := &Builder{NVML: nvml, After: timer.after}

	g, err := b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	_, ok := g.Inventory().Lookup(uuidLate)
	require.True(t, ok)
	_, err = b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	assert.Equal(t, int32(1), nvml.loads.Load(), "a reconnect does not enumerate again")

	require.NoError(t, os.RemoveAll(cache))
	_, stop := runRediscover(t, b)
	assert.Equal(t, rediscoverFirst, testwait.Receive(t, timer.waits, "the wait before writing the cache again"))
	timer.fire <- time.Time{}
	// Once written, nothing is left to retry: Rediscover waits for work.
	stop()
	cached, err := devices.LoadCache(cache)
	require.NoError(t, err, "the cache is written again")
	assert.Equal(t, uuidLate, cached.GPUs[0].UUID)
	assert.Equal(t, int32(1), nvml.loads.Load(), "written from the inventory known, not from a new enumeration")
	noWait(t, timer, "once the cache was written")
}
