// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// x holds MIG 3:0, and the reconcile finds container c running on GPU 3
// whole: c uses every instance of GPU 3, so a request for the free 3:1 is
// queued, naming c, and GPU 3 goes to c once x's claim ends.
func TestContainerFoundOnTheGPUKeepsItsInstancesBusy(t *testing.T) {
	e := newEnv(t, nil)
	x := ctr("ml", "x", "main", "xxxx000000000001")
	c := ctr("ml", "c", "main", "cccc000000000001")
	y := ctr("ml", "y", "main", "yyyy000000000001")
	require.Equal(t, guard.Admit, e.admit(x, visible("3:0")).Result)
	_, err := e.g.Reconcile(ctx, ledger.FrontEndNRI, []guard.Request{
		{FrontEnd: ledger.FrontEndNRI, Owner: x, Spec: visible("3:0")},
		{FrontEnd: ledger.FrontEndNRI, Owner: c, Spec: visible("3")},
	})
	require.NoError(t, err)
	require.Len(t, e.state().Conflicts, 1)

	d := e.admit(y, visible("3:1"))
	require.Equal(t, guard.Queue, d.Result, d.Message)
	assert.Contains(t, d.Message, "MIG 3:1 ("+migUUID(1)+") is in use by ml/c/main (id cccc00000000) through GPU 3 ("+uuid(3)+
		") since 2026-05-09T08:00:00Z (0s ago) (running on it without a claim: found there at reconcile while another container held it)")
	assert.Equal(t, map[string]string{migUUID(0): x.ContainerID}, e.holders())

	require.NoError(t, e.g.Removed(ctx, x))
	assert.Equal(t, map[string]string{uuid(3): c.ContainerID}, e.holders(), "the container found on GPU 3 holds it now")
	assert.Empty(t, e.state().Conflicts)
}
