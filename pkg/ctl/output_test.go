// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// TestGolden runs every read command in every output format on the fixture
// ledger and compares the output with testdata/*.golden.
func TestGolden(t *testing.T) {
	f := newFixture(t)
	f.populate(t)
	for _, tc := range []struct {
		name string
		args []string
		code int
	}{
		// status finds a conflict, a stale claim and a claim on a GPU that
		// is not in the inventory: exit 3 in every format.
		{"status", []string{"status"}, ExitAttention},
		{"status-wide", []string{"status", "-o", "wide"}, ExitAttention},
		{"status-json", []string{"status", "-o", "json"}, ExitAttention},
		{"claims", []string{"claims"}, ExitOK},
		{"claims-wide", []string{"claims", "-o", "wide"}, ExitOK},
		{"claims-json", []string{"claims", "-o", "json"}, ExitOK},
		{"queue", []string{"queue"}, ExitOK},
		{"queue-wide", []string{"queue", "-o", "wide"}, ExitOK},
		{"queue-json", []string{"queue", "-o", "json"}, ExitOK},
		{"devices", []string{"devices"}, ExitOK},
		{"devices-wide", []string{"devices", "-o", "wide"}, ExitOK},
		{"devices-json", []string{"devices", "-o", "json"}, ExitOK},
		{"audit", []string{"audit", "-n", "0"}, ExitOK},
		{"audit-tail", []string{"audit", "-n", "3"}, ExitOK},
		{"audit-since", []string{"audit", "--since", "4m"}, ExitOK},
		{"audit-json", []string{"audit", "-n", "4", "-o", "json"}, ExitOK},
		{"explain-busy", []string{"explain", "--env", "NVIDIA_VISIBLE_DEVICES=1", "--device", "/dev/nvidia4"}, ExitOK},
		{"explain-busy-json", []string{"explain", "--env", "NVIDIA_VISIBLE_DEVICES=1", "--device", "/dev/nvidia4", "-o", "json"}, ExitOK},
		{"explain-queued-json", []string{"explain", "--namespace", "team-g", "--pod", "w2", "--pod-uid", "uid-w2", "--container", "main",
			"--env", "NVIDIA_VISIBLE_DEVICES=0,1", "-o", "json"}, ExitOK},
		{"explain-free", []string{"explain", "--annotation", "cdi.k8s.io/gpu=nvidia.com/mig=0:0"}, ExitOK},
		{"explain-unknown", []string{"explain", "--env", "NVIDIA_VISIBLE_DEVICES=9"}, ExitOK},
		{"explain-none", []string{"explain", "--env", "NVIDIA_VISIBLE_DEVICES=none"}, ExitOK},
		{"check-config", []string{"check-config"}, ExitOK},
		{"check-config-json", []string{"check-config", "-o", "json"}, ExitOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := f.state(t)
			r := f.run(t, tc.args...)
			require.Equal(t, tc.code, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			require.Empty(t, r.stderr)
			if strings.HasSuffix(tc.name, "json") {
				require.True(t, json.Valid([]byte(r.stdout)), r.stdout)
			}
			got := f.normalize(r.stdout)
			if strings.HasPrefix(tc.name, "audit") {
				got = normalizeAuditPids(got)
			}
			golden(t, tc.name, got)
			// Read commands never write.
			require.Equal(t, before, f.state(t))
		})
	}
}

// TestStatusStates checks the state each device gets, independently of the
// golden rendering.
func TestStatusStates(t *testing.T) {
	f := newFixture(t)
	f.populate(t)
	r := f.run(t, "status", "-o", "json")
	require.Equal(t, ExitAttention, r.code, r.stderr)
	var out statusJSONForTest
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &out))
	got := map[string]string{}
	for _, d := range out.Devices {
		got[d.Index] = d.State
	}
	assert.Equal(t, map[string]string{
		"0":   stateHeld,     // its MIG instance 0:1 is claimed
		"0:0": stateFree,     // sibling MIG instances do not conflict
		"0:1": stateHeld,     // the hook container
		"1":   stateConflict, // held by the trainer, used by the rogue container
		"2":   stateHeld,     // holder exited: stale
		"3":   stateReserved, // released, held for the queue head
		"7":   stateHeld,     // not in the inventory
	}, got)
	kinds := map[string]string{}
	for _, p := range out.Problems {
		kinds[p.Index] = p.Kind
	}
	assert.Equal(t, map[string]string{"1": problemConflict, "2": problemHolderExited, "7": problemUnknownDevice}, kinds)
	for _, d := range out.Devices {
		switch d.Index {
		case "0":
			assert.Equal(t, uuidMIG1, d.HeldVia)
			require.NotNil(t, d.Holder)
			assert.Equal(t, idHook, d.Holder.ContainerID)
		case "3":
			require.NotNil(t, d.Reservation)
			assert.Equal(t, key(ownNext), d.Reservation.For)
		case "1":
			assert.Equal(t, 2, d.Waiters)
		}
	}
}

// statusRow is the row of device index in `status -o json`, field by field.
func statusRow(t *testing.T, f *fixture, index string) map[string]json.RawMessage {
	t.Helper()
	r := f.run(t, "status", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	var out struct {
		Devices []map[string]json.RawMessage `json:"devices"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &out))
	for _, row := range out.Devices {
		if string(row["index"]) == `"`+index+`"` {
			return row
		}
	}
	require.Failf(t, "no row", "device %s not in %s", index, r.stdout)
	return nil
}

// A free MIG instance of a GPU that the head of the queue asks for whole is
// kept for it (no other request is admitted on it): status shows it
// reserved for the head, with the GPU it waits for and no deadline.
func TestStatusShowsAnInstanceKeptForTheHead(t *testing.T) {
	f := newFixture(t)
	f.update(t, now.Add(-time.Minute), func(tx *ledger.Tx) {
		claim(t, tx, ownHook, `annotation cdi.k8s.io/gpu="nvidia.com/mig=0:1"`, f.dev(t, uuidMIG1))
		tx.Enqueue(key(ownW2), ownW2, []devices.Device{f.dev(t, uuidGPU0)})
	})
	row := statusRow(t, f, "0:0")
	assert.JSONEq(t, `"`+stateReserved+`"`, string(row["state"]))
	var kept map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(row["reservation"], &kept))
	require.NotNil(t, kept)
	assert.JSONEq(t, `"`+key(ownW2)+`"`, string(kept["for"]))
	assert.JSONEq(t, `"`+ownW2.ContainerID+`"`, string(kept["container_id"]))
	assert.JSONEq(t, `"`+uuidGPU0+`"`, string(kept["kept_for"]))
	assert.NotContains(t, kept, "since", "kept without a stored reservation: no deadline")
	assert.NotContains(t, kept, "until")

	r := f.run(t, "status")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Regexp(t, `(?m)^0:0 +MIG-a0a0a0a0 .* reserved +for team-g/w2/main \(first in line for 0\) `, r.stdout)
}

// A reservation on a GPU keeps its MIG instances from everyone else, and one
// on a MIG instance keeps its GPU: status shows both reserved, naming the
// reserved device, as explain says for a request of either.
func TestStatusShowsDevicesAReservationCovers(t *testing.T) {
	for _, tc := range []struct{ reserved, related string }{{uuidGPU0, "0:0"}, {uuidMIG0, "0"}} {
		f := newFixture(t)
		d := f.dev(t, tc.reserved)
		f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) { claim(t, tx, ownTrainer, "env", d) })
		f.update(t, now.Add(-5*time.Minute), func(tx *ledger.Tx) { tx.Enqueue(key(ownW1), ownW1, []devices.Device{d}) })
		f.update(t, now.Add(-time.Minute), func(tx *ledger.Tx) { tx.Release(idTrainer, "stop") })
		row := statusRow(t, f, tc.related)
		assert.JSONEq(t, `"`+stateReserved+`"`, string(row["state"]), "device %s is blocked by the reservation on %s", tc.related, tc.reserved)
		assert.JSONEq(t, `"`+tc.reserved+`"`, string(row["reserved_via"]))
		var res struct {
			For string `json:"for"`
		}
		require.NoError(t, json.Unmarshal(row["reservation"], &res))
		assert.Equal(t, key(ownW1), res.For)
		ex := f.run(t, "explain", "--env", "NVIDIA_VISIBLE_DEVICES="+tc.related, "-o", "json")
		assert.Contains(t, ex.stdout, `"reason": "reserved"`)
		r := f.run(t, "status")
		assert.Regexp(t, `(?m)^`+regexp.QuoteMeta(tc.related)+` .* reserved +for team-f/w1/main \(via `+regexp.QuoteMeta(d.Index)+`\) `, r.stdout)
	}
}

type statusJSONForTest struct {
	Devices []struct {
		Index   string `json:"index"`
		State   string `json:"state"`
		HeldVia string `json:"held_via"`
		Waiters int    `json:"waiters"`
		Holder  *struct {
			ContainerID string `json:"container_id"`
		} `json:"holder"`
		Reservation *struct {
			For string `json:"for"`
		} `json:"reservation"`
	} `json:"devices"`
	Problems []struct {
		Kind  string `json:"kind"`
		Index string `json:"index"`
	} `json:"problems"`
}

// TestStatusHealthy: nothing wrong is exit 0, and an empty (missing) ledger
// shows every device free.
func TestStatusHealthy(t *testing.T) {
	f := newFixture(t)
	r := f.run(t, "status")
	require.Equal(t, ExitOK, r.code, r.stderr)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	require.Len(t, lines, 1+6+2, r.stdout) // header + 4 GPUs + 2 MIG instances, a blank line, the summary
	for _, l := range lines[1:7] {
		assert.Contains(t, l, " free ")
	}
	assert.Equal(t, "6 devices: 6 free", lines[8])
	assert.NotContains(t, r.stdout, "ATTENTION")

	f.update(t, now.Add(-time.Minute), func(tx *ledger.Tx) {
		claim(t, tx, ownTrainer, "env", f.dev(t, uuidGPU1))
	})
	r = f.run(t, "status")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Regexp(t, `(?m)^1 +GPU-1b1b1b1b +NVIDIA A100-SXM4-80GB +held +team-a/trainer-0/main +a1a1a1a1a1a1 +1m +0$`, r.stdout)
}

// TestStatusWithoutInventory: without a cache and with a configuration that
// discovers nothing, status still shows the claims (from the ledger) and says
// why the rest is missing.
func TestStatusWithoutInventory(t *testing.T) {
	f := newFixture(t)
	f.populate(t)
	require.NoError(t, os.Remove(filepath.Join(f.dir, devices.CacheFile)))
	cfg := "version = 1\n[ledger]\ndir = \"" + f.dir + "\"\n[devices]\nsource = \"proc\"\nproc_root = \"" + t.TempDir() + "\"\n"
	require.NoError(t, os.WriteFile(f.config, []byte(cfg), 0o600))
	r := f.run(t, "status")
	assert.Contains(t, r.stderr, "showing claimed devices only")
	// Stale and conflict are still found; "not in the inventory" is not
	// claimed without an inventory.
	require.Equal(t, ExitAttention, r.code)
	assert.Contains(t, r.stdout, idTrainer[:12])
	assert.Contains(t, r.stdout, idGhost[:12])
	assert.NotContains(t, r.stdout, "0:0") // free devices are unknown
}

// TestStatusWithoutInventoryRows: with no inventory loaded, no device is
// said to be missing from it (the MODEL column says the inventory is
// unavailable), and the rows, from the ledger alone, come in index order
// (a GPU, then its MIG instances, numerically), not in the ledger's.
func TestStatusWithoutInventoryRows(t *testing.T) {
	wantOrder := []string{"0:1", "1", "2", "3", "7"}
	for _, tc := range []struct {
		name   string
		output string
	}{
		{name: "table", output: outputTable},
		{name: "wide", output: outputWide},
		{name: "json", output: outputJSON},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.populate(t)
			require.NoError(t, os.Remove(filepath.Join(f.dir, devices.CacheFile)))
			cfg := "version = 1\n[ledger]\ndir = \"" + f.dir + "\"\n[devices]\nsource = \"proc\"\nproc_root = \"" + t.TempDir() + "\"\n"
			require.NoError(t, os.WriteFile(f.config, []byte(cfg), 0o600))
			r := f.run(t, "status", "-o", tc.output)
			require.Equal(t, ExitAttention, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			assert.NotContains(t, r.stdout, "not in inventory")
			assert.NotContains(t, r.stdout, "not in the inventory")
			var order []string
			if tc.output == outputJSON {
				var v statusView
				require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
				assert.Empty(t, v.InventorySource)
				for _, d := range v.Devices {
					order = append(order, d.Index)
					assert.False(t, d.InInventory, "in_inventory is false: not known")
					assert.Empty(t, d.Model)
				}
			} else {
				lines := strings.Split(r.stdout, "\n")
				for _, line := range lines[1:] {
					if line == "" {
						break
					}
					order = append(order, strings.Fields(line)[0])
					assert.Contains(t, line, "(inventory unavailable)")
				}
			}
			assert.Equal(t, wantOrder, order)
		})
	}
}

// TestDevicesFromConfig: under devices.source = "static" the configured
// list is the inventory, whatever the daemon's cache says.
func TestDevicesFromConfig(t *testing.T) {
	f := newFixture(t)
	f.setSource(t, "static")
	other, err := devices.NewInventory("nvml", []devices.GPU{{Index: 0, UUID: uuidGone, Minor: 0}})
	require.NoError(t, err)
	require.NoError(t, devices.SaveCache(filepath.Join(f.dir, devices.CacheFile), other, bootID))
	for _, withCache := range []bool{true, false} {
		if !withCache {
			require.NoError(t, os.Remove(filepath.Join(f.dir, devices.CacheFile)))
		}
		r := f.run(t, "devices", "-o", "json")
		require.Equal(t, ExitOK, r.code, r.stderr)
		var v devicesView
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
		assert.Equal(t, "static", v.Source)
		assert.Equal(t, "config", v.Origin)
		assert.Nil(t, v.CachedAt)
		require.Len(t, v.GPUs, 4)
		assert.Equal(t, uuidMIG1, v.GPUs[0].MIG[1].UUID)
		// proc_root holds no driver tree: the list is used unchecked,
		// and said so.
		assert.Equal(t, devices.UncheckedNoDriver, v.Unchecked)
	}
	r := f.run(t, "devices")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "Source: static (configuration)\nNot checked against the NVIDIA driver: no driver tree under devices.proc_root")
	r = f.run(t, "status", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, `"inventory_source": "static"`, "no \"(cache)\" under a static source")
}

// TestDevicesDiscoveredWithoutCache: without the daemon's cache the GPUs are
// discovered as the daemon would (here "auto" ends at the static list: NVML
// fails, as on a machine without the library, whatever GPUs this one has).
func TestDevicesDiscoveredWithoutCache(t *testing.T) {
	f := newFixture(t)
	require.NoError(t, os.Remove(filepath.Join(f.dir, devices.CacheFile)))
	var stdout, stderr syncBuffer
	env := f.env(&stdout, &stderr)
	env.NVML = failingNVML()
	code := Run(context.Background(), []string{"--config", f.config, "devices", "-o", "json"}, env)
	r := result{code: code, stdout: stdout.String(), stderr: stderr.String()}
	require.Equal(t, ExitOK, r.code, r.stderr)
	var v devicesView
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	assert.Equal(t, "static", v.Source)
	assert.Equal(t, "discovery", v.Origin)
	require.Len(t, v.GPUs, 4)
	assert.Empty(t, r.stderr, "a missing cache is no warning")
}

// TestUntrustedCacheIgnored: a cache that someone other than root could have
// written is not read; the command says so and discovers instead.
func TestUntrustedCacheIgnored(t *testing.T) {
	f := newFixture(t)
	f.setSource(t, "proc") // proc_root has no GPUs: discovery fails
	cache := filepath.Join(f.dir, devices.CacheFile)
	require.NoError(t, os.Chmod(cache, 0o666))

	r := f.run(t, "devices")
	require.Equal(t, ExitError, r.code)
	assert.Contains(t, r.stderr, cache)
	assert.Contains(t, r.stderr, "writable by group or others")

	require.NoError(t, os.Chmod(cache, 0o600))
	r = f.run(t, "devices")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "Source: nvml (cache "+cache)
}

// TestDevicesRefresh: --refresh is root only and rewrites the cache.
func TestDevicesRefresh(t *testing.T) {
	f := newFixture(t)
	f.setSource(t, "static") // hermetic: NVML would find this machine's GPUs
	cache := filepath.Join(f.dir, devices.CacheFile)
	// The cache says "nvml"; the configuration says "static".
	f.uid = 1000
	r := f.run(t, "devices", "--refresh")
	require.Equal(t, ExitError, r.code)
	assert.Contains(t, r.stderr, "needs root")
	inv, err := devices.LoadCache(cache)
	require.NoError(t, err)
	assert.Equal(t, "nvml", inv.Source)

	f.uid = 0
	r = f.run(t, "devices", "--refresh")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.Contains(t, r.stdout, "Source: static (configuration)")
	inv, err = devices.LoadCache(cache)
	require.NoError(t, err)
	assert.Equal(t, "static", inv.Source)

	// A refresh never falls back to the cache it replaces.
	f.setSource(t, "proc") // proc_root has no GPUs
	r = f.run(t, "devices", "--refresh")
	require.Equal(t, ExitError, r.code)
	assert.Contains(t, r.stderr, "discover GPUs")
}

// TestStateDirFlag: --state-dir overrides [ledger] dir.
func TestStateDirFlag(t *testing.T) {
	f := newFixture(t)
	f.populate(t)
	other := newFixture(t) // same inventory, empty ledger
	r := f.run(t, "--state-dir", other.dir, "claims", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	assert.JSONEq(t, `{"claims":[]}`, r.stdout)
}

// badStateDirs are --state-dir values no command may take for the ledger's:
// the exit code and what the error says.
var badStateDirs = []struct {
	name string
	dir  func(f *fixture) string
	code int
	want string
}{
	{name: "missing", dir: func(f *fixture) string { return f.dir + "-typo" }, code: ExitError, want: "no such directory"},
	{name: "relative", dir: func(*fixture) string { return "state" }, code: ExitUsage, want: "want the absolute path"},
	{name: "a file", dir: func(f *fixture) string { return f.config }, code: ExitError, want: "not a directory"},
}

// TestStateDirFlagRefused: a --state-dir that cannot be the ledger's is
// refused by every command that reads the ledger, with one clear error and
// nothing else (no warning about the inventory cache that is not there
// either), and nothing is shown.
func TestStateDirFlagRefused(t *testing.T) {
	for _, dir := range badStateDirs {
		for _, args := range [][]string{{"status"}, {"status", "-o", "json"}, {"claims"}, {"queue"}, {"gc", "--dry-run"}} {
			t.Run(dir.name+"/"+strings.Join(args, " "), func(t *testing.T) {
				f := newFixture(t)
				f.populate(t)
				d := dir.dir(f)
				r := f.run(t, append([]string{"--state-dir", d}, args...)...)
				require.Equal(t, dir.code, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
				assert.Empty(t, r.stdout)
				assert.Contains(t, r.stderr, "--state-dir")
				assert.Contains(t, r.stderr, dir.want)
				assert.NotContains(t, r.stderr, "warning", "only the error")
			})
		}
	}
}

// TestConfigFromEnvironment: without --config, NRI_GPU_GUARD_CONFIG names the
// configuration.
func TestConfigFromEnvironment(t *testing.T) {
	f := newFixture(t)
	f.populate(t)
	f.getenv["NRI_GPU_GUARD_CONFIG"] = f.config
	var stdout, stderr syncBuffer
	code := Run(t.Context(), []string{"claims", "-o", "json"}, f.env(&stdout, &stderr))
	require.Equal(t, ExitOK, code, stderr.String())
	assert.Contains(t, stdout.String(), idTrainer)
}

// TestCorruptLedger: a state file that does not verify is an error that names
// the file and says what to do; nothing is moved by a reader.
func TestCorruptLedger(t *testing.T) {
	f := newFixture(t)
	f.populate(t)
	state := filepath.Join(f.dir, "ledger.json")
	require.NoError(t, os.WriteFile(state, []byte(`{"claims": [`), 0o600))
	for _, cmd := range []string{"status", "claims", "queue"} {
		r := f.run(t, cmd)
		require.Equal(t, ExitError, r.code, cmd)
		assert.Contains(t, r.stderr, state, cmd)
		assert.Contains(t, r.stderr, "corrupt", cmd)
		assert.Contains(t, r.stderr, "NO container gets a GPU until the ledger is recovered", cmd)
		assert.Contains(t, r.stderr, "sudo gpu-guard-ctl recover", cmd)
		assert.NotContains(t, r.stderr, "daemon moves it aside", cmd)
	}
	_, err := os.Stat(state)
	require.NoError(t, err, "a reader must not move the state file")
}

// TestCheckConfig covers valid, invalid, missing and default files.
func TestCheckConfig(t *testing.T) {
	f := newFixture(t)
	bad := filepath.Join(t.TempDir(), "bad.toml")
	require.NoError(t, os.WriteFile(bad, []byte("version = 1\n[policy]\non_conflict = \"wait\"\nqueue_ttl = \"-1s\"\n"), 0o600))
	unknown := filepath.Join(t.TempDir(), "unknown.toml")
	require.NoError(t, os.WriteFile(unknown, []byte("version = 1\n[policy]\non_conflcit = \"queue\"\n"), 0o600))

	for _, tc := range []struct {
		name string
		args []string
		code int
		want []string
	}{
		{"valid", []string{"check-config", f.config}, ExitOK, []string{"valid", "source auto, 4 static GPU(s)"}},
		{"invalid lists every problem", []string{"check-config", bad}, ExitError,
			[]string{"invalid (2 problem(s))", "policy.on_conflict", `"wait"`, "policy.queue_ttl"}},
		{"unknown key named", []string{"check-config", unknown}, ExitError, []string{"on_conflcit"}},
		{"missing file", []string{"check-config", filepath.Join(t.TempDir(), "nope.toml")}, ExitError, []string{"nope.toml", "no such file"}},
		{"too many args", []string{"check-config", "a", "b"}, ExitUsage, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr syncBuffer
			code := Run(t.Context(), tc.args, f.env(&stdout, &stderr))
			require.Equal(t, tc.code, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
			for _, w := range tc.want {
				assert.Contains(t, stdout.String(), w)
			}
		})
	}

	// JSON lists the problems one by one.
	var stdout, stderr syncBuffer
	require.Equal(t, ExitError, Run(t.Context(), []string{"check-config", bad, "-o", "json"}, f.env(&stdout, &stderr)))
	var v checkConfigView
	require.NoError(t, json.Unmarshal([]byte(stdout.String()), &v))
	assert.False(t, v.Valid)
	assert.Len(t, v.Errors, 2)
}

// TestVersion prints the build information in both formats.
func TestVersion(t *testing.T) {
	f := newFixture(t)
	r := f.run(t, "version")
	require.Equal(t, ExitOK, r.code)
	assert.True(t, strings.HasPrefix(r.stdout, "gpu-guard-ctl "), r.stdout)
	r = f.run(t, "version", "-o", "json")
	require.Equal(t, ExitOK, r.code)
	var v versionView
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	assert.Equal(t, "gpu-guard-ctl", v.Program)
	assert.NotEmpty(t, v.Go)
}

func TestAge(t *testing.T) {
	for _, tc := range []struct {
		d    time.Duration
		want string
	}{
		{-time.Second, "0s"},
		{0, "0s"},
		{59 * time.Second, "59s"},
		{time.Minute, "1m"},
		{59*time.Minute + 59*time.Second, "59m"},
		{time.Hour, "1h"},
		{47 * time.Hour, "47h"},
		{48 * time.Hour, "2d"},
		{729 * 24 * time.Hour, "729d"},
		{730 * 24 * time.Hour, "2y"},
	} {
		assert.Equal(t, tc.want, age(tc.d), tc.d)
	}
}

func TestCleanEscapesControlCharacters(t *testing.T) {
	assert.Equal(t, "-", clean(""))
	assert.Equal(t, "team-a/pod", clean("team-a/pod"))
	assert.Equal(t, `a\x1b[31mb\n`, clean("a\x1b[31mb\n"))
	assert.Equal(t, `a\tb`, clean("a\tb"))
}

func TestShortUUID(t *testing.T) {
	assert.Equal(t, "GPU-0a0a0a0a", shortUUID(uuidGPU0))
	assert.Equal(t, "MIG-a1a1a1a1", shortUUID(uuidMIG1))
	assert.Equal(t, "weird", shortUUID("weird"))
}

func TestCompareIndex(t *testing.T) {
	idx := []string{"10", "1:1", "2", "1", "0:0", "1:0", "0", "x"}
	slices.SortFunc(idx, compareIndex)
	assert.Equal(t, []string{"0", "0:0", "1", "1:0", "1:1", "2", "10", "x"}, idx)
}

// TestAuditWide shows the writer's pid and the generation of each record.
func TestAuditWide(t *testing.T) {
	f := newFixture(t)
	f.populate(t)
	r := f.run(t, "audit", "-o", "wide", "-n", "1")
	require.Equal(t, ExitOK, r.code, r.stderr)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	require.Len(t, lines, 2)
	assert.Regexp(t, `^TIME +OP +DEVICES +HOLDER +CONTAINER ID +KEY +FRONT END +GENERATION +PID +REASON$`, lines[0])
	assert.Regexp(t, `^2026-03-01T11:58:00Z +reserve +`+uuidGPU3+` +team-e/next/train +`+ownNext.ContainerID+` +team-e/uid-next/train +nri +\d+ +`+strconv.Itoa(os.Getpid())+` +head of the queue`, lines[1])
}

// TestExplainSpec: --spec reads an OCI config.json, flags add to it, and
// nothing is written.
func TestExplainSpec(t *testing.T) {
	f := newFixture(t)
	spec := filepath.Join(t.TempDir(), "config.json")
	require.NoError(t, os.WriteFile(spec, []byte(`{"ociVersion":"1.2.0",
		"process":{"env":["PATH=/bin","NVIDIA_VISIBLE_DEVICES=2"]},
		"linux":{"devices":[{"path":"/dev/nvidia4","type":"c","major":195,"minor":4}]}}`), 0o600))
	r := f.run(t, "explain", "--spec", spec, "--cdi", "nvidia.com/gpu=1", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	var v explainView
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	assert.Equal(t, "admit", string(v.Decision))
	got := map[string]string{}
	for _, d := range v.Devices {
		got[d.Index] = strings.Join(d.Sources, "; ")
	}
	assert.Equal(t, map[string]string{
		"1": `cdi "nvidia.com/gpu=1"`,
		"2": `env NVIDIA_VISIBLE_DEVICES="2"`,
		"3": "device /dev/nvidia4 (195:4)",
	}, got)
	assert.Empty(t, f.state(t).Claims, "explain never claims")

	r = f.run(t, "explain", "--spec", filepath.Join(t.TempDir(), "missing.json"))
	require.Equal(t, ExitError, r.code)
	assert.Contains(t, r.stderr, "--spec")

	// A spec runc and crun read in two ways (crun takes the first "linux",
	// runc the last) is refused, as the hook refuses it: neither reading is
	// shown.
	require.NoError(t, os.WriteFile(spec, []byte(`{"ociVersion":"1.2.0","process":{"env":["PATH=/bin"]},
		"linux":{"devices":[{"path":"/dev/nvidia4","type":"c","major":195,"minor":4}]},"linux":{}}`), 0o600))
	r = f.run(t, "explain", "--spec", spec)
	require.Equal(t, ExitError, r.code, r.stdout)
	assert.Contains(t, r.stderr, `ambiguous key "linux"`)
}

// TestExplainNoDeviceCgroup: --no-device-cgroup reads the --spec container
// as the OCI hook reads one a rootful runtime runs without a device cgroup:
// with CAP_MKNOD (or without a capabilities object, which counts as every
// capability) it reaches every GPU, named for why; without the flag (or
// without CAP_MKNOD) it reaches none. The flag needs --spec.
func TestExplainNoDeviceCgroup(t *testing.T) {
	f := newFixture(t)
	spec := func(caps string) string {
		p := filepath.Join(t.TempDir(), "config.json")
		require.NoError(t, os.WriteFile(p, []byte(`{"ociVersion":"1.2.0",
		"process":{"env":["PATH=/bin"],"capabilities":{"bounding":[`+caps+`]}}}`), 0o600))
		return p
	}
	devicesOf := func(args ...string) []string {
		t.Helper()
		r := f.run(t, append([]string{"explain", "-o", "json"}, args...)...)
		require.Equal(t, ExitOK, r.code, r.stderr)
		var v explainView
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
		var got []string
		for _, d := range v.Devices {
			got = append(got, d.Index)
			assert.Equal(t, []string{"no device cgroup (host /dev bound in, or CAP_MKNOD or CAP_SYS_ADMIN)"}, d.Sources)
		}
		return got
	}
	mknod := spec(`"CAP_CHOWN","CAP_MKNOD"`)
	assert.Empty(t, devicesOf("--spec", mknod), "a device cgroup stops the nodes it makes")
	assert.Len(t, devicesOf("--spec", mknod, "--no-device-cgroup"), len(f.inv.GPUs), "without one it reaches every GPU")
	assert.Empty(t, devicesOf("--spec", spec(`"CAP_CHOWN"`), "--no-device-cgroup"), "nothing to make a node with")
	// Without a capabilities object recent runc leaves the process its
	// own, root's: CAP_MKNOD among them.
	noCaps := filepath.Join(t.TempDir(), "config.json")
	require.NoError(t, os.WriteFile(noCaps, []byte(`{"ociVersion":"1.2.0","process":{"env":["PATH=/bin"]}}`), 0o600))
	assert.Empty(t, devicesOf("--spec", noCaps), "a device cgroup stops the nodes it makes")
	assert.Len(t, devicesOf("--spec", noCaps, "--no-device-cgroup"), len(f.inv.GPUs), "no capabilities object: every capability")

	r := f.run(t, "explain", "--no-device-cgroup")
	require.Equal(t, ExitUsage, r.code)
	assert.Contains(t, r.stderr, "give --spec")
}

// TestExplainCapNode: --device takes MIG capability nodes whether or not the
// inventory knows the nvidia-caps numbers, and a known mapping narrows the
// claim from the whole GPU to the MIG instance the node opens.
func TestExplainCapNode(t *testing.T) {
	args := []string{"explain", "--device", "/dev/nvidia0", "--device", "/dev/nvidia-caps/nvidia-cap12", "-o", "json"}
	explain := func(t *testing.T, f *fixture) explainView {
		t.Helper()
		r := f.run(t, args...)
		require.Equal(t, ExitOK, r.code, r.stderr)
		var v explainView
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
		return v
	}

	t.Run("mapping unknown: the whole GPU", func(t *testing.T) {
		v := explain(t, newFixture(t))
		require.Len(t, v.Devices, 1)
		assert.Equal(t, uuidGPU0, v.Devices[0].UUID)
		assert.True(t, slices.ContainsFunc(v.Notes, func(n string) bool { return strings.Contains(n, "no known mapping") }), v.Notes)
	})

	t.Run("mapping known: that MIG instance", func(t *testing.T) {
		f := newFixture(t)
		withCaps := *f.inv
		withCaps.CapsMajor = 508
		withCaps.MIGCaps = []devices.MIGCap{{Minor: 12, Kind: devices.CapCIAccess, GPUMinor: 0, GI: 1, CI: 0}}
		data, err := json.Marshal(&withCaps)
		require.NoError(t, err)
		var inv devices.Inventory
		require.NoError(t, json.Unmarshal(data, &inv))
		require.NoError(t, devices.SaveCache(filepath.Join(f.dir, devices.CacheFile), &inv, bootID))

		v := explain(t, f)
		require.Len(t, v.Devices, 1)
		assert.Equal(t, uuidMIG0, v.Devices[0].UUID)
		assert.Contains(t, v.Devices[0].Sources, "device /dev/nvidia-caps/nvidia-cap12 (508:12)")
	})
}

// jsonKeys collects every object key of a JSON document, at any depth.
func jsonKeys(v any, into map[string]bool) {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			into[k] = true
			jsonKeys(e, into)
		}
	case []any:
		for _, e := range x {
			jsonKeys(e, into)
		}
	}
}

// TestJSONFieldsDocumented: every field any command prints with -o json is
// documented in docs/ctl-json.md, the public reference scripts are written
// against, so that the two cannot drift apart.
func TestJSONFieldsDocumented(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "ctl-json.md"))
	require.NoError(t, err)
	f := newFixture(t)
	f.populate(t)
	f.liveness[idStale] = "cgroup gone"
	for _, args := range [][]string{
		{"status"}, {"claims"}, {"queue"}, {"devices"}, {"audit", "-n", "0"},
		{"explain", "--env", "NVIDIA_VISIBLE_DEVICES=0,1", "--privileged"},
		{"explain", "--namespace", "team-g", "--pod", "w2", "--pod-uid", "uid-w2", "--container", "main", "--env", "NVIDIA_VISIBLE_DEVICES=0,1"},
		{"release", "--container", idTrainer, "--reason", "x", "--dry-run", "--force"},
		{"release", "--container", key(ownW1), "--reason", "x", "--dry-run"},
		{"gc", "--dry-run"}, {"check-config"}, {"version"},
	} {
		r := f.run(t, append(args, "-o", "json")...)
		require.Contains(t, []int{ExitOK, ExitAttention}, r.code, "%v: %s", args, r.stderr)
		var v any
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &v), "%v", args)
		keys := map[string]bool{}
		jsonKeys(v, keys)
		require.NotEmpty(t, keys)
		for k := range keys {
			assert.True(t, strings.Contains(string(doc), `"`+k+`"`) || strings.Contains(string(doc), "`"+k+"`"),
				"%v prints field %q, which docs/ctl-json.md does not document", args, k)
		}
	}
}

// TestDevicesCachedAtIsUTC: devices -o json gives the inventory cache's
// time, the file's modification time in the host's zone, in UTC, as every
// time ctl prints (docs/ctl-json.md). Before, a host outside UTC got
// "…+01:00": only the observer's times were converted.
func TestDevicesCachedAtIsUTC(t *testing.T) {
	was := time.Local
	time.Local = time.FixedZone("CET", 3600)
	defer func() { time.Local = was }()
	f := newFixture(t)
	r := f.run(t, "devices", "-o", "json")
	require.Equal(t, ExitOK, r.code, r.stderr)
	var v struct {
		CachedAt string `json:"cached_at"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	assert.Equal(t, "2026-02-28T10:00:00Z", v.CachedAt)
}
