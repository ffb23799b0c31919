// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"encoding/csv"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

func (a *app) runCommand() *cobra.Command {
	var (
		gpus    string
		timeout time.Duration
	)
	cmd := newCommand("run [--gpus IDS] [--timeout D] -- COMMAND [ARG...]",
		"Wait for GPUs outside the container engine, then run a command that starts a container on them",
		`Queue for GPUs in the ledger's FIFO queue, wait (with progress on stderr)
until they are claimed for this run, then run COMMAND, typically
"podman run …", and hand the claim over to the container it starts.

The OCI hook decides at once and never waits inside podman or CRI-O (they hold
the container's lock while the hook runs): without this command, a container
whose GPU is busy is refused. With it, the wait happens here, where Ctrl-C
leaves the queue and nothing else freezes.

The claim is handed over through a ticket: the environment variable
`+hook.TicketEnv+` is set for COMMAND, and for "podman run" and "docker run" (also "podman|docker container run")
an "-e `+hook.TicketEnv+`" is added after the subcommand, so that the
container carries it; the guard's create-runtime hook recognises it and moves
the claim to the container. For other commands, pass the variable into the
container yourself. A ticket is used once. "podman create" and "docker
create" (or "container create") are refused: they run no OCI runtime (the hook runs at "start",
after this command has ended and released the claim).

The GPUs are those of --gpus (ids as in NVIDIA_VISIBLE_DEVICES), or else those
the command names with -e/--env NVIDIA_VISIBLE_DEVICES=…, --device
/dev/nvidiaN or docker's --gpus. The container must ask for no GPU beyond them;
those of them it does not ask for are released when it takes the ticket over.

Ctrl-C, SIGTERM, SIGHUP or SIGQUIT while waiting leaves the queue.
While COMMAND runs, each signal reaches it once: SIGTERM is forwarded;
SIGINT, SIGQUIT and SIGHUP are forwarded only when this process is not in the
foreground of a terminal (in the foreground, Ctrl-C reaches COMMAND from the
terminal itself).

When COMMAND exits, whatever the ticket still holds (the command started no
container that took it over) is released, with a note saying why when the
guard's hook refused the container that carried the ticket. The exit code is COMMAND's. If this
process is killed, its queue entry and claim are dropped by the next request
for those GPUs (its process is gone).`,
		`  sudo gpu-guard-ctl run -- podman run --rm -e NVIDIA_VISIBLE_DEVICES=1 cuda-image train.sh
  sudo gpu-guard-ctl run --gpus 0,1 --timeout 30m -- podman run -d --device /dev/nvidia0 --device /dev/nvidia1 img
  sudo gpu-guard-ctl run --gpus 2 -- sh -c 'podman run -e NVIDIA_VISIBLE_DEVICES=2 -e `+hook.TicketEnv+` img'`,
		func(_ *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usagef("no command given: %s run [--gpus IDS] -- COMMAND [ARG...]", programName)
			}
			return nil
		},
		func(cmd *cobra.Command, args []string) error {
			if cmd.ArgsLenAtDash() != 0 {
				return usagef("put the command after --: %s run [--gpus IDS] -- COMMAND [ARG...]", programName)
			}
			return a.runWithTicket(cmd.Context(), gpus, timeout, args)
		})
	fl := cmd.Flags()
	fl.StringVar(&gpus, "gpus", "", "GPUs to wait for, as in NVIDIA_VISIBLE_DEVICES (default: what COMMAND names)")
	fl.DurationVar(&timeout, "timeout", 0, "give up waiting after this long (default: wait until interrupted)")
	return cmd
}

func (a *app) runWithTicket(ctx context.Context, gpus string, timeout time.Duration, args []string) error {
	if timeout < 0 {
		return usagef("--timeout must not be negative, got %s", timeout)
	}
	req, from := commandRequest(args)
	if gpus != "" {
		req, from = devices.Request{Env: []string{"NVIDIA_VISIBLE_DEVICES=" + gpus}}, "--gpus "+gpus
	}
	if i := engineSubcommand(args); i > 0 && args[i] == "create" {
		return usagef("%s create starts no container: the engine runs the OCI runtime, and with it the guard's hook, at %s start, "+
			"after %s run has ended and released the GPUs; use %s run (with -d to detach)", args[0], args[0], programName, args[0])
	}
	if from == "" {
		return usagef("the command names no GPU that %s can see: name them with --gpus (e.g. --gpus 1)", programName)
	}
	if err := a.requireRoot("run"); err != nil {
		return err
	}
	cfg, err := a.config()
	if err != nil {
		return err
	}
	// The checked --state-dir, as every other command takes it: a mistyped
	// one would otherwise open a fresh, empty ledger there and "claim" GPUs
	// that the daemon and the hooks never see.
	dir, err := a.stateDir()
	if err != nil {
		return err
	}
	cfg.Ledger.Dir = dir

	// Ctrl-C while waiting leaves the queue, and so do the other signals
	// that would end this process (a hang-up of the terminal or ssh session,
	// Ctrl-\): killed by one, it would leave its entry queued, and the next
	// freed GPU reserved for a waiter that will never come. Once the command
	// runs, the signals are its to handle (see runChild). The wait's
	// handling stays until the command's is set up, so that no signal in
	// between ends this process the default way; one that arrives then (or
	// while the admitting transaction runs) cancels wctx, and the command
	// is not started.
	wctx, stopWait := NotifyInterrupts(ctx)
	defer stopWait()
	t, err := hook.AcquireTicket(wctx, cfg, req, hook.TicketOptions{Timeout: timeout, Stderr: a.env.Stderr})
	if err != nil {
		return err
	}
	names := make([]string, len(t.Devices))
	for i, d := range t.Devices {
		names[i] = ledger.DescribeDevice(d.Device)
	}
	fmt.Fprintf(a.env.Stderr, "%s: %s claimed for ticket %s (from %s); running %s\n",
		programName, strings.Join(names, ", "), t.ID, from, args[0])

	code, runErr := runChild(wctx, withTicketArg(args), t.ID, a.env)
	rel, relErr := hook.ReleaseTicket(context.WithoutCancel(ctx), cfg, t.ID)
	if len(rel) > 0 {
		left := make([]string, len(rel))
		for i, d := range rel {
			left[i] = ledger.DescribeDevice(d)
		}
		// Why: the guard's hook refused the container that carried the
		// ticket (its refuse record is keyed by the ticket), or no
		// container carrying it reached the hook.
		why := "the command started no container that carried it, or the container's create failed before the guard's hook decided"
		if cause, ok := hook.TicketRefusal(cfg, t.ID); ok {
			why = cause
		}
		fmt.Fprintf(a.env.Stderr, "%s: no container took ticket %s over (%s); released %s\n", programName, t.ID, why, strings.Join(left, ", "))
	}
	switch {
	case runErr != nil:
		return errors.Join(runErr, relErr)
	case relErr != nil:
		return fmt.Errorf("release ticket %s (it is dropped once this process is gone, at the next request for its GPUs): %w", t.ID, relErr)
	case code != 0:
		return &quietExit{code: code, why: fmt.Sprintf("%s exited with status %d", args[0], code)}
	}
	return nil
}

// interruptSignals are the signals that end a waiting or changing command
// cleanly (NotifyInterrupts) instead of killing it: every signal whose
// default action ends the process and that a terminal, a supervisor or an
// operator sends to ask for an end.
var interruptSignals = []os.Signal{os.Interrupt, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT}

// NotifyInterrupts is the real process's Env.Interrupts: ctx canceled by
// SIGINT, SIGTERM, SIGHUP or SIGQUIT. SIGHUP and SIGQUIT count too: a
// `gpu-guard-ctl run` waiting in an ssh session that hangs up, or a
// Ctrl-\, must leave the queue as Ctrl-C does, and a release or gc must
// finish its change rather than die in it.
func NotifyInterrupts(ctx context.Context) (context.Context, context.CancelFunc) {
	return signal.NotifyContext(ctx, caughtInterrupts(signal.Ignored)...)
}

// caughtInterrupts are interruptSignals less those the process started
// with ignored: notifying one would turn it back on (`nohup gpu-guard-ctl
// run …` must go on waiting through a hang-up).
func caughtInterrupts(ignored func(os.Signal) bool) []os.Signal {
	var out []os.Signal
	for _, s := range interruptSignals {
		if !ignored(s) {
			out = append(out, s)
		}
	}
	return out
}

// runChild runs args with the ticket in its environment and returns its exit
// code (128+signal when killed). The command is not tied to a context: the
// signal that would cancel one (this command's own interrupt handling) is the
// command's to handle, not a reason to kill it (SIGKILL would end "podman
// run" while its container went on holding the GPU).
//
// Signals while it runs are handled as system(3) handles them: the command
// is in this process's process group, so that it reads the terminal and gets
// what the terminal sends, and each signal reaches it once (forwardSignal).
// A signal this process started with ignored is left ignored, and so
// reaches neither: caught, it would be reset to its default action in the
// command by exec, and forwarded to it (`nohup gpu-guard-ctl run -- CMD`
// must not let a hang-up end CMD).
//
// ctx done once this handling is set up (a signal that came before, while
// the caller's own handling caught it) means the command is not started:
// an error wrapping ctx's cause.
func runChild(ctx context.Context, args []string, ticket string, env Env) (int, error) {
	c := exec.Command(args[0], args[1:]...) //nolint:gosec // running the operator's command is the point
	c.Env = append(os.Environ(), hook.TicketEnv+"="+ticket)
	c.Stdin, c.Stdout, c.Stderr = os.Stdin, env.Stdout, env.Stderr
	sigs := make(chan os.Signal, 4)
	ignored := env.Ignored
	if ignored == nil {
		ignored = signal.Ignored
	}
	signal.Notify(sigs, caughtInterrupts(ignored)...)
	defer signal.Stop(sigs)
	if ctx.Err() != nil {
		return 0, fmt.Errorf("interrupted as the GPUs were claimed, %s not run: %w", args[0], context.Cause(ctx))
	}
	if err := c.Start(); err != nil {
		return 0, fmt.Errorf("run %s: %w", args[0], err)
	}
	done := make(chan struct{})
	go func() {
		for {
			select {
			case s := <-sigs:
				if forwardSignal(s, inTerminalForeground()) {
					_ = c.Process.Signal(s)
				}
			case <-done:
				return
			}
		}
	}()
	err := c.Wait()
	close(done)
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return 128 + int(ws.Signal()), nil
		}
		return ee.ExitCode(), nil
	}
	if err != nil {
		return 0, fmt.Errorf("run %s: %w", args[0], err)
	}
	return 0, nil
}

// forwardSignal decides whether s, received while the command runs, is
// passed on to it. SIGTERM is: nothing sends it to a whole process group but
// kill(1) asked to, and supervisors send it to this process alone
// (systemd's stop under KillMode=mixed, `kill PID`). SIGINT, SIGQUIT and
// SIGHUP are what a terminal sends to its whole foreground process group
// (Ctrl-C, Ctrl-\, hang-up), the command included: when this process is in
// the foreground group of its controlling terminal (foreground), the
// command got its own copy and a forwarded one would be a second
// (`podman run` passes both into the container, and a second Ctrl-C often
// means "force quit"), so they are not forwarded. Elsewhere (no terminal:
// systemd, cron, CI; a background job) they can only have been sent to
// this process (`kill -INT PID`) and are forwarded.
//
// What this cannot tell (Go gives a handler no sender): `kill -INT PID`
// aimed at this process while it is in a terminal's foreground is not
// forwarded (send SIGTERM, or signal the group: `kill -INT -PGID`), and a
// signal sent to the whole group while it is not in a terminal's
// foreground reaches the command twice (under systemd, KillMode=mixed
// sends the stop signal to this process alone).
func forwardSignal(s os.Signal, foreground bool) bool {
	if s == syscall.SIGTERM {
		return true
	}
	return !foreground
}

// inTerminalForeground reports whether this process is in the foreground
// process group of its controlling terminal (false when it has none).
func inTerminalForeground() bool {
	fd, err := unix.Open("/dev/tty", unix.O_RDONLY|unix.O_NOCTTY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return false // no controlling terminal
	}
	defer func() { _ = unix.Close(fd) }()
	pgrp, err := unix.IoctlGetInt(fd, unix.TIOCGPGRP)
	return err == nil && pgrp == unix.Getpgrp()
}

// engineSubcommand finds the "run" or "create" subcommand of a podman or
// docker command line ("podman run", or the management command's long form
// "podman container run") and returns its index, or -1.
func engineSubcommand(args []string) int {
	if len(args) < 2 {
		return -1
	}
	switch filepath.Base(args[0]) {
	case "podman", "docker":
	default:
		return -1
	}
	container := false // "container" seen: run/create must follow
	for i := 1; i < len(args); i++ {
		switch a := args[i]; {
		case a == "run" || a == "create":
			return i
		case a == "container" && !container:
			// "podman container run" is "podman run" (and so for docker,
			// and for create): the same flags follow.
			container = true
		case a == "--":
			return -1
		case strings.HasPrefix(a, "-") && !container:
			if !strings.Contains(a, "=") && globalTakesValue(a) {
				i++
			}
		default:
			return -1 // another subcommand (start, container run, …)
		}
	}
	return -1
}

// globalTakesValue: the global flags of podman and docker that take a value
// in the next argument (the ones a GPU user passes before "run").
func globalTakesValue(flag string) bool {
	switch flag {
	case "--root", "--runroot", "--tmpdir", "--hooks-dir", "--cgroup-manager", "--events-backend", "--runtime",
		"--log-level", "--storage-driver", "--storage-opt", "--network-cmd-path", "--conmon", "--url", "--connection",
		"--identity", "--volumepath", "--cni-config-dir", "--network-config-dir", "--imagestore", "--module",
		"--config", "-c", "--context", "-H", "--host", "-l", "--tlscacert", "--tlscert", "--tlskey":
		return true
	}
	return false
}

// withTicketArg adds "-e TICKET_ENV" after the run/create subcommand of a
// podman or docker command line (the value comes from the environment).
func withTicketArg(args []string) []string {
	i := engineSubcommand(args)
	if i < 0 {
		return args
	}
	out := make([]string, 0, len(args)+2)
	out = append(out, args[:i+1]...)
	out = append(out, "-e", hook.TicketEnv)
	return append(out, args[i+1:]...)
}

// commandRequest reads the GPUs a podman/docker run|create command line
// names: -e/--env NVIDIA_VISIBLE_DEVICES=…, --device /dev/nvidiaN[:…] and
// docker's --gpus. from describes them ("" = none found).
func commandRequest(args []string) (req devices.Request, from string) {
	i := engineSubcommand(args)
	if i < 0 {
		return req, ""
	}
	var found []string
	value := func(j int, a, long, short string) (string, int, bool) {
		switch {
		case a == long || (short != "" && a == short):
			if j+1 < len(args) {
				return args[j+1], j + 1, true
			}
		case strings.HasPrefix(a, long+"="):
			return a[len(long)+1:], j, true
		case short != "" && strings.HasPrefix(a, short) && len(a) > len(short):
			return strings.TrimPrefix(a[len(short):], "="), j, true
		}
		return "", j, false
	}
	for j := i + 1; j < len(args); j++ {
		a := args[j]
		if !strings.HasPrefix(a, "-") {
			break // the image: what follows is the container's command
		}
		if v, nj, ok := value(j, a, "--env", "-e"); ok {
			j = nj
			if strings.HasPrefix(v, "NVIDIA_VISIBLE_DEVICES=") {
				req.Env = append(req.Env, v)
				found = append(found, "-e "+v)
			}
			continue
		}
		if v, nj, ok := value(j, a, "--device", ""); ok {
			j = nj
			host, _, _ := strings.Cut(v, ":")
			if n, ok := strings.CutPrefix(host, "/dev/nvidia"); ok {
				if minor, err := strconv.Atoi(n); err == nil {
					req.Devices = append(req.Devices, devices.LinuxDevice{Path: host, Type: "c", Major: 195, Minor: int64(minor)})
					found = append(found, "--device "+host)
				}
			}
			continue
		}
		if v, nj, ok := value(j, a, "--gpus", ""); ok {
			j = nj
			if ids := dockerGPUs(v); ids != "" {
				req.Env = append(req.Env, "NVIDIA_VISIBLE_DEVICES="+ids)
				found = append(found, "--gpus "+v)
			}
			continue
		}
		if !strings.Contains(a, "=") && runTakesValue[a] {
			j++ // its value
		}
	}
	return req, strings.Join(found, " ")
}

// dockerGPUs turns docker's --gpus value into NVIDIA_VISIBLE_DEVICES ids
// ("" = none). The value is what docker reads: comma-separated fields (CSV,
// so that '"device=0,1",capabilities=utility' keeps its ids together), each
// a count ("all" or N: GPUs 0..N-1, as docker picks them), count=N,
// device=ID[,ID], or a key that names no GPU (capabilities=, driver=,
// options=), in any order. Unquoted, "device=1,2" arrives as the fields
// "device=1" and "2": a bare field after device= is read as one more id.
// (Docker itself refuses that, a count and ids both given; the ids meant
// are read here, and a container that does not start releases them.) A
// bare word that is no count ("utility" of an unquoted capability list)
// names no GPU. Device ids win over a count.
func dockerGPUs(v string) string {
	r := csv.NewReader(strings.NewReader(strings.TrimSpace(v)))
	r.TrimLeadingSpace = true
	fields, err := r.Read()
	if err != nil {
		return "" // not docker syntax: docker refuses it too
	}
	var (
		ids     []string
		count   string
		last    string // the key of the last key=value field
		invalid bool   // a field docker refuses
	)
	for _, f := range fields {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		key, val, ok := strings.Cut(f, "=")
		if !ok {
			_, numErr := strconv.Atoi(f)
			switch {
			case last == "device" && f != "all":
				ids = append(ids, f)
			case f == "all" || numErr == nil:
				count = f // docker's count
			default:
				// A capability or option after an unquoted comma
				// (docker refuses it as a count; no GPU named).
				invalid = true
			}
			continue
		}
		last = key
		switch key {
		case "device":
			for _, id := range strings.Split(val, ",") {
				if id = strings.TrimSpace(id); id != "" {
					ids = append(ids, id)
				}
			}
		case "count":
			count = val
		}
	}
	if len(ids) > 0 {
		return strings.Join(ids, ",")
	}
	if invalid {
		return ""
	}
	if count == "" {
		// Neither a count nor device ids (`--gpus capabilities=compute`,
		// `--gpus driver=nvidia`): docker asks for one GPU, the first.
		count = "1"
	}
	if count == "all" {
		return "all"
	}
	n, err := strconv.Atoi(count)
	if err != nil || n <= 0 {
		return ""
	}
	out := make([]string, n)
	for i := range out {
		out[i] = strconv.Itoa(i)
	}
	return strings.Join(out, ",")
}

// runTakesValue: the flags of podman and docker run|create that take a value
// in the next argument (the scan stops at the first other word: the image).
var runTakesValue = func() map[string]bool {
	m := map[string]bool{}
	for _, f := range strings.Fields(`--name --entrypoint -v --volume --mount -p --publish -w --workdir -u --user
		--network --net -h --hostname -l --label --annotation --cpus --cpu-shares -c --cpuset-cpus --memory -m
		--memory-swap --shm-size --restart --runtime --security-opt --cap-add --cap-drop --ulimit --pull --platform
		--arch --os --log-driver --log-opt --pod --cgroup-parent --cgroupns --cgroups --ipc --pid --uts --userns
		--tmpfs --env-file --label-file --stop-signal --stop-timeout --health-cmd --health-interval --health-retries
		--health-timeout --health-start-period --add-host --dns --dns-search --dns-option --mac-address --ip --ip6
		--expose --group-add --hooks-dir --init-path --pidfile --secret --sysctl --timeout --tz --umask
		--variant --volumes-from --device-cgroup-rule --blkio-weight --oom-score-adj --pids-limit --attach -a
		--detach-keys --cidfile --conmon-pidfile --log-level --isolation --storage-opt --runtime-flag --chrootdirs
		--image-volume --requires --seccomp-policy --sdnotify --systemd --rootfs --preserve-fds --passwd-entry
		--cpu-period --cpu-quota --cpu-rt-period --cpu-rt-runtime --cpuset-mems --kernel-memory --memory-reservation
		--memory-swappiness --link --network-alias --gpus --env -e --device`) {
		m[f] = true
	}
	return m
}()
