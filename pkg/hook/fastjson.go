// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"strconv"
	"strings"
	"unicode/utf8"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// A hook process decodes two small JSON documents and exits. With
// encoding/json, building its reflection tables for the two types costs more
// than the decoding itself: about a tenth of a whole hook process for a
// container that names no GPU. The decoders here read exactly the fields
// the hook uses, in the common shape runtimes write, without reflection.
//
// They never decide alone: each either returns the same value encoding/json
// would, or reports that it cannot (ok false), and the caller then decodes
// with encoding/json, which also produces every error. They give up on
// anything outside the plain shape: a key that differs from a field's name
// only in case (encoding/json matches those too), a repeated key (merged by
// encoding/json), a string with an escape or invalid UTF-8, a number that is
// not a plain integer, a value of the wrong type, trailing data. The caller
// refuses the first two, and a NUL (an escape) in a key or a string
// (checkKeys), before encoding/json sees them: where
// the fast decoders answer, checkKeys finds nothing to refuse, as each
// object they read gives up on the keys that differ from its names (the
// fields of specKeys and stateKeys) only in case, and every object on a
// repeated key. FuzzFastDecode checks both.

// jscan walks a JSON text; bad is set on anything it does not handle, after
// which every method returns zero values.
type jscan struct {
	b   []byte
	i   int
	bad bool
}

func (s *jscan) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// peek returns the next non-space byte without consuming it, 0 at the end.
func (s *jscan) peek() byte {
	s.ws()
	if s.bad || s.i >= len(s.b) {
		return 0
	}
	return s.b[s.i]
}

// lit consumes the literal word (null, true, false).
func (s *jscan) lit(word string) {
	if s.bad || len(s.b)-s.i < len(word) || string(s.b[s.i:s.i+len(word)]) != word {
		s.bad = true
		return
	}
	s.i += len(word)
}

// null consumes a null if one is next.
func (s *jscan) null() bool {
	if s.peek() != 'n' {
		return false
	}
	s.lit("null")
	return !s.bad
}

// str reads a string without escapes.
func (s *jscan) str() string {
	if s.peek() != '"' {
		s.bad = true
		return ""
	}
	start := s.i + 1
	for j := start; j < len(s.b); j++ {
		switch c := s.b[j]; {
		case c == '"':
			v := s.b[start:j]
			if !utf8.Valid(v) {
				s.bad = true
				return ""
			}
			s.i = j + 1
			return string(v)
		case c == '\\' || c < 0x20:
			s.bad = true
			return ""
		}
	}
	s.bad = true
	return ""
}

// integer reads a plain integer (no fraction, no exponent) that fits 64 bits.
func (s *jscan) integer() int64 {
	s.ws()
	j := s.i
	if j < len(s.b) && s.b[j] == '-' {
		j++
	}
	digits := j
	for j < len(s.b) && '0' <= s.b[j] && s.b[j] <= '9' {
		j++
	}
	if j == digits || (s.b[digits] == '0' && j > digits+1) ||
		(j < len(s.b) && (s.b[j] == '.' || s.b[j] == 'e' || s.b[j] == 'E')) {
		s.bad = true
		return 0
	}
	v, err := strconv.ParseInt(string(s.b[s.i:j]), 10, 64)
	if err != nil {
		s.bad = true
		return 0
	}
	s.i = j
	return v
}

func (s *jscan) boolean() bool {
	switch s.peek() {
	case 't':
		s.lit("true")
		return true
	case 'f':
		s.lit("false")
	default:
		s.bad = true
	}
	return false
}

// object calls field for every key of an object; field consumes the value
// and returns false for a key it does not know. An unknown key is skipped,
// unless it matches a known one but for case (names lists them), and a
// repeated known key gives up.
func (s *jscan) object(names []string, field func(key string) bool) {
	if s.peek() != '{' {
		s.bad = true
		return
	}
	s.i++
	seen := map[string]bool{}
	if s.peek() == '}' {
		s.i++
		return
	}
	for !s.bad {
		key := s.str()
		if s.peek() != ':' {
			s.bad = true
			return
		}
		s.i++
		if seen[key] || (names != nil && !isASCII(key)) {
			s.bad = true
			return
		}
		seen[key] = true
		if !field(key) {
			for _, n := range names {
				if strings.EqualFold(key, n) {
					s.bad = true
					return
				}
			}
			s.skip(0)
		}
		switch s.peek() {
		case ',':
			s.i++
		case '}':
			s.i++
			return
		default:
			s.bad = true
			return
		}
	}
}

// array calls elem for every element of an array.
func (s *jscan) array(elem func()) {
	if s.peek() != '[' {
		s.bad = true
		return
	}
	s.i++
	if s.peek() == ']' {
		s.i++
		return
	}
	for !s.bad {
		elem()
		switch s.peek() {
		case ',':
			s.i++
		case ']':
			s.i++
			return
		default:
			s.bad = true
			return
		}
	}
}

// maxDepth bounds the nesting of a skipped value (encoding/json allows
// 10,000; deeper input goes to it and is refused there).
const maxDepth = 100

// skip consumes any value, checking it is valid JSON.
func (s *jscan) skip(depth int) {
	if depth > maxDepth {
		s.bad = true
		return
	}
	switch c := s.peek(); {
	case c == '{':
		s.object(nil, func(string) bool { s.skip(depth + 1); return true })
	case c == '[':
		s.array(func() { s.skip(depth + 1) })
	case c == '"':
		s.str()
	case c == 'n':
		s.lit("null")
	case c == 't' || c == 'f':
		s.boolean()
	case c == '-' || ('0' <= c && c <= '9'):
		s.number()
	default:
		s.bad = true
	}
}

// number consumes any JSON number:
// -? (0 | [1-9][0-9]*) (.[0-9]+)? ([eE][+-]?[0-9]+)?
func (s *jscan) number() {
	j := s.i
	digits := func() int {
		k := j
		for j < len(s.b) && '0' <= s.b[j] && s.b[j] <= '9' {
			j++
		}
		return j - k
	}
	if j < len(s.b) && s.b[j] == '-' {
		j++
	}
	start := j
	if n := digits(); n == 0 || (n > 1 && s.b[start] == '0') {
		s.bad = true
		return
	}
	if j < len(s.b) && s.b[j] == '.' {
		j++
		if digits() == 0 {
			s.bad = true
			return
		}
	}
	if j < len(s.b) && (s.b[j] == 'e' || s.b[j] == 'E') {
		j++
		if j < len(s.b) && (s.b[j] == '+' || s.b[j] == '-') {
			j++
		}
		if digits() == 0 {
			s.bad = true
			return
		}
	}
	s.i = j
}

// end checks that only white space follows.
func (s *jscan) end() bool {
	s.ws()
	return !s.bad && s.i == len(s.b)
}

func (s *jscan) strings() []string {
	if s.null() {
		return nil
	}
	out := []string{}
	s.array(func() { out = append(out, s.str()) })
	return out
}

func (s *jscan) stringMap() map[string]string {
	if s.null() {
		return nil
	}
	m := map[string]string{}
	s.object(nil, func(k string) bool {
		m[k] = s.str()
		return true
	})
	return m
}

// optString reads a string or null (which leaves a string field as it is).
func (s *jscan) optString() string {
	if s.null() {
		return ""
	}
	return s.str()
}

// fastState decodes the OCI state as json.Unmarshal into specs.State would,
// or reports ok false.
func fastState(data []byte) (st specs.State, ok bool) {
	s := &jscan{b: data}
	s.object([]string{"ociVersion", "id", "status", "pid", "bundle", "annotations"}, func(k string) bool {
		switch k {
		case "ociVersion":
			st.Version = s.optString()
		case "id":
			st.ID = s.optString()
		case "status":
			st.Status = specs.ContainerState(s.optString())
		case "pid":
			if !s.null() {
				v := s.integer()
				if int64(int(v)) != v {
					s.bad = true // too big for an int here: encoding/json says so
				}
				st.Pid = int(v)
			}
		case "bundle":
			st.Bundle = s.optString()
		case "annotations":
			st.Annotations = s.stringMap()
		default:
			return false
		}
		return true
	})
	if !s.end() {
		return specs.State{}, false
	}
	return st, true
}

// fastSpec decodes config.json as json.Unmarshal into hookSpec would, or
// reports ok false.
func fastSpec(data []byte) (h hookSpec, ok bool) {
	s := &jscan{b: data}
	s.object([]string{"process", "root", "mounts", "annotations", "linux", "hooks"}, func(k string) bool {
		switch k {
		case "hooks":
			h.Hooks = s.hooks()
		case "process":
			h.Process = s.process()
		case "root":
			h.Root = s.root()
		case "mounts":
			h.Mounts = s.mounts()
		case "annotations":
			h.Annotations = s.stringMap()
		case "linux":
			h.Linux = s.linux()
		default:
			return false
		}
		return true
	})
	if !s.end() {
		return hookSpec{}, false
	}
	return h, true
}

func (s *jscan) hooks() *hookHooks {
	if s.null() {
		return nil
	}
	hs := &hookHooks{}
	s.object([]string{"createRuntime", "poststop"}, func(k string) bool {
		switch k {
		case "createRuntime":
			hs.CreateRuntime = s.hookList()
		case "poststop":
			// Not kept, but read as createRuntime is, so that a key
			// checkKeys refuses (or any value the fast path cannot
			// read) sends the spec to the checked fallback.
			_ = s.hookList()
		default:
			return false
		}
		return true
	})
	return hs
}

func (s *jscan) hookList() []hookHook {
	if s.null() {
		return nil
	}
	out := []hookHook{}
	s.array(func() {
		var h hookHook
		s.object([]string{"path", "args", "timeout"}, func(k string) bool {
			switch k {
			case "path":
				h.Path = s.optString()
			case "args":
				h.Args = s.strings()
			case "timeout":
				if s.null() {
					return true
				}
				v := s.integer()
				if int64(int(v)) != v {
					s.bad = true // too big for an int here: encoding/json says so
				}
				n := int(v)
				h.Timeout = &n
			default:
				return false
			}
			return true
		})
		out = append(out, h)
	})
	return out
}

func (s *jscan) root() *hookRoot {
	if s.null() {
		return nil
	}
	r := &hookRoot{}
	s.object([]string{"path", "readonly"}, func(k string) bool {
		switch k {
		case "path":
			r.Path = s.optString()
		case "readonly":
			if !s.null() {
				r.Readonly = s.boolean()
			}
		default:
			return false
		}
		return true
	})
	return r
}

func (s *jscan) process() *hookProcess {
	if s.null() {
		return nil
	}
	p := &hookProcess{}
	s.object([]string{"env", "capabilities"}, func(k string) bool {
		switch k {
		case "env":
			p.Env = s.strings()
		case "capabilities":
			if s.null() {
				p.Capabilities = nil
				return true
			}
			p.Capabilities = &hookCaps{}
			s.object([]string{"bounding"}, func(k string) bool {
				if k != "bounding" {
					return false
				}
				p.Capabilities.Bounding = s.strings()
				return true
			})
		default:
			return false
		}
		return true
	})
	return p
}

func (s *jscan) mounts() []hookMount {
	if s.null() {
		return nil
	}
	out := []hookMount{}
	s.array(func() {
		var m hookMount
		s.object([]string{"destination", "source", "type", "options"}, func(k string) bool {
			switch k {
			case "destination":
				m.Destination = s.optString()
			case "source":
				m.Source = s.optString()
			case "type":
				m.Type = s.optString()
			case "options":
				m.Options = s.strings()
			default:
				return false
			}
			return true
		})
		out = append(out, m)
	})
	return out
}

func (s *jscan) linux() *hookLinux {
	if s.null() {
		return nil
	}
	l := &hookLinux{}
	s.object([]string{"devices", "cgroupsPath", "resources", "namespaces"}, func(k string) bool {
		switch k {
		case "devices":
			l.Devices = s.linuxDevices()
		case "namespaces":
			l.Namespaces = s.namespaces()
		case "cgroupsPath":
			l.CgroupsPath = s.optString()
		case "resources":
			if s.null() {
				l.Resources = nil
				return true
			}
			l.Resources = &hookResources{}
			s.object([]string{"devices"}, func(k string) bool {
				if k != "devices" {
					return false
				}
				l.Resources.Devices = s.cgroupRules()
				return true
			})
		default:
			return false
		}
		return true
	})
	return l
}

func (s *jscan) namespaces() []hookNamespace {
	if s.null() {
		return nil
	}
	out := []hookNamespace{}
	s.array(func() {
		var n hookNamespace
		s.object([]string{"type", "path"}, func(k string) bool {
			switch k {
			case "type":
				n.Type = s.optString()
			case "path":
				n.Path = s.optString()
			default:
				return false
			}
			return true
		})
		out = append(out, n)
	})
	return out
}

func (s *jscan) linuxDevices() []hookDevice {
	if s.null() {
		return nil
	}
	out := []hookDevice{}
	s.array(func() {
		var d hookDevice
		s.object([]string{"path", "type", "major", "minor"}, func(k string) bool {
			switch k {
			case "path":
				d.Path = s.optString()
			case "type":
				d.Type = s.optString()
			case "major":
				if !s.null() {
					d.Major = s.integer()
				}
			case "minor":
				if !s.null() {
					d.Minor = s.integer()
				}
			default:
				return false
			}
			return true
		})
		out = append(out, d)
	})
	return out
}

func (s *jscan) cgroupRules() []specs.LinuxDeviceCgroup {
	if s.null() {
		return nil
	}
	out := []specs.LinuxDeviceCgroup{}
	s.array(func() {
		var r specs.LinuxDeviceCgroup
		s.object([]string{"allow", "type", "major", "minor", "access"}, func(k string) bool {
			switch k {
			case "allow":
				if !s.null() {
					r.Allow = s.boolean()
				}
			case "type":
				r.Type = s.optString()
			case "major":
				r.Major = s.optInt64()
			case "minor":
				r.Minor = s.optInt64()
			case "access":
				r.Access = s.optString()
			default:
				return false
			}
			return true
		})
		out = append(out, r)
	})
	return out
}

func (s *jscan) optInt64() *int64 {
	if s.null() {
		return nil
	}
	v := s.integer()
	return &v
}

func isASCII(k string) bool {
	for i := 0; i < len(k); i++ {
		if k[i] >= utf8.RuneSelf {
			return false
		}
	}
	return true
}
