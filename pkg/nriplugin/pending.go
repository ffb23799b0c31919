// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"context"
	"sync"
)

// pending counts work in the background (the start records) and lets a
// handler wait, within its context, until none is left: the ledger then
// shows every start record committed before the handler's own work.
type pending struct {
	mu   sync.Mutex
	n    int
	idle chan struct{} // closed while n is 0
}

func newPending() *pending {
	idle := make(chan struct{})
	close(idle)
	return &pending{idle: idle}
}

func (w *pending) add() {
	w.mu.Lock()
	if w.n == 0 {
		w.idle = make(chan struct{})
	}
	w.n++
	w.mu.Unlock()
}

func (w *pending) done() {
	w.mu.Lock()
	w.n--
	if w.n == 0 {
		close(w.idle)
	}
	w.mu.Unlock()
}

// wait returns once nothing is pending, or with ctx's error.
func (w *pending) wait(ctx context.Context) error {
	w.mu.Lock()
	idle := w.idle
	w.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
