// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Command durablefloor is the floor of a hook that must record a claim or a
// release durably: a static Go program that reads its stdin to the end and
// then does the least one durable ledger commit needs, nothing more. It
// opens the lock file of the state dir and flocks it, appends one record of
// the size the journal writes for that phase to a file in the same dir with
// one write, fdatasyncs it and unlocks. Every hook that keeps the
// durability contract (one fdatasync per claim and per release) pays at
// least this; the benchmarks measure the guard's hooks against it.
//
//	durablefloor [create-runtime|poststop] [...] --state-dir DIR [...]
//
// Arguments other than the phase and --state-dir are ignored, so that it
// takes the hook's place with the hook's arguments. Built with
// CGO_ENABLED=0 by BenchmarkHookProcess and BenchmarkRuncHook.
package main

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"syscall"
)

// Record sizes: a journal line of a claim by an environment variable
// (device, owner with pid and start time, source, since) and of a release
// (the device's UUID), as the ledger writes them for one GPU.
const (
	claimRecord   = 323
	releaseRecord = 112
)

func main() {
	if _, err := io.Copy(io.Discard, os.Stdin); err != nil {
		os.Exit(1)
	}
	dir, size := "", claimRecord
	args := os.Args[1:]
	for i, a := range args {
		switch {
		case a == "poststop":
			size = releaseRecord
		case a == "--state-dir" && i+1 < len(args):
			dir = args[i+1]
		}
	}
	if dir == "" {
		_, _ = os.Stderr.WriteString("durablefloor: --state-dir DIR is required\n")
		os.Exit(2)
	}
	if err := commit(dir, size); err != nil {
		_, _ = os.Stderr.WriteString("durablefloor: " + err.Error() + "\n")
		os.Exit(1)
	}
}

func commit(dir string, size int) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	lock, err := os.OpenFile(filepath.Join(dir, "floor.lock"), os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	defer func() { _ = lock.Close() }()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return err
	}
	defer func() { _ = syscall.Flock(int(lock.Fd()), syscall.LOCK_UN) }()
	f, err := os.OpenFile(filepath.Join(dir, "floor.journal"), os.O_WRONLY|os.O_APPEND|os.O_CREATE|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	rec := append(bytes.Repeat([]byte("x"), size-1), '\n')
	if _, err := f.Write(rec); err != nil {
		return err
	}
	return syscall.Fdatasync(int(f.Fd()))
}
