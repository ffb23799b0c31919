// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
)

// A pod's creator chooses its name; the NRI path bounds it exactly as the
// hook bounds the names it reads from annotations (guard.BoundOwner), before
// it reaches the ledger, the logs or another container's refusal message.
func TestPodNamesAreBoundedLikeTheHook(t *testing.T) {
	rt := newRuntime(t, nil)
	rt.startPlugin()
	huge := strings.Repeat("p", 256<<10)
	podA, podB := rt.addPod(huge), rt.addPod("b")
	holder := container(podA, huge+"\x1b[31m", "aaaaaaaaaaaa0123456789", "NVIDIA_VISIBLE_DEVICES=1")
	require.NoError(t, rt.create(podA, holder))
	rt.start(podA, holder, 1001)

	st := rt.state()
	require.Len(t, st.Claims, 1)
	o := st.Claims[0].Owner
	assert.Len(t, o.Pod, guard.MaxLabelLen)
	assert.Len(t, o.Container, guard.MaxLabelLen)
	assert.LessOrEqual(t, len(o.PodUID), guard.MaxLabelLen)
	assert.NotContains(t, o.Container, "\x1b")

	err := rt.create(podB, container(podB, "main", "bbbbbbbbbbbb0123456789", "NVIDIA_VISIBLE_DEVICES=1"))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "is held by ml/"+huge[:guard.MaxLabelLen]+"/")
	assert.Less(t, len(err.Error()), 4096, "the refusal quotes the bounded names only")
}
