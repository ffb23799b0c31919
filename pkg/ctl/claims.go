// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"cmp"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
)

func (a *app) claimsCommand() *cobra.Command {
	return newCommand("claims",
		"List every claim: which container holds which device, since when",
		`List one row per claim in the ledger: the device (index and UUID), the holder
(namespace/pod/container and container id), how the container named the device
(source) and how long it has held it. -o wide adds the pod UID, front end, pid
and cgroup recorded when the container started.`,
		`  gpu-guard-ctl claims
  gpu-guard-ctl claims -o wide
  gpu-guard-ctl claims -o json | jq -r '.claims[] | "\(.device) \(.container_id)"'`,
		noArgs,
		func(cmd *cobra.Command, _ []string) error {
			st, err := a.snapshot(cmd.Context())
			if err != nil {
				return err
			}
			if err := a.checkLedgerDir(); err != nil {
				return err
			}
			return renderClaims(a.env.Stdout, a.output, st, a.env.Now())
		})
}

// claimsView is the claims output; its JSON is a public interface.
type claimsView struct {
	Claims []claimJSON `json:"claims"`
}

type claimJSON struct {
	Device      string     `json:"device"`
	Index       string     `json:"index"`
	ContainerID string     `json:"container_id"`
	Namespace   string     `json:"namespace"`
	Pod         string     `json:"pod"`
	PodUID      string     `json:"pod_uid"`
	Container   string     `json:"container"`
	FrontEnd    string     `json:"front_end"`
	Source      string     `json:"source"`
	Since       time.Time  `json:"since"`
	Pid         int        `json:"pid,omitempty"`
	Cgroup      string     `json:"cgroup,omitempty"`
	StartedAt   *time.Time `json:"started_at,omitempty"`
	StoppedAt   *time.Time `json:"stopped_at,omitempty"`
	// DrainingSince: the holder stopped under release_requires_idle and
	// the claim is kept until its processes leave the GPU.
	DrainingSince *time.Time `json:"draining_since,omitempty"`
}

func claimView(c ledger.Claim) claimJSON {
	return claimJSON{
		Device:      c.Device.UUID,
		Index:       c.Device.Index,
		ContainerID: c.Owner.ContainerID,
		Namespace:   c.Owner.Namespace,
		Pod:         c.Owner.Pod,
		PodUID:      c.Owner.PodUID,
		Container:   c.Owner.Container,
		FrontEnd:    string(c.Owner.FrontEnd),
		Source:      c.Source,
		Since:       c.Since,
		Pid:         c.Owner.Pid,
		Cgroup:      c.Owner.Cgroup,
		StartedAt:   timeOrNil(c.Owner.StartedAt),
		StoppedAt:   timeOrNil(c.Owner.StoppedAt),

		DrainingSince: timeOrNil(c.Owner.DrainingSince),
	}
}

func renderClaims(w io.Writer, output string, st ledger.State, now time.Time) error {
	// The ledger keeps claims by UUID; people read them by index.
	slices.SortStableFunc(st.Claims, func(a, b ledger.Claim) int { return compareIndex(a.Device.Index, b.Device.Index) })
	if output == outputJSON {
		v := claimsView{Claims: make([]claimJSON, 0, len(st.Claims))}
		for _, c := range st.Claims {
			v.Claims = append(v.Claims, claimView(c))
		}
		return writeJSON(w, v)
	}
	wide := output == outputWide
	header := []string{"INDEX", "UUID", "HOLDER", "ID", "SOURCE", "SINCE"}
	if wide {
		header = []string{"INDEX", "UUID", "HOLDER", "CONTAINER ID", "POD UID", "FRONT END", "PID", "CGROUP", "SOURCE", "SINCE", "STOPPED", "DRAINING"}
	}
	t := newTable(w, header...)
	for _, c := range st.Claims {
		if !wide {
			t.row(c.Device.Index, shortUUID(c.Device.UUID), holderName(c.Owner), naming.ShortID(c.Owner.ContainerID), c.Source, since(now, c.Since))
			continue
		}
		pid := none
		if c.Owner.Pid > 0 {
			pid = strconv.Itoa(c.Owner.Pid)
		}
		t.row(c.Device.Index, c.Device.UUID, holderName(c.Owner), c.Owner.ContainerID, c.Owner.PodUID,
			string(c.Owner.FrontEnd), pid, c.Owner.Cgroup, c.Source, since(now, c.Since), since(now, c.Owner.StoppedAt),
			since(now, c.Owner.DrainingSince))
	}
	return t.flush()
}

// compareIndex orders device indices numerically: "2" < "10", and a GPU's MIG
// instances ("1:0", "1:1") right after it.
func compareIndex(a, b string) int {
	for a != "" || b != "" {
		var x, y string
		x, a, _ = strings.Cut(a, ":")
		y, b, _ = strings.Cut(b, ":")
		if x == y {
			continue
		}
		xi, xerr := strconv.Atoi(x)
		yi, yerr := strconv.Atoi(y)
		switch {
		case xerr == nil && yerr == nil:
			return cmp.Compare(xi, yi)
		default:
			return strings.Compare(x, y)
		}
	}
	return 0
}
