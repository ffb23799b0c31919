// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package config

import (
	"bytes"
	"sort"
	"testing"

	"github.com/BurntSushi/toml"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestKeysAreCaseSensitive: TOML keys are case-sensitive, but the decoder
// matches them without regard to case. A key or table that is a schema key
// in other case is refused, naming it and the key it spells; in particular a
// case variant next to the real key no longer replaces its value.
func TestKeysAreCaseSensitive(t *testing.T) {
	for _, tc := range []struct {
		name, doc string
		want      []string
		notWant   []string
	}{
		{"upper-case key", "[policy]\nON_CONFLICT = \"reject\"\n",
			[]string{"policy.ON_CONFLICT (keys are case-sensitive: write policy.on_conflict)"}, nil},
		{"case variant after the real key", "[policy]\non_conflict = \"reject\"\nOn_Conflict = \"queue\"\n",
			[]string{"policy.On_Conflict (keys are case-sensitive: write policy.on_conflict)"}, []string{"policy.on_conflict,"}},
		// Only the table is named: every key below it is refused with it.
		{"capitalised table", "[Policy]\non_conflict = \"reject\"\nrelease_on = \"remove\"\n",
			[]string{"unknown configuration key: Policy (keys are case-sensitive: write policy) ("}, []string{"Policy.on_conflict", "Policy.release_on"}},
		{"capitalised array of tables", "[devices]\nsource = \"static\"\n[[devices.Static]]\nindex = 0\nuuid = \"GPU-6c1a2f2e-0000-4000-8000-000000000000\"\nminor = 0\n",
			[]string{"devices.Static (keys are case-sensitive: write devices.static)"}, []string{"devices.Static.index"}},
		{"upper-case version", "VERSION = 1\n", []string{"VERSION (keys are case-sensitive: write version)"}, nil},
		{"inline table", "ledger = { DIR = \"/srv/gpu-ledger\" }\n", []string{"ledger.DIR (keys are case-sensitive: write ledger.dir)"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := Parse([]byte(tc.doc))
			require.ErrorIs(t, err, ErrUnknownKey)
			require.Equal(t, Config{}, cfg, "nothing of the document is applied")
			for _, w := range tc.want {
				assert.Contains(t, err.Error(), w)
			}
			for _, w := range tc.notWant {
				assert.NotContains(t, err.Error(), w)
			}
		})
	}
}

// TestUnknownKeyNamesWhereTheKeysAre: the error of an unknown key points at
// what an installed host has: the packaged configuration, which shows every
// key with its default, and the design document installed with the others.
func TestUnknownKeyNamesWhereTheKeysAre(t *testing.T) {
	_, err := Parse([]byte("[policy]\non_confilct = \"queue\"\n"))
	require.ErrorIs(t, err, ErrUnknownKey)
	assert.Contains(t, err.Error(), "policy.on_confilct (check the spelling; every key is shown, with its default, "+
		"in the configuration file the package installs (/etc/nri-gpu-guard/config.toml) and in /usr/share/doc/nri-gpu-guard/design.md)")
	assert.NotContains(t, err.Error(), "README")
}

// TestSchemaKeysAreTheDecodersKeys: the key set checkKeys derives from the
// struct tags is exactly the set of keys of a document that sets every
// field (arrays of tables included), as the decoder reports them: no key of
// the schema is refused, and none outside it is accepted.
func TestSchemaKeysAreTheDecodersKeys(t *testing.T) {
	full := Default()
	full.Metrics.Listen = "127.0.0.1:9464"
	full.Policy.ExemptNamespaces = []string{"monitoring"}
	full.Devices.Static = []StaticGPU{{Index: 0, UUID: "GPU-6c1a2f2e-0000-4000-8000-000000000000", Model: "m", MemoryMiB: 1,
		MIG: []StaticMIG{{Index: 0, UUID: "MIG-6c1a2f2e-0000-4000-8000-0000000000a0", GI: 1}}}}
	var buf bytes.Buffer
	require.NoError(t, toml.NewEncoder(&buf).Encode(full))

	var decoded Config
	md, err := toml.Decode(buf.String(), &decoded)
	require.NoError(t, err)
	require.Empty(t, md.Undecoded())
	docKeys := map[string]bool{}
	for _, k := range md.Keys() {
		docKeys[k.String()] = true
	}
	require.Equal(t, sorted(docKeys), sorted(schemaKeys()), "document:\n%s", buf.String())

	cfg, err := Parse(buf.Bytes())
	require.NoError(t, err)
	require.Equal(t, full, cfg)
}

func sorted(set map[string]bool) []string {
	out := make([]string, 0, len(set))
	for k := range set {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
