// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hook

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/nri-gpu-guard/nri-gpu-guard/internal/phasetrace"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
)

// Phase names accepted by Run: the words after "nri-gpu-guard hook".
const (
	PhaseCreateRuntime = "create-runtime"
	PhasePoststop      = "poststop"
)

// RuntimeEnv is the environment the shipped hook definitions give the hook
// process (packaging/oci-hooks.d, docs/hook.md); a runtime runs a hook with
// exactly the environment its definition lists. GOMAXPROCS=1: a hook is one
// short, sequential process, and without it the Go runtime sets up one
// scheduler slot per CPU before the program starts and wakes idle threads to
// look for work while it runs. On a GPU node with 128 CPUs that is most of
// what a hook for a container without GPU costs (docs/benchmarks.md), twice
// per container. Nothing else is needed from the environment: the
// configuration path goes in the arguments (--config).
func RuntimeEnv() []string { return []string{"GOMAXPROCS=1"} }

// ErrUsage is wrapped by RunInput for an unknown phase.
var ErrUsage = errors.New("usage: nri-gpu-guard hook create-runtime|poststop [--config PATH]")

// RunInput executes one hook phase for the runtime's input, already read
// (ReadInput): a hook binary reads it first (Main), so that a container that
// can reach no GPU (Input.NeverClaims) is answered before the configuration
// is loaded.
//
// create-runtime admits the container through the guard. By default it
// decides at once: admit, or refuse with who holds the GPU and how many wait
// for it (an engine such as podman holds the container's lock for the whole
// create, so a hook that waits freezes it). With opts.Wait it waits in the
// ledger's FIFO queue while its GPUs are held (up to hook.wait_timeout, with
// progress lines on stderr), unless the engine that ran it is one that holds
// such a lock. A container started by `gpu-guard-ctl run` carries a ticket:
// the GPUs claimed for the ticket are handed over to it. poststop releases
// what the container holds.
//
// RunInput installs its own SIGTERM/SIGINT handling where the hook may block
// (see interrupts): a signal cancels a waiting hook, which then leaves the
// queue and fails. It never panics. A non-nil error is self-contained (it
// names the container, the devices and what to do): the caller prints it on
// one line and exits non-zero, which makes the runtime refuse the container
// (or, for poststop, log a warning).
func RunInput(ctx context.Context, phase string, opts Options, cfg config.Config, in *Input, stderr io.Writer) error {
	return defaultEnv().runWith(ctx, phase, opts, cfg, in, stderr, true)
}

// runWith is RunInput through e, with the signal handling where signals is
// set: only a hook that is its own process may set it up. A server answering
// for many hook processes at once (MainAs) must not: a signal is the
// server's, not one request's, and ctx is each request's cancellation.
func (e env) runWith(ctx context.Context, phase string, opts Options, cfg config.Config, in *Input, stderr io.Writer, signals bool) error {
	if opts.Started.IsZero() {
		opts.Started = time.Now()
	}
	e.opts = opts
	if signals {
		// The signal is the context's cause ("terminated signal received"),
		// which the error of a cancelled waiter quotes. Armed only where the
		// hook is about to block.
		var irq *interrupts
		ctx, irq = newInterrupts(ctx)
		defer irq.stop()
		e.beforeWait = irq.arm
		e.openGuard = func(cfg config.Config, inv *devices.Inventory) (guardAPI, func(), error) {
			return openGuardWith(cfg, inv, irq.arm)
		}
	}
	return e.runInput(ctx, phase, cfg, in, stderr)
}

// guardAPI is what the hook needs from *guard.Guard.
type guardAPI interface {
	admitter
	AdmitIfFree(ctx context.Context, r guard.Request) (guard.Decision, error)
	Resolve(spec devices.Request) (devices.Resolution, error)
	RemovedExited(ctx context.Context, o ledger.Owner, runs func(ledger.Owner) bool) ([]ledger.Claim, error)
	WithdrawExited(ctx context.Context, key, reason string, runs func(ledger.Owner) bool) (bool, error)
	CordonRefusal(tx *ledger.Tx, key string, res []devices.Resolved, cordoned []ledger.CordonedDevice) guard.Decision
	Ledger() *ledger.Ledger
}

// env holds what Run takes from the host, so tests can substitute it.
type env struct {
	now       func() time.Time
	newTicker func(time.Duration) ticker
	newTimer  func(time.Duration) timer
	procRoot  string
	// getppid is the hook's parent: the runtime that runs it. A change means
	// the runtime died and nobody waits for this hook's answer.
	getppid func() int
	// openGuard opens the ledger and builds the guard over inv.
	openGuard func(cfg config.Config, inv *devices.Inventory) (guardAPI, func(), error)
	// opts are the hook's command-line options.
	opts Options
	// processStart, where set, is this process's start read from /proc
	// (fallback where it cannot be read, or is later): a hook binary's
	// own clock starts at its main, later than the process the runtime
	// started and times where the relay exec'd it after trying the server
	// (up to its acknowledgement timeout, or a stopping server's grace).
	// Asked only for a hook that has a timeout (deadlines). Unset for
	// MainAs, whose Options.Started is the relay's start already.
	processStart func(fallback time.Time) time.Time
	// beforeWait, if set, is called before the hook waits in the queue (it
	// arms the interrupt handling; openGuard's guard calls it before waiting
	// for the turnstile or the ledger lock).
	beforeWait func()
	// lockingEngine reports whether the engine that ran the hook holds a
	// lock around the create (see engineHoldsLock).
	lockingEngine func() (bool, string)
	// markerDir holds the container markers (see marker.go).
	markerDir string
	// lockBudget bounds poststop's retries of a busy ledger lock (0:
	// withdrawTimeout).
	lockBudget time.Duration
	// userNS tells the user namespace the runtime runs in
	// (runtimeUserNS): in another than the host's it sets up no device
	// cgroup.
	userNS func() RuntimeUserNS
	// readCgroup reads a /proc/<pid>/cgroup file below procRoot
	// (readCgroupFile); read only for a container that binds something
	// device-like (see noDeviceCgroup).
	readCgroup func(path string) ([]byte, error)
}

// maxPoststopBudget keeps poststop's retries inside the 30 s timeout of the
// shipped hooks.d poststop hook: a runtime that kills it first reports
// nothing the operator can act on.
const maxPoststopBudget = 20 * time.Second

// poststopBudget is how long poststop retries a busy ledger lock, for its
// release and its withdrawal together.
func (e env) poststopBudget(cfg config.Config) time.Duration {
	if e.lockBudget > 0 {
		return e.lockBudget
	}
	return min(withdrawTimeout(cfg), maxPoststopBudget)
}

// defaultEnv is the host as this process, the hook, sees it.
func defaultEnv() env {
	e := envOf(os.Getppid)
	e.processStart = func(fallback time.Time) time.Time {
		return liveness.StartedAt(liveness.DefaultProcRoot, os.Getpid(), fallback)
	}
	return e
}

// envOf is the host as a hook process whose parent getppid tells sees it.
// Everything else a hook reads of its own process is namespaced, and the
// same for any process in the hook's namespaces (which a server answering
// for another process checks, pkg/hookserve): its user namespace
// (/proc/self/uid_map, /proc/self/ns/user: runtimeUserNS, lockedByUserNS),
// its mount table (/proc/self/mountinfo), its pids and cgroups (/proc) and
// the clock.
func envOf(getppid func() int) env {
	return env{
		now:       time.Now,
		newTicker: newRealTicker,
		newTimer:  newRealTimer,
		procRoot:  liveness.DefaultProcRoot,
		getppid:   getppid,
		openGuard: openGuard,
		lockingEngine: func() (bool, string) {
			return engineHoldsLock(liveness.DefaultProcRoot, getppid())
		},
		markerDir:  markerDir,
		userNS:     func() RuntimeUserNS { return runtimeUserNS(liveness.DefaultProcRoot) },
		readCgroup: readCgroupFile,
	}
}

// run is Run without the signal handling.
func (e env) run(ctx context.Context, phase string, cfg config.Config, stdin io.Reader, stderr io.Writer) error {
	return e.runInput(ctx, phase, cfg, e.readInput(stdin), stderr)
}

// runInput is RunInput without the signal handling; it turns a panic into an
// error.
func (e env) runInput(ctx context.Context, phase string, cfg config.Config, in *Input, stderr io.Writer) (err error) {
	defer func() {
		if r := recover(); r != nil {
			if phase == PhasePoststop {
				subject, remedy := releaseRemedy(in)
				err = fmt.Errorf("hook poststop: internal error (please report this): %v; the GPUs of %s may not be released: %s", r, subject, remedy)
				return
			}
			err = fmt.Errorf("hook %s: internal error, container refused (please report this): %v", phase, r)
		}
	}()
	if err := cfg.Validate(); err != nil {
		return ConfigError(phase, in, err)
	}
	switch phase {
	case PhaseCreateRuntime:
		err = e.createRuntime(ctx, cfg, in, stderr)
	case PhasePoststop:
		err = e.poststop(ctx, cfg, in, stderr)
	default:
		return fmt.Errorf("%w (unknown phase %q)", ErrUsage, phase)
	}
	if err != nil {
		return fmt.Errorf("hook %s: %w", phase, err)
	}
	return nil
}

// ConfigError is the error of a hook phase whose configuration does not
// load or validate (err). create-runtime refuses the container: a
// configuration it cannot read must not let GPUs through. poststop runs for
// a container that has stopped already: it cannot release the container's
// GPUs, and says how to release them once the configuration is fixed. Both
// name the container (when its state could be read) and the check that says
// what is wrong, as the runtime's log may be all an operator sees.
func ConfigError(phase string, in *Input, err error) error {
	const check = "Fix the configuration (`gpu-guard-ctl check-config` says what is wrong)"
	if phase == PhasePoststop {
		subject, remedy := releaseRemedy(in)
		return fmt.Errorf("hook poststop: %s: its GPUs are not released: configuration: %w. %s, then %s", subject, err, check, remedy)
	}
	subject := "container"
	if in != nil && in.stateErr == nil && in.state.ID != "" {
		subject += " " + in.state.ID
	}
	return fmt.Errorf("hook %s: %s refused: configuration: %w. %s, then create the container again", phase, subject, err, check)
}

// releaseRemedy names the container of a poststop's input and says how an
// operator releases its GPUs when poststop could not.
func releaseRemedy(in *Input) (subject, remedy string) {
	if in == nil || in.stateErr != nil {
		return "a stopped container (its id is unknown)", "run `gpu-guard-ctl gc` (it releases holders whose processes are gone), " +
			"or `sudo gpu-guard-ctl release --container ID --reason \"poststop failed\"` (`gpu-guard-ctl claims` lists the holders)"
	}
	id := in.state.ID
	return "container " + id, fmt.Sprintf("run `sudo gpu-guard-ctl release --container %s --reason \"poststop failed\"` (or `gpu-guard-ctl gc`, which releases holders whose processes are gone)", id)
}

// createRuntime admits (or refuses) the container described by stdin.
func (e env) createRuntime(ctx context.Context, cfg config.Config, in *Input, stderr io.Writer) error {
	if in.stateErr != nil {
		return fmt.Errorf("container refused: %w", in.stateErr)
	}
	st, spec := in.state, in.spec
	if in.specErr != nil {
		return fmt.Errorf("container %s refused: %w", st.ID, in.specErr)
	}
	req := in.request
	if in.NeverClaims() {
		// The common case for a hook installed for every container: it can
		// reach no GPU under any policy or inventory. Done without reading
		// the inventory or the ledger.
		return nil
	}
	dl := e.deadlines(spec)
	if in.never {
		// It reaches no GPU but carries a ticket (Input.NeverClaims is
		// false for that alone): the ticket's GPUs are released. No
		// inventory is needed, nor read: one that does not load must not
		// refuse a container that asks for no GPU.
		e.releaseUnusedTicket(ctx, cfg, in.ticket, st.ID, dl, stderr)
		return nil
	}

	inv, invErr := loadInventory(cfg)
	phasetrace.Mark("inventory")
	if skip, err := guard.Prescreen(cfg, inv, invErr, req); err != nil {
		return fmt.Errorf("container %s refused: %w", st.ID, err)
	} else if skip {
		// The common case for a hook installed for every container: no GPU
		// named anywhere. Done without touching the ledger, unless it
		// carries a ticket, whose GPUs it would otherwise leave idle.
		if t := ticketOf(req.Env); t != "" {
			e.releaseUnusedTicket(ctx, cfg, t, st.ID, dl, stderr)
		}
		return nil
	}

	var (
		pidStart uint64
		err      error
	)
	if st.Pid > 0 {
		pidStart, err = liveness.PidStart(e.procRoot, st.Pid)
		if err != nil {
			return fmt.Errorf("container %s refused: its process %d is not readable (was it killed?): %w", st.ID, st.Pid, err)
		}
	}
	owner := OwnerFrom(st, spec, pidStart)
	// OwnerFrom's cgroup is the spec's, unverified; without a pid there is
	// no process to verify it by, and none is recorded.
	owner.Cgroup = ""
	if st.Pid > 0 {
		owner.Cgroup = e.holderCgroup(st, spec)
	}
	var self *liveness.Process
	if st.Pid > 0 {
		self = &liveness.Process{Pid: st.Pid, PidStart: pidStart}
	}

	phasetrace.Mark("pid-start")
	g, closeGuard, err := e.openGuard(cfg, inv)
	phasetrace.Mark("open-ledger")
	if err != nil {
		return fmt.Errorf("container %s refused: %w", st.ID, err)
	}
	defer closeGuard()

	if guard.ValidTicket(st.ID) {
		// The release rule gives a ticket's claim no stop and no drain
		// (guard.IsTicket): a container posing as one would have its claim
		// released at its exit whatever release_on and
		// release_requires_idle say.
		why := fmt.Sprintf("container ids of the form %s<26 lowercase letters or digits 2-7> are reserved for the tickets of "+
			"gpu-guard-ctl run; give the container another id", guard.TicketPrefix)
		actx, cancel := e.until(ctx, dl.answerBy)
		defer cancel()
		e.auditRefusal(actx, g, cfg, guard.Request{FrontEnd: ledger.FrontEndHook, Owner: owner}, guard.Decision{},
			"refused (reserved-id): "+why, stderr)
		return fmt.Errorf("container %s refused: %w: %s", st.ID, guard.ErrRejected, why)
	}

	if !cfg.Hook.Poststop && !in.optsIntoPoststop() {
		// No poststop runs ([hook] poststop = false): nothing would read a
		// marker, or remove it. The claim ends when the next request for
		// its GPU (or gc) finds this container's processes gone.
		return e.admitContainer(ctx, g, cfg, in, owner, self, dl, stderr)
	}
	// The container's marker is written before anything of it is written
	// to the ledger, so that its poststop reads the ledger whatever its
	// config.json says by then (see marker.go). Without it the claim still
	// stands; only that protection is lost, and said.
	mk := newMarker(e.markerDir, st, cfg.Ledger.Dir)
	if err := mk.write(); err != nil {
		if !e.poststopFindsClaim(in) {
			// Its poststop would skip the ledger (it reaches GPUs only
			// through what no device cgroup stops, which a stopped
			// container's spec does not show): a claim made now would
			// outlive it.
			return fmt.Errorf("container %s refused: %w (its poststop needs the marker to release the GPUs it reaches "+
				"without a device cgroup; fix the marker directory, or run the container in a device cgroup of its own)", st.ID, err)
		}
		_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: container %s: %v; its poststop will go by its config.json alone "+
			"(should that be edited to name no GPU before the container is deleted, run `sudo gpu-guard-ctl release --container %s --reason \"config.json edited\"` after)\n",
			ledger.ShortID(st.ID), err, st.ID)
	}
	err = e.admitContainer(ctx, g, cfg, in, owner, self, dl, stderr)
	if err == nil {
		// A remover may have taken the marker away between its write and
		// the claim's commit: it is put back (see marker.go).
		_ = mk.ensure()
		return nil
	}
	// Refused, or failed: this container has nothing in the ledger (unless
	// a withdrawal failed) and, under podman, gets no poststop. Its marker
	// goes, unless the ledger still shows the id.
	// With no marker removed (its write failed) there is nothing to settle,
	// and no ledger read to make.
	if !mk.remove() {
		return err
	}
	holds, waits := true, true
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.Ledger.LockTimeout.Duration)
	defer cancel()
	if snap, serr := g.Ledger().Snapshot(sctx); serr == nil {
		holds, waits = appears(snap, st.ID)
	}
	settleMarker(mk, true, holds || waits, nil)
	return err
}

// admitContainer is create-runtime once the ledger is open: the ticket's
// hand-over, or the decision (at once, or waiting with --wait).
func (e env) admitContainer(ctx context.Context, g guardAPI, cfg config.Config, in *Input, owner ledger.Owner,
	self *liveness.Process, dl hookDeadlines, stderr io.Writer) error {
	st, req := in.state, in.request
	// Everything below, the ticket's hand-over included, decides by
	// dl.decideBy: a runtime that kills the hook at its timeout refuses the
	// container with a bare kill, its exit code and the guard's words lost.
	dctx, cancel := e.until(ctx, dl.decideBy)
	defer cancel()
	if t := ticketOf(req.Env); t != "" {
		if done, err := e.useTicket(dctx, g, cfg, t, owner, req, dl, stderr); done || err != nil {
			return err
		}
	}
	greq := guard.Request{FrontEnd: ledger.FrontEndHook, Owner: owner, Key: st.ID, Spec: req}
	if !e.opts.Wait {
		return e.decide(dctx, g, cfg, greq, dl.answerBy, stderr)
	}
	// The runtime kills a hook at its definition's timeout, counted from
	// the hook's start: a --wait hook stops waiting hookAnswerMargin
	// before, so that the container is refused with the guard's words (and
	// leaves the queue) rather than by a bare kill, and no single ledger
	// write (each may wait for the turnstile and the lock) runs past that.
	kill := dl.kill
	if kill > 0 && kill <= hookAnswerMargin {
		// Too short to wait at all: decide as a hook without --wait does
		// (admit, or refuse with the queue position, leaving no waiter),
		// answering hookExitReserve before the kill (dl.decideBy) rather
		// than waiting hook.wait_timeout into it.
		err := e.decide(dctx, g, cfg, greq, dl.answerBy, stderr)
		if err != nil {
			_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: container %s: deciding without waiting although --wait is set: "+
				"the timeout of this hook in the container's config.json (%s) leaves no time to wait (it must exceed %s)\n",
				ledger.ShortID(st.ID), kill, hookAnswerMargin)
		}
		return err
	}
	// Waiting is for GPUs that are busy. Free ones are claimed as by a hook
	// that does not wait (one transaction that writes nothing unless it
	// admits), before anything a wait needs is set up; any other answer,
	// or an error, goes the waiting way, which decides again.
	if d, err := g.AdmitIfFree(dctx, greq); err == nil && (d.Result == guard.Admit || d.Result == guard.Skip) {
		return nil
	}
	if e.lockingEngine != nil {
		if locked, why := e.lockingEngine(); locked {
			_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: container %s: deciding without waiting although --wait is set: %s\n", ledger.ShortID(st.ID), why)
			return e.decide(dctx, g, cfg, greq, dl.answerBy, stderr)
		}
	}

	w := e.newQueueWait(g, cfg, greq, stderr)
	w.gone = e.goneCheck(self)
	w.started = dl.started
	// Every refusal leaves a refuse record, as without --wait (crun shows
	// only the exit code): but those the guard's transaction records
	// itself (Decision.Audited). ctx bounds the record: see queueWait.run.
	w.onRefuse = func(ctx context.Context, d guard.Decision, reason string) {
		if d.Audited {
			return
		}
		e.auditRefusal(ctx, g, cfg, greq, d, reason, stderr)
	}
	if kill > 0 {
		w.killAt = dl.killAt
		if limit := kill - hookAnswerMargin; limit < w.waitTimeout {
			w.waitTimeout = limit
			w.timeoutKey = fmt.Sprintf("the timeout of this hook in the container's config.json (%s, less %s to answer)", kill, hookAnswerMargin)
		}
	}
	if e.beforeWait != nil {
		e.beforeWait()
	}
	return w.run(ctx)
}

// hookDeadlines are the deadlines of one create-runtime hook, counted, as
// the runtime counts its hook timeout, from the hook's start. kill is zero
// when the hook's own timeout is unknown (its definition gives none: nothing
// kills it); then the other times are zero too, and each ledger write is
// bounded by its own retry budget alone.
type hookDeadlines struct {
	started time.Time
	// kill is the hook's own timeout (ownHookTimeout), killAt when the
	// runtime kills it.
	kill   time.Duration
	killAt time.Time
	// decideBy ends the deciding (the ticket's hand-over, the admission,
	// a wait): hookAnswerMargin before the kill, leaving the rest to the
	// refusal's record and the withdrawal; for a timeout that leaves no
	// such margin, answerBy.
	decideBy time.Time
	// answerBy ends every ledger write: hookExitReserve before the kill,
	// so that the hook exits with its code and its words before it.
	answerBy time.Time
}

// deadlines reads the hook's own timeout from spec (see ownHookTimeout) and
// places its deadlines from the hook's start (opts.Started, or now; where
// the hook has a timeout, its process's start if that was earlier:
// processStart).
func (e env) deadlines(spec *specs.Spec) hookDeadlines {
	dl := hookDeadlines{started: e.opts.Started}
	if dl.started.IsZero() {
		dl.started = e.now()
	}
	kill, ok := ownHookTimeout(spec, e.opts.Wait)
	if !ok {
		return dl
	}
	if e.processStart != nil {
		dl.started = e.processStart(dl.started)
	}
	dl.kill = kill
	dl.killAt = dl.started.Add(kill)
	dl.answerBy = dl.killAt.Add(-hookExitReserve)
	dl.decideBy = dl.answerBy
	if kill > hookAnswerMargin {
		dl.decideBy = dl.killAt.Add(-hookAnswerMargin)
	}
	return dl
}

// until is ctx with deadline t, read on e's clock (zero t: ctx as it is).
// A deadline already passed gives a context that is done.
func (e env) until(ctx context.Context, t time.Time) (context.Context, context.CancelFunc) {
	if t.IsZero() {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, t.Sub(e.now()))
}

// ahead reports, on e's clock, whether t (zero: none) is still to come.
func (e env) ahead(t time.Time) func() bool {
	return func() bool { return t.IsZero() || e.now().Before(t) }
}

// runtimeScopePrefixes are the prefixes runtimes and engines put before a
// container's id in the name of the cgroup they create for it
// (<prefix>-<id>, or <prefix>-<id>.scope under systemd). "libpod-payload"
// is podman's --cgroups=split (quadlet's default), whose container runs in
// libpod-payload-<id> below the service's cgroup. The empty prefix is a
// systemd cgroupsPath "<slice>::<id>", which runc and crun name
// "-<id>.scope" (liveness.CgroupPath): it matches a leaf "-<id>" only.
var runtimeScopePrefixes = []string{"runc", "crun", "runsc", "youki", "libpod", "libpod-payload", "crio", "cri-containerd", "docker", "nerdctl", ""}

// namesContainer reports whether a cgroup's leaf is container id's own by
// its name: the id ("/train", runc's cgroupfs default; "train.scope") or
// <runtime prefix>-<id>[.scope] ("runc-train.scope" under systemd). A leaf
// that merely ends in "-<id>" is not: the login session "session-3.scope"
// or the transient unit "run-u12.scope" would pass for containers "3" and
// "u12".
func namesContainer(leaf, id string) bool {
	if id == "" {
		return false
	}
	leaf = strings.TrimSuffix(leaf, ".scope")
	if leaf == id {
		return true
	}
	prefix, ok := strings.CutSuffix(leaf, "-"+id)
	return ok && slices.Contains(runtimeScopePrefixes, prefix)
}

// holderCgroup is the cgroup recorded for the container st describes, so
// that its liveness and the GPU observer can tell its processes; "" for
// none, which the liveness check answers by the pid and its start time.
//
// The spec's cgroupsPath is recorded only when the container's process is
// in it (inCgroup): it is written by whoever creates the container, and a
// runtime that creates no cgroup leaves the process where its caller was
// (crun --cgroup-manager=disabled, rootless runc without delegation). Named
// there, any existing cgroup without processes would read as "exited"
// while the process runs, and its claim would be released to the next
// container. Otherwise (no cgroupsPath: runc run puts the container in a
// cgroup named after its id; or one the process is not in) the cgroup the
// process is in is recorded when it is the container's own (ownCgroup): a
// process left in its caller's cgroup shares it, and a shared cgroup would
// never read as exited. When the process's cgroup cannot be read nothing is
// recorded: an unverified cgroup could release a running holder's claim, a
// missing one cannot.
//
// Read only for a container that claims a GPU: create-runtime answers the
// others before this.
func (e env) holderCgroup(st specs.State, spec *specs.Spec) string {
	cg, err := liveness.ProcessCgroup(e.procRoot, st.Pid)
	if err != nil {
		return ""
	}
	if v := verifiedCgroup(cg, st.ID, specCgroup(spec)); v != "" {
		return v
	}
	if e.ownCgroup(cg, st.ID) {
		return guard.BoundCgroup(cg)
	}
	return ""
}

// ownCgroup reports whether cgroup cg, the one container id's process is
// in, is the container's own: its leaf names the container
// (namesContainer), and it is neither the cgroup of the runtime that ran
// this hook (its parent) nor one above it, which the container's process
// would share with the runtime and whatever else runs there. When the
// runtime's cgroup cannot be read it is not.
func (e env) ownCgroup(cg, id string) bool {
	// Asked first: a leaf that names another spares the runtime's read.
	if !namesContainer(path.Base(cg), id) {
		return false
	}
	rt, err := liveness.ProcessCgroup(e.procRoot, e.getppid())
	if err != nil {
		return false
	}
	return ownedCgroup(cg, rt, id)
}

// ownedCgroup reports whether cgroup cg, the one container id's process is
// in, is the container's own given rt, the cgroup of the runtime that ran
// this hook in the same hierarchy: cg or a cgroup above it names the
// container (namesContainer: crun's systemd driver runs the process in a
// "container" cgroup below its libpod-<id>.scope or crio-<id>.scope, whose
// rules apply below it), and neither cg nor that one is rt or above rt
// (the container's process would share it with the runtime and whatever
// else runs there).
func ownedCgroup(cg, rt, id string) bool {
	cg, rt = path.Clean(cg), path.Clean(rt)
	if cg == "/" || cg == "." || cg == rt || strings.HasPrefix(rt, cg+"/") {
		return false
	}
	for p := cg; p != "/" && p != "."; p = path.Dir(p) {
		if namesContainer(path.Base(p), id) {
			return p != rt && !strings.HasPrefix(rt, p+"/")
		}
	}
	return false
}

// hookAnswerMargin is kept between the end of a --wait and the runtime's
// kill at the hook's timeout, for the refusal and the withdrawal; the
// withdrawal may take all of it but hookExitReserve.
const (
	hookAnswerMargin = 2 * time.Second
	hookExitReserve  = 500 * time.Millisecond
)

// maxHookTimeout is the largest hook timeout, in seconds, taken as a bound.
const maxHookTimeout = math.MaxInt32

// ownHookTimeout finds, in the container's spec as ReadInput read it (one
// bounded read of a regular config.json: the file is never opened again),
// the timeout of the createRuntime hook that runs this program, with --wait
// when wait is set and without it otherwise: how long after the hook's
// start the runtime kills it. ok is false when there is none. Both plain
// runc's config.json hooks and hooks.d definitions reach the spec this way:
// podman and CRI-O copy a hooks.d definition, its timeout included, into the
// config.json the runtime (which enforces the timeout) reads. A --wait
// timeout of hookAnswerMargin or less leaves no time to wait: such a hook
// decides at once (see admitContainer).
func ownHookTimeout(spec *specs.Spec, wait bool) (timeout time.Duration, ok bool) {
	if spec == nil || spec.Hooks == nil {
		return 0, false
	}
	for _, h := range spec.Hooks.CreateRuntime {
		// Past maxHookTimeout it bounds nothing (and would overflow).
		if h.Timeout == nil || *h.Timeout <= 0 || *h.Timeout > maxHookTimeout || !strings.HasPrefix(filepath.Base(h.Path), "nri-gpu-guard") ||
			slices.Contains(h.Args, "--wait") != wait {
			continue
		}
		return time.Duration(*h.Timeout) * time.Second, true
	}
	return 0, false
}

// newQueueWait builds the FIFO wait of one request: the hook's --wait and
// gpu-guard-ctl run wait the same way, polling the ledger lock-free, asking
// the guard's release rule about holders and dropping dead waiters ahead.
func (e env) newQueueWait(g guardAPI, cfg config.Config, req guard.Request, stderr io.Writer) *queueWait {
	w := &queueWait{
		g:               g,
		req:             req,
		stderr:          stderr,
		pollInterval:    cfg.Hook.PollInterval.Duration,
		waitTimeout:     cfg.Hook.WaitTimeout.Duration,
		withdrawTimeout: withdrawTimeout(cfg),
		procRoot:        e.procRoot,
		now:             e.now,
		newTicker:       e.newTicker,
		newTimer:        e.newTimer,
		watch: &watcher{
			snapshot:     g.Ledger().Snapshot,
			committed:    g.Ledger().Committed,
			releasable:   releasableFor(guard.NewReleaseRule(cfg, liveness.New("", e.procRoot)), req.Owner),
			now:          e.now,
			queueTTL:     cfg.Policy.QueueTTL.Duration,
			refreshEvery: refreshInterval(cfg),
		},
	}
	w.dropDead = func(ctx context.Context, want []devices.Device, budget time.Duration) bool {
		return dropDeadWaiters(ctx, g, g.Ledger().Snapshot, e.procRoot, req.Key, want, budget)
	}
	return w
}

// releasableFor binds the release rule to the waiter requester, as its
// Admit applies it: an earlier incarnation of its own container is judged
// without its process (guard.ReleaseRule.CheckFor).
func releasableFor(rule guard.ReleaseRule, requester ledger.Owner) func(ledger.Owner) guard.Verdict {
	return func(o ledger.Owner) guard.Verdict { return rule.CheckFor(o, requester) }
}

// goneCheck returns the test a waiting hook runs before every retry: its
// container's process must still be the one the state named (same pid, same
// start time, not a zombie), and the runtime that ran the hook must still be
// its parent. Either failing means nobody will start this container: a
// runtime killed with SIGKILL never reaps or answers its hooks. self is nil
// when the state names no process; then only the runtime is watched.
func (e env) goneCheck(self *liveness.Process) func() (bool, string) {
	ppid := e.getppid()
	checker := liveness.New("", e.procRoot)
	return func() (bool, string) {
		if now := e.getppid(); now != ppid {
			return true, fmt.Sprintf("the runtime that ran the hook (pid %d) is gone", ppid)
		}
		if self != nil {
			if exited, why := checker.Exited(*self); exited {
				return true, "its process: " + why
			}
		}
		return false, ""
	}
}

// poststop releases everything the container holds and drops any waiter
// entry it left (a create-runtime hook killed with SIGKILL cannot withdraw).
// Both are idempotent: a container that held nothing succeeds. A claim or
// queue entry of the same id whose recorded process still runs is another
// container's (ids are unique only per runtime root) and is kept; that is
// decided under the ledger lock (guard.RemovedExited, WithdrawExited).
//
// Most containers hold nothing. One whose spec names no GPU in any way a
// configuration could turn into a claim (Input.NeverClaims) is done without
// opening the ledger: its create-runtime hook never wrote there. For the
// others (and when the bundle cannot be read) a lock-free read of the ledger
// tells, and only a container that appears in it takes the ledger lock. The
// read cannot miss a claim of this container: its create-runtime hook ended
// (or was killed and reaped by the runtime) before the runtime ran poststop.
func (e env) poststop(ctx context.Context, cfg config.Config, in *Input, stderr io.Writer) error {
	if in.stateErr != nil {
		subject, remedy := releaseRemedy(in)
		return fmt.Errorf("%w; the GPUs of %s are not released: %s", in.stateErr, subject, remedy)
	}
	st := in.state
	mk := newMarker(e.markerDir, st, cfg.Ledger.Dir)
	if in.reachesNoGPU() && !mk.exists() {
		return nil
	}
	// Releasing needs no inventory: it must work even when the GPU set
	// changed or the cache is gone.
	g, closeGuard, err := e.openGuard(cfg, emptyInventory())
	phasetrace.Mark("open-ledger")
	if err != nil {
		return fmt.Errorf("container %s: cannot release its GPUs (run `gpu-guard-ctl gc` or `gpu-guard-ctl release --container %s --reason \"poststop failed\"`): %w", st.ID, st.ID, err)
	}
	defer closeGuard()
	// The marker goes before the ledger is read, and comes back if what
	// follows leaves anything of the id in the ledger that is not settled
	// (another container of the id still runs, or a write failed): see
	// marker.go.
	removed := mk.remove()
	keep := false
	defer func() {
		report := func(err error) {
			_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: hook poststop: container %s: %v\n", st.ID, err)
		}
		settleMarker(mk, removed, keep, report)
		if cwdBundle(st.Bundle) && !keep {
			// `crun delete` of a container crun 1.8 gave the bundle "/"
			// (readSpecOf): its marker is named after the bundle crun was
			// given at create, which delete's command line does not name.
			// The id's markers that the ledger does not show go, as gc's
			// sweep removes them (put back if the id shows by then).
			if _, err := sweepMarkers(ctx, mk.dir, cfg.Ledger.Dir, st.ID, g.Ledger().Snapshot); err != nil {
				report(err)
			}
		}
	}()
	// What the lock-free read shows decides which writes are needed: a
	// container that only held GPUs has no queue entry to drop, and one that
	// only waited holds nothing. Each skipped write is a lock cycle saved.
	// Unreadable, both run.
	holds, waits := true, true
	snap, err := g.Ledger().Snapshot(ctx)
	phasetrace.Mark("lock-free-read")
	if err == nil {
		holds, waits = appears(snap, st.ID)
		if !holds && !waits {
			return nil
		}
	}
	owner := ledger.Owner{ContainerID: st.ID, FrontEnd: ledger.FrontEndHook}
	// Which claims and queue entry of this id are this container's is
	// decided under the ledger lock, never from the read above: another
	// container may run under the same id (another runtime root or
	// containerd namespace) and may have been admitted since. One whose
	// recorded process (pid and start time) still runs is that other
	// container's: this container's processes are gone by poststop.
	runs := func(o ledger.Owner) bool { return liveness.Running(e.procRoot, o.Pid, o.PidStart) }
	// A busy lock is waited for as create-runtime waits for it: under
	// release_on = "remove" little else ends these claims (the container is
	// gone: no later event names it, and gc or the next request end an
	// exited holder's claim there only where [hook] runtime_roots shows
	// that its runtime deleted it). One budget for both writes, inside the
	// hook's own timeout.
	deadline := time.Now().Add(e.poststopBudget(cfg))
	var errs []error
	if holds {
		var others []ledger.Claim
		err := retryLocked(ctx, time.Until(deadline), func(ctx context.Context) error {
			var err error
			others, err = g.RemovedExited(ctx, owner, runs)
			return err
		})
		if err != nil && !errors.Is(err, ledger.ErrNotFound) {
			errs = append(errs, fmt.Errorf("release the GPUs of container %s (%s): %w", st.ID, guard.ReleaseAdvice(cfg, st.ID), err))
		}
		for _, c := range others {
			keep = true
			_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: hook poststop: container %s: %s not released: it is held by pid %d, which still runs: "+
				"another container with the same id\n", st.ID, naming.Device(c.Device), c.Owner.Pid)
		}
	}
	if waits {
		var kept bool
		err := retryLocked(ctx, time.Until(deadline), func(ctx context.Context) error {
			var err error
			kept, err = g.WithdrawExited(ctx, st.ID, "container removed", runs)
			return err
		})
		if err != nil && !errors.Is(err, ledger.ErrNotFound) {
			errs = append(errs, fmt.Errorf("drop the queue entry of container %s: %w", st.ID, err))
		}
		if kept {
			keep = true
			_, _ = fmt.Fprintf(stderr, "nri-gpu-guard: hook poststop: container %s: its queue entry is kept: the process it records still runs: "+
				"another container with the same id waits\n", st.ID)
		}
	}
	keep = keep || len(errs) > 0
	return errors.Join(errs...)
}

// appears reports whether container id holds a claim or has a conflict
// record in st (holds), and whether it waits in the queue (waits).
func appears(st ledger.State, id string) (holds, waits bool) {
	for _, c := range st.Claims {
		if c.Owner.ContainerID == id {
			holds = true
			break
		}
	}
	for _, c := range st.Conflicts {
		if c.Owner.ContainerID == id {
			holds = true
			break
		}
	}
	for _, w := range st.Waiters {
		if w.Key == id || w.Owner.ContainerID == id {
			waits = true
			break
		}
	}
	return holds, waits
}

// refreshInterval is how long a waiting hook may go without an Admit when
// nothing changes: a quarter of queue_ttl and of reservation_ttl (so that a
// live waiter is never dropped, nor is the head of the queue, whose
// reservations on part of its request stand while it waits for the rest
// and lapse with their waiter if not renewed in time), at most maxRefresh,
// at least one poll.
func refreshInterval(cfg config.Config) time.Duration {
	d := min(cfg.Policy.QueueTTL.Duration/4, maxRefresh)
	if r := cfg.Policy.ReservationTTL.Duration; r > 0 {
		d = min(d, r/4)
	}
	return max(d, cfg.Hook.PollInterval.Duration)
}

// withdrawTimeout bounds the Withdraw of a hook that gives up: a lock timeout
// is retried within it (see withdrawReliably), so that a hook leaves the
// queue even when many others contend for the ledger at the same moment.
func withdrawTimeout(cfg config.Config) time.Duration {
	return max(10*cfg.Ledger.LockTimeout.Duration, 10*time.Second)
}

// openGuard opens the host ledger and builds the guard the NRI front end also
// uses, so that both front ends decide with one policy over one ledger.
func openGuard(cfg config.Config, inv *devices.Inventory) (guardAPI, func(), error) {
	return openGuardWith(cfg, inv, nil)
}

// openGuardWith is openGuard whose guard calls beforeWait (if set) before it
// waits for the turnstile or for a ledger lock another process holds.
func openGuardWith(cfg config.Config, inv *devices.Inventory, beforeWait func()) (guardAPI, func(), error) {
	opts := guard.LedgerOptions(cfg)
	opts.BeforeLockWait = beforeWait
	led, err := ledger.Open(cfg.Ledger.Dir, opts)
	if err != nil {
		return nil, nil, fmt.Errorf("open the GPU ledger in %s: %w", cfg.Ledger.Dir, err)
	}
	g, err := guard.New(guard.Options{
		Config:    cfg,
		Inventory: inv,
		Ledger:    led,
	})
	if err != nil {
		led.Close()
		return nil, nil, fmt.Errorf("start the GPU guard: %w", err)
	}
	// Sleeping in the turnstile costs nothing, so it may take longer than one
	// ledger lock attempt: a burst of n hooks queues there for n writes.
	return lineUp(g, turnstile{path: filepath.Join(cfg.Ledger.Dir, turnstileName), timeout: 3 * cfg.Ledger.LockTimeout.Duration,
		beforeWait: beforeWait}), led.Close, nil
}
