// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"os"
	"os/signal"
	"sync"
	"syscall"
)

// interrupts is a hook's handling of SIGTERM and SIGINT (they cancel the
// context, with "<signal> signal received" as its cause, so that a waiting
// hook leaves the queue and says why) and of SIGPIPE (ignored: a runtime
// that died while its hook waits leaves stdout and stderr without a reader,
// and a write there must fail with EPIPE, not kill the hook before it left
// the queue).
//
// It is set up only when the hook is about to block: before it waits in the
// queue (--wait), for the turnstile, or for a ledger lock another process
// holds. Setting it up costs a hook more than its whole decision when
// nothing is contended (os/signal starts a goroutine locked to a thread of
// its own, and the runtime then a template thread to start others from), and
// a hook that does not block answers in about a millisecond. A signal that
// arrives before then ends the process the default way; at that point it has
// either written nothing or completed ledger transactions, which are
// crash-safe (the ledger is written for kill -9 at any instant) and are
// undone as after any hook failure: the runtime deletes a container whose
// hook failed, and its poststop releases what it holds.
type interrupts struct {
	once   sync.Once
	cancel context.CancelCauseFunc
	sigs   chan os.Signal
	done   chan struct{}
}

// newInterrupts returns the context that the handling, once armed, cancels.
func newInterrupts(parent context.Context) (context.Context, *interrupts) {
	ctx, cancel := context.WithCancelCause(parent)
	return ctx, &interrupts{cancel: cancel}
}

// arm sets the handling up; only the first call does anything, and none
// after stop.
func (i *interrupts) arm() {
	i.once.Do(func() {
		i.sigs = make(chan os.Signal, 1)
		i.done = make(chan struct{})
		signal.Notify(i.sigs, syscall.SIGTERM, syscall.SIGINT)
		signal.Ignore(syscall.SIGPIPE)
		go func() {
			select {
			case s := <-i.sigs:
				i.cancel(signalCause(s.String() + " signal received"))
			case <-i.done:
			}
		}()
	})
}

// stop undoes arm and cancels the context.
func (i *interrupts) stop() {
	i.once.Do(func() {}) // an arm from now on does nothing
	if i.sigs != nil {
		signal.Stop(i.sigs)
		close(i.done)
	}
	i.cancel(nil)
}

// signalCause is the cause of a context cancelled by a signal, worded as
// signal.NotifyContext words it.
type signalCause string

func (c signalCause) Error() string { return string(c) }
