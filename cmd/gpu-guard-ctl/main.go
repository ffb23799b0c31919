// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Command gpu-guard-ctl is the operator's tool for the nri-gpu-guard ledger;
// everything it does lives in pkg/ctl.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ctl"
)

func main() {
	// Interrupt ends `audit --follow` cleanly; other commands finish quickly.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := ctl.Run(ctx, os.Args[1:], ctl.DefaultEnv())
	stop()
	os.Exit(code)
}
