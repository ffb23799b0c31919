// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// ErrArgs is wrapped by ParseArgs' errors: the command line is not one of a
// hook phase. The hook binary prints its usage after such an error; a
// server that runs hooks for a relay (pkg/hookserve) answers nothing and
// lets the hook binary itself say it.
var ErrArgs = errors.New("not a hook phase's command line")

// ParseArgs parses a hook phase's command line, from the phase on:
// create-runtime|poststop [--config PATH] [--state-dir DIR] [--wait], in the
// flag package's syntax. It is nri-gpu-guard-hook's own parsing, shared with
// the server that runs the same hook for a relay, so that both take exactly
// the same command lines. The returned Invocation's Program is program; its
// Options.Started is left for the caller. It writes nothing: an error says
// what is wrong on one line and wraps ErrArgs (and flag.ErrHelp for -h or
// --help after the phase).
func ParseArgs(program string, args []string) (Invocation, error) {
	if len(args) == 0 {
		return Invocation{}, argsError{msg: fmt.Sprintf("no phase (want %s or %s)", PhaseCreateRuntime, PhasePoststop)}
	}
	inv := Invocation{Program: program, Phase: args[0]}
	if inv.Phase != PhaseCreateRuntime && inv.Phase != PhasePoststop {
		return Invocation{}, argsError{msg: fmt.Sprintf("unknown phase %q", inv.Phase)}
	}
	fs := phaseFlags(program, &inv)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	if err := fs.Parse(args[1:]); err != nil {
		return Invocation{}, argsError{msg: err.Error(), err: err}
	}
	if fs.NArg() > 0 {
		return Invocation{}, argsError{msg: fmt.Sprintf("unexpected argument %q", fs.Arg(0))}
	}
	return inv, nil
}

// PrintPhaseDefaults writes the options of a hook phase as the flag package
// lists them (flag.FlagSet.PrintDefaults), for a usage text.
func PrintPhaseDefaults(w io.Writer) {
	fs := phaseFlags("", &Invocation{})
	fs.SetOutput(w)
	fs.PrintDefaults()
}

// phaseFlags defines a hook phase's options on a new flag set, bound to inv.
func phaseFlags(program string, inv *Invocation) *flag.FlagSet {
	fs := flag.NewFlagSet(program, flag.ContinueOnError)
	fs.StringVar(&inv.Config, "config", "", "configuration file (default $"+config.EnvPath+" or "+config.DefaultPath+")")
	fs.StringVar(&inv.StateDir, "state-dir", "", "ledger directory (default [ledger] dir)")
	fs.BoolVar(&inv.Options.Wait, "wait", false, "create-runtime: wait in the queue for a busy GPU (plain runc only; ignored under conmon and containerd-shim)")
	return fs
}

// argsError is ParseArgs' error: its text is the line the hook binary
// prints before its usage, as it did before the parsing was shared.
type argsError struct {
	msg string
	err error // the flag package's, if any
}

func (e argsError) Error() string { return e.msg }

func (e argsError) Is(target error) bool { return target == ErrArgs }

func (e argsError) Unwrap() error { return e.err }
