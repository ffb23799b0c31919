// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"unicode"
	"unicode/utf8"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// MaxSpecBytes bounds a config.json the hook reads, and add-hooks edits.
const MaxSpecBytes = 16 << 20

// Input bounds. The runtime writes the state (a few hundred bytes plus the
// annotations, which Kubernetes caps at 256 KiB in total) and the bundle's
// config.json (env, mounts, annotations: rarely above 100 KiB). Anything near
// these limits is refused rather than buffered without end.
const (
	maxStateBytes = 1 << 20
	maxSpecBytes  = MaxSpecBytes
	// maxIDLen bounds the container id (runc ids are 64 hex digits; podman's
	// too). The id is only a ledger key and a word in messages.
	maxIDLen = 1024
	// maxLabelLen bounds a pod namespace/name/uid or container name taken
	// from an annotation before it goes into the ledger: the bound both
	// front ends apply (guard.BoundLabel).
	maxLabelLen = guard.MaxLabelLen
)

// errInput is wrapped by every error about the runtime's input (state on
// stdin, config.json), so tests and callers can tell "could not read what I
// was given" from a refusal.
var errInput = errors.New("cannot read the runtime's input")

// readState decodes the OCI state the runtime writes to a hook's stdin.
func readState(r io.Reader) (specs.State, error) {
	data, err := io.ReadAll(io.LimitReader(r, maxStateBytes+1))
	if err != nil {
		return specs.State{}, fmt.Errorf("%w: read the OCI state from stdin: %w", errInput, err)
	}
	if len(data) > maxStateBytes {
		return specs.State{}, fmt.Errorf("%w: the OCI state on stdin is larger than %d bytes", errInput, maxStateBytes)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return specs.State{}, fmt.Errorf("%w: stdin is empty; a runtime hook gets the OCI state (JSON) on stdin", errInput)
	}
	st, ok := fastState(data)
	if !ok {
		// Anything the fast decoder does not handle, errors included. It
		// gives up on a repeated key and on a key that differs from a
		// field's only in case: those are refused before encoding/json
		// merges them (checkKeys).
		if err := checkKeys(data, stateKeys); err != nil {
			return specs.State{}, fmt.Errorf("%w: the OCI state on stdin: %w", errInput, err)
		}
		if err := json.Unmarshal(data, &st); err != nil {
			return specs.State{}, fmt.Errorf("%w: decode the OCI state from stdin: %w", errInput, err)
		}
	}
	if err := checkID(st.ID); err != nil {
		return specs.State{}, err
	}
	if st.Pid < 0 {
		return specs.State{}, fmt.Errorf("%w: the OCI state of container %q has a negative pid %d", errInput, st.ID, st.Pid)
	}
	return st, nil
}

// checkID refuses container ids that could not have come from a runtime:
// empty, huge, or holding control characters (they end up in messages and
// the audit log).
func checkID(id string) error {
	switch {
	case id == "":
		return fmt.Errorf("%w: the OCI state has no container id", errInput)
	case len(id) > maxIDLen:
		return fmt.Errorf("%w: the container id in the OCI state is longer than %d bytes", errInput, maxIDLen)
	case strings.IndexFunc(id, func(r rune) bool { return unicode.IsControl(r) || unicode.IsSpace(r) }) >= 0:
		return fmt.Errorf("%w: the container id %q in the OCI state holds spaces or control characters", errInput, id)
	}
	return nil
}

// readSpec loads <bundle>/config.json. The bundle path is the runtime's; the
// file must be a regular file (a FIFO or device there would block or feed the
// hook without end) and is read with a bound.
func readSpec(st specs.State) (*specs.Spec, error) {
	if st.Bundle == "" {
		return nil, fmt.Errorf("%w: the OCI state of container %q names no bundle directory", errInput, st.ID)
	}
	if !filepath.IsAbs(st.Bundle) {
		return nil, fmt.Errorf("%w: the bundle %q of container %q is not an absolute path", errInput, st.Bundle, st.ID)
	}
	path := filepath.Join(filepath.Clean(st.Bundle), "config.json")
	// O_NONBLOCK so that opening a FIFO planted there cannot hang the hook;
	// it is irrelevant for the regular file that is expected. Opened with
	// syscall.Open and checked before os.NewFile, with O_NONBLOCK cleared:
	// os.OpenFile would hand a non-blocking descriptor to the runtime's
	// poller, and starting the poller (epoll, eventfd) costs a hook process
	// more than reading the file.
	fd, err := syscall.Open(path, syscall.O_RDONLY|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: open the spec of container %q: %w", errInput, st.ID, &os.PathError{Op: "open", Path: path, Err: err})
	}
	var sys syscall.Stat_t
	if err := syscall.Fstat(fd, &sys); err != nil {
		_ = syscall.Close(fd)
		return nil, fmt.Errorf("%w: stat %s: %w", errInput, path, err)
	}
	if sys.Mode&syscall.S_IFMT != syscall.S_IFREG {
		_ = syscall.Close(fd)
		return nil, fmt.Errorf("%w: %s is not a regular file (%s)", errInput, path, fileType(sys.Mode))
	}
	return decodeSpecFile(fd, path)
}

// decodeSpecFile reads and decodes the spec open at fd (a regular file,
// opened non-blocking, named path in messages) and closes fd.
func decodeSpecFile(fd int, path string) (*specs.Spec, error) {
	if err := syscall.SetNonblock(fd, false); err != nil {
		_ = syscall.Close(fd)
		return nil, fmt.Errorf("%w: open %s: %w", errInput, path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer func() { _ = f.Close() }()
	data, err := io.ReadAll(io.LimitReader(f, maxSpecBytes+1))
	if err != nil {
		return nil, fmt.Errorf("%w: read %s: %w", errInput, path, err)
	}
	if len(data) > maxSpecBytes {
		return nil, fmt.Errorf("%w: %s is larger than %d bytes", errInput, path, maxSpecBytes)
	}
	sub, ok := fastSpec(data)
	if !ok {
		// Anything the fast decoder does not handle, errors included (see
		// readState for the keys refused first).
		if err := checkKeys(data, specKeys); err != nil {
			return nil, fmt.Errorf("%w: %s: %w", errInput, path, err)
		}
		if err := json.Unmarshal(data, &sub); err != nil {
			return nil, fmt.Errorf("%w: decode %s: %w", errInput, path, err)
		}
	}
	return sub.spec(), nil
}

// crunDefaultRoot is the state root of crun run without --root and
// without XDG_RUNTIME_DIR in its environment (crunStateRoot).
const crunDefaultRoot = "/run/crun"

// maxCmdlineBytes bounds the read of the runtime's command line.
const maxCmdlineBytes = 64 << 10

// maxEnvironBytes bounds the read of the runtime's environment: far more
// than an engine gives a runtime, well below what a process may carry.
const maxEnvironBytes = 256 << 10

// crunStateRoot is the state root of crun run without --root (which names
// it otherwise: runtimeDirs) in the environment environ:
// $XDG_RUNTIME_DIR/crun where XDG_RUNTIME_DIR is set and not empty, and
// crunDefaultRoot otherwise. crun 1.8 takes XDG_RUNTIME_DIR whatever its
// user, root's too (a root login session sets /run/user/0), and getenv's
// first entry when the environment names it twice.
func crunStateRoot(environ []string) string {
	for _, kv := range environ {
		if v, ok := strings.CutPrefix(kv, "XDG_RUNTIME_DIR="); ok {
			if v == "" {
				break
			}
			return v + "/crun"
		}
	}
	return crunDefaultRoot
}

// cwdBundle reports whether bundle, the one an OCI state names, is "/": the
// working directory crun 1.8 reports instead of the bundle (crunSpec).
func cwdBundle(bundle string) bool {
	return bundle != "" && filepath.Clean(bundle) == "/"
}

// readSpecOf reads the spec of the container st describes: its bundle's
// config.json (readSpec), or, where the state names the bundle "/",
// the runtime's own copy of it (crunSpec), st.Bundle then becoming the
// bundle directory the runtime was given, so that relative paths of the
// spec and the container's marker (marker.go) go by the bundle as they do
// for every other container.
func (e env) readSpecOf(st *specs.State) (*specs.Spec, error) {
	if !cwdBundle(st.Bundle) {
		return readSpec(*st)
	}
	spec, bundle, err := e.crunSpec(st.ID, st.Bundle)
	if err != nil {
		return nil, err
	}
	st.Bundle = bundle
	return spec, nil
}

// crunSpec reads the spec of container id, whose OCI state names the bundle
// stateBundle ("/"), from the state directory of the runtime that runs this
// hook, its parent. crun 1.8 fills the state's bundle with its working
// directory (getcwd), not the bundle it was given; for a container with a
// user namespace and linux.devices entries it has changed directory to "/"
// by the time it runs the createRuntime hooks (it makes the device nodes on
// the host first), and records "/" as the bundle for `crun state` and the
// poststop hooks of `crun delete` as well (containers/crun#2025, #2263).
// The "/" is no bundle: its config.json, if any, is another file.
//
// crun keeps a copy of the spec it was given, byte for byte, in
// <root>/<id>/config.json from before the container is created until it is
// deleted; <root> is its --root, or $XDG_RUNTIME_DIR/crun, or /run/crun
// (crunStateRoot). That copy is read,
// and only when it is the runtime's own: the root, the container's directory
// and the file are owned by the hook's user (root, as the runtime is) and
// writable by no one else, the id is one path element, and neither the
// directory nor the file is a symlink. So a user who is not root cannot
// plant a spec there. The root and the bundle come from the runtime's
// command line (/proc/<ppid>/cmdline: --root and --bundle or -b), and,
// without --root, the root from its environment (/proc/<ppid>/environ:
// XDG_RUNTIME_DIR), both the runtime's own (the hook's parent). The bundle
// is needed too: a relative root.path or bind source is read from it, as the
// runtime did.
//
// Where either cannot be found the container is refused (an error): what it
// reaches cannot be read. Poststop, given the same "/" by `crun delete`
// (whose command line names no bundle), so reads the ledger rather than
// take the spec's word that it holds nothing; podman runs poststop itself,
// with the bundle.
func (e env) crunSpec(id, stateBundle string) (*specs.Spec, string, error) {
	ppid := e.getppid()
	prefix := fmt.Sprintf("the OCI state of container %q names the bundle %q, which crun 1.8 reports instead of the bundle "+
		"for a container with a user namespace and devices (its working directory)", id, stateBundle)
	const remedy = "use a crun release that reports the bundle (containers/crun#2263) or runc"
	args, err := readCmdline(filepath.Join(e.procRoot, strconv.Itoa(ppid), "cmdline"))
	if err != nil {
		return nil, "", fmt.Errorf("%w: %s, and the command line of the runtime that ran this hook (pid %d) cannot be read to find the spec: %w; %s",
			errInput, prefix, ppid, err, remedy)
	}
	root, bundle, err := runtimeDirs(args)
	if err != nil {
		return nil, "", fmt.Errorf("%w: %s, and the command line of the runtime that ran this hook (pid %d) cannot be read as crun reads it: %w",
			errInput, prefix, ppid, err)
	}
	if root == "" {
		environ, err := readNULList(filepath.Join(e.procRoot, strconv.Itoa(ppid), "environ"), maxEnvironBytes)
		if err != nil {
			return nil, "", fmt.Errorf("%w: %s, and the environment of the runtime that ran this hook (pid %d), which names its state root "+
				"(XDG_RUNTIME_DIR) where its command line names no --root, cannot be read: %w. Give the runtime --root, or %s",
				errInput, prefix, ppid, err, remedy)
		}
		root = crunStateRoot(environ)
	}
	if bundle == "" || !filepath.IsAbs(bundle) {
		return nil, "", fmt.Errorf("%w: %s, and the command line of the runtime that ran this hook (pid %d) names no absolute --bundle: "+
			"the directory the spec's relative paths start from is unknown. Give the runtime --bundle with an absolute path, or %s",
			errInput, prefix, ppid, remedy)
	}
	fd, path, err := openRuntimeSpec(root, id, os.Geteuid())
	if err != nil {
		// Name the copy sought even where the error stops short of it (a
		// state root not there: crun makes it at its first container).
		sought := ""
		if path != "" {
			sought = fmt.Sprintf(" (sought at %s)", path)
		}
		return nil, "", fmt.Errorf("%w: %s, and the runtime's own copy of the spec cannot be read: %w%s. "+
			"If the runtime keeps its state elsewhere, give it that --root; or %s", errInput, prefix, err, sought, remedy)
	}
	spec, err := decodeSpecFile(fd, path)
	if err != nil {
		return nil, "", err
	}
	return spec, filepath.Clean(bundle), nil
}

// readCmdline reads a /proc/<pid>/cmdline file: its NUL-separated words.
func readCmdline(path string) ([]string, error) { return readNULList(path, maxCmdlineBytes) }

// readNULList reads a /proc/<pid>/cmdline or environ file of at most limit
// bytes: its NUL-separated words.
func readNULList(path string, limit int) ([]string, error) {
	data, err := readBounded(path, limit)
	if err != nil {
		return nil, err
	}
	return strings.Split(strings.TrimSuffix(string(data), "\x00"), "\x00"), nil
}

// runtimeDirs returns the state root (--root) and the bundle (--bundle, -b)
// that an OCI runtime's command line args (args[0] the program) names, ""
// for one it does not name. runc and crun take --root before the command and
// --bundle after it; both read "--flag value" and "--flag=value", and crun
// "-bvalue" too. The last of each counts, as the runtimes read them (crun's
// argp and runc's flag parser both overwrite an option given twice: `crun
// --root A --root B state x` opens B/x/status). crun's argp also takes a
// long option abbreviated to a prefix (--bund for --bundle): such a word is
// an error here, since the directory it names would otherwise be missed
// and the default taken instead.
func runtimeDirs(args []string) (root, bundle string, err error) {
	for i := 1; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			break
		}
		next := func() string {
			if i+1 < len(args) {
				i++
				return args[i]
			}
			return ""
		}
		name, _, _ := strings.Cut(a, "=")
		switch {
		case a == "--root":
			root = next()
		case strings.HasPrefix(a, "--root="):
			root = strings.TrimPrefix(a, "--root=")
		case a == "--bundle" || a == "-b":
			bundle = next()
		case strings.HasPrefix(a, "--bundle="):
			bundle = strings.TrimPrefix(a, "--bundle=")
		case strings.HasPrefix(a, "-b") && !strings.HasPrefix(a, "--"):
			bundle = strings.TrimPrefix(a, "-b")
		case len(name) > 2 && (strings.HasPrefix("--root", name) || strings.HasPrefix("--bundle", name)):
			full := "--root"
			if strings.HasPrefix("--bundle", name) {
				full = "--bundle"
			}
			return "", "", fmt.Errorf("it abbreviates %s to %q, which crun reads as %s: give the option in full", full, name, full)
		}
	}
	return root, bundle, nil
}

// readRuntimeSpec reads the spec of container id from crun's own copy of
// it, <root>/<id>/config.json, for a caller that learns the container from
// the runtime's state root rather than a hook's stdin (ReadSpec) and finds
// the bundle "/" recorded: crun 1.8's working directory, not the
// bundle (crunSpec), whose config.json is another file. The copy is read
// only when it is the runtime's own (openRuntimeSpec), the runtime's user
// being the root's owner (a rootless runtime's root is its user's). A spec
// that names a path read from the bundle (a relative root.path or bind
// source) is refused: the bundle is unknown, and read from elsewhere such a
// path could miss what the container reaches.
func readRuntimeSpec(root, id string) (*specs.Spec, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	fd, path, err := openRuntimeSpec(root, id, -1)
	if err != nil {
		return nil, fmt.Errorf("%w: the runtime's own copy of the spec of container %q cannot be read: %w", errInput, id, err)
	}
	spec, err := decodeSpecFile(fd, path)
	if err != nil {
		return nil, err
	}
	if p := rootPath(spec); p != "" && p[0] != '/' {
		return nil, fmt.Errorf("%w: %s names the relative root.path %q, read from the bundle, which the runtime did not record",
			errInput, path, p)
	}
	for _, m := range spec.Mounts {
		if isBind(m) && m.Source != "" && m.Source[0] != '/' {
			return nil, fmt.Errorf("%w: %s binds the relative source %q at %q, read from the bundle, which the runtime did not record",
				errInput, path, m.Source, m.Destination)
		}
	}
	return spec, nil
}

// openRuntimeSpec opens <root>/<id>/config.json, the copy of a container's
// spec that crun keeps in its state directory, if it is the runtime's own:
// the root (followed if a symlink: it is the runtime's own setting), the
// container's directory and the file are owned by the runtime's user, owner
// (the hook's effective user; -1: the root's owner), and writable by no
// other, the directory and the file are no symlinks, the file is a regular
// one, and id is a single path element. It returns the descriptor, opened
// non-blocking (see readSpec), and the path; on an error after root and id
// were found sound, the path it sought ("" before).
func openRuntimeSpec(root, id string, owner int) (int, string, error) {
	if !filepath.IsAbs(root) {
		return -1, "", fmt.Errorf("the runtime's state root %q is not an absolute path", root)
	}
	root = filepath.Clean(root)
	if id == "." || id == ".." || strings.Contains(id, "/") { // checkID refused control characters
		return -1, "", fmt.Errorf("the container id %q is not a file name", id)
	}
	dir := filepath.Join(root, id)
	path := filepath.Join(dir, "config.json")
	euid := uint32(owner) //nolint:gosec // a uid fits 32 bits; -1 is replaced below
	// owned checks, by its descriptor (no path to swap meanwhile), that
	// fd is a file of the kind mode that only the runtime's user may
	// write; first is called for the root, whose owner is that user when
	// the caller does not say (owner < 0).
	first := true
	owned := func(fd int, name string, mode uint32, kind string) error {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return &os.PathError{Op: "stat", Path: name, Err: err}
		}
		if first && owner < 0 {
			euid = st.Uid
		}
		first = false
		switch {
		case st.Mode&unix.S_IFMT != mode:
			return fmt.Errorf("%s is not a %s (%s)", name, kind, fileType(st.Mode))
		case st.Uid != euid:
			return fmt.Errorf("%s is owned by uid %d, not by the runtime's user (uid %d)", name, st.Uid, euid)
		case st.Mode&0o022 != 0:
			return fmt.Errorf("%s is writable by others than its owner (mode %#o)", name, st.Mode&0o7777)
		}
		return nil
	}
	rootFD, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, path, &os.PathError{Op: "open", Path: root, Err: err}
	}
	defer func() { _ = unix.Close(rootFD) }()
	if err := owned(rootFD, root, unix.S_IFDIR, "directory"); err != nil {
		return -1, path, err
	}
	dirFD, err := unix.Openat(rootFD, id, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, path, &os.PathError{Op: "open", Path: dir, Err: err}
	}
	defer func() { _ = unix.Close(dirFD) }()
	if err := owned(dirFD, dir, unix.S_IFDIR, "directory"); err != nil {
		return -1, path, err
	}
	fd, err := unix.Openat(dirFD, "config.json", unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, path, &os.PathError{Op: "open", Path: path, Err: err}
	}
	if err := owned(fd, path, unix.S_IFREG, "regular file"); err != nil {
		_ = unix.Close(fd)
		return -1, path, err
	}
	return fd, path, nil
}

// hookSpec is the part of config.json the hook reads: what can make a GPU
// reachable (devices.RequestFromSpec, and the root filesystem and mounts
// where no device cgroup applies: unfence), what names the container
// (OwnerFrom) and the createRuntime hooks (ownHookTimeout). Decoding into specs.Spec instead makes encoding/json build
// its field tables for the whole OCI schema in every hook process, a fifth
// of a hook's run time for a container that names no GPU.
type hookSpec struct {
	Process *hookProcess `json:"process"`
	// Root: its path is bound at the container's "/" (boundRoot), read-only
	// or not (which runc keeps the nodev of its mount for).
	Root        *hookRoot         `json:"root"`
	Mounts      []hookMount       `json:"mounts"`
	Annotations map[string]string `json:"annotations"`
	Linux       *hookLinux        `json:"linux"`
	// Hooks: a --wait hook reads its own timeout there (ownHookTimeout).
	Hooks *hookHooks `json:"hooks"`
}

type hookHooks struct {
	CreateRuntime []hookHook `json:"createRuntime"`
}

type hookHook struct {
	Path    string   `json:"path"`
	Args    []string `json:"args"`
	Timeout *int     `json:"timeout"`
}

type hookRoot struct {
	Path string `json:"path"`
	// Readonly: runc remounts a read-only root without the nodev of its
	// mount (boundRoot).
	Readonly bool `json:"readonly"`
}

type hookProcess struct {
	Env          []string  `json:"env"`
	Capabilities *hookCaps `json:"capabilities"`
}

type hookCaps struct {
	Bounding []string `json:"bounding"`
}

type hookMount struct {
	Destination string `json:"destination"`
	Source      string `json:"source"`
	// Type: a devtmpfs mounted afresh is the host's /dev (AddMount);
	// Options: an overlay's layers are host directories (OverlayLayers).
	Type    string   `json:"type"`
	Options []string `json:"options"`
}

type hookLinux struct {
	Devices     []hookDevice   `json:"devices"`
	CgroupsPath string         `json:"cgroupsPath"`
	Resources   *hookResources `json:"resources"`
	// Namespaces: their types (a user namespace stops CAP_MKNOD making
	// device nodes, see makesNodes) and paths (a PID namespace joined by
	// path is not the container's own, see procShowsOtherRoots).
	Namespaces []hookNamespace `json:"namespaces"`
}

type hookNamespace struct {
	Type string `json:"type"`
	Path string `json:"path"`
}

type hookDevice struct {
	Path  string `json:"path"`
	Type  string `json:"type"`
	Major int64  `json:"major"`
	Minor int64  `json:"minor"`
}

type hookResources struct {
	Devices []specs.LinuxDeviceCgroup `json:"devices"`
}

// spec returns the decoded fields as a specs.Spec (the rest left zero).
func (h *hookSpec) spec() *specs.Spec {
	s := &specs.Spec{Annotations: h.Annotations}
	if r := h.Root; r != nil {
		s.Root = &specs.Root{Path: r.Path, Readonly: r.Readonly}
	}
	if p := h.Process; p != nil {
		s.Process = &specs.Process{Env: p.Env}
		if c := p.Capabilities; c != nil {
			s.Process.Capabilities = &specs.LinuxCapabilities{Bounding: c.Bounding}
		}
	}
	for _, m := range h.Mounts {
		s.Mounts = append(s.Mounts, specs.Mount{Destination: m.Destination, Source: m.Source, Type: m.Type, Options: m.Options})
	}
	if hs := h.Hooks; hs != nil {
		s.Hooks = &specs.Hooks{}
		for _, k := range hs.CreateRuntime {
			s.Hooks.CreateRuntime = append(s.Hooks.CreateRuntime, specs.Hook{Path: k.Path, Args: k.Args, Timeout: k.Timeout})
		}
	}
	if l := h.Linux; l != nil {
		s.Linux = &specs.Linux{CgroupsPath: l.CgroupsPath}
		if l.Resources != nil {
			s.Linux.Resources = &specs.LinuxResources{Devices: l.Resources.Devices}
		}
		for _, d := range l.Devices {
			s.Linux.Devices = append(s.Linux.Devices, specs.LinuxDevice{Path: d.Path, Type: d.Type, Major: d.Major, Minor: d.Minor})
		}
		for _, n := range l.Namespaces {
			s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.LinuxNamespaceType(n.Type), Path: n.Path})
		}
	}
	return s
}

// errAmbiguousKey is wrapped by the error about a key of the runtime's
// input that OCI runtimes read differently (checkKeys).
var errAmbiguousKey = errors.New("ambiguous key")

// errNULString is wrapped by the error about a string value of the
// runtime's input that holds a NUL character, which OCI runtimes read
// differently (checkKeys).
var errNULString = errors.New("NUL character in a string")

// keySchema names the fields of a JSON object that the hook reads, each
// with the schema of its value: nil for a value whose keys are not fields
// (a map such as annotations) or that has none (a string, a list of
// strings). The schema of a list is that of its elements.
type keySchema map[string]keySchema

var (
	// hookEntryKeys are the keys of a hook's entry in the spec.
	hookEntryKeys = keySchema{"path": nil, "args": nil, "timeout": nil}
	// specKeys are the fields of hookSpec, and the poststop hooks (the
	// hook's other phase: a "Poststop" runs it under runc, not crun; and
	// add-hooks looks there for the guard's entry).
	specKeys = keySchema{
		"process": {"env": nil, "capabilities": {"bounding": nil}},
		"root":    {"path": nil, "readonly": nil},
		"mounts":  {"destination": nil, "source": nil, "type": nil, "options": nil},
		"linux": {
			"devices":     {"path": nil, "type": nil, "major": nil, "minor": nil},
			"cgroupsPath": nil,
			"resources":   {"devices": {"allow": nil, "type": nil, "major": nil, "minor": nil, "access": nil}},
			"namespaces":  {"type": nil, "path": nil},
		},
		"annotations": nil,
		"hooks":       {"createRuntime": hookEntryKeys, "poststop": hookEntryKeys},
	}
	// stateKeys are the fields of specs.State.
	stateKeys = keySchema{"ociVersion": nil, "id": nil, "status": nil, "pid": nil, "bundle": nil, "annotations": nil}
)

// CheckSpecKeys returns the error create-runtime gives for a config.json
// (data) that OCI runtimes read in more than one way (checkKeys), nil for
// one they all read alike, or that is not valid JSON. For a tool that edits
// the spec's hooks (nri-gpu-guard-hook add-hooks): an edit by key would
// pick one of two readings of such a file, and hide the other.
func CheckSpecKeys(data []byte) error {
	return checkKeys(data, specKeys)
}

// maxKeyDepth bounds the nesting checkKeys follows: encoding/json refuses
// deeper input as well.
const maxKeyDepth = 10000

// checkKeys refuses a JSON text (the spec, or the OCI state) that OCI
// runtimes can read in more than one way: an object that repeats a key
// (Go's encoding/json, runc's, keeps the last and merges two objects;
// crun's parser keeps the first), or a key that differs from a field of
// schema at its level only in case (encoding/json matches it to the field,
// crun ignores it). The hook would read one container and the runtime
// create another: a spec that names a GPU in its first "linux" and none in
// its second reaches the GPU under crun while the hook claims nothing.
// Runtimes and engines write config.json with one key each, spelled as the
// runtime spec does, so only a spec written by hand (or to get round the
// guard) is refused.
//
// It refuses as well a key or a string value that holds U+0000 (only an
// escape, \u0000, can put one in JSON): crun's parser hands C strings on,
// which end at the NUL, and compares keys with strcmp, so crun reads
// "linux\u0000" as "linux" (the first of two "linux" keys, the one the hook
// never sees) and a bind source "/dev\u0000x" as "/dev", where encoding/json
// reads an unknown key and a path no file has.
//
// Keys are compared as encoding/json compares them: unescaped (invalid
// UTF-8 as U+FFFD), and folded as bytes.EqualFold does for the case.
// A text that is not valid JSON is left to the decoder that follows, which
// says what is wrong. The walk decodes no value (it runs wherever the fast
// decoder gave up, on a string with an escape for one: a URL with & in an
// environment variable, as Go's encoder writes it, \u0026).
func checkKeys(data []byte, schema keySchema) error {
	w := keyWalk{s: jscan{b: data}}
	err := w.value(schema, 0)
	if refusedText(err) {
		return err
	}
	return nil
}

// refusedText reports whether err, from checkKeys' walk, refuses the
// text (rather than leave a text that is not JSON to encoding/json).
func refusedText(err error) bool {
	return errors.Is(err, errAmbiguousKey) || errors.Is(err, errNULString) || errors.Is(err, errTooDeep)
}

var (
	errTooDeep = fmt.Errorf("JSON nested deeper than %d levels", maxKeyDepth)
	// errNotJSON stops checkKeys' walk; what is wrong is encoding/json's
	// to say.
	errNotJSON = errors.New("not JSON")
)

// keyWalk walks a JSON text for checkKeys: s scans it (its bad is never
// read: every method here checks what it consumes), path is where the
// walk is, keys the keys of the objects on it so far (a small object's
// repeated key is found without a map).
type keyWalk struct {
	s    jscan
	path []pathStep
	keys [][]byte
}

// pathStep is a key, or the index of a list's element.
type pathStep struct {
	key   []byte
	index int
	elem  bool
}

// smallObject is the number of keys up to which an object's keys are
// compared one by one: most objects of a spec have a handful.
const smallObject = 16

func (w *keyWalk) value(schema keySchema, depth int) error {
	s := &w.s
	s.ws()
	if s.i >= len(s.b) {
		return errNotJSON
	}
	switch c := s.b[s.i]; {
	case c == '{':
		s.i++
		return w.object(schema, depth+1)
	case c == '[':
		s.i++
		return w.array(schema, depth+1)
	case c == '"':
		start := s.i
		raw, escaped, err := w.str()
		if err != nil || !escaped || !nulEscape(raw) {
			return err
		}
		var v string
		if err := json.Unmarshal(s.b[start:s.i], &v); err != nil {
			return errNotJSON
		}
		return nulString(v, w.path)
	case c == 't':
		s.lit("true")
	case c == 'f':
		s.lit("false")
	case c == 'n':
		s.lit("null")
	case c == '-' || ('0' <= c && c <= '9'):
		s.number()
	default:
		return errNotJSON
	}
	if s.bad {
		return errNotJSON
	}
	return nil
}

// str consumes a string: its bytes between the quotes, and whether they
// hold an escape (which str skips, never checks: encoding/json does).
func (w *keyWalk) str() (raw []byte, escaped bool, err error) {
	s := &w.s
	start := s.i + 1
	for j := start; j < len(s.b); j++ {
		switch c := s.b[j]; {
		case c == '"':
			s.i = j + 1
			return s.b[start:j], escaped, nil
		case c == '\\':
			escaped = true
			j++ // the escaped byte, which may be a quote
		case c < 0x20:
			return nil, false, errNotJSON
		}
	}
	return nil, false, errNotJSON
}

// nulEscape reports whether raw, a JSON string's bytes between the quotes,
// holds the escape \u0000 (a NUL: the only way one is written in JSON, which
// refuses control characters as they are). An escaped backslash followed by
// "u0000" (\\u0000) is no NUL.
func nulEscape(raw []byte) bool {
	for j := 0; j < len(raw)-1; j++ {
		if raw[j] != '\\' {
			continue
		}
		if raw[j+1] == 'u' && j+6 <= len(raw) && string(raw[j+2:j+6]) == "0000" {
			return true
		}
		j++ // the escaped byte: a backslash escaped is no escape's start
	}
	return false
}

// key consumes an object's key and returns it as encoding/json decodes it.
func (w *keyWalk) key() ([]byte, error) {
	start := w.s.i
	raw, escaped, err := w.str()
	if err != nil {
		return nil, err
	}
	if !escaped && utf8.Valid(raw) {
		return raw, nil
	}
	// Rare: decoded by encoding/json itself, so that every escape and
	// invalid byte comes out as it does there.
	var k string
	if err := json.Unmarshal(w.s.b[start:w.s.i], &k); err != nil {
		return nil, errNotJSON
	}
	return []byte(k), nil
}

// next consumes the separator after a member or an element: true for a
// comma, false for the closing byte.
func (w *keyWalk) next(closing byte) (more bool, err error) {
	s := &w.s
	s.ws()
	if s.i < len(s.b) {
		switch s.b[s.i] {
		case ',':
			s.i++
			return true, nil
		case closing:
			s.i++
			return false, nil
		}
	}
	return false, errNotJSON
}

func (w *keyWalk) object(schema keySchema, depth int) error {
	if depth > maxKeyDepth {
		return errTooDeep
	}
	s := &w.s
	if s.peek() == '}' {
		s.i++
		return nil
	}
	base := len(w.keys)
	defer func() { w.keys = w.keys[:base] }()
	var seen map[string]bool // for a large object
	for {
		if s.peek() != '"' {
			return errNotJSON
		}
		key, err := w.key()
		if err != nil {
			return err
		}
		if s.peek() != ':' {
			return errNotJSON
		}
		s.i++
		if bytes.IndexByte(key, 0) >= 0 {
			return nulKey(string(key), w.path)
		}
		if w.repeated(base, &seen, key) {
			return repeatedKey(string(key), w.path)
		}
		child, known := schema[string(key)]
		if !known {
			for name := range schema {
				if strings.EqualFold(string(key), name) {
					return caseVariant(string(key), name, w.path)
				}
			}
		}
		w.path = append(w.path, pathStep{key: key})
		if err := w.value(child, depth); err != nil {
			return err
		}
		w.path = w.path[:len(w.path)-1]
		if more, err := w.next('}'); !more || err != nil {
			return err
		}
	}
}

// repeated records key, a key of the object whose keys start at
// w.keys[base], and reports whether the object had it already.
func (w *keyWalk) repeated(base int, seen *map[string]bool, key []byte) bool {
	if *seen != nil {
		if (*seen)[string(key)] {
			return true
		}
		(*seen)[string(key)] = true
		return false
	}
	for _, k := range w.keys[base:] {
		if bytes.Equal(k, key) {
			return true
		}
	}
	w.keys = append(w.keys, key)
	if len(w.keys)-base > smallObject {
		*seen = make(map[string]bool, 2*smallObject)
		for _, k := range w.keys[base:] {
			(*seen)[string(k)] = true
		}
	}
	return false
}

func (w *keyWalk) array(schema keySchema, depth int) error {
	if depth > maxKeyDepth {
		return errTooDeep
	}
	if w.s.peek() == ']' {
		w.s.i++
		return nil
	}
	for i := 0; ; i++ {
		w.path = append(w.path, pathStep{index: i, elem: true})
		if err := w.value(schema, depth); err != nil {
			return err
		}
		w.path = w.path[:len(w.path)-1]
		if more, err := w.next(']'); !more || err != nil {
			return err
		}
	}
}

// repeatedKey is the error about key, repeated in the object at path.
func repeatedKey(key string, path []pathStep) error {
	return fmt.Errorf("%w %q: it appears twice in %s, and OCI runtimes disagree on which one counts "+
		"(runc takes the last, crun the first): write each key once", errAmbiguousKey, key, where(path))
}

// caseVariant is the error about key, in the object at path, which
// differs from the field name only in case.
func caseVariant(key, name string, path []pathStep) error {
	return fmt.Errorf("%w %q in %s: it differs from the field %q only in case, which runc reads as %q and crun ignores: spell it %q",
		errAmbiguousKey, key, where(path), name, name, name)
}

// nulKey is the error about key, in the object at path, which holds a NUL.
func nulKey(key string, path []pathStep) error {
	crun, _, _ := strings.Cut(key, "\x00")
	return fmt.Errorf("%w %q in %s: it holds a NUL character (\\u0000), where crun ends the key: crun reads it as %q, runc as "+
		"a key of its own, so they disagree on what the container gets: remove the NUL", errAmbiguousKey, key, where(path), crun)
}

// nulString is the error about the string value s, at path, which holds a
// NUL.
func nulString(s string, path []pathStep) error {
	at := "the top-level value"
	if len(path) > 0 {
		at = where(path)
	}
	crun, _, _ := strings.Cut(s, "\x00")
	return fmt.Errorf("%w: the string %q at %s holds a NUL character (\\u0000), where crun ends the string: crun reads %q, runc "+
		"the whole string, so they disagree on what the container gets: remove the NUL", errNULString, s, at, crun)
}

// where names the object at path: "the top-level object", or its path
// such as linux.devices[0].
func where(path []pathStep) string {
	if len(path) == 0 {
		return "the top-level object"
	}
	var b strings.Builder
	for i, p := range path {
		switch {
		case p.elem:
			b.WriteString("[" + strconv.Itoa(p.index) + "]")
		case i > 0:
			b.WriteString("." + string(p.key))
		default:
			b.Write(p.key)
		}
	}
	return b.String()
}

// fileType names the type of a non-regular file as fs.FileMode does.
func fileType(mode uint32) fs.FileMode {
	switch mode & syscall.S_IFMT {
	case syscall.S_IFDIR:
		return fs.ModeDir
	case syscall.S_IFIFO:
		return fs.ModeNamedPipe
	case syscall.S_IFSOCK:
		return fs.ModeSocket
	case syscall.S_IFLNK:
		return fs.ModeSymlink
	case syscall.S_IFCHR:
		return fs.ModeDevice | fs.ModeCharDevice
	case syscall.S_IFBLK:
		return fs.ModeDevice
	}
	return fs.ModeIrregular
}

// CRI annotations naming the pod and container. containerd's CRI plugin and
// CRI-O use different keys; both are read so that a hook container run by
// either shows up in the ledger as namespace/pod/container.
var (
	annNamespace = []string{"io.kubernetes.cri.sandbox-namespace", "io.kubernetes.pod.namespace"}
	annPod       = []string{"io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"}
	annPodUID    = []string{"io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"}
	annContainer = []string{"io.kubernetes.cri.container-name", "io.kubernetes.container.name"}
	annSandboxID = []string{"io.kubernetes.cri.sandbox-id", "io.kubernetes.cri-o.SandboxID"}
)

// OwnerFrom builds the ledger identity create-runtime records for the
// container: its id, its pod when CRI annotations name one, its pid (with
// start time pidStart, against pid reuse) and the cgroup the spec names. The
// annotations of the spec win over those of the state; both come from the
// same runtime. A claim adopted from the runtime's own state (gpu-guard-ctl
// recover) must look like this to be the same holder.
//
// The cgroup is the spec's linux.cgroupsPath as written, unverified: it is
// written by whoever creates the container, and a runtime that creates no
// cgroup (crun --cgroup-manager=disabled, rootless runc without delegation)
// leaves the process elsewhere. The liveness check decides on a recorded
// cgroup alone, so an empty one named there would release a running
// holder's claim: a caller that records the owner of a process it can read
// replaces it with what VerifiedCgroup (create-runtime: holderCgroup)
// finds.
func OwnerFrom(st specs.State, spec *specs.Spec, pidStart uint64) ledger.Owner {
	ann := func(keys []string) string {
		for _, k := range keys {
			if spec != nil {
				if v, ok := spec.Annotations[k]; ok && v != "" {
					return guard.BoundLabel(v)
				}
			}
			if v, ok := st.Annotations[k]; ok && v != "" {
				return guard.BoundLabel(v)
			}
		}
		return ""
	}
	o := ledger.Owner{
		ContainerID:  st.ID,
		Container:    ann(annContainer),
		Namespace:    ann(annNamespace),
		Pod:          ann(annPod),
		PodUID:       ann(annPodUID),
		PodSandboxID: ann(annSandboxID),
		FrontEnd:     ledger.FrontEndHook,
		Pid:          st.Pid,
		PidStart:     pidStart,
	}
	o.Cgroup = guard.BoundCgroup(specCgroup(spec))
	return o
}

// specCgroup is the spec's linux.cgroupsPath ("" when it names none).
func specCgroup(spec *specs.Spec) string {
	if spec == nil || spec.Linux == nil {
		return ""
	}
	return spec.Linux.CgroupsPath
}

// VerifiedCgroup returns the first of cgroupsPaths (a runtime's cgroups
// paths: cgroupfs "/k8s.io/<id>" or systemd "<slice>:<prefix>:<name>") that
// the process pid of container id is verifiably in, bounded by
// guard.BoundCgroup; "" when it is in none of them or its cgroup cannot be
// read. The process's cgroup is read from procRoot/<pid>/cgroup on the
// hierarchy liveness.ProcessCgroup picks, the one the liveness check looks
// a recorded path up in first. Only a cgroup so verified may be recorded as
// a holder's: the liveness check reads an existing cgroup without processes
// as "exited" whatever the pid says.
func VerifiedCgroup(procRoot string, pid int, id string, cgroupsPaths ...string) string {
	if pid <= 0 {
		return ""
	}
	cg, err := liveness.ProcessCgroup(procRoot, pid)
	if err != nil {
		return ""
	}
	return verifiedCgroup(cg, id, cgroupsPaths...)
}

// verifiedCgroup is VerifiedCgroup with the process's cgroup cg read.
func verifiedCgroup(cg, id string, cgroupsPaths ...string) string {
	for _, p := range cgroupsPaths {
		if p == "" || !inCgroup(cg, p, id) {
			continue
		}
		if b := guard.BoundCgroup(p); b != "" {
			return b
		}
	}
	return ""
}

// inCgroup reports whether cg, the cgroup of container id's process as
// /proc/<pid>/cgroup names it, is the cgroup cgroupsPath names or, when
// that one is the container's own by its name (namesContainer), one below
// it: crun's systemd driver puts the process in a "container" cgroup below
// its scope.
// Either way the named cgroup holds the process, so the liveness check
// cannot read it as empty while the process runs. A shared cgroup above the
// process (a login session's, a user's slice) is not accepted: the GPU
// observer would count everything below it as the holder's.
func inCgroup(cg, cgroupsPath, id string) bool {
	rel, err := liveness.CgroupPath(cgroupsPath)
	if err != nil {
		return false
	}
	cg = path.Clean(cg)
	if cg == rel {
		return true
	}
	if !strings.HasPrefix(cg, rel+"/") {
		return false
	}
	return namesContainer(path.Base(rel), id)
}
