// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Runtimes tells whether the OCI runtimes of this host still know a
// container: the evidence that an OCI hook holder's container was deleted
// (see ReleasableIdle). The default is RuntimeRoots over [hook]
// runtime_roots.
type Runtimes interface {
	// Deleted reports whether no runtime knows container id any more, with
	// a short reason either way. It must answer false when in doubt (a
	// root that cannot be read): a claim is never released on doubt; then
	// unsure is true and why says what could not be told. listedIn is the
	// root that still has the container, when one does: where an operator
	// deletes it should its engine have forgotten it.
	Deleted(id string) (deleted, unsure bool, why, listedIn string)
}

// RuntimeRoots is Runtimes over the state roots of the OCI runtimes (runc's
// /run/runc, which podman uses too, crun's /run/crun: [hook] runtime_roots),
// each of which holds one entry per container id, from the moment the
// runtime starts creating it (before its createRuntime hooks run) until
// `runc delete`/`crun delete`, which runs the poststop hooks of its
// config.json (podman runs those of hooks.d itself, after it). An engine
// that cleans a container up deletes it there: podman does so once the
// container exited, and at `podman rm`.
//
// It reads only the few entries it is asked about: one lstat of each root and
// one of <root>/<id>, never a listing (a hook runs it inside the engine's
// create). Nothing is followed as a symlink, as package runtimestate reads
// the same roots.
type RuntimeRoots []string

// Deleted reports whether no root has an entry for container id. A root
// that does not exist is that of a runtime not used here and knows nothing;
// but one at least must exist (else the runtime that ran the container is
// not among the roots). A root that cannot be read, is a symlink or is not
// a directory, or an entry that cannot be stat'ed, leaves it unsure: kept.
func (r RuntimeRoots) Deleted(id string) (deleted, unsure bool, why, listedIn string) {
	if len(r) == 0 {
		return false, true, "hook.runtime_roots is empty: no runtime state is read", ""
	}
	if id == "" || id == "." || id == ".." || strings.ContainsAny(id, "/\x00") {
		return false, true, "container id " + quoteID(id) + " is no runtime's directory name", ""
	}
	var read []string
	for _, root := range r {
		root = filepath.Clean(root)
		fi, err := os.Lstat(root)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			continue // a runtime not used on this host
		case err != nil:
			return false, true, "runtime root " + root + " cannot be read: " + errText(err), ""
		case fi.Mode()&fs.ModeSymlink != 0:
			return false, true, "runtime root " + root + " is a symlink: not followed", ""
		case !fi.IsDir():
			return false, true, "runtime root " + root + " is not a directory", ""
		}
		_, err = os.Lstat(filepath.Join(root, id))
		switch {
		case err == nil:
			return false, false, "runtime root " + root + " still has container " + id, root
		case !errors.Is(err, fs.ErrNotExist):
			return false, true, "runtime root " + root + ": container " + id + " cannot be looked up: " + errText(err), ""
		}
		read = append(read, root)
	}
	if len(read) == 0 {
		return false, true, "none of hook.runtime_roots (" + strings.Join(r, ", ") + ") exists here", ""
	}
	return true, false, "no runtime knows container " + id + " any more (" + strings.Join(read, ", ") + ")", ""
}

// errText is err without the path an fs.PathError repeats.
func errText(err error) string {
	if pe, ok := errors.AsType[*fs.PathError](err); ok {
		return pe.Err.Error()
	}
	return err.Error()
}

// quoteID quotes a container id for a message, bounded.
func quoteID(id string) string {
	if len(id) > 80 {
		id = id[:80]
	}
	return strconv.Quote(id)
}
