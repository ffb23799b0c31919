// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"fmt"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/runtimescan"
)

// scanRuntimes lists the live containers of the configured runtime roots
// and resolves each one's GPUs as the OCI hook resolves them (same spec
// decoding, inventory and policy), in the order they were started.
func (a *app) scanRuntimes(cfg config.Config, l *ledger.Ledger) (*runtimescan.Result, error) {
	res, err := runtimescan.Read(cfg.Hook.RuntimeRoots, a.env.ProcRoot, func() (*guard.Guard, error) {
		inv, _, err := a.inventory()
		if err != nil {
			return nil, err
		}
		// The guard's resolver: the same inventory and policy the hook
		// decided with. The guard only resolves here; Recover writes.
		return guard.New(guard.Options{Config: cfg, Inventory: inv, Ledger: l, Liveness: a.env.Liveness, Now: a.env.Now})
	})
	if err != nil {
		return nil, fmt.Errorf("%w (fix that, or recover without the check: --no-runtime)", err)
	}
	return res, nil
}
