// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// TestStatusInventoryWarningsFollowTheLedger: what status says about the
// inventory (a refused cache, discovery that failed) matters only once the
// ledger was read. When the ledger read fails (not root, a ledger that needs
// recovery), its error is what to fix, and stderr starts with it, not with an
// inventory warning caused by the same thing; read, the warnings are printed.
func TestStatusInventoryWarningsFollowTheLedger(t *testing.T) {
	for _, tc := range []struct {
		name          string
		source        string // devices.source; "auto" discovers the static list (NVML fails)
		corruptLedger bool
		code          int
		warning       string // on stderr once the ledger is read
	}{
		{name: "refused cache, ledger read", source: "auto", code: ExitAttention,
			warning: "warning: ignoring the inventory cache: "},
		{name: "refused cache, ledger needs recovery", source: "auto", corruptLedger: true, code: ExitError},
		{name: "no inventory, ledger read", source: "proc", code: ExitAttention,
			warning: "unusable inventory cache"},
		{name: "no inventory, ledger needs recovery", source: "proc", corruptLedger: true, code: ExitError},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.populate(t)
			if tc.source != "auto" { // the fixture's
				f.setSource(t, tc.source)
			}
			require.NoError(t, os.WriteFile(filepath.Join(f.dir, devices.CacheFile), []byte("{not json"), 0o600))
			if tc.corruptLedger {
				require.NoError(t, os.WriteFile(filepath.Join(f.dir, "ledger.json"), []byte("\x00\x00garbage"), 0o600))
			}
			var stdout, stderr syncBuffer
			env := f.env(&stdout, &stderr)
			env.NVML = failingNVML()
			code := Run(context.Background(), []string{"--config", f.config, "status"}, env)
			require.Equal(t, tc.code, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
			if tc.corruptLedger {
				assert.True(t, strings.HasPrefix(stderr.String(), "error: CORRUPT LEDGER"), "the ledger's error comes first: %s", stderr.String())
				assert.NotContains(t, stderr.String(), "inventory cache")
				assert.NotContains(t, stderr.String(), "warning:")
				return
			}
			assert.Contains(t, stderr.String(), tc.warning)
		})
	}
}
