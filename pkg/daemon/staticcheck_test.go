// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/testwait"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
)

// unknownUUID is how the driver shows the UUID of a GPU it has not
// initialised yet.
const unknownUUID = "GPU-????????-????-????-????-????????????"

// driverGPU writes the driver's /proc entry of one GPU under root.
func driverGPU(t *testing.T, root, bus, uuid string, minor int) {
	t.Helper()
	dir := filepath.Join(root, "proc", "driver", "nvidia", "gpus", bus)
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "information"), fmt.Appendf(nil,
		"Model: \t\t NVIDIA H100 80GB HBM3\nGPU UUID: \t %s\nBus Location: \t %s\nDevice Minor: \t %d\nGPU Excluded:\t No\n",
		uuid, bus, minor), 0o644))
}

// noSwap fails the test if a swap was sent. Called once the next wait was
// armed, it sees a swap of the attempt before.
func noSwap(t *testing.T, swapped <-chan *guard.Guard, why string) {
	t.Helper()
	select {
	case <-swapped:
		t.Fatalf("a swap %s", why)
	default:
	}
}

// TestRediscoverChecksStaticList: under source "static" a daemon that
// started before the NVIDIA driver (a GPU Operator node) used to keep the
// list it could not check for life, so that a list missing a GPU let
// NVIDIA_VISIBLE_DEVICES=all through unclaimed once the driver was up. It
// now decides with the list as before (fake GPUs keep working, logged once)
// and checks it again in the background at the rediscovery back-off; once
// the driver contradicts it, every GPU request is refused with the
// mismatch, and once the driver matches it, the list is checked and the
// retries stop.
func TestRediscoverChecksStaticList(t *testing.T) {
	cfg := staticConfig(t)
	root := cfg.Devices.ProcRoot
	require.NoError(t, os.MkdirAll(filepath.Join(root, "proc"), 0o755)) // a procfs without the driver yet
	cache := filepath.Join(cfg.Ledger.Dir, devices.CacheFile)
	logs := &syncBuffer{}
	timer := newManualTimer()
	b := &Builder{After: timer.after, Logger: slog.New(slog.NewTextHandler(logs, nil))}

	g, err := b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	assert.Equal(t, devices.UncheckedNoDriver, g.Inventory().Unchecked)
	d, err := g.Admit(context.Background(), gpuRequest("c1", "all"))
	require.NoError(t, err)
	assert.Equal(t, guard.Admit, d.Result, "the list is decided with, as before: %s", d.Message)
	cached, err := devices.LoadCache(cache)
	require.NoError(t, err)
	assert.Equal(t, devices.UncheckedNoDriver, cached.Unchecked, "the cache says it is unchecked")

	swapped, stop := runRediscover(t, b)
	// No driver yet (or ever, for fake GPUs): checked again with the
	// back-off, nothing swapped, nothing more logged.
	for _, w := range []time.Duration{5 * time.Second, 10 * time.Second, 20 * time.Second} {
		assert.Equal(t, w, testwait.Receive(t, timer.waits, "a wait"))
		timer.fire <- time.Time{}
	}
	assert.Equal(t, 40*time.Second, testwait.Receive(t, timer.waits, "a wait"))
	noSwap(t, swapped, "while nothing changed")
	assert.Equal(t, 1, strings.Count(logs.String(), "used without a check against the NVIDIA driver"), logs.String())

	// The driver comes up and lists a GPU the list misses.
	driverGPU(t, root, "0000:07:00.0", uuidStatic, 0)
	driverGPU(t, root, "0000:3b:00.0", uuidLate, 1)
	timer.fire <- time.Time{}
	assert.Same(t, g, testwait.Receive(t, swapped, "the swap"))
	assert.True(t, g.Inventory().Undiscovered)
	for _, visible := range []string{"all", "0", uuidLate} {
		d, err = g.Admit(context.Background(), gpuRequest("c-"+visible, visible))
		require.NoError(t, err)
		assert.Equal(t, guard.Reject, d.Result, visible)
		assert.Equal(t, guard.ReasonInventoryIncomplete, d.Reason, visible)
		assert.Contains(t, d.Message, "GPU 1 ("+uuidLate+") at 0000:3b:00.0, /dev/nvidia1, is not in [[devices.static]]", visible)
	}
	assert.Equal(t, 1, strings.Count(logs.String(), "contradicts [[devices.static]]"), logs.String())
	// The same mismatch again: nothing swapped, nothing logged.
	assert.Equal(t, time.Minute, testwait.Receive(t, timer.waits, "a wait"))
	timer.fire <- time.Time{}
	assert.Equal(t, time.Minute, testwait.Receive(t, timer.waits, "a wait"))
	noSwap(t, swapped, "for the same mismatch")
	assert.Equal(t, 1, strings.Count(logs.String(), "contradicts [[devices.static]]"))

	// The driver's tree goes away for a while (its pod restarts): the list
	// it contradicted is not used again unchecked.
	require.NoError(t, os.RemoveAll(filepath.Join(root, "proc", "driver")))
	timer.fire <- time.Time{}
	assert.Equal(t, time.Minute, testwait.Receive(t, timer.waits, "a wait"))
	noSwap(t, swapped, "while the driver's tree is gone")
	d, err = g.Admit(context.Background(), gpuRequest("c-gone", "all"))
	require.NoError(t, err)
	assert.Equal(t, guard.Reject, d.Result, "still refused: %s", d.Message)
	driverGPU(t, root, "0000:07:00.0", uuidStatic, 0)

	// The driver lists the list's GPU alone: checked, decided with, cached,
	// and no more retries.
	require.NoError(t, os.RemoveAll(filepath.Join(root, "proc", "driver", "nvidia", "gpus", "0000:3b:00.0")))
	timer.fire <- time.Time{}
	assert.Same(t, g, testwait.Receive(t, swapped, "the swap"))
	assert.False(t, g.Inventory().Undiscovered)
	assert.Empty(t, g.Inventory().Unchecked)
	d, err = g.Admit(context.Background(), gpuRequest("c2", "all"))
	require.NoError(t, err)
	assert.NotEqual(t, guard.ReasonInventoryIncomplete, d.Reason, d.Message)
	cached, err = devices.LoadCache(cache)
	require.NoError(t, err)
	assert.Empty(t, cached.Unchecked, "the cache is rewritten, checked")
	stop()
	noWait(t, timer, "after the list was checked")
}

// TestRediscoverChecksUnknownUUIDs: under source "auto" without NVML, a GPU
// whose UUID the driver does not show yet makes /proc fail, and the static
// list matched by minor and index is the inventory. It used to be complete
// for the daemon (never discovered again) and cached for the hooks for the
// whole boot, so that a GPU the list names by a wrong UUID (the card was
// replaced) was admitted unclaimed by its real UUID under unknown_device =
// "ignore". Such an id is now refused while the UUIDs are unchecked, and
// the daemon discovers again until the driver shows them.
func TestRediscoverChecksUnknownUUIDs(t *testing.T) {
	cfg := staticConfig(t)
	cfg.Devices.Source = config.SourceAuto
	cfg.Policy.UnknownDevice = config.UnknownIgnore
	root := cfg.Devices.ProcRoot
	driverGPU(t, root, "0000:07:00.0", unknownUUID, 0)
	cache := filepath.Join(cfg.Ledger.Dir, devices.CacheFile)
	timer := newManualTimer()
	b := &Builder{NVML: &lateNVML{unavailable: true}, After: timer.after}

	g, err := b.Setup(context.Background(), cfg)
	require.NoError(t, err)
	require.Equal(t, "static", g.Inventory().Source)
	assert.Equal(t, devices.UncheckedUUIDs, g.Inventory().Unchecked)
	cached, err := devices.LoadCache(cache)
	require.NoError(t, err)
	assert.Equal(t, devices.UncheckedUUIDs, cached.Unchecked, "the hooks check the cache on every read")

	d, err := g.Admit(context.Background(), gpuRequest("real", uuidLate))
	require.NoError(t, err)
	assert.Equal(t, guard.Reject, d.Result, "the real UUID of the GPU the list names wrongly: %s", d.Message)
	assert.Contains(t, d.Message, "whose UUIDs are not checked yet")

	swapped, stop := runRediscover(t, b)
	assert.Equal(t, 5*time.Second, testwait.Receive(t, timer.waits, "a wait"))
	timer.fire <- time.Time{} // the UUID still unknown
	assert.Equal(t, 10*time.Second, testwait.Receive(t, timer.waits, "a wait"))
	noSwap(t, swapped, "while the UUID is unknown")

	driverGPU(t, root, "0000:07:00.0", uuidLate, 0) // the card was replaced
	timer.fire <- time.Time{}
	assert.Same(t, g, testwait.Receive(t, swapped, "the swap"))
	assert.Equal(t, "proc", g.Inventory().Source)
	d, err = g.Admit(context.Background(), gpuRequest("real2", uuidLate))
	require.NoError(t, err)
	assert.Equal(t, guard.Admit, d.Result, d.Message)
	assert.Equal(t, []string{uuidLate}, deviceUUIDs(d))
	cached, err = devices.LoadCache(cache)
	require.NoError(t, err)
	assert.Equal(t, "proc", cached.Source)
	stop()
	noWait(t, timer, "after discovery worked")
}

func deviceUUIDs(d guard.Decision) []string {
	var out []string
	for _, dev := range d.Devices {
		out = append(out, dev.UUID)
	}
	return out
}
