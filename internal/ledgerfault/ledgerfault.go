// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Package ledgerfault lets the tests of other packages make the ledger's
// syncs fail, as a disk does on an I/O error: the ledger's own tests stop
// and cut its writes at its failpoints, which no other package reaches, but
// what a front end does with a commit whose sync failed after its record was
// written (the record stands for every reader; the caller got an error) is
// only seen with the front end, the guard and the ledger together.
//
// Invariant: production code never sets a fault; unset, Sync costs one
// atomic load.
package ledgerfault

import "sync/atomic"

var fault atomic.Pointer[func(path string) error]

// FailSync makes every sync the ledger makes after this call (of an
// appended journal record: path is the journal; of the state directory after
// a rename: path is the directory) fail with the error fail returns for its
// path, nil letting that sync run. The data was written already: only its
// sync fails. It returns the function that lifts the fault; a test calls it
// before it ends (t.Cleanup).
func FailSync(fail func(path string) error) (lift func()) {
	fault.Store(&fail)
	return func() { fault.Store(nil) }
}

// Sync is what the ledger asks before it syncs path: an error stands for the
// sync's own.
func Sync(path string) error {
	if f := fault.Load(); f != nil {
		return (*f)(path)
	}
	return nil
}
