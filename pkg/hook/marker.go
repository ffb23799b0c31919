// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// Container markers. poststop must not trust the bundle's config.json it
// reads: plain runc (create, start, delete) runs poststop long after create,
// and a config.json edited meanwhile to name no GPU would make poststop skip
// the release of a claim create-runtime made (a ghost claim; under
// release_on = "remove" nothing else ends it). Yet a container whose spec
// names no GPU must not read the ledger in poststop: that is most
// containers, twice per container (docs/benchmarks.md).
//
// So create-runtime, before it writes anything to the ledger for a container
// (a claim, a queue entry, a ticket's hand-over), leaves a marker, a small
// file named after the container's id and bundle in DefaultMarkerDir, and
// poststop takes its short cut (spec names no GPU) only when no marker
// exists: one stat. A marker says only "read the ledger": poststop then
// goes the usual way, deciding under the ledger lock and by incarnation
// (pid and start time) what is this container's; nothing is ever released
// because a marker exists or on what it says. A stale marker costs a
// ledger read and is removed by that poststop.
//
// The markers live in the ledger's per-boot runtime dir
// (ledger.DefaultRuntimeDir, a tmpfs), not in the state dir: a hook binary
// knows that path without loading the configuration (parsing it is about a
// fifth of a hook's run time), and like the runtimes' own state (/run/runc)
// the markers are gone after a reboot, when every container is.
//
// Removal never loses the marker of a container that is in the ledger. A
// writer (create-runtime) writes the marker before its first ledger write
// and checks it is still there after it (ensure); a remover (poststop, a
// refused create-runtime, SweepMarkers) removes it first and then reads the
// ledger, and puts it back if the id still appears there. Whichever order
// their steps take, one of them sees the other.

// PoststopAnnotation is the annotation that, set to "on", opts a container
// into the poststop on a host that runs the createRuntime hook alone ([hook]
// poststop = false): the shipped mask of the poststop definition
// (packaging/oci-hooks.d/one-hook) runs it for such containers only. Such a container gets its marker as on
// a host with both hooks, so that its poststop finds a claim its spec does
// not show (one made because no device cgroup applies to it).
const PoststopAnnotation = "io.nri-gpu-guard.poststop"

// optsIntoPoststop reports whether the container's spec carries
// PoststopAnnotation = "on" (the engines match hooks.d conditions against
// the spec's annotations).
func (in *Input) optsIntoPoststop() bool {
	return in.spec != nil && in.spec.Annotations[PoststopAnnotation] == "on"
}

// DefaultMarkerDir holds the container markers: in the ledger's per-boot
// runtime dir, root-only.
const DefaultMarkerDir = ledger.DefaultRuntimeDir + "/hook-containers"

// markerDir is DefaultMarkerDir, or a test's own dir.
var markerDir = DefaultMarkerDir

// markerPrefix starts the name of every marker file.
const markerPrefix = "c-"

// maxMarkerBytes bounds a marker's content (the bundle path is the runtime's).
const maxMarkerBytes = 64 << 10

// markerRecord is a marker's content: what the sweep needs (which ledger,
// which container) and what an operator looking at the file wants to see.
// None of it decides a release. On disk it is markerHeader, then one line
// each for the ledger dir and the container id, then the bundle (the rest of
// the file): written without encoding/json, whose set-up would cost a hook
// process more than the rest of the marker's work.
type markerRecord struct {
	ID     string
	Bundle string
	Ledger string
}

const markerHeader = "nri-gpu-guard hook container marker v1\n"

func (r markerRecord) encode() []byte {
	return []byte(markerHeader + "ledger " + r.Ledger + "\nid " + r.ID + "\nbundle " + r.Bundle)
}

func decodeMarkerRecord(data []byte) (markerRecord, bool) {
	rest, ok := strings.CutPrefix(string(data), markerHeader)
	if !ok {
		return markerRecord{}, false
	}
	lines := strings.SplitN(rest, "\n", 3)
	if len(lines) != 3 {
		return markerRecord{}, false
	}
	l, ok1 := strings.CutPrefix(lines[0], "ledger ")
	id, ok2 := strings.CutPrefix(lines[1], "id ")
	b, ok3 := strings.CutPrefix(lines[2], "bundle ")
	if !ok1 || !ok2 || !ok3 || l == "" || id == "" {
		return markerRecord{}, false
	}
	return markerRecord{ID: id, Bundle: b, Ledger: l}, true
}

// marker is the marker of one container.
type marker struct {
	dir  string
	path string
	rec  markerRecord
}

// markerName is the file name of the marker of container id in bundle: a
// hash, since the id and the bundle are the runtime's words. Two containers
// of one id (two runtime roots) have two bundles and two markers.
func markerName(id, bundle string) string {
	sum := sha256.Sum256([]byte(id + "\x00" + filepath.Clean(bundle)))
	return markerPrefix + hex.EncodeToString(sum[:16])
}

func newMarker(dir string, st specs.State, ledgerDir string) marker {
	if dir == "" {
		dir = markerDir
	}
	return marker{dir: dir, path: filepath.Join(dir, markerName(st.ID, st.Bundle)),
		rec: markerRecord{ID: st.ID, Bundle: st.Bundle, Ledger: filepath.Clean(ledgerDir)}}
}

// Marked reports whether the container of in has a marker in
// DefaultMarkerDir: its create-runtime hook wrote to the ledger for it, so
// its poststop reads the ledger whatever its config.json says now. One stat;
// an answer other than "does not exist" counts as marked.
func Marked(in *Input) bool {
	if in.stateErr != nil {
		return true
	}
	return markerExists(filepath.Join(markerDir, markerName(in.state.ID, in.state.Bundle)))
}

func markerExists(path string) bool {
	var st syscall.Stat_t
	err := syscall.Lstat(path, &st)
	return !errors.Is(err, syscall.ENOENT) && !errors.Is(err, syscall.ENOTDIR)
}

func (m marker) exists() bool { return markerExists(m.path) }

// write creates (or rewrites) the marker, creating the marker dir (0700) if
// needed. The dir must be a directory of this user's, writable by nobody
// else, as the ledger requires of its runtime dir.
func (m marker) write() error {
	if err := ensurePrivateDir(filepath.Dir(m.dir)); err != nil {
		return err
	}
	if err := ensurePrivateDir(m.dir); err != nil {
		return err
	}
	// With syscall, not os.OpenFile: a descriptor os opens starts the
	// runtime's poller, which costs a hook process more than the write.
	fd, err := syscall.Open(m.path, syscall.O_WRONLY|syscall.O_CREAT|syscall.O_TRUNC|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("write the container marker %s: %w", m.path, err)
	}
	data := m.rec.encode()
	n, err := syscall.Write(fd, data)
	if err == nil && n != len(data) {
		err = syscall.EIO
	}
	if cerr := syscall.Close(fd); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write the container marker %s: %w", m.path, err)
	}
	return nil
}

// ensure writes the marker again if it is gone (a remover's step between
// this writer's first write and its ledger write: see above).
func (m marker) ensure() error {
	if m.exists() {
		return nil
	}
	return m.write()
}

// remove removes the marker and reports whether there was one.
func (m marker) remove() bool {
	return os.Remove(m.path) == nil
}

// ensurePrivateDir creates dir (0700) if it does not exist and checks it: a
// directory, not a symlink, owned by this user and writable by nobody else.
func ensurePrivateDir(dir string) error {
	fi, err := os.Lstat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("create %s: %w", dir, err)
		}
		fi, err = os.Lstat(dir)
	}
	if err != nil {
		return fmt.Errorf("marker dir %s: %w", dir, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("%w: %s is not a directory (a symlink?)", ledger.ErrUnsafeDir, dir)
	}
	if sys, ok := fi.Sys().(*syscall.Stat_t); ok && int(sys.Uid) != os.Geteuid() {
		return fmt.Errorf("%w: %s is owned by uid %d, not by this user (uid %d)", ledger.ErrUnsafeDir, dir, sys.Uid, os.Geteuid())
	}
	if fi.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("%w: %s is writable by group or others (mode %v)", ledger.ErrUnsafeDir, dir, fi.Mode().Perm())
	}
	return nil
}

// settleMarker is the remover's side for container id, whose marker m was
// removed (removed) before the ledger was read: it is put back when the
// ledger may still hold something of the id (keep), so that a later
// poststop of the id still reads the ledger. Failing to put it back is
// reported on stderr.
func settleMarker(m marker, removed, keep bool, report func(error)) {
	if !removed || !keep {
		return
	}
	if err := m.write(); err != nil && report != nil {
		report(err)
	}
}

// SweepMarkers removes from dir (DefaultMarkerDir when empty) the markers of
// the ledger in ledgerDir whose container appears nowhere in that ledger
// (no claim, conflict record or queue entry): markers of containers that
// never reached poststop (a create that failed after its hook admitted it,
// under podman; a crashed hook). snapshot reads the ledger without the lock;
// it is read again after the removals, and a marker whose container appears
// by then is put back. It returns how many markers it removed for good. A
// marker of another ledger, or one that does not decode, is left alone.
func SweepMarkers(ctx context.Context, dir, ledgerDir string, snapshot func(context.Context) (ledger.State, error)) (int, error) {
	if dir == "" {
		dir = DefaultMarkerDir
	}
	return sweepMarkers(ctx, dir, ledgerDir, "", snapshot)
}

// sweepMarkers is SweepMarkers over dir for the markers of container id
// only ("": of every container).
func sweepMarkers(ctx context.Context, dir, ledgerDir, id string, snapshot func(context.Context) (ledger.State, error)) (int, error) {
	ledgerDir = filepath.Clean(ledgerDir)
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("list the container markers: %w", err)
	}
	st, err := snapshot(ctx)
	if err != nil {
		return 0, err
	}
	var removed []marker
	for _, e := range entries {
		if !e.Type().IsRegular() || !strings.HasPrefix(e.Name(), markerPrefix) {
			continue
		}
		m, ok := readMarker(filepath.Join(dir, e.Name()))
		if !ok || filepath.Clean(m.rec.Ledger) != ledgerDir || (id != "" && m.rec.ID != id) {
			continue
		}
		if holds, waits := appears(st, m.rec.ID); holds || waits {
			continue
		}
		m.dir = dir
		if m.remove() {
			removed = append(removed, m)
		}
	}
	if len(removed) == 0 {
		return 0, nil
	}
	st, err = snapshot(ctx)
	n := 0
	var errs []error
	for _, m := range removed {
		if holds, waits := appears(st, m.rec.ID); err == nil && !holds && !waits {
			n++
			continue
		}
		if werr := m.write(); werr != nil {
			errs = append(errs, werr)
		}
	}
	if err != nil {
		errs = append(errs, fmt.Errorf("read the ledger again after removing container markers (they were put back): %w", err))
	}
	return n, errors.Join(errs...)
}

// readMarker reads the marker file at path.
func readMarker(path string) (marker, bool) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0) //nolint:gosec // a file of the marker dir
	if err != nil {
		return marker{}, false
	}
	defer func() { _ = f.Close() }()
	data, err := io.ReadAll(io.LimitReader(f, maxMarkerBytes))
	if err != nil {
		return marker{}, false
	}
	rec, ok := decodeMarkerRecord(data)
	if !ok {
		return marker{}, false
	}
	return marker{path: path, rec: rec}, true
}

// RemoveMarkersUnder removes from dir (DefaultMarkerDir when empty) the
// markers of containers whose bundle is at or below root, and returns how
// many it removed: for a test suite that made containers in a temp root
// and deletes it (see internal/testtmp for the ledger's boot markers).
func RemoveMarkersUnder(dir, root string) (int, error) {
	if dir == "" {
		dir = DefaultMarkerDir
	}
	if !filepath.IsAbs(root) {
		return 0, fmt.Errorf("remove container markers under %q: not an absolute path", root)
	}
	root = filepath.Clean(root)
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("list the container markers: %w", err)
	}
	n := 0
	for _, e := range entries {
		if !e.Type().IsRegular() || !strings.HasPrefix(e.Name(), markerPrefix) {
			continue
		}
		m, ok := readMarker(filepath.Join(dir, e.Name()))
		if !ok {
			continue
		}
		if b := filepath.Clean(m.rec.Bundle); b == root || strings.HasPrefix(b, root+"/") {
			if m.remove() {
				n++
			}
		}
	}
	return n, nil
}
