// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hookserve"
)

// cmdServe runs the resident server that nri-gpu-guard-hook-relay forwards
// hook runs to (pkg/hookserve).
const cmdServe = "serve"

// serveUsage is serve's line of the usage.
const serveUsage = program + " " + cmdServe + " [--socket PATH]"

// serve runs the hook server until SIGTERM or SIGINT: on the socket systemd
// passed, if any, else on --socket.
func serve(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet(program+" "+cmdServe, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		_, _ = fmt.Fprintln(fs.Output(), "usage: "+serveUsage+"\n\n"+
			"Answers nri-gpu-guard-hook-relay's hook runs with the hook of this binary, until SIGTERM or SIGINT.\n"+
			"A socket passed by systemd socket activation is used instead of --socket.")
		fs.PrintDefaults()
	}
	socket := fs.String("socket", hookserve.DefaultSocket, "unix socket to listen on (its directory is created, mode 0755, if missing)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		_, _ = fmt.Fprintf(stderr, "%s %s: unexpected argument %q\n", program, cmdServe, fs.Arg(0))
		fs.Usage()
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	// A broken stderr (journald restarted) must not end the server: Go
	// exits on EPIPE for fds 1 and 2 unless SIGPIPE is handled. Its log
	// lines are lost then; the relays are still answered.
	signal.Ignore(syscall.SIGPIPE)
	l, err := listen(*socket)
	if err != nil {
		_, _ = fmt.Fprintf(stderr, "%s %s: %v\n", program, cmdServe, err)
		return 1
	}
	// The one line of a healthy start: the journal shows where it listens,
	// and whoever started it can wait for this line rather than poll.
	_, _ = fmt.Fprintf(stderr, "%s %s: listening on %s\n", program, cmdServe, l.Addr())
	if err := hookserve.New(program, stderr).Serve(ctx, l); err != nil {
		_, _ = fmt.Fprintf(stderr, "%s %s: %v\n", program, cmdServe, err)
		return 1
	}
	return 0
}

// listen takes the socket systemd passed, or listens on path.
func listen(path string) (*net.UnixListener, error) {
	l, ok, err := hookserve.Activated()
	if ok || err != nil {
		return l, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil { //nolint:gosec // the relay, run by any runtime, must reach the socket
		return nil, fmt.Errorf("create the socket's directory: %w", err)
	}
	return hookserve.Listen(path)
}
