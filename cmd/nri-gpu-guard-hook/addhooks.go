// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"syscall"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
)

// cmdAddHooks is the subcommand that adds the guard's hooks to a bundle's
// config.json, for runtimes that read no hooks.d (Docker, containerd
// without NRI: docs/hook.md's runc wrapper runs it for every container).
const cmdAddHooks = "add-hooks"

// addHooksUsage is add-hooks' line of the usage.
const addHooksUsage = program + " " + cmdAddHooks + " [--config PATH] [--state-dir DIR] [--wait] [--no-poststop] [--path HOOK] [--relay RELAY | --no-relay] CONFIG.JSON"

// relayName is the file name of the relay (cmd/nri-gpu-guard-hook-relay),
// installed beside this binary.
const relayName = "nri-gpu-guard-hook-relay"

// addHooks runs `nri-gpu-guard-hook add-hooks`: it adds a createRuntime
// and a poststop hook running this binary to the config.json named, each
// unless that stage already has an entry running it (directly or through
// the relay), and leaves every other byte of the file as it was. Where the
// relay is installed beside this binary, the entries run the relay, told
// to fall back to this binary: each run is then answered by the hook
// server where one listens (a Go process start saved per hook), and by
// this binary, exec'd in the relay's place, where none does. jq, which the wrapper used
// before, rewrites every number as a double: docker's --ulimit
// memlock=-1 (18446744073709551615) came out as 18446744073709552000,
// which runc refuses, and every such container failed to start.
func addHooks(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet(program+" "+cmdAddHooks, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		_, _ = fmt.Fprintln(fs.Output(), "usage: "+addHooksUsage+"\n\n"+
			"Adds the createRuntime and poststop hooks of "+program+" to an OCI bundle's config.json\n"+
			"(each unless that stage has an entry running it already); the flags given are\n"+
			"passed on to the hooks. Where "+relayName+" is installed beside this binary (and\n"+
			"--path is not given), the entries run it: it hands each run to `"+program+" serve`\n"+
			"where one listens, and runs this binary itself where none does.\nWith --no-poststop (a host whose configuration says [hook]\n"+
			"poststop = false) the poststop hook is added only to a container annotated\n"+
			hook.PoststopAnnotation+"=on. The rest of the file is kept byte for byte.")
		fs.PrintDefaults()
	}
	cfgPath := fs.String("config", "", "configuration file the hooks read (absolute; default theirs: $"+config.EnvPath+" or "+config.DefaultPath+")")
	stateDir := fs.String("state-dir", "", "ledger directory the hooks use (absolute; default [ledger] dir)")
	wait := fs.Bool("wait", false, "the create-runtime hook waits in the queue for a busy GPU (plain runc only)")
	hookPath := fs.String("path", "", "path of the hook binary the hooks run (default: this binary, as it was started); "+
		"given, the hooks run it directly unless --relay is given too")
	noPoststop := fs.Bool("no-poststop", false, "add the createRuntime hook alone ([hook] poststop = false), and the poststop "+
		"only to a container annotated "+hook.PoststopAnnotation+"=on")
	relayPath := fs.String("relay", "", "path of the relay the hooks run, in front of the hook binary "+
		"(default: "+relayName+" beside this binary, when it is there and --path is not given)")
	noRelay := fs.Bool("no-relay", false, "the hooks run the hook binary directly, not through the relay")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() != 1 {
		_, _ = fmt.Fprintf(stderr, "%s %s: want one config.json, got %d arguments\n", program, cmdAddHooks, fs.NArg())
		fs.Usage()
		return 2
	}
	for _, f := range []struct{ name, v string }{{"--config", *cfgPath}, {"--state-dir", *stateDir}, {"--path", *hookPath}, {"--relay", *relayPath}} {
		if f.v != "" && !filepath.IsAbs(f.v) {
			// The runtime runs the hooks in the bundle directory.
			_, _ = fmt.Fprintf(stderr, "%s %s: %s %q: want an absolute path (the runtime runs the hooks in the bundle directory)\n",
				program, cmdAddHooks, f.name, f.v)
			return 2
		}
	}
	pathGiven := *hookPath != ""
	if !pathGiven {
		p, err := selfPath()
		if err != nil {
			_, _ = fmt.Fprintf(stderr, "%s %s: cannot tell this binary's path (give --path): %v\n", program, cmdAddHooks, err)
			return 1
		}
		*hookPath = p
	}
	relay, also, err := chooseRelay(*hookPath, *relayPath, pathGiven, *noRelay)
	if err != nil {
		_, _ = fmt.Fprintf(stderr, "%s %s: %v\n", program, cmdAddHooks, err)
		return 2
	}
	var extra []string
	if *cfgPath != "" {
		extra = append(extra, "--config", *cfgPath)
	}
	if *stateDir != "" {
		extra = append(extra, "--state-dir", *stateDir)
	}
	create := append([]string{program, hook.PhaseCreateRuntime}, extra...)
	if *wait {
		create = append(create, "--wait")
	}
	entries := []hookEntry{
		{stage: "createRuntime", Path: *hookPath, Args: create, Env: hook.RuntimeEnv()},
		{stage: "poststop", Path: *hookPath, Args: append([]string{program, hook.PhasePoststop}, extra...), Env: hook.RuntimeEnv(),
			optedInOnly: *noPoststop},
	}
	for i := range entries {
		if relay != "" {
			entries[i] = entries[i].throughRelay(relay)
		}
		entries[i].also = append(entries[i].also, also...)
	}
	if err := addHooksToFile(fs.Arg(0), entries); err != nil {
		_, _ = fmt.Fprintf(stderr, "%s %s: %v\n", program, cmdAddHooks, err)
		return 1
	}
	return 0
}

// chooseRelay returns the relay the entries run (none: "") and the other
// paths an entry already there may run the hook by (the relay beside the
// hook binary, and one --relay names, when the entries do not run it: an
// earlier add-hooks wrote entries through it, so the hook is there).
// relayFlag is --relay (absolute, checked by the caller); pathGiven: the
// hook binary came from --path, which turns off looking for the relay
// beside it (the hooks run what --path names, as before the relay).
func chooseRelay(hookPath, relayFlag string, pathGiven, noRelay bool) (relay string, also []string, err error) {
	if noRelay && relayFlag != "" {
		return "", nil, errors.New("--relay and --no-relay: give one")
	}
	beside := relayBeside(hookPath)
	if !pathGiven && beside == "" {
		// A symlink started by its own path: the directory it points into.
		if exe, err := os.Executable(); err == nil {
			beside = relayBeside(exe)
		}
	}
	if relayFlag != "" {
		if filepath.Base(hookPath) == relayName {
			return "", nil, fmt.Errorf("--path %s is the relay itself; with --relay, --path names the hook binary the relay runs when no server answers", hookPath)
		}
		if !executableFile(relayFlag) {
			return "", nil, fmt.Errorf("--relay %s: not an executable regular file (every container's hook would fail to run)", relayFlag)
		}
		relay = relayFlag
	} else if !noRelay && !pathGiven {
		relay = beside
	}
	for _, p := range []string{beside, relayFlag} {
		if p != "" && p != relay && !slices.Contains(also, p) {
			also = append(also, p)
		}
	}
	return relay, also, nil
}

// selfPath is the path this binary was started by when it is absolute (a
// wrapper's $GUARD: the path an entry already there names), else the
// executable's.
func selfPath() (string, error) {
	if len(os.Args) > 0 && filepath.IsAbs(os.Args[0]) {
		return os.Args[0], nil
	}
	return os.Executable()
}

// relayBeside is the relay installed in the directory of the hook binary
// at hookPath, or "" when there is no executable regular file of that
// name there (a build tree, a copy of the hook alone): the hooks then run
// the hook binary directly, as without a relay.
func relayBeside(hookPath string) string {
	p := filepath.Join(filepath.Dir(hookPath), relayName)
	if !executableFile(p) {
		return ""
	}
	return p
}

// executableFile reports whether path is (or links to) a regular file
// with an execute bit.
func executableFile(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

// hookEntry is one hook to add to the spec's hooks.<stage>.
type hookEntry struct {
	stage string
	// optedInOnly: added only to a spec annotated
	// hook.PoststopAnnotation=on (the poststop on a one-hook host, as the
	// shipped hooks.d mask runs it).
	optedInOnly bool
	// also: other paths of the same hook (the hook binary behind the
	// relay): a stage with an entry of one of them has the hook already.
	also []string
	Path string   `json:"path"`
	Args []string `json:"args"`
	Env  []string `json:"env"`
}

// throughRelay is e run by the relay at relay: the same arguments after the
// relay's own option naming the hook binary to exec when no server answers
// (always given, so that the fallback runs the binary that wrote the entry
// whatever the relay was built to default to).
func (e hookEntry) throughRelay(relay string) hookEntry {
	args := append([]string{relayName, "--relay-hook=" + e.Path}, e.Args[1:]...)
	e.also = append(e.also, e.Path)
	e.Path, e.Args = relay, args
	return e
}

// runs reports whether a hook entry of path runs e.
func (e hookEntry) runs(path string) bool {
	return path == e.Path || slices.Contains(e.also, path)
}

// optedIn reports whether the spec data carries hook.PoststopAnnotation =
// "on". A spec that does not decode has not opted in (addHookEntries then
// says what is wrong with it).
func optedIn(data []byte) bool {
	var spec struct {
		Annotations map[string]string `json:"annotations"`
	}
	return json.Unmarshal(data, &spec) == nil && spec.Annotations[hook.PoststopAnnotation] == "on"
}

// addHooksToFile adds entries to the config.json at path, replacing the
// file (same directory, same mode and owner) only when something was
// added.
func addHooksToFile(path string, entries []hookEntry) error {
	data, mode, uid, gid, err := readRegular(path)
	if err != nil {
		return err
	}
	wanted := entries[:0:0]
	for _, e := range entries {
		if !e.optedInOnly || optedIn(data) {
			wanted = append(wanted, e)
		}
	}
	out, err := addHookEntries(data, wanted)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if out == nil {
		return nil
	}
	return replaceFile(path, out, mode, uid, gid)
}

// readRegular reads a regular file of at most hook.MaxSpecBytes, as the
// hook bounds the one it reads (config.OpenRegular: a FIFO or device there
// would block or never end).
func readRegular(path string) (data []byte, mode os.FileMode, uid, gid int, err error) {
	f, err := config.OpenRegular(path)
	if err != nil {
		return nil, 0, 0, 0, err
	}
	defer func() { _ = f.Close() }() // read only: a close error loses nothing
	fi, err := f.Stat()
	if err != nil {
		return nil, 0, 0, 0, err
	}
	data, err = io.ReadAll(io.LimitReader(f, hook.MaxSpecBytes+1))
	if err != nil {
		return nil, 0, 0, 0, fmt.Errorf("read %s: %w", path, err)
	}
	if len(data) > hook.MaxSpecBytes {
		return nil, 0, 0, 0, fmt.Errorf("%s is larger than %d bytes", path, hook.MaxSpecBytes)
	}
	st, _ := fi.Sys().(*syscall.Stat_t)
	if st == nil {
		return nil, 0, 0, 0, fmt.Errorf("stat %s: no owner", path)
	}
	return data, fi.Mode().Perm(), int(st.Uid), int(st.Gid), nil
}

// replaceFile writes data to a new file beside path and renames it over
// path: a runtime (or a crash) sees the old file or the new one, never a
// part.
func replaceFile(path string, data []byte, mode os.FileMode, uid, gid int) (err error) {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".gpu-guard-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	if err := tmp.Chmod(mode); err != nil {
		return err
	}
	if uid != os.Geteuid() || gid != os.Getegid() {
		if err := tmp.Chown(uid, gid); err != nil {
			return err
		}
	}
	if _, err := tmp.Write(data); err != nil {
		return err
	}
	if err := tmp.Sync(); err != nil {
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// addHookEntries returns data, a config.json, with each entry added to
// hooks.<stage> unless one running it is there (hookEntry.runs); nil when
// nothing was added. Only the hooks object changes, by splicing: every other byte (the
// key order, white space, and numbers such as an rlimit of 2^64-1, which a
// decode into float64 or any re-encoding would change) stays as it was.
func addHookEntries(data []byte, entries []hookEntry) ([]byte, error) {
	if !json.Valid(data) {
		// Say where, as encoding/json does.
		var v any
		if err := json.Unmarshal(data, &v); err != nil {
			return nil, fmt.Errorf("not JSON: %w", err)
		}
		return nil, errors.New("not JSON")
	}
	// A key repeated, or a field spelled in another case, would leave the
	// hooks that counted to the runtime's reading: refused as the hook
	// refuses it.
	if err := hook.CheckSpecKeys(data); err != nil {
		return nil, err
	}
	top, err := objectMembers(data, 0, len(data))
	if err != nil {
		return nil, fmt.Errorf("not an OCI runtime spec: %w", err)
	}
	var edits []edit
	hooks, ok := top.find("hooks")
	switch {
	case !ok:
		obj, err := newHooksObject(entries)
		if err != nil {
			return nil, err
		}
		edits = append(edits, top.insert(`"hooks":`+obj))
	case string(data[hooks.start:hooks.end]) == "null":
		obj, err := newHooksObject(entries)
		if err != nil {
			return nil, err
		}
		edits = append(edits, edit{hooks.start, hooks.end, obj})
	default:
		obj, err := objectMembers(data, hooks.start, hooks.end)
		if err != nil {
			return nil, fmt.Errorf("hooks: %w", err)
		}
		var added []string
		for _, e := range entries {
			entry, err := json.Marshal(e)
			if err != nil {
				return nil, err
			}
			stage, ok := obj.find(e.stage)
			if !ok {
				added = append(added, `"`+e.stage+`":[`+string(entry)+`]`)
				continue
			}
			ed, err := addToList(data, stage, e, entry)
			if err != nil {
				return nil, err
			}
			if ed != nil {
				edits = append(edits, *ed)
			}
		}
		if len(added) > 0 {
			ed := obj.insert(added[0])
			for _, a := range added[1:] {
				ed.text += "," + a
			}
			edits = append(edits, ed)
		}
	}
	if len(edits) == 0 {
		return nil, nil
	}
	// From the end, so that each edit's offsets still hold.
	sort.Slice(edits, func(i, j int) bool { return edits[i].start > edits[j].start })
	out := data
	for _, e := range edits {
		out = slices.Concat(out[:e.start], []byte(e.text), out[e.end:])
	}
	return out, nil
}

// addToList returns the edit that appends entry (e marshalled) to the list
// of hooks at span, nil when the list has an entry running e already (its
// path, or the hook binary's behind the relay: a spec given the hook
// directly by an earlier add-hooks, or by hand, does not get it twice).
func addToList(data []byte, span member, e hookEntry, entry []byte) (*edit, error) {
	raw := data[span.start:span.end]
	if string(raw) == "null" {
		return &edit{span.start, span.end, "[" + string(entry) + "]"}, nil
	}
	var list []*struct {
		Path string `json:"path"`
	}
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, fmt.Errorf("hooks.%s is not a list of hooks", e.stage)
	}
	for _, h := range list {
		if h != nil && e.runs(h.Path) {
			return nil, nil
		}
	}
	closing := span.end - 1 // raw ends with its ']'
	if len(list) == 0 {
		return &edit{span.start, span.end, "[" + string(entry) + "]"}, nil
	}
	return &edit{closing, closing, "," + string(entry)}, nil
}

// newHooksObject is a hooks object holding entries alone.
func newHooksObject(entries []hookEntry) (string, error) {
	s := "{"
	for i, e := range entries {
		entry, err := json.Marshal(e)
		if err != nil {
			return "", err
		}
		if i > 0 {
			s += ","
		}
		s += `"` + e.stage + `":[` + string(entry) + `]`
	}
	return s + "}", nil
}

// edit replaces data[start:end] with text.
type edit struct {
	start, end int
	text       string
}

// member is a key of a JSON object and where its value is in the text.
type member struct {
	key        string
	start, end int
}

// object is a JSON object's members and the offset of its closing brace.
type object struct {
	members []member
	closing int
}

func (o object) find(key string) (member, bool) {
	for _, m := range o.members {
		if m.key == key {
			return m, true
		}
	}
	return member{}, false
}

// insert is the edit that adds the member text (`"key":value`) last: just
// after the last value, or inside the braces of an empty object.
func (o object) insert(text string) edit {
	if n := len(o.members); n > 0 {
		end := o.members[n-1].end
		return edit{end, end, "," + text}
	}
	return edit{o.closing, o.closing, text}
}

// objectMembers reads the JSON object data[start:end] (valid JSON,
// checked by the caller) and says where each member's value is, in
// offsets of data.
func objectMembers(data []byte, start, end int) (object, error) {
	dec := json.NewDecoder(bytes.NewReader(data[start:end]))
	tok, err := dec.Token()
	if err != nil {
		return object{}, err
	}
	if tok != json.Delim('{') {
		return object{}, errors.New("not a JSON object")
	}
	var o object
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return object{}, err
		}
		key, _ := tok.(string) // the decoder gives an object's keys as strings
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return object{}, err
		}
		// The decoder's offset is just past the value, and the raw
		// message is the value's own bytes: so the value starts there
		// minus its length. Checked, since the file is rewritten from it.
		vend := start + int(dec.InputOffset())
		vstart := vend - len(raw)
		if vstart < start || !bytes.Equal(data[vstart:vend], raw) {
			return object{}, fmt.Errorf("cannot tell where the value of %q is", key)
		}
		o.members = append(o.members, member{key: key, start: vstart, end: vend})
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return object{}, err
	}
	o.closing = start + int(dec.InputOffset()) - 1
	if o.closing < start || data[o.closing] != '}' {
		return object{}, errors.New("cannot tell where the object ends")
	}
	return o, nil
}
