// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Command ctrprog is the process the hook acceptance tests run inside their
// runc containers. It is built statically (CGO_ENABLED=0) into each rootfs.
//
// Usage: ctrprog DIR NAME MODE
//
// It appends "NAME start" to DIR/order (one line, O_APPEND, so the test can
// read the order in which several containers ran), creates DIR/NAME.started
// holding its pid, and then, in MODE "wait", runs until DIR/NAME.release
// exists; in MODE "exit" it goes on at once; in MODE "open:PATH" it opens
// PATH (a device node the test made) for reading and appends "NAME open ok"
// or "NAME open failed: ERROR" to DIR/order, then goes on. On the way out
// it appends "NAME exit" to DIR/order. DIR is a bind mount shared with the
// test.
package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "ctrprog:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	if len(args) != 3 {
		return errors.New("usage: ctrprog DIR NAME wait|exit|open:PATH")
	}
	dir, name, mode := args[0], args[1], args[2]
	if err := record(dir, name+" start"); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, name+".started"), []byte(fmt.Sprint(os.Getpid())), 0o644); err != nil {
		return err
	}
	if path, ok := strings.CutPrefix(mode, "open:"); ok {
		result := "ok"
		if f, err := os.Open(path); err != nil {
			result = "failed: " + err.Error()
		} else {
			_ = f.Close()
		}
		if err := record(dir, name+" open "+result); err != nil {
			return err
		}
		mode = "exit"
	}
	if mode == "exit" {
		return record(dir, name+" exit")
	}
	// The workload: live until told to stop. Polling here is the container's
	// behaviour, not the tests' synchronisation (they wait on the files this
	// program writes).
	release := filepath.Join(dir, name+".release")
	for {
		if _, err := os.Stat(release); err == nil {
			return record(dir, name+" exit")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// record appends one line to DIR/order. O_APPEND writes of one short line
// are atomic, so lines of concurrent containers never interleave.
func record(dir, line string) error {
	f, err := os.OpenFile(filepath.Join(dir, "order"), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(line + "\n"); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}
