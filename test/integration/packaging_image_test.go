// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build integration

package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const (
	// k8sDropInPath is the second containerd drop-in of a Kubernetes node:
	// it names the pod annotation that lets the guard's own pod start while
	// the guard is absent.
	k8sDropInPath = "packaging/containerd/nri-gpu-guard-kubernetes.toml"
	// tolerateMissingAnnotation is that annotation, at pod scope, as the
	// DaemonSet's pod template carries it.
	tolerateMissingAnnotation = "tolerate-missing-plugins.noderesource.dev/pod"
	// imageTag names the image this test builds; it only ever lives in the
	// test's own containerd.
	imageTag = "e2e"
	// imageBuildTimeout bounds packaging/build-image.sh (it compiles the
	// image writer on a cold cache).
	imageBuildTimeout = 5 * time.Minute
)

// buildPackagedImage runs packaging/build-image.sh on the binaries under
// test and returns the archive and the image reference it printed.
func buildPackagedImage(t *testing.T) (tarPath, ref string) {
	t.Helper()
	tarPath = filepath.Join(t.TempDir(), "nri-gpu-guard-image.tar")
	ctx, cancel := context.WithTimeout(context.Background(), imageBuildTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(RepoRoot, "packaging", "build-image.sh"))
	cmd.Dir = RepoRoot
	cmd.Env = append(os.Environ(), "BIN_DIR="+filepath.Dir(GuardBin), "OUT="+tarPath, "IMAGE_TAG="+imageTag)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "packaging/build-image.sh: %s", stderr.String())
	ref = strings.TrimSpace(string(out))
	require.Equal(t, "docker.io/nri-gpu-guard/nri-gpu-guard:"+imageTag, ref, "the reference build-image.sh printed")
	return tarPath, ref
}

// TestPackagedImage: the image packaging/build-image.sh assembles from the
// built (cgo-linked) binaries imports into containerd and runs there without
// any base layer; and, deployed the way packaging/kubernetes/ deploys it (a
// pod with the toleration annotation, on a node with both shipped drop-ins),
// the containerized guard starts while containerd refuses everything else,
// registers over the NRI socket, and then guards GPUs.
//
// The shipped drop-ins turn on NRI's default validator (and are in the
// version 3 config format), so release lines before 2.2 cannot run this.
func TestPackagedImage(t *testing.T) {
	RequireCapability(t, CapDefaultValidator)
	tarPath, ref := buildPackagedImage(t)
	c := StartContainerd(t, ContainerdOptions{Imports: []string{
		filepath.Join(RepoRoot, dropInPath), filepath.Join(RepoRoot, k8sDropInPath),
	}})
	require.NoError(t, c.ImportImage(tarPath), "ctr images import")

	// The binaries run from the image (their C library and loader came
	// along) and are the ones under test.
	hostVersion, err := exec.Command(GuardBin, "--version").Output()
	require.NoError(t, err)
	out, err := c.Ctr("run", "--rm", ref, "pkg-version", "/usr/bin/nri-gpu-guard", "--version")
	require.NoError(t, err, "nri-gpu-guard --version in the image")
	assert.Equal(t, strings.TrimSpace(string(hostVersion)), strings.TrimSpace(out))
	out, err = c.Ctr("run", "--rm", ref, "pkg-check-config", "/usr/bin/gpu-guard-ctl", "check-config")
	require.NoError(t, err, "gpu-guard-ctl check-config of the config baked into the image")
	assert.Contains(t, out, "/etc/nri-gpu-guard/config.toml")

	// Fail closed: with the guard absent, an ordinary container is refused.
	work := c.RunPod(t, PodSpec{Name: "workload"})
	msg := work.Refused(t, ContainerSpec{Name: "early"})
	assert.Contains(t, msg, guardPluginName, "refused because the guard is absent")

	// The guard as the DaemonSet runs it: the image's entrypoint with only
	// --config, the pod annotated to tolerate the missing guard, host pid
	// namespace, the NRI socket, the ledger and the config mounted in, the
	// host cgroup hierarchy read-only.
	g, err := newGuard(c, GuardOptions{}, false)
	require.NoError(t, err)
	guardPod := c.RunPod(t, PodSpec{
		Name:        "nri-gpu-guard",
		Namespace:   "nri-gpu-guard",
		Annotations: map[string]string{tolerateMissingAnnotation: "true"},
		HostPID:     true,
	})
	guardID := guardPod.Run(t, ContainerSpec{
		Name:  "nri-gpu-guard",
		Image: ref,
		Args:  []string{"--config", g.ConfigPath},
		Mounts: []Mount{
			{ContainerPath: g.Dir, HostPath: g.Dir},
			{ContainerPath: c.NRISocket, HostPath: c.NRISocket},
			{ContainerPath: "/sys/fs/cgroup", HostPath: "/sys/fs/cgroup", Readonly: true},
		},
	})
	t.Cleanup(func() {
		if t.Failed() {
			logs, err := c.Crictl("logs", guardID)
			t.Logf("containerized guard's log (%v):\n%s", err, logs)
		}
	})
	waitFor(t, startTimeout, "the containerized guard to be ready", func() (bool, string) {
		if st := c.ContainerState(t, guardID); st != "CONTAINER_RUNNING" {
			t.Fatalf("the guard's container is %s", st)
		}
		return g.Ready(), "not ready"
	})

	// Registered: containers are admitted again, and GPUs are guarded.
	holder := work.Run(t, ContainerSpec{Name: "holder", Env: GPUEnv("0")})
	g.WaitHolder(t, 0, holder)
	msg = work.Refused(t, ContainerSpec{Name: "intruder", Env: GPUEnv(c.GPUs[0].UUID)})
	assert.Contains(t, msg, c.GPUs[0].UUID, "the refusal names the busy GPU")
	assert.Contains(t, msg, work.Owner("holder"), "and its holder")
	assert.Equal(t, "CONTAINER_RUNNING", c.ContainerState(t, guardID), fmt.Sprintf("the guard (%s) kept running", guardID))
}
