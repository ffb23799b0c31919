// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
)

// While a rebuild is pending only the containers that ask for a GPU are
// refused, with the ledger error behind the rebuild in the message: a
// container without a GPU, one of an exempt namespace (audited as always)
// and one a policy refuses anyway are decided as they would be without the
// rebuild, since none of them is decided on the ledger's holders.
func TestRebuildRefusesOnlyGPURequests(t *testing.T) {
	rt := newRuntime(t, func(c *config.Config) { c.Policy.ExemptNamespaces = []string{"kube-system"} })
	pl := rt.startPlugin()
	app, sys := rt.addPod("app"), rt.addPod("sys")
	sys.Namespace = "kube-system"
	pl.p.setRebuilding(true, errors.New("ledger lock /x/ledger.lock not acquired within 1s: held by pid 4242"))

	require.NoError(t, rt.create(app, container(app, "web", "web-1")), "a container without a GPU needs no holder")
	require.NoError(t, rt.create(sys, container(sys, "dcgm", "dcgm-1", "NVIDIA_VISIBLE_DEVICES=0")),
		"an exempt container is let through as always")
	var exempt []string
	for _, r := range rt.audited(guard.AuditExempt) {
		exempt = append(exempt, r.ContainerID)
	}
	assert.Equal(t, []string{"dcgm-1"}, exempt, "the exemption is audited as always")

	err := rt.create(app, container(app, "typo", "typo-1", "NVIDIA_VISIBLE_DEVICES=17"))
	require.Error(t, err)
	assert.NotContains(t, err.Error(), "being rebuilt", "a policy refusal needs no holder: its own message")

	err = rt.create(app, container(app, "train", "train-1", "NVIDIA_VISIBLE_DEVICES=1"))
	require.Error(t, err, "a GPU request is decided on the holders the rebuild restores")
	assert.Contains(t, err.Error(), "being rebuilt")
	assert.Contains(t, err.Error(), "held by pid 4242", "the refusal names the ledger error behind the rebuild")
	assert.Empty(t, rt.holders())

	pl.p.setRebuilding(false, nil)
	require.NoError(t, rt.create(app, container(app, "train", "train-2", "NVIDIA_VISIBLE_DEVICES=1")))
	assert.Equal(t, map[string]string{"1": "train-2"}, rt.holders())
}
