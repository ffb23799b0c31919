// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"fmt"
	"io"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/phasetrace"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// Invocation is one run of a hook binary as its command line states it.
type Invocation struct {
	// Program names the binary at the start of its error line.
	Program string
	// Phase is PhaseCreateRuntime or PhasePoststop.
	Phase string
	// Config is --config: "" for $NRI_GPU_GUARD_CONFIG, then the default
	// path (config.LoadDefault).
	Config string
	// StateDir is --state-dir: "" for [ledger] dir.
	StateDir string
	Options  Options
}

// Main is a hook binary's run once its command line is parsed, the one path
// of nri-gpu-guard-hook and of `nri-gpu-guard hook` (kept for hooks.d files
// written for it), so that both answer every container alike. It writes at
// most one line to stderr and returns the exit code: 0, 1, or ExitCode's.
//
// Most containers can reach no GPU: their answer needs neither the
// configuration nor the ledger (Input.NeverClaims holds under any
// configuration), so the input is read first and such a container is
// answered at once, before the TOML is parsed or signals are set up, and a
// configuration that does not load refuses none of them. poststop takes that
// short cut only when create-runtime left no marker for the container (one
// stat): the bundle's config.json may have been edited since create, and a
// container the hook claimed for is released whatever it says now.
func Main(ctx context.Context, inv Invocation, stdin io.Reader, stderr io.Writer) int {
	if inv.Phase != PhaseCreateRuntime && inv.Phase != PhasePoststop {
		_, _ = fmt.Fprintf(stderr, "%s: %v (unknown phase %q)\n", inv.Program, ErrUsage, inv.Phase)
		return 2
	}
	in := ReadInput(stdin)
	phasetrace.Mark("input")
	if in.NeverClaims() && (inv.Phase != PhasePoststop || !Marked(in)) {
		return 0
	}
	cfg, _, err := config.LoadDefault(inv.Config)
	phasetrace.Mark("config")
	if err == nil && inv.StateDir != "" {
		cfg.Ledger.Dir = inv.StateDir
		err = cfg.Validate()
	}
	if err != nil {
		// The runtime logs this line and, for create-runtime, refuses the
		// container: an unreadable configuration must not let GPUs through.
		// poststop says how to release the stopped container's GPUs.
		_, _ = fmt.Fprintf(stderr, "%s: %v\n", inv.Program, ConfigError(inv.Phase, in, err))
		return 1
	}
	// RunInput handles SIGTERM/SIGINT (a waiting hook leaves the queue) and
	// SIGPIPE itself, from the moment the hook is about to block.
	if err := RunInput(ctx, inv.Phase, inv.Options, cfg, in, stderr); err != nil {
		_, _ = fmt.Fprintf(stderr, "%s: %v\n", inv.Program, err)
		// 75: a GPU is busy, 77: refused by policy, 1: anything else; crun
		// shows only this code.
		return ExitCode(err)
	}
	return 0
}
