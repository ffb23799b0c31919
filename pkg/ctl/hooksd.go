// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"github.com/BurntSushi/toml"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
)

// defaultHooksDir is the hooks directory podman (and CRI-O) read when their
// configuration names none ([engine] hooks_dir of containers.conf).
const defaultHooksDir = "/usr/share/containers/oci/hooks.d"

// DefaultContainersConfs are the containers.conf files podman reads, in
// order, when CONTAINERS_CONF names none: a later one's [engine] hooks_dir
// replaces an earlier one's.
var DefaultContainersConfs = []string{
	"/usr/share/containers/containers.conf",
	"/etc/containers/containers.conf",
	"/etc/containers/containers.conf.d/*.conf",
}

// maxContainersConfBytes bounds the read of one containers.conf.
const maxContainersConfBytes = 1 << 20

// podmanHooksDirs returns the hooks directories podman reads, lowest
// precedence first (a file in a later one masks the file of the same name
// in an earlier one), from the [engine] hooks_dir of the containers.conf
// files confs (patterns, in podman's order): the last one that sets it
// wins, and none setting it leaves podman's default. A file that cannot be
// read or parsed is skipped (podman reports it itself).
func podmanHooksDirs(confs []string) []string {
	dirs := []string{defaultHooksDir}
	for _, pattern := range confs {
		files, err := filepath.Glob(pattern)
		if err != nil {
			continue
		}
		slices.Sort(files)
		for _, f := range files {
			data, err := readSmallRegular(f, maxContainersConfBytes)
			if err != nil {
				continue
			}
			var conf struct {
				Engine struct {
					HooksDir []string `toml:"hooks_dir"`
				} `toml:"engine"`
			}
			if _, err := toml.Decode(string(data), &conf); err != nil || conf.Engine.HooksDir == nil {
				continue
			}
			dirs = conf.Engine.HooksDir
		}
	}
	return dirs
}

// maxHookFileBytes bounds the read of one hooks.d file (they are a few
// hundred bytes).
const maxHookFileBytes = 64 << 10

// hookDefinition is what check-config needs of one hooks.d file (schema
// 1.0.0).
type hookDefinition struct {
	file string
	Hook struct {
		Path string   `json:"path"`
		Args []string `json:"args"`
	} `json:"hook"`
	When struct {
		Always        *bool             `json:"always"`
		Annotations   map[string]string `json:"annotations"`
		Commands      []string          `json:"commands"`
		HasBindMounts *bool             `json:"hasBindMounts"`
	} `json:"when"`
	Stages []string `json:"stages"`
}

// runs reports whether the definition runs the guard's hook phase at stage.
func (h *hookDefinition) runs(stage, phase string) bool {
	if !slices.Contains(h.Stages, stage) {
		return false
	}
	args := h.Hook.Args
	switch filepath.Base(h.Hook.Path) {
	case "nri-gpu-guard-hook":
	case "nri-gpu-guard-hook-relay":
		// "nri-gpu-guard-hook-relay [--relay-NAME=VALUE ...] PHASE ...":
		// the relay's own options come first, the hook's arguments after.
		for len(args) > 1 && isRelayOption(args[1]) {
			args = append(args[:1:1], args[2:]...)
		}
	case "nri-gpu-guard": // "nri-gpu-guard hook PHASE"
		if len(args) < 2 || args[1] != "hook" {
			return false
		}
		args = args[1:]
	default:
		return false
	}
	return len(args) > 1 && args[1] == phase
}

// isRelayOption reports whether arg is one of the options
// nri-gpu-guard-hook-relay reads itself (relay.c): any other argument,
// "--relay-typo=1" too, is the first of the hook's, its phase.
func isRelayOption(arg string) bool {
	for _, p := range []string{"--relay-socket=", "--relay-hook=", "--relay-ack-timeout-ms="} {
		if strings.HasPrefix(arg, p) {
			return true
		}
	}
	return false
}

// forEveryContainer reports whether the definition's conditions match every
// container, as podman and CRI-O match them (schema 1.0.0, every condition
// set must match): no annotations, no hasBindMounts (true needs a bind
// mount; false matches nothing), "always" not false, and either "always"
// true with no commands, or a command pattern that matches any command
// (NVIDIA's own definition sets "always": true with "commands": [".*"]).
// A command pattern is an unanchored regular expression, as the engines
// apply it to process.args[0]; it counts as matching any command when it
// matches each of a set of unlike ones (commandProbes): check-config only
// advises.
func (h *hookDefinition) forEveryContainer() bool {
	w := h.When
	if len(w.Annotations) > 0 || w.HasBindMounts != nil || (w.Always != nil && !*w.Always) {
		return false
	}
	if len(w.Commands) == 0 {
		return w.Always != nil
	}
	return slices.ContainsFunc(w.Commands, matchesAnyCommand)
}

// commandProbes are unlike process.args[0] values: a command pattern that
// matches them all is taken to match any.
var commandProbes = []string{"", "/", "sh", "/bin/sh", "/usr/local/bin/python3", "nvidia-smi", "./run.sh --x", "C:\\x", "\n"}

// matchesAnyCommand reports whether the command pattern p matches every
// probe; one that does not compile matches nothing (the engine refuses it).
func matchesAnyCommand(p string) bool {
	re, err := regexp.Compile(p)
	if err != nil {
		return false
	}
	for _, c := range commandProbes {
		if !re.MatchString(c) {
			return false
		}
	}
	return true
}

// effectiveHookDefinitions reads the *.json files of dirs (lowest
// precedence first), a later file masking an earlier one of the same name.
// Directories that are missing or unreadable, and files that do not parse,
// are left out: the engine reports those itself.
func effectiveHookDefinitions(dirs []string) []hookDefinition {
	byName := map[string]hookDefinition{}
	for _, dir := range dirs {
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, e := range entries {
			if !strings.HasSuffix(e.Name(), ".json") || e.IsDir() {
				continue
			}
			p := filepath.Join(dir, e.Name())
			data, err := readSmallRegular(p, maxHookFileBytes)
			if err != nil {
				continue
			}
			var h hookDefinition
			if json.Unmarshal(data, &h) != nil {
				continue
			}
			h.file = p
			byName[e.Name()] = h // a later directory masks an earlier one
		}
	}
	out := make([]hookDefinition, 0, len(byName))
	for _, h := range byName {
		out = append(out, h)
	}
	slices.SortFunc(out, func(a, b hookDefinition) int { return strings.Compare(a.file, b.file) })
	return out
}

// readSmallRegular reads the regular file p (a symbolic link to one is
// followed, as the engines follow it) of at most limit bytes. It never
// blocks on what is not a regular file (config.OpenRegular: a FIFO named
// *.json is refused, not waited on).
func readSmallRegular(p string, limit int64) ([]byte, error) {
	f, err := config.OpenRegular(p)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%s is larger than %d bytes", p, limit)
	}
	return data, nil
}

// hooksDirWarnings compares [hook] poststop with the guard's hooks.d
// definitions in dirs. With poststop = false a poststop that still runs
// for every container costs the process the setting means to save; with
// poststop = true, a host that runs create-runtime for every container but
// no poststop for every one leaves each exited container's claim until the
// next request, and status reports each as a problem. Nothing is said
// where no create-runtime definition is found: the host may run the NRI
// plugin alone, or read hooks from a directory of its own.
func hooksDirWarnings(dirs []string, poststop bool) []string {
	defs := effectiveHookDefinitions(dirs)
	var create, stopAll []string
	for i := range defs {
		h := &defs[i]
		if h.runs("createRuntime", "create-runtime") && h.forEveryContainer() {
			create = append(create, h.file)
		}
		if h.runs("poststop", "poststop") && h.forEveryContainer() {
			stopAll = append(stopAll, h.file)
		}
	}
	switch {
	case !poststop && len(stopAll) > 0:
		return []string{fmt.Sprintf("hook.poststop: false, but %s runs `nri-gpu-guard-hook poststop` for every container "+
			"(podman's hooks directories, [engine] hooks_dir: %s), which costs the process this setting means to save; "+
			"mask it with /usr/share/nri-gpu-guard/one-hook/nri-gpu-guard-poststop.json in a directory listed after it "+
			"(docs/hook.md, One hook per container), or set poststop = true",
			strings.Join(stopAll, ", "), strings.Join(dirs, ", "))}
	case poststop && len(create) > 0 && len(stopAll) == 0:
		return []string{fmt.Sprintf("hook.poststop: true, but no hooks.d definition in %s (podman's hooks directories, "+
			"[engine] hooks_dir) runs `nri-gpu-guard-hook poststop` for every container while %s runs create-runtime for every one: "+
			"the claim of each exited container lasts until the next request for its GPU and status reports it as a problem; "+
			"install the poststop definition, or set poststop = false for one hook per container",
			strings.Join(dirs, ", "), strings.Join(create, ", "))}
	}
	return nil
}
