// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package config

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestEmptyDocumentIsDefault(t *testing.T) {
	for _, doc := range []string{"", "  \n", "# only a comment\n", "version = 1\n"} {
		cfg, err := Parse([]byte(doc))
		require.NoError(t, err, "doc %q", doc)
		require.Equal(t, Default(), cfg, "doc %q", doc)
	}
}

func TestDefaultValidates(t *testing.T) {
	cfg := Default()
	require.NoError(t, cfg.Validate())
}

func TestLoadOverridesOnlyNamedKeys(t *testing.T) {
	cfg, err := Load(strings.NewReader(`
version = 1
[ledger]
dir = "/run/gg"
lock_timeout = "250ms"
[devices]
source = "static"
[[devices.static]]
index = 0
uuid = "GPU-6c1a2f2e-0000-4000-8000-000000000000"
minor = 3
model = "NVIDIA H100 80GB HBM3"
memory_mib = 81559
  [[devices.static.mig]]
  index = 0
  uuid = "MIG-6c1a2f2e-0000-4000-8000-0000000000a0"
  gi = 1
  ci = 0
[policy]
on_conflict = "reject"
release_on = "remove"
exempt_namespaces = ["gpu-monitoring"]
swarm_resource_envvars = ["DOCKER_RESOURCE_NVIDIA-GPU"]
[hook]
poll_interval = "100ms"
[metrics]
listen = "127.0.0.1:9464"
`))
	require.NoError(t, err)
	want := Default()
	want.Ledger.Dir = "/run/gg"
	want.Ledger.LockTimeout = Duration{250 * time.Millisecond}
	want.Devices.Source = SourceStatic
	want.Devices.Static = []StaticGPU{{
		Index: 0, UUID: "GPU-6c1a2f2e-0000-4000-8000-000000000000", Minor: 3,
		Model: "NVIDIA H100 80GB HBM3", MemoryMiB: 81559,
		MIG: []StaticMIG{{Index: 0, UUID: "MIG-6c1a2f2e-0000-4000-8000-0000000000a0", GI: 1, CI: 0}},
	}}
	want.Policy.OnConflict = ConflictReject
	want.Policy.ReleaseOn = ReleaseOnRemove
	want.Policy.ExemptNamespaces = []string{"gpu-monitoring"}
	want.Policy.SwarmResourceEnvvars = []string{"DOCKER_RESOURCE_NVIDIA-GPU"}
	want.Hook.PollInterval = Duration{100 * time.Millisecond}
	want.Metrics.Listen = "127.0.0.1:9464"
	require.Equal(t, want, cfg)
}

func TestUnknownKeysAreNamed(t *testing.T) {
	_, err := Parse([]byte("version = 1\n[policy]\non_confilct = \"queue\"\n[ledgr]\ndir = \"/x\"\n"))
	require.ErrorIs(t, err, ErrUnknownKey)
	require.Contains(t, err.Error(), "policy.on_confilct")
	require.Contains(t, err.Error(), "ledgr")
}

func TestSyntaxErrorIsReported(t *testing.T) {
	_, err := Parse([]byte("version = = 1"))
	require.Error(t, err)
	require.Contains(t, err.Error(), "parse configuration")
}

func TestBadDurationNamesValue(t *testing.T) {
	_, err := Parse([]byte("[policy]\nreservation_ttl = \"6 minutes\"\n"))
	require.Error(t, err)
	require.Contains(t, err.Error(), `"6 minutes"`)
	require.Contains(t, err.Error(), "policy.reservation_ttl")
}

func TestValidateMessages(t *testing.T) {
	const gpu0 = "GPU-6c1a2f2e-0000-4000-8000-000000000000"
	const gpu1 = "GPU-6c1a2f2e-0000-4000-8000-000000000001"
	tests := []struct {
		name  string
		edit  func(*Config)
		wants []string
	}{
		{"version", func(c *Config) { c.Version = 2 }, []string{"version: unsupported version 2"}},
		{"relative dir", func(c *Config) { c.Ledger.Dir = "state" }, []string{"ledger.dir", `"state"`}},
		{"zero lock timeout", func(c *Config) { c.Ledger.LockTimeout = Duration{} }, []string{"ledger.lock_timeout", "between 1ms and 1h0m0s", `"0s"`}},
		{"nanosecond poll", func(c *Config) { c.Hook.PollInterval = Duration{time.Nanosecond} }, []string{"hook.poll_interval", `"1ns"`, "between 1ms"}},
		{"huge durations", func(c *Config) {
			huge := Duration{2562047 * time.Hour}
			c.Ledger.LockTimeout, c.Policy.ReservationTTL, c.Policy.QueueTTL, c.Hook.WaitTimeout, c.Observe.Interval =
				huge, huge, huge, huge, huge
		}, []string{"ledger.lock_timeout", "policy.reservation_ttl", "policy.queue_ttl", "hook.wait_timeout", "observe.interval", `"2562047h0m0s"`}},
		{"ledger dir is /", func(c *Config) { c.Ledger.Dir = "/" }, []string{"ledger.dir", "system directory /"}},
		{"ledger dir climbs into /etc", func(c *Config) { c.Ledger.Dir = "/var/../etc" }, []string{"ledger.dir", `"/var/../etc" is the system directory /etc`}},
		{"ledger dir is /var/lib/", func(c *Config) { c.Ledger.Dir = "/var/lib/" }, []string{"ledger.dir", "system directory /var/lib"}},
		{"ledger dir is /tmp", func(c *Config) { c.Ledger.Dir = "/tmp" }, []string{"ledger.dir", "system directory /tmp"}},
		{"ledger dir in /proc", func(c *Config) { c.Ledger.Dir = "/proc/self/cwd" }, []string{"ledger.dir", "kernel file system (/proc)"}},
		{"tiny audit", func(c *Config) { c.Ledger.AuditMaxBytes = 10 }, []string{"ledger.audit_max_bytes"}},
		{"bad source", func(c *Config) { c.Devices.Source = "nvidia-smi" }, []string{"devices.source", `"nvidia-smi"`, "auto, nvml, proc, static"}},
		{"static without gpus", func(c *Config) { c.Devices.Source = SourceStatic }, []string{"devices.static", "no [[devices.static]]"}},
		{"bad enum", func(c *Config) { c.Policy.OnConflict = "queu" }, []string{"policy.on_conflict", `"queu"`, "queue, reject"}},
		{"release_on", func(c *Config) { c.Policy.ReleaseOn = "exit" }, []string{"policy.release_on"}},
		{"all_devices", func(c *Config) { c.Policy.AllDevices = "allow" }, []string{"policy.all_devices"}},
		{"privileged", func(c *Config) { c.Policy.Privileged = "deny" }, []string{"policy.privileged"}},
		{"unknown_device", func(c *Config) { c.Policy.UnknownDevice = "warn" }, []string{"policy.unknown_device"}},
		{"negative ttl", func(c *Config) { c.Policy.QueueTTL = Duration{-time.Second} }, []string{"policy.queue_ttl"}},
		{"dup namespace", func(c *Config) { c.Policy.ExemptNamespaces = []string{"a", "a"} }, []string{"exempt_namespaces[1]", "twice"}},
		{"swarm variable with =", func(c *Config) { c.Policy.SwarmResourceEnvvars = []string{"DOCKER_RESOURCE_GPU=1"} },
			[]string{"policy.swarm_resource_envvars[0]", "not an environment variable name"}},
		{"empty swarm variable", func(c *Config) { c.Policy.SwarmResourceEnvvars = []string{"DOCKER_RESOURCE_A", ""} }, []string{"policy.swarm_resource_envvars[1]"}},
		{"dup swarm variable", func(c *Config) { c.Policy.SwarmResourceEnvvars = []string{"DOCKER_RESOURCE_A", "DOCKER_RESOURCE_A"} }, []string{"swarm_resource_envvars[1]", "twice"}},
		{"swarm variable without Docker's prefix", func(c *Config) { c.Policy.SwarmResourceEnvvars = []string{"GPU_LIST"} },
			[]string{"policy.swarm_resource_envvars[0]", `"GPU_LIST" does not start with DOCKER_RESOURCE_`}},
		{"too many swarm variables", func(c *Config) {
			for i := range 17 {
				c.Policy.SwarmResourceEnvvars = append(c.Policy.SwarmResourceEnvvars, fmt.Sprintf("DOCKER_RESOURCE_V%d", i))
			}
		}, []string{"policy.swarm_resource_envvars", "17 names listed, at most 16"}},
		{"plugin index", func(c *Config) { c.NRI.PluginIndex = "9" }, []string{"nri.plugin_index", `"9"`}},
		{"plugin name", func(c *Config) { c.NRI.PluginName = "90-gpu guard" }, []string{"nri.plugin_name"}},
		{"poll longer than wait", func(c *Config) { c.Hook.PollInterval = Duration{time.Hour} }, []string{"hook.poll_interval", "longer than hook.wait_timeout"}},
		{"metrics listen", func(c *Config) { c.Metrics.Listen = "9464" }, []string{"metrics.listen", `"9464"`}},
		{"exempt namespace with a space", func(c *Config) { c.Policy.ExemptNamespaces = []string{" gpu-monitoring"} }, []string{"policy.exempt_namespaces[0]", `" gpu-monitoring"`, "not a Kubernetes namespace name"}},
		{"exempt namespace with capitals", func(c *Config) { c.Policy.ExemptNamespaces = []string{"kube-system", "GPU-Monitoring"} }, []string{"policy.exempt_namespaces[1]"}},
		{"metrics port not a number", func(c *Config) { c.Metrics.Listen = "127.0.0.1:abc" }, []string{"metrics.listen", `port "abc"`, "1 to 65535"}},
		{"metrics port out of range", func(c *Config) { c.Metrics.Listen = ":99999" }, []string{"metrics.listen", `port "99999"`}},
		{"metrics port zero", func(c *Config) { c.Metrics.Listen = "127.0.0.1:0" }, []string{"metrics.listen", `port "0"`}},
		{"relative runtime root", func(c *Config) { c.Hook.RuntimeRoots = []string{"run/runc"} }, []string{"hook.runtime_roots[0]", "absolute", `"run/runc"`}},
		{"empty runtime root", func(c *Config) { c.Hook.RuntimeRoots = []string{"/run/runc", ""} }, []string{"hook.runtime_roots[1]", "absolute"}},
		{"unclean runtime root", func(c *Config) { c.Hook.RuntimeRoots = []string{"/run/../run/crun/"} }, []string{"hook.runtime_roots[0]", "not a clean path", `"/run/crun"`}},
		{"dup runtime root", func(c *Config) { c.Hook.RuntimeRoots = []string{"/run/runc", "/run/runc"} }, []string{"hook.runtime_roots[1]", "twice"}},
		{"negative observe interval", func(c *Config) { c.Observe.Interval = Duration{-time.Second} }, []string{"observe.interval", "0 disables"}},
		{"tiny observe interval", func(c *Config) { c.Observe.Interval = Duration{time.Millisecond} }, []string{"observe.interval", "between 1s and 1h0m0s"}},
		{"on_intruder", func(c *Config) { c.Observe.OnIntruder = "kill" }, []string{"observe.on_intruder", `"kill"`, "report, cordon"}},
		{"zero idle grace", func(c *Config) { c.Observe.IdleGrace = Duration{} }, []string{"observe.idle_grace", "positive"}},
		{"unbounded idle grace", func(c *Config) { c.Observe.IdleGrace = Duration{2 * time.Hour} }, []string{"observe.idle_grace", "at most 1h0m0s"}},
		{"bad xid", func(c *Config) { c.Observe.Xids = []int{48, 0} }, []string{"observe.xids[1]", "Xid 0 is out of range"}},
		{"duplicate xid", func(c *Config) { c.Observe.Xids = []int{79, 79} }, []string{"observe.xids[1]", "Xid 79 is listed twice"}},
		{"bad uuid", func(c *Config) {
			c.Devices.Static = []StaticGPU{{UUID: "gpu0"}}
		}, []string{"devices.static[0].uuid", `"gpu0"`}},
		{"duplicate static uuid", func(c *Config) {
			c.Devices.Static = []StaticGPU{{Index: 0, UUID: gpu0, Minor: 0}, {Index: 1, UUID: gpu0, Minor: 1}}
		}, []string{"devices.static[1].uuid", "already used by devices.static[0]"}},
		{"duplicate index and minor", func(c *Config) {
			c.Devices.Static = []StaticGPU{{Index: 0, UUID: gpu0, Minor: 0}, {Index: 0, UUID: gpu1, Minor: 0}}
		}, []string{"devices.static[1].index", "devices.static[1].minor"}},
		{"modeset minor", func(c *Config) {
			c.Devices.Static = []StaticGPU{{Index: 0, UUID: gpu0, Minor: 255}}
		}, []string{"devices.static[0].minor", "between 0 and 253"}},
		{"mig uuid", func(c *Config) {
			c.Devices.Static = []StaticGPU{{UUID: gpu0, MIG: []StaticMIG{{UUID: gpu1}}}}
		}, []string{"devices.static[0].mig[0].uuid", "not a MIG UUID"}},
		{"duplicate mig instance", func(c *Config) {
			c.Devices.Static = []StaticGPU{{UUID: gpu0, MIG: []StaticMIG{
				{Index: 0, UUID: "MIG-6c1a2f2e-0000-4000-8000-000000000000", GI: 1, CI: 0},
				{Index: 1, UUID: "MIG-6c1a2f2e-0000-4000-8000-000000000001", GI: 1, CI: 0},
			}}}
		}, []string{"devices.static[0].mig[1]", "gi=1 ci=0 is already used by devices.static[0].mig[0]"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := Default()
			tt.edit(&cfg)
			err := cfg.Validate()
			require.ErrorIs(t, err, ErrInvalid)
			for _, w := range tt.wants {
				require.Contains(t, err.Error(), w)
			}
		})
	}
}

func TestValidateReportsAllProblems(t *testing.T) {
	cfg := Default()
	cfg.Policy.OnConflict = "x"
	cfg.NRI.PluginIndex = "x"
	err := cfg.Validate()
	require.Contains(t, err.Error(), "policy.on_conflict")
	require.Contains(t, err.Error(), "nri.plugin_index")
}

func TestLoadFileAndPath(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "config.toml")
	require.NoError(t, os.WriteFile(path, []byte("[policy]\non_conflict = \"reject\"\n"), 0o600))

	cfg, err := LoadFile(path)
	require.NoError(t, err)
	require.Equal(t, ConflictReject, cfg.Policy.OnConflict)

	_, err = LoadFile(filepath.Join(dir, "missing.toml"))
	require.ErrorIs(t, err, os.ErrNotExist)

	t.Setenv(EnvPath, "")
	p, explicit := Path("")
	require.Equal(t, DefaultPath, p)
	require.False(t, explicit)

	t.Setenv(EnvPath, path)
	p, explicit = Path("")
	require.Equal(t, path, p)
	require.True(t, explicit)
	p, _ = Path("/flag/wins.toml")
	require.Equal(t, "/flag/wins.toml", p)

	cfg, used, err := LoadDefault("")
	require.NoError(t, err)
	require.Equal(t, path, used)
	require.Equal(t, ConflictReject, cfg.Policy.OnConflict)

	// An explicitly named file that is missing is an error, not the defaults.
	_, _, err = LoadDefault(filepath.Join(dir, "missing.toml"))
	require.True(t, errors.Is(err, os.ErrNotExist))
}

func TestOversizedDocumentRefused(t *testing.T) {
	big := strings.Repeat("# padding\n", maxConfigBytes/10+10)
	_, err := Load(strings.NewReader(big))
	require.Error(t, err)
	require.Contains(t, err.Error(), "larger than")
}

func TestDurationRoundTrip(t *testing.T) {
	d := Duration{90 * time.Second}
	text, err := d.MarshalText()
	require.NoError(t, err)
	var back Duration
	require.NoError(t, back.UnmarshalText(text))
	require.Equal(t, d, back)
}

// TestRuntimeRoots: the default lists runc's and crun's roots; a document
// replaces the list, and an empty list turns the scan off.
func TestRuntimeRoots(t *testing.T) {
	require.Equal(t, []string{"/run/runc", "/run/crun", "/run/user/0/crun"}, Default().Hook.RuntimeRoots)
	cfg, err := Parse([]byte("version = 1\n[hook]\nruntime_roots = [\"/run/containerd/runc/k8s.io\"]\n"))
	require.NoError(t, err)
	require.Equal(t, []string{"/run/containerd/runc/k8s.io"}, cfg.Hook.RuntimeRoots)
	cfg, err = Parse([]byte("version = 1\n[hook]\nruntime_roots = []\n"))
	require.NoError(t, err)
	require.Empty(t, cfg.Hook.RuntimeRoots)
}

func TestObserveKeys(t *testing.T) {
	cfg, err := Parse([]byte(`
[observe]
interval = "0s"
on_intruder = "cordon"
release_requires_idle = true
idle_grace = "30s"
xids = []
`))
	require.NoError(t, err)
	require.Zero(t, cfg.Observe.Interval.Duration, "0 disables the accounting")
	require.Equal(t, IntruderCordon, cfg.Observe.OnIntruder)
	require.True(t, cfg.Observe.ReleaseRequiresIdle)
	require.Equal(t, 30*time.Second, cfg.Observe.IdleGrace.Duration)
	require.Empty(t, cfg.Observe.Xids, "an empty list is kept, not replaced by the default")

	def := Default().Observe
	require.Equal(t, 10*time.Second, def.Interval.Duration)
	require.Equal(t, IntruderReport, def.OnIntruder)
	require.False(t, def.ReleaseRequiresIdle)
	require.Contains(t, def.Xids, 79, "fallen off the bus is critical by default")
	for _, app := range []int{13, 31, 43, 45, 68, 109} {
		require.NotContains(t, def.Xids, app, "application Xid %d must not mark a GPU unhealthy", app)
	}
	// DefaultXids hands out a fresh slice: editing one configuration's list
	// must not change another's default.
	a := DefaultXids()
	a[0] = 1
	require.NotEqual(t, 1, DefaultXids()[0])
}

// A FIFO (or any non-regular file) given as the configuration is refused at
// once: opening a FIFO without a writer used to block forever.
func TestLoadFileRefusesNonRegularFiles(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "config.fifo")
	require.NoError(t, syscall.Mkfifo(fifo, 0o600))
	for path, kind := range map[string]string{fifo: "named pipe (FIFO)", dir: "directory", "/dev/null": "character device"} {
		_, err := LoadFile(path)
		require.ErrorIs(t, err, ErrNotRegular, path)
		assert.Contains(t, err.Error(), kind)
		_, _, err = LoadDefault(path)
		require.ErrorIs(t, err, ErrNotRegular, path)
	}
	// A symlink to a regular file is a regular file.
	file := filepath.Join(dir, "config.toml")
	require.NoError(t, os.WriteFile(file, []byte("version = 1\n"), 0o600))
	link := filepath.Join(dir, "link.toml")
	require.NoError(t, os.Symlink(file, link))
	_, err := LoadFile(link)
	require.NoError(t, err)
}

func TestWarnings(t *testing.T) {
	cfg := Default()
	assert.Empty(t, cfg.Warnings(), "the defaults open no endpoint")
	assert.Empty(t, cfg.Metrics.Listen)
	for _, listen := range []string{"127.0.0.1:9464", "[::1]:9464", "localhost:9464"} {
		cfg.Metrics.Listen = listen
		require.NoError(t, cfg.Validate())
		assert.Empty(t, cfg.Warnings(), listen)
	}
	for listen, want := range map[string]string{
		"0.0.0.0:9464":  "listens on every address",
		":9464":         "listens on every address",
		"[::]:9464":     "listens on every address",
		"10.0.0.7:9464": `"10.0.0.7" is reachable from other hosts`,
		"node-1:9464":   `"node-1" is reachable from other hosts`,
	} {
		cfg.Metrics.Listen = listen
		require.NoError(t, cfg.Validate(), "a warning is not an error")
		w := cfg.Warnings()
		require.Len(t, w, 1, listen)
		assert.Contains(t, w[0], "metrics.listen: ")
		assert.Contains(t, w[0], want)
		assert.Contains(t, w[0], "no authentication")
	}
	cfg = Default()
	cfg.Policy.ExemptNamespaces = []string{"gpu-monitoring"}
	require.Len(t, cfg.Warnings(), 1)
	assert.Contains(t, cfg.Warnings()[0], "OCI hook are never exempt")

	// A poll as long as half a TTL: the waiter renews its place only when
	// it polls, so it may be dropped, or lose its reservation, in between.
	// (Such a TTL is always below the kubelet's back-off too: a poll is at
	// most a minute.)
	pollWarnings := func() []string {
		return slices.DeleteFunc(cfg.Warnings(), func(w string) bool { return !strings.HasPrefix(w, "hook.poll_interval: ") })
	}
	cfg = Default()
	cfg.Hook.PollInterval = Duration{time.Minute}
	assert.Empty(t, cfg.Warnings(), "a minute's poll under the default TTLs (15m, 6m)")
	cfg.Policy.ReservationTTL = Duration{2 * time.Minute}
	assert.Empty(t, pollWarnings(), "a poll of half the reservation_ttl")
	cfg.Policy.ReservationTTL = Duration{90 * time.Second}
	assert.Equal(t, []string{"hook.poll_interval: 1m0s is longer than half of policy.reservation_ttl (1m30s): a waiting hook or " +
		"`gpu-guard-ctl run` renews its place only when it polls, and may lose the GPU reserved for it between two polls; " +
		"keep poll_interval under a quarter of policy.reservation_ttl"}, pollWarnings())
	cfg.Policy.QueueTTL = Duration{time.Minute}
	ws := pollWarnings()
	require.Len(t, ws, 2)
	assert.Contains(t, ws[0], "half of policy.queue_ttl (1m0s)")
	assert.Contains(t, ws[0], "be dropped from the queue between two polls")

	// One hook per container under release_requires_idle: each handover
	// is refused while the drain that only the next request starts runs.
	cfg = Default()
	cfg.Hook.Poststop = false
	assert.Empty(t, cfg.Warnings(), "one hook alone is no risk")
	cfg.Observe.ReleaseRequiresIdle = true
	require.Len(t, cfg.Warnings(), 1)
	assert.Contains(t, cfg.Warnings()[0], "hook.poststop: false with observe.release_requires_idle = true")
	cfg.Hook.Poststop = true
	assert.Empty(t, cfg.Warnings())

	// Cordoning intruders with the accounting off: valid, but said.
	cfg = Default()
	cfg.Observe.OnIntruder, cfg.Observe.Interval = IntruderCordon, Duration{}
	require.NoError(t, cfg.Validate())
	require.Len(t, cfg.Warnings(), 1)
	assert.Contains(t, cfg.Warnings()[0], "observe.on_intruder")

	// TTLs the kubelet's back-off outlasts: valid, but said.
	cfg = Default()
	cfg.Policy.ReservationTTL = Duration{5 * time.Minute}
	cfg.Policy.QueueTTL = Duration{10 * time.Second}
	require.NoError(t, cfg.Validate())
	w := cfg.Warnings()
	require.Len(t, w, 2)
	assert.Contains(t, w[0], "policy.reservation_ttl: 5m0s is not longer than the kubelet's 5m0s maximum back-off")
	assert.Contains(t, w[1], "policy.queue_ttl: 10s")
	cfg.Policy.ReservationTTL, cfg.Policy.QueueTTL = Duration{5*time.Minute + time.Second}, Duration{6 * time.Minute}
	assert.Empty(t, cfg.Warnings())
}
