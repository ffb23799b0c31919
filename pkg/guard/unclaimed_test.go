// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// Unclaimed lists what a container reaches beyond its claims, after the
// checks admission makes before reading the ledger: an exempt namespace
// reaches what it reaches, and "all" while the inventory lists none of the
// host's GPUs is refused as at admission (it resolves to no device, yet
// reaches every GPU there is).
func TestUnclaimed(t *testing.T) {
	e := newEnv(t, func(c *config.Config) { c.Policy.ExemptNamespaces = []string{"monitoring"} })
	holder := ctr("ml", "h", "main", "hhhh000000000001")
	require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
	req := func(o ledger.Owner, spec devices.Request) guard.Request {
		return guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: o, Spec: spec}
	}
	uuids := func(rs []devices.Resolved) []string {
		var out []string
		for _, r := range rs {
			out = append(out, r.UUID)
		}
		return out
	}

	got, err := e.g.Unclaimed(ctx, req(holder, visible("1")))
	require.NoError(t, err)
	assert.Empty(t, got, "it holds GPU 1")
	got, err = e.g.Unclaimed(ctx, req(holder, visible("1,2")))
	require.NoError(t, err)
	assert.Equal(t, []string{uuid(2)}, uuids(got))
	got, err = e.g.Unclaimed(ctx, req(ctr("ml", "o", "main", "oooo000000000001"), visible("1")))
	require.NoError(t, err)
	assert.Equal(t, []string{uuid(1)}, uuids(got), "another container's claim is not this one's")
	got, err = e.g.Unclaimed(ctx, req(ctr("monitoring", "dcgm", "main", "mmmm000000000001"), visible("all")))
	require.NoError(t, err)
	assert.Empty(t, got, "exempt")
	_, err = e.g.Unclaimed(ctx, req(holder, visible("-1")))
	require.ErrorContains(t, err, `invalid device id "-1"`)

	for _, doc := range []string{`{"source":"none","gpus":[],"undiscovered":true}`, `{"source":"proc","gpus":[],"unlisted_gpus":4}`} {
		var inv devices.Inventory
		require.NoError(t, json.Unmarshal([]byte(doc), &inv))
		require.NoError(t, e.g.SetInventory(&inv))
		for _, spec := range []string{"all", "0"} {
			got, err = e.g.Unclaimed(ctx, req(ctr("ml", "n", "main", "nnnn000000000001"), visible(spec)))
			require.Error(t, err, "%s, NVIDIA_VISIBLE_DEVICES=%s: %v", doc, spec, got)
		}
	}
}

// A refusal says what to do once: the resolver's own advice for a CDI name
// NVIDIA's runtime would inject after the check, or for a rule opening every
// GPU under all_devices = "reject", is not followed by a generic hint that
// contradicts or repeats it.
func TestRefusalAdviceSaidOnce(t *testing.T) {
	e := newEnv(t, func(c *config.Config) { c.Policy.AllDevices = config.AllReject })
	d := e.admit(ctr("ml", "n", "main", "nnnn000000000001"), visible("vendor.com/nic=0"))
	require.Equal(t, guard.Reject, d.Result)
	assert.Contains(t, d.Message, "podman: --device VENDOR/CLASS=NAME")
	assert.NotContains(t, d.Message, "fix the device id (an index")

	d = e.admit(ctr("ml", "r", "main", "rrrr000000000001"), devices.Request{GPUNodesAllowed: true})
	require.Equal(t, guard.Reject, d.Result)
	assert.Equal(t, 1, strings.Count(d.Message, "name the GPUs the container needs"), d.Message)
}
