// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package runtimescan

import (
	"fmt"
	"slices"
	"strings"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/runtimestate"
)

// Result is what was learned from the runtimes' state dirs.
type Result struct {
	// Roots are the roots read (configured ones that exist).
	Roots []string `json:"roots"`
	// Live is the number of created or running containers found.
	Live int `json:"live"`
	// Unresolved are live containers whose GPUs could not be told (their
	// spec unreadable, or their request no longer resolves): their claims
	// are kept, but nothing is adopted for them.
	Unresolved []Note `json:"unresolved,omitempty"`
	// Creating are containers being created (no state file yet).
	Creating []string `json:"creating,omitempty"`
	// Problems are entries that could not be read as containers.
	Problems []runtimestate.Problem `json:"problems,omitempty"`

	// Holdings are the live containers as the hook front end's holders, in
	// the order they were started, and Why the audit reason of each (for
	// ledger.RecoverOptions.Running and RunningWhy).
	Holdings []ledger.Holding `json:"-"`
	Why      []string         `json:"-"`
}

// Note names a container and what is wrong with it.
type Note struct {
	ID      string `json:"id"`
	Runtime string `json:"runtime"`
	Error   string `json:"error"`
}

// maxSourceLen bounds the "how it named the device" text of an adopted
// claim, as the guard bounds it for an admitted one.
const maxSourceLen = 512

// Read lists the live containers of roots (pids checked under procRoot, ""
// for /proc) and resolves each one's GPUs as the OCI hook resolves them
// (same spec decoding, inventory and policy). guardFor gives the guard to
// resolve with; it is called only when a live container is found, so that
// a host without one never needs the inventory.
func Read(roots []string, procRoot string, guardFor func() (*guard.Guard, error)) (*Result, error) {
	return ReadBy(roots, procRoot, time.Time{}, guardFor)
}

// ReadBy is Read that gives up once deadline (zero: none) has passed, with
// an error: a list that misses containers would lose their claims.
func ReadBy(roots []string, procRoot string, deadline time.Time, guardFor func() (*guard.Guard, error)) (*Result, error) {
	scan := runtimestate.Scan(roots, runtimestate.Options{ProcRoot: procRoot, Deadline: deadline})
	if scan.Unfinished != "" {
		return nil, fmt.Errorf("the runtimes' state was not read in time: the scan %s", scan.Unfinished)
	}
	out := &Result{Roots: scan.Roots, Creating: scan.Creating, Problems: scan.Problems}
	live := scan.Live()
	out.Live = len(live)
	if len(live) == 0 {
		return out, nil
	}
	g, err := guardFor()
	if err != nil {
		// Without the inventory no running container's GPUs can be told,
		// and a lost claim would stay lost: refuse rather than recover
		// half-way.
		return nil, fmt.Errorf("the runtimes run %d container(s) whose GPUs must be checked, but the GPU inventory "+
			"did not load: %w", len(live), err)
	}
	for i, c := range live {
		if !deadline.IsZero() && !time.Now().Before(deadline) {
			return nil, fmt.Errorf("the runtimes' containers were not resolved in time: %d of %d done", i, len(live))
		}
		st := specs.State{Version: specs.Version, ID: c.ID, Pid: c.Pid, Bundle: c.Bundle, Annotations: c.Annotations}
		owner := guard.BoundOwner(hook.OwnerFrom(st, c.Spec, c.PidStart))
		owner.FrontEnd = ledger.FrontEndHook
		// The spec's cgroupsPath, and the runtime's state (runc copies
		// it from the spec), name a cgroup the container's creator
		// chose: recorded only when the process is in it, as the hook
		// does at create-runtime. An empty cgroup named by a container
		// left in its caller's cgroup would read as exited, and the
		// adopted claim be released while its holder runs; without a
		// cgroup liveness goes by pid and start time.
		owner.Cgroup = hook.VerifiedCgroup(procRootOr(procRoot), c.Pid, c.ID, owner.Cgroup, c.Cgroup)
		h := ledger.Holding{Owner: owner}
		if guard.ValidTicket(c.ID) {
			// Adopted, it would be a ticket's claim, released as soon as
			// its process is gone whatever release_on says (the hook
			// refuses such ids; this one was admitted without it).
			out.Unresolved = append(out.Unresolved, Note{ID: c.ID, Runtime: c.Runtime,
				Error: "its id has the form of a gpu-guard-ctl run ticket, which containers may not take"})
		} else if c.SpecErr != nil {
			out.Unresolved = append(out.Unresolved, Note{ID: c.ID, Runtime: c.Runtime, Error: c.SpecErr.Error()})
		} else if res, err := g.Resolve(c.Request); err != nil {
			out.Unresolved = append(out.Unresolved, Note{ID: c.ID, Runtime: c.Runtime, Error: err.Error()})
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
			if len(h.Source) > maxSourceLen {
				h.Source = h.Source[:maxSourceLen] + "…"
			}
		}
		out.Holdings = append(out.Holdings, h)
		out.Why = append(out.Why, fmt.Sprintf("recover: found %s in %s state (%s)", c.Status, c.Runtime, c.Root))
	}
	return out, nil
}

// Without returns r less the holdings of the containers in ids (those
// another front end lists: the NRI daemon's own, on a CRI-O host whose
// runc root the hook roots include).
func (r *Result) Without(ids map[string]bool) (holdings []ledger.Holding, why []string) {
	for i, h := range r.Holdings {
		if !ids[h.Owner.ContainerID] {
			holdings = append(holdings, h)
			why = append(why, r.Why[i])
		}
	}
	return holdings, why
}

// procRootOr is procRoot, or the host's /proc when it is empty (Read's
// default).
func procRootOr(procRoot string) string {
	if procRoot == "" {
		return "/proc"
	}
	return procRoot
}
