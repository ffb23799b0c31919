// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package packaging

import (
	"bufio"
	"bytes"
	"encoding"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/BurntSushi/toml"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hookserve"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

const (
	configFile   = "config.toml"
	dropInFile   = "containerd/nri-gpu-guard.toml"
	k8sDropIn    = "containerd/nri-gpu-guard-kubernetes.toml"
	unitFile     = "systemd/nri-gpu-guard.service"
	configMap    = "kubernetes/20-configmap.yaml"
	staticPrefix = "devices.static"
)

// schemaKeys lists every key of the configuration schema as a dotted path
// ("policy.on_conflict", "devices.static.mig.gi"), derived from the toml tags
// of config.Config so that a key added to the schema is noticed here.
func schemaKeys(t *testing.T) []string {
	t.Helper()
	textUnmarshaler := reflect.TypeFor[encoding.TextUnmarshaler]()
	var keys []string
	var walk func(prefix string, typ reflect.Type)
	walk = func(prefix string, typ reflect.Type) {
		for i := range typ.NumField() {
			f := typ.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("toml"), ",")
			require.NotEmpty(t, name, "field %s.%s has no toml tag", typ.Name(), f.Name)
			path := name
			if prefix != "" {
				path = prefix + "." + name
			}
			ft := f.Type
			if ft.Kind() == reflect.Slice && ft.Elem().Kind() == reflect.Struct {
				ft = ft.Elem() // an array of tables: its keys are the element's keys
			}
			if ft.Kind() == reflect.Struct && !reflect.PointerTo(ft).Implements(textUnmarshaler) {
				walk(path, ft)
				continue
			}
			keys = append(keys, path)
		}
	}
	walk("", reflect.TypeFor[config.Config]())
	sort.Strings(keys)
	return keys
}

var (
	// A table header, live or commented out: "[policy]", "# [[devices.static]]".
	headerRE = regexp.MustCompile(`^#?\s*\[\[?([A-Za-z0-9_.]+)\]\]?\s*$`)
	// A key line, live or commented out: "lock_timeout = ...", "# minor = 0".
	// Prose comments never start with "word =", so they do not match.
	keyRE = regexp.MustCompile(`^#?\s*([a-z_]+)\s*=\s*\S`)
)

// documentedKeys returns every key the file shows, live or commented out, as
// dotted paths, plus the file with every commented-out key and header turned
// live.
func documentedKeys(t *testing.T, data []byte) (keys []string, uncommented []byte) {
	t.Helper()
	seen := map[string]bool{}
	var out bytes.Buffer
	section := ""
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case headerRE.MatchString(line):
			section = headerRE.FindStringSubmatch(line)[1]
			line = strings.TrimLeft(line, "# ")
		case keyRE.MatchString(line):
			key := keyRE.FindStringSubmatch(line)[1]
			if section != "" {
				key = section + "." + key
			}
			require.False(t, seen[key], "%s shows key %s twice", configFile, key)
			seen[key] = true
			line = strings.TrimLeft(line, "# ")
		}
		out.WriteString(line)
		out.WriteByte('\n')
	}
	require.NoError(t, sc.Err())
	for k := range seen {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys, out.Bytes()
}

func readFile(t *testing.T, name string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.FromSlash(name))
	require.NoError(t, err)
	return data
}

// The shipped config must be exactly the defaults: an operator who installs
// the package and changes nothing runs with config.Default().
func TestShippedConfigEqualsDefault(t *testing.T) {
	cfg, err := config.Parse(readFile(t, configFile))
	require.NoError(t, err)
	want := config.Default()
	if !reflect.DeepEqual(want, cfg) {
		t.Fatalf("%s does not equal config.Default():\n got: %+v\nwant: %+v", configFile, cfg, want)
	}
}

// Every key of the schema is shown in the shipped config (the static
// inventory commented out, everything else live), and no key is shown that
// the schema does not have.
func TestShippedConfigShowsEverySchemaKey(t *testing.T) {
	data := readFile(t, configFile)
	want := schemaKeys(t)
	got, _ := documentedKeys(t, data)
	require.Equal(t, want, got, "keys shown in %s differ from the config schema", configFile)

	var doc map[string]any
	md, err := toml.Decode(string(data), &doc)
	require.NoError(t, err)
	for _, key := range want {
		live := md.IsDefined(strings.Split(key, ".")...)
		if strings.HasPrefix(key, staticPrefix+".") || key == staticPrefix {
			require.False(t, live, "%s: %s must stay commented out (no static GPUs by default)", configFile, key)
			continue
		}
		require.True(t, live, "%s: %s must be set to its default, not only mentioned", configFile, key)
	}
}

// The commented-out static inventory is a working example: turned live it
// parses, validates and describes one GPU with one MIG instance.
func TestShippedConfigStaticExampleIsValid(t *testing.T) {
	_, uncommented := documentedKeys(t, readFile(t, configFile))
	cfg, err := config.Parse(uncommented)
	require.NoError(t, err, "the commented-out example in %s, turned live, does not parse", configFile)
	require.Len(t, cfg.Devices.Static, 1)
	gpu := cfg.Devices.Static[0]
	require.Regexp(t, `^GPU-`, gpu.UUID)
	require.NotEmpty(t, gpu.Model)
	require.NotZero(t, gpu.MemoryMiB)
	require.Len(t, gpu.MIG, 1)
	require.Regexp(t, `^MIG-`, gpu.MIG[0].UUID)
}

// The drop-in is included verbatim by operators and the end-to-end test; it
// must set nothing but NRI on and the validator requiring this plugin (by the
// default name, without its index).
func TestContainerdDropIn(t *testing.T) {
	var doc map[string]any
	_, err := toml.Decode(string(readFile(t, dropInFile)), &doc)
	require.NoError(t, err)
	want := map[string]any{
		"version": int64(3),
		"plugins": map[string]any{
			"io.containerd.nri.v1.nri": map[string]any{
				"disable": false,
				"default_validator": map[string]any{
					"enable":           true,
					"required_plugins": []any{config.Default().NRI.PluginName},
				},
			},
		},
	}
	require.Equal(t, want, doc)
}

// The Kubernetes drop-in adds only the toleration annotation key, without a
// '/' (containerd appends "/pod" or "/container.NAME" to it).
func TestContainerdKubernetesDropIn(t *testing.T) {
	var doc map[string]any
	_, err := toml.Decode(string(readFile(t, k8sDropIn)), &doc)
	require.NoError(t, err)
	want := map[string]any{
		"version": int64(3),
		"plugins": map[string]any{
			"io.containerd.nri.v1.nri": map[string]any{
				"default_validator": map[string]any{
					"tolerate_missing_plugins_annotation": "tolerate-missing-plugins.noderesource.dev",
				},
			},
		},
	}
	require.Equal(t, want, doc)
}

// unitDirectives returns the values of each directive of a systemd unit file.
func unitDirectives(t *testing.T, data []byte) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, ";") || strings.HasPrefix(line, "[") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		require.True(t, ok, "%s: malformed line %q", unitFile, line)
		out[strings.TrimSpace(k)] = append(out[strings.TrimSpace(k)], strings.TrimSpace(v))
	}
	require.NoError(t, sc.Err())
	return out
}

// The hardened unit must still let the daemon write where the defaults say it
// writes, start the shipped binary, and come back after a crash.
func TestSystemdUnitMatchesDefaults(t *testing.T) {
	d := unitDirectives(t, readFile(t, unitFile))
	def := config.Default()

	writable := strings.Fields(strings.Join(d["ReadWritePaths"], " "))
	for _, dir := range []string{def.Ledger.Dir, filepath.Dir(def.NRI.Socket)} {
		found := false
		for _, w := range writable {
			found = found || strings.TrimLeft(w, "-") == dir
		}
		require.True(t, found, "%s: ReadWritePaths %v lacks %s", unitFile, writable, dir)
	}
	require.Equal(t, []string{"strict"}, d["ProtectSystem"])
	require.Equal(t, []string{"always"}, d["Restart"])
	require.Len(t, d["ExecStart"], 1)
	require.True(t, strings.HasPrefix(d["ExecStart"][0], "/usr/bin/nri-gpu-guard"), "ExecStart %q", d["ExecStart"][0])
	require.Contains(t, d["After"], "containerd.service")
	// The state directory systemd creates must be the ledger directory with
	// the mode the ledger insists on.
	require.Equal(t, []string{filepath.Base(def.Ledger.Dir)}, d["StateDirectory"])
	require.Equal(t, []string{"0700"}, d["StateDirectoryMode"])
	// The ledger's per-boot markers: /run is read-only under
	// ProtectSystem=strict unless it is the unit's runtime directory, and
	// systemd must not remove it (and the markers) when the service stops.
	require.Equal(t, []string{filepath.Base(ledger.DefaultRuntimeDir)}, d["RuntimeDirectory"])
	require.Equal(t, "/run", filepath.Dir(ledger.DefaultRuntimeDir))
	require.Equal(t, []string{"0700"}, d["RuntimeDirectoryMode"])
	require.Equal(t, []string{"yes"}, d["RuntimeDirectoryPreserve"])
	// PrivateDevices would hide /dev/nvidia*, which NVML needs.
	for _, v := range d["PrivateDevices"] {
		require.NotContains(t, []string{"yes", "true", "on", "1"}, v, fmt.Sprintf("%s: PrivateDevices hides the GPUs", unitFile))
	}
}

// configMapDocument extracts the config.toml literal block of the Kubernetes
// ConfigMap (its module checks the YAML itself; this checks that the
// document it carries is one the daemon accepts).
func configMapDocument(t *testing.T) []byte {
	t.Helper()
	const key = "  config.toml: |"
	const indent = "    "
	var out bytes.Buffer
	in := false
	for line := range strings.Lines(string(readFile(t, configMap))) {
		switch {
		case strings.TrimRight(line, "\n") == key:
			in = true
		case !in:
		case strings.TrimSpace(line) == "":
			out.WriteString("\n")
		case strings.HasPrefix(line, indent):
			out.WriteString(strings.TrimPrefix(line, indent))
		default:
			in = false
		}
	}
	require.NotZero(t, out.Len(), "%s: no %q block", configMap, key)
	return out.Bytes()
}

// The DaemonSet's configuration is the shipped defaults plus the metrics
// endpoint its probes use, as parsed by the daemon's own parser.
func TestKubernetesConfigMapIsDefaultWithMetrics(t *testing.T) {
	cfg, err := config.Parse(configMapDocument(t))
	require.NoError(t, err)
	want := config.Default()
	want.Metrics.Listen = "127.0.0.1:9464"
	if !reflect.DeepEqual(want, cfg) {
		t.Fatalf("%s config differs from the defaults plus [metrics] listen:\n got: %+v\nwant: %+v", configMap, cfg, want)
	}
}

// The hook server's units and the relay agree on one socket, and the server
// runs in the host's namespaces: it answers a relay only when both share
// their mount, pid, user, cgroup and time namespaces, so a unit option that
// gives the service a mount namespace of its own would make every relay
// fall back to the Go hook (correct, but the server would never serve).
func TestHookServerUnits(t *testing.T) {
	sock := unitDirectives(t, readFile(t, "systemd/nri-gpu-guard-hook.socket"))
	require.Equal(t, []string{hookserve.DefaultSocket}, sock["ListenStream"])
	require.Equal(t, []string{"0600"}, sock["SocketMode"], "root only: the server trusts its callers' arguments")
	require.Equal(t, []string{"0700"}, sock["DirectoryMode"], "/run/nri-gpu-guard: the ledger's markers live there too, root only")
	require.NotContains(t, sock, "Accept", "one server for every relay (Accept=yes would start one per connection)")
	require.Equal(t, []string{"sockets.target"}, sock["WantedBy"], "what the package's enable hangs it on")
	relay := string(readFile(t, "../cmd/nri-gpu-guard-hook-relay/relay.c"))
	require.Contains(t, relay, fmt.Sprintf("#define RELAY_DEFAULT_SOCKET %q", hookserve.DefaultSocket))
	require.Contains(t, relay, `#define RELAY_DEFAULT_HOOK "/usr/bin/nri-gpu-guard-hook"`)

	svc := unitDirectives(t, readFile(t, "systemd/nri-gpu-guard-hook.service"))
	require.Equal(t, []string{"/usr/bin/nri-gpu-guard-hook serve"}, svc["ExecStart"])
	require.Contains(t, svc["Requires"], "nri-gpu-guard-hook.socket")
	for _, key := range []string{"ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "ReadWritePaths", "ReadOnlyPaths",
		"InaccessiblePaths", "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths", "PrivateMounts", "MountAPIVFS", "RootDirectory",
		"ProtectKernelTunables", "ProtectControlGroups", "ProtectKernelModules", "ProtectKernelLogs", "ProtectClock", "ProtectProc",
		"PrivateUsers", "PrivateNetwork", "PrivatePIDs", "RuntimeDirectory", "StateDirectory", "NetworkNamespacePath",
		"PrivateIPC", "MountFlags", "NoExecPaths", "ExecPaths", "ReadWriteDirectories", "ReadOnlyDirectories", "InaccessibleDirectories",
		"RootImage", "MountImages", "ExtensionImages", "ExtensionDirectories", "LogNamespace", "JoinsNamespaceOf", "IPCNamespacePath"} {
		require.NotContains(t, svc, key, "%s would put the hook server in namespaces of its own", key)
	}
	// The server answers only relays of its own uid (root): another user
	// would make every relay fall back; DynamicUser also brings a mount
	// namespace of its own.
	for _, key := range []string{"User", "Group", "DynamicUser"} {
		require.NotContains(t, svc, key, "%s would run the hook server as another user than the relays'", key)
	}
}
