// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Command sleeper is the only program in the integration tests' container
// image: it serves as the pod sandbox ("pause") process and as every workload
// container. It sleeps until SIGTERM or SIGINT and then exits 0, so that a
// CRI stop ends it at once (no wait for the stop timeout's SIGKILL) and its
// exit is a clean one.
//
// It must be built with CGO_ENABLED=0: the image holds no libc.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	fmt.Fprintf(os.Stdout, "sleeper: pid %d sleeping until SIGTERM/SIGINT\n", os.Getpid())
	<-ctx.Done()
	fmt.Fprintln(os.Stdout, "sleeper: signalled, exiting")
}
