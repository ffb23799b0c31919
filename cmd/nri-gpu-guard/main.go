// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Command nri-gpu-guard is the GPU exclusivity guard for containerd (an NRI
// plugin, pre-installed or external) and, as `nri-gpu-guard hook PHASE`, the
// OCI runtime hook for runtimes without NRI. `nri-gpu-guard ctl ARGS...` is
// gpu-guard-ctl with NVML: the gpu-guard-ctl binary, built without cgo, hands
// the commands that need NVML to it.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ctl"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/nriplugin"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/version"
)

func main() { os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr)) }

// openNVML is how the daemon's observer opens NVML: nil = the host's
// library. Only a test build (the fakenvml tag) sets it.
var openNVML func() (observe.Source, error)

func run(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	// A hook's --wait counts from here, before the configuration loads.
	started := time.Now()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	fs := flag.NewFlagSet("nri-gpu-guard", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		_, _ = fmt.Fprintln(stderr, "usage: nri-gpu-guard [--config PATH] [--socket PATH] [--name NAME] [--idx NN] [--state-dir DIR]\n"+
			"       nri-gpu-guard hook create-runtime|poststop [--config PATH] [--wait]\n"+
			"       nri-gpu-guard ctl COMMAND... (gpu-guard-ctl, with NVML)\n       nri-gpu-guard version")
		fs.PrintDefaults()
	}
	cfgPath := fs.String("config", "", "configuration file (default $"+config.EnvPath+" or "+config.DefaultPath+")")
	socket := fs.String("socket", "", "NRI socket to dial (default [nri] socket)")
	name := fs.String("name", "", "plugin name (default [nri] plugin_name)")
	idx := fs.String("idx", "", "plugin index, two digits (default [nri] plugin_index)")
	stateDir := fs.String("state-dir", "", "ledger directory (default [ledger] dir)")
	wait := fs.Bool("wait", false, "hook create-runtime: wait in the queue (up to [hook] wait_timeout) instead of refusing a busy GPU at once; only for runtimes run without an engine lock (plain runc)")
	phase := ""
	switch {
	case len(args) > 0 && (args[0] == "version" || args[0] == "--version" || args[0] == "-version"):
		_, _ = fmt.Fprintln(stdout, version.String("nri-gpu-guard"))
		return 0
	case len(args) > 0 && args[0] == ctl.CompanionCommand:
		// gpu-guard-ctl is built without cgo and hands the commands that
		// need NVML to this binary, which links it (ctl.ExecCompanion).
		// The same signal handling as gpu-guard-ctl's own (a handed-over
		// `run` that waits must leave the queue on a hang-up too).
		return ctl.Run(ctx, args[1:], ctl.Env{Stdout: stdout, Stderr: stderr, Interrupts: ctl.NotifyInterrupts})
	case len(args) > 0 && args[0] == "hook":
		if len(args) < 2 || (args[1] != hook.PhaseCreateRuntime && args[1] != hook.PhasePoststop) {
			fs.Usage()
			return 2
		}
		phase, args = args[1], args[2:]
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: unexpected argument %q\n", fs.Arg(0))
		fs.Usage()
		return 2
	}
	if phase != "" {
		// The hook binary's own path (hook.Main): the runtime's input is
		// read before the configuration, so that a container that can
		// reach no GPU is not refused for a configuration that does not
		// load.
		return hook.Main(ctx, hook.Invocation{Program: "nri-gpu-guard", Phase: phase, Config: *cfgPath, StateDir: *stateDir,
			Options: hook.Options{Wait: *wait, Started: started}}, stdin, stderr)
	}
	cfg, _, err := config.LoadDefault(*cfgPath)
	if err == nil && *stateDir != "" {
		cfg.Ledger.Dir = *stateDir
		err = cfg.Validate()
	}
	if err != nil {
		_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: configuration: %v\n", err)
		return 1
	}
	logger := slog.New(slog.NewJSONHandler(stderr, nil))
	logger.Info("starting", "version", version.String("nri-gpu-guard"), "launched_by_runtime", nriplugin.Launched())
	err = runDaemon(ctx, daemonOptions{Config: cfg, Logger: logger, OpenNVML: openNVML,
		Identity: nriplugin.Identity{Name: *name, Index: *idx, Socket: *socket}})
	if err != nil {
		_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: %v\n", err)
		return 1
	}
	return 0
}
