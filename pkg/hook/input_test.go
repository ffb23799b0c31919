// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
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

// A config.json or OCI state that OCI runtimes read in more than one way is
// refused, whichever decoder reads it: crun takes the first of two keys and
// only the exact spelling, runc (encoding/json) the last (merged) and any
// case. Reproduced with crun 1.8.1: two "linux" objects, the first with
// /dev/nvidia1 and a rule allowing it, the second with no devices: crun
// created the container with nvidia1 and the hook claimed nothing.
func TestAmbiguousKeysRefused(t *testing.T) {
	const gpu1 = `{"devices":[{"path":"/dev/nvidia1","type":"c","major":195,"minor":1}],` +
		`"resources":{"devices":[{"allow":false,"access":"rwm"},{"allow":true,"type":"c","major":195,"minor":1,"access":"rwm"}]}}`
	const caps = `"process":{"env":["PATH=/bin"],"capabilities":{"bounding":["CAP_KILL"]}}`
	for _, tc := range []struct {
		name, spec string
		want       []string // in the error; none: accepted
	}{
		{"linux twice, GPU in the first", `{` + caps + `,"linux":` + gpu1 + `,"linux":{"devices":[]}}`,
			[]string{`ambiguous key "linux": it appears twice in the top-level object`, "runc takes the last, crun the first"}},
		{"linux twice, GPU in the second", `{` + caps + `,"linux":{"devices":[]},"linux":` + gpu1 + `}`,
			[]string{`ambiguous key "linux": it appears twice in the top-level object`}},
		{"env twice in process", `{"process":{"env":["NVIDIA_VISIBLE_DEVICES=0"],"env":["PATH=/bin"]}}`,
			[]string{`ambiguous key "env": it appears twice in process,`}},
		{"devices twice in linux", `{` + caps + `,"linux":{"devices":[{"path":"/dev/nvidia1","type":"c","major":195,"minor":1}],"devices":[]}}`,
			[]string{`ambiguous key "devices": it appears twice in linux,`}},
		{"minor twice in a device entry", `{` + caps + `,"linux":{"devices":[{"path":"/dev/null","type":"c","major":1,"minor":3},` +
			`{"path":"/dev/nvidia1","type":"c","major":195,"minor":1,"minor":3}]}}`,
			[]string{`ambiguous key "minor": it appears twice in linux.devices[1],`}},
		{"a key twice in a cgroup rule", `{` + caps + `,"linux":{"resources":{"devices":[{"allow":false,"allow":true,"access":"rwm"}]}}}`,
			[]string{`ambiguous key "allow": it appears twice in linux.resources.devices[0],`}},
		{"an annotation twice", `{` + caps + `,"annotations":{"cdi.k8s.io/x":"nvidia.com/gpu=0","cdi.k8s.io/x":""}}`,
			[]string{`ambiguous key "cdi.k8s.io/x": it appears twice in annotations,`}},
		{"a key twice where the hook reads nothing", `{` + caps + `,"root":{"path":"rootfs","path":"/"}}`,
			[]string{`ambiguous key "path": it appears twice in root,`}},
		{"twice, once escaped", `{` + caps + `,"linux":` + gpu1 + `,"l\u0069nux":{}}`,
			[]string{`ambiguous key "linux": it appears twice in the top-level object`}},
		{"twice, after a string the fast decoder does not read", `{"annotations":{"a":"\u0026"},` + caps + `,"linux":` + gpu1 + `,"linux":{}}`,
			[]string{`ambiguous key "linux": it appears twice`}},
		{"Linux", `{` + caps + `,"Linux":` + gpu1 + `}`,
			[]string{`ambiguous key "Linux" in the top-level object: it differs from the field "linux" only in case`,
				`runc reads as "linux" and crun ignores: spell it "linux"`}},
		{"linux, then Linux", `{` + caps + `,"linux":{"devices":[]},"Linux":` + gpu1 + `}`,
			[]string{`ambiguous key "Linux" in the top-level object`}},
		{"ENV", `{"process":{"ENV":["NVIDIA_VISIBLE_DEVICES=0"],"capabilities":{"bounding":[]}}}`,
			[]string{`ambiguous key "ENV" in process: it differs from the field "env" only in case`}},
		{"folded as encoding/json folds (long s)", `{"proce\u017fs":{"env":["NVIDIA_VISIBLE_DEVICES=0"]}}`,
			[]string{`ambiguous key "proceſs" in the top-level object`}},
		{"Path in a createRuntime hook", `{` + caps + `,"hooks":{"createRuntime":[{"Path":"/x"}]}}`,
			[]string{`ambiguous key "Path" in hooks.createRuntime[0]`}},
		{"Poststop", `{` + caps + `,"hooks":{"Poststop":[]}}`,
			[]string{`ambiguous key "Poststop" in hooks`}},
		{"Path in a poststop hook", `{` + caps + `,"hooks":{"poststop":[{"path":"/x"},{"Path":"/y"}]}}`,
			[]string{`ambiguous key "Path" in hooks.poststop[1]`}},
		// Not refused: keys the hook does not read cannot change what it
		// decides.
		{"a case variant of a field the hook does not read", `{` + caps + `,"Hostname":"h","linux":{"Sysctl":{}}}`, nil},
		{"the same key in two objects", `{` + caps + `,"linux":{"devices":[{"path":"/dev/null","type":"c"}],"resources":{"devices":[{"type":"c"}]}}}`, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bundle := t.TempDir()
			require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), []byte(tc.spec), 0o600))
			spec, err := readSpec(specs.State{ID: "c1", Bundle: bundle})
			if tc.want == nil {
				require.NoError(t, err)
				require.NotNil(t, spec)
				return
			}
			require.ErrorIs(t, err, errInput)
			require.ErrorIs(t, err, errAmbiguousKey)
			require.ErrorContains(t, err, filepath.Join(bundle, "config.json")+": ambiguous key")
			for _, s := range tc.want {
				require.ErrorContains(t, err, s)
			}
		})
	}
	for _, tc := range []struct{ name, state, want string }{
		{"id twice", `{"id":"a","bundle":"/b","id":"b"}`, `the OCI state on stdin: ambiguous key "id": it appears twice in the top-level object`},
		{"ID", `{"ID":"c1","bundle":"/b"}`, `the OCI state on stdin: ambiguous key "ID" in the top-level object: it differs from the field "id" only in case`},
		{"an annotation twice", `{"id":"c1","bundle":"/b","annotations":{"k":"1","k":"2"}}`, `ambiguous key "k": it appears twice in annotations`},
	} {
		t.Run("state: "+tc.name, func(t *testing.T) {
			_, err := readState(strings.NewReader(tc.state))
			require.ErrorIs(t, err, errInput)
			require.ErrorIs(t, err, errAmbiguousKey)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// A key or a string that holds a NUL (\u0000) is refused: crun's parser
// hands on C strings, so it reads "linux\u0000" as "linux" (the first of
// two, and first wins) and a bind source "/dev\u0000x" as "/dev", where
// encoding/json reads an unknown key and a path the hook cannot stat.
// Reproduced with crun 1.8: {"ociVersion\u0000":"9.9.9","ociVersion":"1.0.2"}
// makes it say "unknown version specified".
func TestNULRefused(t *testing.T) {
	const caps = `"process":{"env":["PATH=/bin"],"capabilities":{"bounding":["CAP_CHOWN"]}}`
	for _, tc := range []struct {
		name, spec string
		is         error
		want       string // in the error; "": accepted
	}{
		{"a NUL key shadowing linux", `{` + caps + `,"linux\u0000":{"devices":[{"path":"/dev/nvidia0","type":"c","major":195,"minor":0}],` +
			`"resources":{"devices":[{"allow":true,"type":"c","major":195,"minor":0,"access":"rwm"}]}},` +
			`"linux":{"resources":{"devices":[{"allow":false,"access":"rwm"}]}}}`,
			errAmbiguousKey, `ambiguous key "linux\x00" in the top-level object: it holds a NUL character (\u0000), where crun ends the key: crun reads it as "linux"`},
		{"a NUL key in an annotation", `{` + caps + `,"annotations":{"a\u0000b":"x"}}`,
			errAmbiguousKey, `ambiguous key "a\x00b" in annotations: it holds a NUL character`},
		{"a NUL in a bind source", `{` + caps + `,"mounts":[{"destination":"/dev","type":"tmpfs","source":"tmpfs"},` +
			`{"destination":"/mnt","type":"bind","source":"/dev\u0000x","options":["rbind"]}]}`,
			errNULString, `NUL character in a string: the string "/dev\x00x" at mounts[1].source holds a NUL character (\u0000), where crun ends the string: crun reads "/dev"`},
		{"a NUL in an environment variable", `{"process":{"env":["PATH=/bin","NVIDIA_VISIBLE_DEVICES=none\u0000"]}}`,
			errNULString, `the string "NVIDIA_VISIBLE_DEVICES=none\x00" at process.env[1] holds a NUL character`},
		{"a NUL after other escapes", `{` + caps + `,"root":{"path":"\"\\\u0000"}}`,
			errNULString, `at root.path holds a NUL character`},
		// Not a NUL: an escaped backslash, then "u0000".
		{"an escaped backslash before u0000", `{` + caps + `,"root":{"path":"r\\u0000"},"annotations":{"k\\u0000":"\\\\u0000"}}`, nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, ok := fastSpec([]byte(tc.spec))
			require.False(t, ok, "the fast decoder gives up on any escape")
			bundle := t.TempDir()
			require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), []byte(tc.spec), 0o600))
			st, err := json.Marshal(specs.State{Version: specs.Version, ID: "nul", Status: specs.StateCreating, Pid: 1, Bundle: bundle})
			require.NoError(t, err)
			e := defaultEnv()
			e.userNS = func() RuntimeUserNS { return Rootful }
			in := e.readInput(bytes.NewReader(st))
			if tc.is == nil {
				require.NoError(t, in.specErr)
				require.Equal(t, "r\\u0000", in.spec.Root.Path)
				return
			}
			require.ErrorIs(t, in.specErr, errInput)
			require.ErrorIs(t, in.specErr, tc.is)
			require.ErrorContains(t, in.specErr, filepath.Join(bundle, "config.json")+": ")
			require.ErrorContains(t, in.specErr, tc.want)
			require.False(t, in.NeverClaims(), "refused, not let through as a container that names no GPU")
			require.ErrorIs(t, CheckSpecKeys([]byte(tc.spec)), tc.is, "add-hooks refuses it too")
		})
	}
	_, err := readState(strings.NewReader(`{"id":"c1","bundle":"/b","annotations":{"k":"v\u0000"}}`))
	require.ErrorIs(t, err, errInput)
	require.ErrorIs(t, err, errNULString)
	require.ErrorContains(t, err, `the OCI state on stdin: NUL character in a string: the string "v\x00" at annotations.k holds a NUL character`)
}

// Nesting beyond encoding/json's limit is refused by the key check itself
// (it does not recurse without bound), and within it the check finds what
// lies past the deep part.
func TestCheckKeysDepth(t *testing.T) {
	deep := `{"a":` + strings.Repeat("[", maxKeyDepth) + strings.Repeat("]", maxKeyDepth) + `}`
	require.ErrorIs(t, checkKeys([]byte(deep), specKeys), errTooDeep)
	within := `{"a":` + strings.Repeat("[", maxKeyDepth-1) + strings.Repeat("]", maxKeyDepth-1) + `,"b":1,"b":2}`
	require.ErrorIs(t, checkKeys([]byte(within), specKeys), errAmbiguousKey)
	// Not JSON: left to the decoder that follows, which words the error.
	require.NoError(t, checkKeys([]byte(`{"linux":{"devices":[}}`), specKeys))
	require.NoError(t, checkKeys([]byte(`{"a":1} {"a":1,"a":2}`), specKeys), "trailing data is encoding/json's to refuse")
}

// A repeated key is found in an object of any size, and across the nested
// objects between its two places.
func TestCheckKeysLargeObjects(t *testing.T) {
	for _, n := range []int{2, smallObject, smallObject + 1, 200} {
		var b strings.Builder
		b.WriteString(`{"annotations":{`)
		for i := range n {
			fmt.Fprintf(&b, `"k%d":"v","n%d":{"k%d":{},"x":[{"k0":1}]},`, i, i, i)
		}
		b.WriteString(`"k0":"again"}}`)
		err := checkKeys([]byte(b.String()), specKeys)
		require.ErrorContains(t, err, `ambiguous key "k0": it appears twice in annotations,`, n)
		require.EqualError(t, err, tokenCheckKeys([]byte(b.String()), specKeys).Error())
		ok := strings.Replace(b.String(), `"k0":"again"`, `"last":"once"`, 1)
		require.NoError(t, checkKeys([]byte(ok), specKeys), n)
	}
}

// specKeys and stateKeys are the fields encoding/json fills in hookSpec and
// specs.State (and the poststop hooks, whose keys add-hooks reads), and the
// fast decoders give up on a case variant of each of them: a field added to
// hookSpec without its key here would let encoding/json match a variant of
// it that crun ignores.
func TestKeySchemasMatchTheDecoders(t *testing.T) {
	type variant struct{ doc, key string }
	var variants []variant
	var schemaOf func(t reflect.Type, wrap func(string) string) keySchema
	schemaOf = func(typ reflect.Type, wrap func(string) string) keySchema {
		for typ.Kind() == reflect.Pointer || typ.Kind() == reflect.Slice {
			typ = typ.Elem()
		}
		if typ.Kind() != reflect.Struct {
			return nil
		}
		ks := keySchema{}
		for i := range typ.NumField() {
			f := typ.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			require.NotEmpty(t, name, "%s.%s has a json name", typ, f.Name)
			upper := strings.ToUpper(name[:1]) + name[1:]
			variants = append(variants, variant{wrap(`{"` + upper + `":null}`), upper})
			ft := f.Type
			for ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			inner := func(s string) string { return wrap(`{"` + name + `":` + s + `}`) }
			if ft.Kind() == reflect.Slice {
				inner = func(s string) string { return wrap(`{"` + name + `":[` + s + `]}`) }
			}
			ks[name] = schemaOf(f.Type, inner)
		}
		return ks
	}
	id := func(s string) string { return s }
	want := schemaOf(reflect.TypeOf(hookSpec{}), id)
	want["hooks"]["poststop"] = want["hooks"]["createRuntime"]
	variants = append(variants, variant{`{"hooks":{"Poststop":null}}`, "Poststop"}, variant{`{"hooks":{"poststop":[{"Path":null}]}}`, "Path"},
		variant{`{"hooks":{"poststop":[{"TIMEOUT":null}]}}`, "TIMEOUT"})
	require.Equal(t, want, specKeys)
	for _, v := range variants {
		_, ok := fastSpec([]byte(v.doc))
		require.False(t, ok, "fastSpec gives up on %s", v.doc)
		require.ErrorIs(t, checkKeys([]byte(v.doc), specKeys), errAmbiguousKey, v.doc)
		require.ErrorContains(t, checkKeys([]byte(v.doc), specKeys), strconv.Quote(v.key))
	}

	variants = nil
	require.Equal(t, schemaOf(reflect.TypeOf(specs.State{}), id), stateKeys)
	for _, v := range variants {
		_, ok := fastState([]byte(v.doc))
		require.False(t, ok, "fastState gives up on %s", v.doc)
		require.ErrorIs(t, checkKeys([]byte(v.doc), stateKeys), errAmbiguousKey, v.doc)
	}
}

// Both phases of a container whose spec repeats "linux": create-runtime
// refuses it before it opens the ledger or writes a marker, and poststop
// (runc runs it after a failed create) finds nothing of it to release and
// succeeds, leaving nothing behind.
func TestAmbiguousSpecPhases(t *testing.T) {
	cfg := staticConfig(t)
	bundle := t.TempDir()
	spec := `{"process":{"env":["PATH=/bin"],"capabilities":{"bounding":[]}},` +
		`"linux":{"devices":[{"path":"/dev/nvidia1","type":"c","major":195,"minor":1}],` +
		`"resources":{"devices":[{"allow":true,"type":"c","major":195,"minor":1,"access":"rwm"}]}},"linux":{"devices":[]}}`
	require.NoError(t, os.WriteFile(filepath.Join(bundle, "config.json"), []byte(spec), 0o600))
	state := func(status specs.ContainerState) string {
		st, err := json.Marshal(specs.State{Version: specs.Version, ID: "dup", Status: status, Pid: os.Getpid(), Bundle: bundle})
		require.NoError(t, err)
		return string(st)
	}
	opened := 0
	e := testEnv(&opened)
	in := e.readInput(strings.NewReader(state(specs.StateCreating)))
	require.False(t, in.NeverClaims(), "a hook binary does not answer it before loading the configuration")
	err := e.run(t.Context(), PhaseCreateRuntime, cfg, strings.NewReader(state(specs.StateCreating)), io.Discard)
	require.ErrorIs(t, err, errAmbiguousKey)
	require.ErrorContains(t, err, `hook create-runtime: container dup refused: cannot read the runtime's input: `+
		filepath.Join(bundle, "config.json")+`: ambiguous key "linux": it appears twice in the top-level object`)
	require.Equal(t, 0, opened, "refused before the ledger")
	require.NoFileExists(t, newMarker(e.markerDir, specs.State{ID: "dup", Bundle: bundle}, cfg.Ledger.Dir).path)

	var stderr bytes.Buffer
	require.NoError(t, e.run(t.Context(), PhasePoststop, cfg, strings.NewReader(state(specs.StateStopped)), &stderr))
	require.Empty(t, stderr.String())
	l, err := ledger.OpenReadOnly(cfg.Ledger.Dir, ledger.Options{})
	require.NoError(t, err)
	snap, err := l.Snapshot(t.Context())
	require.NoError(t, err)
	require.Empty(t, snap.Claims)
	require.Empty(t, snap.Waiters)
}

// tokenCheckKeys is checkKeys written over json.Decoder.Token: slower (it
// decodes every value), but its keys are encoding/json's by construction.
// FuzzCheckKeys holds checkKeys to it.
func tokenCheckKeys(data []byte, schema keySchema) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	var path []pathStep
	var value func(schema keySchema, depth int) error
	value = func(schema keySchema, depth int) error {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		switch tok {
		case json.Delim('{'):
			if depth+1 > maxKeyDepth {
				return errTooDeep
			}
			seen := map[string]bool{}
			for dec.More() {
				tok, err := dec.Token()
				if err != nil {
					return err
				}
				key := tok.(string)
				if strings.Contains(key, "\x00") {
					return nulKey(key, path)
				}
				if seen[key] {
					return repeatedKey(key, path)
				}
				seen[key] = true
				child, known := schema[key]
				if !known {
					for name := range schema {
						if strings.EqualFold(key, name) {
							return caseVariant(key, name, path)
						}
					}
				}
				path = append(path, pathStep{key: []byte(key)})
				if err := value(child, depth+1); err != nil {
					return err
				}
				path = path[:len(path)-1]
			}
			_, err = dec.Token()
			return err
		case json.Delim('['):
			if depth+1 > maxKeyDepth {
				return errTooDeep
			}
			for i := 0; dec.More(); i++ {
				path = append(path, pathStep{index: i, elem: true})
				if err := value(schema, depth+1); err != nil {
					return err
				}
				path = path[:len(path)-1]
			}
			_, err = dec.Token()
			return err
		}
		if v, ok := tok.(string); ok && strings.Contains(v, "\x00") {
			return nulString(v, path)
		}
		return nil
	}
	err := value(schema, 0)
	if errors.Is(err, errAmbiguousKey) || errors.Is(err, errNULString) || errors.Is(err, errTooDeep) {
		return err
	}
	return nil
}

// FuzzCheckKeys: on valid JSON, checkKeys finds what a walk over
// encoding/json's tokens finds, in the same words (on the rest,
// encoding/json refuses the text anyway).
func FuzzCheckKeys(f *testing.F) {
	for _, s := range []string{
		`{"linux":{"devices":[{"path":"/dev/nvidia1","type":"c","major":195,"minor":1}]},"linux":{"devices":[]}}`,
		`{"Linux":{},"process":{"ENV":[]}}`,
		`{"process":{"env":["A=\u0026","B=\"\\"]},"l\u0069nux":{},"linux":{}}`,
		`{"annotations":{"a":"1","\u0061":"2"}}`,
		`{"x":[1,-2.5e-3,true,false,null,{"y":{},"y":[]}]}`,
		"{\"\xff\":1,\"\xfe\":2}",
		`{"proceſs":{}}`,
		`{"hooks":{"poststop":[{"path":"/x","Path":"/y"}]}}`,
		`{"id":"a","ID":"b"}`,
		` { "a" : [ { } , [ ] ] , "b" : "\ud83d\ude00" } `,
		`{"linux\u0000":{"devices":[]},"linux":{}}`,
		`{"mounts":[{"source":"/dev\u0000x"}],"a":"\\u0000","b":["\\\u0000"]}`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		for _, schema := range []keySchema{specKeys, stateKeys} {
			got := checkKeys([]byte(in), schema)
			if !json.Valid([]byte(in)) {
				continue
			}
			want := tokenCheckKeys([]byte(in), schema)
			if want == nil {
				require.NoError(t, got, "%q", in)
			} else {
				require.EqualError(t, got, want.Error(), "%q", in)
			}
		}
	})
}
