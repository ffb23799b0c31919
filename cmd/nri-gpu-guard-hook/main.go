// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Command nri-gpu-guard-hook is the OCI runtime hook of nri-gpu-guard, for
// runtimes without NRI (podman, CRI-O, plain runc): a runtime runs
// `nri-gpu-guard-hook create-runtime` and `nri-gpu-guard-hook poststop` for
// every container, with the OCI state on stdin.
//
// It is a separate binary because a hook is a process start per container
// and per phase: it links only pkg/hook and what that needs (no NRI, ttrpc,
// protobuf, prometheus or net/http, no cgo), so starting it costs little more
// than starting any static Go program. `nri-gpu-guard hook PHASE` runs the
// same code and stays for hooks.d files written for it.
//
// `nri-gpu-guard-hook add-hooks CONFIG.JSON` adds both hooks to a bundle's
// config.json, for engines that read no hooks.d (the runc wrapper of
// docs/hook.md, for Docker and containerd without NRI).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/phasetrace"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/version"
)

const program = "nri-gpu-guard-hook"

// started is when main began, as near the process's start as the program
// can take it: the timeout a runtime gives the hook counts from its start.
// Zero when run is called otherwise (tests): then RunInput's own start.
var started time.Time

func main() {
	started = time.Now()
	phasetrace.Mark("init")
	code := run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	phasetrace.Mark("exit")
	os.Exit(code)
}

func run(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	usage := func(w io.Writer) {
		_, _ = fmt.Fprintln(w, "usage: "+program+" create-runtime|poststop [--config PATH] [--state-dir DIR] [--wait]\n       "+
			addHooksUsage+"\n       "+serveUsage+"\n       "+program+" version")
		hook.PrintPhaseDefaults(w)
	}
	if len(args) == 0 {
		usage(stderr)
		return 2
	}
	switch args[0] {
	case "version", "--version", "-version":
		_, _ = fmt.Fprintln(stdout, version.String(program))
		return 0
	case "help", "--help", "-help", "-h":
		usage(stdout)
		return 0
	case cmdAddHooks:
		return addHooks(args[1:], stderr)
	case cmdServe:
		return serve(args[1:], stderr)
	}
	// The very parsing the server (serve) applies to a relay's arguments:
	// both take exactly the same command lines.
	inv, err := hook.ParseArgs(program, args)
	if err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			_, _ = fmt.Fprintf(stderr, "%s: %v\n", program, err)
		}
		usage(stderr)
		return 2
	}
	inv.Options.Started = started
	// The one path of both hook binaries (see hook.Main): a container
	// that can reach no GPU is answered before the configuration is read.
	return hook.Main(context.Background(), inv, stdin, stderr)
}
