// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package devices

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestResolvingPackagesLinkNoNVML: the packages that only resolve, record or
// check liveness build without cgo and never link go-nvml; only nvmlloader
// does (and the programs that hand it to LoadInventory). An import that
// drags the NVML bindings back below the loader, as a liveness → ledger →
// devices → go-nvml chain once did, fails here and names the chain's root.
func TestResolvingPackagesLinkNoNVML(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command to list dependencies with")
	}
	const module = "github.com/nri-gpu-guard/nri-gpu-guard/pkg/"
	for _, pkg := range []string{"liveness", "ledger", "devices", "guard", "hook", "nriplugin"} {
		cmd := exec.Command(goBin, "list", "-tags", "nri_no_wasm", "-deps",
			"-f", "{{if not .Standard}}{{.ImportPath}} {{len .CgoFiles}}{{end}}", module+pkg)
		// With cgo on, a package's cgo files are counted rather than
		// excluded from the build.
		cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("go list -deps %s: %v\n%s", pkg, err, out)
		}
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			path, cgoFiles, _ := strings.Cut(line, " ")
			if strings.HasPrefix(path, "github.com/NVIDIA/go-nvml") || (cgoFiles != "0" && cgoFiles != "") {
				t.Errorf("pkg/%s depends on %s (%s cgo files): keep NVML in pkg/devices/nvmlloader", pkg, path, cgoFiles)
			}
		}
	}
}
