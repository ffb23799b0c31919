// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build integration

package integration

import (
	"debug/buildinfo"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// DefaultContainerdVersion is the containerd the suite runs when
// CONTAINERD_VERSION is unset (setup.sh builds the same default).
const DefaultContainerdVersion = "v2.2.1"

// ContainerdVersion is a containerd release, e.g. v1.7.35.
type ContainerdVersion struct{ Major, Minor, Patch int }

var versionRE = regexp.MustCompile(`^v(\d+)\.(\d+)\.(\d+)$`)

// ParseContainerdVersion parses a release tag "vX.Y.Z".
func ParseContainerdVersion(s string) (ContainerdVersion, error) {
	m := versionRE.FindStringSubmatch(s)
	if m == nil {
		return ContainerdVersion{}, fmt.Errorf("containerd version %q: want a release tag like %s", s, DefaultContainerdVersion)
	}
	var v ContainerdVersion
	v.Major, _ = strconv.Atoi(m[1])
	v.Minor, _ = strconv.Atoi(m[2])
	v.Patch, _ = strconv.Atoi(m[3])
	return v, nil
}

func (v ContainerdVersion) String() string {
	return fmt.Sprintf("v%d.%d.%d", v.Major, v.Minor, v.Patch)
}

// AtLeast reports whether v is release line major.minor or later.
func (v ContainerdVersion) AtLeast(major, minor int) bool {
	return v.Major > major || v.Major == major && v.Minor >= minor
}

// runtimeUnderTest reads CONTAINERD_VERSION. NRI first shipped in 1.7.
func runtimeUnderTest() (ContainerdVersion, error) {
	s := os.Getenv("CONTAINERD_VERSION")
	if s == "" {
		s = DefaultContainerdVersion
	}
	v, err := ParseContainerdVersion(s)
	if err != nil {
		return v, err
	}
	if !v.AtLeast(1, 7) {
		return v, fmt.Errorf("containerd %s has no NRI: the suite needs 1.7 or later", v)
	}
	return v, nil
}

// Capability is something the suite relies on that not every containerd
// release line has. A test that needs one calls RequireCapability, so that
// on older lines it is reported as not supported, by name, rather than
// failing or silently passing.
type Capability struct {
	// Name is how test output and the compatibility table name it.
	Name string
	// Since is the first release line that has it.
	SinceMajor, SinceMinor int
	// Without says what that means for a user of an older line.
	Without string
}

// CapDefaultValidator is NRI's built-in default validator with
// required_plugins: containers are refused while the guard is not
// registered. Older lines reject or ignore the config block.
var CapDefaultValidator = Capability{
	Name:       "NRI default validator (required_plugins)",
	SinceMajor: 2, SinceMinor: 2,
	Without: "the guard cannot fail closed: while it is not registered, containers are created unchecked",
}

// CapAdjustmentValidation is NRI's ValidateContainerAdjustment: the guard
// checks the container as every plugin leaves it. Older lines refuse a
// plugin subscribing to it (the guard subscribes only from 2.2 on).
var CapAdjustmentValidation = Capability{
	Name:       "NRI adjustment validation (ValidateContainerAdjustment)",
	SinceMajor: 2, SinceMinor: 2,
	Without: "an NRI plugin with a higher index than the guard's can add a GPU unchecked: keep device-adding plugins below the guard's index",
}

// Has reports whether the runtime under test has c.
func (c Capability) Has(v ContainerdVersion) bool { return v.AtLeast(c.SinceMajor, c.SinceMinor) }

// notSupportedPrefix starts the skip message of a test whose capability the
// runtime lacks; the matrix report shows such a test as "not supported".
const notSupportedPrefix = "not supported on containerd "

// RequireCapability skips the test, saying which capability the runtime
// under test lacks and what that means, unless it has it.
func RequireCapability(t testing.TB, c Capability) {
	t.Helper()
	if !c.Has(Runtime) {
		t.Skipf("%s%s: %s (since containerd %d.%d); %s", notSupportedPrefix, Runtime, c.Name, c.SinceMajor, c.SinceMinor, c.Without)
	}
}

// configVersion is the containerd config format of the runtime under test:
// 1.7 reads version 2 (and no version 3), 2.x reads version 3 (and migrates
// older ones, with a log line).
func configVersion(v ContainerdVersion) int {
	if v.Major < 2 {
		return 2
	}
	return 3
}

// nriModule is the NRI library's module path inside a containerd binary.
const nriModule = "github.com/containerd/nri"

// runtimeNRIVersion reads, from the containerd binary's build information,
// which NRI version the runtime under test speaks.
func runtimeNRIVersion(bin string) (string, error) {
	info, err := buildinfo.ReadFile(bin)
	if err != nil {
		return "", fmt.Errorf("build information of %s: %w", bin, err)
	}
	for _, dep := range info.Deps {
		if dep.Path == nriModule {
			if dep.Replace != nil {
				return dep.Replace.Version, nil
			}
			return dep.Version, nil
		}
	}
	return "", fmt.Errorf("%s was not built with %s", bin, nriModule)
}

// stubVersionWarning is what the plugin's NRI stub logs when the runtime
// sends no NRI version and the stub cannot infer one from the runtime's own
// version (a source build reports "X.Y.Z+unknown").
const stubVersionWarning = "failed to infer runtime NRI version"

// TestRuntimeUnderTest checks that the containerd the suite runs is the
// version it was asked for (the build cache cannot hand it another one),
// and reports the runtime's NRI version and whether the guard's NRI stub
// warns about it. The matrix report reads the "runtime under test" line.
func TestRuntimeUnderTest(t *testing.T) {
	bin := filepath.Join(ContainerdDir, "containerd")
	out, err := runTool(os.Environ(), bin, "--version")
	require.NoError(t, err)
	// "containerd github.com/containerd/containerd/v2 2.2.1+unknown" (a
	// source build has no leading v and no commit).
	fields := strings.Fields(out)
	require.GreaterOrEqual(t, len(fields), 3, "containerd --version: %q", out)
	reported := strings.TrimPrefix(fields[2], "v")
	assert.True(t, reported == strings.TrimPrefix(Runtime.String(), "v") || strings.HasPrefix(reported, strings.TrimPrefix(Runtime.String(), "v")+"+"),
		"containerd under %s reports version %q, want %s", ContainerdDir, fields[2], Runtime)

	nri, err := runtimeNRIVersion(bin)
	require.NoError(t, err)

	env := NewGuardEnv(t, GuardOptions{})
	log, err := os.ReadFile(env.G.LogPath)
	require.NoError(t, err)
	warned := false
	for _, line := range strings.Split(string(log), "\n") {
		if strings.Contains(line, stubVersionWarning) {
			warned = true
			t.Logf("the guard's NRI stub warned: %s", line)
		}
	}
	t.Logf("runtime under test: containerd %s, NRI %s, config version %d, stub version warning: %t, cgroup %s",
		Runtime, nri, configVersion(Runtime), warned, cgroupMode())
}

// cgroup2SuperMagic is statfs's f_type of a cgroup2 mount (linux/magic.h).
const cgroup2SuperMagic = 0x63677270

// cgroupMode is "v2" when /sys/fs/cgroup is a cgroup2 mount (a cgroup v2
// host, or the suite run through cgroup2.sh), else "v1" (v1 or hybrid).
func cgroupMode() string {
	var st syscall.Statfs_t
	if err := syscall.Statfs("/sys/fs/cgroup", &st); err == nil && st.Type == cgroup2SuperMagic {
		return "v2"
	}
	return "v1"
}
