// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

func TestReadState(t *testing.T) {
	for _, tc := range []struct {
		name    string
		in      string
		want    specs.State
		wantErr string
	}{
		{
			name: "runc createRuntime state",
			in:   `{"ociVersion":"1.0.2-dev","id":"c1","status":"creating","pid":17992,"bundle":"/run/b1","annotations":{"a":"b"}}`,
			want: specs.State{Version: "1.0.2-dev", ID: "c1", Status: "creating", Pid: 17992, Bundle: "/run/b1", Annotations: map[string]string{"a": "b"}},
		},
		{
			name: "runc poststop state has no pid",
			in:   `{"ociVersion":"1.0.2-dev","id":"c1","status":"stopped","bundle":"/run/b1"}`,
			want: specs.State{Version: "1.0.2-dev", ID: "c1", Status: "stopped", Bundle: "/run/b1"},
		},
		{name: "empty stdin", in: "  \n", wantErr: "stdin is empty"},
		{name: "not JSON", in: "hello", wantErr: "decode the OCI state"},
		{name: "no id", in: `{"pid":1,"bundle":"/b"}`, wantErr: "no container id"},
		{name: "id with a newline", in: `{"id":"a\nb","bundle":"/b"}`, wantErr: "spaces or control characters"},
		{name: "id too long", in: `{"id":"` + strings.Repeat("a", maxIDLen+1) + `","bundle":"/b"}`, wantErr: "longer than"},
		{name: "negative pid", in: `{"id":"c","pid":-4,"bundle":"/b"}`, wantErr: "negative pid"},
		{name: "too large", in: `{"id":"c","bundle":"/b","annotations":{"x":"` + strings.Repeat("x", maxStateBytes) + `"}}`, wantErr: "larger than"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := readState(strings.NewReader(tc.in))
			if tc.wantErr != "" {
				require.ErrorIs(t, err, errInput)
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestReadSpec(t *testing.T) {
	good := &specs.Spec{Version: "1.0.2", Process: &specs.Process{Env: []string{"NVIDIA_VISIBLE_DEVICES=1"}}}
	goodJSON, err := json.Marshal(good)
	require.NoError(t, err)

	for _, tc := range []struct {
		name    string
		setup   func(t *testing.T, bundle string)
		bundle  func(dir string) string
		wantErr string
	}{
		{
			name: "regular config.json",
			setup: func(t *testing.T, b string) {
				require.NoError(t, os.WriteFile(filepath.Join(b, "config.json"), goodJSON, 0o600))
			},
		},
		{
			name:    "missing config.json",
			setup:   func(*testing.T, string) {},
			wantErr: "open the spec of container",
		},
		{
			name:    "relative bundle",
			setup:   func(*testing.T, string) {},
			bundle:  func(string) string { return "relative/bundle" },
			wantErr: "not an absolute path",
		},
		{
			name:    "no bundle",
			setup:   func(*testing.T, string) {},
			bundle:  func(string) string { return "" },
			wantErr: "names no bundle directory",
		},
		{
			name: "a FIFO does not hang the hook",
			setup: func(t *testing.T, b string) {
				require.NoError(t, syscall.Mkfifo(filepath.Join(b, "config.json"), 0o600))
			},
			wantErr: "not a regular file",
		},
		{
			name: "a directory",
			setup: func(t *testing.T, b string) {
				require.NoError(t, os.Mkdir(filepath.Join(b, "config.json"), 0o700))
			},
			wantErr: "not a regular file",
		},
		{
			name: "larger than the bound",
			setup: func(t *testing.T, b string) {
				f, err := os.OpenFile(filepath.Join(b, "config.json"), os.O_CREATE|os.O_WRONLY, 0o600)
				require.NoError(t, err)
				require.NoError(t, f.Truncate(maxSpecBytes+1)) // sparse
				require.NoError(t, f.Close())
			},
			wantErr: "larger than",
		},
		{
			name: "not JSON",
			setup: func(t *testing.T, b string) {
				require.NoError(t, os.WriteFile(filepath.Join(b, "config.json"), []byte("{"), 0o600))
			},
			wantErr: "decode",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			tc.setup(t, dir)
			bundle := dir
			if tc.bundle != nil {
				bundle = tc.bundle(dir)
			}
			spec, err := readSpec(specs.State{ID: "c1", Bundle: bundle})
			if tc.wantErr != "" {
				require.ErrorIs(t, err, errInput)
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, good.Process.Env, spec.Process.Env)
		})
	}
}

func TestOwnerFrom(t *testing.T) {
	for _, tc := range []struct {
		name  string
		state specs.State
		spec  *specs.Spec
		want  ledger.Owner
	}{
		{
			name:  "plain runc container",
			state: specs.State{ID: "abc", Pid: 42},
			spec:  &specs.Spec{},
			want:  ledger.Owner{ContainerID: "abc", Pid: 42, PidStart: 7, FrontEnd: ledger.FrontEndHook},
		},
		{
			name:  "containerd CRI annotations and cgroup",
			state: specs.State{ID: "abc", Pid: 42},
			spec: &specs.Spec{
				Annotations: map[string]string{
					"io.kubernetes.cri.sandbox-namespace": "team-a",
					"io.kubernetes.cri.sandbox-name":      "trainer-0",
					"io.kubernetes.cri.sandbox-uid":       "uid-1",
					"io.kubernetes.cri.container-name":    "main",
					"io.kubernetes.cri.sandbox-id":        "sb1",
				},
				Linux: &specs.Linux{CgroupsPath: "kubepods-besteffort-poduid_1.slice:cri-containerd:abc"},
			},
			want: ledger.Owner{ContainerID: "abc", Namespace: "team-a", Pod: "trainer-0", PodUID: "uid-1", Container: "main",
				PodSandboxID: "sb1", Pid: 42, PidStart: 7, FrontEnd: ledger.FrontEndHook,
				Cgroup: "kubepods-besteffort-poduid_1.slice:cri-containerd:abc"},
		},
		{
			name: "CRI-O annotations, from the state when the spec lacks them",
			state: specs.State{ID: "abc", Pid: 42, Annotations: map[string]string{
				"io.kubernetes.pod.namespace":   "team-b",
				"io.kubernetes.pod.name":        "infer",
				"io.kubernetes.pod.uid":         "uid-2",
				"io.kubernetes.container.name":  "srv",
				"io.kubernetes.cri-o.SandboxID": "sb2",
			}},
			spec: &specs.Spec{},
			want: ledger.Owner{ContainerID: "abc", Namespace: "team-b", Pod: "infer", PodUID: "uid-2", Container: "srv",
				PodSandboxID: "sb2", Pid: 42, PidStart: 7, FrontEnd: ledger.FrontEndHook},
		},
		{
			name:  "untrusted values are bounded and stripped of control characters",
			state: specs.State{ID: "abc"},
			spec: &specs.Spec{
				Annotations: map[string]string{
					"io.kubernetes.pod.namespace": "a\x1b[31mb\n",
					"io.kubernetes.pod.name":      strings.Repeat("p", 1000),
				},
				Linux: &specs.Linux{CgroupsPath: "/bad\npath"},
			},
			want: ledger.Owner{ContainerID: "abc", Namespace: "a[31mb", Pod: strings.Repeat("p", maxLabelLen), PidStart: 7, FrontEnd: ledger.FrontEndHook},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, OwnerFrom(tc.state, tc.spec, 7))
		})
	}
}

// FuzzReadState: whatever a runtime (or an attacker able to feed a hook)
// writes on stdin, readState returns an error or a state with a usable id;
// it never panics.
func FuzzReadState(f *testing.F) {
	f.Add(`{"ociVersion":"1.0.2-dev","id":"c1","status":"creating","pid":17992,"bundle":"/run/b1"}`)
	f.Add(`{"id":"","pid":-1}`)
	f.Add(`{"id":"a b","annotations":{"x":"y"}}`)
	f.Add(`[]`)
	f.Fuzz(func(t *testing.T, in string) {
		st, err := readState(strings.NewReader(in))
		if err != nil {
			require.ErrorIs(t, err, errInput)
			return
		}
		require.NoError(t, checkID(st.ID))
		require.GreaterOrEqual(t, st.Pid, 0)
	})
}
