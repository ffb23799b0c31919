// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package observe

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestReportFileRoundTripAndBounds(t *testing.T) {
	dir := t.TempDir()
	_, err := ReadFile(dir)
	require.ErrorIs(t, err, ErrNoFile)

	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	f := File{Time: at, WrittenAt: at, IntervalSeconds: 10}
	for i := range maxFileFindings + 5 {
		f.Findings = append(f.Findings, FileFinding{Finding: Finding{Kind: KindIntruder, PID: i,
			Device: Device{Index: "0", UUID: "GPU-0"}}, Namespace: "ns"})
	}
	for range maxFileErrors + 1 {
		u := UnlistedDevice{Device: Device{Index: "1", UUID: "GPU-1"}, Error: "list compute processes: ERROR_UNKNOWN"}
		f.Errors = append(f.Errors, u.String())
		f.Unlisted = append(f.Unlisted, u)
	}
	require.NoError(t, WriteFile(dir, f))
	fi, err := os.Stat(filepath.Join(dir, FileName))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), "root-only, like the ledger")

	got, err := ReadFile(dir)
	require.NoError(t, err)
	assert.Len(t, got.Findings, maxFileFindings)
	assert.Len(t, got.Errors, maxFileErrors)
	assert.Equal(t, "GPU 1 (GPU-1): list compute processes: ERROR_UNKNOWN", got.Errors[0])
	assert.Len(t, got.Unlisted, maxFileErrors, "the devices of the errors kept")
	assert.Equal(t, "GPU-1", got.Unlisted[0].Device.UUID)
	assert.Equal(t, 6, got.Truncated, "an unlisted device left out is its error left out: counted once")
	assert.Equal(t, "ns", got.Findings[3].Namespace)
	assert.Equal(t, 3, got.Findings[3].PID)
	assert.Equal(t, "GPU-0", got.Findings[3].Device.UUID)
	assert.NotNil(t, got.Unhealthy, "empty lists are [] in JSON")
	require.NoError(t, WriteFile(dir, File{Time: at}))
	empty, err := ReadFile(dir)
	require.NoError(t, err)
	assert.NotNil(t, empty.Unlisted, "empty lists are [] in JSON")

	assert.False(t, got.Stale(at.Add(30*time.Second)))
	assert.True(t, got.Stale(at.Add(31*time.Second)), "three intervals without a pass")
	got.Time = time.Time{}
	assert.False(t, got.Stale(at.Add(30*time.Second)), "no pass yet: judged from when it was written")
	assert.True(t, got.Stale(at.Add(31*time.Second)))
	got.IntervalSeconds = 0
	assert.False(t, got.Stale(at.Add(time.Hour)), "accounting off: health only, never stale")

	require.NoError(t, RemoveFile(dir))
	require.NoError(t, RemoveFile(dir), "removing twice is fine")
	_, err = ReadFile(dir)
	require.ErrorIs(t, err, ErrNoFile)
}

// The devices the daemon's inventory lacks have a list of their own in
// observe.json, bounded as the errors are (what is left out is counted),
// written [] when empty; a file of an older daemon, without it, still
// reads.
func TestReportFileNotInInventory(t *testing.T) {
	dir := t.TempDir()
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	f := File{Time: at, WrittenAt: at, IntervalSeconds: 10}
	for i := range maxFileErrors + 2 {
		f.NotInInventory = append(f.NotInInventory, NotInInventoryDevice{
			Device: Device{Index: fmt.Sprintf("1:%d", i), UUID: fmt.Sprintf("MIG-%d", i), ParentUUID: "GPU-1"},
			Notice: "the MIG layout of GPU 1 (GPU-1) changed since the inventory was discovered"})
	}
	require.NoError(t, WriteFile(dir, f))
	got, err := ReadFile(dir)
	require.NoError(t, err)
	require.Equal(t, maxFileErrors, len(got.NotInInventory), "bounded as the errors are")
	assert.Equal(t, "MIG-0", got.NotInInventory[0].Device.UUID)
	assert.Equal(t, "GPU-1", got.NotInInventory[0].Device.ParentUUID)
	assert.Equal(t, "MIG 1:0 (MIG-0): the MIG layout of GPU 1 (GPU-1) changed since the inventory was discovered",
		got.NotInInventory[0].String())
	assert.Equal(t, 2, got.Truncated, "the devices left out are counted")
	assert.Empty(t, got.Unlisted, "not in the inventory is not unlisted")

	require.NoError(t, WriteFile(dir, File{Time: at}))
	raw, err := os.ReadFile(filepath.Join(dir, FileName))
	require.NoError(t, err)
	assert.Contains(t, string(raw), `"not_in_inventory": []`, "empty lists are [] in JSON")

	older := `{"time": "2026-01-02T03:04:05Z", "written_at": "2026-01-02T03:04:05Z", "interval_seconds": 10,
		"findings": [], "unhealthy": [], "errors": [], "unlisted": []}`
	require.NoError(t, os.WriteFile(filepath.Join(dir, FileName), []byte(older), 0o600))
	got, err = ReadFile(dir)
	require.NoError(t, err, "a file without the field reads")
	assert.Empty(t, got.NotInInventory)
}

func TestReadFileRefusesOddFiles(t *testing.T) {
	dir := t.TempDir()
	other := filepath.Join(t.TempDir(), "x.json")
	require.NoError(t, os.WriteFile(other, []byte("{}"), 0o600))
	require.NoError(t, os.Symlink(other, filepath.Join(dir, FileName)))
	_, err := ReadFile(dir)
	require.ErrorContains(t, err, "is a symlink")

	dir = t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, FileName), []byte("{not json"), 0o600))
	_, err = ReadFile(dir)
	require.ErrorContains(t, err, "does not parse")

	dir = t.TempDir()
	big := fmt.Sprintf(`{"errors":[%q]}`, strings.Repeat("x", maxFileBytes))
	require.NoError(t, os.WriteFile(filepath.Join(dir, FileName), []byte(big), 0o600))
	_, err = ReadFile(dir)
	require.ErrorContains(t, err, "larger than")

	dir = t.TempDir()
	require.NoError(t, os.Mkdir(filepath.Join(dir, FileName), 0o700))
	_, err = ReadFile(dir)
	require.ErrorContains(t, err, "not a regular file")
}

func TestCarryFileRoundTripAndRefusals(t *testing.T) {
	dir := t.TempDir()
	_, err := ReadCarry(dir)
	require.ErrorIs(t, err, ErrNoFile)

	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	c := Carry{BootID: "boot-1", WrittenAt: at, Cordons: true,
		CordonLineages: map[string]string{"GPU-0": "L1"}, CordonRetries: []string{"GPU-1"}}
	for i := range maxFileFindings + 2 {
		c.Findings = append(c.Findings, FileFinding{Finding: Finding{Kind: KindIntruder, PID: i, StartTicks: uint64(500 + i),
			Device: Device{Index: "0", UUID: "GPU-0"}}, Pod: "rogue"})
	}
	require.NoError(t, WriteCarry(dir, c))
	fi, err := os.Stat(filepath.Join(dir, CarryFileName))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), "root-only, like the ledger")
	got, err := ReadCarry(dir)
	require.NoError(t, err)
	assert.Equal(t, CarryFormat, got.Format)
	assert.Equal(t, "boot-1", got.BootID)
	assert.True(t, got.Cordons)
	assert.Len(t, got.Findings, maxFileFindings)
	assert.Equal(t, 2, got.Truncated)
	assert.EqualValues(t, 503, got.Findings[3].StartTicks)
	assert.Equal(t, "rogue", got.Findings[3].Pod)
	assert.Equal(t, map[string]string{"GPU-0": "L1"}, got.CordonLineages)
	assert.Equal(t, []string{"GPU-1"}, got.CordonRetries)
	_, err = ReadFile(dir)
	require.ErrorIs(t, err, ErrNoFile, "not the report gpu-guard-ctl reads")

	require.NoError(t, os.WriteFile(filepath.Join(dir, CarryFileName), []byte(`{"format": 2, "findings": []}`), 0o600))
	_, err = ReadCarry(dir)
	require.ErrorContains(t, err, "format 2")
	require.NoError(t, os.WriteFile(filepath.Join(dir, CarryFileName), []byte(`{"format": 1, "findi`), 0o600))
	_, err = ReadCarry(dir)
	require.ErrorContains(t, err, "does not parse")
}
