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

// Validate checks a container as it will be created against its claims,
// after the checks admission makes before reading the ledger: what it holds
// is admitted, what it would reach unclaimed is refused (and audited), an
// exempt namespace reaches what it reaches (the exemption audited), and
// "all" while the inventory lists none of the host's GPUs is refused as at
// admission (it resolves to no device, yet reaches every GPU there is).
func TestValidate(t *testing.T) {
	e := newEnv(t, func(c *config.Config) { c.Policy.ExemptNamespaces = []string{"monitoring"} })
	holder := ctr("ml", "h", "main", "hhhh000000000001")
	require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)
	validate := func(o ledger.Owner, spec devices.Request, opts guard.ValidateOptions) (guard.Decision, error) {
		return e.g.Validate(ctx, guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: o, Spec: spec}, opts)
	}
	uuids := func(rs []devices.Resolved) []string {
		var out []string
		for _, r := range rs {
			out = append(out, r.UUID)
		}
		return out
	}
	opts := guard.ValidateOptions{After: "an NRI plugin that runs after nri-gpu-guard (95-injector)"}

	d, err := validate(holder, visible("1"), opts)
	require.NoError(t, err)
	assert.Equal(t, guard.Admit, d.Result, "it holds GPU 1")
	d, err = validate(holder, visible("1,2"), opts)
	require.NoError(t, err)
	assert.Equal(t, guard.Reject, d.Result)
	assert.Equal(t, []string{uuid(2)}, uuids(d.Devices))
	assert.Contains(t, d.Message, "an NRI plugin that runs after nri-gpu-guard (95-injector) gave it GPU 2 ("+uuid(2)+")")
	d, err = validate(ctr("ml", "o", "main", "oooo000000000001"), visible("1"), opts)
	require.NoError(t, err)
	assert.Equal(t, guard.Reject, d.Result, "another container's claim is not this one's")
	assert.Equal(t, []string{uuid(1)}, uuids(d.Devices))
	d, err = validate(ctr("ml", "n", "main", "nnnn000000000001"), devices.Request{}, opts)
	require.NoError(t, err)
	assert.Equal(t, guard.Skip, d.Result, "no GPU")
	d, err = validate(ctr("monitoring", "dcgm", "main", "mmmm000000000001"), visible("all"), opts)
	require.NoError(t, err)
	assert.Equal(t, guard.ReasonExempt, d.Reason)
	d, err = validate(holder, visible("-1"), opts)
	require.NoError(t, err)
	assert.Equal(t, guard.Reject, d.Result)
	assert.Contains(t, d.Message, `invalid device id "-1"`)
	// A claim of the OCI hook's front end under the same id (an id whoever
	// runs runc chose) is not this NRI container's.
	hookOwner := ledger.Owner{ContainerID: "dupe00000000001", FrontEnd: ledger.FrontEndHook}
	hd, err := e.g.Admit(ctx, guard.Request{FrontEnd: ledger.FrontEndHook, Owner: hookOwner, Spec: visible("3")})
	require.NoError(t, err)
	require.Equal(t, guard.Admit, hd.Result)
	d, err = validate(ctr("ml", "d", "main", "dupe00000000001"), visible("3"), opts)
	require.NoError(t, err)
	assert.Equal(t, guard.Reject, d.Result, "another front end's claim under the same id")
	_, err = validate(holder, visible("2"), guard.ValidateOptions{WithoutLedger: true})
	require.ErrorIs(t, err, guard.ErrNeedsClaims, "while the holders are rebuilt, no ledger read")

	recs, err := ledger.ReadAudit(e.l.AuditPath())
	require.NoError(t, err)
	var refused, exempt []string
	for _, r := range recs {
		switch r.Op {
		case guard.AuditRefuse:
			refused = append(refused, r.ContainerID)
			assert.Contains(t, r.Reason, "validation of the NRI plugins' adjustments")
		case guard.AuditExempt:
			exempt = append(exempt, r.ContainerID)
		}
	}
	assert.Equal(t, []string{"hhhh000000000001", "oooo000000000001", "hhhh000000000001", "dupe00000000001"}, refused, "every refusal audited")
	assert.Equal(t, []string{"mmmm000000000001"}, exempt, "the exemption audited")

	for _, doc := range []string{`{"source":"none","gpus":[],"undiscovered":true}`, `{"source":"proc","gpus":[],"unlisted_gpus":4}`} {
		var inv devices.Inventory
		require.NoError(t, json.Unmarshal([]byte(doc), &inv))
		require.NoError(t, e.g.SetInventory(&inv))
		for _, spec := range []string{"all", "0"} {
			d, err = validate(ctr("ml", "n", "main", "nnnn000000000001"), visible(spec), opts)
			require.NoError(t, err)
			assert.Equal(t, guard.Reject, d.Result, "%s, NVIDIA_VISIBLE_DEVICES=%s", doc, spec)
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

	// A management device under all_devices = "reject": the resolver says
	// where monitoring agents go; the policy is named once.
	d = e.admit(ctr("ml", "m", "main", "mmmm000000000001"), devices.Request{Annotations: map[string]string{
		"cdi.k8s.io/monitor": "management.nvidia.com/gpu=all"}})
	require.Equal(t, guard.Reject, d.Result)
	assert.Contains(t, d.Message, "policy.exempt_namespaces")
	assert.Equal(t, 1, strings.Count(d.Message, "all_devices"), d.Message)

	d = e.admit(ctr("ml", "u", "main", "uuuu000000000001"), visible("7"))
	require.Equal(t, guard.Reject, d.Result)
	assert.Equal(t, 1, strings.Count(d.Message, "name a GPU of this host"), d.Message)

	// A device rule under privileged = "reject": the container is not
	// privileged, so "drop privileged" would be wrong.
	e = newEnv(t, func(c *config.Config) { c.Policy.Privileged = config.PrivilegedReject })
	d = e.admit(ctr("ml", "p", "main", "pppp000000000001"), devices.Request{GPUNodesAllowed: true})
	require.Equal(t, guard.Reject, d.Result)
	assert.Contains(t, d.Message, "let its device cgroup allow only their nodes")
	assert.NotContains(t, d.Message, "drop privileged", d.Message)
}
