// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseFileSpec(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    FileSpec
		wantErr string
	}{
		{in: "bin/x:/x", want: FileSpec{Src: "bin/x", Dst: "/x"}},
		{in: "bin/x:/usr/bin/x:0755", want: FileSpec{Src: "bin/x", Dst: "/usr/bin/x", Mode: 0o755}},
		{in: "bin/x:/x:644", want: FileSpec{Src: "bin/x", Dst: "/x", Mode: 0o644}},
		{in: "bin/x", wantErr: "want SRC:DST[:MODE]"},
		{in: "a:b:c:d", wantErr: "want SRC:DST[:MODE]"},
		{in: ":/x", wantErr: "empty source"},
		{in: "bin/x:x", wantErr: "absolute, clean path"},
		{in: "bin/x:/", wantErr: "absolute, clean path"},
		{in: "bin/x:/a/../b", wantErr: "absolute, clean path"},
		{in: "bin/x:/a//b", wantErr: "absolute, clean path"},
		{in: "bin/x:/x:0999", wantErr: "octal permission"},
		{in: "bin/x:/x:0", wantErr: "octal permission"},
		{in: "bin/x:/x:17777", wantErr: "octal permission"},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := ParseFileSpec(tc.in)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}

// layout is an image layout tar read back: every entry by name.
type layout map[string][]byte

func readLayout(t *testing.T, b []byte) layout {
	t.Helper()
	l := layout{}
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return l
		}
		require.NoError(t, err)
		data, err := io.ReadAll(tr)
		require.NoError(t, err)
		_, dup := l[hdr.Name]
		require.False(t, dup, "entry %s twice", hdr.Name)
		l[hdr.Name] = data
	}
}

// blob returns the blob a descriptor names after checking that its content
// has the digest and size the descriptor claims.
func (l layout) blob(t *testing.T, d Descriptor) []byte {
	t.Helper()
	data, ok := l[blobPath(d.Digest)]
	require.True(t, ok, "blob %s missing", d.Digest)
	sum := sha256.Sum256(data)
	require.Equal(t, d.Digest, "sha256:"+hex.EncodeToString(sum[:]), "blob content does not match its digest")
	require.Equal(t, d.Size, int64(len(data)), "size of %s", d.Digest)
	return data
}

type layerEntry struct {
	typ  byte
	mode int64
	uid  int
	gid  int
	data string
}

func readLayer(t *testing.T, gz []byte) ([]string, map[string]layerEntry, string) {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(gz))
	require.NoError(t, err)
	raw, err := io.ReadAll(zr)
	require.NoError(t, err)
	sum := sha256.Sum256(raw)
	var order []string
	entries := map[string]layerEntry{}
	tr := tar.NewReader(bytes.NewReader(raw))
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		data, err := io.ReadAll(tr)
		require.NoError(t, err)
		order = append(order, hdr.Name)
		entries[hdr.Name] = layerEntry{typ: hdr.Typeflag, mode: hdr.Mode, uid: hdr.Uid, gid: hdr.Gid, data: string(data)}
	}
	return order, entries, "sha256:" + hex.EncodeToString(sum[:])
}

func writeFile(t *testing.T, dir, name, content string, mode fs.FileMode) string {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(p, []byte(content), mode))
	require.NoError(t, os.Chmod(p, mode)) // not subject to the umask
	return p
}

func TestBuildWritesAnImportableLayout(t *testing.T) {
	dir := t.TempDir()
	bin := writeFile(t, dir, "sleeper", "#!binary", 0o700)
	conf := writeFile(t, dir, "conf", "key = 1\n", 0o640)

	var out bytes.Buffer
	res, err := Build(&out, Spec{
		Names:      []string{"registry.k8s.io/pause:3.10", "localhost/gpu-guard/sleeper:1"},
		Files:      []FileSpec{{Src: bin, Dst: "/sleeper", Mode: 0o755}, {Src: conf, Dst: "/etc/app/conf"}},
		Entrypoint: []string{"/sleeper"},
		Cmd:        []string{"--flag"},
		Env:        []string{"A=b"},
		WorkingDir: "/",
		OS:         "linux",
		Arch:       "amd64",
	})
	require.NoError(t, err)
	l := readLayout(t, out.Bytes())

	assert.JSONEq(t, `{"imageLayoutVersion":"1.0.0"}`, string(l["oci-layout"]))

	var idx Index
	require.NoError(t, json.Unmarshal(l["index.json"], &idx))
	assert.Equal(t, 2, idx.SchemaVersion)
	assert.Equal(t, mediaTypeIndex, idx.MediaType)
	require.Len(t, idx.Manifests, 2)
	for i, want := range []struct{ name, tag string }{
		{"registry.k8s.io/pause:3.10", "3.10"},
		{"localhost/gpu-guard/sleeper:1", "1"},
	} {
		d := idx.Manifests[i]
		assert.Equal(t, want.name, d.Annotations[annotationImageName])
		assert.Equal(t, want.tag, d.Annotations[annotationRefName])
		assert.Equal(t, res.Manifest.Digest, d.Digest, "every name points at the one manifest")
		assert.Equal(t, mediaTypeManifest, d.MediaType)
		assert.Equal(t, &Platform{Architecture: "amd64", OS: "linux"}, d.Platform)
	}

	var man Manifest
	require.NoError(t, json.Unmarshal(l.blob(t, idx.Manifests[0]), &man))
	assert.Equal(t, 2, man.SchemaVersion)
	assert.Equal(t, mediaTypeConfig, man.Config.MediaType)
	require.Len(t, man.Layers, 1)
	assert.Equal(t, mediaTypeLayer, man.Layers[0].MediaType)

	var cfg ImageConfig
	require.NoError(t, json.Unmarshal(l.blob(t, man.Config), &cfg))
	assert.Equal(t, "amd64", cfg.Architecture)
	assert.Equal(t, "linux", cfg.OS)
	assert.Equal(t, []string{"/sleeper"}, cfg.Config.Entrypoint)
	assert.Equal(t, []string{"--flag"}, cfg.Config.Cmd)
	assert.Equal(t, []string{defaultPath, "A=b"}, cfg.Config.Env)
	assert.Equal(t, "layers", cfg.RootFS.Type)

	order, entries, diffID := readLayer(t, l.blob(t, man.Layers[0]))
	assert.Equal(t, []string{diffID}, cfg.RootFS.DiffIDs, "diff_id is the digest of the uncompressed layer")
	assert.Equal(t, res.DiffID, diffID)
	assert.Equal(t, []string{"etc/", "etc/app/", "etc/app/conf", "sleeper"}, order, "parents before children, sorted")
	assert.Equal(t, layerEntry{typ: tar.TypeDir, mode: 0o755}, entries["etc/app/"])
	assert.Equal(t, layerEntry{typ: tar.TypeReg, mode: 0o755, data: "#!binary"}, entries["sleeper"], "explicit mode wins")
	assert.Equal(t, layerEntry{typ: tar.TypeReg, mode: 0o640, data: "key = 1\n"}, entries["etc/app/conf"], "mode of the source")
	assert.Equal(t, []string{"/etc/app/conf", "/sleeper"}, res.Files)

	// Nothing but the layout and its three blobs.
	assert.Len(t, l, 2+2+3)
}

func TestBuildIsReproducible(t *testing.T) {
	dir := t.TempDir()
	bin := writeFile(t, dir, "b", "content", 0o755)
	spec := Spec{Names: []string{"x:1"}, Files: []FileSpec{{Src: bin, Dst: "/b"}}, OS: "linux", Arch: "amd64"}
	var a, b bytes.Buffer
	_, err := Build(&a, spec)
	require.NoError(t, err)
	// A changed mtime must not change the image.
	require.NoError(t, os.Chtimes(bin, epoch, epoch))
	_, err = Build(&b, spec)
	require.NoError(t, err)
	assert.Equal(t, a.Bytes(), b.Bytes())

	require.NoError(t, os.WriteFile(bin, []byte("changed"), 0o755))
	var c bytes.Buffer
	_, err = Build(&c, spec)
	require.NoError(t, err)
	assert.NotEqual(t, a.Bytes(), c.Bytes(), "content is part of the image")
}

func TestBuildLibraryDeps(t *testing.T) {
	dir := t.TempDir()
	one := writeFile(t, dir, "one", "1", 0o755)
	two := writeFile(t, dir, "two", "2", 0o755)
	libc := writeFile(t, dir, "libc.so.6", "libc", 0o644)
	loader := writeFile(t, dir, "ld.so", "ld", 0o755)
	libx := writeFile(t, dir, "libx.so", "x", 0o644)
	own := writeFile(t, dir, "own-libx", "mine", 0o600)

	ldd := func(bin string) ([]string, error) {
		switch bin {
		case one:
			return []string{libc, loader}, nil
		case two:
			return []string{libc, libx, loader}, nil
		case own:
			return nil, nil
		}
		return nil, errors.New("unexpected binary " + bin)
	}
	var out bytes.Buffer
	_, err := Build(&out, Spec{
		Names:       []string{"x:1"},
		Files:       []FileSpec{{Src: one, Dst: "/one"}, {Src: two, Dst: "/two"}, {Src: own, Dst: libx}},
		OS:          "linux",
		Arch:        "amd64",
		LibraryDeps: true,
		LDD:         ldd,
	})
	require.NoError(t, err)
	l := readLayout(t, out.Bytes())
	var idx Index
	require.NoError(t, json.Unmarshal(l["index.json"], &idx))
	var man Manifest
	require.NoError(t, json.Unmarshal(l.blob(t, idx.Manifests[0]), &man))
	_, entries, _ := readLayer(t, l.blob(t, man.Layers[0]))

	rel := func(p string) string { return strings.TrimPrefix(p, "/") }
	assert.Equal(t, layerEntry{typ: tar.TypeReg, mode: 0o644, data: "libc"}, entries[rel(libc)], "a shared library is copied once to its host path")
	assert.Equal(t, layerEntry{typ: tar.TypeReg, mode: 0o755, data: "ld"}, entries[rel(loader)])
	assert.Equal(t, layerEntry{typ: tar.TypeReg, mode: 0o600, data: "mine"}, entries[rel(libx)], "an explicit file wins over a library at the same path")
	assert.Contains(t, entries, "one")
	assert.Contains(t, entries, "two")
}

func TestBuildErrors(t *testing.T) {
	dir := t.TempDir()
	a := writeFile(t, dir, "a", "a", 0o755)
	b := writeFile(t, dir, "b", "b", 0o755)
	base := func() Spec {
		return Spec{Names: []string{"x:1"}, Files: []FileSpec{{Src: a, Dst: "/a"}}, OS: "linux", Arch: "amd64"}
	}
	for _, tc := range []struct {
		name    string
		mutate  func(*Spec)
		wantErr string
	}{
		{"no name", func(s *Spec) { s.Names = nil }, "image name is required"},
		{"blank name", func(s *Spec) { s.Names = []string{"a b"} }, "whitespace"},
		{"no files", func(s *Spec) { s.Files = nil }, "file is required"},
		{"no arch", func(s *Spec) { s.Arch = "" }, "architecture"},
		{"relative destination", func(s *Spec) { s.Files[0].Dst = "a" }, "absolute"},
		{"missing source", func(s *Spec) { s.Files[0].Src = filepath.Join(dir, "nope") }, "no such file"},
		{"directory source", func(s *Spec) { s.Files[0].Src = dir }, "not a regular file"},
		{"one destination, two sources", func(s *Spec) { s.Files = append(s.Files, FileSpec{Src: b, Dst: "/a"}) }, "given twice"},
		{"ldd fails", func(s *Spec) {
			s.LibraryDeps = true
			s.LDD = func(string) ([]string, error) { return nil, errors.New("shared library libcuda.so.1 not found") }
		}, "libcuda.so.1 not found"},
		{"ldd names a relative path", func(s *Spec) {
			s.LibraryDeps = true
			s.LDD = func(string) ([]string, error) { return []string{"lib.so"}, nil }
		}, "absolute"},
		{"ldd names a missing file", func(s *Spec) {
			s.LibraryDeps = true
			s.LDD = func(string) ([]string, error) { return []string{filepath.Join(dir, "gone.so")}, nil }
		}, "no such file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := base()
			tc.mutate(&s)
			_, err := Build(io.Discard, s)
			require.ErrorContains(t, err, tc.wantErr)
		})
	}
}

func TestParseLDD(t *testing.T) {
	for _, tc := range []struct {
		name    string
		out     string
		want    []string
		wantErr string
	}{
		{
			name: "glibc binary",
			out: "\tlinux-vdso.so.1 (0x00007ffc0b5f2000)\n" +
				"\tlibresolv.so.2 => /lib/x86_64-linux-gnu/libresolv.so.2 (0x00007f0e1c5d0000)\n" +
				"\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f0e1c3ef000)\n" +
				"\t/lib64/ld-linux-x86-64.so.2 (0x00007f0e1c5f7000)\n",
			want: []string{"/lib/x86_64-linux-gnu/libresolv.so.2", "/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"},
		},
		{name: "old vdso form", out: "\tlinux-vdso.so.1 =>  (0x00007ffc0b5f2000)\n", want: nil},
		{name: "static pie", out: "\tstatically linked\n", want: nil},
		{name: "missing library", out: "\tlibcuda.so.1 => not found\n", wantErr: "libcuda.so.1 not found"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseLDD(tc.out)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}

// TestRunLDDOnHost checks the parser against the host's real ldd.
func TestRunLDDOnHost(t *testing.T) {
	if _, err := exec.LookPath("ldd"); err != nil {
		t.Skip("no ldd on this host")
	}
	sh, err := exec.LookPath("sh")
	require.NoError(t, err)
	libs, err := runLDD(sh)
	require.NoError(t, err)
	require.NotEmpty(t, libs, "sh is dynamically linked on every supported host")
	for _, l := range libs {
		assert.True(t, filepath.IsAbs(l), l)
		_, err := os.Stat(l)
		assert.NoError(t, err)
	}

	// A file that is no dynamic executable has no dependencies.
	static := writeFile(t, t.TempDir(), "data", "not an ELF file", 0o755)
	libs, err = runLDD(static)
	require.NoError(t, err)
	assert.Empty(t, libs)
}

func TestRunWritesAtomically(t *testing.T) {
	dir := t.TempDir()
	bin := writeFile(t, dir, "bin", "x", 0o755)
	out := filepath.Join(dir, "out", "image.tar")
	require.NoError(t, os.Mkdir(filepath.Dir(out), 0o755))

	var stderr bytes.Buffer
	err := run([]string{"--out", out, "--name", "x:1", "--file", bin + ":/nope:0"}, &stderr)
	require.ErrorContains(t, err, "octal permission")
	err = run([]string{"--out", out, "--name", "x:1", "--file", filepath.Join(dir, "missing") + ":/x"}, &stderr)
	require.ErrorContains(t, err, "no such file")
	left, err := os.ReadDir(filepath.Dir(out))
	require.NoError(t, err)
	assert.Empty(t, left, "a failed build leaves nothing behind")

	require.NoError(t, run([]string{"--out", out, "--name", "x:1", "--file", bin + ":/bin/x:0755", "--entrypoint", "/bin/x", "--entrypoint", "-v"}, &stderr))
	data, err := os.ReadFile(out)
	require.NoError(t, err)
	l := readLayout(t, data)
	var idx Index
	require.NoError(t, json.Unmarshal(l["index.json"], &idx))
	var man Manifest
	require.NoError(t, json.Unmarshal(l.blob(t, idx.Manifests[0]), &man))
	var cfg ImageConfig
	require.NoError(t, json.Unmarshal(l.blob(t, man.Config), &cfg))
	assert.Equal(t, []string{"/bin/x", "-v"}, cfg.Config.Entrypoint)
	left, err = os.ReadDir(filepath.Dir(out))
	require.NoError(t, err)
	assert.Len(t, left, 1, "only the image, no temporary file")

	require.ErrorContains(t, run([]string{"--name", "x:1"}, &stderr), "--out is required")
	require.ErrorContains(t, run([]string{"--out", out, "extra"}, &stderr), "unexpected arguments")
}
