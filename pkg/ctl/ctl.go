// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices/nvmlloader"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// Exit codes of gpu-guard-ctl. They are a public interface: scripts and
// monitoring act on them.
const (
	ExitOK        = 0 // the command did what was asked
	ExitError     = 1 // the command failed (message on stderr)
	ExitUsage     = 2 // unknown command or flag, bad or missing argument
	ExitAttention = 3 // status or ps: a problem needs an operator (conflict, exited holder, observer finding, …)
)

// programName is how the tool names itself in help and messages.
const programName = "gpu-guard-ctl"

// defaultFollowInterval is how often `audit --follow` looks for new records:
// the audit log is appended a few times per container start, so a second is
// responsive without polling the disk hard.
const defaultFollowInterval = time.Second

// Env is everything Run takes from the process: where output goes, the clock,
// the caller's uid and the host roots. Zero fields take the process defaults
// (see DefaultEnv), so tests set only what they pin.
type Env struct {
	Stdout io.Writer
	Stderr io.Writer
	// Now is the clock for ages ("3m"), --since and queue expiry.
	Now func() time.Time
	// BootClock is the time since boot by which the ledger tells a step of
	// the wall clock from time passing (ledger.Options.BootClock): with Now
	// left zero, the host's (ledger.SinceBoot); with Now pinned and this
	// zero, none (a pinned clock is stepped only where a test says so).
	BootClock func() time.Duration
	// Getuid decides whether mutating commands may run (root only).
	Getuid func() int
	// Getenv reads NRI_GPU_GUARD_CONFIG and SUDO_USER.
	Getenv func(string) string
	// CgroupRoot and ProcRoot are where holders' cgroups and pids are checked
	// (default /sys/fs/cgroup and /proc).
	CgroupRoot string
	ProcRoot   string
	// Liveness overrides the checker built from CgroupRoot and ProcRoot.
	Liveness guard.Liveness
	// NVML is the library the NVML loader uses (a go-nvml nvml.Interface in
	// cgo builds); nil = the host's libnvidia-ml.
	NVML nvmlloader.Interface
	// NeedNVML is set in a gpu-guard-ctl without NVML (the release binary is
	// built without cgo, which starts faster; see ExecCompanion). A command
	// calls it where it would initialise NVML (ps; GPU discovery through
	// NVML when no trusted inventory cache answers), before it has printed
	// or changed anything, to hand the whole invocation to a binary that has
	// NVML. It returns only when it cannot; the command then fails with an
	// NVMLHandoverError. Nil: NVML is used through the NVML field.
	NeedNVML func(why string) error
	// Interrupts returns ctx canceled on Ctrl-C, SIGTERM, SIGHUP or SIGQUIT,
	// and its stop (NotifyInterrupts in the real process). A command that waits or
	// changes the ledger runs under it, so that a signal ends the wait, or
	// lets the change finish, instead of killing the process. A read that
	// renders once (status, queue, claims, explain, check-config, version)
	// does not: listening for signals starts an extra thread, about a
	// tenth of such a command, and the default (the process ends) is all it
	// needs. Nil: commands run under Run's ctx as it is.
	Interrupts func(ctx context.Context) (context.Context, context.CancelFunc)
	// Ignored reports whether the process started with a signal ignored
	// (signal.Ignored when nil): `gpu-guard-ctl run` leaves such a signal
	// ignored for its command (nohup). Tests that play a process started
	// from a terminal report none, whatever the test run itself ignores.
	Ignored func(os.Signal) bool
	// BootID overrides the host boot id the ledger compares its state with
	// (tests pin it; empty = /proc/sys/kernel/random/boot_id).
	BootID string
	// FollowInterval is how often `audit --follow` polls (default 1s).
	FollowInterval time.Duration
	// HooksDirs are the hooks.d directories check-config compares [hook]
	// poststop with, lowest precedence first; nil = the ones podman reads,
	// from the [engine] hooks_dir of ContainersConfs.
	HooksDirs []string
	// ContainersConfs are the containers.conf files (glob patterns) podman
	// reads, in order; nil = $CONTAINERS_CONF if set, else
	// DefaultContainersConfs.
	ContainersConfs []string
}

// DefaultEnv is the Env of the real process.
func DefaultEnv() Env {
	return Env{
		Stdout:     os.Stdout,
		Stderr:     os.Stderr,
		Now:        time.Now,
		BootClock:  ledger.SinceBoot,
		Getuid:     os.Getuid,
		Getenv:     os.Getenv,
		CgroupRoot: liveness.DefaultCgroupRoot,
		ProcRoot:   liveness.DefaultProcRoot,
	}
}

// withDefaults fills the zero fields of env from DefaultEnv.
func (env Env) withDefaults() Env {
	def := DefaultEnv()
	if env.Stdout == nil {
		env.Stdout = def.Stdout
	}
	if env.Stderr == nil {
		env.Stderr = def.Stderr
	}
	if env.Now == nil {
		env.Now = def.Now
		if env.BootClock == nil {
			env.BootClock = def.BootClock
		}
	}
	if env.Getuid == nil {
		env.Getuid = def.Getuid
	}
	if env.Getenv == nil {
		env.Getenv = def.Getenv
	}
	if env.CgroupRoot == "" {
		env.CgroupRoot = def.CgroupRoot
	}
	if env.ProcRoot == "" {
		env.ProcRoot = def.ProcRoot
	}
	if env.Liveness == nil {
		env.Liveness = liveness.New(env.CgroupRoot, env.ProcRoot)
	}
	if env.FollowInterval <= 0 {
		env.FollowInterval = defaultFollowInterval
	}
	return env
}

// Run executes gpu-guard-ctl with args (without the program name) and returns
// the exit code. Errors are printed to env.Stderr; Run never exits the process.
func Run(ctx context.Context, args []string, env Env) int {
	env = env.withDefaults()
	if args == nil {
		// cobra falls back to os.Args for a nil slice.
		args = []string{}
	}
	a := &app{env: env}
	root := a.rootCommand(args)
	root.SetArgs(args)
	root.SetOut(env.Stdout)
	root.SetErr(env.Stderr)
	cmd, err := root.ExecuteContextC(ctx)
	if a.stopInterrupts != nil {
		a.stopInterrupts()
	}
	if err == nil {
		return ExitOK
	}
	return a.report(cmd, err)
}

// report prints err the way an operator needs it and maps it to an exit code.
func (a *app) report(cmd *cobra.Command, err error) int {
	var ue *usageError
	var qe *quietExit
	switch {
	case errors.As(err, &qe):
		// The findings are already on stdout, in the output format asked for.
		return qe.code
	case errors.As(err, &ue):
		fmt.Fprintf(a.env.Stderr, "error: %s\n", ue.msg)
		path := programName
		if cmd != nil {
			path = cmd.CommandPath()
		}
		fmt.Fprintf(a.env.Stderr, "Run '%s --help' for usage.\n", path)
		return ExitUsage
	default:
		fmt.Fprintf(a.env.Stderr, "error: %s\n", describe(err))
		return ExitError
	}
}

// usageError is a mistake in the command line (exit 2).
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// quietExit ends a command whose findings are already in its output (status
// with problems, check-config of an invalid file): only the exit code remains
// to be set.
type quietExit struct {
	code int
	why  string
}

func (e *quietExit) Error() string { return e.why }

// attention is status's exit 3.
func attention(n int) error {
	return &quietExit{code: ExitAttention, why: fmt.Sprintf("%d problem(s) need attention", n)}
}

// describe adds what to do to the errors an operator can act on.
func describe(err error) string {
	var ce *ledger.CorruptError
	switch {
	case errors.As(err, &ce):
		return corruptAdvice(ce)
	case errors.Is(err, ledger.ErrNeedsRecovery):
		return "LEDGER NEEDS RECOVERY: " + err.Error() + recoverAdvice(false)
	case errors.Is(err, ledger.ErrLockTimeout):
		return err.Error() + "\n  the ledger is busy; retry in a moment. If this persists, the process named above holds the lock: check it is the nri-gpu-guard daemon and that it is healthy."
	case errors.Is(err, ledger.ErrUnsafeDir):
		return err.Error() + "\n  the state dir must be a root-owned directory with mode 0700, below directories that are root-owned and not writable by group or others (or sticky, like /tmp), with no symlinks on the path; fix what the message names. NO container gets a GPU meanwhile."
	case errors.Is(err, os.ErrPermission):
		return err.Error() + "\n  the state dir is readable by root only: run gpu-guard-ctl with sudo."
	}
	return err.Error()
}

// corruptAdvice is the loud message for a state file that failed to verify.
// A reader never moves the file; recover does.
func corruptAdvice(ce *ledger.CorruptError) string {
	var b strings.Builder
	fmt.Fprintf(&b, "CORRUPT LEDGER: %v", ce)
	if ce.Quarantined != "" {
		fmt.Fprintf(&b, "\n  the bad file is kept at %s for the bug report.", ce.Quarantined)
		return b.String()
	}
	b.WriteString(recoverAdvice(true))
	return b.String()
}

// recoverAdvice adds, under the ledger's own error (which already says to
// run recover), what an operator needs besides: that recover needs root,
// what it keeps (badFile: a corrupt file, which it moves aside; a missing
// or replaced ledger has none), and that the daemon may recover it itself.
func recoverAdvice(badFile bool) string {
	keeps := "every claim whose holder still runs"
	if badFile {
		keeps = "the bad file (moved aside) and " + keeps
	}
	return "\n  NO container gets a GPU until the ledger is recovered (every front end refuses)." +
		"\n  recover needs root (`sudo gpu-guard-ctl recover`); it keeps " + keeps + ", and reports what it recovered." +
		"\n  on an NRI host the daemon also recovers it itself: an external plugin reconnects for a new sync with containerd" +
		" at the next refused container; one launched by containerd rebuilds the ledger in place from the containers it tracks."
}
