// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// Output formats accepted by -o.
const (
	outputTable = "table"
	outputWide  = "wide"
	outputJSON  = "json"
)

// rootCommand builds the command tree. It is rebuilt for every Run: cobra
// commands hold parsed flag values, and tests run many command lines.
func (a *app) rootCommand(args []string) *cobra.Command {
	root := &cobra.Command{
		Use:   programName,
		Short: "Inspect and operate the nri-gpu-guard GPU ledger",
		Long: `gpu-guard-ctl shows which container holds which GPU on this host, who waits
for one, and what a container would be told if it were created now. Root can
force-release a stuck claim (audited) and collect claims of exited holders.

Read commands never take the ledger lock, so they are safe to run at any time.

Exit codes: 0 ok, 1 error, 2 usage, 3 attention needed (status or ps found
a problem: a conflict, an exited holder, an unknown device, an observer
cordon or finding; see docs/ctl-json.md).`,
		Example: `  gpu-guard-ctl status
  gpu-guard-ctl queue -o json
  sudo gpu-guard-ctl release --container 4f2a9c1be0d3 --reason "job hung, GPU memory leaked"`,
		// Silence cobra's own printing: Run prints errors once, in one format,
		// and maps them to exit codes.
		SilenceErrors: true,
		SilenceUsage:  true,
		// With Args set, an unknown command reaches validateRoot instead of
		// cobra's plain error, so it becomes a usage error (exit 2) that still
		// suggests the command meant.
		Args: a.validateRoot,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cmd.SetOut(a.env.Stderr)
			_ = cmd.Usage()
			return usagef("no command given")
		},
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			switch a.output {
			case outputTable, outputWide, outputJSON:
			default:
				return usagef("invalid output format %q (want table, wide or json)", a.output)
			}
			if a.env.Interrupts != nil && cmd.Annotations[annotReadOnce] == "" {
				ctx, stop := a.env.Interrupts(cmd.Context())
				cmd.SetContext(ctx)
				a.stopInterrupts = stop
			}
			return nil
		},
	}
	root.CompletionOptions.HiddenDefaultCmd = true
	// cobra only suggests prefixes unless a distance is set.
	root.SuggestionsMinimumDistance = 2
	root.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error {
		// "relase --container x": cobra parses the subcommand's flags
		// against the root when the command is unknown. The unknown command
		// is the mistake to report, with its suggestion. A word that names
		// a command is no such mistake ("--bogus status": cobra stops at
		// the unknown flag before it finds the command): the flag is.
		if !cmd.HasParent() {
			if word := firstWord(cmd, args); word != "" && !isCommand(cmd, word) {
				if uerr := a.validateRoot(cmd, []string{word}); uerr != nil {
					return uerr
				}
			}
		}
		return &usageError{msg: err.Error()}
	})
	pf := root.PersistentFlags()
	pf.StringVar(&a.configFlag, "config", "", "configuration file (default $NRI_GPU_GUARD_CONFIG, else /etc/nri-gpu-guard/config.toml)")
	pf.StringVar(&a.stateDirFlag, "state-dir", "", "ledger directory (overrides [ledger] dir of the configuration)")
	pf.StringVarP(&a.output, "output", "o", outputTable, "output format: table, wide or json")

	root.AddCommand(
		readOnce(a.statusCommand()),
		a.psCommand(),
		readOnce(a.claimsCommand()),
		readOnce(a.queueCommand()),
		a.devicesCommand(),
		readOnce(a.explainCommand()),
		a.auditCommand(),
		a.releaseCommand(),
		a.gcCommand(),
		a.cordonCommand(),
		a.uncordonCommand(),
		a.runCommand(),
		a.recoverCommand(),
		readOnce(a.checkConfigCommand()),
		readOnce(a.versionCommand()),
	)
	return root
}

// validateRoot turns a stray word after the program name into a usage error
// naming the closest commands.
func (a *app) validateRoot(cmd *cobra.Command, args []string) error {
	if len(args) == 0 {
		return nil
	}
	msg := fmt.Sprintf("unknown command %q for %q", args[0], programName)
	if s := cmd.SuggestionsFor(args[0]); len(s) > 0 {
		msg += "\n\nDid you mean this?\n\t" + strings.Join(s, "\n\t")
	}
	return &usageError{msg: msg}
}

// isCommand reports whether word names one of root's commands (or an alias).
func isCommand(root *cobra.Command, word string) bool {
	for _, c := range root.Commands() {
		if c.Name() == word || c.HasAlias(word) {
			return true
		}
	}
	return false
}

// firstWord is the first argument that is neither a flag nor the value of one
// of cmd's flags: what cobra takes for the command name.
func firstWord(cmd *cobra.Command, args []string) string {
	for i := 0; i < len(args); i++ {
		arg := args[i]
		switch {
		case arg == "--":
			return ""
		case !strings.HasPrefix(arg, "-") || arg == "-":
			return arg
		case strings.Contains(arg, "="):
			continue
		}
		var f *pflag.Flag
		if name, ok := strings.CutPrefix(arg, "--"); ok {
			f = cmd.Flags().Lookup(name)
		} else if len(arg) == 2 {
			f = cmd.Flags().ShorthandLookup(arg[1:])
		}
		if f != nil && f.NoOptDefVal == "" {
			i++ // the flag's value
		}
	}
	return ""
}

// noArgs rejects positional arguments for commands that take none.
func noArgs(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usagef("%s takes no arguments, got %q", cmd.CommandPath(), strings.Join(args, " "))
	}
	return nil
}

// maxArgs rejects more than n positional arguments.
func maxArgs(n int) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) > n {
			return usagef("%s takes at most %d argument(s), got %q", cmd.CommandPath(), n, strings.Join(args, " "))
		}
		return nil
	}
}

// newCommand fills the fields every subcommand shares.
func newCommand(use, short, long, example string, args cobra.PositionalArgs, run func(cmd *cobra.Command, args []string) error) *cobra.Command {
	return &cobra.Command{Use: use, Short: short, Long: long, Example: example, Args: args, RunE: run}
}

// annotReadOnce marks a command that reads once and renders, without
// waiting and without changing anything: it runs without Env.Interrupts.
const annotReadOnce = "gpu-guard-ctl/read-once"

// readOnce marks cmd as annotReadOnce.
func readOnce(cmd *cobra.Command) *cobra.Command {
	cmd.Annotations = map[string]string{annotReadOnce: "true"}
	return cmd
}
