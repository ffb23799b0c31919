// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build podman

package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// The podman suite (build tag "podman", `make integration-podman`): real
// podman 4 with conmon, runc and crun, the guard's OCI hooks installed from a
// hooks directory as docs/hook.md says, fake GPUs (a static inventory and
// mknod'ed /dev/nvidiaN nodes). Every podman runs with private state (root,
// runroot, tmpdir, cgroupfs, file events, a CONTAINERS_CONF with ulimits the
// sandbox allows, no network and the hooks directory).

const (
	podmanImage = "localhost/gpu-guard-test/sleeper:1"
	// podmanCmdTimeout bounds every podman and gpu-guard-ctl call.
	podmanCmdTimeout = 90 * time.Second
	// podmanWait bounds waiting for an effect (a claim, a start).
	podmanWait = 60 * time.Second
	fakeGPUs   = 4
)

var (
	podmanRepo  string
	podmanGuard string
	podmanHook  string
	podmanRelay string
	podmanCtl   string
	podmanTar   string
)

func TestMain(m *testing.M) {
	code, err := podmanMain(m)
	if err != nil {
		fmt.Fprintf(os.Stderr, "podman suite: %v\n", err)
		os.Exit(1)
	}
	os.Exit(code)
}

func podmanMain(m *testing.M) (int, error) {
	if os.Geteuid() != 0 {
		return 0, errors.New("the podman suite runs containers as root: run it as root (make integration-podman)")
	}
	wd, err := os.Getwd()
	if err != nil {
		return 0, err
	}
	podmanRepo = filepath.Clean(filepath.Join(wd, "..", ".."))
	podmanGuard = filepath.Join(podmanRepo, "bin", "nri-gpu-guard")
	podmanHook = filepath.Join(podmanRepo, "bin", "nri-gpu-guard-hook")
	podmanRelay = filepath.Join(podmanRepo, "bin", "nri-gpu-guard-hook-relay")
	podmanCtl = filepath.Join(podmanRepo, "bin", "gpu-guard-ctl")
	cache := os.Getenv("NRI_GPU_GUARD_CACHE")
	if cache == "" {
		home, _ := os.UserHomeDir()
		cache = filepath.Join(home, ".cache", "nri-gpu-guard")
	}
	podmanTar = filepath.Join(cache, "images", "gpu-guard-podman.tar")
	var missing []string
	for _, p := range []string{podmanGuard, podmanHook, podmanRelay, podmanCtl, podmanTar} {
		if _, err := os.Stat(p); err != nil {
			missing = append(missing, p)
		}
	}
	for _, b := range []string{"podman", "conmon", "runc", "crun", "nsenter", "unshare"} {
		if _, err := exec.LookPath(b); err != nil {
			missing = append(missing, b+" (on PATH)")
		}
	}
	if len(missing) > 0 {
		return 0, fmt.Errorf("missing %s: run `make build` and ./test/integration/setup-podman.sh (or `make integration-podman`)", strings.Join(missing, ", "))
	}
	return m.Run(), nil
}

// podmanRig is one podman installation with the guard's hooks, for one OCI
// runtime.
type podmanRig struct {
	t         *testing.T
	runtime   string
	base      string
	ledgerDir string
	cfgPath   string
	hooksDir  string
	// wrapper is a `podman` script with the private flags (and, for crun,
	// run inside the mount namespace crun needs): what the tests and
	// gpu-guard-ctl run call.
	wrapper string
	// nsFile keeps crun's mount namespace, bound below nsDir, a bind
	// mount of itself made private (both empty for runc).
	nsFile string
	nsDir  string
	gpu    []string // UUIDs, by index
	// relaySock is set in relay mode (TestPodmanRelay): the hooks.d
	// definitions name nri-gpu-guard-hook-relay, which forwards each hook
	// run to server, `nri-gpu-guard-hook serve` on relaySock, and execs
	// relayHook when that server cannot answer.
	relaySock string
	relayHook string
	server    *hookServer
	serverLog serverLog
	// top is the test the rig was made for (r.t is the scenario's).
	top *testing.T
}

// newPodmanRig makes a rig for runtime; with relay, its hooks go through
// the relay and a hook server that runs for the rig's life (see relaySock).
func newPodmanRig(t *testing.T, runtime string, relay bool) *podmanRig {
	t.Helper()
	base, err := os.MkdirTemp("", "ggp-")
	require.NoError(t, err)
	r := &podmanRig{t: t, top: t, runtime: runtime, base: base, ledgerDir: filepath.Join(base, "ledger"), hooksDir: filepath.Join(base, "hooks")}
	if relay {
		r.relaySock = filepath.Join(base, "hook.sock")
		r.relayHook = podmanHook
	}
	for _, d := range []string{"root", "runroot", "tmp", "hooks", "hooks-wait", "bin"} {
		require.NoError(t, os.MkdirAll(filepath.Join(base, d), 0o755))
	}
	require.NoError(t, os.MkdirAll(r.ledgerDir, 0o700))
	// Before r.cleanup: cleanups run last-in first-out, so the nodes go
	// after the containers that may use them.
	makeFakeGPUNodes(t)
	t.Cleanup(r.cleanup)

	var cfg strings.Builder
	// proc_root names a dir without a driver tree: the fake GPUs are
	// compared with no real driver's (on a GPU host they would differ).
	fmt.Fprintf(&cfg, "version = 1\n[ledger]\ndir = %q\n[devices]\nsource = \"static\"\nproc_root = %q\n", r.ledgerDir, t.TempDir())
	for i := range fakeGPUs {
		u := fmt.Sprintf("GPU-6c1a2f2e-0000-4000-8000-%012d", i)
		r.gpu = append(r.gpu, u)
		fmt.Fprintf(&cfg, "[[devices.static]]\nindex = %d\nuuid = %q\nminor = %d\nmodel = \"Fake GPU\"\n", i, u, i)
	}
	fmt.Fprintf(&cfg, "[hook]\npoll_interval = \"50ms\"\n")
	r.cfgPath = filepath.Join(base, "config.toml")
	require.NoError(t, os.WriteFile(r.cfgPath, []byte(cfg.String()), 0o600))

	r.writeHooks(t)
	// The hooks directory goes in containers.conf's [engine] hooks_dir, as
	// docs/hook.md recommends, not in --hooks-dir: podman does not pass the
	// flag on to the `podman container cleanup` that conmon runs when the
	// container exits (containers/podman#17935), and that command builds
	// the spec of a container its restart policy restarts; CONTAINERS_CONF
	// reaches it through conmon's environment. containers-wait.conf names
	// hooks-wait instead (podmanAbandoned picks it with GG_CONTAINERS_CONF).
	for _, c := range []struct{ file, hooks string }{{"containers.conf", "hooks"}, {"containers-wait.conf", "hooks-wait"}} {
		doc := fmt.Sprintf("[containers]\ndefault_ulimits = [\"nofile=1024:1024\", \"nproc=4096:4096\"]\nnetns = \"none\"\n"+
			"[engine]\nhooks_dir = [%q]\n", filepath.Join(base, c.hooks))
		require.NoError(t, os.WriteFile(filepath.Join(base, c.file), []byte(doc), 0o644))
	}

	prefix := ""
	if runtime == "crun" {
		// crun 1.8 refuses a host with cgroup v1 and a cgroup2 hierarchy
		// at /sys/fs/cgroup/unified ("hybrid"): podman runs in a mount
		// namespace without that mount, kept alive by a bind of its file.
		nsDir := filepath.Join(base, "ns")
		require.NoError(t, os.MkdirAll(nsDir, 0o755))
		// Set before the mount: cleanup undoes the bind even when a
		// later step of this setup fails.
		r.nsDir = nsDir
		r.mustRun("mount", "--bind", nsDir, nsDir)
		r.mustRun("mount", "--make-private", nsDir)
		r.nsFile = filepath.Join(nsDir, "mnt")
		require.NoError(t, os.WriteFile(r.nsFile, nil, 0o600))
		r.mustRun("unshare", "--mount="+r.nsFile, "--propagation", "private", "true")
		r.mustRun("nsenter", "--mount="+r.nsFile, "sh", "-c", "! mountpoint -q /sys/fs/cgroup/unified || umount /sys/fs/cgroup/unified")
		prefix = "nsenter --mount=" + r.nsFile + " "
	}
	r.wrapper = filepath.Join(base, "bin", "podman")
	// Container storage is mounted nodev (containers/storage's mountopt),
	// as docs/hook.md asks of a host whose containers may run without a
	// device cgroup: a root filesystem without it counts as reaching every
	// GPU there (a device node its image may carry). GG_STORAGE_OPTS
	// replaces the option ("" for none: podmanImageNodes).
	script := fmt.Sprintf("#!/bin/sh\nexport CONTAINERS_CONF=\"${GG_CONTAINERS_CONF:-%s}\"\nexec %s%s --root %s --runroot %s --tmpdir %s "+
		"${GG_STORAGE_OPTS---storage-opt=overlay.mountopt=nodev} "+
		"--cgroup-manager cgroupfs --events-backend file --runtime %s \"$@\"\n",
		filepath.Join(base, "containers.conf"), prefix, podmanPath(t), filepath.Join(base, "root"), filepath.Join(base, "runroot"), filepath.Join(base, "tmp"),
		runtime)
	require.NoError(t, os.WriteFile(r.wrapper, []byte(script), 0o755))

	if relay {
		// In the mount namespace the runtime runs the hooks in (crun's:
		// above), which the server answers only if it shares.
		r.startServer(t)
	}
	out, err := r.podman("load", "-i", podmanTar)
	require.NoError(t, err, out)
	return r
}

// writeHooks writes the rig's hooks.d definitions, as docs/hook.md installs
// them (with the environment the shipped definitions set); hooks-wait adds
// --wait to create-runtime (a misconfiguration under podman, which the hook
// must survive). In relay mode they name the relay, its options in front of
// the very same hook arguments.
func (r *podmanRig) writeHooks(t *testing.T) {
	t.Helper()
	for _, dir := range []string{"hooks", "hooks-wait"} {
		for _, ph := range []struct{ name, stage string }{
			{"create-runtime", "createRuntime"}, {"poststop", "poststop"},
		} {
			args := []string{ph.name, "--config", r.cfgPath}
			if dir == "hooks-wait" && ph.name == "create-runtime" {
				args = append(args, "--wait")
			}
			path, argv := podmanHook, append([]string{"nri-gpu-guard-hook"}, args...)
			if r.relaySock != "" {
				path = podmanRelay
				argv = append([]string{"nri-gpu-guard-hook-relay", "--relay-socket=" + r.relaySock, "--relay-hook=" + r.relayHook}, args...)
			}
			doc, err := json.Marshal(map[string]any{
				"version": "1.0.0",
				"hook":    map[string]any{"path": path, "args": argv, "env": hook.RuntimeEnv(), "timeout": 30},
				"when":    map[string]any{"always": true},
				"stages":  []string{ph.stage},
			})
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(filepath.Join(r.base, dir, "nri-gpu-guard-"+ph.name+".json"), doc, 0o644))
		}
	}
}

// makeFakeGPUNodes mknods /dev/nvidia0..fakeGPUs-1 where missing: podman
// adds every /dev/nvidia* node of the host to a privileged container, and
// --device needs the node. Only the nodes created here are removed, by the
// test's cleanup (which runs however the test ends, unlike a defer in
// TestMain).
func makeFakeGPUNodes(t *testing.T) {
	t.Helper()
	for i := range fakeGPUs {
		p := "/dev/nvidia" + strconv.Itoa(i)
		if _, err := os.Stat(p); err == nil {
			continue
		}
		require.NoError(t, syscall.Mknod(p, syscall.S_IFCHR|0o666, int(195<<8|i)), "mknod %s", p)
		t.Cleanup(func() {
			if err := os.Remove(p); err != nil {
				t.Errorf("remove the fake GPU node %s: %v", p, err)
			}
		})
	}
}

func podmanPath(t *testing.T) string {
	p, err := exec.LookPath("podman")
	require.NoError(t, err)
	return p
}

func (r *podmanRig) mustRun(name string, args ...string) {
	r.t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	require.NoError(r.t, err, "%s %v: %s", name, args, out)
}

// podman runs the wrapper and returns its combined output.
func (r *podmanRig) podman(args ...string) (string, error) {
	return r.podmanEnv(nil, args...)
}

func (r *podmanRig) podmanEnv(env []string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), podmanCmdTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, r.wrapper, args...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		r.t.Fatalf("podman %v did not return within %s: %s", args, podmanCmdTimeout, out)
	}
	return string(out), err
}

// timed is podman with its duration.
func (r *podmanRig) timed(args ...string) (string, time.Duration, error) {
	start := time.Now()
	out, err := r.podman(args...)
	return out, time.Since(start), err
}

func (r *podmanRig) mustPodman(args ...string) string {
	r.t.Helper()
	out, err := r.podman(args...)
	require.NoError(r.t, err, "podman %v: %s", args, out)
	return strings.TrimSpace(out)
}

// runGPU starts a detached container named name that names GPU env (e.g.
// "1", "all"; "" = none), with extra podman flags.
func (r *podmanRig) runGPU(name, env string, extra ...string) (string, error) {
	args := []string{"run", "-d", "--name", name}
	if env != "" {
		args = append(args, "-e", "NVIDIA_VISIBLE_DEVICES="+env)
	}
	args = append(append(args, extra...), podmanImage)
	return r.podman(args...)
}

func (r *podmanRig) id(name string) string {
	r.t.Helper()
	return r.mustPodman("inspect", "-f", "{{.Id}}", name)
}

func (r *podmanRig) inspect(name, format string) string {
	r.t.Helper()
	return r.mustPodman("inspect", "-f", format, name)
}

func (r *podmanRig) ctl(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), podmanCmdTimeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, podmanCtl, append([]string{"--config", r.cfgPath}, args...)...).CombinedOutput()
	return string(out), err
}

// bgCtl is a `gpu-guard-ctl run` in the background.
type bgCtl struct {
	cmd  *exec.Cmd
	out  *lockedBuffer
	done chan struct{}
	err  error
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// ctlRun starts `gpu-guard-ctl run -- podman run -d --name name -e
// NVIDIA_VISIBLE_DEVICES=gpu IMAGE` in the background.
func (r *podmanRig) ctlRun(name, gpu string) *bgCtl {
	r.t.Helper()
	b := &bgCtl{out: &lockedBuffer{}, done: make(chan struct{})}
	b.cmd = exec.Command(podmanCtl, "--config", r.cfgPath, "run", "--",
		r.wrapper, "run", "-d", "--name", name, "-e", "NVIDIA_VISIBLE_DEVICES="+gpu, podmanImage)
	b.cmd.Stdout, b.cmd.Stderr = b.out, b.out
	require.NoError(r.t, b.cmd.Start())
	go func() {
		b.err = b.cmd.Wait()
		close(b.done)
	}()
	r.t.Cleanup(func() {
		_ = b.cmd.Process.Kill()
		<-b.done
	})
	return b
}

// queued waits until the ledger has n waiters, failing at once with b's
// output if b ended instead.
func (r *podmanRig) queued(b *bgCtl, n int) {
	r.t.Helper()
	r.waitFor(fmt.Sprintf("%d waiter(s)", n), func() bool {
		select {
		case <-b.done:
			r.t.Fatalf("gpu-guard-ctl run ended before it queued (%v): %s", b.err, b.out.String())
		default:
		}
		return len(r.waiterKeys()) == n
	})
}

func (b *bgCtl) wait(t *testing.T) error {
	t.Helper()
	select {
	case <-b.done:
		return b.err
	case <-time.After(podmanWait):
		t.Fatalf("gpu-guard-ctl run did not return within %s: %s", podmanWait, b.out.String())
		return nil
	}
}

func (r *podmanRig) state() ledger.State {
	r.t.Helper()
	l, err := ledger.OpenReadOnly(r.ledgerDir, ledger.Options{})
	require.NoError(r.t, err)
	st, err := l.Snapshot(context.Background())
	require.NoError(r.t, err)
	return st
}

// holders maps GPU index to the holder's container id.
func (r *podmanRig) holders() map[int]string {
	out := map[int]string{}
	for _, c := range r.state().Claims {
		out[slices.Index(r.gpu, c.Device.UUID)] = c.Owner.ContainerID
	}
	return out
}

func (r *podmanRig) waiterKeys() []string {
	st := r.state()
	slices.SortFunc(st.Waiters, func(a, b ledger.Waiter) int { return int(a.Seq) - int(b.Seq) })
	var keys []string
	for _, w := range st.Waiters {
		keys = append(keys, w.Key)
	}
	return keys
}

// waitFor polls cond until it holds or podmanWait passes.
func (r *podmanRig) waitFor(desc string, cond func() bool) {
	r.t.Helper()
	deadline := time.Now().Add(podmanWait)
	for !cond() {
		if time.Now().After(deadline) {
			r.t.Fatalf("timed out after %s waiting for %s; ledger: %+v", podmanWait, desc, r.state())
		}
		time.Sleep(50 * time.Millisecond) // polling a condition, not synchronising on time
	}
}

// reset removes every container and checks the ledger is left empty.
func (r *podmanRig) reset() {
	r.t.Helper()
	r.mustPodman("rm", "-af", "-t", "0")
	r.waitFor("every claim released", func() bool { return len(r.state().Claims) == 0 })
	require.Empty(r.t, r.state().Waiters)
}

func (r *podmanRig) cleanup() {
	_, _ = r.podman("rm", "-af", "-t", "0")
	_, _ = r.podman("rmi", "-af")
	r.stopServer(r.top) // after the poststops of the removal, which it answers
	r.dropRuntimeLeftovers()
	if r.nsFile != "" {
		_ = exec.Command("umount", r.nsFile).Run()
	}
	if r.nsDir != "" {
		_ = exec.Command("umount", r.nsDir).Run()
	}
	_ = exec.Command("umount", "-R", filepath.Join(r.base, "root", "overlay")).Run()
	_ = os.RemoveAll(r.base)
	_, _ = ledger.RemoveMarkersUnder(ledger.DefaultRuntimeDir, r.base)
	_, _ = hook.RemoveMarkersUnder(hook.DefaultMarkerDir, r.base) // containers whose create failed after admission
}

// dropRuntimeLeftovers deletes from the runtimes' state roots what this
// rig's containers left there: in this rig crun cannot remove the cgroup
// it made (see podmanFailedCreateUnderRemove), so podman rm leaves the
// container's state dir behind, and runc keeps that of a container whose
// conmon a scenario killed; a later `gpu-guard-ctl recover` with the
// default runtime_roots on this host would read them as containers. Only
// the dirs whose state names a path below the rig's base go (crun's
// status, runc's state.json).
func (r *podmanRig) dropRuntimeLeftovers() {
	for _, rt := range []struct{ bin, root, state string }{
		{"crun", "/run/crun", "status"},
		{"runc", "/run/runc", "state.json"},
	} {
		entries, err := os.ReadDir(rt.root)
		if err != nil {
			continue
		}
		for _, e := range entries {
			state, err := os.ReadFile(filepath.Join(rt.root, e.Name(), rt.state))
			if err != nil || !strings.Contains(string(state), r.base+"/") {
				continue
			}
			if exec.Command(rt.bin, "--root", rt.root, "delete", "--force", e.Name()).Run() != nil {
				_ = os.RemoveAll(filepath.Join(rt.root, e.Name()))
			}
		}
	}
}

// audit is the ledger's audit log, oldest first.
func (r *podmanRig) audit() []ledger.AuditRecord {
	r.t.Helper()
	l, err := ledger.OpenReadOnly(r.ledgerDir, ledger.Options{})
	require.NoError(r.t, err)
	recs, err := ledger.ReadAudit(l.AuditPath())
	require.NoError(r.t, err)
	return recs
}

// oneHook makes r, for one scenario, a host that runs the createRuntime
// hook alone, as docs/hook.md sets one up: the poststop hooks.d file is
// replaced by the shipped mask (packaging/oci-hooks.d/one-hook: the same
// name, run only for containers annotated io.nri-gpu-guard.poststop=on),
// pointed at the rig's hook binary and configuration, and the configuration
// says [hook] poststop = false (both back at the scenario's end). No poststop
// ends the scenario's claims: defer what oneHook returns, which removes
// every container and releases their claims with gpu-guard-ctl gc, before
// the rig's reset checks that the ledger is empty.
func (r *podmanRig) oneHook(t *testing.T) (end func()) {
	t.Helper()
	cfg, err := os.ReadFile(r.cfgPath)
	require.NoError(t, err)
	require.Equal(t, 1, strings.Count(string(cfg), "[hook]\n"))
	one := strings.Replace(string(cfg), "[hook]\n", "[hook]\npoststop = false\n", 1)
	require.NoError(t, os.WriteFile(r.cfgPath, []byte(one), 0o600))
	t.Cleanup(func() { require.NoError(t, os.WriteFile(r.cfgPath, cfg, 0o600)) })
	poststop := filepath.Join(r.hooksDir, "nri-gpu-guard-poststop.json")
	def, err := os.ReadFile(poststop)
	require.NoError(t, err)
	var rigHook struct {
		Hook map[string]any `json:"hook"`
	}
	require.NoError(t, json.Unmarshal(def, &rigHook))
	maskDoc, err := os.ReadFile(filepath.Join(podmanRepo, "packaging", "oci-hooks.d", "one-hook", "nri-gpu-guard-poststop.json"))
	require.NoError(t, err)
	var mask map[string]any
	require.NoError(t, json.Unmarshal(maskDoc, &mask))
	// The rig's binary (in relay mode the relay, with its options) and
	// --config; the mask's "when".
	require.Equal(t, r.hookPath(), rigHook.Hook["path"], "the rig's poststop definition")
	mask["hook"] = rigHook.Hook
	masked, err := json.Marshal(mask)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(poststop, masked, 0o644))
	t.Cleanup(func() { require.NoError(t, os.WriteFile(poststop, def, 0o644)) })
	return func() {
		if out, err := r.podman("rm", "-af", "-t", "0"); err != nil {
			t.Errorf("podman rm -af: %v: %s", err, out)
		}
		if out, err := r.ctl("gc"); err != nil {
			t.Errorf("gpu-guard-ctl gc: %v: %s", err, out)
		}
		if claims := r.state().Claims; len(claims) != 0 {
			t.Errorf("gc left claims of removed containers: %+v", claims)
		}
	}
}
