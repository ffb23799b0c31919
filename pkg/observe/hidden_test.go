// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build cgo

package observe

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A procfs of the observer's own pid namespace that shows no entry for a
// process NVML lists (mounted with hidepid: the DaemonSet has no
// CAP_SYS_PTRACE, and the process is another user's) does not prove it
// gone: the kernel is asked. Idle then cannot tell, and says so, rather
// than answering idle and letting a draining claim go while the process
// may still use the GPU.
func TestHiddenProcessIsNotIdle(t *testing.T) {
	h := newMockA100(t)
	fp := newFakeProc(t, 1000)
	pid := os.Getpid() // a process the kernel knows, with no entry in the tree
	require.NoError(t, os.Symlink(strconv.Itoa(pid), filepath.Join(fp.root, "proc", "self")))
	h.run(h.uuid(0), uint32(pid), 4<<30)
	holder := Holding{DeviceUUID: h.uuid(0), ContainerID: idA}
	o, _ := newObserver(t, h, fp, &holdings{holder}, nil)

	res, err := o.Idle(context.Background(), holder)
	require.Error(t, err, "a hidden process is not a gone one: %+v", res)
	assert.False(t, res.Idle)
	assert.Contains(t, err.Error(), "hidepid")
}
