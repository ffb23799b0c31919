// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
)

// stringList is a repeatable string flag.
type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, ",") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

// fileList is the repeatable --file SRC:DST[:MODE] flag.
type fileList []FileSpec

func (l *fileList) String() string { return fmt.Sprint(len(*l), " files") }
func (l *fileList) Set(v string) error {
	f, err := ParseFileSpec(v)
	if err != nil {
		return err
	}
	*l = append(*l, f)
	return nil
}

func main() {
	if err := run(os.Args[1:], os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "ociimage:", err)
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		os.Exit(2)
	}
}

func run(args []string, stderr io.Writer) error {
	fl := flag.NewFlagSet("ociimage", flag.ContinueOnError)
	fl.SetOutput(stderr)
	var (
		s          Spec
		names      stringList
		files      fileList
		entrypoint stringList
		cmd        stringList
		env        stringList
	)
	out := fl.String("out", "", "output tar `path` (required)")
	fl.Var(&names, "name", "image `reference` to record, e.g. registry.k8s.io/pause:3.10 (repeatable)")
	fl.Var(&files, "file", "`SRC:DST[:MODE]` host file to copy to DST (octal MODE) (repeatable)")
	fl.Var(&entrypoint, "entrypoint", "entrypoint `argument` (repeatable: program, then its arguments)")
	fl.Var(&cmd, "cmd", "default command `argument` (repeatable)")
	fl.Var(&env, "env", "`KEY=VALUE` environment entry (repeatable)")
	fl.StringVar(&s.WorkingDir, "workdir", "/", "working `directory`")
	fl.StringVar(&s.OS, "os", "linux", "image `os`")
	fl.StringVar(&s.Arch, "arch", runtime.GOARCH, "image `architecture`")
	fl.BoolVar(&s.LibraryDeps, "library-deps", false, "also copy the shared libraries (ldd) of every --file")
	if err := fl.Parse(args); err != nil {
		return err
	}
	if fl.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fl.Args())
	}
	if *out == "" {
		return errors.New("--out is required")
	}
	s.Names, s.Files, s.Entrypoint, s.Cmd, s.Env = names, files, entrypoint, cmd, env
	return writeImage(*out, s)
}

// writeImage builds into a temporary file next to out and renames it into
// place, so that readers (and caches keyed on the file's existence) never see
// a partial archive.
func writeImage(out string, s Spec) (err error) {
	tmp, err := os.CreateTemp(filepath.Dir(out), "."+filepath.Base(out)+".*")
	if err != nil {
		return fmt.Errorf("create output: %w", err)
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	res, err := Build(tmp, s)
	if err != nil {
		return err
	}
	if err := tmp.Chmod(0o644); err != nil {
		return fmt.Errorf("write %s: %w", out, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write %s: %w", out, err)
	}
	if err := os.Rename(tmp.Name(), out); err != nil {
		return fmt.Errorf("write %s: %w", out, err)
	}
	_, _ = fmt.Fprintf(os.Stdout, "%s: %s (%d files, manifest %s)\n", out, strings.Join(s.Names, ", "), len(res.Files), res.Manifest.Digest)
	return nil
}
