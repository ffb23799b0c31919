// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// BenchmarkReadInput times what a hook does with its input before it
// decides, for a container that names no GPU under a rootful runtime, with
// the mounts podman gives every container (binds of files in its run dir,
// and of its shm directory),
// its root filesystem (an overlay's merged dir, stat'ed and statfs'ed:
// boundRoot; here on storage not mounted nodev, as podman's default is, so
// its cgroup is read, from a /proc tree of files here, as for CAP_MKNOD)
// and an engine's default capabilities: podman's and CRI-O's (no
// CAP_MKNOD) and docker's and containerd's (CAP_MKNOD). In-process, warm:
// the syscalls the input costs, not the process start
// (BenchmarkHookProcess).
func BenchmarkReadInput(b *testing.B) {
	podman := []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_NET_BIND_SERVICE",
		"CAP_SETFCAP", "CAP_SETGID", "CAP_SETPCAP", "CAP_SETUID", "CAP_SYS_CHROOT"}
	docker := append([]string{"CAP_AUDIT_WRITE", "CAP_MKNOD", "CAP_NET_RAW"}, podman...)
	for _, bc := range []struct {
		name string
		caps []string
	}{{"podman-caps", podman}, {"docker-caps", docker}} {
		b.Run(bc.name, func(b *testing.B) {
			dir := b.TempDir()
			proc := filepath.Join(dir, "proc")
			for pid, cg := range map[string]string{"4242": "0::/machine.slice/libpod-bench.scope\n", "4000": "0::/machine.slice/libpod-conmon-bench.scope\n"} {
				if err := os.MkdirAll(filepath.Join(proc, pid), 0o755); err != nil {
					b.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(proc, pid, "cgroup"), []byte(cg), 0o644); err != nil {
					b.Fatal(err)
				}
			}
			run := filepath.Join(dir, "userdata")
			mounts := []specs.Mount{{Destination: "/proc", Type: "proc", Source: "proc"},
				{Destination: "/dev", Type: "tmpfs", Source: "tmpfs"}, {Destination: "/sys", Type: "sysfs", Source: "sysfs"}}
			for _, f := range []string{"hosts", "resolv.conf", "hostname", ".containerenv", "run/secrets"} {
				src := filepath.Join(run, f)
				if err := os.MkdirAll(filepath.Dir(src), 0o755); err != nil {
					b.Fatal(err)
				}
				if err := os.WriteFile(src, nil, 0o644); err != nil {
					b.Fatal(err)
				}
				mounts = append(mounts, specs.Mount{Destination: "/etc/" + f, Type: "bind", Source: src, Options: []string{"rbind"}})
			}
			// podman's /dev/shm: a directory bound in, whose cgroup is read
			// before anything below it.
			shm := filepath.Join(run, "shm")
			if err := os.Mkdir(shm, 0o755); err != nil {
				b.Fatal(err)
			}
			mounts = append(mounts, specs.Mount{Destination: "/dev/shm", Type: "bind", Source: shm, Options: []string{"bind", "nosuid", "noexec", "nodev"}})
			merged := filepath.Join(dir, "overlay", "merged")
			if err := os.MkdirAll(filepath.Join(merged, "dev"), 0o755); err != nil {
				b.Fatal(err)
			}
			spec, err := json.Marshal(specs.Spec{Version: specs.Version, Root: &specs.Root{Path: merged},
				Process: &specs.Process{Args: []string{"/app"}, Env: []string{"PATH=/usr/bin:/bin", "TERM=xterm"},
					Capabilities: &specs.LinuxCapabilities{Bounding: bc.caps, Effective: bc.caps, Permitted: bc.caps}},
				Mounts: mounts,
				Linux: &specs.Linux{CgroupsPath: "machine.slice:libpod:bench",
					Namespaces: []specs.LinuxNamespace{{Type: "pid"}, {Type: "network"}, {Type: "ipc"}, {Type: "uts"}, {Type: "mount"}}}})
			if err != nil {
				b.Fatal(err)
			}
			bundle := filepath.Join(dir, "bundle")
			if err := os.MkdirAll(bundle, 0o755); err != nil {
				b.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(bundle, "config.json"), spec, 0o600); err != nil {
				b.Fatal(err)
			}
			st, err := json.Marshal(specs.State{Version: specs.Version, ID: "bench", Status: specs.StateCreating, Pid: 4242, Bundle: bundle})
			if err != nil {
				b.Fatal(err)
			}
			e := defaultEnv()
			e.procRoot = proc
			e.getppid = func() int { return 4000 }
			e.userNS = func() RuntimeUserNS { return Rootful }
			b.ResetTimer()
			for b.Loop() {
				in := e.readInput(strings.NewReader(string(st)))
				if in.specErr != nil || !in.NeverClaims() {
					b.Fatalf("want a container that reaches no GPU: %v", in.specErr)
				}
			}
		})
	}
}
