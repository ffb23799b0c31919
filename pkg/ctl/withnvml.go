// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices/nvmlloader"
)

// Companion is the binary a gpu-guard-ctl built without cgo hands a command
// that needs NVML to: the daemon, linked with NVML, runs the same command
// tree as `nri-gpu-guard ctl ARGS...` (CompanionCommand).
const (
	Companion        = "nri-gpu-guard"
	CompanionCommand = "ctl"
)

// NVMLHandoverError is the error of a command that needed NVML in a process
// without it and could not hand itself over (Env.NeedNVML failed). Nothing
// else may stand in for NVML then: status does not fall back to the claimed
// devices, "auto" does not move on to /proc/driver/nvidia (the daemon,
// which has NVML, would have seen another inventory).
type NVMLHandoverError struct {
	// Why is what needed NVML.
	Why string
	Err error
}

func (e *NVMLHandoverError) Error() string {
	return fmt.Sprintf("%s needs NVML: %v", e.Why, e.Err)
}

func (e *NVMLHandoverError) Unwrap() error { return e.Err }

// needNVML hands the invocation over to a process with NVML (Env.NeedNVML),
// where the command is about to initialise NVML. It returns nil when this
// process has NVML itself; otherwise it returns only when the handover
// failed.
func (a *app) needNVML(why string) error {
	if a.env.NeedNVML == nil {
		return nil
	}
	err := a.env.NeedNVML(why)
	if err == nil {
		err = errors.New("the handover to a binary with NVML returned without running the command")
	}
	return &NVMLHandoverError{Why: why, Err: err}
}

// nvmlLoader is the NVML source of the inventory: the library itself, or in
// a process without NVML the handover, at the moment discovery would call
// NVML and not before (a trusted cache, a static or proc source never need
// it).
func (a *app) nvmlLoader(source config.Source) (devices.Loader, *handoverLoader) {
	if a.env.NeedNVML == nil {
		return nvmlloader.New(a.env.NVML), nil
	}
	h := &handoverLoader{a: a, why: discoveryWhy(source)}
	return h, h
}

// handoverLoader is the NVML loader of a process without NVML. Its Load hands
// the process over; when that fails it keeps the error, so that the caller
// fails with it rather than with what discovery made of it.
type handoverLoader struct {
	a   *app
	why string
	err error
}

func (h *handoverLoader) Name() string { return string(config.SourceNVML) }

func (h *handoverLoader) Load() ([]devices.GPU, error) {
	h.err = h.a.needNVML(h.why)
	return nil, h.err
}

// ExecCompanion is Env.NeedNVML of the gpu-guard-ctl release binary, which is
// built without cgo: it replaces the process with `nri-gpu-guard ctl ARGS...`
// (args: this process's arguments, without the program name), found next to
// this executable, else on PATH. It returns only when that binary is missing
// or cannot be started.
func ExecCompanion(args []string) func(why string) error {
	return func(string) error {
		path, err := findCompanion()
		if err != nil {
			return err
		}
		argv := append([]string{path, CompanionCommand}, args...)
		if err := syscall.Exec(path, argv, os.Environ()); err != nil { //nolint:gosec // the package's own daemon binary, next to this one or on PATH
			return fmt.Errorf("run %s %s: %w", path, CompanionCommand, err)
		}
		return nil
	}
}

// findCompanion looks for the companion binary next to this executable, then
// on PATH.
func findCompanion() (string, error) {
	self, err := os.Executable()
	if err == nil {
		next := filepath.Join(filepath.Dir(self), Companion)
		if fi, err := os.Stat(next); err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
			return next, nil
		}
	}
	path, err := exec.LookPath(Companion)
	if err != nil {
		where := "on PATH"
		if self != "" {
			where = "next to " + self + " nor on PATH"
		}
		return "", fmt.Errorf("this %s is built without NVML and runs such commands as `%s %s`, but there is no %s %s: "+
			"install the nri-gpu-guard package, which ships both binaries in the same directory", programName, Companion, CompanionCommand, Companion, where)
	}
	return path, nil
}

// discoveryWhy is what needs NVML when the inventory is discovered.
func discoveryWhy(source config.Source) string {
	return fmt.Sprintf("GPU discovery (devices.source = %q)", source)
}
