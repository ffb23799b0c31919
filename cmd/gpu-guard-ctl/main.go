// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Command gpu-guard-ctl is the operator's tool for the nri-gpu-guard ledger;
// everything it does lives in pkg/ctl.
//
// The release binary is built without cgo (`make build`): a static binary
// starts faster, and most commands only read files. The few that need NVML
// (ps, GPU discovery through NVML) hand the whole invocation to
// `nri-gpu-guard ctl` (see ctl.ExecCompanion), which runs the same commands
// with NVML.
package main

import (
	"context"
	"os"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ctl"
)

func main() {
	env := ctl.DefaultEnv()
	// Interrupt (and SIGTERM, SIGHUP, SIGQUIT) ends `audit --follow`
	// cleanly, and a waiting or changing command through its context; a
	// read that renders once ignores it.
	env.Interrupts = ctl.NotifyInterrupts
	if !withNVML {
		env.NeedNVML = ctl.ExecCompanion(os.Args[1:])
	}
	os.Exit(ctl.Run(context.Background(), os.Args[1:], env))
}
