// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Media types and annotations of the OCI image specification (v1.0) that
// containerd's importer understands.
const (
	mediaTypeIndex    = "application/vnd.oci.image.index.v1+json"
	mediaTypeManifest = "application/vnd.oci.image.manifest.v1+json"
	mediaTypeConfig   = "application/vnd.oci.image.config.v1+json"
	mediaTypeLayer    = "application/vnd.oci.image.layer.v1.tar+gzip"

	// annotationImageName is what `ctr images import` names the image after.
	annotationImageName = "io.containerd.image.name"
	// annotationRefName is the OCI layout's own reference (the tag).
	annotationRefName = "org.opencontainers.image.ref.name"

	defaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
)

// epoch is the timestamp of every tar entry: a fixed value keeps the output
// reproducible, so equal inputs give equal digests (and the cache key of the
// tests' image is its content).
var epoch = time.Unix(0, 0).UTC()

// FileSpec is one host file copied into the image layer.
type FileSpec struct {
	// Src is the host path; symlinks are followed.
	Src string
	// Dst is the absolute path inside the image.
	Dst string
	// Mode is the permission of Dst; zero takes the permission of Src.
	Mode fs.FileMode
}

// ParseFileSpec parses the SRC:DST[:MODE] form of the --file flag. MODE is
// octal (e.g. 0755).
func ParseFileSpec(s string) (FileSpec, error) {
	parts := strings.Split(s, ":")
	var fsp FileSpec
	switch len(parts) {
	case 2:
		fsp = FileSpec{Src: parts[0], Dst: parts[1]}
	case 3:
		m, err := strconv.ParseUint(parts[2], 8, 32)
		if err != nil || m == 0 || m > 0o7777 {
			return FileSpec{}, fmt.Errorf("file %q: mode %q is not an octal permission like 0755", s, parts[2])
		}
		fsp = FileSpec{Src: parts[0], Dst: parts[1], Mode: fs.FileMode(m)}
	default:
		return FileSpec{}, fmt.Errorf("file %q: want SRC:DST[:MODE]", s)
	}
	if fsp.Src == "" {
		return FileSpec{}, fmt.Errorf("file %q: empty source path", s)
	}
	if err := checkImagePath(fsp.Dst); err != nil {
		return FileSpec{}, fmt.Errorf("file %q: %w", s, err)
	}
	return fsp, nil
}

// checkImagePath accepts only absolute, clean paths below the root, so that
// no entry can escape the layer or collide with another under a second name.
func checkImagePath(p string) error {
	if !strings.HasPrefix(p, "/") || p == "/" || path.Clean(p) != p {
		return fmt.Errorf("destination %q must be an absolute, clean path below /", p)
	}
	return nil
}

// Spec describes the image to build.
type Spec struct {
	// Names are the image references to record (at least one); each becomes
	// one manifest entry of index.json, all pointing at the same manifest.
	Names []string
	Files []FileSpec
	// Entrypoint and Cmd become the image config's Entrypoint and Cmd.
	Entrypoint []string
	Cmd        []string
	// Env entries are KEY=VALUE; PATH is added unless given.
	Env        []string
	WorkingDir string
	OS         string
	Arch       string
	// LibraryDeps copies the shared libraries of every file into the layer.
	LibraryDeps bool
	// LDD lists the shared libraries (absolute host paths, loader included)
	// a binary needs; nil runs the host's ldd. Tests inject a fake.
	LDD func(binary string) ([]string, error)
}

// Descriptor is an OCI content descriptor.
type Descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
	Platform    *Platform         `json:"platform,omitempty"`
}

// Platform is the OS and architecture an image runs on.
type Platform struct {
	Architecture string `json:"architecture"`
	OS           string `json:"os"`
}

// Index is the OCI layout's index.json.
type Index struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Manifests     []Descriptor `json:"manifests"`
}

// Manifest is an OCI image manifest.
type Manifest struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Config        Descriptor   `json:"config"`
	Layers        []Descriptor `json:"layers"`
}

// ImageConfig is the OCI image configuration.
type ImageConfig struct {
	Architecture string        `json:"architecture"`
	OS           string        `json:"os"`
	Config       RuntimeConfig `json:"config"`
	RootFS       RootFS        `json:"rootfs"`
	History      []History     `json:"history,omitempty"`
}

// RuntimeConfig is the execution part of ImageConfig.
type RuntimeConfig struct {
	Entrypoint []string `json:"Entrypoint,omitempty"`
	Cmd        []string `json:"Cmd,omitempty"`
	Env        []string `json:"Env,omitempty"`
	WorkingDir string   `json:"WorkingDir,omitempty"`
}

// RootFS lists the layers by their uncompressed digest.
type RootFS struct {
	Type    string   `json:"type"`
	DiffIDs []string `json:"diff_ids"`
}

// History records how a layer was made.
type History struct {
	CreatedBy string `json:"created_by,omitempty"`
}

// Result reports the digests of what Build wrote.
type Result struct {
	Manifest Descriptor
	Config   Descriptor
	Layer    Descriptor
	DiffID   string
	// Files are the image paths in the layer (regular files only), sorted.
	Files []string
}

// layerFile is one regular file of the layer.
type layerFile struct {
	src  string
	dst  string
	mode fs.FileMode
}

// Build writes the OCI image layout tar for s to w.
func Build(w io.Writer, s Spec) (Result, error) {
	if err := s.validate(); err != nil {
		return Result{}, err
	}
	files, err := s.layerFiles()
	if err != nil {
		return Result{}, err
	}
	layer, diffID, err := buildLayer(files)
	if err != nil {
		return Result{}, err
	}
	layerDesc := Descriptor{MediaType: mediaTypeLayer, Digest: digestOf(layer), Size: int64(len(layer))}

	env := append([]string(nil), s.Env...)
	if !hasKey(env, "PATH") {
		env = append([]string{defaultPath}, env...)
	}
	cfg := ImageConfig{
		Architecture: s.Arch,
		OS:           s.OS,
		Config: RuntimeConfig{
			Entrypoint: s.Entrypoint,
			Cmd:        s.Cmd,
			Env:        env,
			WorkingDir: s.WorkingDir,
		},
		RootFS:  RootFS{Type: "layers", DiffIDs: []string{diffID}},
		History: []History{{CreatedBy: "ociimage"}},
	}
	cfgJSON, err := json.Marshal(cfg)
	if err != nil {
		return Result{}, fmt.Errorf("encode image config: %w", err)
	}
	cfgDesc := Descriptor{MediaType: mediaTypeConfig, Digest: digestOf(cfgJSON), Size: int64(len(cfgJSON))}

	man := Manifest{SchemaVersion: 2, MediaType: mediaTypeManifest, Config: cfgDesc, Layers: []Descriptor{layerDesc}}
	manJSON, err := json.Marshal(man)
	if err != nil {
		return Result{}, fmt.Errorf("encode manifest: %w", err)
	}
	manDesc := Descriptor{MediaType: mediaTypeManifest, Digest: digestOf(manJSON), Size: int64(len(manJSON))}

	idx := Index{SchemaVersion: 2, MediaType: mediaTypeIndex}
	for _, n := range s.Names {
		d := manDesc
		d.Annotations = map[string]string{annotationImageName: n}
		if tag := refTag(n); tag != "" {
			d.Annotations[annotationRefName] = tag
		}
		d.Platform = &Platform{Architecture: s.Arch, OS: s.OS}
		idx.Manifests = append(idx.Manifests, d)
	}
	idxJSON, err := json.Marshal(idx)
	if err != nil {
		return Result{}, fmt.Errorf("encode index: %w", err)
	}

	tw := tar.NewWriter(w)
	entries := []struct {
		name string
		data []byte
	}{
		{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		{"index.json", idxJSON},
		{blobPath(manDesc.Digest), manJSON},
		{blobPath(cfgDesc.Digest), cfgJSON},
		{blobPath(layerDesc.Digest), layer},
	}
	for _, dir := range []string{"blobs/", "blobs/sha256/"} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: dir, Mode: 0o755, ModTime: epoch}); err != nil {
			return Result{}, fmt.Errorf("write layout: %w", err)
		}
	}
	for _, e := range entries {
		hdr := &tar.Header{Typeflag: tar.TypeReg, Name: e.name, Mode: 0o644, Size: int64(len(e.data)), ModTime: epoch}
		if err := tw.WriteHeader(hdr); err != nil {
			return Result{}, fmt.Errorf("write layout entry %s: %w", e.name, err)
		}
		if _, err := tw.Write(e.data); err != nil {
			return Result{}, fmt.Errorf("write layout entry %s: %w", e.name, err)
		}
	}
	if err := tw.Close(); err != nil {
		return Result{}, fmt.Errorf("write layout: %w", err)
	}
	res := Result{Manifest: manDesc, Config: cfgDesc, Layer: layerDesc, DiffID: diffID}
	for _, f := range files {
		res.Files = append(res.Files, f.dst)
	}
	return res, nil
}

func (s Spec) validate() error {
	if len(s.Names) == 0 {
		return errors.New("at least one image name is required")
	}
	for _, n := range s.Names {
		if n == "" || strings.ContainsAny(n, " \t\n") {
			return fmt.Errorf("image name %q is empty or contains whitespace", n)
		}
	}
	if len(s.Files) == 0 {
		return errors.New("at least one file is required")
	}
	if s.OS == "" || s.Arch == "" {
		return errors.New("os and architecture are required")
	}
	for _, f := range s.Files {
		if err := checkImagePath(f.Dst); err != nil {
			return err
		}
	}
	return nil
}

// layerFiles expands s.Files with their library dependencies; the result is
// sorted by destination and has one entry per destination.
func (s Spec) layerFiles() ([]layerFile, error) {
	byDst := map[string]layerFile{}
	add := func(f layerFile, explicit bool) error {
		if prev, ok := byDst[f.dst]; ok {
			if prev.src == f.src || !explicit {
				// A library named by two binaries, or one the user copied
				// on purpose: the first (explicit files come first) wins.
				return nil
			}
			return fmt.Errorf("destination %s is given twice (from %s and %s)", f.dst, prev.src, f.src)
		}
		byDst[f.dst] = f
		return nil
	}
	for _, f := range s.Files {
		st, err := os.Stat(f.Src)
		if err != nil {
			return nil, fmt.Errorf("file for %s: %w", f.Dst, err)
		}
		if !st.Mode().IsRegular() {
			return nil, fmt.Errorf("file for %s: %s is not a regular file", f.Dst, f.Src)
		}
		mode := f.Mode
		if mode == 0 {
			mode = st.Mode().Perm()
		}
		if err := add(layerFile{src: f.Src, dst: f.Dst, mode: mode}, true); err != nil {
			return nil, err
		}
	}
	if s.LibraryDeps {
		ldd := s.LDD
		if ldd == nil {
			ldd = runLDD
		}
		for _, f := range s.Files {
			libs, err := ldd(f.Src)
			if err != nil {
				return nil, fmt.Errorf("library dependencies of %s: %w", f.Src, err)
			}
			for _, lib := range libs {
				if err := checkImagePath(lib); err != nil {
					return nil, fmt.Errorf("library dependency of %s: %w", f.Src, err)
				}
				st, err := os.Stat(lib)
				if err != nil {
					return nil, fmt.Errorf("library dependency of %s: %w", f.Src, err)
				}
				if err := add(layerFile{src: lib, dst: lib, mode: st.Mode().Perm()}, false); err != nil {
					return nil, err
				}
			}
		}
	}
	out := make([]layerFile, 0, len(byDst))
	for _, f := range byDst {
		out = append(out, f)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].dst < out[j].dst })
	return out, nil
}

// buildLayer returns the gzip-compressed layer tar and the digest of its
// uncompressed form (the diff_id).
func buildLayer(files []layerFile) ([]byte, string, error) {
	var gz bytes.Buffer
	zw, err := gzip.NewWriterLevel(&gz, gzip.BestCompression)
	if err != nil {
		return nil, "", fmt.Errorf("gzip: %w", err)
	}
	zw.ModTime = epoch
	raw := sha256.New()
	tw := tar.NewWriter(io.MultiWriter(zw, raw))

	dirs := map[string]bool{}
	for _, f := range files {
		for d := path.Dir(f.dst); d != "/"; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	names := make([]string, 0, len(dirs)+len(files))
	for d := range dirs {
		names = append(names, d)
	}
	sort.Strings(names)
	for _, d := range names {
		hdr := &tar.Header{Typeflag: tar.TypeDir, Name: strings.TrimPrefix(d, "/") + "/", Mode: 0o755, ModTime: epoch}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, "", fmt.Errorf("layer directory %s: %w", d, err)
		}
	}
	for _, f := range files {
		if err := addFile(tw, f); err != nil {
			return nil, "", err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, "", fmt.Errorf("layer: %w", err)
	}
	if err := zw.Close(); err != nil {
		return nil, "", fmt.Errorf("layer: %w", err)
	}
	return gz.Bytes(), "sha256:" + hex.EncodeToString(raw.Sum(nil)), nil
}

func addFile(tw *tar.Writer, f layerFile) error {
	in, err := os.Open(f.src)
	if err != nil {
		return fmt.Errorf("layer file %s: %w", f.dst, err)
	}
	defer func() { _ = in.Close() }()
	st, err := in.Stat()
	if err != nil {
		return fmt.Errorf("layer file %s: %w", f.dst, err)
	}
	hdr := &tar.Header{
		Typeflag: tar.TypeReg,
		Name:     strings.TrimPrefix(f.dst, "/"),
		Mode:     int64(f.mode.Perm()),
		Size:     st.Size(),
		ModTime:  epoch,
	}
	if err := tw.WriteHeader(hdr); err != nil {
		return fmt.Errorf("layer file %s: %w", f.dst, err)
	}
	// CopyN: a file that grows while it is read must not overrun its header.
	if _, err := io.CopyN(tw, in, st.Size()); err != nil {
		return fmt.Errorf("layer file %s from %s: %w", f.dst, f.src, err)
	}
	return nil
}

// runLDD asks the host's ldd which shared objects binary loads.
func runLDD(binary string) ([]string, error) {
	cmd := exec.Command("ldd", binary) //nolint:gosec // G204: inspecting the operator's own --file binary is the point
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if strings.Contains(stdout.String()+stderr.String(), "not a dynamic executable") {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %w: %s", binary, err, strings.TrimSpace(stderr.String()))
	}
	return parseLDD(stdout.String())
}

// parseLDD extracts the absolute library paths from ldd's output. The
// virtual DSO has no file; a library ldd cannot find is an error, since the
// image would not start.
func parseLDD(out string) ([]string, error) {
	var libs []string
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.Contains(line, "statically linked") {
			continue
		}
		if name, target, ok := strings.Cut(line, "=>"); ok {
			target = strings.TrimSpace(target)
			if strings.HasPrefix(target, "not found") {
				return nil, fmt.Errorf("shared library %s not found", strings.TrimSpace(name))
			}
			p := strings.Fields(target)
			if len(p) == 0 || !strings.HasPrefix(p[0], "/") {
				// "linux-vdso.so.1 => (0x…)" on old glibc: no file.
				continue
			}
			libs = append(libs, p[0])
			continue
		}
		p := strings.Fields(line)[0]
		if strings.HasPrefix(p, "/") {
			// The loader, named by its absolute path.
			libs = append(libs, p)
		}
		// Otherwise the vDSO ("linux-vdso.so.1 (0x…)"): nothing to copy.
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read ldd output: %w", err)
	}
	return libs, nil
}

func digestOf(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func blobPath(digest string) string {
	return "blobs/sha256/" + strings.TrimPrefix(digest, "sha256:")
}

// refTag returns the tag of an image reference ("3.10" of
// "registry.k8s.io/pause:3.10"), or "" when it has none.
func refTag(name string) string {
	name, _, _ = strings.Cut(name, "@")
	i := strings.LastIndex(name, ":")
	if i < 0 || strings.Contains(name[i:], "/") {
		return ""
	}
	return name[i+1:]
}

func hasKey(env []string, key string) bool {
	for _, e := range env {
		if k, _, _ := strings.Cut(e, "="); k == key {
			return true
		}
	}
	return false
}
