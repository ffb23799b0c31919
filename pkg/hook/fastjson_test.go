// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"encoding/json"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"
)

// agree fails unless the fast decoders, where they answer, answer exactly as
// encoding/json does and take nothing checkKeys refuses (a repeated key, a
// field's name in another case); it reports whether they answered.
func agree(t *testing.T, in []byte) (stateOK, specOK bool) {
	t.Helper()
	if st, ok := fastState(in); ok {
		var want specs.State
		require.NoError(t, json.Unmarshal(in, &want), "fastState took %q", in)
		require.Equal(t, want, st, "%q", in)
		require.NoError(t, checkKeys(in, stateKeys), "fastState took %q", in)
		stateOK = true
	}
	if h, ok := fastSpec(in); ok {
		var want hookSpec
		require.NoError(t, json.Unmarshal(in, &want), "fastSpec took %q", in)
		require.Equal(t, want, h, "%q", in)
		require.NoError(t, checkKeys(in, specKeys), "fastSpec took %q", in)
		specOK = true
	}
	return stateOK, specOK
}

var (
	major195, minus1 = int64(195), int64(-1)
	hookTimeout      = 60
)

// A spec and a state as runtimes write them take the fast path (or the
// speed-up is gone), and give what encoding/json gives.
func TestFastDecodeTypical(t *testing.T) {
	spec := specs.Spec{
		Version: specs.Version,
		Process: &specs.Process{
			Args: []string{"/bin/sh", "-c", "echo hi; exit 0"},
			Env:  []string{"PATH=/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=0,1", "HOME=/root"},
			Cwd:  "/", Capabilities: &specs.LinuxCapabilities{Bounding: []string{"CAP_CHOWN", "CAP_KILL"}, Effective: []string{"CAP_KILL"}},
			Rlimits: []specs.POSIXRlimit{{Type: "RLIMIT_NOFILE", Hard: 1024, Soft: 1024}},
		},
		Root: &specs.Root{Path: "rootfs", Readonly: true},
		Hooks: &specs.Hooks{
			CreateRuntime: []specs.Hook{{Path: "/usr/bin/nri-gpu-guard-hook", Args: []string{"nri-gpu-guard-hook", "create-runtime", "--wait"},
				Env: []string{"GOMAXPROCS=1"}, Timeout: &hookTimeout}},
			Poststop: []specs.Hook{{Path: "/usr/bin/nri-gpu-guard-hook", Args: []string{"nri-gpu-guard-hook", "poststop"}}},
		},
		Hostname:    "h",
		Mounts:      []specs.Mount{{Destination: "/proc", Type: "proc", Source: "proc"}, {Destination: "/dev/nvidia0", Source: "/dev/nvidia0", Options: []string{"bind"}}},
		Annotations: map[string]string{"io.kubernetes.cri.sandbox-name": "pod-1", "x": ""},
		Linux: &specs.Linux{
			CgroupsPath: "/kubepods/pod1/c1",
			Devices:     []specs.LinuxDevice{{Path: "/dev/nvidia0", Type: "c", Major: 195, Minor: 0}},
			Resources: &specs.LinuxResources{Devices: []specs.LinuxDeviceCgroup{
				{Allow: false, Access: "rwm"}, {Allow: true, Type: "c", Major: &major195, Minor: &minus1, Access: "rw"}}},
			Namespaces:    []specs.LinuxNamespace{{Type: "pid"}, {Type: "mount"}, {Type: "user", Path: "/proc/1/ns/user"}},
			MaskedPaths:   []string{"/proc/kcore"},
			ReadonlyPaths: []string{"/proc/sys"},
		},
	}
	data, err := json.Marshal(spec)
	require.NoError(t, err)
	_, ok := agree(t, data)
	require.True(t, ok, "fastSpec gave up on %s", data)

	h, ok := fastSpec(data)
	require.True(t, ok)
	require.Equal(t, []string{"PATH=/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=0,1", "HOME=/root"}, h.Process.Env)
	require.Equal(t, "/kubepods/pod1/c1", h.Linux.CgroupsPath)
	require.Equal(t, int64(195), *h.Linux.Resources.Devices[1].Major)
	require.Equal(t, 60, *h.Hooks.CreateRuntime[0].Timeout)
	require.Equal(t, "/usr/bin/nri-gpu-guard-hook", h.Hooks.CreateRuntime[0].Path)
	require.Equal(t, []hookNamespace{{Type: "pid"}, {Type: "mount"}, {Type: "user", Path: "/proc/1/ns/user"}}, h.Linux.Namespaces)
	require.Equal(t, "proc", h.Mounts[0].Type)

	data, err = json.Marshal(specs.State{Version: specs.Version, ID: "c1", Status: specs.StateCreating, Pid: 4242, Bundle: "/run/b", Annotations: map[string]string{"a": "b"}})
	require.NoError(t, err)
	ok, _ = agree(t, data)
	require.True(t, ok, "fastState gave up on %s", data)
}

// What the fast decoders give up on goes to encoding/json, which decides
// (and words the error).
func TestFastDecodeGivesUp(t *testing.T) {
	for _, in := range []string{
		`{"ID":"c1"}`,             // matched by encoding/json regardless of case
		`{"id":"a","id":"b"}`,     // repeated key
		`{"id":"a\u0062"}`,        // escape
		`{"id":"` + "\xff" + `"}`, // invalid UTF-8
		`{"pid":1.0}`,             // not an integer
		`{"pid":"1"}`,             // wrong type
		`{"id":"a"} x`,            // trailing data
		`null`,                    // not an object
		`{"id":"a",}`,
		`{"ıd":"a"}`, // a non-ASCII key
	} {
		_, ok := fastState([]byte(in))
		require.False(t, ok, "%s", in)
		agree(t, []byte(in))
	}
	for _, in := range []string{
		`{"process":{"Env":["A"]}}`, // case again, nested
		`{"mounts":[null]}`,
		`{"annotations":{"a":null}}`,
		`{"linux":{"devices":[{"major":1e2}]}}`,
		`{"process":{"env":[null]}}`,
		`{"linux":{"resources":{"devices":[{"allow":"yes"}]}}}`,
		// Repeated keys below the top level: encoding/json keeps the last.
		`{"annotations":{"a":"1","a":"2"}}`,
		`{"process":{"env":[],"env":["NVIDIA_VISIBLE_DEVICES=0"]}}`,
		`{"linux":{"devices":[],"devices":[{"path":"/dev/nvidia0"}]}}`,
		`{"linux":{"devices":[{"major":1,"major":195}]}}`,
		`{"hooks":{"CreateRuntime":[]}}`,
		`{"hooks":{"createRuntime":[{"Timeout":5}]}}`,
		`{"hooks":{"createRuntime":[null]}}`,
		`{"hooks":{"createRuntime":[{"timeout":1.5}]}}`,
		`{"hooks":{"createRuntime":[{"timeout":99999999999999999999}]}}`,
		`{"hooks":{"createRuntime":[{"args":[null]}]}}`,
	} {
		_, ok := fastSpec([]byte(in))
		require.False(t, ok, "%s", in)
		agree(t, []byte(in))
	}
	_, ok := fastState([]byte(`{"id":"a","unknown":{"deep":[1,-2.5e-3,true,false,null,"s",{}]}}`))
	require.True(t, ok, "unknown fields are skipped")
}

// FuzzFastDecode: wherever the fast decoders answer, encoding/json gives
// the same value.
func FuzzFastDecode(f *testing.F) {
	f.Add(`{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":17992,"bundle":"/run/b1","annotations":{"k":"v"}}`)
	f.Add(`{"process":{"env":["A=1"],"capabilities":{"bounding":["CAP_X"]}},"mounts":[{"destination":"/d"}],"linux":{"devices":[{"path":"/dev/x","type":"c","major":195,"minor":0}],"cgroupsPath":"/c","resources":{"devices":[{"allow":true,"type":"c","major":195,"minor":-1,"access":"rwm"}]}}}`)
	f.Add(`{"id":"a","x":[1,2.5e3,{"y":null}],"pid":0}`)
	f.Add(`{"linux":null,"process":null,"mounts":[],"annotations":{}}`)
	f.Add(`{"hooks":{"prestart":[],"createRuntime":[{"path":"/h","args":["h","--wait"],"env":[],"timeout":5},{"timeout":null}]}}`)
	f.Add(`{"hooks":null}`)
	f.Add(`{"linux":{"namespaces":[{"type":"pid"},{"type":"user","path":"/proc/1/ns/user"},{}]}}`)
	f.Add(`{"linux":{"namespaces":null}}`)
	f.Add(`{"mounts":[{"destination":"/d","type":"devtmpfs","source":"devtmpfs"},{"type":null,"options":["rbind"]}]}`)
	f.Add(`{"mounts":[{"type":"overlay","source":"overlay","options":["lowerdir=/a:/b","upperdir=/u"]},{"options":null},{"options":[]}]}`)
	// What runtimes read differently (checkKeys), where the fast decoders
	// must give up.
	f.Add(`{"linux":{"devices":[{"path":"/dev/nvidia1","type":"c","major":195,"minor":1}]},"linux":{"devices":[]}}`)
	f.Add(`{"linux":{"devices":[]},"Linux":{"devices":[{"path":"/dev/nvidia1","type":"c","major":195,"minor":1}]}}`)
	f.Add(`{"process":{"ENV":["NVIDIA_VISIBLE_DEVICES=0"],"env":[]}}`)
	f.Add(`{"linux":{"devices":[{"path":"/dev/nvidia1","minor":1,"minor":0}]}}`)
	f.Add(`{"hooks":{"poststop":[{"path":"/h"},null,{"Args":[]}],"createRuntime":[]}}`)
	f.Add(`{"id":"a","bundle":"/b","annotations":{"k":"1","k":"2"}}`)
	// A NUL, which crun reads as the end of a key or a string.
	f.Add(`{"linux\u0000":{"devices":[{"path":"/dev/nvidia1","type":"c","major":195,"minor":1}]},"linux":{}}`)
	f.Add(`{"mounts":[{"destination":"/mnt","type":"bind","source":"/dev\u0000x","options":["rbind"]}]}`)
	f.Add(`{"id":"a\u0000","bundle":"/b\u0000"}`)
	f.Fuzz(func(t *testing.T, in string) {
		agree(t, []byte(in))
	})
}
