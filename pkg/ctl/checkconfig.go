// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/version"
)

func (a *app) checkConfigCommand() *cobra.Command {
	return newCommand("check-config [PATH]",
		"Validate a configuration file",
		`Parse and validate a configuration file and report every problem at once, each
naming the key, the bad value and what is accepted. Unknown keys are errors.

PATH defaults to --config, then $NRI_GPU_GUARD_CONFIG, then
/etc/nri-gpu-guard/config.toml. When no path is named and nothing at all is
at the default path, the built-in defaults apply and check-config says so. A
symbolic link there whose target is gone (or a link among the directories
above it) is not "nothing": the file is invalid, as the daemon, the hook and
ctl refuse to run on the defaults in its place.

The ledger dir's parent chain is checked as this host has it: every
directory on the path must be owned by root (or the running user), not a
symlink, and not writable by group or others unless sticky; otherwise anyone
who can rename the state dir could make the host look fresh.

Settings that are valid but risky (a metrics endpoint reachable from other
hosts, exempt namespaces that the OCI hook cannot honour) are listed as
warnings; they do not make the file invalid. So is a [hook] poststop that
disagrees with the guard's hooks.d definitions in the hooks directories
podman reads (the [engine] hooks_dir of its containers.conf files, else
/usr/share/containers/oci/hooks.d; a file in a later directory masks one of
the same name in an earlier one): false while a poststop still runs for
every container, or true while create-runtime does and no poststop does.

Exits 0 when the file is valid (with or without warnings), 1 when it is not.`,
		`  gpu-guard-ctl check-config
  gpu-guard-ctl check-config /etc/nri-gpu-guard/config.toml.new
  gpu-guard-ctl check-config ./config.toml -o json`,
		maxArgs(1),
		func(_ *cobra.Command, args []string) error {
			name := a.configFlag
			if len(args) == 1 {
				name = args[0]
			}
			if name == "" {
				name = a.env.Getenv(config.EnvPath)
			}
			return a.checkConfig(name)
		})
}

// checkConfigView is the check-config output; its JSON is a public interface.
type checkConfigView struct {
	Path     string   `json:"path"`
	Valid    bool     `json:"valid"`
	Defaults bool     `json:"defaults"` // no file: the built-in defaults apply
	Errors   []string `json:"errors"`
	Warnings []string `json:"warnings"`

	cfg config.Config
}

func (a *app) checkConfig(name string) error {
	v := checkConfigView{Errors: []string{}, Warnings: []string{}}
	if name == "" {
		v.Path = config.DefaultPath
		cfg, err := config.LoadFile(config.DefaultPath)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			// Nothing at all is there: LoadFile reports a symbolic
			// link that leads nowhere as another error, and that is
			// invalid (config.ErrLinkLeadsNowhere).
			v.Valid, v.Defaults, v.cfg = true, true, config.Default()
		case err != nil:
			v.Errors = splitErrors(err)
		default:
			v.Valid, v.cfg = true, cfg
		}
	} else {
		v.Path = name
		cfg, err := config.LoadFile(name)
		if err != nil {
			v.Errors = splitErrors(err)
		} else {
			v.Valid, v.cfg = true, cfg
		}
	}
	if v.Valid {
		// The ledger's parent chain as this host has it: the daemon, the
		// hook and ctl refuse to open a ledger below a directory someone
		// else could rename or replace, so check-config says so first. The
		// daemon, the hook and ctl clean the configured path before opening
		// it ("/var/lib/nri-gpu-guard/" is fine), so this check does too.
		if err := ledger.CheckDirChain(filepath.Clean(v.cfg.Ledger.Dir)); err != nil {
			v.Valid = false
			v.Errors = append(v.Errors, fmt.Sprintf("ledger.dir: %v", err))
		}
	}
	if v.Valid {
		v.Warnings = append(v.Warnings, v.cfg.Warnings()...)
		dirs := a.env.HooksDirs
		if dirs == nil {
			confs := a.env.ContainersConfs
			switch {
			case confs != nil:
			case a.env.Getenv("CONTAINERS_CONF") != "":
				confs = []string{a.env.Getenv("CONTAINERS_CONF")}
			default:
				confs = DefaultContainersConfs
			}
			dirs = podmanHooksDirs(confs)
		}
		v.Warnings = append(v.Warnings, hooksDirWarnings(dirs, v.cfg.Hook.Poststop)...)
		// The packaged systemd unit (ProtectSystem=strict) may write only
		// the default ledger dir: another one is read-only there, and the
		// service fails at every start.
		if dir, def := filepath.Clean(v.cfg.Ledger.Dir), config.Default().Ledger.Dir; dir != def {
			v.Warnings = append(v.Warnings, fmt.Sprintf("ledger.dir: %s is not %s, the only ledger directory the packaged "+
				"systemd unit may write (ProtectSystem=strict); allow it with `systemctl edit nri-gpu-guard`: "+
				"[Service] ReadWritePaths=%s", dir, def, dir))
		}
	}
	if err := v.render(a.env.Stdout, a.output); err != nil {
		return err
	}
	if !v.Valid {
		return &quietExit{code: ExitError, why: "invalid configuration"}
	}
	return nil
}

// splitErrors lists the individual problems of a joined validation error.
// config.LoadFile wraps the joined list with the path, so the first error in
// the chain that carries several is the list.
func splitErrors(err error) []string {
	var multi interface{ Unwrap() []error }
	if !errors.As(err, &multi) {
		return []string{err.Error()}
	}
	var out []string
	for _, one := range multi.Unwrap() {
		out = append(out, one.Error())
	}
	return out
}

func (v checkConfigView) render(w io.Writer, output string) error {
	if output == outputJSON {
		return writeJSON(w, v)
	}
	var b strings.Builder
	switch {
	case v.Defaults:
		fmt.Fprintf(&b, "no configuration file at %s: the built-in defaults apply\n", v.Path)
	case v.Valid:
		fmt.Fprintf(&b, "%s: valid\n", escapeLine(v.Path))
	default:
		fmt.Fprintf(&b, "%s: invalid (%d problem(s))\n", escapeLine(v.Path), len(v.Errors))
		for _, e := range v.Errors {
			fmt.Fprintf(&b, "  - %s\n", escapeLine(e))
		}
	}
	for _, w := range v.Warnings {
		fmt.Fprintf(&b, "  warning: %s\n", escapeLine(w))
	}
	if v.Valid {
		c := v.cfg
		fmt.Fprintf(&b, "  ledger dir:     %s\n", c.Ledger.Dir)
		fmt.Fprintf(&b, "  devices:        source %s", c.Devices.Source)
		if n := len(c.Devices.Static); n > 0 {
			fmt.Fprintf(&b, ", %d static GPU(s)", n)
		}
		b.WriteString("\n")
		fmt.Fprintf(&b, "  policy:         on_conflict %s, release_on %s, all_devices %s, privileged %s, unknown_device %s\n",
			c.Policy.OnConflict, c.Policy.ReleaseOn, c.Policy.AllDevices, c.Policy.Privileged, c.Policy.UnknownDevice)
		fmt.Fprintf(&b, "  nri plugin:     %s-%s on %s\n", c.NRI.PluginIndex, c.NRI.PluginName, c.NRI.Socket)
	}
	if _, err := io.WriteString(w, b.String()); err != nil {
		return fmt.Errorf("write output: %w", err)
	}
	return nil
}

func (a *app) versionCommand() *cobra.Command {
	return newCommand("version",
		"Print build information",
		`Print the version, the commit it was built from, the Go version and the
platform.`,
		`  gpu-guard-ctl version
  gpu-guard-ctl version -o json`,
		noArgs,
		func(_ *cobra.Command, _ []string) error {
			if a.output == outputJSON {
				return writeJSON(a.env.Stdout, versionView{
					Program: programName, Version: version.Version, Commit: version.Commit,
					Go: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH,
				})
			}
			if _, err := fmt.Fprintln(a.env.Stdout, version.String(programName)); err != nil {
				return fmt.Errorf("write output: %w", err)
			}
			return nil
		})
}

// versionView is the version output; its JSON is a public interface.
type versionView struct {
	Program  string `json:"program"`
	Version  string `json:"version"`
	Commit   string `json:"commit"`
	Go       string `json:"go"`
	Platform string `json:"platform"`
}
