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

// AdmitWithoutClaims decides, on its one resolution, only what needs no
// claims: a container without GPU is skipped, a policy refusal is refused,
// and a GPU request returns ErrNeedsClaims with nothing recorded (no claim,
// no queue entry), whoever holds what.
func TestAdmitWithoutClaims(t *testing.T) {
	e := newEnv(t, nil)
	holder := ctr("ml", "h", "main", "hhhh000000000001")
	require.Equal(t, guard.Admit, e.admit(holder, visible("1")).Result)

	d, err := e.g.AdmitWithoutClaims(ctx, guard.Request{Owner: ctr("ml", "web", "main", "w0000000000001"), FrontEnd: ledger.FrontEndNRI})
	require.NoError(t, err)
	assert.Equal(t, guard.Skip, d.Result)

	d, err = e.g.AdmitWithoutClaims(ctx, guard.Request{Owner: ctr("ml", "bad", "main", "b0000000000001"), Spec: visible("GPU-not-a-uuid"), FrontEnd: ledger.FrontEndNRI})
	require.NoError(t, err)
	assert.Equal(t, guard.Reject, d.Result, "a policy refusal needs no claims: %s", d.Message)

	for _, spec := range []string{"0", "1", "all"} {
		_, err = e.g.AdmitWithoutClaims(ctx, guard.Request{Owner: ctr("ml", "gpu", "main", "g0000000000001"), Spec: visible(spec), FrontEnd: ledger.FrontEndNRI})
		require.ErrorIs(t, err, guard.ErrNeedsClaims, "NVIDIA_VISIBLE_DEVICES=%s", spec)
	}
	assert.Equal(t, map[string]string{uuid(1): holder.ContainerID}, e.holders(), "nothing claimed")
	assert.Empty(t, e.waiters(), "nothing queued")
}
