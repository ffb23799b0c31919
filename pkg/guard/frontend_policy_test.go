// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// frontEnds are the packages that must contain no policy: they translate
// their runtime's events into guard calls and the guard's answers back.
var frontEnds = []string{"../nriplugin", "../hook", "../ctl"}

// displayOnly are front-end files allowed to read policy fields because they
// only print them (gpu-guard-ctl check-config shows the effective policy).
var displayOnly = map[string]bool{"../ctl/checkconfig.go": true}

// policyFields are the [policy] settings that decide admissions and
// releases; the TTLs are timing knobs a front end may read (a waiting hook's
// refresh interval depends on queue_ttl).
var policyFields = map[string]bool{
	"OnConflict": true, "ReleaseOn": true, "AllDevices": true, "Privileged": true,
	"UnknownDevice": true, "ExemptNamespaces": true,
}

var timingFields = map[string]bool{"QueueTTL": true, "ReservationTTL": true}

// policyConsts are the config values of those settings.
var policyConsts = map[string]bool{
	"ConflictQueue": true, "ConflictReject": true, "ReleaseOnStop": true, "ReleaseOnRemove": true,
	"AllClaim": true, "AllReject": true, "AllIgnore": true,
	"PrivilegedDeclared": true, "PrivilegedAll": true, "PrivilegedReject": true,
	"UnknownReject": true, "UnknownIgnore": true,
}

// policyReads lists where file reads a policy decision: a policy field, a
// policy value of package config, or the whole [policy] section.
func policyReads(fset *token.FileSet, file *ast.File) []string {
	var out []string
	parentSel := map[*ast.SelectorExpr]string{}
	ast.Inspect(file, func(n ast.Node) bool {
		if sel, ok := n.(*ast.SelectorExpr); ok {
			if inner, ok := sel.X.(*ast.SelectorExpr); ok {
				parentSel[inner] = sel.Sel.Name
			}
		}
		return true
	})
	ast.Inspect(file, func(n ast.Node) bool {
		sel, ok := n.(*ast.SelectorExpr)
		if !ok {
			return true
		}
		pos := fset.Position(sel.Pos()).String()
		if id, ok := sel.X.(*ast.Ident); ok && id.Name == "config" && policyConsts[sel.Sel.Name] {
			out = append(out, pos+": config."+sel.Sel.Name)
		}
		if sel.Sel.Name != "Policy" {
			return true
		}
		field, selected := parentSel[sel]
		switch {
		case !selected:
			out = append(out, pos+": the whole Policy section")
		case policyFields[field]:
			out = append(out, pos+": Policy."+field)
		case !timingFields[field]:
			out = append(out, pos+": Policy."+field+" (new field: decide whether it is policy)")
		}
		return true
	})
	return out
}

// TestFrontEndsHoldNoPolicy: no front end reads a policy setting; each asks
// the guard (Admit, Releasable, Prescreen, ClaimOutlivesStop, ...), so that
// one place decides and all give one answer.
func TestFrontEndsHoldNoPolicy(t *testing.T) {
	fset := token.NewFileSet()
	scanned := 0
	for _, dir := range frontEnds {
		names, err := filepath.Glob(filepath.Join(dir, "*.go"))
		require.NoError(t, err)
		for _, name := range names {
			if strings.HasSuffix(name, "_test.go") || displayOnly[filepath.ToSlash(name)] {
				continue
			}
			file, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
			require.NoError(t, err)
			scanned++
			assert.Empty(t, policyReads(fset, file), "front end %s reads policy; move the decision into pkg/guard", name)
		}
	}
	require.Greater(t, scanned, 10, "the front-end packages were not found")
}

// TestPolicyReadsFound: the scan catches each way of reading policy.
func TestPolicyReadsFound(t *testing.T) {
	src := `package x
func f(g G, cfg config.Config) {
	if g.Config().Policy.ReleaseOn != config.ReleaseOnRemove {}
	_ = devices.NewResolver(inv, cfg.Policy)
	_ = cfg.Policy.QueueTTL.Duration
	_ = req.Privileged
}`
	fset := token.NewFileSet()
	file, err := parser.ParseFile(fset, "x.go", src, parser.SkipObjectResolution)
	require.NoError(t, err)
	reads := policyReads(fset, file)
	require.Len(t, reads, 3, "%v", reads)
	assert.Contains(t, reads[0]+reads[1]+reads[2], "config.ReleaseOnRemove")
	assert.Contains(t, reads[0]+reads[1]+reads[2], "Policy.ReleaseOn")
	assert.Contains(t, reads[0]+reads[1]+reads[2], "the whole Policy section")
}
