// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
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

const uuidLate = "GPU-1a7e1a7e-0000-4000-8000-000000000000"

// lateNVML is an NVML source whose driver is not there until up is set (a
// GPU Operator's driver container that starts after the guard): until then
// it lists no GPU, or with unavailable set it fails as without a library.
// Once up it lists gpus, or one GPU (uuidLate) when gpus is nil.
type lateNVML struct {
	up          atomic.Bool
	unavailable bool
	gpus        []devices.GPU
}

func (*lateNVML) Name() string { return string(config.SourceNVML) }

func (l *lateNVML) Load() ([]devices.GPU, error) {
	if !l.up.Load() && !l.unavailable {
		return nil, nil
	}
	if !l.up.Load() {
		return nil, fmt.Errorf("%w: nvml: libnvidia-ml.so.1 not found (test)", devices.ErrSourceUnavailable)
	}
	if l.gpus != nil {
		return l.gpus, nil
	}
	return []devices.GPU{{Index: 0, UUID: uuidLate, Minor: 0, BusID: "0000:3b:00.0"}}, nil
}

// manualTimer is Builder.After under the test's control: each wait is
// reported on waits, and ends when the test sends on fire.
type manualTimer struct {
	waits chan time.Duration
	fire  chan time.Time
}

func newManualTimer() *manualTimer {
	return &manualTimer{waits: make(chan time.Duration, 16), fire: make(chan time.Time)}
}

func (m *manualTimer) after(d time.Duration) <-chan time.Time {
	m.waits <- d
	return m.fire
}

// runRediscover runs b.Rediscover until stop is called or the test ends,
// and returns the channel its swaps are sent on. stop returns once
// Rediscover has.
func runRediscover(t *testing.T, b *Builder) (swapped <-chan *guard.Guard, stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	swaps := make(chan *guard.Guard, 1)
	var done sync.WaitGroup
	done.Go(func() { b.Rediscover(ctx, func(g *guard.Guard) { swaps <- g }) })
	stop = func() { cancel(); done.Wait() }
	t.Cleanup(stop)
	return swaps, stop
}

// noWait fails the test if a retry was waited for. Called once Rediscover
// has returned, it sees every wait it armed: Rediscover asks for the timer
// before it selects on it, even with its context done.
func noWait(t *testing.T, timer *manualTimer, why string) {
	t.Helper()
	select {
	case w := <-timer.waits:
		t.Fatalf("a wait of %s %s", w, why)
	default:
	}
}

// lateDriverHost is a state directory whose cache lists the GPU from a
// previous boot, and a PCI bus that shows it with no driver bound.
func lateDriverHost(t *testing.T) config.Config {
	t.Helper()
	cfg := config.Default()
	cfg.Ledger.Dir = t.TempDir()
	cfg.Devices.Source = config.SourceAuto
	cfg.Devices.ProcRoot = t.TempDir() // a procfs without /proc/driver/nvidia yet
	require.NoError(t, os.MkdirAll(filepath.Join(cfg.Devices.ProcRoot, "proc"), 0o755))
	dev := filepath.Join(cfg.Devices.ProcRoot, "sys", "bus", "pci", "devices", "0000:3b:00.0")
	require.NoError(t, os.MkdirAll(dev, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dev, "vendor"), []byte("0x10de\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dev, "class"), []byte("0x030200\n"), 0o644))
	prev, err := devices.NewInventory("nvml", []devices.GPU{{Index: 0, UUID: uuidCached, Minor: 0, BusID: "0000:3b:00.0"}})
	require.NoError(t, err)
	require.NoError(t, devices.SaveCache(filepath.Join(cfg.Ledger.Dir, devices.CacheFile), prev, "an-earlier-boot"))
	return cfg
}

func gpuRequest(id, visible string) guard.Request {
	return guard.Request{FrontEnd: ledger.FrontEndNRI,
		Owner: ledger.Owner{ContainerID: id, Namespace: "ml", Pod: "p-" + id, PodUID: "u-" + id, Container: "c", FrontEnd: ledger.FrontEndNRI},
		Spec:  devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=" + visible}}}
}

// TestRediscoverAfterLateDriver: a daemon that started before the NVIDIA
// driver refuses GPU requests over its empty inventory, keeps the cache a
// previous boot wrote (without deciding with it), retries the discovery
// with a growing back-off, and once the driver is up swaps the inventory
// of the guard it built and rewrites the cache: the same guard admits the
// request, no restart, no new Setup.
func TestRediscoverAfterLateDriver(t *testing.T) {
	cfg := lateDriverHost(t)
	cache := filepath.Join(cfg.Ledger.Dir, devices.CacheFile)
	nvml, timer := &lateNVML{}, newManualTimer()
	b := &Builder{NVML: nvml, After: timer.after}

	g, err := b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	assert.Empty(t, g.Inventory().GPUs)
	assert.Equal(t, 1, g.Inventory().UnlistedGPUs)
	cached, err := devices.LoadCache(cache)
	require.NoError(t, err)
	assert.Equal(t, uuidCached, cached.GPUs[0].UUID, "the empty discovery did not overwrite the cache")

	d, err := g.Admit(context.Background(), gpuRequest("c1", "all"))
	require.NoError(t, err)
	assert.Equal(t, guard.Reject, d.Result)
	assert.Equal(t, "inventory-incomplete", d.Reason)
	assert.Contains(t, d.Message, "retries the discovery by itself")
	d, err = g.Admit(context.Background(), gpuRequest("c2", uuidCached))
	require.NoError(t, err)
	assert.Equal(t, guard.Reject, d.Result, "the stale cache is not decided with")

	swapped, stop := runRediscover(t, b)

	// The driver is still down: attempts back off 5s, 10s, 20s, 40s, 1m, 1m.
	want := []time.Duration{5 * time.Second, 10 * time.Second, 20 * time.Second, 40 * time.Second, time.Minute, time.Minute}
	for i, w := range want {
		assert.Equal(t, w, testwait.Receive(t, timer.waits, "a wait"), "wait %d", i)
		if i < len(want)-1 {
			timer.fire <- time.Time{}
		}
	}
	assert.Empty(t, g.Inventory().GPUs)
	cached, err = devices.LoadCache(cache)
	require.NoError(t, err)
	assert.Equal(t, uuidCached, cached.GPUs[0].UUID, "failed attempts write nothing")

	nvml.up.Store(true)
	timer.fire <- time.Time{}
	assert.Same(t, g, testwait.Receive(t, swapped, "the swap"))
	_, ok := g.Inventory().Lookup(uuidLate)
	require.True(t, ok, "the guard decides with the new inventory")
	cached, err = devices.LoadCache(cache)
	require.NoError(t, err)
	assert.Equal(t, uuidLate, cached.GPUs[0].UUID, "the cache the hooks read is rewritten")

	d, err = g.Admit(context.Background(), gpuRequest("c3", "0"))
	require.NoError(t, err)
	assert.Equal(t, guard.Admit, d.Result, d.Message)

	// Complete: no more attempts (checked once Rediscover has returned,
	// so that one it was about to arm is seen), and a reconnect reuses
	// the inventory.
	stop()
	noWait(t, timer, "after the inventory was complete")
	g2, err := b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	_, ok = g2.Inventory().Lookup(uuidLate)
	assert.True(t, ok)
}

// A daemon whose discovery failed at start decides with the cache it fell
// back to, and replaces it with what live discovery lists once the driver
// is up.
func TestRediscoverReplacesCacheFallback(t *testing.T) {
	cfg := lateDriverHost(t)
	nvml, timer := &lateNVML{unavailable: true}, newManualTimer()
	b := &Builder{NVML: nvml, After: timer.after}
	g, err := b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	_, ok := g.Inventory().Lookup(uuidCached)
	require.True(t, ok, "the cache fallback")

	swapped, _ := runRediscover(t, b)
	assert.Equal(t, 5*time.Second, testwait.Receive(t, timer.waits, "a wait"))
	nvml.up.Store(true)
	timer.fire <- time.Time{}
	assert.Same(t, g, testwait.Receive(t, swapped, "the swap"))
	_, ok = g.Inventory().Lookup(uuidLate)
	assert.True(t, ok)
}

// A static inventory checked against the driver, or one discovery listed
// GPUs in, is not retried.
func TestRediscoverIdleWhenComplete(t *testing.T) {
	timer := newManualTimer()
	b := &Builder{After: timer.after}
	cfg := staticConfig(t)
	driverGPU(t, cfg.Devices.ProcRoot, "0000:07:00.0", uuidStatic, 0)
	g, err := b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	require.Empty(t, g.Inventory().Unchecked)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); b.Rediscover(ctx, nil) }()
	cancel()
	testwait.Receive(t, done, "Rediscover to stop")
	noWait(t, timer, "over a complete inventory")
}

// TestStartWithoutDriverOrCache: the first boot of a GPU Operator node. No
// discovery source works (no NVML library, no /proc/driver/nvidia, no
// static list) and no cache exists. The daemon starts all the same (else
// containerd, whose drop-in requires the plugin, refuses every pod, the
// driver's included), writes no cache, admits containers without GPU,
// refuses every GPU request whatever names it, and admits them once the
// driver is up and its discovery, retried in the background, lists GPUs.
func TestStartWithoutDriverOrCache(t *testing.T) {
	for _, unknown := range []config.UnknownDevice{config.UnknownReject, config.UnknownIgnore} {
		t.Run(string(unknown), func(t *testing.T) {
			cfg := config.Default()
			cfg.Ledger.Dir = t.TempDir()
			cfg.Devices.Source = config.SourceAuto
			cfg.Devices.ProcRoot = t.TempDir() // a procfs without the driver, no sysfs
			require.NoError(t, os.MkdirAll(filepath.Join(cfg.Devices.ProcRoot, "proc"), 0o755))
			cfg.Policy.UnknownDevice = unknown
			cache := filepath.Join(cfg.Ledger.Dir, devices.CacheFile)
			nvml, timer := &lateNVML{unavailable: true}, newManualTimer()
			b := &Builder{NVML: nvml, After: timer.after}

			g, err := b.Setup(context.Background(), cfg)
			require.NoError(t, err, "the daemon starts without a driver or a cache")
			assert.Empty(t, g.Inventory().GPUs)
			assert.True(t, g.Inventory().Undiscovered)
			assert.NoFileExists(t, cache, "no cache is written over nothing: the hooks keep failing closed")

			ctx := context.Background()
			d, err := g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndNRI,
				Owner: ledger.Owner{ContainerID: "plain", Namespace: "ml", Pod: "p", PodUID: "u-plain", Container: "c", FrontEnd: ledger.FrontEndNRI},
				Spec: devices.Request{Env: []string{"PATH=/bin"}, Devices: []devices.LinuxDevice{
					{Path: "/dev/nvidiactl", Type: "c", Major: 195, Minor: 255}}}})
			require.NoError(t, err)
			assert.Equal(t, guard.Skip, d.Result, "a container without GPU is admitted: %s", d.Message)

			refused := map[string]guard.Request{
				"id 0":        gpuRequest("r-id", "0"),
				"uuid":        gpuRequest("r-uuid", uuidLate),
				"all":         gpuRequest("r-all", "all"),
				"device node": {FrontEnd: ledger.FrontEndNRI, Owner: gpuRequest("r-node", "void").Owner, Spec: devices.Request{Devices: []devices.LinuxDevice{{Path: "/dev/nvidia0", Type: "c", Major: 195, Minor: 0}}}},
				"cdi":         {FrontEnd: ledger.FrontEndNRI, Owner: gpuRequest("r-cdi", "void").Owner, Spec: devices.Request{CDIDevices: []string{"nvidia.com/gpu=0"}}},
			}
			for what, req := range refused {
				d, err := g.Admit(ctx, req)
				require.NoError(t, err, what)
				assert.Equal(t, guard.Reject, d.Result, "%s: %s", what, d.Message)
				assert.Equal(t, guard.ReasonInventoryIncomplete, d.Reason, what)
				assert.Contains(t, d.Message, "retries the discovery by itself", what)
			}

			swapped, _ := runRediscover(t, b)

			assert.Equal(t, 5*time.Second, testwait.Receive(t, timer.waits, "a wait"))
			timer.fire <- time.Time{} // still no driver
			assert.Equal(t, 10*time.Second, testwait.Receive(t, timer.waits, "a wait"))
			assert.NoFileExists(t, cache)

			nvml.up.Store(true)
			timer.fire <- time.Time{}
			assert.Same(t, g, testwait.Receive(t, swapped, "the swap"))
			assert.False(t, g.Inventory().Undiscovered)
			cached, err := devices.LoadCache(cache)
			require.NoError(t, err)
			assert.Equal(t, uuidLate, cached.GPUs[0].UUID, "the cache the hooks read is written")

			d, err = g.Admit(ctx, gpuRequest("late", "0"))
			require.NoError(t, err)
			assert.Equal(t, guard.Admit, d.Result, d.Message)
		})
	}
}
