// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

const testBoot = "11111111-2222-3333-4444-555555555555"

// clock is an injected, manually advanced clock: a wall clock (Now) and the
// time since boot (Boot, what CLOCK_BOOTTIME reads). Advance is time
// passing, and moves both; Step sets the wall clock alone, as date -s,
// chronyc makestep or NTP's first sync after boot do.
type clock struct {
	mu   sync.Mutex
	t    time.Time
	boot time.Duration
}

func newClock() *clock {
	return &clock{t: time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC), boot: 42 * time.Minute}
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Boot() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.boot
}

// Advance lets d pass: both readings move.
func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.boot += d
	c.mu.Unlock()
}

// Step sets the wall clock by d (back if negative) without any time passing.
func (c *clock) Step(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func gpu(i int) devices.Device {
	return devices.Device{UUID: fmt.Sprintf("GPU-%08d-0000-4000-8000-000000000000", i), Index: fmt.Sprint(i), Kind: devices.KindGPU}
}

func mig(g, j int) devices.Device {
	return devices.Device{
		UUID:   fmt.Sprintf("MIG-%08d-%04d-4000-8000-000000000000", g, j),
		Index:  fmt.Sprintf("%d:%d", g, j),
		Kind:   devices.KindMIG,
		Parent: gpu(g).UUID,
	}
}

func devs(ds ...devices.Device) []devices.Device { return ds }

func owner(id string) Owner {
	return Owner{ContainerID: id, Namespace: "ns", Pod: "pod-" + id, PodUID: "uid-" + id, Container: "ctr", FrontEnd: FrontEndNRI}
}

func testOptions(c *clock) Options {
	o := Options{BootID: testBoot, LockTimeout: 30 * time.Second}
	if c != nil {
		o.Now, o.BootClock = c.Now, c.Boot
	}
	return o
}

func openTest(t testing.TB, c *clock) *Ledger {
	t.Helper()
	l, err := Open(t.TempDir(), testOptions(c))
	require.NoError(t, err)
	return l
}

// safeDir is a fresh directory whose chain CheckDirChain must accept: made
// by this process (owned by its euid), mode 0755 (not writable by group or
// others), in the temp dir. That the temp dir's own parents are safe is no
// extra assumption: openTest opens every test ledger there, and Open checks
// the chain. A rejection is thus a failure of the test, never a skip.
func safeDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	require.NoError(t, os.Chmod(dir, 0o755))
	return dir
}

// update runs fn in an Update and fails the test on error.
func update(t testing.TB, l *Ledger, fn func(tx *Tx)) {
	t.Helper()
	require.NoError(t, l.Update(context.Background(), func(tx *Tx) error { fn(tx); return nil }))
}

func snapshot(t testing.TB, l *Ledger) State {
	t.Helper()
	st, err := l.Snapshot(context.Background())
	require.NoError(t, err)
	return st
}

// holders maps device UUID to holding container id.
func holders(st State) map[string]string {
	m := map[string]string{}
	for _, c := range st.Claims {
		m[c.Device.UUID] = c.Owner.ContainerID
	}
	return m
}

func reservedFor(st State) map[string]string {
	m := map[string]string{}
	for _, r := range st.Reservations {
		m[r.Device.UUID] = r.For
	}
	return m
}

func waiterKeys(st State) []string {
	var out []string
	for _, w := range st.Waiters {
		out = append(out, w.Key)
	}
	return out
}

func isBusy(err error) bool {
	var be *BusyError
	return errors.As(err, &be) && errors.Is(err, ErrBusy)
}

// auditOps lists the ops of the audit log in order.
func auditOps(t testing.TB, l *Ledger) []string {
	t.Helper()
	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err)
	var ops []string
	for _, r := range recs {
		ops = append(ops, r.Op)
	}
	return ops
}

// formatPrefix is how a snapshot of format n starts.
func formatPrefix(n int) []byte { return []byte(fmt.Sprintf(`{"format":%d,`, n)) }
