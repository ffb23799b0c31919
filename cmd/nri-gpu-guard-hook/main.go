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
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/phasetrace"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
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
	fs := flag.NewFlagSet(program, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		_, _ = fmt.Fprintln(fs.Output(), "usage: "+program+" create-runtime|poststop [--config PATH] [--state-dir DIR] [--wait]\n       "+
			addHooksUsage+"\n       "+program+" version")
		fs.PrintDefaults()
	}
	cfgPath := fs.String("config", "", "configuration file (default $"+config.EnvPath+" or "+config.DefaultPath+")")
	stateDir := fs.String("state-dir", "", "ledger directory (default [ledger] dir)")
	wait := fs.Bool("wait", false, "create-runtime: wait in the queue for a busy GPU (plain runc only; ignored under conmon and containerd-shim)")
	if len(args) == 0 {
		fs.Usage()
		return 2
	}
	phase := args[0]
	switch phase {
	case "version", "--version", "-version":
		_, _ = fmt.Fprintln(stdout, version.String(program))
		return 0
	case "help", "--help", "-help", "-h":
		fs.SetOutput(stdout)
		fs.Usage()
		return 0
	case cmdAddHooks:
		return addHooks(args[1:], stderr)
	case hook.PhaseCreateRuntime, hook.PhasePoststop:
	default:
		_, _ = fmt.Fprintf(stderr, "%s: unknown phase %q\n", program, phase)
		fs.Usage()
		return 2
	}
	if err := fs.Parse(args[1:]); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		_, _ = fmt.Fprintf(stderr, "%s: unexpected argument %q\n", program, fs.Arg(0))
		fs.Usage()
		return 2
	}
	// The one path of both hook binaries (see hook.Main): a container
	// that can reach no GPU is answered before the configuration is read.
	return hook.Main(context.Background(), hook.Invocation{Program: program, Phase: phase, Config: *cfgPath, StateDir: *stateDir,
		Options: hook.Options{Wait: *wait, Started: started}}, stdin, stderr)
}
