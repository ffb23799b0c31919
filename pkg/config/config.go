// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package config

import (
	"bytes"
	"encoding"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/BurntSushi/toml"
)

// CurrentVersion is the only schema version this build understands.
const CurrentVersion = 1

// DefaultPath is where the daemon, the hook and the ctl look for the
// configuration when neither --config nor EnvPath names one.
const DefaultPath = "/etc/nri-gpu-guard/config.toml"

// EnvPath is the environment variable that overrides DefaultPath.
const EnvPath = "NRI_GPU_GUARD_CONFIG"

// maxConfigBytes bounds what Load reads: a configuration is a few KiB; anything
// near this size is a mistake (or an attack through the NRI config string).
const maxConfigBytes = 1 << 20

// Source names where the inventory comes from.
type Source string

// Inventory sources.
const (
	SourceAuto   Source = "auto"
	SourceNVML   Source = "nvml"
	SourceProc   Source = "proc"
	SourceStatic Source = "static"
)

// OnConflict is what happens to a request whose device is held.
type OnConflict string

// Conflict policies.
const (
	ConflictQueue  OnConflict = "queue"
	ConflictReject OnConflict = "reject"
)

// ReleaseOn says when a holder's claim ends.
type ReleaseOn string

// Release policies.
const (
	ReleaseOnStop   ReleaseOn = "stop"
	ReleaseOnRemove ReleaseOn = "remove"
)

// AllDevices is the policy for requests naming every GPU ("all").
type AllDevices string

// Policies for "all".
const (
	AllClaim  AllDevices = "claim"
	AllReject AllDevices = "reject"
	AllIgnore AllDevices = "ignore"
)

// Privileged is the policy for privileged containers.
type Privileged string

// Policies for privileged containers.
const (
	PrivilegedDeclared Privileged = "declared"
	PrivilegedAll      Privileged = "all"
	PrivilegedReject   Privileged = "reject"
)

// UnknownDevice is the policy for device ids that are not in the inventory.
type UnknownDevice string

// Policies for unknown ids.
const (
	UnknownReject UnknownDevice = "reject"
	UnknownIgnore UnknownDevice = "ignore"
)

// Config is the whole configuration document.
type Config struct {
	Version int           `toml:"version"`
	Ledger  LedgerConfig  `toml:"ledger"`
	Devices DevicesConfig `toml:"devices"`
	Policy  PolicyConfig  `toml:"policy"`
	NRI     NRIConfig     `toml:"nri"`
	Hook    HookConfig    `toml:"hook"`
	Metrics MetricsConfig `toml:"metrics"`
	Observe ObserveConfig `toml:"observe"`
}

// LedgerConfig locates the host ledger and bounds access to it.
type LedgerConfig struct {
	// Dir holds ledger.json, ledger.lock, audit.log and inventory.json.
	Dir string `toml:"dir"`
	// LockTimeout bounds every wait for the ledger lock.
	LockTimeout Duration `toml:"lock_timeout"`
	// AuditMaxBytes rotates audit.log once it grows past this size.
	AuditMaxBytes int64 `toml:"audit_max_bytes"`
}

// DevicesConfig selects and parameterises the GPU inventory.
type DevicesConfig struct {
	Source   Source      `toml:"source"`
	ProcRoot string      `toml:"proc_root"`
	Static   []StaticGPU `toml:"static"`
}

// StaticGPU describes one GPU of a static inventory.
type StaticGPU struct {
	Index     int         `toml:"index"`
	UUID      string      `toml:"uuid"`
	Minor     int         `toml:"minor"`
	Model     string      `toml:"model"`
	MemoryMiB uint64      `toml:"memory_mib"`
	MIG       []StaticMIG `toml:"mig"`
}

// StaticMIG describes one MIG instance of a static GPU.
type StaticMIG struct {
	// Index is the MIG device index on its parent, so that "<gpu>:<index>" names it.
	Index int    `toml:"index"`
	UUID  string `toml:"uuid"`
	GI    int    `toml:"gi"`
	CI    int    `toml:"ci"`
}

// PolicyConfig holds the admission policies.
type PolicyConfig struct {
	OnConflict       OnConflict    `toml:"on_conflict"`
	ReleaseOn        ReleaseOn     `toml:"release_on"`
	AllDevices       AllDevices    `toml:"all_devices"`
	Privileged       Privileged    `toml:"privileged"`
	UnknownDevice    UnknownDevice `toml:"unknown_device"`
	ReservationTTL   Duration      `toml:"reservation_ttl"`
	QueueTTL         Duration      `toml:"queue_ttl"`
	ExemptNamespaces []string      `toml:"exempt_namespaces"`
	// SwarmResourceEnvvars are further variables NVIDIA's runtime reads
	// GPU ids from, in place of NVIDIA_VISIBLE_DEVICES, when they are set:
	// its swarm-resource setting (a Docker swarm's generic resource, e.g.
	// DOCKER_RESOURCE_NVIDIA-GPU). DOCKER_RESOURCE_GPU is always read; a
	// name the runtime reads and the guard does not is a GPU without a
	// claim.
	SwarmResourceEnvvars []string `toml:"swarm_resource_envvars"`
}

// SwarmResourcePrefix starts every name of policy.swarm_resource_envvars:
// Docker names a swarm generic resource's variable DOCKER_RESOURCE_<KIND>,
// and the OCI hook's no-GPU shortcut, which answers before it reads the
// configuration, treats every such variable as a possible GPU request.
const SwarmResourcePrefix = "DOCKER_RESOURCE_"

// NRIConfig identifies the plugin to containerd.
type NRIConfig struct {
	PluginName  string `toml:"plugin_name"`
	PluginIndex string `toml:"plugin_index"`
	Socket      string `toml:"socket"`
}

// HookConfig tunes the OCI hook front end.
type HookConfig struct {
	WaitTimeout  Duration `toml:"wait_timeout"`
	PollInterval Duration `toml:"poll_interval"`
	// RuntimeRoots are the state directories of the OCI runtimes whose
	// containers `gpu-guard-ctl recover`, and the NRI daemon when it
	// recovers the ledger, adopt claims for (runc's and crun's roots;
	// podman uses runc's, and crun's as root; crun run by root from a login
	// session, with XDG_RUNTIME_DIR set, keeps its state below that
	// directory, /run/user/0/crun). Under release_on = "remove" the release rule
	// also asks them whether an exited OCI hook holder was removed (no
	// root lists its id). Empty: neither looks (such a holder is kept).
	RuntimeRoots []string `toml:"runtime_roots"`
	// Poststop says whether the runtime runs the hook's poststop phase for
	// each container (the shipped hooks.d files do). false: only the
	// createRuntime hook is installed, one hook process per container
	// instead of two; a claim then ends when the next request for its GPU
	// (or gc) finds its holder exited, create-runtime leaves no marker for a
	// poststop (marker.go), and status lists such a claim without calling
	// it a problem.
	Poststop bool `toml:"poststop"`
}

// MetricsConfig enables the HTTP endpoint for metrics and health.
type MetricsConfig struct {
	// Listen is host:port; empty means no HTTP endpoint.
	Listen string `toml:"listen"`
}

// OnIntruder is what the observer does about a process it finds on a GPU that
// its container does not hold.
type OnIntruder string

// Intruder policies. Neither kills anything.
const (
	IntruderReport OnIntruder = "report"
	IntruderCordon OnIntruder = "cordon"
)

// ObserveConfig tunes the observer, which compares the ledger with what NVML
// reports running on each GPU and watches GPU health.
type ObserveConfig struct {
	// Interval between two process accountings; 0 disables them (health
	// events are still watched).
	Interval Duration `toml:"interval"`
	// OnIntruder: "report" the finding, or also "cordon" the device.
	OnIntruder OnIntruder `toml:"on_intruder"`
	// ReleaseRequiresIdle keeps a stopped holder's claim (draining) until
	// NVML shows none of its processes on the device, or IdleGrace passes.
	ReleaseRequiresIdle bool `toml:"release_requires_idle"`
	// IdleGrace bounds how long a draining claim waits for the device to
	// become idle.
	IdleGrace Duration `toml:"idle_grace"`
	// Xids are the Xid error codes that make a device unhealthy.
	Xids []int `toml:"xids"`
}

// DefaultXids are the Xids whose resolution in NVIDIA's Xid catalogue
// (https://docs.nvidia.com/deploy/xid-errors/) is a GPU reset or a node
// reboot rather than restarting the application: double-bit ECC (48),
// micro-controller halt (62), page retirement / row remap failure (64),
// NVLink error (74), fallen off the bus (79), uncontained ECC (95), GSP RPC
// timeout and GSP error (119, 120), unrecovered ECC (140) and "GPU recovery
// action changed" (154). None of the application errors that the Kubernetes
// device plugin ignores (13, 31, 43, 45, 68, 109) is listed.
func DefaultXids() []int {
	return []int{48, 62, 64, 74, 79, 95, 119, 120, 140, 154}
}

// Default returns the configuration used when a key is absent.
func Default() Config {
	return Config{
		Version: CurrentVersion,
		Ledger: LedgerConfig{
			Dir:           "/var/lib/nri-gpu-guard",
			LockTimeout:   Duration{time.Second},
			AuditMaxBytes: 10 << 20,
		},
		Devices: DevicesConfig{
			Source:   SourceAuto,
			ProcRoot: "/",
		},
		Policy: PolicyConfig{
			OnConflict:       ConflictQueue,
			ReleaseOn:        ReleaseOnStop,
			AllDevices:       AllClaim,
			Privileged:       PrivilegedDeclared,
			UnknownDevice:    UnknownReject,
			ReservationTTL:   Duration{6 * time.Minute},
			QueueTTL:         Duration{15 * time.Minute},
			ExemptNamespaces: []string{},
			// Read always: DOCKER_RESOURCE_GPU (the resolver's).
			SwarmResourceEnvvars: []string{},
		},
		NRI: NRIConfig{
			PluginName:  "gpu-guard",
			PluginIndex: "90",
			Socket:      "/var/run/nri/nri.sock",
		},
		Hook: HookConfig{
			WaitTimeout:  Duration{10 * time.Minute},
			PollInterval: Duration{250 * time.Millisecond},
			RuntimeRoots: []string{"/run/runc", "/run/crun", "/run/user/0/crun"},
			Poststop:     true,
		},
		Observe: ObserveConfig{
			Interval:   Duration{10 * time.Second},
			OnIntruder: IntruderReport,
			IdleGrace:  Duration{time.Minute},
			Xids:       DefaultXids(),
		},
	}
}

// ErrUnknownKey is wrapped by Load when the document has a key the schema lacks.
var ErrUnknownKey = errors.New("unknown configuration key")

// Load reads a TOML document over the defaults and validates the result.
// Absent keys keep their defaults; unknown keys are an error naming each one.
func Load(r io.Reader) (Config, error) {
	data, err := io.ReadAll(io.LimitReader(r, maxConfigBytes+1))
	if err != nil {
		return Config{}, fmt.Errorf("read configuration: %w", err)
	}
	if len(data) > maxConfigBytes {
		return Config{}, fmt.Errorf("configuration is larger than %d bytes", maxConfigBytes)
	}
	return Parse(data)
}

// Parse is Load for a document already in memory (the NRI Configure string).
func Parse(data []byte) (Config, error) {
	cfg := Default()
	if len(bytes.TrimSpace(data)) == 0 {
		return cfg, nil
	}
	md, err := toml.NewDecoder(bytes.NewReader(data)).Decode(&cfg)
	if err != nil {
		return Config{}, fmt.Errorf("parse configuration: %w", err)
	}
	if err := checkKeys(md.Keys()); err != nil {
		return Config{}, err
	}
	if err := cfg.Validate(); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

// keysHelp says where an operator finds every key of the schema on a host
// the packages installed: the shipped configuration lists each one with its
// default, and the design document, installed with the other documents,
// describes them.
const keysHelp = "every key is shown, with its default, in the configuration file the package installs " +
	"(" + DefaultPath + ") and in /usr/share/doc/nri-gpu-guard/design.md"

// checkKeys refuses every key of the document that is not exactly a key of
// the schema. The decoder matches keys without regard to case, and leaves
// out of MetaData.Undecoded what it matched so: "ON_CONFLICT" or "[Policy]"
// would be taken, and a case variant of a key written next to the key
// itself would silently replace its value. TOML keys are case-sensitive, so
// the document's keys, as written, are compared with the schema's. Below a
// key that is refused, nothing more is named.
func checkKeys(doc []toml.Key) error {
	schema := schemaKeys()
	var bad []string
	seen := map[string]bool{}
	var refused []string // prefixes ("ledgr.") of the refused keys
next:
	for _, k := range doc {
		name := k.String()
		if schema[name] || seen[name] {
			continue
		}
		for _, p := range refused {
			if strings.HasPrefix(name, p) {
				continue next
			}
		}
		seen[name] = true
		refused = append(refused, name+".")
		if want := schemaFold(name); want != "" {
			bad = append(bad, fmt.Sprintf("%s (keys are case-sensitive: write %s)", name, want))
		} else {
			bad = append(bad, name)
		}
	}
	if len(bad) == 0 {
		return nil
	}
	sort.Strings(bad)
	return fmt.Errorf("%w: %s (check the spelling; %s)", ErrUnknownKey, strings.Join(bad, ", "), keysHelp)
}

// schemaFold is the schema key that name spells in other case, or "".
func schemaFold(name string) string {
	for k := range schemaKeys() {
		if strings.EqualFold(k, name) {
			return k
		}
	}
	return ""
}

// schemaKeys is every key path of the schema ("ledger", "ledger.dir",
// "devices.static.mig.gi", ...) in the form toml.Key.String writes it,
// derived once from the toml tags of Config, so that a key added to the
// structs is accepted without a list to keep up to date. An array of tables
// ([[devices.static]]) adds no index to the path, as the decoder's keys
// have none.
var schemaKeys = sync.OnceValue(func() map[string]bool {
	keys := map[string]bool{}
	addSchemaKeys(keys, "", reflect.TypeFor[Config]())
	return keys
})

// textUnmarshaler marks a struct that is one value in TOML (Duration).
var textUnmarshaler = reflect.TypeFor[encoding.TextUnmarshaler]()

func addSchemaKeys(keys map[string]bool, prefix string, t reflect.Type) {
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("toml"), ",")
		if name == "-" {
			continue
		}
		if name == "" {
			// The decoder's name for a field without a tag. Every field
			// has one (TestSchemaKeysAreTheDecodersKeys), so that the
			// schema's key names are written down beside the fields.
			name = f.Name
		}
		key := prefix + name
		keys[key] = true
		ft := f.Type
		if ft.Kind() == reflect.Slice {
			ft = ft.Elem()
		}
		if ft.Kind() == reflect.Struct && !reflect.PointerTo(ft).Implements(textUnmarshaler) {
			addSchemaKeys(keys, key+".", ft)
		}
	}
}

// ErrNotRegular is wrapped by LoadFile for a path that is not a regular file.
var ErrNotRegular = errors.New("not a regular file")

// ErrLinkLeadsNowhere is wrapped by LoadFile when no file is at path but a
// symbolic link is: path itself (its target gone) or a directory above it.
var ErrLinkLeadsNowhere = errors.New("no configuration file where a symbolic link leads")

// LoadFile loads the configuration at path. A missing file is an error that
// wraps fs.ErrNotExist only when nothing at all is there: no symbolic link in
// path's place and none among the directories above it (see absent); callers
// that accept "no file" (LoadDefault) apply the defaults for that error only.
// Anything but a regular file (a FIFO, a device, a directory) is refused at
// once: opening a FIFO without a writer would block, and reading a device
// would not end.
func LoadFile(path string) (Config, error) {
	f, err := OpenRegular(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			if lerr := absent(path); lerr != nil {
				return Config{}, lerr
			}
		}
		return Config{}, fmt.Errorf("open configuration: %w", err)
	}
	defer func() { _ = f.Close() }() // read-only: a close error loses nothing
	cfg, err := Load(f)
	if err != nil {
		return Config{}, fmt.Errorf("%s: %w", path, err)
	}
	return cfg, nil
}

// absent checks, for a path whose open said it does not exist, that nothing
// at all is there. A symbolic link at path (its target gone) or in place of
// its directory, or a link further up whose target is gone, says that a
// configuration is kept elsewhere and was meant to be found (a
// configuration-management checkout, a file system not mounted yet, a link
// being replaced): the built-in defaults would then be another guard, with
// another ledger directory, so that two containers could hold one GPU. Such
// a path is an error naming the link and where it leads, which never wraps
// fs.ErrNotExist. A link further up that leads somewhere (a distribution
// whose /etc is one) is only the way there: below it, nothing is.
func absent(path string) error {
	abs, err := filepath.Abs(path)
	if err != nil {
		return fmt.Errorf("configuration %s: %w", path, err)
	}
	for p := abs; ; p = filepath.Dir(p) {
		fi, err := os.Lstat(p)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			// Nothing here; a link above could still be why.
		case err != nil:
			return fmt.Errorf("configuration %s: cannot tell whether it exists: %w", path, err)
		case fi.Mode()&fs.ModeSymlink != 0:
			if p != abs && p != filepath.Dir(abs) {
				if _, err := os.Stat(p); err == nil {
					break
				}
			}
			return linkError(path, abs, p)
		case p == abs:
			// The open found nothing, but something is there now.
			return fmt.Errorf("configuration %s appeared while it was being opened; run again", path)
		}
		if parent := filepath.Dir(p); parent == p {
			return nil
		}
	}
}

// linkError is absent's error for the symbolic link link on the way to the
// configuration path (abs, absolute).
func linkError(path, abs, link string) error {
	target, err := os.Readlink(link)
	if err != nil {
		target = "?" // replaced since the Lstat; the link is still what is named
	} else if !filepath.IsAbs(target) {
		target = filepath.Join(filepath.Dir(link), target)
	}
	what := fmt.Sprintf("%s is a symbolic link to %s", link, target)
	if _, err := os.Stat(target); errors.Is(err, fs.ErrNotExist) {
		what += ", which does not exist"
	}
	if link != abs {
		what += fmt.Sprintf(", and no file is at %s below it", path)
	}
	return fmt.Errorf("configuration %s: %w: %s. Restore the configuration the link leads to, or name a file with --config; "+
		"the built-in defaults apply only where no file and no link is found", path, ErrLinkLeadsNowhere, what)
}

// OpenRegular opens path for reading if it is a regular file (symlinks to one
// are followed) and refuses anything else with ErrNotRegular. It never blocks:
// the open is non-blocking, so a FIFO is refused rather than waited on, and
// the mode is checked on the opened file, not on a path that could change.
func OpenRegular(path string) (*os.File, error) {
	//nolint:gosec // the path is the operator's choice
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("stat %s: %w", path, err)
	}
	if !fi.Mode().IsRegular() {
		_ = f.Close()
		return nil, fmt.Errorf("%s: %w (it is a %s); name a file", path, ErrNotRegular, fileKind(fi.Mode()))
	}
	return f, nil
}

// fileKind names a file type for people.
func fileKind(m os.FileMode) string {
	switch {
	case m.IsDir():
		return "directory"
	case m&os.ModeNamedPipe != 0:
		return "named pipe (FIFO)"
	case m&os.ModeSocket != 0:
		return "socket"
	case m&os.ModeCharDevice != 0:
		return "character device"
	case m&os.ModeDevice != 0:
		return "block device"
	default:
		return "special file (" + m.Type().String() + ")"
	}
}

// Path picks the configuration file's path: the flag value, then $NRI_GPU_GUARD_CONFIG,
// then DefaultPath. explicit is true when the operator named the path, in which
// case a missing file is an error rather than "use the defaults".
func Path(flagValue string) (path string, explicit bool) {
	return PathFrom(flagValue, os.Getenv(EnvPath))
}

// PathFrom is Path for a process whose $NRI_GPU_GUARD_CONFIG is envValue
// ("" where unset), not necessarily this one's: a resident hook server
// answers for hook processes whose environment it was told, and its own
// environment must not pick their configuration.
func PathFrom(flagValue, envValue string) (path string, explicit bool) {
	if flagValue != "" {
		return flagValue, true
	}
	if envValue != "" {
		return envValue, true
	}
	return DefaultPath, false
}

// LoadDefault loads the configuration named by flagValue (see Path). When no
// path was named and nothing at all is at DefaultPath, it returns Default():
// a symbolic link there that leads nowhere is an error (see LoadFile).
func LoadDefault(flagValue string) (Config, string, error) {
	return loadPath(Path(flagValue))
}

// LoadDefaultFrom is LoadDefault for a process whose $NRI_GPU_GUARD_CONFIG
// is envValue (see PathFrom).
func LoadDefaultFrom(flagValue, envValue string) (Config, string, error) {
	return loadPath(PathFrom(flagValue, envValue))
}

// loadPath is LoadDefault for the path Path picked.
func loadPath(path string, explicit bool) (Config, string, error) {
	cfg, err := LoadFile(path)
	if err != nil && !explicit && errors.Is(err, os.ErrNotExist) {
		return Default(), "", nil
	}
	return cfg, path, err
}
