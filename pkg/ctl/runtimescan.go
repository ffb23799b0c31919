// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"fmt"
	"slices"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/runtimestate"
)

// runtimeScan is what recover learned from the OCI runtimes' state dirs.
type runtimeScan struct {
	// Roots are the roots read (configured ones that exist).
	Roots []string `json:"roots"`
	// Live is the number of created or running containers found.
	Live int `json:"live"`
	// Unresolved are live containers whose GPUs could not be told (their
	// spec unreadable, or their request no longer resolves): their claims
	// are kept, but nothing is adopted for them.
	Unresolved []runtimeNote `json:"unresolved,omitempty"`
	// Creating are containers being created (no state file yet).
	Creating []string `json:"creating,omitempty"`
	// Problems are entries that could not be read as containers.
	Problems []runtimestate.Problem `json:"problems,omitempty"`

	holdings []ledger.Holding
	why      []string
}

// maxAdoptSourceLen bounds the "how it named the device" text of an
// adopted claim, as the guard bounds it for an admitted one.
const maxAdoptSourceLen = 512

// runtimeNote names a container and what is wrong with it.
type runtimeNote struct {
	ID      string `json:"id"`
	Runtime string `json:"runtime"`
	Error   string `json:"error"`
}

// scanRuntimes lists the live containers of the configured runtime roots
// and resolves each one's GPUs as the OCI hook resolves them (same spec
// decoding, inventory and policy), in the order they were started.
func (a *app) scanRuntimes(cfg config.Config, l *ledger.Ledger) (*runtimeScan, error) {
	scan := runtimestate.Scan(cfg.Hook.RuntimeRoots, runtimestate.Options{ProcRoot: a.env.ProcRoot})
	out := &runtimeScan{Roots: scan.Roots, Creating: scan.Creating, Problems: scan.Problems}
	live := scan.Live()
	out.Live = len(live)
	if len(live) == 0 {
		return out, nil
	}
	inv, _, err := a.inventory()
	if err != nil {
		// Without the inventory no running container's GPUs can be told,
		// and a lost claim would stay lost: refuse rather than recover
		// half-way.
		return nil, fmt.Errorf("the runtimes run %d container(s) whose GPUs must be checked, but the GPU inventory "+
			"did not load: %w (fix that, or recover without the check: --no-runtime)", len(live), err)
	}
	// The guard's resolver: the same inventory and policy the hook decided
	// with. The guard only resolves here; Recover writes.
	g, err := guard.New(guard.Options{Config: cfg, Inventory: inv, Ledger: l, Liveness: a.env.Liveness, Now: a.env.Now})
	if err != nil {
		return nil, err
	}
	for _, c := range live {
		st := specs.State{Version: specs.Version, ID: c.ID, Pid: c.Pid, Bundle: c.Bundle, Annotations: c.Annotations}
		owner := guard.BoundOwner(hook.OwnerFrom(st, c.Spec, c.PidStart))
		owner.FrontEnd = ledger.FrontEndHook
		if owner.Cgroup == "" {
			owner.Cgroup = guard.BoundCgroup(c.Cgroup)
		}
		h := ledger.Holding{Owner: owner}
		if c.SpecErr != nil {
			out.Unresolved = append(out.Unresolved, runtimeNote{ID: c.ID, Runtime: c.Runtime, Error: c.SpecErr.Error()})
		} else if res, err := g.Resolve(c.Request); err != nil {
			out.Unresolved = append(out.Unresolved, runtimeNote{ID: c.ID, Runtime: c.Runtime, Error: err.Error()})
		} else {
			var srcs []string
			for _, d := range res.Devices {
				h.Devices = append(h.Devices, d.Device)
				for _, s := range d.Sources {
					if !slices.Contains(srcs, s) {
						srcs = append(srcs, s)
					}
				}
			}
			h.Source = strings.Join(srcs, "; ")
			if len(h.Source) > maxAdoptSourceLen {
				h.Source = h.Source[:maxAdoptSourceLen] + "…"
			}
		}
		// Even a container with no GPU (or none that can be told) is
		// listed: a claim it holds is never released while it runs.
		out.holdings = append(out.holdings, h)
		out.why = append(out.why, fmt.Sprintf("recover: found %s in %s state (%s)", c.Status, c.Runtime, c.Root))
	}
	return out, nil
}
