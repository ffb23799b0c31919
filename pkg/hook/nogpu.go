// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"io"
	"os"
	"strings"
	"syscall"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
)

// Input is the runtime's input to one hook run, read once: the OCI state
// from stdin and the bundle's spec it names, with what could not be read.
type Input struct {
	state    specs.State
	stateErr error
	spec     *specs.Spec
	specErr  error
	// request is what the spec makes reachable; set when spec is.
	request devices.Request
	// never is guard.NeverClaims(request), decided once: a hook binary asks
	// before loading the configuration and create-runtime asks again.
	never bool
}

// ReadInput reads the OCI state from stdin and the spec of its bundle. It
// never fails: what it could not read is kept and reported by the phase,
// which refuses the container (create-runtime) or reads the ledger anyway
// (poststop).
func ReadInput(stdin io.Reader) *Input {
	in := &Input{}
	in.state, in.stateErr = readState(stdin)
	if in.stateErr != nil {
		return in
	}
	in.spec, in.specErr = readSpec(in.state)
	if in.specErr == nil {
		in.request = devices.RequestFromSpec(in.spec)
		if len(in.spec.Mounts) > 0 && runtimeInUserNamespace() {
			// A rootless runtime (it runs in a user namespace) sets up no
			// device cgroup: a host GPU node bound in opens, and so does
			// every node of the host's /dev bound in.
			addBoundNodes(&in.request, in.spec.Mounts)
			if in.request.HostDevMounted {
				in.request.GPUNodesAllowed = true
			}
		}
		in.never = guard.NeverClaims(in.request)
	}
	return in
}

// addBoundNodes records, for a rootless runtime, what each bind source is
// on the host, whatever it is called (the runtime follows symlinks, and
// numbers, not names, tell a GPU node): a character device is a node of the
// container, and the host's / or /dev sets HostDevMounted. AddBindSource
// reads sources by their spelling only. Only there: a rootful runtime's
// device cgroup stops every node the spec does not allow, however it is
// bound in, and a stat per mount would cost every container.
func addBoundNodes(req *devices.Request, mounts []specs.Mount) {
	var root, dev os.FileInfo
	for _, m := range mounts {
		if m.Source == "" || m.Source[0] != '/' {
			continue
		}
		fi, err := os.Stat(m.Source)
		if err != nil {
			continue // nothing the runtime can bind either
		}
		switch {
		case fi.Mode()&os.ModeCharDevice != 0:
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				req.Devices = append(req.Devices, devices.LinuxDevice{Path: m.Source, Type: "c",
					Major: int64(unix.Major(st.Rdev)), Minor: int64(unix.Minor(st.Rdev)), BoundAt: m.Destination})
			}
		case fi.IsDir():
			if root == nil {
				root, _ = os.Stat("/")
				dev, _ = os.Stat("/dev")
			}
			if (root != nil && os.SameFile(fi, root)) || (dev != nil && os.SameFile(fi, dev)) {
				req.HostDevMounted = true
			}
		}
	}
}

// runtimeInUserNamespace reports whether the hook, and so the runtime that
// runs it, is in a user namespace other than the host's, as rootless
// podman's runc and crun are: they set up no device cgroup there. An
// unreadable map counts as one (the conservative answer: more may open).
func runtimeInUserNamespace() bool {
	data, err := os.ReadFile("/proc/self/uid_map")
	if err != nil {
		return true
	}
	return inUserNamespace(data)
}

// inUserNamespace reads a uid_map: only the initial namespace maps every id
// to itself ("0 0 4294967295").
func inUserNamespace(uidMap []byte) bool {
	f := strings.Fields(string(uidMap))
	return len(f) != 3 || f[0] != "0" || f[1] != "0" || f[2] != "4294967295"
}

// NeverClaims reports whether both the state and the spec were read and the
// container can reach no GPU under any configuration or inventory
// (guard.NeverClaims): create-runtime admits it and poststop has nothing to
// release, whatever the configuration says, so a hook binary answers it
// before loading the configuration.
func (in *Input) NeverClaims() bool {
	return in.stateErr == nil && in.specErr == nil && in.never
}
