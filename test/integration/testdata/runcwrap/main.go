// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Command runcwrap runs runc, first removing the CPU resources from the
// bundle's OCI spec on `create` and `run`. The end-to-end suite uses it only
// when it runs on a cgroup v2 view of a hybrid host (cgroup2.sh), where the
// cpu controller stays bound to its v1 hierarchy and cannot be enabled in
// cgroup v2: runc would fail writing cpu.weight for the CRI sandbox's
// default CPU shares. Everything else (the container's cgroup, its process
// list, its populated state) is runc's own.
//
// Environment: RUNCWRAP_RUNC is the runc to run (default: runc on PATH).
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "runcwrap: %v\n", err)
		os.Exit(1)
	}
}

func run() error {
	args := os.Args[1:]
	if bundle, ok := bundleOf(args); ok {
		if err := dropCPU(filepath.Join(bundle, "config.json")); err != nil {
			return err
		}
	}
	runc := os.Getenv("RUNCWRAP_RUNC")
	if runc == "" {
		p, err := exec.LookPath("runc")
		if err != nil {
			return err
		}
		runc = p
	}
	return syscall.Exec(runc, append([]string{"runc"}, args...), os.Environ())
}

// bundleOf returns the --bundle (or -b) value of a create or run command.
func bundleOf(args []string) (string, bool) {
	cmd := false
	for i := 0; i < len(args); i++ {
		switch a := args[i]; {
		case a == "create" || a == "run":
			cmd = true
		case cmd && (a == "--bundle" || a == "-b") && i+1 < len(args):
			return args[i+1], true
		case cmd && len(a) > 9 && a[:9] == "--bundle=":
			return a[9:], true
		}
	}
	return "", false
}

// dropCPU removes linux.resources.cpu from the spec at path, keeping every
// other field as it is.
func dropCPU(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var spec map[string]json.RawMessage
	if err := json.Unmarshal(b, &spec); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	var linux map[string]json.RawMessage
	if raw, ok := spec["linux"]; !ok || json.Unmarshal(raw, &linux) != nil {
		return nil
	}
	var res map[string]json.RawMessage
	if raw, ok := linux["resources"]; !ok || json.Unmarshal(raw, &res) != nil {
		return nil
	}
	if _, ok := res["cpu"]; !ok {
		return nil
	}
	delete(res, "cpu")
	if linux["resources"], err = json.Marshal(res); err != nil {
		return err
	}
	if spec["linux"], err = json.Marshal(linux); err != nil {
		return err
	}
	out, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	return os.WriteFile(path, out, 0o600)
}
