// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/phasetrace"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
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

// Process is the hook process a run answers for when that is not this
// process: a resident server (pkg/hookserve) answers for the relay process a
// runtime started as its hook, whose pid and environment it was told.
type Process struct {
	// Pid is the hook process, the one the runtime started and waits for.
	// Its parent, the runtime, is read from /proc/<Pid>/stat whenever the
	// hook asks for it (as getppid(2) would answer that process): a
	// change means the runtime died, and a process gone reads as parent 0,
	// a change too.
	Pid int
	// Env is the part of the hook process's environment the hook reads
	// ("NAME=VALUE"; of it only $NRI_GPU_GUARD_CONFIG), never this
	// process's own environment.
	Env []string
}

// getenv is os.Getenv over p.Env (the last entry of a name wins, as for
// exec.Cmd.Env).
func (p Process) getenv(key string) string {
	v := ""
	for _, kv := range p.Env {
		if k, val, ok := strings.Cut(kv, "="); ok && k == key {
			v = val
		}
	}
	return v
}

// parent returns the parent pid of p read from /proc, or 0 where it cannot
// be read (p is gone: nobody waits for its answer).
func (p Process) parent() func() int {
	return func() int {
		ppid, err := parentOf(liveness.DefaultProcRoot, p.Pid)
		if err != nil {
			return 0
		}
		return ppid
	}
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
	return mainWith(ctx, inv, defaultEnv(), os.Getenv, true, stdin, stderr)
}

// MainAs is Main for hook process proc instead of this process, as a
// resident server runs it (pkg/hookserve): the runtime it reads (the hook's
// parent: engine, cgroup, crun's root) is proc's parent, the configuration
// path the one of proc's environment, and no signal handling is set up (a
// signal to this process is no request's): ctx is the run's only
// cancellation, and a waiting hook leaves the queue when it ends. proc must
// share this process's namespaces (user, mount, pid, cgroup, time): what a
// hook reads of its own namespaces is read here of this process's.
// inv.Options.Started should be when proc started (or as near as the caller
// knows): a runtime's hook timeout counts from there.
func MainAs(ctx context.Context, inv Invocation, proc Process, stdin io.Reader, stderr io.Writer) int {
	if proc.Pid <= 0 {
		// A caller's bug, answered as the hook answers what it cannot run:
		// create-runtime refuses.
		_, _ = fmt.Fprintf(stderr, "%s: hook %s: internal error, container refused (please report this): no hook process (pid %d)\n",
			inv.Program, inv.Phase, proc.Pid)
		return 1
	}
	return mainWith(ctx, inv, envOf(proc.parent()), proc.getenv, false, stdin, stderr)
}

// mainWith is Main and MainAs: the hook process seen through e, its
// environment through getenv, signal handling set up where signals is set.
func mainWith(ctx context.Context, inv Invocation, e env, getenv func(string) string, signals bool, stdin io.Reader, stderr io.Writer) int {
	if inv.Phase != PhaseCreateRuntime && inv.Phase != PhasePoststop {
		_, _ = fmt.Fprintf(stderr, "%s: %v (unknown phase %q)\n", inv.Program, ErrUsage, inv.Phase)
		return 2
	}
	in := e.readInput(stdin)
	phasetrace.Mark("input")
	if in.NeverClaims() && (inv.Phase != PhasePoststop || !Marked(in)) {
		return 0
	}
	cfg, _, err := config.LoadDefaultFrom(inv.Config, getenv(config.EnvPath))
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
	// With signals, SIGTERM/SIGINT (a waiting hook leaves the queue) and
	// SIGPIPE are handled from the moment the hook is about to block.
	if err := e.runWith(ctx, inv.Phase, inv.Options, cfg, in, stderr, signals); err != nil {
		_, _ = fmt.Fprintf(stderr, "%s: %v\n", inv.Program, err)
		// 75: a GPU is busy, 77: refused by policy, 1: anything else; crun
		// shows only this code.
		return ExitCode(err)
	}
	return 0
}
