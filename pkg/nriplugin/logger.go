// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"context"
	"fmt"
	"log/slog"

	nrilog "github.com/containerd/nri/pkg/log"
)

// slogAdapter routes the NRI stub's own log lines into the daemon's slog
// logger, so that one log stream carries both.
type slogAdapter struct {
	log *slog.Logger
}

var _ nrilog.Logger = slogAdapter{}

func (a slogAdapter) Debugf(ctx context.Context, format string, args ...any) {
	a.emit(ctx, slog.LevelDebug, format, args)
}

func (a slogAdapter) Infof(ctx context.Context, format string, args ...any) {
	a.emit(ctx, slog.LevelInfo, format, args)
}

func (a slogAdapter) Warnf(ctx context.Context, format string, args ...any) {
	a.emit(ctx, slog.LevelWarn, format, args)
}

func (a slogAdapter) Errorf(ctx context.Context, format string, args ...any) {
	a.emit(ctx, slog.LevelError, format, args)
}

func (a slogAdapter) emit(ctx context.Context, level slog.Level, format string, args []any) {
	if ctx == nil {
		ctx = context.Background()
	}
	if !a.log.Enabled(ctx, level) {
		return
	}
	a.log.Log(ctx, level, fmt.Sprintf(format, args...), slog.String("component", "nri"))
}
